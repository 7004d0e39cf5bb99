"""The plugins a team runs beside this one (issue 19, item 31): each row runs one small user project with the
other plugin (or pytest switch) on, and checks that the JSON report's counts equal pytest's and that the
other plugin's own output is intact.

pytest-randomly and pytest-asyncio are kept out of the suite's inner runs (tests/conftest.py); their rows
turn them on with ``-p randomly`` / ``-p asyncio``. Rows that need a fresh process (pytest-xdist's workers,
coverage's tracer, ``-W error`` over first imports) run in a subprocess; the rest in-process. The xdist rows
also prove issue 19 item 22: no torch import-time DeprecationWarning in a `-n 2` run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from conftest import FAST_ARGS
from pytest_transformers_opt.report.schema import validate_report

# Two measured tests sharing one configuration (one load, one baseline reference run per session) and a test
# of the project's own that uses none of the plugin.
PROJECT = """
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=2)

@pytest.mark.optimization("sdpa", max_kl=0.5)
def test_sdpa_looser(opt_bench):
    opt_bench(max_new_tokens=2)

def test_own():
    assert sum(range(4)) == 6
"""

ASYNC_TEST = """

@pytest.mark.asyncio
async def test_async():
    import asyncio
    await asyncio.sleep(0)
"""

BENCHMARK_TEST = """

def test_own_benchmark(benchmark):
    assert benchmark(sum, range(100)) == 4950
"""

FLAKY_BUDGET_TEST = """

@pytest.mark.optimization("sdpa", max_latency="1 us")
def test_too_tight(opt_bench):
    opt_bench(max_new_tokens=2)
"""

OWN_TESTS = ("test_own", "test_async", "test_own_benchmark")  # the project's tests that use none of the plugin
SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (test_user\.py::\S+)")
OUTCOME = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "XFAIL": "xfailed", "XPASS": "xpassed"}


@dataclass
class Row:
    args: tuple[str, ...]
    output: tuple[str, ...] = ()  # fnmatch lines of the other plugin's own output, in order
    subprocess: bool = False
    extra_source: str = ""
    check: Callable[[Path, pytest.RunResult], None] | None = None
    ini: str | None = None


def _html_has_every_test(folder: Path, result: pytest.RunResult) -> None:
    page = (folder / "pytest-html.html").read_text()
    assert "test_sdpa_looser" in page and "test_own" in page


def _coverage_measured_the_project(folder: Path, result: pytest.RunResult) -> None:
    result.stdout.fnmatch_lines(["test_user.py *100%*"])


def _each_repeat_is_a_row(folder: Path, result: pytest.RunResult) -> None:
    report = json.loads((folder / "opt-report.json").read_text())
    assert sorted(t["nodeid"].rsplit("::", 1)[1] for t in report["tests"]) == [
        "test_sdpa[1-2]", "test_sdpa[2-2]", "test_sdpa_looser[1-2]", "test_sdpa_looser[2-2]"]


def _one_row_with_its_attempts(folder: Path, result: pytest.RunResult) -> None:
    report = json.loads((folder / "opt-report.json").read_text())
    rows = [t for t in report["tests"] if "::test_too_tight" in t["nodeid"]]
    assert len(rows) == 1 and rows[0]["outcome"] == "failed", [t["nodeid"] for t in report["tests"]]
    assert rows[0]["attempts"] == 2 and report["summary"]["rerun"] == 1  # pytest's "1 rerun"


def _split_ran_part_of_the_project(folder: Path, result: pytest.RunResult) -> None:
    report = json.loads((folder / "opt-report.json").read_text())
    assert 0 < len(report["tests"]) + ("PASSED test_user.py::test_own" in result.stdout.str()) < 3


# pytest-xdist's default distribution (load) runs in the suite's shared `-n 2` session (tests/conftest.py
# xdist_run); loadgroup, without xdist_group marks, schedules as load does: no row of its own (30 s of the suite)
ROWS = {
    # the rows that need a fresh process are one, where the plugins meet as teams run them: each such session costs
    # two workers' torch imports (~25 s of the suite's CPU). loadscope sends the one module to one worker, so the
    # other ends with no test; worksteal moves tests between workers as load does (the shared session's)
    "xdist-loadscope+W-error+cov": Row(("-n", "2", "--dist", "loadscope", "-W", "error", "--cov", ".", "--cov-report",
                                        "term"), ("created: 2/2 workers", "*coverage: platform*", "TOTAL*"),
                                       subprocess=True, check=_coverage_measured_the_project),
    "randomly": Row(("-p", "randomly", "--randomly-seed=1234"), ("Using --randomly-seed=1234",)),
    "rerunfailures": Row(("--reruns", "1"), ("*1 failed, 3 passed*1 rerun*",), extra_source=FLAKY_BUDGET_TEST,
                         check=_one_row_with_its_attempts),
    "repeat": Row(("--count", "2"), ("*6 passed*",), check=_each_repeat_is_a_row),
    "timeout": Row(("-p", "timeout", "--timeout", "600"), ("timeout: 600.0s", "timeout method: signal")),
    "html": Row(("--html", "pytest-html.html", "--self-contained-html"), ("*Generated html report: *pytest-html.html*",),
                check=_html_has_every_test),
    "benchmark": Row((), ("*benchmark*", "Name (time in *", "*test_own_benchmark*"), extra_source=BENCHMARK_TEST),
    "split": Row(("--splits", "2", "--group", "1"), ("*Running group 1/2*",), check=_split_ran_part_of_the_project),
    "asyncio": Row(("-p", "asyncio"), ("asyncio: mode=*STRICT*",), extra_source=ASYNC_TEST,
                   ini="[pytest]\nasyncio_default_fixture_loop_scope = function\n"),
    "strict": Row(("--strict-markers", "--strict-config"), ("*transformers optimization report*",),
                  ini="[pytest]\nopt_report = true\nopt_budgets = enforce\n"),
    "importlib": Row(("--import-mode=importlib",), ()),
}

def _pytest_outcomes(result: pytest.RunResult) -> dict[str, str]:
    """Each test's final outcome as pytest's short summary (-rA) lists it, the project's own tests left out."""
    outcomes = {}
    for line in result.outlines:
        match = SUMMARY_LINE.match(line)
        if match and match.group(2).split("::")[1].split("[")[0] not in OWN_TESTS:
            outcomes[match.group(2)] = OUTCOME[match.group(1)]
    return outcomes


@pytest.mark.parametrize("name", list(ROWS))
def test_the_report_counts_as_pytest_does_beside_another_plugin(pytester: pytest.Pytester, name: str) -> None:
    row = ROWS[name]
    pytester.makepyfile(test_user=PROJECT + row.extra_source)
    if row.ini is not None:
        pytester.makeini(row.ini)
    report_path = pytester.path / "opt-report.json"
    # one round, no warm-up: the rows check counts and the other plugin's output, not figures
    args = (*FAST_ARGS, "--opt-rounds=1", "--opt-warmup=0", "-rA", f"--opt-report-json={report_path}", *row.args)
    result = pytester.runpytest_subprocess(*args) if row.subprocess else pytester.runpytest(*args)
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output, output[-3000:]
    # the torch import-time warnings a fresh process would show (issue 19, item 22), under any plugin
    assert "script_method" not in output, output[-3000:]
    if row.output:
        result.stdout.fnmatch_lines(list(row.output))

    report = json.loads(report_path.read_text())
    validate_report(report)
    pytest_outcomes = _pytest_outcomes(result)
    assert pytest_outcomes, output[-3000:]
    assert {t["nodeid"]: t["outcome"] for t in report["tests"]} == pytest_outcomes
    counts = {key: list(pytest_outcomes.values()).count(key) for key in ("passed", "failed", "skipped", "error")}
    assert {key: report["summary"][key] for key in counts} == counts, report["summary"]
    if row.check is not None:
        row.check(pytester.path, result)
