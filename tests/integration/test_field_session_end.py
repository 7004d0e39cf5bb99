"""The end of a session as users hit it (issue 10, items 1, 2, 4 and 15).

A run that ran no test of the plugin keeps the last report; every report writer is independent, and
one that fails is one line; every cause of a changed exit status is said in every verbosity mode;
fields a hook adds under ``extra`` are written as strict JSON and read back by ``--opt-compare``.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pytest_transformers_opt.verdict.compare import Threshold, compare_reports
from pytest_transformers_opt.report.writer import REPORT_NOT_WRITTEN_STATUS
from pytest_transformers_opt.report.schema import validate_report

ARGS = ("-p", "no:cacheprovider", "--opt-rounds=1", "--opt-warmup=0")

USER_TESTS = '''
import pytest

def test_plain():
    pass

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=4)
'''


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    result = pytester.runpytest(*ARGS, *args)
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output and "Traceback" not in output, output
    return result


def _strict_json(path: Path) -> Any:
    """Parse as any strict JSON reader would: a NaN or Infinity literal is an error."""
    def refuse(literal: str) -> None:
        raise ValueError(f"{path.name} holds the non-JSON literal {literal}")

    report = json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)
    validate_report(report)
    return report


def test_collect_only_and_runs_without_plugin_tests_keep_the_last_report(pytester, monkeypatch):
    pytester.makeini("[pytest]\nopt_report_json = report.json\n")
    pytester.makepyfile(test_user=USER_TESTS)
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(pytester.path / "summary.md"))
    files = ("--opt-report-md=report.md", "--opt-report-html=report.html")
    _run(pytester, *files).assert_outcomes(passed=2)
    real = _strict_json(pytester.path / "report.json")
    assert [(t["nodeid"], t["outcome"]) for t in real["tests"]] == [("test_user.py::test_sdpa", "passed")]
    names = ("report.json", "report.md", "report.html", "summary.md")
    before = {name: (pytester.path / name).read_bytes() for name in names}
    assert b"test_sdpa" in before["summary.md"] and b"test_sdpa" in before["report.html"]

    for args, outcomes, status in ((("--collect-only",), {}, pytest.ExitCode.OK),
                                   (("-k", "plain"), {"passed": 1, "deselected": 1}, pytest.ExitCode.OK),
                                   (("-k", "nothing_matches"), {"deselected": 2}, pytest.ExitCode.NO_TESTS_COLLECTED)):
        result = _run(pytester, *files, *args)
        assert result.ret == status, args
        if outcomes:
            result.assert_outcomes(**outcomes)
        assert {name: (pytester.path / name).read_bytes() for name in names} == before, args
        result.stdout.fnmatch_lines(["transformers-opt: no test that uses opt_bench, opt_model or opt_baseline_model "
                                     "ran: ini opt_report_json=*report.json, --opt-report-md=*report.md, "
                                     "--opt-report-html=*report.html left as they were"])


FULL_DISK_CONFTEST = '''
import errno
import os

import pytest_transformers_opt.report.writer as report_module

real_write = report_module.write_atomic


def full_disk(path, text):
    if str(path).endswith(".md"):  # the Markdown report lands on a full disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real_write(path, text)


def pytest_configure(config):
    report_module.write_atomic = full_disk


def pytest_unconfigure(config):
    report_module.write_atomic = real_write
'''


def test_a_full_disk_loses_only_the_report_it_hit(pytester, monkeypatch):
    pytester.makeconftest(FULL_DISK_CONFTEST)
    pytester.makepyfile(test_user=USER_TESTS)
    (pytester.path / "report.md").write_text("the last good Markdown report\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", "/dev/full")  # a real ENOSPC for the append
    result = _run(pytester, "-q", "--opt-report-json=report.json", "--opt-report-md=report.md",
                  "--opt-report-html=report.html")
    result.assert_outcomes(passed=2)
    assert result.ret == REPORT_NOT_WRITTEN_STATUS == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "transformers-opt: could not write --opt-report-md=*report.md: [[]Errno 28[]] No space left on device",
        "transformers-opt: could not write $GITHUB_STEP_SUMMARY=/dev/full: [[]Errno 28[]] No space left on device"])
    assert (pytester.path / "report.md").read_text() == "the last good Markdown report\n"
    report = _strict_json(pytester.path / "report.json")
    assert [(t["nodeid"], t["outcome"]) for t in report["tests"]] == [("test_user.py::test_sdpa", "passed")]
    html = (pytester.path / "report.html").read_text()
    assert "test_sdpa" in html and html.rstrip().endswith("</html>")


RAISING_HOOK_CONFTEST = '''
def pytest_opt_report_extra(config, report):
    report["extra"] = {"half": "written"}
    report["tests"][0]["extra"] = {"half": "written"}
    raise KeyError("no build id")
'''


def test_a_raising_hook_and_a_step_summary_in_a_missing_folder_are_one_line_each(pytester, monkeypatch):
    pytester.makeconftest(RAISING_HOOK_CONFTEST)
    pytester.makepyfile(test_user=USER_TESTS + "\n\ndef test_fails():\n    assert 1 == 2\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(pytester.path / "missing" / "summary.md"))
    result = _run(pytester, "--opt-report-json=report.json", "--opt-report-md=report.md")
    result.assert_outcomes(passed=2, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # what the tests said: a step summary is not asked for
    result.stdout.fnmatch_lines([
        "*= FAILURES =*", "*assert 1 == 2*",
        "transformers-opt: the pytest_opt_report_extra hook in conftest.py:4 raised KeyError: 'no build id'; "
        "the report is written without its fields",
        "transformers-opt: could not write $GITHUB_STEP_SUMMARY=*missing*summary.md: [[]Errno 2[]] No such file or "
        "directory",
        "*short test summary info*", "FAILED test_user.py::test_fails*", "*1 failed, 2 passed*"])
    after_tests = result.stdout.lines[[n for n, line in enumerate(result.stdout.lines) if "[100%]" in line][0]:]
    assert len([line for line in after_tests if line.startswith("transformers-opt: ")]) == 2  # one line each
    report = _strict_json(pytester.path / "report.json")
    assert "extra" not in report and "extra" not in report["tests"][0]  # the half-done fields are gone
    assert report["tests"][0]["outcome"] == "passed"
    assert "test_sdpa" in (pytester.path / "report.md").read_text()

    # the same two failures at session end when every test passed: the exit status stays 0
    passing = _run(pytester, "--opt-report-json=report.json", "-k", "sdpa")
    passing.assert_outcomes(passed=1, deselected=2)
    assert passing.ret == pytest.ExitCode.OK
    passing.stdout.fnmatch_lines(["transformers-opt: the pytest_opt_report_extra hook in conftest.py:4 raised *",
                                  "transformers-opt: could not write $GITHUB_STEP_SUMMARY=*"])


EXTRA_CONFTEST = '''
import math
from pathlib import Path


class Opaque:
    pass


def pytest_opt_report_extra(config, report):
    report["extra"] = {"checkout": Path("src") / "model.py", "tags": {"gpu", "ci", "bf16"}, "score": math.nan,
                       "ceiling": -math.inf, "pair": (1, 2), "huge": 10**30, "handle": Opaque(),
                       "nested": {"kl": [math.nan, 1.5]}}
    for test in report["tests"]:
        test["extra"] = {"ticket": "OPT-12", "seen": {3, 1, 2}, "ratio": math.inf}
'''


def test_hook_fields_are_strict_json_and_round_trip_through_compare(pytester):
    pytester.makeconftest(EXTRA_CONFTEST)
    pytester.makepyfile(test_user=USER_TESTS)
    first = _run(pytester, "--opt-report-json=first.json", "-k", "sdpa")
    assert first.ret == pytest.ExitCode.OK
    first.stdout.fnmatch_lines([
        "transformers-opt: report field report.extra.huge: an integer beyond 64 bits, written as null "
        "(pytest_opt_report_extra)",
        "transformers-opt: report field report.extra.handle: Opaque is not a JSON value, left out "
        "(pytest_opt_report_extra)"])
    report = _strict_json(pytester.path / "first.json")
    assert report["extra"] == {"checkout": str(Path("src") / "model.py"), "tags": ["bf16", "ci", "gpu"],
                               "score": None, "ceiling": None, "pair": [1, 2], "huge": None,
                               "nested": {"kl": [None, 1.5]}}
    assert report["tests"][0]["extra"] == {"ticket": "OPT-12", "seen": [1, 2, 3], "ratio": None}

    # the same report, 100 times faster: a later run regresses against it (and must be able to read it)
    earlier = copy.deepcopy(report)
    earlier["tests"][0]["optimized"]["latency_s"] *= 0.01
    (pytester.path / "earlier.json").write_text(json.dumps(earlier))
    for quiet in (("-q",), ("-qq", "--opt-report")):
        result = _run(pytester, *quiet, "-k", "sdpa", "--opt-report-json=second.json", "--opt-compare=earlier.json",
                      "--opt-compare-fail=latency:10%")
        if quiet == ("-q",):
            result.assert_outcomes(passed=1, deselected=1)
        else:  # -qq prints no summary line at all: the test's dot, and the exit status
            assert result.stdout.lines[0].startswith(".")
        assert result.ret == pytest.ExitCode.TESTS_FAILED, quiet
        result.stdout.fnmatch_lines([
            "REGRESSED test_user.py::test_sdpa: latency * (+*%, limit 10%)*",
            "transformers-opt: 1 test regressed past --opt-compare-fail=latency:10% against "
            "--opt-compare=*earlier.json: the run fails"])
        second = _strict_json(pytester.path / "second.json")
        assert second["tests"][0]["regression"]["verdict"] == "regressed"
        assert second["extra"]["tags"] == ["bf16", "ci", "gpu"]


def test_a_hook_field_outside_extra_is_named_and_the_report_stays_valid(pytester):
    pytester.makeconftest('''
def pytest_opt_report_extra(config, report):
    report["extra"] = {"build": 7}
    report["ticket"] = "OPT-12"  # not under "extra": a later --opt-compare would refuse the file
''')
    pytester.makepyfile(test_user=USER_TESTS)
    result = _run(pytester, "--opt-report-json=report.json", "-k", "sdpa")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([
        "transformers-opt: the pytest_opt_report_extra hook left the report invalid (report: *'ticket'*); it is "
        "written without the hook's fields: put them under report[[]\"extra\"[]] or a test's [[]\"extra\"[]]",
        "*1 passed, 1 deselected*"])
    report = _strict_json(pytester.path / "report.json")
    assert "ticket" not in report and "extra" not in report


def test_no_number_in_a_compare_report_can_crash_the_comparison():
    """Whatever the loader lets through, comparing cannot raise: a number past any float is unmeasured."""
    test = {"nodeid": "t.py::test_x", "outcome": "passed", "model": {"name_or_path": "m"}, "techniques": ["sdpa"],
            "workload": {"num_prompts": 1, "max_new_tokens": 4, "batch_size": 1},
            "optimized": {"latency_s": 0.5, "peak_memory_bytes": 10}, "speedup": 1.0}
    old, new = copy.deepcopy(test), copy.deepcopy(test)
    old["optimized"]["latency_s"] = int("9" * 401)
    verdict = compare_reports({"tests": [old]}, {"tests": [new]}, [Threshold("latency", 10.0, True)])
    assert verdict["t.py::test_x"]["verdict"] == "ok"
    assert "latency not measured in the old run (new: 500" in verdict["t.py::test_x"]["details"][0]
    old["workload"]["max_new_tokens"] = 10**5000  # past Python's digit limit for printing
    verdict = compare_reports({"tests": [old]}, {"tests": [new]}, [])
    assert verdict["t.py::test_x"] == {"verdict": "not comparable", "details": [
        "different workload: max_new_tokens <int too long to print> -> 4"]}
    assert math.isfinite(new["optimized"]["latency_s"])


STOP_AND_RERUN = '''
import pytest

@pytest.mark.optimization("sdpa", max_latency="1 us")
def test_a_over_budget(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa")
def test_b_never_started_under_x(opt_bench):
    opt_bench(max_new_tokens=4)
'''


def test_stop_at_first_failure_then_rerun_the_last_failed(pytester):
    """``-x`` then ``--lf``, as a user chases a red gate: each report holds exactly the tests that ran, with
    their real outcomes (a test -x never started is not a row, nor "interrupted")."""
    pytester.makepyfile(test_user=STOP_AND_RERUN)
    args = ("-p", "cacheprovider", "--opt-rounds=1", "--opt-warmup=0", "--opt-report-json=report.json")
    stopped = pytester.runpytest(*args, "-x")
    assert "INTERNALERROR" not in stopped.stdout.str() + stopped.stderr.str()
    stopped.assert_outcomes(failed=1)
    report = _strict_json(pytester.path / "report.json")
    assert [(t["nodeid"], t["outcome"], t["failed_budgets"]) for t in report["tests"]] == [
        ("test_user.py::test_a_over_budget", "failed", ["max_latency"])]
    assert report["summary"]["failed"] == 1 and report["summary"]["passed"] == 0

    rerun = pytester.runpytest(*args, "--lf")
    rerun.assert_outcomes(failed=1, passed=0)
    report = _strict_json(pytester.path / "report.json")
    assert [t["nodeid"] for t in report["tests"]] == ["test_user.py::test_a_over_budget"]
    assert report["tests"][0]["outcome"] == "failed"
