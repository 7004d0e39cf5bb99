"""The census in the window's verdicts and in the renderings, without a model: a census threshold judged exactly
against the window's newest run, a timed verdict's census cause, and the cause and census as the terminal, the
Markdown report and the HTML page show them.

The window's runs are a real report of an earlier layout (``tests/data/reports``) given a hand-written census and
copied into a history folder, as ``test_compare_window_unit.py`` builds its windows.
"""

from __future__ import annotations

import copy
import datetime as dt
import html
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pytest_transformers_opt.report.compare import summarise
from pytest_transformers_opt.report.html import render_html
from pytest_transformers_opt.report.markdown import render_markdown
from pytest_transformers_opt.report.schema import validate_report
from pytest_transformers_opt.report.view import census_table, regression_text
from pytest_transformers_opt.report.window import compare_with_window, regressed_entries
from pytest_transformers_opt.verdict.compare import attach_verdicts, parse_compare_fail

LAYOUT = Path(__file__).parents[1] / "data" / "reports" / "layout-17-f347164.json"
NODEID = "test_layout_run.py::test_sdpa"
START = dt.datetime(2026, 11, 20, 10, 0, tzinfo=dt.timezone.utc)
QUIET = [0.98, 0.99, 0.99, 1.0, 1.0, 1.0, 1.01, 1.01, 1.02]  # a window whose latency spread is about 1.5%
STEPS = 4


def census(extra_mm_per_step: int = 0, *, breaks: int | None = None) -> dict[str, Any]:
    """A CPU census of one generate call (``STEPS`` decode steps): 10 ``aten::linear`` and 4 ``aten::add`` a step,
    and ``extra_mm_per_step`` ``aten::mm``; ``breaks``: a compiled configuration's graph breaks."""
    per_step = {"aten::add": 4.0, "aten::linear": 10.0, **({"aten::mm": float(extra_mm_per_step)}
                                                           if extra_mm_per_step else {})}
    ops = {name: int(count * STEPS) + 3 for name, count in per_step.items()}  # and the prefill's
    compiled = breaks is not None
    unavailable = {"kernels": "CPU: the ATen ops are what runs (ops); kernels are counted on CUDA",
                   "syncs": "CPU: no device for the host to wait on"}
    if not compiled:
        unavailable.update({key: "not a compiled configuration" for key in ("graph_breaks", "unique_graphs",
                                                                            "recompiles")})
    return {"generate_calls": 1, "ops": ops, "ops_total": sum(ops.values()), "decode_steps": STEPS,
            "ops_per_step": per_step, "graph_breaks": breaks,
            "graph_break_reasons": ["Tensor.item() in LlamaAttention.forward"] if breaks else [],
            "unique_graphs": (breaks or 0) + 1 if compiled else None, "compiled_calls": 5 if compiled else None,
            "recompiles": 0 if compiled else None, "kernels": None, "kernels_total": None, "kernels_per_step": None,
            "syncs": None, "syncs_per_step": None, "cuda_graph_replays": None, "unavailable": unavailable}


def _template() -> dict[str, Any]:
    report = json.loads(LAYOUT.read_text())
    report["tests"] = [test for test in report["tests"] if test["nodeid"] == NODEID]
    report["tests"][0]["ab"] = None
    report["summary"] = {"passed": 1, "failed": 0, "skipped": 0, "error": 0}
    return report


TEMPLATE = _template()


def _run(factor: float = 1.0, optimized: dict[str, Any] | None = None, *, counted: bool = True) -> dict[str, Any]:
    """The template run, its optimized latency (and rounds) ``factor`` times as long, with ``optimized`` as its
    optimized side's census (and the plain census as the baseline's); ``counted=False``: no census at all."""
    report = copy.deepcopy(TEMPLATE)
    row = report["tests"][0]
    row["optimized"]["latency_s"] *= factor
    row["optimized"]["latency_samples_s"] = [sample * factor for sample in row["optimized"]["latency_samples_s"]]
    if counted:
        row["census"] = {"optimized": optimized if optimized is not None else census(), "baseline": census(),
                         "why_not": {}}
    return report


def _record(folder: Path, runs: list[dict[str, Any]]) -> list[str]:
    """Write ``runs`` (oldest first) into ``folder`` as --opt-history names them, an hour apart."""
    folder.mkdir(exist_ok=True)
    names = []
    for hour, report in enumerate(runs):
        moment = START + dt.timedelta(hours=hour)
        report = copy.deepcopy(report)
        report["created"] = moment.isoformat()
        validate_report(report)
        names.append(f"{moment.strftime('%Y%m%dT%H%M%SZ')}.json")
        (folder / names[-1]).write_text(json.dumps(report))
    return names


def _compare(folder: Path, today: dict[str, Any], spec: str) -> tuple[Any, dict[str, Any]]:
    comparison = compare_with_window(str(folder), today, parse_compare_fail(spec), 10)
    attach_verdicts(today, comparison.verdicts)
    validate_report(today)  # the census records and the cause are the schema's
    return comparison, today["tests"][0]["regression"]


# --------------------------------------------------------------------------- the window


def test_a_census_threshold_is_judged_exactly_against_the_windows_newest_run_not_its_median(tmp_path: Path) -> None:
    folder = tmp_path / "history"
    # the window's median census has no aten::mm; its newest run (a change recorded last) has 2 a step
    names = _record(folder, [*[_run(f) for f in QUIET[:-1]], _run(QUIET[-1], census(2))])
    _, regression = _compare(folder, _run(1.0, census(2)), "ops:0")
    assert regression["verdict"] == "ok", regression  # the window rule, on the median of ops_total, would regress
    (record,) = regression["judged"]
    assert record["rule"] == "exact" and record["changes"] == [] and "spread" not in record
    detail = regression["details"][1]
    assert detail.startswith(f"against {names[-1]}, the window's newest run with ops counted (a census is exact")
    assert "the window's runs held 2 different ops censuses, the newest stands for them" in detail

    _, regression = _compare(folder, _run(1.0, census(3)), "ops:0")
    assert regression["verdict"] == "regressed"
    assert regression["details"][1].endswith("aten::mm +1 per step (2 -> 3): regressed"), regression["details"]
    assert "cause" not in regression  # no timed threshold: a cause explains a timing verdict


def test_a_graph_break_fails_graph_breaks_zero_against_a_window_of_equal_censuses(tmp_path: Path) -> None:
    folder = tmp_path / "history"
    _record(folder, [_run(f, census(breaks=0)) for f in QUIET])
    _, regression = _compare(folder, _run(1.0, census(breaks=1)), "graph_breaks:0,recompiles:0")
    assert regression["verdict"] == "regressed"
    breaks = next(d for d in regression["details"] if "graph breaks 0 -> 1" in d)
    assert "Tensor.item() in LlamaAttention.forward" in breaks and "different" not in breaks  # one census held


def test_a_census_threshold_against_runs_without_a_census_is_inconclusive_with_the_reason(tmp_path: Path) -> None:
    folder = tmp_path / "history"
    _record(folder, [_run(f, counted=False) for f in QUIET])
    _, regression = _compare(folder, _run(1.0), "ops:5%")
    assert regression["verdict"] == "inconclusive"
    assert "ops not counted in the recorded run: an earlier report, or --opt-census=off" \
        in regression["details"][1]


def test_a_timed_window_verdict_carries_the_census_change_as_its_cause(tmp_path: Path) -> None:
    folder = tmp_path / "history"
    _record(folder, [_run(f) for f in QUIET])
    comparison, regression = _compare(folder, _run(1.5, census(2)), "latency:10%,ops:0")
    assert regression["verdict"] == "regressed"
    assert regression["cause"] == {"changed": True, "lines": ["aten::mm +2 per step (0 -> 2)"],
                                   "text": "the census changed: aten::mm +2 per step (0 -> 2)"}
    (line,) = [text for text in comparison.lines if text.startswith("REGRESSED ")]
    assert line.endswith("; cause: the census changed: aten::mm +2 per step (0 -> 2)"), line

    _, slower = _compare(folder, _run(1.5), "latency:10%")  # slower, running the same: the machine or arithmetic
    assert slower["cause"]["changed"] is False
    assert slower["cause"]["text"] == "the census did not change: the same ops ran, so a timing difference is the arithmetic's or the machine's"
    _, same = _compare(folder, _run(1.0, census(2)), "latency:10%")
    assert same["verdict"] == "ok" and "cause" not in same  # only a regressed or inconclusive timing verdict


def test_only_a_measured_figure_makes_a_test_a_suspect_to_measure_again(tmp_path: Path) -> None:
    folder = tmp_path / "history"
    _record(folder, [_run(f) for f in QUIET])
    environment = TEMPLATE["environment"]

    def suspects(spec: str, today: dict[str, Any]) -> list[dict[str, Any]]:
        settings = SimpleNamespace(compare_history=str(folder), compare_thresholds=parse_compare_fail(spec),
                                   compare_window=10)
        return regressed_entries(settings, environment, today["tests"])

    assert suspects("ops:0,latency:10%", _run(1.0, census(2))) == []  # a census counts the same again
    assert len(suspects("ops:0,latency:10%", _run(1.5, census(2)))) == 1


# --------------------------------------------------------------------------- the renderings


def _judged_report(tmp_path: Path) -> dict[str, Any]:
    folder = tmp_path / "history"
    _record(folder, [_run(f) for f in QUIET])
    today = _run(1.5, census(2))
    comparison, _ = _compare(folder, today, "latency:10%")
    today["compare"] = {"against": f"--opt-compare={folder}", "reference": "window", "window": 10,
                        "gate": "latency:10%", "counts": {"regressed": 1}}
    assert any("cause: the census changed" in line for line in comparison.lines)
    return today


def test_markdown_and_html_show_the_cause_beside_the_verdict(tmp_path: Path) -> None:
    report = _judged_report(tmp_path)
    row = report["tests"][0]
    cause = "the census changed: aten::mm +2 per step (0 -> 2)"
    assert regression_text(row).startswith("regressed: against a window of 9 runs")
    assert regression_text(row).endswith(f"; cause: {cause}")
    assert cause not in regression_text(row, with_cause=False)
    assert f"cause: {cause} |".replace(">", "\\>") in render_markdown(report)  # the Regression cell's end
    page = render_html(report)
    assert f'<span class="reason cause">cause: {html.escape(cause)}</span>' in page


def test_the_html_page_has_each_tests_census_per_call_and_per_step(tmp_path: Path) -> None:
    report = _run(1.0, census(2, breaks=1))
    row = report["tests"][0]
    table = census_table(row)
    assert table is not None and table.why_not is None
    figures = {label: (optimized, baseline) for label, optimized, baseline in table.rows}
    assert figures["Ops per call"][0] == "73 (3 kinds): aten::linear 43, aten::add 19, aten::mm 11"
    assert figures["Ops per decode step"][0] == "16 (3 kinds): aten::linear 10, aten::add 4, aten::mm 2 (over 4 steps)"
    assert figures["Graph breaks"] == ("1: Tensor.item() in LlamaAttention.forward",
                                       "- (not a compiled configuration)")
    assert figures["Kernels per call"][0] == "- (CPU: the ATen ops are what runs (ops); kernels are counted on CUDA)"
    assert "Kernels per decode step" not in figures and "CUDA graph replays" not in figures  # said above / none
    page = render_html(report)
    assert '<section id="census"><h2>Execution census</h2>' in page
    assert "<td>Ops per decode step</td>" in page and html.escape("Tensor.item() in LlamaAttention.forward") in page

    row["census"] = {"optimized": None, "baseline": None,
                     "why_not": {"optimized": "--opt-census=off", "baseline": "--opt-census=off"}}
    assert census_table(row) is not None and census_table(row).why_not == "--opt-census=off"  # type: ignore[union-attr]
    assert "not taken (--opt-census=off)" in render_html(report)
    del row["census"]  # an earlier report: no section at all
    assert 'id="census"' not in render_html(report)


def test_the_terminal_says_the_cause_of_a_regressed_and_an_inconclusive_verdict_only() -> None:
    cause = {"changed": True, "lines": ["aten::mm +2 per step (0 -> 2)"],
             "text": "the census changed: aten::mm +2 per step (0 -> 2)"}
    verdicts = {"t::a": {"verdict": "regressed", "details": ["latency 1 -> 2: regressed"], "cause": cause},
                "t::b": {"verdict": "inconclusive", "details": ["latency 1 -> 1.2: inconclusive"], "cause": cause},
                "t::c": {"verdict": "ok", "details": ["latency 1 -> 1: ok"]}}
    lines = summarise(verdicts, "old.json")
    assert lines[:2] == ["REGRESSED t::a: latency 1 -> 2; cause: the census changed: aten::mm +2 per step (0 -> 2)",
                         "INCONCLUSIVE t::b: latency 1 -> 1.2; cause: the census changed: aten::mm +2 per step (0 -> 2)"]
