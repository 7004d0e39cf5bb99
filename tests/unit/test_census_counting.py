"""The census's counting (engine.census) and its exact comparison (verdict.census_diff, compare's census thresholds),
on crafted profiler events: CUDA's kernels and syncs are counted here without a GPU (unverified on one)."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_transformers_opt.engine.census import (CALL_MARK, GRAPH, KERNEL, MARK, OP, REGION, RUNTIME, STEP_MARK,
                                                   CensusEvent, census_from_events)
from pytest_transformers_opt.verdict.census_diff import UNCHANGED, census_cause, map_changes
from pytest_transformers_opt.verdict.compare import compare_test, parse_compare_fail


def _call(start: float, steps: int, per_step: list[tuple[str, str]], prefill: list[tuple[str, str]]) -> list[CensusEvent]:
    """One generate call: its mark, the prefill's events, then ``steps`` marks with each step's events after it."""
    events = [CensusEvent(CALL_MARK, MARK, start, start + 1000)]
    t = start + 1
    for name, kind in prefill:
        events.append(CensusEvent(name, kind, t))
        t += 1
    for _ in range(steps):
        events.append(CensusEvent(STEP_MARK, MARK, t))
        t += 1
        for name, kind in per_step:
            events.append(CensusEvent(name, kind, t))
            t += 1
    return events


def test_ops_are_counted_per_call_and_per_decode_step_inside_the_generate_call_only() -> None:
    events = _call(0, 4, [("aten::mm", OP), ("aten::mm", OP), ("aten::cat", OP)], [("aten::embedding", OP)])
    events.append(CensusEvent("aten::to", OP, 5000))  # tokenizing after the call: not the configuration's
    census = census_from_events(events, cuda=False, compiled=False)
    # the ops after the last mark (the last token's bookkeeping) count per call, not per step: 4 marks, 3 steps
    assert census["ops"] == {"aten::cat": 4, "aten::embedding": 1, "aten::mm": 8}
    assert census["ops_total"] == 13 and census["decode_steps"] == 3
    assert census["ops_per_step"] == {"aten::cat": 1.0, "aten::mm": 2.0}
    assert census["kernels"] is None and "CUDA" in census["unavailable"]["kernels"]
    assert census["graph_breaks"] is None and census["unavailable"]["graph_breaks"] == "not a compiled configuration"


def test_cuda_kernels_syncs_and_graph_replays_are_counted_from_their_events() -> None:
    step = [("aten::mm", OP), ("sm90_gemm", KERNEL), ("cudaStreamSynchronize", RUNTIME), ("cudaGraphLaunch", RUNTIME),
            ("cudaMemcpyAsync", RUNTIME)]  # an async copy does not block the host
    census = census_from_events(_call(0, 3, step, [("cudaDeviceSynchronize", RUNTIME)]), cuda=True, compiled=False)
    assert census["kernels"] == {"sm90_gemm": 3} and census["kernels_per_step"] == {"sm90_gemm": 1.0}
    assert census["syncs"] == 4 and census["syncs_per_step"] == 1.0  # the prefill's one is per call only
    assert census["cuda_graph_replays"] == 3


def test_graph_breaks_are_graphs_per_compiled_call_minus_one_with_their_reasons() -> None:
    step = [("Torch-Compiled Region: 0/0", REGION), ("## Call CompiledFxGraph a ##", GRAPH),
            ("## Call CompiledFxGraph b ##", GRAPH), ("## Call CompiledFxGraph b ##", GRAPH)]
    census = census_from_events(_call(0, 5, step, []), cuda=False, compiled=True, recompiles=0,
                                graph_break_reasons=["Unsupported Tensor.item() call\n  Explanation: ..."])
    assert census["graph_breaks"] == 2 and census["unique_graphs"] == 2 and census["compiled_calls"] == 5
    assert census["graph_break_reasons"] == ["Unsupported Tensor.item() call"]
    whole = census_from_events(_call(0, 5, step[:2], []), cuda=False, compiled=True, recompiles=0,
                               graph_break_reasons=["an old reason"])
    assert whole["graph_breaks"] == 0 and whole["graph_break_reasons"] == []  # no break: no reason shown


def test_a_compiled_configuration_whose_forward_ran_eagerly_says_so_instead_of_zero_breaks() -> None:
    census = census_from_events(_call(0, 2, [("aten::mm", OP)], []), cuda=False, compiled=True, recompiles=None)
    assert census["graph_breaks"] is None and "ran eagerly" in census["unavailable"]["graph_breaks"]
    assert "recompiles" in census["unavailable"]


def test_generate_batch_has_no_steps_to_mark() -> None:
    census = census_from_events(_call(0, 0, [], [("aten::mm", OP)]), cuda=False, compiled=False, steps_known=False)
    assert census["ops_per_step"] is None and census["decode_steps"] is None
    assert "generate_batch" in census["unavailable"]["ops_per_step"]
    # its forwards run in a thread the profiler does not record: no count, rather than the few the caller's ran
    assert census["ops"] is None and census["ops_total"] is None and "own thread" in census["unavailable"]["ops"]


def _row(ops_step: dict[str, float], ops: dict[str, int], **extra: Any) -> dict[str, Any]:
    census = {"ops": ops, "ops_total": sum(ops.values()), "ops_per_step": ops_step, "decode_steps": 4,
              "graph_breaks": None, "recompiles": None, "syncs": None, "kernels": None,
              "unavailable": {"graph_breaks": "not a compiled configuration", "recompiles": "not a compiled configuration",
                              "syncs": "CPU: no device for the host to wait on"}, **extra}
    return {"nodeid": "t.py::t", "outcome": "passed", "optimized": {"latency_s": 0.1}, "census":
            {"optimized": census, "baseline": census, "why_not": {}}}


OLD = _row({"aten::mm": 48.0}, {"aten::mm": 200, "aten::cat": 12})
NEW = _row({"aten::mm": 50.0}, {"aten::mm": 208, "aten::cat": 11})


def test_a_census_change_reads_per_step_where_the_step_changed_and_per_call_otherwise() -> None:
    lines = map_changes(OLD["census"]["optimized"], NEW["census"]["optimized"])
    assert lines == ["aten::mm +2 per step (48 -> 50)", "aten::cat -1 per call (12 -> 11)"]


def test_ops_zero_fails_any_change_and_names_it_and_a_relative_limit_allows_a_share() -> None:
    result = compare_test(OLD, NEW, parse_compare_fail("ops:0"))
    assert result["verdict"] == "regressed"
    assert "aten::mm +2 per step (48 -> 50)" in result["details"][0], result
    (record,) = result["judged"]
    assert record["rule"] == "exact" and record["old"] == 212 and record["new"] == 219
    # 9 counts changed of 212: 4.2%
    assert compare_test(OLD, NEW, parse_compare_fail("ops:5%"))["verdict"] == "ok"
    assert compare_test(OLD, NEW, parse_compare_fail("ops:4%"))["verdict"] == "regressed"
    assert compare_test(OLD, OLD, parse_compare_fail("ops:0"))["verdict"] == "ok"


def test_graph_breaks_growing_regress_with_the_reason_and_shrinking_improve() -> None:
    broken = _row({}, {"aten::mm": 1}, graph_breaks=1, graph_break_reasons=["Unsupported Tensor.item() call"])
    whole = _row({}, {"aten::mm": 1}, graph_breaks=0, graph_break_reasons=[])
    result = compare_test(whole, broken, parse_compare_fail("graph_breaks:0"))
    assert result["verdict"] == "regressed"
    assert result["details"][0].startswith("graph breaks 0 -> 1: Unsupported Tensor.item() call"), result
    assert compare_test(broken, whole, parse_compare_fail("graph_breaks:0"))["verdict"] == "improved"
    # an eager configuration has no graph to break: 0 on both sides, judged
    assert compare_test(OLD, OLD, parse_compare_fail("graph_breaks:0"))["verdict"] == "ok"


def test_a_count_one_side_could_not_give_is_inconclusive_never_ok() -> None:
    result = compare_test(OLD, NEW, parse_compare_fail("syncs:0"))
    assert result["verdict"] == "inconclusive"
    assert "CPU: no device for the host to wait on" in result["details"][0]
    earlier = {k: v for k, v in OLD.items() if k != "census"}  # a report written before the census
    assert compare_test(earlier, NEW, parse_compare_fail("ops:0"))["verdict"] == "inconclusive"


def _timed(row: dict[str, Any], latencies: list[float]) -> dict[str, Any]:
    import statistics

    return {**row, "optimized": {"latency_s": statistics.median(latencies), "latency_samples_s": latencies,
                                 "rounds": len(latencies)}}


@pytest.mark.parametrize("new_row, cause", [(NEW, "the census changed: aten::mm +2 per step (48 -> 50)"),
                                            (OLD, UNCHANGED)])
def test_a_regressed_timing_verdict_carries_the_census_difference_as_its_cause(new_row: dict[str, Any],
                                                                               cause: str) -> None:
    old = _timed(OLD, [0.100, 0.101, 0.099, 0.100, 0.100, 0.102])
    new = _timed(new_row, [0.200, 0.201, 0.199, 0.200, 0.202, 0.200])
    result = compare_test(old, new, parse_compare_fail("latency:10%"))
    assert result["verdict"] == "regressed"
    assert result["cause"]["text"].startswith(cause), result["cause"]
    faster = _timed(new_row, [0.050, 0.051, 0.049, 0.050, 0.050, 0.052])
    improved = compare_test(old, faster, parse_compare_fail("latency:10%"))
    assert improved["verdict"] == "improved" and "cause" not in improved  # nothing to explain


def test_the_cause_says_when_a_side_has_no_census() -> None:
    cause = census_cause({"census": None}, NEW)
    assert cause == {"changed": None, "lines": [], "text": "no census in the old run (an earlier report, or --opt-census=off)"}
