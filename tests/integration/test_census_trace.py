"""--opt-trace (issue 41, item 7): the Chrome trace of each test's census call, kept next to the JSON report for the
tests asked for (all, or the ones the gate flagged), linked from the row and the HTML report; the others deleted,
and the session's temporary folder with them."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

TWO_TESTS = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_attention(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=3)

@pytest.mark.optimization("static_cache", max_latency="1 us")
def test_cache_over_budget(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=3)
'''


@pytest.fixture
def own_temp(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The inner session's temporary folder (where it keeps traces until the report is written), its own."""
    folder = pytester.path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _trace(run: Any, name: str) -> Path:
    row = run.test(name)
    assert isinstance(row["trace"], str), row.get("trace")
    path = run.report_path.parent / row["trace"]
    assert path.is_file(), path
    return path


def test_all_writes_each_tests_trace_next_to_the_report_linked_from_the_row_and_the_html(
        run_user: Any, pytester: pytest.Pytester, own_temp: Path) -> None:
    html = pytester.path / "pages" / "report.html"
    html.parent.mkdir()
    run = run_user(TWO_TESTS, "--opt-rounds=1", "--opt-trace=all", f"--opt-report-html={html}")
    folder = pytester.path / "opt-report.traces"
    traces = {name: _trace(run, name) for name in ("test_attention", "test_cache_over_budget")}
    assert {path.parent for path in traces.values()} == {folder}
    assert run.test("test_attention")["trace"].startswith("opt-report.traces/")
    for path in traces.values():
        trace = json.loads(path.read_text(encoding="utf-8"))
        assert trace["traceEvents"], path  # torch.profiler's Chrome trace, opened in Perfetto as it is
    # the census call's events: its own marks, and sdpa's fused attention op in the sdpa test's trace
    names = {event.get("name") for event in json.loads(traces["test_attention"].read_text())["traceEvents"]}
    assert "pytest_opt::generate" in names and "aten::scaled_dot_product_attention" in names
    # the HTML report (in another folder) links each trace relative to itself
    page = html.read_text(encoding="utf-8")
    assert f'href="../opt-report.traces/{traces["test_attention"].name}"' in page, page
    run.result.stdout.fnmatch_lines([f"transformers-opt: --opt-trace=all: 2 Chrome traces of the census call "
                                     f"written to {folder}"])
    assert not list(own_temp.glob("pytest-opt-traces-*"))  # the session's folder went with the run


def test_regressed_keeps_only_the_flagged_tests_trace_and_deletes_the_rest(
        run_user: Any, pytester: pytest.Pytester, own_temp: Path) -> None:
    stale = pytester.path / "opt-report.traces" / "test_user.py__test_gone.trace.json"
    stale.parent.mkdir()
    stale.write_text("{}", encoding="utf-8")  # an earlier run's trace: not this run's
    run = run_user(TWO_TESTS, "--opt-rounds=1", "--opt-trace=regressed")
    assert run.test("test_cache_over_budget")["failed_budgets"] == ["max_latency"]
    kept = _trace(run, "test_cache_over_budget")
    assert run.test("test_attention")["trace"] is None  # passed, within every budget: its trace deleted
    assert sorted(stale.parent.iterdir()) == [kept]
    assert not list(own_temp.glob("pytest-opt-traces-*"))


def test_without_a_json_report_it_says_once_that_the_traces_need_one(
        pytester: pytest.Pytester, own_temp: Path) -> None:
    pytester.makepyfile(test_user=TWO_TESTS.split("@pytest.mark.optimization(\"static_cache\"")[0])
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-rounds=1", "--opt-warmup=0", "--opt-trace=all")
    assert result.ret == pytest.ExitCode.OK
    out = result.stdout.str()
    assert out.count("--opt-trace=all needs --opt-report-json") == 1, out
    assert not list(own_temp.glob("pytest-opt-traces-*")) and not list(pytester.path.glob("*.traces"))


def _row(tmp: Path, name: str, **verdicts: Any) -> dict[str, Any]:
    trace = tmp / f"{name}.trace.json"
    trace.write_text('{"traceEvents": []}', encoding="utf-8")
    return {"nodeid": name, "trace": str(trace), "failed_budgets": [], **verdicts}


def test_regressed_keeps_what_any_gate_flagged_regressed_or_inconclusive(tmp_path: Path) -> None:
    from pytest_transformers_opt.report.traces import FOLDER_PREFIX, place_traces

    session = tmp_path / f"{FOLDER_PREFIX}x"
    session.mkdir()
    rows = [_row(session, "compare_inconclusive", regression={"verdict": "inconclusive"}),
            _row(session, "ab_regressed", ab={"verdict": "regressed"}),
            _row(session, "over_budget", failed_budgets=["max_latency"]),
            _row(session, "compare_ok", regression={"verdict": "ok"}, ab={"verdict": "improved"})]
    placed = place_traces(rows, "regressed", str(tmp_path / "out" / "report.json"), None)
    assert (placed.kept, placed.traced) == (3, 4)
    assert [row["trace"] for row in rows] == [f"report.traces/{name}.trace.json"
                                             for name in ("compare_inconclusive", "ab_regressed", "over_budget")] + [None]
    assert sorted(p.name for p in (tmp_path / "out" / "report.traces").iterdir()) == [
        "ab_regressed.trace.json", "compare_inconclusive.trace.json", "over_budget.trace.json"]
    assert not session.exists()  # the session's (or a worker's) temporary folder goes with it
