"""--opt-compare=DIR on real sessions: each test judged against a window of its runs recorded by --opt-history.

The test's optimized side is padded to a pause per forward pass (``slowdown.sleepy_conftest``), so its rounds
are steady on a busy machine, and a longer pause is a real slowdown. One real session records the first run of a history;
the windows are that run's report copied into history files (named as --opt-history names them, an hour apart,
in the past) with the latency edited to a quiet or a noisy spread around the recorded one, another hardware or
another transformers version. The session under test then runs for real against that folder.
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

from pytest_transformers_opt.report.schema import validate_report
from slowdown import sleepy_conftest  # tests/ is on sys.path

PAUSE_VARIABLE = "WINDOW_TEST_PAUSE"
SLEEPY = sleepy_conftest("import os\n", f"float(os.environ.get({PAUSE_VARIABLE!r}, '0.05'))")
TEST = '''
import pytest

@pytest.mark.optimization("sleepy")
def test_sleepy(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=3)
'''
GATE = "--opt-compare-fail=latency:10%"
# per-run latencies, as factors of the recorded run's: a spread (1.4826 x MAD) of 1.5% and of 11.9%
QUIET = [0.97, 0.98, 0.99, 0.99, 1.0, 1.0, 1.01, 1.01, 1.02, 1.03]
NOISY = [0.84, 0.88, 0.92, 0.96, 1.0, 1.0, 1.04, 1.08, 1.12, 1.16]

_FIRST_RUN: dict[str, Any] = {}  # one real first run serves every test here (the same test file and machine)


@pytest.fixture()
def first_run(run_user: Any, pytester: pytest.Pytester) -> dict[str, Any]:
    """The first run of a CI history: --opt-history and --opt-compare name the same folder, not made yet."""
    if not _FIRST_RUN:
        folder = pytester.path / ".opt-history"
        run = run_user(TEST, "-q", f"--opt-history={folder}", f"--opt-compare={folder}", GATE, conftest=SLEEPY)
        (recorded,) = folder.iterdir()
        _FIRST_RUN.update(ret=run.result.ret, lines=run.result.outlines, report=run.report,
                          recorded=json.loads(recorded.read_text()))
    return copy.deepcopy(_FIRST_RUN)


def _craft(folder: Path, recorded: dict[str, Any], factors: list[float], *, hours_ago: int = 0,
           hardware: str | None = None, transformers: str | None = None) -> list[str]:
    """History files of ``recorded`` with its optimized latency (and rounds) times each factor, oldest first,
    an hour apart, the newest ``hours_ago`` hours before now; their names."""
    folder.mkdir(exist_ok=True)
    newest = dt.datetime.now(dt.timezone.utc).replace(microsecond=0) - dt.timedelta(hours=hours_ago + 1)
    names = []
    for index, factor in enumerate(factors):
        moment = newest - dt.timedelta(hours=len(factors) - 1 - index)
        report = copy.deepcopy(recorded)
        report["created"] = moment.isoformat()
        row, environment = report["tests"][0], report["environment"]
        optimized = row["optimized"]
        optimized["latency_samples_s"] = [sample * factor for sample in optimized["latency_samples_s"]]
        optimized["latency_s"] = statistics.median(optimized["latency_samples_s"])
        if hardware is not None:
            row["hardware"] = environment["hardware"] = hardware
        if transformers is not None:
            environment["transformers"] = environment["versions"]["transformers"] = transformers
        validate_report(report)
        names.append(f"{moment.strftime('%Y%m%dT%H%M%SZ')}.json")
        (folder / names[-1]).write_text(json.dumps(report))
    return names


def _regression(run: Any) -> dict[str, Any]:
    return run.test("test_sleepy")["regression"]  # type: ignore[no-any-return]


def test_the_first_run_of_a_history_says_it_is_building_the_history_and_passes(first_run: dict[str, Any]) -> None:
    assert first_run["ret"] == pytest.ExitCode.OK
    lines = "\n".join(first_run["lines"])
    assert "building the history: 0 of 5 runs recorded in " in lines  # under -q
    assert "nothing is judged until a test has 5 (a run recorded there with --opt-history starts the window)" in lines
    assert "compare: 0 regressed, 0 inconclusive, 0 improved, 0 ok, 1 new, 0 not comparable" in lines
    row = first_run["report"]["tests"][0]
    assert row["regression"]["verdict"] == "new"
    assert row["regression"]["details"][0].startswith("building the history: no recorded run in ")
    assert first_run["report"]["compare"]["reference"] == "window"
    assert first_run["recorded"]["tests"][0]["outcome"] == "passed"  # and the run started the history


def test_a_slowed_run_regresses_against_a_quiet_window_and_fails(
        run_user: Any, pytester: pytest.Pytester, first_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    folder = pytester.path / "history"
    names = _craft(folder, first_run["recorded"], QUIET)
    monkeypatch.setenv(PAUSE_VARIABLE, "0.1")  # twice the sleep of the recorded run
    md, page = pytester.path / "report.md", pytester.path / "report.html"
    run = run_user(TEST, "-q", f"--opt-compare={folder}", GATE, f"--opt-report-md={md}", f"--opt-report-html={page}",
                   conftest=SLEEPY)
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED
    run.result.stdout.fnmatch_lines([  # said under -q
        "REGRESSED test_user.py::test_sleepy: latency * vs the window's median * (+*%, limit 10%), spread 1.5%, "
        "detectable *%, adjusted p=*",
        "compare: 1 regressed, 0 inconclusive, 0 improved, 0 ok, 0 new, 0 not comparable (against the window of up "
        "to 10 runs in *)",
        f"*1 test regressed past {GATE} against --opt-compare={folder}: the run fails"])
    regression = _regression(run)
    first, last = (dt.datetime.strptime(name[:16], "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)
                   for name in (names[0], names[-1]))
    assert regression["reference"] == {"kind": "window", "runs": 10, "first": first.isoformat(),
                                       "last": last.isoformat(), "source": str(folder)}
    (judged,) = regression["judged"]
    assert (judged["rule"], judged["verdict"], judged["runs"]) == ("window", "regressed", 10)
    assert judged["spread_pct"] == pytest.approx(1.4826, rel=1e-3) and judged["p_adjusted"] < 0.05
    assert judged["ratio"] > 1.5 and 10 < judged["detectable"] < 20
    assert run.report["compare"] == {"against": f"--opt-compare={folder}", "reference": "window", "window": 10,
                                     "gate": "latency:10%", "counts": {"regressed": 1, "inconclusive": 0,
                                                                       "improved": 0, "ok": 0, "new": 0,
                                                                       "not comparable": 0}}
    period = f"{first:%Y-%m-%d}" if f"{first:%Y-%m-%d}" == f"{last:%Y-%m-%d}" else f"{first:%Y-%m-%d}..{last:%Y-%m-%d}"
    for text in (md.read_text(), html.unescape(page.read_text())):
        assert f"regressed: against a window of 10 runs, {period}; latency " in text.replace("\\", "")
        assert "spread 1.5%, detectable " in text and "Compared with each test's window of up to 10 runs" in text


def test_a_normal_run_is_ok_against_a_quiet_window(run_user: Any, pytester: pytest.Pytester,
                                                   first_run: dict[str, Any]) -> None:
    folder = pytester.path / "history"
    _craft(folder, first_run["recorded"], QUIET)
    run = run_user(TEST, "--opt-report", f"--opt-compare={folder}", GATE, conftest=SLEEPY)
    assert run.result.ret == pytest.ExitCode.OK
    assert _regression(run)["verdict"] == "ok"
    run.result.stdout.fnmatch_lines([  # under --opt-report, the ok test's figures and window too
        "ok test_user.py::test_sleepy: latency * vs the window's median * (*%, limit 10%), spread 1.5%, "
        "detectable *% (window of 10 runs, *)",
        "compare: 0 regressed, 0 inconclusive, 0 improved, 1 ok, 0 new, 0 not comparable*"])


def test_a_noisy_window_is_inconclusive_counted_and_passes(run_user: Any, pytester: pytest.Pytester,
                                                           first_run: dict[str, Any]) -> None:
    folder = pytester.path / "history"
    _craft(folder, first_run["recorded"], NOISY)
    run = run_user(TEST, "-q", f"--opt-compare={folder}", GATE, conftest=SLEEPY)
    assert run.result.ret == pytest.ExitCode.OK  # never a false fail
    run.result.stdout.fnmatch_lines([  # never a silent pass: said under -q, with the detectable size
        "INCONCLUSIVE test_user.py::test_sleepy: latency * vs the window's median * (*%, limit 10%), spread 11.9%, "
        "detectable *%; cause: the census did not change*",  # the same code ran: the noise is the machine's
        "compare: 0 regressed, 1 inconclusive, 0 improved, 0 ok, 0 new, 0 not comparable*"])
    (judged,) = _regression(run)["judged"]
    assert judged["verdict"] == "inconclusive" and judged["detectable"] > 20
    assert run.report["compare"]["counts"]["inconclusive"] == 1


def test_runs_of_other_hardware_and_another_stack_are_left_out_and_the_change_said(
        run_user: Any, pytester: pytest.Pytester, first_run: dict[str, Any]) -> None:
    """Pooled, the runs of another machine and of the old transformers (three times as fast) would make this run
    regress; the window holds only this stack's five runs on this hardware, and says the stack changed."""
    folder = pytester.path / "history"
    recorded = first_run["recorded"]
    _craft(folder, recorded, [0.3] * 4, hours_ago=20, hardware="NVIDIA H200")
    old_stack = _craft(folder, recorded, [0.3] * 4, hours_ago=10, transformers="5.0.0")
    _craft(folder, recorded, QUIET[:5])
    run = run_user(TEST, "-q", f"--opt-compare={folder}", GATE, conftest=SLEEPY)
    assert run.result.ret == pytest.ExitCode.OK
    regression = _regression(run)
    assert regression["verdict"] == "ok" and regression["reference"]["runs"] == 5
    change = (f"the stack changed since run {old_stack[-1]} (transformers 5.0.0 -> "
              f"{recorded['environment']['transformers']}): judged against the 5 runs of this stack")
    assert regression["details"][1] == change
    run.result.stdout.fnmatch_lines([f"stack changed (1 test): {change}"])  # said under -q


def test_bad_window_settings_are_usage_errors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_plain():\n    pass\n")
    folder = pytester.mkdir("history")
    for args, message in (
            (["--opt-compare-window=0", f"--opt-compare={folder}"],
             "*--opt-compare-window: recorded runs in the window: 0 must be a whole number >= 5 and <= 1000*"),
            (["--opt-compare-window=x", f"--opt-compare={folder}"], "*--opt-compare-window: *'x'*>= 5*"),
            (["--opt-compare-window=12"], "*--opt-compare-window: needs --opt-compare=DIR, a folder of runs recorded "
                                          "by --opt-history (found: no --opt-compare)*")):
        result = pytester.runpytest("-p", "no:cacheprovider", *args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([message])
    pytester.makeini("[pytest]\nopt_compare_window = 4\n")
    result = pytester.runpytest("-p", "no:cacheprovider", f"--opt-compare={folder}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini opt_compare_window: recorded runs in the window: 4 must be a whole number "
                                 ">= 5*"])
    pytester.makeini("[pytest]\n")
    (folder / "report.json").write_text("{}")  # a folder of reports, not a history
    result = pytester.runpytest("-p", "no:cacheprovider", f"--opt-compare={folder}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*holds no run recorded by --opt-history (named like 20261201T131500Z-1a2b3c4.json) "
                                 "but 1 other JSON file (report.json); give one report as --opt-compare=FILE*"])


# -- --opt-compare-confirm: a regression fails the gate only when measured twice ------------------------------

SLOW_RUNS_VARIABLE = "WINDOW_TEST_SLOW_RUNS"
# the test sleeps twice as long in the runs of it this session that SLOW_RUNS names ("1": its first run only)
ONE_OFF = sleepy_conftest(f'''import os

import pytest

RUNS = []


@pytest.fixture(autouse=True)
def _count_runs():
    RUNS.append(1)
    yield


def current_pause():
    slow = os.environ.get({SLOW_RUNS_VARIABLE!r}, "").split(",")
    return float(os.environ.get({PAUSE_VARIABLE!r}, "0.05")) * (2 if str(len(RUNS)) in slow else 1)
''', "current_pause()")


def test_a_one_off_slow_measurement_is_measured_again_and_passes_a_real_slowdown_fails(
        run_user: Any, pytester: pytest.Pytester, first_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    folder = pytester.path / "history"
    _craft(folder, first_run["recorded"], QUIET)
    # slow the first time only: the second measurement, after the other tests, clears it
    monkeypatch.setenv(SLOW_RUNS_VARIABLE, "1")
    run = run_user(TEST, "-q", f"--opt-compare={folder}", GATE, conftest=ONE_OFF)
    assert run.result.ret == pytest.ExitCode.OK, run.result.stdout.str()
    assert run.result.parseoutcomes() == {"passed": 1}  # pytest counts the test once
    run.result.stdout.fnmatch_lines([
        "transformers-opt: confirming 1 regressed test with fresh rounds (--opt-compare-confirm: *) ...",
        "transformers-opt: confirming 1 regressed test with fresh rounds: done in *",
        "NOT CONFIRMED test_user.py::test_sleepy: regressed at first, * when measured again after the other tests "
        "(a one-off: the gate passes it): latency * vs the window's median * (*%, limit 10%)*",
        "compare: 0 regressed, 0 inconclusive, * 0 new, 0 not comparable*"])
    (row,) = run.report["tests"]
    regression = row["regression"]
    # ok, or improved: the window is the first run's figures, taken under whatever load the suite had then
    assert regression["verdict"] in ("ok", "improved")
    assert (regression["confirmed"], regression["first_verdict"]) == (False, "regressed")
    assert regression["details"][0].startswith("regressed at first, not confirmed")
    assert regression["judged"][0]["verdict"] == "regressed"  # the first measurement's figures, as judged
    # the row keeps both measurements: the first slept twice as long in every forward
    first, second = row["optimized"]["latency_s"], row["confirmation"]["optimized"]["latency_s"]
    assert row["confirmation"]["outcome"] == "passed" and first > 1.5 * second

    # slow both times: confirmed, the run fails
    monkeypatch.setenv(SLOW_RUNS_VARIABLE, "1,2")
    run = run_user(TEST, "-q", f"--opt-compare={folder}", GATE, conftest=ONE_OFF)
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED
    run.result.stdout.fnmatch_lines([
        "CONFIRMED test_user.py::test_sleepy: measured again after the other tests, it regressed again: latency *",
        "REGRESSED test_user.py::test_sleepy: latency *",
        f"*1 test regressed past {GATE} against --opt-compare={folder}: the run fails"])
    regression = run.test("test_sleepy")["regression"]
    assert regression["verdict"] == "regressed" and regression["confirmed"] is True

    # --opt-compare-confirm=0: the first measurement decides
    monkeypatch.setenv(SLOW_RUNS_VARIABLE, "1")
    run = run_user(TEST, "-q", f"--opt-compare={folder}", GATE, "--opt-compare-confirm=0", conftest=ONE_OFF)
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED
    assert "confirming" not in run.result.stdout.str()
    assert "confirmation" not in run.test("test_sleepy") and "confirmed" not in run.test("test_sleepy")["regression"]


def test_confirmation_is_skipped_after_x_and_under_collect_only(
        run_user: Any, pytester: pytest.Pytester, first_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    folder = pytester.path / "history"
    _craft(folder, first_run["recorded"], QUIET)
    monkeypatch.setenv(SLOW_RUNS_VARIABLE, "1")
    failing = TEST + "\n\ndef test_fails():\n    assert False\n"
    run = run_user(failing, "-q", "-x", "-p", "no:randomly", f"--opt-compare={folder}", GATE, conftest=ONE_OFF)
    assert "confirming" not in run.result.stdout.str()  # -x stopped the session: nothing more is measured
    assert run.test("test_sleepy")["regression"]["verdict"] == "regressed"
    collected = pytester.runpytest("--collect-only", "-q", f"--opt-compare={folder}", GATE)
    assert collected.ret == pytest.ExitCode.OK and "confirming" not in collected.stdout.str()


def test_under_xdist_the_worker_that_ran_a_regressed_test_measures_it_again(
        run_user: Any, pytester: pytest.Pytester, first_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pytest-xdist worker confirms its own tests after its last; the second measurement reaches the controller
    with the worker's rows, and the run's verdict (adjusted over every test) uses it."""
    folder = pytester.path / "history"
    _craft(folder, first_run["recorded"], QUIET)
    monkeypatch.setenv(SLOW_RUNS_VARIABLE, "1")
    run = run_user(TEST, "-q", "-n", "1", f"--opt-compare={folder}", GATE, conftest=ONE_OFF)
    assert run.result.ret == pytest.ExitCode.OK, run.result.stdout.str()
    # ok, or improved: the window is the first run's figures, taken under whatever load the suite had then
    run.result.stdout.fnmatch_lines(["NOT CONFIRMED test_user.py::test_sleepy: regressed at first, * when measured "
                                     "again after the other tests*"])
    row = run.test("test_sleepy")
    assert row["regression"]["confirmed"] is False and row["regression"]["verdict"] in ("ok", "improved")
    assert row["confirmation"]["outcome"] == "passed"
    assert row["optimized"]["latency_s"] > 1.5 * row["confirmation"]["optimized"]["latency_s"]


def test_a_second_measurement_that_fails_leaves_the_regression_standing(
        run_user: Any, pytester: pytest.Pytester, first_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing clears a regression but a second measurement that does not regress: one whose test fails (here its
    own assertion, on its second run) keeps the first verdict, says why, and the row keeps how it ended."""
    folder = pytester.path / "history"
    _craft(folder, first_run["recorded"], QUIET)
    monkeypatch.setenv(SLOW_RUNS_VARIABLE, "1")
    fails_again = TEST.replace("import pytest\n", "import pytest\n\nimport conftest\n") + \
        "    assert len(conftest.RUNS) == 1, 'the second run of this test fails'\n"
    run = run_user(fails_again, "-q", f"--opt-compare={folder}", GATE, conftest=ONE_OFF)
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED
    assert run.result.parseoutcomes() == {"passed": 1}  # the second run is not reported to pytest
    run.result.stdout.fnmatch_lines([
        "CONFIRMED test_user.py::test_sleepy: the second measurement gave no verdict (*the second run of this test "
        "fails*): the regression stands",
        f"*1 test regressed past {GATE} against --opt-compare={folder}: the run fails"])
    row = run.test("test_sleepy")
    assert row["regression"]["verdict"] == "regressed" and row["regression"]["confirmed"] is True
    assert row["confirmation"]["outcome"] == "failed" and "second run of this test fails" in row["confirmation"]["error"]
