"""Unit tests of merging (report/merge.py) and of the comparison's per-row hardware (report/compare.py).

Reports are small dicts built here; the end-to-end runs are in tests/integration/test_merge.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pytest_transformers_opt.errors import OptConfigError
from pytest_transformers_opt.report.compare import summarise
from pytest_transformers_opt.verdict.compare import compare_reports, parse_compare_fail, verdict_keys
from pytest_transformers_opt.report.merge import Shard, merge_reports, shard_hardware
from pytest_transformers_opt.report.schema import validate_report

ENV: dict[str, Any] = {
    "python": "3.12.0", "platform": "Linux-6.8-x86_64", "torch": "2.13.0", "transformers": "5.24.0",
    "accelerate": "1.0", "bitsandbytes": None, "kernels": None, "cuda": "12.8", "driver": "570", "device": "cuda:0",
    "gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "gpu_memory_bytes": 80 * 2**30,
    "device_count": 1, "bf16_supported": True, "tf32": None,
}
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def _metrics(latency: float) -> dict[str, Any]:
    return {"ttft_s": 0.001, "tpot_s": 0.0001, "latency_s": latency, "throughput_tok_s": 100.0,
            "peak_memory_bytes": 2**20, "load_time_s": 0.1, "compile_time_s": None, "tokens_generated": 4,
            "recompiles": None, "rounds": 1, "latency_samples_s": [latency]}


def row(nodeid: str, hardware: str | None, latency: float = 0.01, outcome: str = "passed") -> dict[str, Any]:
    return {
        "nodeid": nodeid, "outcome": outcome, "skip_reason": None, "error": None,
        "model": {"name_or_path": "tiny-random-llama", "revision": None, "dtype": "float32"},
        "techniques": ["sdpa"], "baseline_techniques": ["eager"],
        "workload": {"num_prompts": 1, "max_new_tokens": 4, "batch_size": 1, "input_tokens": 8},
        "baseline": _metrics(0.02), "optimized": _metrics(latency), "speedup": 2.0, "memory_ratio": 1.0,
        "similarity": {"token_match": 1.0, "kl_mean": 0.0, "kl_max": 0.0, "top1": 1.0, "near_tie": False},
        "budgets": [], "failed_budgets": [], "estimates": {}, "regression": None, "hardware": hardware,
    }


def report(*tests: dict[str, Any], env: dict[str, Any] | None = None) -> dict[str, Any]:
    made = {"schema": "pytest-transformers-opt/report", "schema_version": 1, "created": "2025-01-01T00:00:00+00:00",
            "environment": copy.deepcopy(env or ENV),
            "settings": {"budgets_mode": "enforce", "rounds": 1, "warmup": 0, "device": "cuda:0",
                         "default_model": "tiny-random-llama"},
            "tests": list(tests), "summary": {"passed": len(tests), "failed": 0, "skipped": 0, "error": 0},
            "advice": None}
    validate_report(made)
    return made


def test_shard_hardware_takes_the_row_then_the_run_then_what_an_older_report_keeps() -> None:
    assert shard_hardware(row("t::a", H200), {**ENV, "hardware": H100}) == H200
    assert shard_hardware(row("t::a", None), {**ENV, "hardware": H100}) == H100
    assert shard_hardware(row("t::a", None), ENV) == H100  # before "hardware": the GPU's name on CUDA
    cpu = {**ENV, "device": "cpu", "gpu_name": None}
    assert shard_hardware(row("t::a", None), {**cpu, "cpu_model": "AMD EPYC 7B13"}) == "CPU: AMD EPYC 7B13"
    assert shard_hardware(row("t::a", None), cpu) == "CPU: Linux-6.8-x86_64"


def test_merge_fills_null_hardware_from_the_shard_and_recounts_the_summary() -> None:
    failed = row("t::b", None, outcome="failed")
    merged = merge_reports([Shard("a.json", report(row("t::a", None), failed)),
                            Shard("b.json", report(row("t::a", None), env={**ENV, "gpu_name": H200}))])
    assert [(t["nodeid"], t["hardware"], t["shard"]) for t in merged["tests"]] == [
        ("t::a", H100, 0), ("t::a", H200, 1), ("t::b", H100, 0)]
    assert merged["summary"] == {"passed": 2, "failed": 1, "skipped": 0, "error": 0}
    assert [s["source"] for s in merged["shards"]] == ["a.json", "b.json"]
    assert merged["shards"][1]["environment"]["gpu_name"] == H200 and merged["environment"]["gpu_name"] == H100


def test_a_null_hardware_row_clashing_with_a_known_one_is_a_duplicate() -> None:
    with pytest.raises(OptConfigError, match=r"'t::a' on 'NVIDIA H100 80GB HBM3' is in both 'a.json' and 'b.json'"):
        merge_reports([Shard("a.json", report(row("t::a", H100))), Shard("b.json", report(row("t::a", None)))])


def test_nothing_to_merge_is_an_error() -> None:
    with pytest.raises(OptConfigError, match="at least one report"):
        merge_reports([])


def test_rows_of_one_report_with_different_hardware_are_not_comparable_even_on_one_environment() -> None:
    old, new = report(row("t::a", H100)), report(row("t::a", H200))
    assert compare_reports(old, new, [])["t::a"] == {
        "verdict": "not comparable", "details": [f"measured on different hardware: {H100!r} -> {H200!r}"]}


def test_a_merged_old_report_compares_each_row_with_the_row_of_its_own_hardware() -> None:
    old = merge_reports([Shard("h100.json", report(row("t::a", H100, latency=0.010))),
                         Shard("h200.json", report(row("t::a", H200, latency=0.001)))])
    thresholds = parse_compare_fail("latency:10%")
    assert compare_reports(old, report(row("t::a", H100, latency=0.010)), thresholds)["t::a"]["verdict"] == "ok"
    assert compare_reports(old, report(row("t::a", H200, latency=0.010)), thresholds)["t::a"]["verdict"] == "regressed"
    elsewhere = compare_reports(old, report(row("t::a", "NVIDIA A100")), thresholds)["t::a"]
    assert elsewhere == {"verdict": "not comparable", "details": [
        f"measured on different hardware: {H100!r}, {H200!r} -> 'NVIDIA A100'"]}


def test_verdicts_of_a_merged_new_report_are_keyed_by_node_id_and_hardware_where_it_repeats() -> None:
    new = merge_reports([Shard("h100.json", report(row("t::a", H100), row("t::b", H100, latency=0.5))),
                         Shard("h200.json", report(row("t::a", H200)))])
    assert verdict_keys(new) == [f"t::a on {H100}", f"t::a on {H200}", "t::b"]
    old = copy.deepcopy(new)
    for test in old["tests"]:
        test["optimized"] = _metrics(0.001) if test["hardware"] == H200 else test["optimized"]
    verdicts = compare_reports(old, new, parse_compare_fail("latency:10%"))
    assert {key: v["verdict"] for key, v in verdicts.items()} == {
        f"t::a on {H100}": "ok", f"t::a on {H200}": "regressed", "t::b": "ok"}
    assert summarise(verdicts, "old.json")[0].startswith(f"REGRESSED t::a on {H200}: latency 1.0 ms -> 10.0 ms")


def test_reports_without_hardware_still_compare_by_their_environments() -> None:
    legacy = {key: value for key, value in row("t::a", None).items() if key != "hardware"}
    other = {**ENV, "gpu_name": H200}
    assert compare_reports(report(legacy), report(copy.deepcopy(legacy)), [])["t::a"]["verdict"] == "ok"
    assert compare_reports(report(legacy), report(copy.deepcopy(legacy), env=other), [])["t::a"]["details"] == [
        f"measured on different hardware: GPU {H100!r} -> {H200!r}"]
