"""The execution census in the window path (--opt-compare=DIR), end to end: a census threshold judged exactly
against the window's newest recorded run, and a latency verdict's census cause in the terminal, the JSON, the
Markdown and the HTML report.

One real session records a run with --opt-history; the window is that run's file copied into a history folder
(named as --opt-history names them, an hour apart, in the past), as ``test_compare_window.py`` builds its windows.
The sessions under test then run for real against that folder, with or without ``EXTRA_MATMUL``: the user's
technique then runs one more ``torch.matmul`` in every decoder layer's forward, as a library release that adds an op
per layer would.
"""

from __future__ import annotations

import copy
import datetime as dt
import html
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from census_techniques import MATMUL_CHANGE, extra_matmul_conftest  # tests/ is on sys.path
from pytest_transformers_opt.report.schema import validate_report

EXTRA_MATMUL = "CENSUS_WINDOW_EXTRA_MATMUL"
CONFTEST = extra_matmul_conftest(f'os.environ.get("{EXTRA_MATMUL}")')
TEST = '''
import pytest

@pytest.mark.optimization("sdpa_plus")
def test_layers(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=5)
'''
NODEID = "test_user.py::test_layers"
ADDED = MATMUL_CHANGE
# the window's latencies as factors of the recorded run's: half as long, with a quiet spread (1.5%), so today's
# run is twice as slow as the window on any machine
FASTER_WINDOW = [0.5 * f for f in (0.98, 0.99, 0.99, 1.0, 1.0, 1.0, 1.01, 1.02)]

_RECORDED: dict[str, Any] = {}  # one real recorded run serves every test here (the same test file and machine)


@pytest.fixture()
def recorded(run_user: Any, pytester: pytest.Pytester) -> dict[str, Any]:
    """The file one real session recorded with --opt-history (without the extra matmul)."""
    if not _RECORDED:
        folder = pytester.path / ".opt-history"
        run = run_user(TEST, "-q", f"--opt-history={folder}", conftest=CONFTEST)
        assert run.result.ret == pytest.ExitCode.OK, run.result.stdout.str()
        (path,) = folder.iterdir()
        _RECORDED.update(json.loads(path.read_text()))
    return copy.deepcopy(_RECORDED)


def _window(folder: Path, recorded: dict[str, Any], factors: list[float]) -> list[str]:
    """History files of ``recorded``, its optimized latency (and rounds) times each factor, oldest first, an hour
    apart, the newest an hour ago; their names."""
    folder.mkdir()
    newest = dt.datetime.now(dt.timezone.utc).replace(microsecond=0) - dt.timedelta(hours=1)
    names = []
    for index, factor in enumerate(factors):
        moment = newest - dt.timedelta(hours=len(factors) - 1 - index)
        report = copy.deepcopy(recorded)
        report["created"] = moment.isoformat()
        optimized = report["tests"][0]["optimized"]
        optimized["latency_samples_s"] = [sample * factor for sample in optimized["latency_samples_s"]]
        optimized["latency_s"] = statistics.median(optimized["latency_samples_s"])
        validate_report(report)
        names.append(f"{moment.strftime('%Y%m%dT%H%M%SZ')}.json")
        (folder / names[-1]).write_text(json.dumps(report))
    return names


def test_a_run_of_the_same_configuration_counts_what_the_window_counted(
        run_user: Any, pytester: pytest.Pytester, recorded: dict[str, Any]) -> None:
    folder = pytester.path / "history"
    names = _window(folder, recorded, [1.0] * 5)
    run = run_user(TEST, "-q", f"--opt-compare={folder}", "--opt-compare-fail=ops:0,graph_breaks:0", conftest=CONFTEST)
    assert run.result.ret == pytest.ExitCode.OK, run.result.stdout.str()
    regression = run.test("test_layers")["regression"]
    assert regression["verdict"] == "ok", regression  # the census is exact: another session counts the same
    ops = next(d for d in regression["details"] if d.startswith(f"against {names[-1]}, the window's newest run"))
    assert ops.endswith(" per call (0 changed, limit ops:0): ok") and "different" not in ops, ops
    assert [r["rule"] for r in regression["judged"]] == ["exact", "exact"]


def test_an_extra_matmul_per_layer_fails_ops_zero_against_the_window_naming_the_op_per_step(
        run_user: Any, pytester: pytest.Pytester, recorded: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    folder = pytester.path / "history"
    names = _window(folder, recorded, [1.0] * 5)
    monkeypatch.setenv(EXTRA_MATMUL, "1")
    run = run_user(TEST, "-q", f"--opt-compare={folder}", "--opt-compare-fail=ops:0", conftest=CONFTEST)
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED
    run.result.stdout.fnmatch_lines([
        f"REGRESSED {NODEID}: against {names[-1]}, the window's newest run with ops counted (a census is exact: no "
        f"spread): ops * -> * per call (10 changed, limit ops:0): {ADDED}",
        "compare: 1 regressed, 0 inconclusive, 0 improved, 0 ok, 0 new, 0 not comparable (against the window *)",
        f"*1 test regressed past --opt-compare-fail=ops:0 against --opt-compare={folder}: the run fails"])
    regression = run.test("test_layers")["regression"]
    (record,) = regression["judged"]
    assert (record["rule"], record["verdict"], record["changes"]) == ("exact", "regressed", [ADDED])
    assert "cause" not in regression  # a census threshold is its own evidence; a cause explains a timing verdict


def test_a_latency_regression_against_the_window_names_the_census_change_as_its_cause_everywhere(
        run_user: Any, pytester: pytest.Pytester, recorded: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    folder = pytester.path / "history"
    _window(folder, recorded, FASTER_WINDOW)
    monkeypatch.setenv(EXTRA_MATMUL, "1")
    md, page = pytester.path / "report.md", pytester.path / "report.html"
    run = run_user(TEST, "-q", f"--opt-compare={folder}", "--opt-compare-fail=latency:10%", f"--opt-report-md={md}",
                   f"--opt-report-html={page}", conftest=CONFTEST)
    regression = run.test("test_layers")["regression"]
    assert regression["verdict"] in ("regressed", "inconclusive"), regression
    cause = f"the census changed: {ADDED}"
    assert regression["cause"] == {"changed": True, "lines": [ADDED], "text": cause}  # the JSON
    run.result.stdout.fnmatch_lines([f"{regression['verdict'].upper()} {NODEID}: latency * vs the window's median *"
                                     f"; cause: {cause}"])  # the terminal, under -q
    escaped = cause.replace(">", "\\>")  # as Markdown keeps it text
    assert f"; cause: {escaped} |" in md.read_text()  # the Regression cell, last
    text = page.read_text()
    assert f'<span class="reason cause">cause: {html.escape(cause)}</span>' in text  # under the verdict
    census = text[text.index('<section id="census">'):]
    census = census[:census.index("</section>")]
    assert "<td>Ops per call</td>" in census and "<td>Ops per decode step</td>" in census
    counted = run.test("test_layers")["census"]
    for side in ("optimized", "baseline"):  # each side's total per call, as the JSON counts it
        assert f"<td>{counted[side]['ops_total']} (" in census
    assert "(over 4 steps)" in census
