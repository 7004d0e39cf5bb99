"""The advisor's newer speed levers (issue 22, item 5): the experts implementation for mixture-of-experts models,
speculative decoding (prompt_lookup) for latency-bound decoding at batch size 1; each cites its documentation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_transformers_opt.advisor import (Advice, Change, ServingScenario, advise, advise_from_report,
                                             compatibility_questions, render_text)
from pytest_transformers_opt.advisor.docs import documentation_for, tradeoffs_for
from pytest_transformers_opt.advisor.model_config import shape_from_dict
from pytest_transformers_opt.techniques.catalogue import BUILTIN_TECHNIQUES

GiB = 2**30
# Qwen3-30B-A3B's shape: 128 experts, 8 per token.
QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
H100 = {"device": "cuda", "compute_capability": "9.0", "gpu_memory_bytes": 80 * GiB,
        "versions": {"torch": "2.10.0", "transformers": "5.24.0"}}
CATALOGUE = {technique.name: technique for technique in BUILTIN_TECHNIQUES}


@pytest.fixture()
def moe_dir(tmp_path: Path) -> str:
    folder = tmp_path / "qwen3-moe-shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_MOE))
    return str(folder)


def _speed(model: str, **kw: Any) -> ServingScenario:
    kw.setdefault("input_tokens", 1024)
    kw.setdefault("max_new_tokens", 512)
    return ServingScenario(model=model, problem="speed", **kw)


def _cites_its_page(advice: Advice, name: str) -> str:
    """The change's own documentation page, by title and link, is in what the user is shown."""
    technique = CATALOGUE[name]
    text = render_text(advice)
    assert f"Transformers docs: {technique.docs_title} <{technique.docs}>" in text
    assert technique.docs.startswith("https://huggingface.co/docs/transformers/")
    return text


# ---------------------------------------------------------------- experts: mixture-of-experts models

@pytest.mark.parametrize("field,count", [("num_local_experts", 8), ("num_experts", 128), ("n_routed_experts", 256)])
def test_the_advisor_reads_the_expert_count_from_the_config(field: str, count: int) -> None:
    dense = {key: value for key, value in QWEN3_MOE.items() if key != "num_experts"}
    shape = shape_from_dict({**dense, field: count}, "m")
    assert shape.num_experts == count
    assert shape_from_dict(dense, "m").num_experts == 1


def test_a_moe_model_on_a_recent_gpu_gets_grouped_mm(moe_dir: str) -> None:
    advice = advise(_speed(moe_dir), hardware=H100)
    assert advice.stage == "speed"
    assert advice.change == Change("experts", {"implementation": "grouped_mm"})
    assert advice.marker_line().startswith('@pytest.mark.optimization(techniques.experts(implementation="grouped_mm")')
    text = _cites_its_page(advice, "experts")
    assert "https://huggingface.co/docs/transformers/main/en/experts_interface" in text
    assert any("128 experts per MoE layer" in line and "batched_mm" in line for line in advice.why)
    assert advice.budgets["min_speedup"] == 1.1  # a speed change on a real model
    assert any("Experts backends" in line for line in advice.tradeoffs)
    # the GPU is known to be capable: no question about it is left open, only the model class's support
    assert not any("compute capability" in q for q in advice.open_questions)
    assert any("experts_implementation" in q for q in advice.open_questions)


def test_grouped_mm_that_the_hardware_rules_out_becomes_batched_mm_on_a_gpu_and_nothing_on_cpu(moe_dir: str) -> None:
    turing = {**H100, "compute_capability": "7.5"}
    assert advise(_speed(moe_dir), hardware=turing).change == Change("experts", {"implementation": "batched_mm"})
    old_cpu = {"device": "cpu", "versions": {"torch": "2.8.0", "transformers": "5.24.0"}}
    # on CPU batched_mm is slower than eager (the Experts backends page): the next lever instead
    assert advise(_speed(moe_dir, cpu_memory_bytes=256 * GiB), hardware=old_cpu).change.name == "compile"
    blockers = compatibility_questions(ServingScenario(device="cpu", versions={"torch": "2.8.0"}),
                                       [Change("experts", {"implementation": "grouped_mm"})])
    assert any("needs torch >= 2.9 on cpu" in q and "found: torch 2.8.0" in q for q in blockers)


def test_a_dense_model_gets_no_experts_lever(model_dir: str) -> None:
    advice = advise(_speed(model_dir, batch_size=4), hardware=H100)
    assert advice.change.name == "compile"


def test_after_the_experts_change_the_next_lever_follows(moe_dir: str) -> None:
    """From a run of the experts change that met every budget: at batch size 1, speculative decoding is next;
    at batch size 4, compile."""
    record = {
        "nodeid": "test_next.py::test_recommended_change", "outcome": "passed", "skip_reason": None, "error": None,
        "model": {"name_or_path": moe_dir, "revision": None, "dtype": "bfloat16"},
        "techniques": ["experts(implementation='grouped_mm')"], "baseline_techniques": [],
        "workload": {"num_prompts": 1, "max_new_tokens": 256, "batch_size": 1, "input_tokens": 512},
        "speedup": 1.3, "memory_ratio": 1.0, "budgets": [], "failed_budgets": [],
    }
    report = {"schema": "pytest-transformers-opt/report", "schema_version": 1, "created": "2026-01-01T00:00:00",
              "environment": {"device": "cuda:0", "gpu_name": "NVIDIA H100", "compute_capability": "9.0",
                              "torch": "2.10.0", "transformers": "5.24.0"},
              "tests": [record], "summary": {"passed": 1, "failed": 0, "skipped": 0, "error": 0}}
    advice = advise_from_report(report, ServingScenario(problem="speed"))
    assert advice.change == Change("prompt_lookup")
    assert [c.label() for c in advice.configuration] == ["experts(implementation='grouped_mm')", "prompt_lookup"]
    wider = {**record, "workload": {**record["workload"], "batch_size": 4}}
    assert advise_from_report({**report, "tests": [wider]}, ServingScenario(problem="speed")).change.name == "compile"
    # a speed budget missed by a MoE model's run with sdpa: the experts implementation comes before compile
    slow = {**record, "outcome": "failed", "techniques": ["sdpa"], "failed_budgets": ["min_speedup"],
            "workload": {**record["workload"], "batch_size": 4}}
    assert advise_from_report({**report, "tests": [slow]}).change == Change("experts", {"implementation": "grouped_mm"})


# ---------------------------------------------------------------- speculative decoding: batch size 1

def test_one_sequence_at_a_time_gets_prompt_lookup(model_dir: str) -> None:
    advice = advise(_speed(model_dir, batch_size=1, concurrency=1), hardware=H100)
    assert advice.change == Change("prompt_lookup")
    assert advice.marker_line().startswith('@pytest.mark.optimization("prompt_lookup"')
    text = _cites_its_page(advice, "prompt_lookup")
    assert "generation_strategies" in text
    assert any("latency-bound" in line and "assisted_decoding" in line for line in advice.why)
    assert advice.test is not None and advice.test.batch_size == 1
    questions = "\n".join(advice.open_questions)
    assert "batch size 1" in questions and "do_sample=False" in questions
    assert any("batch size 1 only" in line for line in advice.tradeoffs)


def test_speculative_decoding_needs_a_stated_batch_of_one(model_dir: str) -> None:
    """Transformers runs it at batch size 1 only: an assumed batch size (or several sequences, or concurrent
    requests) keeps compile, which runs at any batch size."""
    assert advise(_speed(model_dir), hardware=H100).change.name == "compile"
    assert advise(_speed(model_dir, batch_size=2), hardware=H100).change.name == "compile"
    assert advise(_speed(model_dir, batch_size=1, concurrency=4), hardware=H100).change.name == "continuous_batching"


def test_assisted_decoding_is_cited_and_asks_for_a_draft() -> None:
    refs = documentation_for(Change("assisted_decoding"))
    technique = CATALOGUE["assisted_decoding"]
    assert refs[0] == f"Transformers docs: {technique.docs_title} <{technique.docs}>"
    assert "generation_strategies" in technique.docs
    questions = compatibility_questions(ServingScenario(model="org/big"), [Change("assisted_decoding")])
    assert any("draft model" in q and "shares its tokenizer" in q for q in questions)
    assert any("draft model" in line for line in tradeoffs_for(Change("assisted_decoding")))
