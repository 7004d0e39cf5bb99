"""Speculative decoding (issue 22, item 3): assisted_decoding and prompt_lookup run for real, prove that
transformers' candidate-verification path ran, report acceptance figures in every format, and refuse what
they cannot do, each as that test's own error."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_transformers_opt.engine.hardware import HardwareInfo
from pytest_transformers_opt.errors import OptConfigError
from pytest_transformers_opt.techniques import ProbeContext, TechniqueSpec, build_registry
from pytest_transformers_opt.verdict.budgets import Budget, drop_inapplicable

REPEATING = "the cat sees the dog and the cat sees the dog and the cat sees the"

USER_TESTS = '''
import pytest
from pytest_transformers_opt import techniques

REPEATING = {repeating!r}
FOREIGN = {foreign!r}

@pytest.mark.optimization(techniques.prompt_lookup(num_tokens=4))
def test_prompt_lookup(opt_bench):
    opt_bench(prompts=[REPEATING], max_new_tokens=12)

# the model drafts for itself: every draft token is accepted
@pytest.mark.optimization(techniques.assisted_decoding("tiny-random-llama", num_assistant_tokens=3),
                          min_acceptance_rate=0.9)
def test_assisted(opt_bench):
    opt_bench(prompts=["The cat sees", "A dog eats"], max_new_tokens=8)

@pytest.mark.optimization(techniques.prompt_lookup(num_tokens=4))
def test_prompt_lookup_fallback(opt_bench):
    opt_bench(prompts=[REPEATING], max_new_tokens=12)

@pytest.mark.optimization(techniques.assisted_decoding("tiny-random-llama", num_assistant_tokens=3))
def test_assisted_fallback(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=8)

@pytest.mark.optimization(techniques.prompt_lookup(num_tokens=0))
def test_bad_num_tokens(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization(techniques.assisted_decoding("./no-such-draft"))
def test_missing_assistant(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization(techniques.assisted_decoding(FOREIGN))
def test_foreign_tokenizer(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization(techniques.prompt_lookup())
def test_batch_too_large(opt_bench):
    opt_bench(prompts=["The cat sees", "A dog eats"], max_new_tokens=4, batch_size=2)

@pytest.mark.optimization("sdpa", min_acceptance_rate=0.5)
def test_rate_without_speculation(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("prompt_lookup", min_acceptance_rate=1.5)
def test_rate_out_of_range(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("prompt_lookup", "continuous_batching")
def test_with_continuous_batching(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization(techniques.assisted_decoding("tiny-random-llama"), "tensor_parallel")
def test_with_tensor_parallel(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("prompt_lookup", "static_cache")
def test_with_static_cache(opt_bench):
    opt_bench(max_new_tokens=4)
'''

# what a user could write: a conftest that silently turns speculation off for some tests
SILENT_FALLBACK = '''
import pytest
from transformers.generation import candidate_generator

@pytest.fixture(autouse=True)
def _no_speculation(request, monkeypatch):
    if "fallback" in request.node.name:
        def no_candidates(self, input_ids, **kwargs):
            return input_ids, None  # as if nothing matched: plain decoding, one token a step
        for cls in (candidate_generator.PromptLookupCandidateGenerator,
                    candidate_generator.AssistedCandidateGenerator):
            monkeypatch.setattr(cls, "get_candidates", no_candidates)
'''

ERRORS = {
    "test_bad_num_tokens": ["prompt_lookup: num_tokens=0; accepted: an int > 0"],
    "test_missing_assistant": ["assisted_decoding: assistant='./no-such-draft'", "does not exist"],
    "test_foreign_tokenizer": ["assisted_decoding: assistant=", "does not share the model's tokenizer",
                               "vocab_size 600"],
    "test_rate_without_speculation": ["budget min_acceptance_rate is measured by speculative decoding",
                                      "assisted_decoding or prompt_lookup"],
    "test_rate_out_of_range": ["budget min_acceptance_rate", "1.5"],
    "test_with_continuous_batching": ["prompt_lookup(num_tokens=10) and continuous_batching", "conflict",
                                      "generate_batch() takes no assistant_model or prompt lookup"],
    "test_with_tensor_parallel": ["assisted_decoding(assistant='tiny-random-llama') and tensor_parallel(tp_size=2)",
                                  "conflict"],
    "test_with_static_cache": ["prompt_lookup(num_tokens=10) and static_cache", "static cache"],
}


def _foreign_draft(folder: Path) -> str:
    """A draft whose vocabulary is not the tiny models' (600 ids against their 511), as a user might pick."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pytest_transformers_opt.engine.tiny_models import ensure_tiny_model

    config = LlamaConfig(vocab_size=600, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(ensure_tiny_model("tiny-random-llama")).save_pretrained(folder)
    return str(folder)


def _check_counts(entry: dict, new_tokens: int) -> dict:
    """The draft figures hold together: every verification step yields its accepted draft tokens plus one of
    the model's own, so steps + accepted = the tokens generated, and the rates are the counts' ratios."""
    optimized = entry["optimized"]
    steps, proposed, accepted = (optimized[k] for k in ("draft_steps", "draft_tokens_proposed", "draft_tokens_accepted"))
    assert steps + accepted == new_tokens, optimized
    assert 0 <= accepted <= proposed and proposed > 0, optimized
    assert optimized["acceptance_rate"] == pytest.approx(accepted / proposed)
    assert optimized["mean_accepted_tokens_per_step"] == pytest.approx(accepted / steps)
    assert entry["baseline"]["acceptance_rate"] is None and entry["baseline"]["draft_steps"] is None
    return optimized


def test_speculative_techniques_prove_report_and_refuse(run_user, pytester: pytest.Pytester):
    foreign = _foreign_draft(pytester.path / "foreign-draft")
    md, html = pytester.path / "report.md", pytester.path / "report.html"
    run = run_user(USER_TESTS.format(repeating=REPEATING, foreign=foreign), "--opt-rounds=1", "--opt-warmup=0",
                   "--opt-report", f"--opt-report-md={md}", f"--opt-report-html={html}",
                   "-W", "ignore::DeprecationWarning", conftest=SILENT_FALLBACK)
    outcomes = {t["nodeid"].split("::")[-1]: t["outcome"] for t in run.report["tests"]}
    assert outcomes == {"test_prompt_lookup": "passed", "test_assisted": "passed", "test_prompt_lookup_fallback": "failed",
                        "test_assisted_fallback": "failed", "test_batch_too_large": "failed",
                        **{name: "error" for name in ERRORS}}, outcomes

    lookup = run.test("test_prompt_lookup")
    figures = _check_counts(lookup, 12)
    assert max(1, figures["draft_steps"]) <= 12 and figures["draft_tokens_proposed"] <= 4 * figures["draft_steps"]
    assert lookup["similarity"]["token_match"] == 1.0  # lossless under greedy decoding: exact parity
    assert {b["name"]: b["limit"] for b in lookup["budgets"]} == {"min_token_match": 1.0, "max_kl": 1e-3}
    assert lookup["workload"]["batch_size"] == 1

    assisted = run.test("test_assisted")
    figures = _check_counts(assisted, 2 * 8)
    assert figures["acceptance_rate"] == 1.0  # a draft identical to the model agrees on every token
    assert figures["draft_tokens_proposed"] <= 3 * figures["draft_steps"]  # num_assistant_tokens=3 honoured
    assert assisted["workload"]["batch_size"] == 1  # both sides ran the two prompts one at a time, and say so
    assert any(note.startswith("batch size 1 on both sides: assisted_decoding(") for note in assisted["notes"])
    assert assisted["similarity"]["token_match"] == 1.0 and assisted["similarity"]["kl_mean"] <= 1e-3
    rate = next(b for b in assisted["budgets"] if b["name"] == "min_acceptance_rate")
    assert rate["ok"] is True and rate["measured"] == 1.0 and rate["source"] == "marker"
    assert any("the draft tiny-random-llama" in note and "optimized side's figures" in note
               for note in assisted["notes"]), assisted["notes"]

    # a silent fallback (no candidate proposed, the draft never called) fails the test, naming what did not run
    assert "no draft token was proposed" in run.test("test_prompt_lookup_fallback")["error"]
    assert "the draft model's forward was never called" in run.test("test_assisted_fallback")["error"]
    assert "opt_bench(batch_size=2)" in run.test("test_batch_too_large")["error"]
    assert "accepted: batch_size <= 1" in run.test("test_batch_too_large")["error"]
    for name, parts in ERRORS.items():
        error = run.test(name)["error"]
        assert all(part in error for part in parts), (name, error)

    # every format shows the figures
    stdout = run.result.stdout.str()
    assert "speculative decoding (draft tokens accepted / proposed in the verified run):" in stdout
    assert "test_assisted: acceptance rate 100.0%" in stdout
    markdown, page = md.read_text(), html.read_text()
    assert "### Speculative decoding" in markdown and "100.0%" in markdown.split("### Speculative decoding")[1]
    assert '<section id="speculative">' in page and "Acceptance rate" in page


def _probe(name: str, config: object) -> str | None:
    ctx = ProbeContext(hardware=HardwareInfo(), model_config=config, dtype="float32")
    return build_registry().resolve(TechniqueSpec.of(name, **({"assistant": "tiny-random-llama"}
                                                              if name == "assisted_decoding" else {}))).probe(ctx)


def test_a_cache_that_cannot_be_cropped_skips_with_the_reason():
    """Rejected draft tokens are cropped from the cache; a linear or chunked attention layer cannot be: a skip
    naming the layers, read from the config before any load. Sliding and full layers run."""
    from transformers import AutoConfig

    assert _probe("prompt_lookup", AutoConfig.for_model("llama4_text")) == (
        "prompt_lookup(num_tokens=10) needs a model whose cache can be cropped back after rejected draft tokens "
        "(full_attention or sliding_attention layers); found: 36 of 48 layers chunked_attention (config.layer_types)")
    assert _probe("assisted_decoding", AutoConfig.for_model("qwen3_next")).endswith(
        "found: 36 of 48 layers linear_attention (config.layer_types)")
    for model_type in ("gemma3_text", "llama", "gpt_oss"):
        assert _probe("prompt_lookup", AutoConfig.for_model(model_type)) is None, model_type


def test_min_acceptance_rate_from_ini_applies_to_speculative_configurations_only():
    ini = {"min_acceptance_rate": Budget("min_acceptance_rate", 0.5, "ini", "0.5")}
    assert drop_inapplicable(ini, {"attention"}, "here") == {}
    assert drop_inapplicable(ini, {"speculative_decoding"}, "here") == ini
    marker = {"min_acceptance_rate": Budget("min_acceptance_rate", 0.5, "marker", 0.5)}
    with pytest.raises(OptConfigError, match="here: budget min_acceptance_rate is measured by speculative decoding"):
        drop_inapplicable(marker, {"attention"}, "here")
