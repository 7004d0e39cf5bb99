"""Unit tests of ``report/window.py`` (``--opt-compare=DIR``) and the small statistics it rests on.

The window's runs are a real report of today's layout (``tests/data/reports``) copied into a history folder
with their figures, times, hardware and versions edited, so no model runs here.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from pytest_transformers_opt.report.schema import validate_report
from pytest_transformers_opt.report.window import compare_with_window, regressed_entries
from pytest_transformers_opt.verdict.compare import INCONCLUSIVE, Threshold, attach_verdicts, nothing_judged
from pytest_transformers_opt.verdict.window_rule import MIN_TIMED_SPREAD, adjust, window_figure
from pytest_transformers_opt.verdict.stats import (MIN_WINDOW_RUNS, benjamini_hochberg, robust_spread, student_t_isf,
                                                   student_t_sf)

LAYOUT = Path(__file__).parents[1] / "data" / "reports" / "layout-17-f347164.json"
NODEID = "test_layout_run.py::test_sdpa"
LATENCY = Threshold("latency", 10.0, True)
START = dt.datetime(2026, 11, 20, 10, 0, tzinfo=dt.timezone.utc)
# per-run medians around 1.0 with a 1.4826 x MAD spread of about 1.5% ("quiet") and 11.9% ("noisy")
QUIET = [0.98, 0.99, 0.99, 1.0, 1.0, 1.0, 1.0, 1.01, 1.01, 1.02]
NOISY = [0.84, 0.88, 0.92, 0.96, 1.0, 1.0, 1.04, 1.08, 1.12, 1.16]


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("t", [-4.0, -0.3, 0.0, 0.5, 1.0, 3.0, 40.0, 1e6])
def test_student_t_tail_matches_the_closed_forms(t: float) -> None:
    assert student_t_sf(t, 1.0) == pytest.approx(0.5 - math.atan(t) / math.pi, rel=1e-9, abs=1e-15)
    assert student_t_sf(t, 2.0) == pytest.approx(0.5 * (1 - t / math.sqrt(t * t + 2)), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize(("p", "df", "t"), [(0.05, 9, 1.833), (0.01, 9, 2.821), (0.05, 30, 1.697),
                                            (0.001, 4, 7.173), (0.05, 1, 6.314)])
def test_student_t_critical_values_match_the_tables(p: float, df: float, t: float) -> None:
    assert student_t_isf(p, df) == pytest.approx(t, abs=1e-3)
    assert student_t_sf(student_t_isf(p, df), df) == pytest.approx(p, rel=1e-9)


def test_student_t_agrees_with_scipy_for_fractional_degrees_of_freedom() -> None:
    stats = pytest.importorskip("scipy.stats")
    for df in (0.74, 1.48, 3.33, 10.7):
        for t in (0.1, 1.5, 6.0, 300.0):
            assert student_t_sf(t, df) == pytest.approx(float(stats.t.sf(t, df)), rel=1e-9)
        assert student_t_isf(0.05 / 150, df) == pytest.approx(float(stats.t.isf(0.05 / 150, df)), rel=1e-8)


def test_benjamini_hochberg_adjusts_in_the_order_given() -> None:
    assert benjamini_hochberg([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.04 * 4 / 3, 0.04 * 4 / 3, 0.2])
    assert benjamini_hochberg([]) == []
    assert benjamini_hochberg([0.5]) == [0.5]


def test_robust_spread_is_the_mad_or_where_most_runs_agree_the_mean_deviation() -> None:
    center, spread = robust_spread(NOISY)
    assert center == 1.0 and spread == pytest.approx(1.4826 * 0.08)
    center, spread = robust_spread([100.0] * 8 + [107.0] * 2)  # MAD 0, but two runs differ
    assert center == 100.0 and spread == pytest.approx(math.sqrt(math.pi / 2) * 1.4)
    assert robust_spread([5.0] * 6) == (5.0, 0.0)


# --------------------------------------------------------------------------- the rule


def _judged(threshold: Threshold, values: list[float], today: float, family: int = 1) -> Any:
    """One figure judged on its window among ``family - 1`` others whose runs did not change."""
    figure = window_figure(threshold, values, today)
    assert figure is not None
    others = [window_figure(threshold, values, 1.0) for _ in range(family - 1)]
    adjust([figure, *[other for other in others if other is not None]])
    return figure


def test_a_quiet_window_flags_a_slowdown_past_the_limit_and_passes_a_null_run() -> None:
    slowed = _judged(LATENCY, QUIET, 1.15)
    assert slowed.verdict == "regressed" and slowed.p_worse_adjusted < 0.05
    assert slowed.detectable < 15.0 and slowed.spread_pct == pytest.approx(1.4826, rel=1e-3)
    for today in (0.97, 1.0, 1.03):
        assert _judged(LATENCY, QUIET, today).verdict == "ok"
    assert _judged(LATENCY, QUIET, 0.85).verdict == "improved"
    # past the limit within the window's noise: never a silent ok, whatever the window's detectable size
    past = _judged(LATENCY, QUIET, 1.11)
    assert past.verdict == INCONCLUSIVE and past.detectable < 2 * LATENCY.limit and past.p_worse_adjusted > 0.05
    assert past.detail().endswith(", adjusted p=" + f"{past.p_worse_adjusted:.2g}" + ": inconclusive")


def test_a_noisy_window_is_inconclusive_with_its_detectable_size_unless_the_change_is_huge() -> None:
    null = _judged(LATENCY, NOISY, 1.02)
    assert null.verdict == INCONCLUSIVE and null.detectable > 2 * LATENCY.limit
    assert _judged(LATENCY, NOISY, 1.15).verdict == INCONCLUSIVE  # a real 15% could be this window's noise
    assert _judged(LATENCY, NOISY, 3.0).verdict == "regressed"  # significant whatever the noise
    assert null.detail().endswith(": inconclusive") and "spread 11.9%, detectable " in null.detail()


def test_the_family_adjustment_takes_back_a_borderline_regression_among_many_tests() -> None:
    spread = [0.98, 0.985, 0.99, 0.995, 1.0, 1.0, 1.005, 1.01, 1.015, 1.02]  # about 1.1%
    probe = window_figure(LATENCY, spread, 1.0)
    assert probe is not None
    # today's worsening where the one-sided p-value is 0.01: significant alone, not among 150 (Benjamini-Hochberg)
    borderline = 1.0 + (LATENCY.limit + student_t_isf(0.01, probe.df) * probe.scale) / 100
    alone = _judged(LATENCY, spread, borderline)
    assert alone.p_worse == pytest.approx(0.01, rel=1e-6) and alone.verdict == "regressed"
    crowded = _judged(LATENCY, spread, borderline, family=150)
    assert crowded.p_worse == pytest.approx(0.01, rel=1e-6) and crowded.p_worse_adjusted > 0.05
    assert crowded.verdict != "regressed" and crowded.detectable > alone.detectable


def test_identical_timed_runs_get_a_floor_and_identical_memory_none() -> None:
    same = [0.0100] * 10
    near = _judged(Threshold("latency", 0.5, True), same, 0.01008)  # 0.8% past a 0.5% limit, 0 spread
    assert near.floored and near.spread_pct == pytest.approx(100 * MIN_TIMED_SPREAD)
    assert near.verdict != "regressed" and "spread 0.5% (floor)" in near.detail()
    assert near.record()["note"] == "spread floored at 0.5% of the median"
    assert _judged(LATENCY, same, 0.0115).verdict == "regressed"
    memory = Threshold("peak_memory", 5.0, True)  # read once per run: identical runs are its real spread
    assert _judged(memory, [2.0**20] * 10, 1.06 * 2**20).verdict == "regressed"
    steady = _judged(memory, [2.0**20] * 10, 1.04 * 2**20)
    assert steady.verdict == "ok" and not steady.floored and steady.detectable == memory.limit


def test_too_few_runs_or_a_zero_median_leave_the_rule_to_the_newest_run() -> None:
    assert window_figure(LATENCY, QUIET[: MIN_WINDOW_RUNS - 1], 1.0) is None
    assert window_figure(Threshold("kl_mean", 5.0, True), [0.0] * 10, 0.1) is None


# --------------------------------------------------------------------------- a history folder


def _template() -> dict[str, Any]:
    report = json.loads(LAYOUT.read_text())
    report["tests"] = [test for test in report["tests"] if test["nodeid"] == NODEID]
    report["tests"][0]["ab"] = None
    report["summary"] = {"passed": 1, "failed": 0, "skipped": 0, "error": 0}
    return report


TEMPLATE = _template()
LATENCY_S = TEMPLATE["tests"][0]["optimized"]["latency_s"]


def _run(factor: float, *, hardware: str | None = None, transformers: str | None = None,
         outcome: str = "passed") -> dict[str, Any]:
    """The template run with its optimized latency (and rounds) ``factor`` times as long."""
    report = copy.deepcopy(TEMPLATE)
    row, env = report["tests"][0], report["environment"]
    optimized = row["optimized"]
    optimized["latency_s"] *= factor
    optimized["latency_samples_s"] = [sample * factor for sample in optimized["latency_samples_s"]]
    row["outcome"] = outcome
    if hardware is not None:
        row["hardware"] = env["hardware"] = hardware
    if transformers is not None:
        env["transformers"] = env["versions"]["transformers"] = transformers
    return report


def _record(folder: Path, runs: list[dict[str, Any]], start: dt.datetime = START) -> list[str]:
    """Write ``runs`` (oldest first) into ``folder`` as --opt-history names them, an hour apart."""
    folder.mkdir(exist_ok=True)
    names = []
    for hour, report in enumerate(runs):
        moment = start + dt.timedelta(hours=hour)
        report = copy.deepcopy(report)
        report["created"] = moment.isoformat()
        validate_report(report)
        names.append(f"{moment.strftime('%Y%m%dT%H%M%SZ')}.json")
        (folder / names[-1]).write_text(json.dumps(report))
    return names


def _compare(folder: Path, today: dict[str, Any], spec: str = "latency:10%", size: int = 10) -> Any:
    thresholds = [Threshold("latency", 10.0, True)] if spec == "latency:10%" else []
    comparison = compare_with_window(str(folder), today, thresholds, size)
    attach_verdicts(today, comparison.verdicts)
    validate_report(today)  # the records the comparison attached are the schema's
    return comparison, today["tests"][0]["regression"]


def test_other_hardware_is_never_pooled_and_a_stack_change_is_said(tmp_path: Path) -> None:
    folder = tmp_path / "history"
    # oldest first: another machine, twice as fast (pooled, it would make today regress); then the old stack,
    # also twice as fast; then this stack's quiet runs
    names = _record(folder, [*[_run(0.5, hardware="NVIDIA H200") for _ in range(4)],
                             *[_run(0.5, transformers="5.22.0") for _ in range(4)],
                             *[_run(factor) for factor in QUIET[:6]]])
    comparison, regression = _compare(folder, _run(1.0))
    assert regression["verdict"] == "ok"
    assert regression["reference"] == {"kind": "window", "runs": 6, "first": "2026-11-20T18:00:00+00:00",
                                       "last": "2026-11-20T23:00:00+00:00", "source": str(folder)}
    assert regression["details"][0] == "against a window of 6 runs, 2026-11-20"
    assert regression["details"][1] == (f"the stack changed since run {names[7]} (transformers 5.22.0 -> 5.24.0): "
                                        f"judged against the 6 runs of this stack")
    (judged,) = regression["judged"]
    assert judged["rule"] == "window" and judged["runs"] == 6 and judged["old"] == pytest.approx(
        LATENCY_S * statistics.median(QUIET[:6]))
    assert f"stack changed (1 test): {regression['details'][1]}" in comparison.lines
    assert comparison.said  # a changed stack is said in every verbosity mode


def test_no_run_of_this_stack_or_hardware_is_not_comparable_with_the_reason(tmp_path: Path) -> None:
    folder = tmp_path / "history"
    names = _record(folder, [_run(factor, transformers="5.22.0") for factor in QUIET])
    comparison, regression = _compare(folder, _run(1.0))
    assert regression == {"verdict": "not comparable", "details": [
        f"the stack changed since run {names[-1]} (transformers 5.22.0 -> 5.24.0): no recorded run of this stack"]}
    assert nothing_judged(comparison.verdicts) is not None  # a gate that judged nothing fails, as with one report
    _record(folder, [_run(1.0), _run(1.0)], START + dt.timedelta(days=1))  # two runs of the new stack since
    _, regression = _compare(folder, _run(1.0))
    assert regression == {"verdict": "new", "details": [
        f"building the history (2 of {MIN_WINDOW_RUNS} runs of this test on this hardware and stack; judged from "
        f"{MIN_WINDOW_RUNS})",
        f"the stack changed since run {names[-1]} (transformers 5.22.0 -> 5.24.0): 2 runs of this stack recorded so "
        f"far"]}
    _, regression = _compare(folder, _run(1.0, hardware="NVIDIA H200", transformers="5.22.0"))
    assert regression["verdict"] == "not comparable"
    assert regression["details"] == ["measured on different hardware: no recorded run on 'NVIDIA H200' (recorded "
                                     "on 'CPU: AMD EPYC')"]


def test_failed_runs_are_left_out_and_a_short_window_is_still_building_the_history(tmp_path: Path) -> None:
    """Issue 40, item 4: fewer runs than a spread needs are recorded, not judged, and the run says how far the
    history has got (it is no failure: nothing was judged for lack of runs, not for lack of a measurement)."""
    folder = tmp_path / "history"
    _record(folder, [_run(1.0), _run(1.0), _run(1.0, outcome="failed"), _run(0.5)])
    comparison, regression = _compare(folder, _run(1.0))
    assert regression == {"verdict": "new", "details": [
        f"building the history (3 of {MIN_WINDOW_RUNS} runs of this test on this hardware and stack; judged from "
        f"{MIN_WINDOW_RUNS})"]}
    assert f"building the history (1 test): 3 of {MIN_WINDOW_RUNS} runs on this hardware and stack; recorded, not " \
           f"judged, until {MIN_WINDOW_RUNS}" in comparison.lines
    assert comparison.empty and comparison.said  # said in every verbosity; the gate does not fail on it


def test_a_noisy_window_is_inconclusive_in_the_summary_and_a_slowdown_is_a_suspect(tmp_path: Path) -> None:
    folder = tmp_path / "history"
    _record(folder, [_run(factor) for factor in NOISY])
    comparison, regression = _compare(folder, _run(1.0))
    assert regression["verdict"] == INCONCLUSIVE
    (judged,) = regression["judged"]
    assert judged["verdict"] == INCONCLUSIVE and judged["detectable"] > 20 and judged["spread_pct"] == pytest.approx(
        11.86, abs=0.01)
    inconclusive = [line for line in comparison.lines if line.startswith("INCONCLUSIVE ")]
    assert len(inconclusive) == 1 and "spread 11.9%, detectable " in inconclusive[0]
    assert comparison.lines[-1].startswith("compare: 0 regressed, 1 inconclusive, 0 improved, 0 ok, 0 new, "
                                           "0 not comparable (against the window of up to 10 runs in ")
    assert nothing_judged(comparison.verdicts) is None  # judged, not passed silently: listed and counted
    settings = type("Settings", (), {"compare_history": str(folder), "compare_window": 10,
                                     "compare_thresholds": [LATENCY]})()
    today = _run(3.0)
    assert regressed_entries(settings, today["environment"], today["tests"]) == today["tests"]
    assert regressed_entries(settings, today["environment"], _run(1.0)["tests"]) == []


def test_an_empty_folder_is_a_first_run_and_a_broken_file_is_left_out(tmp_path: Path) -> None:
    comparison, regression = _compare(tmp_path / "missing", _run(1.0))
    assert comparison.empty and regression["verdict"] == "new"
    assert comparison.lines[0].startswith(f"building the history: 0 of {MIN_WINDOW_RUNS} runs recorded in "
                                          f"{tmp_path / 'missing'}; nothing is judged until a test has")
    folder = tmp_path / "history"
    _record(folder, [_run(factor) for factor in QUIET])
    (folder / "20261121T000000Z.json").write_text("{not json")
    comparison, regression = _compare(folder, _run(1.0))
    assert regression["verdict"] == "ok" and regression["reference"]["runs"] == 10
    assert any(line.startswith("note: 1 file left out of the window: 20261121T000000Z.json: ")
               for line in comparison.lines)


def test_merge_compares_the_merged_shards_with_the_window_of_a_history_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``pytest-opt merge ... --compare DIR``: the merged report judged as pytest --opt-compare=DIR judges a run."""
    from pytest_transformers_opt import cli

    folder = tmp_path / "history"
    _record(folder, [_run(factor) for factor in QUIET])
    for factor, status in ((3.0, 1), (1.0, 0)):
        shard = tmp_path / f"shard-{factor}.json"
        shard.write_text(json.dumps(_run(factor)))
        merged = tmp_path / f"merged-{factor}.json"
        code = cli.main(["merge", str(shard), "-o", str(merged), "--compare", str(folder),
                         "--compare-fail", "latency:10%"])
        out, err = capsys.readouterr()
        assert code == status, (out, err)
        regression = json.loads(merged.read_text())["tests"][0]["regression"]
        assert regression["reference"]["kind"] == "window" and regression["reference"]["runs"] == 10
        if status:
            assert regression["verdict"] == "regressed" and "REGRESSED " in out
            assert "1 test regressed past --compare-fail=latency:10%" in err
        else:
            assert regression["verdict"] == "ok" and "compare: 0 regressed, 0 inconclusive, 0 improved, 1 ok" in out
    # a window size outside its range, or without a folder: one line, exit 2
    for extra, said in ((["--compare", str(folder), "--compare-window", "3"], "--compare-window"),
                        (["--compare-window", "10"], "--compare-window: needs --compare DIR")):
        assert cli.main(["merge", str(shard), "-o", str(tmp_path / "x.json"), *extra]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert said in line


def test_a_figure_too_few_runs_have_is_judged_as_two_reports_of_the_rows_own_device(tmp_path: Path) -> None:
    """TTFT kept by only the newest two of ten runs (a report layout that began keeping it): judged against the
    newest run as against one report, with the between-run default of the device the rows ran on, a GPU's here."""
    def on_gpu(run: dict[str, Any], ttft: bool) -> dict[str, Any]:
        run["environment"]["device"] = "cuda:0"
        if not ttft:
            run["tests"][0]["optimized"]["ttft_s"] = None
            run["tests"][0]["optimized"]["ttft_samples_s"] = []
        return run

    folder = tmp_path / "history"
    _record(folder, [on_gpu(_run(factor), ttft=i >= 8) for i, factor in enumerate(QUIET)])
    comparison = compare_with_window(str(folder), on_gpu(_run(1.0), ttft=True), [Threshold("ttft", 10.0, True)], 10)
    (result,) = comparison.verdicts.values()
    detail = next(d for d in result["details"] if "alone (2 of the window's runs have ttft)" in d)
    assert "with the GPU default between runs (4% a figure, 2% a speedup;" in detail
