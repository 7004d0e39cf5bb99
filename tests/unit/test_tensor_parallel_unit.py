"""tensor_parallel for real on CPU: two torchrun ranks over gloo, compared with one process."""

from __future__ import annotations

import os
import re
import time
from types import SimpleNamespace

import pytest
import torch

from pytest_transformers_opt.engine.measure import RoundTiming
from pytest_transformers_opt.engine.tensor_parallel import TensorParallelRun, TensorParallelUnavailable, run_tensor_parallel
from pytest_transformers_opt.techniques.parallel import tensor_parallel_probe
from pytest_transformers_opt.engine.tiny_models import ensure_tiny_model

PROMPTS = ["Hello there", "The cat sat on the mat and", "Explain gravity in one sentence."]
NEW_TOKENS = 6

needs_gloo = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


@pytest.fixture(scope="module")
def tiny_path() -> str:
    return str(ensure_tiny_model("tiny-random-llama"))


@pytest.fixture(scope="module")
def tp_run(tiny_path: str) -> TensorParallelRun:
    return run_tensor_parallel(tiny_path, dtype="float32", tp_size=2, prompts=PROMPTS, max_new_tokens=NEW_TOKENS,
                               batch_size=len(PROMPTS), rounds=2, warmup=1, device_type="cpu", timeout_s=240)


@pytest.fixture(scope="module")
def single_process(tiny_path: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The same workload in this process, unsharded: the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32, attn_implementation="eager").eval()
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(**encoded, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                             pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[:, encoded["input_ids"].shape[1]:].tolist()
    logprobs = torch.stack(out.logits, dim=1).float().log_softmax(dim=-1)
    return tokens, [logprobs[i] for i in range(len(PROMPTS))]


@needs_gloo
def test_two_ranks_shard_the_weights(tp_run: TensorParallelRun) -> None:
    assert tp_run.world_size == 2 and tp_run.tp_size == 2
    assert len(tp_run.per_rank) == 2 and [r["rank"] for r in tp_run.per_rank] == [0, 1]
    assert len(tp_run.sharded_params) == 2 and all(n > 0 for n in tp_run.sharded_params)
    for report in tp_run.per_rank:
        assert report["backend"] == "gloo" and report["model_tp_size"] == 2
        # each rank holds about half of the weights
        assert report["local_param_bytes"] < 0.75 * report["full_param_bytes"]
        example = report["example_shard"]
        assert example["local_shape"] != example["full_shape"]
    assert "distributed_config" in tp_run.per_rank[0]["from_pretrained_kwargs"]
    assert tp_run.problem() is None and tp_run.tokens_agree


@needs_gloo
def test_tokens_match_a_single_process(tp_run: TensorParallelRun, single_process) -> None:
    ref_tokens, ref_logprobs = single_process
    assert [len(t) for t in tp_run.tokens] == [NEW_TOKENS] * len(PROMPTS)  # EOS never stops it
    assert tp_run.tokens == ref_tokens
    assert tp_run.texts and len(tp_run.texts) == len(PROMPTS)
    assert tp_run.logprobs is not None and len(tp_run.logprobs) == len(PROMPTS)
    for mine, ref in zip(tp_run.logprobs, ref_logprobs):
        assert mine.shape == ref.shape
        # sharded matmuls sum in another order: equal up to float32 rounding
        assert torch.allclose(mine, ref, atol=1e-4), (mine - ref).abs().max()


@needs_gloo
def test_timings_and_memory_are_measured(tp_run: TensorParallelRun) -> None:
    assert len(tp_run.rounds) == 2 and all(isinstance(r, RoundTiming) for r in tp_run.rounds)
    for timing in tp_run.rounds + [tp_run.verification]:
        assert timing.latency_s > 0 and timing.total_s >= timing.latency_s * 0.99
        assert timing.ttft_s is not None and 0 < timing.ttft_s < timing.latency_s
        assert timing.steps == NEW_TOKENS and timing.tokens == NEW_TOKENS * len(PROMPTS)
        assert timing.tpot_s is not None and timing.tpot_s > 0
    assert len(tp_run.warmup_s) == 1 and tp_run.warmup_s[0] > 0
    assert tp_run.load_time_s > 0 and tp_run.wall_s > tp_run.load_time_s
    assert tp_run.peak_memory_bytes is not None and tp_run.peak_memory_bytes > 0
    assert tp_run.peak_memory_bytes == max(r["peak_memory_bytes"] for r in tp_run.per_rank)
    timings = tp_run.timings()
    assert timings.latency_s and timings.ttft_s and timings.throughput_tok_s and timings.tokens == 18
    assert tp_run.threads_per_rank == max(1, (os.cpu_count() or 1) // 2)


@needs_gloo
def test_a_failing_rank_is_named(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(RuntimeError) as info:
        run_tensor_parallel(str(missing), dtype="float32", tp_size=2, prompts=["Hello"], max_new_tokens=2,
                            batch_size=1, rounds=1, warmup=0, timeout_s=120)
    message = str(info.value)
    assert not isinstance(info.value, TensorParallelUnavailable)
    assert "tensor_parallel(tp_size=2) exited with status" in message
    # whichever rank fails first is named; torchrun may stop the other before it writes its report
    assert re.search(r"rank [01] failed: [^\n]*no-such-model", message), message
    assert "torchrun stderr (tail)" in message


@needs_gloo
def test_a_timeout_kills_the_whole_group() -> None:
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"timed out after 0\.5 s"):
        run_tensor_parallel("unused", dtype=None, tp_size=2, prompts=["Hello"], max_new_tokens=2, batch_size=1,
                            rounds=1, warmup=0, timeout_s=0.5)
    assert time.perf_counter() - start < 30


def test_missing_gloo_is_unavailable_not_broken(monkeypatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: False)
    reason = tensor_parallel_probe("cpu", 0, 2, None)
    assert reason and reason.startswith("tensor_parallel(tp_size=2) on CPU needs the gloo backend") and "found: torch" in reason
    with pytest.raises(TensorParallelUnavailable) as info:
        run_tensor_parallel("unused", dtype=None, tp_size=2, prompts=["x"], max_new_tokens=1, batch_size=1,
                            rounds=1, warmup=0)
    assert info.value.reason == reason and isinstance(info.value, RuntimeError)


def test_probe_reasons(monkeypatch) -> None:
    llama = SimpleNamespace(model_type="llama", base_model_tp_plan={"layers.*.self_attn.q_proj": "colwise"},
                            num_attention_heads=4, num_key_value_heads=2)
    assert tensor_parallel_probe("cuda", 1, 2, llama) == "tensor_parallel(tp_size=2) needs 2 CUDA devices; found: 1"
    assert tensor_parallel_probe("cuda", 0, 4, None) == "tensor_parallel(tp_size=4) needs 4 CUDA devices; found: 0"
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert tensor_parallel_probe("cuda", 2, 2, llama) is None
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: True)
    assert tensor_parallel_probe("cpu", 0, 2, llama) is None
    assert tensor_parallel_probe("cpu", 0, 2, None) is None
    no_plan = SimpleNamespace(model_type="gpt2", base_model_tp_plan=None, num_attention_heads=4)
    assert tensor_parallel_probe("cpu", 0, 2, no_plan) == "tensor_parallel needs a model with a tp_plan; found: gpt2 without one"
    assert "divisible by 4" in tensor_parallel_probe("cpu", 0, 4, llama)
    assert "found: mps" in tensor_parallel_probe("mps", 0, 2, llama)
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    assert "needs torch.distributed" in tensor_parallel_probe("cpu", 0, 2, llama)


def test_probe_on_the_built_in_model() -> None:
    from pytest_transformers_opt.engine.tiny_models import tiny_model_config

    config = tiny_model_config("tiny-random-llama")
    expected = None if torch.distributed.is_available() and torch.distributed.is_gloo_available() else "gloo"
    reason = tensor_parallel_probe("cpu", 0, 2, config)
    assert reason is None if expected is None else expected in reason


def test_an_uneven_vocabulary_skips_on_transformers_before_5_21_and_runs_since(monkeypatch) -> None:
    """transformers 5.17-5.20 gather lm_head's column shards whole and refuse an uneven split (the built-in
    model's 511-token vocabulary failed both ranks): a skip naming both versions there, a run since 5.21."""
    import pytest_transformers_opt.techniques.parallel as parallel

    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: True)
    llama = SimpleNamespace(model_type="llama", base_model_tp_plan={"layers.*.self_attn.q_proj": "colwise"},
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=511)
    monkeypatch.setattr(parallel, "package_version", lambda name: "5.17.0")
    assert tensor_parallel_probe("cpu", 0, 2, llama) == (
        "tensor_parallel(tp_size=2) with transformers 5.17.0 needs vocab_size divisible by 2 (transformers 5.21 "
        "and later shard an uneven lm_head); found: llama with vocab_size 511")
    llama.vocab_size = 512
    assert tensor_parallel_probe("cpu", 0, 2, llama) is None
    llama.vocab_size = 511
    monkeypatch.setattr(parallel, "package_version", lambda name: "5.21.0")
    assert tensor_parallel_probe("cpu", 0, 2, llama) is None
