"""Scenario logic: one recommendation per stage, a complete report, and the next step from a report."""

from __future__ import annotations

import copy

import pytest

from pytest_transformers_opt.advisor import (
    UNVERIFIED,
    Change,
    ServingScenario,
    advise,
    advise_from_report,
    compatibility_questions,
    flash_attention_capable,
    render_text,
)
from pytest_transformers_opt.advisor.docs import documentation_for
from pytest_transformers_opt.advisor.from_report import load_report, validate_report
from pytest_transformers_opt.errors import OptConfigError
from pytest_transformers_opt.techniques.catalogue import BUILTIN_TECHNIQUES

GiB = 2**30
SECTIONS = ("Recommended change", "Configuration", "Why", "Supported by", "Expected tradeoffs",
            "Open compatibility questions", "Assumptions / questions to answer", "Validation")


def workload(model_dir: str, **kw) -> ServingScenario:
    kw.setdefault("input_tokens", 1024)
    kw.setdefault("max_new_tokens", 512)
    return ServingScenario(model=model_dir, **kw)


def assert_complete(advice, docs_section: str) -> str:
    """The report names the change, documentation, tradeoffs, open questions and the validation test."""
    text = render_text(advice)
    for section in SECTIONS:
        assert f"\n{section}" in f"\n{text}", section
    assert any(docs_section in ref for ref in advice.documentation)
    assert "Transformers docs: Inference optimization overview > " + docs_section in text
    # the catalogue's documentation link of the change is what the user is shown, with its title
    technique = advice.change.technique
    assert f"Transformers docs: {technique.docs_title} <{technique.docs}>" in text
    assert advice.tradeoffs and advice.open_questions
    assert "pytest test_recommended_change.py --opt-report" in text
    assert advice.marker_line().startswith("@pytest.mark.optimization(")
    assert advice.marker_line() in text
    assert text.rstrip().endswith(UNVERIFIED)
    for line in text.splitlines():  # estimates and measurements never share a line
        assert not ("(estimate" in line and "(measured" in line), line
    assert all(f.kind == "estimate" for f in advice.figures if f.kind not in ("stated", "probed"))
    assert len(advice.summary_lines()) <= 6
    return text


# ---------------------------------------------------------------- one scenario per stage

def test_weights_that_do_not_fit_get_8bit_when_8bit_fits(model_dir):
    advice = advise(workload(model_dir, gpu_memory_bytes=12 * GiB))
    assert advice.stage == "load"
    assert [c.name for c in advice.configuration] == ["bnb_8bit"]
    assert advice.budgets["max_memory"] == "12 GiB"
    text = assert_complete(advice, "Quantization")
    assert "Stage that breaks first: load" in text
    assert '@pytest.mark.optimization("bnb_8bit", max_memory="12 GiB", max_kl=0.07, min_top1=0.85)' in text


def test_weights_that_do_not_fit_at_8bit_get_4bit(model_dir):
    advice = advise(workload(model_dir, gpu_memory_bytes=8 * GiB))
    assert advice.change.name == "bnb_4bit" and len(advice.configuration) == 1
    assert advice.budgets == {"max_memory": "8 GiB", "max_kl": 0.5, "min_top1": 0.6}
    assert_complete(advice, "Quantization")
    assert any("bitsandbytes" in q for q in advice.open_questions)


def test_kv_cache_outgrowing_vram_on_long_generation_gets_a_cache_technique(model_dir):
    advice = advise(workload(model_dir, gpu_memory_bytes=24 * GiB, input_tokens=2048, max_new_tokens=100_000))
    assert advice.stage == "long-generation"
    assert advice.change.name == "quantized_cache"
    assert advice.change.params == {"backend": "quanto", "nbits": 4}
    text = assert_complete(advice, "Caching")
    assert 'techniques.quantized_cache(backend="quanto", nbits=4)' in advice.marker_line()
    assert any("optimum-quanto" in q for q in advice.open_questions)
    # Shorter generations appear only as a workload tradeoff, never as the change.
    assert advice.workload_tradeoffs and "not an optimization" in advice.workload_tradeoffs[0]
    assert "Cap generations at" in "\n".join(advice.workload_tradeoffs)
    assert "Workload tradeoffs (not optimizations)" in text
    assert "Cap generations" not in advice.title


def test_a_cache_too_big_even_quantized_is_offloaded(model_dir):
    advice = advise(workload(model_dir, gpu_memory_bytes=24 * GiB, input_tokens=2048, max_new_tokens=400_000,
                             cpu_memory_bytes=512 * GiB))
    assert advice.stage == "long-generation"
    assert advice.change.name == "offloaded_cache"
    assert_complete(advice, "Caching")


def test_long_input_with_eager_attention_gets_a_memory_efficient_backend(model_dir):
    advice = advise(workload(model_dir, gpu_memory_bytes=40 * GiB, input_tokens=32_768, max_new_tokens=64,
                             attention="eager"))
    assert advice.stage == "long-input"
    assert advice.change.name == "sdpa"  # GPU capability unknown: not flash attention
    text = assert_complete(advice, "Attention backends")
    assert "score matrix" in text
    assert any("support sdpa" in q for q in advice.open_questions)


def test_long_input_on_a_capable_gpu_gets_flash_attention(model_dir):
    capable = advise(workload(model_dir, gpu_memory_bytes=40 * GiB, input_tokens=32_768, max_new_tokens=64,
                              compute_capability="9.0"))
    assert capable.change.name == "flash_attention_2"
    assert_complete(capable, "Attention backends")
    older = advise(workload(model_dir, gpu_memory_bytes=40 * GiB, input_tokens=32_768, max_new_tokens=64),
                   hardware={"device": "cuda", "compute_capability": "7.5"})
    assert older.change.name == "sdpa"


def test_many_concurrent_requests_get_continuous_batching(model_dir):
    advice = advise(workload(model_dir, gpu_memory_bytes=24 * GiB, concurrency=64))
    assert advice.stage == "concurrency"
    assert advice.change.name == "continuous_batching"
    assert advice.change.params["max_batch_tokens"] == 1024
    assert_complete(advice, "Continuous batching")
    assert "Serve " in "\n".join(advice.workload_tradeoffs)  # fewer requests: a tradeoff only


def test_fits_and_wants_speed_gets_compile(model_dir):
    advice = advise(workload(model_dir, gpu_memory_bytes=80 * GiB, problem="speed"))
    assert advice.stage == "speed"
    assert [c.name for c in advice.configuration] == ["compile"]
    assert advice.budgets["min_speedup"] == 1.1
    text = assert_complete(advice, "Compilation")
    assert "static cache" in text
    assert not advice.workload_tradeoffs


def test_speed_with_concurrency_prefers_continuous_batching(model_dir):
    advice = advise(workload(model_dir, gpu_memory_bytes=80 * GiB, problem="speed", concurrency=8))
    assert advice.change.name == "continuous_batching"


def test_an_earlier_breaking_stage_wins_over_the_reported_problem(model_dir):
    advice = advise(workload(model_dir, gpu_memory_bytes=8 * GiB, problem="speed"))
    assert advice.stage == "load" and advice.change.family == "quantization"
    assert any("You reported speed" in line for line in advice.why)


def test_reported_stage_is_used_when_memory_is_unknown(model_dir):
    advice = advise(workload(model_dir, problem="long-generation"))
    assert advice.change.name == "quantized_cache"
    assert any("--gpu-memory" in a for a in advice.assumptions)


def test_missing_details_become_questions_with_assumptions(model_dir):
    advice = advise(ServingScenario(model=model_dir))
    joined = "\n".join(advice.assumptions)
    assert "Assumed: 1 concurrent request." in joined
    assert "--gpu-memory" in joined and "fit cannot be checked" in joined
    assert "--input-tokens" in joined and "--max-new-tokens" in joined and "--revision" in joined
    assert advice.change.name == "compile"  # assumed to fit; the goal is speed


def test_concurrency_problem_without_a_number_assumes_several(model_dir):
    advice = advise(workload(model_dir, problem="concurrency"))
    assert advice.change.name == "continuous_batching"
    assert any("8 concurrent requests" in a for a in advice.assumptions)


def test_bad_workload_values_are_config_errors(model_dir):
    with pytest.raises(OptConfigError, match="--problem"):
        ServingScenario(model=model_dir, problem="slow")
    with pytest.raises(OptConfigError, match="--input-tokens"):
        ServingScenario(model=model_dir, input_tokens=-1)
    with pytest.raises(OptConfigError, match="--model: required"):
        advise(ServingScenario())


def test_figures_are_labelled(model_dir):
    advice = advise(workload(model_dir, gpu_memory_bytes=12 * GiB))
    for figure in advice.figures:
        assert figure.text().endswith(f"({figure.kind})")
    assert {f.kind for f in advice.figures} == {"estimate", "stated"}


def test_probed_hardware_fills_unstated_memory(model_dir):
    advice = advise(workload(model_dir), hardware={"device": "cuda", "gpu_memory_bytes": 12 * GiB,
                                                   "compute_capability": "8.0", "versions": {"bitsandbytes": None}})
    assert advice.change.name == "bnb_8bit"
    assert any(f.kind == "probed" for f in advice.figures)
    assert any("bitsandbytes is not installed" in q for q in advice.open_questions)


def test_every_catalogue_technique_is_cited_by_title_and_link():
    for technique in BUILTIN_TECHNIQUES:
        refs = documentation_for(Change(technique.name))
        own = refs[1] if technique.overview_section else refs[0]  # no overview section (experts, speculative): its page
        assert f"<{technique.docs}>" in own, technique.name
        assert technique.docs_title and technique.docs_title in own, technique.name
        if technique.overview_section:
            assert refs[0].startswith(f"Transformers docs: Inference optimization overview > {technique.overview_section} <")


# ---------------------------------------------------------------- compatibility questions

def test_compatibility_questions_from_probed_hardware():
    work = ServingScenario(model="m", dtype="bfloat16")
    unknown = compatibility_questions(work, ["flash_attention_2"])
    assert any("compute capability >= 8.0" in q and q.endswith("?") for q in unknown)
    on_cpu = compatibility_questions(work, ["flash_attention_2"], {"device": "cpu"})
    assert any("found: cpu" in q for q in on_cpu)
    capable = compatibility_questions(work, ["flash_attention_2"], {
        "device": "cuda", "compute_capability": "9.0", "versions": {"flash-attn": "2.7.0"}})
    assert not any("compute capability" in q for q in capable)
    assert not any("flash-attn" in q for q in capable)
    assert flash_attention_capable(work, {"device": "cuda", "compute_capability": "8.6"}) is True
    assert flash_attention_capable(work, {"device": "cuda", "compute_capability": "7.5"}) is False
    assert flash_attention_capable(work) is None
    bnb = compatibility_questions(work, ["bnb_4bit"], {"device": "cuda", "bf16_supported": False})
    assert any("bitsandbytes installed with CUDA support" in q for q in bnb)
    assert any('compute_dtype="float16"' in q for q in bnb)
    sdpa = compatibility_questions(ServingScenario(model="m", revision="abc123"), ["sdpa"])
    assert any("m at abc123 support sdpa" in q for q in sdpa)
    assert any("versions" in q for q in sdpa)  # no versions known at all


# ---------------------------------------------------------------- from an earlier run's report

def _record(**over):
    record = {
        "nodeid": "test_next.py::test_recommended_change", "outcome": "failed", "skip_reason": None, "error": None,
        "model": {"name_or_path": "org/not-local-model", "revision": None, "dtype": "bfloat16"},
        "techniques": ["bnb_4bit"], "baseline_techniques": [],
        "workload": {"num_prompts": 1, "max_new_tokens": 256, "batch_size": 1, "input_tokens": 512},
        "baseline": {"ttft_s": 0.05, "tpot_s": 0.03, "latency_s": 7.7, "throughput_tok_s": 33.0,
                     "peak_memory_bytes": 17 * GiB, "load_time_s": 10.0, "compile_time_s": None,
                     "tokens_generated": 256},
        "optimized": {"ttft_s": 0.07, "tpot_s": 0.035, "latency_s": 9.0, "throughput_tok_s": 28.0,
                      "peak_memory_bytes": 6 * GiB, "load_time_s": 20.0, "compile_time_s": None,
                      "tokens_generated": 256},
        "speedup": 0.85, "memory_ratio": 0.35,
        "similarity": {"token_match": 0.6, "kl_mean": 0.62, "kl_max": 1.9, "top1": 0.55},
        "budgets": [{"name": "max_memory", "limit": 8 * GiB, "measured": 6 * GiB, "ok": True},
                    {"name": "max_kl", "limit": 0.5, "measured": 0.62, "ok": False},
                    {"name": "min_top1", "limit": 0.6, "measured": 0.55, "ok": False}],
        "failed_budgets": ["max_kl", "min_top1"],
    }
    record.update(over)
    return record


def _report(*records):
    return {
        "schema": "pytest-transformers-opt/report", "schema_version": 1, "created": "2025-06-01T12:00:00",
        "environment": {"python": "3.12.3", "platform": "Linux", "torch": "2.6.0", "transformers": "5.24.0",
                        "accelerate": "1.5.0", "bitsandbytes": "0.45.0", "kernels": None, "cuda": "12.4",
                        "driver": "550.54", "device": "cuda:0", "gpu_name": "NVIDIA L4", "compute_capability": "8.9",
                        "gpu_memory_bytes": 24 * GiB, "device_count": 1, "bf16_supported": True},
        "tests": list(records),
        "summary": {"passed": 0, "failed": len(records), "skipped": 0, "error": 0},
    }


def test_4bit_that_met_memory_but_failed_kl_leads_to_8bit(model_dir):
    record = _record(model={"name_or_path": model_dir, "revision": None, "dtype": "bfloat16"})
    advice = advise_from_report(_report(record))
    assert advice.change.name == "bnb_8bit"
    assert [c.name for c in advice.configuration] == ["bnb_8bit"]  # replaces 4-bit: one change
    assert advice.budgets["max_memory"] == "8 GiB"  # memory was met: keep checking it
    assert advice.budgets["max_kl"] == 0.07  # 4-bit's default 0.5 is not carried to 8-bit
    text = render_text(advice)
    assert "Measured (from report created 2025-06-01T12:00:00)" in text
    assert "budget max_kl (limit 0.5, FAILED): 0.62 (measured on NVIDIA L4, compute capability 8.9)" in text
    assert "optimized peak memory: 6.00 GiB (measured on NVIDIA L4, compute capability 8.9)" in text
    assert any(f.kind == "estimate" for f in advice.figures)  # the config was local: estimates too
    for line in text.splitlines():
        assert not ("(estimate" in line and "(measured" in line), line
    assert UNVERIFIED not in text and "has not been run yet" in text
    assert len(advice.summary_lines()) <= 6
    assert any("bnb_8bit" in line for line in advice.summary_lines())


def test_measured_figures_are_shown_as_measured_without_a_local_config():
    advice = advise_from_report(_report(_record()))
    assert advice.change.name == "bnb_8bit"
    assert advice.figures == []  # the hub model is not local: no estimates, only measurements
    assert advice.measured and all(f.kind == "measured" for f in advice.measured)
    assert all(f.where == "NVIDIA L4, compute capability 8.9" for f in advice.measured)
    assert any("model config not read" in line for line in advice.why)
    assert advice.test is not None and advice.test.model == "org/not-local-model"


def test_user_similarity_budget_is_kept():
    record = _record(budgets=[{"name": "max_kl", "limit": 0.05, "measured": 0.62, "ok": False}])
    assert advise_from_report(_report(record)).budgets["max_kl"] == 0.05


def test_memory_failure_leads_to_the_next_memory_technique():
    record = _record(techniques=["bnb_8bit"], failed_budgets=["max_memory"],
                     budgets=[{"name": "max_memory", "limit": 8 * GiB, "measured": 9 * GiB, "ok": False}])
    assert advise_from_report(_report(record)).change.name == "bnb_4bit"
    cache = _record(techniques=["quantized_cache(backend='quanto', nbits=4)"], failed_budgets=["max_memory"])
    assert advise_from_report(_report(cache)).change.name == "offloaded_cache"
    oom = _record(techniques=["sdpa"], outcome="error", error="torch.OutOfMemoryError: CUDA out of memory",
                  failed_budgets=[])
    assert advise_from_report(_report(oom)).change.name == "bnb_8bit"


def test_compile_that_passed_leads_to_continuous_batching_or_nothing():
    passed = _record(techniques=["static_cache", "sdpa", "compile"], outcome="passed", failed_budgets=[])
    serving = advise_from_report(_report(passed), ServingScenario(concurrency=8))
    assert serving.change.name == "continuous_batching"
    alone = advise_from_report(_report(passed), ServingScenario(concurrency=1))
    assert alone.change is None
    assert alone.title.startswith("No further change needed")
    assert alone.verified and "were measured" in alone.verification_line()


def test_among_passing_runs_the_one_furthest_along_decides():
    """Report order (test ids) must not decide: the fullest passing stack is the one to build on."""
    stacked = _record(nodeid="test_a.py::test_stack", techniques=["static_cache", "sdpa", "compile"],
                      outcome="passed", failed_budgets=[])
    single = _record(nodeid="test_z.py::test_single", techniques=["sdpa"], outcome="passed", failed_budgets=[])
    for order in ((stacked, single), (single, stacked)):
        advice = advise_from_report(_report(*order), ServingScenario(concurrency=8))
        assert advice.why[0].startswith("Measured run test_a.py::test_stack:")
        assert advice.change.name == "continuous_batching"
    faster = _record(nodeid="test_b.py::test_fast", techniques=["sdpa"], outcome="passed", failed_budgets=[],
                     speedup=1.4)
    slower = _record(nodeid="test_c.py::test_slow", techniques=["sdpa"], outcome="passed", failed_budgets=[],
                     speedup=1.1)
    assert advise_from_report(_report(slower, faster)).why[0].startswith("Measured run test_b.py::test_fast:")
    # compile carries its static cache: as far along as static_cache + sdpa, and here faster
    compiled = _record(nodeid="test_d.py::test_compiled", techniques=["compile"], outcome="passed",
                       failed_budgets=[], speedup=1.46)
    cache_sdpa = _record(nodeid="test_e.py::test_cache_sdpa", techniques=["static_cache", "sdpa"], outcome="passed",
                         failed_budgets=[], speedup=1.02)
    assert advise_from_report(_report(cache_sdpa, compiled)).why[0].startswith("Measured run test_d.py::test_compiled:")


def test_continuous_batching_replaces_compile_and_static_cache():
    passed = _record(techniques=["static_cache", "sdpa", "compile"], outcome="passed", failed_budgets=[])
    advice = advise_from_report(_report(passed), ServingScenario(concurrency=4))
    assert [c.name for c in advice.configuration] == ["sdpa", "continuous_batching"]


def test_skipped_flash_attention_falls_back_to_sdpa():
    record = _record(techniques=["flash_attention_2"], outcome="skipped", failed_budgets=[], optimized=None,
                     skip_reason="flash_attention_2 needs a CUDA GPU of compute capability >= 8.0; found: cpu")
    advice = advise_from_report(_report(record))
    assert advice.change.name == "sdpa"


def test_a_skipped_run_verifies_nothing():
    record = _record(techniques=["bnb_4bit"], outcome="skipped", failed_budgets=[], optimized=None, baseline=None,
                     similarity=None, budgets=[], speedup=None, memory_ratio=None,
                     skip_reason="bnb_4bit needs bitsandbytes; found: not installed")
    advice = advise_from_report(_report(record))
    assert advice.change is None and not advice.verified
    assert advice.verification_line() == UNVERIFIED
    assert "bitsandbytes" in advice.title


def test_a_cpu_run_takes_its_memory_budget_as_cpu_ram():
    report = _report(_record(techniques=["sdpa"], outcome="passed", failed_budgets=[]))
    report["environment"].update(device="cpu", gpu_name=None, compute_capability=None, gpu_memory_bytes=None)
    advice = advise_from_report(report)
    assert advice.title.startswith("No further change needed") and "on cpu (measured)" in advice.title
    assert any("max_memory budget (8 GiB)" in line for line in advice.why)
    assert all(f.where == "cpu" for f in advice.measured)


def test_lossless_technique_failing_similarity_proposes_nothing_new():
    record = _record(techniques=["sdpa"], failed_budgets=["max_kl"])
    advice = advise_from_report(_report(record))
    assert advice.change is None and "float32" in advice.title


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.pop("schema"), "not a pytest-transformers-opt report"),
    (lambda r: r.update(schema_version=2), "schema_version 2"),
    (lambda r: r.update(tests="nope"), "list of test records"),
])
def test_not_a_report_is_a_clear_error(mutate, message):
    report = copy.deepcopy(_report(_record()))
    mutate(report)
    with pytest.raises(OptConfigError, match=f"--from-report: .*{message}"):
        validate_report(report)


def test_load_report_errors_name_the_option(tmp_path):
    with pytest.raises(OptConfigError, match="--from-report: cannot read"):
        load_report(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(OptConfigError, match="--from-report: .* is not JSON"):
        load_report(bad)
