"""KL and top-1 at every generated position: the optimized configuration decodes the baseline's tokens."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_transformers_opt.verdict.baselines import StoredBaseline, similarity_against_stored
from pytest_transformers_opt.engine.generation import ForceTokens
from pytest_transformers_opt.verdict.results import SideMetrics
from pytest_transformers_opt.verdict.similarity import PREFIX_ONLY_NOTE, compare_runs


def test_force_tokens_forces_each_row_at_its_step_and_leaves_exhausted_rows() -> None:
    force = ForceTokens([[2, 0], [1]], prompt_length=3)  # row 1's baseline stopped after one token
    scores = torch.tensor([[0.5, 3.0, 1.0, -1.0], [4.0, 0.0, 1.0, 2.0]])
    original = scores.clone()
    step0 = force(torch.zeros(2, 3, dtype=torch.long), scores)
    assert step0.argmax(-1).tolist() == [2, 1]
    assert step0[0, 2] == 0.0 and torch.isinf(step0[0, [0, 1, 3]]).all()
    assert torch.equal(scores, original)  # generate's own scores tensor is not written to
    step1 = force(torch.zeros(2, 4, dtype=torch.long), scores)  # the step is read from input_ids' length
    assert step1.argmax(-1).tolist() == [0, 0] and torch.equal(step1[1], original[1])
    assert force(torch.zeros(2, 5, dtype=torch.long), scores) is scores  # past every row: untouched


def _lp(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log_softmax(-1)


def test_forced_distributions_cover_every_position_live_and_stored() -> None:
    base = _lp([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    base_tokens = [[0, 1, 2, 0]]
    free_tokens = [[0, 0, 2, 2]]  # diverged at step 1: the free run's later contexts differ
    free = _lp([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0], [9.0, 0.0, 0.0], [9.0, 0.0, 0.0]])
    forced = base.clone()
    forced[1] = _lp([[5.0, 0.0, 0.0]])[0]  # at the baseline's contexts only step 1 differs
    prefix_only = compare_runs(base_tokens, free_tokens, 4, [base], [free])
    assert prefix_only.compared_steps == 2 and prefix_only.note == PREFIX_ONLY_NOTE
    every = compare_runs(base_tokens, free_tokens, 4, [base], [free], forced_logprobs=[forced])
    assert every.token_match == prefix_only.token_match == 0.25  # tokens still from the free run
    assert every.compared_steps == 4 and every.note is None
    assert every.top1 == 0.75 and every.kl_mean == pytest.approx(every.kl_max / 4)
    side = SideMetrics(ttft_s=0.01, tpot_s=0.002, latency_s=0.5, throughput_tok_s=24.0, peak_memory_bytes=2 ** 30,
                       tokens_generated=4, rounds=1, texts=["a"])
    stored = StoredBaseline.build(model="m", revision=None, dtype="float32", baseline_techniques=["eager"],
                                  workload={"prompts": ["p"], "max_new_tokens": 4, "batch_size": 1},
                                  tokens=base_tokens, logprobs=[base.float()], measurements=side,
                                  environment={}, texts=["a"], k=3)
    estimate = similarity_against_stored(stored, free_tokens, [free.float()], 4, [forced.float()])
    assert estimate.compared_steps == 4 and estimate.top1 == 0.75
    assert estimate.kl_max == pytest.approx(every.kl_max, rel=1e-5)  # k = vocab: the estimate is exact
    assert PREFIX_ONLY_NOTE in similarity_against_stored(stored, free_tokens, [free.float()], 4).note


# A test-only technique: at decode step STEP of every generate call it swaps the two highest logits
# (an lm_head hook, so it changes the raw distributions as a real lossy technique would). The free
# run diverges there; decoding the baseline's tokens, every other position is the baseline's own.
CONFTEST = '''
import contextlib
from pytest_transformers_opt.techniques import Technique

STEP = 2

class SwapAtStep(Technique):
    name = "swap_at_step"
    family = "generation"
    summary = "test only: swaps the top-2 logits at one decode step"

    @contextlib.contextmanager
    def around_generate(self, model):
        calls = [0]

        def hook(module, args, output):
            calls[0] += 1
            if calls[0] != STEP + 1:  # the prefill gives step 0's scores, each decode call one more
                return output
            output = output.clone()
            last = output[:, -1, :]
            top = last.topk(2, dim=-1).indices
            first, second = last.gather(-1, top[:, :1]), last.gather(-1, top[:, 1:])
            last.scatter_(-1, top[:, :1], second)
            last.scatter_(-1, top[:, 1:], first)
            return output

        handle = model.lm_head.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

def pytest_opt_register_techniques(registry):
    registry.register(SwapAtStep)
'''

USER_TESTS = '''
import pytest

LOOSE = dict(max_kl=10.0, min_token_match=0.0, min_top1=0.0)

@pytest.mark.optimization("swap_at_step", **LOOSE)
def test_swap_one_prompt(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=6)

@pytest.mark.optimization("swap_at_step", **LOOSE)
def test_swap_default_prompts(opt_bench):
    opt_bench(max_new_tokens=6)

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=6)
'''

FORCED_NOTE = "KL and top-1 from a forced run"


def _forced_notes(entry: dict) -> list[str]:
    return [n for n in entry["notes"] if FORCED_NOTE in n]


def test_an_early_divergence_is_compared_at_every_position(run_user, tmp_path) -> None:
    store = tmp_path / "baselines"
    live = run_user(USER_TESTS, "--opt-rounds=1", "--opt-warmup=0", f"--opt-baselines={store}",
                    "--opt-update-baselines", conftest=CONFTEST)
    live.result.assert_outcomes(passed=3)
    stored = run_user(USER_TESTS, "--opt-rounds=1", "--opt-warmup=0", f"--opt-baselines={store}")
    stored.result.assert_outcomes(passed=3)
    for run, where in ((live, "live"), (stored, "stored")):
        one = run.test("test_swap_one_prompt")
        sim = one["similarity"]
        # free run: the tokens part at step 2; forced run: all 6 positions, only step 2 differs
        assert sim["token_match"] == pytest.approx(2 / 6), (where, sim)
        assert sim["compared_steps"] == 1 * 6, (where, sim)
        assert sim["top1"] == pytest.approx(5 / 6), (where, sim)
        assert sim["kl_max"] > 0.0 and sim["kl_mean"] == pytest.approx(sim["kl_max"] / 6, rel=1e-4), (where, sim)
        assert _forced_notes(one), (where, one["notes"])
        many = run.test("test_swap_default_prompts")
        prompts = len(many["workload"]["prompts"])
        assert prompts > 1
        assert many["similarity"]["compared_steps"] == prompts * 6, (where, many["similarity"])
        assert many["similarity"]["top1"] == pytest.approx(1 - 1 / 6), (where, many["similarity"])
        assert many["similarity"]["token_match"] == pytest.approx(2 / 6), (where, many["similarity"])
        lossless = run.test("test_sdpa")  # the same tokens: the free run's distributions, no forced run
        assert lossless["similarity"]["token_match"] == 1.0
        assert lossless["similarity"]["compared_steps"] == prompts * 6
        assert not _forced_notes(lossless), lossless["notes"]
    assert any("stored baseline" in n for n in stored.test("test_swap_one_prompt")["notes"])
    live_kl = live.test("test_swap_one_prompt")["similarity"]["kl_max"]
    assert math.isclose(stored.test("test_swap_one_prompt")["similarity"]["kl_max"], live_kl, rel_tol=1e-3)


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is not available")
def test_tensor_parallel_ranks_decode_the_baselines_tokens() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pytest_transformers_opt.engine.tensor_parallel import run_tensor_parallel
    from pytest_transformers_opt.engine.tiny_models import ensure_tiny_model

    path, prompts, new_tokens = str(ensure_tiny_model("tiny-random-llama")), ["Hello there", "The cat sat on"], 5
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)

    def generate(force: list[list[int]] | None) -> tuple[list[list[int]], torch.Tensor]:
        processors = [ForceTokens(force, encoded["input_ids"].shape[1])] if force else []
        with torch.inference_mode():
            out = model.generate(**encoded, max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                 pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True,
                                 output_logits=True, logits_processor=processors)
        return out.sequences[:, encoded["input_ids"].shape[1]:].tolist(), torch.stack(out.logits, 1).log_softmax(-1)

    free, _ = generate(None)
    baseline = [list(t) for t in free]
    baseline[0][1] = (baseline[0][1] + 1) % model.config.vocab_size  # a baseline that differs from step 1 on
    forced_tokens, expected = generate(baseline)
    assert forced_tokens == baseline
    tp = run_tensor_parallel(path, dtype="float32", tp_size=2, prompts=prompts, max_new_tokens=new_tokens,
                             batch_size=len(prompts), rounds=1, warmup=0, device_type="cpu", timeout_s=240,
                             force_tokens=baseline)
    assert tp.tokens == free  # the free run is untouched
    assert tp.forced_logprobs is not None and all(r["forced_run"] for r in tp.per_rank)
    for mine, ref in zip(tp.forced_logprobs, expected):
        assert mine.shape == ref.shape == (new_tokens, model.config.vocab_size)
        assert torch.allclose(mine, ref, atol=1e-4), (mine - ref).abs().max()
