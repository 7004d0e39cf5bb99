"""Red-team round three on ``--opt-ab`` (issue 40), each finding as the user hit it: a reference that cannot run
the technique hid the candidate's failure (a skip, exit 0); a reference that stopped answering hung the session; a
package bump read as "identical stacks"; a dead worker's error named an internal tuple; the gate said "none
measured anything" of tests that had measured. The reference is a wrapper script that execs this same Python,
with a folder first on its path where a test needs the reference to differ."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmark_scripts import ab_study  # noqa: E402  (tests/ is on sys.path): the reference wrapper
from slowdown import sleepy_conftest  # noqa: E402
from pytest_transformers_opt.engine.ab_worker import CRASH_ENV, CRASH_STATUS, HANG_ENV
from pytest_transformers_opt.verdict import reference_side

SDPA_TEST = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=3)
'''

TWO_TESTS = SDPA_TEST + '''
@pytest.mark.optimization("static_cache")
def test_static_cache(opt_bench):
    opt_bench(max_new_tokens=3)
'''

# the red team's case: a budget no configuration meets, so the candidate's own verdict is a failure
QUANTO_TEST = '''
import pytest

@pytest.mark.optimization("quanto_int8", max_memory="1 KiB")
def test_quanto(opt_bench):
    opt_bench(max_new_tokens=3)
'''


def _reference(folder: Path, pythonpath: Path | None = None) -> str:
    """A reference interpreter that notes each start (its pid, in ``started``) and execs this Python."""
    script = ab_study.write_wrapper(folder / "reference-python", sys.executable, pythonpath)
    lines = script.read_text().splitlines()
    script.write_text("\n".join([lines[0], f'echo "$$" >> {folder / "started"}', *lines[1:]]) + "\n")
    return str(script)


def _started(folder: Path) -> list[int]:
    return [int(pid) for pid in (folder / "started").read_text().split()]


def _running(pid: int) -> bool:
    """The process still runs (not gone, not a zombie nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _summary(**counts: int) -> dict[str, int]:
    words = ("regressed", "inconclusive", "improved", "ok", "not comparable", "not judged")
    return {word: counts.get(word.replace(" ", "_"), 0) for word in words}


def test_a_reference_that_cannot_run_the_technique_keeps_the_candidates_failure_and_is_not_comparable(
        run_user: Any, pytester: pytest.Pytester) -> None:
    alone = run_user(QUANTO_TEST)
    alone.result.assert_outcomes(failed=1)
    failed_budgets = alone.test("test_quanto")["failed_budgets"]
    assert "max_memory" in str(failed_budgets), failed_budgets

    # an optimum without quanto first on the reference's path: there quanto_int8 cannot load
    shadow = pytester.path / "shadow" / "optimum"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    reference = _reference(pytester.path, pythonpath=shadow.parent)

    gated = run_user(QUANTO_TEST, "-q", f"--opt-ab={reference}", "--opt-ab-fail=latency:20%")
    gated.result.assert_outcomes(failed=1)  # was: skipped, exit 0
    assert gated.result.ret == pytest.ExitCode.TESTS_FAILED
    row = gated.test("test_quanto")
    assert row["failed_budgets"] == failed_budgets and row["optimized"]["latency_s"] > 0
    ab = row["ab"]
    why = ab["not_comparable"]
    assert why == "in the reference environment: quanto_int8 needs the optimum-quanto package; found: not installed"
    assert ab["verdict"] == "not comparable" and ab["details"] == [why]
    assert ab["optimized"] is None and ab["figures"] == {} and ab["reference"]["python"] == reference
    assert gated.report["ab"]["summary"] == _summary(not_comparable=1)  # was: "0 not judged"
    gated.result.stdout.fnmatch_lines([f"AB not comparable test_user.py::test_quanto: {why}",
                                       "A/B: 0 regressed, 0 inconclusive, 0 improved, 0 ok, 1 not comparable, "
                                       "0 not judged (--opt-ab-fail=latency:20%*"])

    # without a gate: the same verdict, listed under -q too, and in the report's A/B section with its reason
    plain = run_user(QUANTO_TEST, "-q", f"--opt-ab={reference}", "--opt-report")
    plain.result.assert_outcomes(failed=1)
    assert plain.test("test_quanto")["ab"]["verdict"] == "not comparable"
    assert plain.report["ab"]["summary"] == _summary(not_comparable=1)
    plain.result.stdout.fnmatch_lines([f"  test_quanto: candidate vs reference*: no figure measured on both sides; not "
                                       f"comparable: {why}",
                                       f"AB not comparable test_user.py::test_quanto: {why}"])
    assert not any(_running(pid) for pid in _started(pytester.path))


@pytest.mark.timeout(600)  # before the fix the session never ended: this ends the test instead
def test_a_reference_that_stops_answering_is_killed_and_the_session_goes_on_without_it(
        run_user: Any, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference_side, "REQUEST_FLOOR_S", 3.0)  # a round's limit: max(3 s, 20x the candidate's)
    monkeypatch.setenv(HANG_ENV, "generate:7")  # the worker never answers its seventh round (warm-ups included)
    reference = _reference(pytester.path)
    # the default rounds (auto), whose open A/B verdict would have held them on: the gate's own use
    run = run_user(TWO_TESTS, "-q", "--opt-rounds=auto", f"--opt-ab={reference}", "--opt-ab-fail=latency:20%")
    run.result.assert_outcomes(passed=2)
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED  # a gate that judged nothing does not pass
    hung, after = run.test("test_sdpa"), run.test("test_static_cache")
    for row in (hung, after):  # the candidate's own rounds went on, as a test without the A/B runs them
        assert row["optimized"]["rounds"] == 5 and row["ab"]["verdict"] == "not comparable", row["ab"]
        assert row["rounds_decision"]["ab"] is None and not any("--opt-ab-fail" in note for note in row["notes"])
    stopped = hung["ab"]["details"][0]
    found = re.fullmatch(r"the reference stopped answering after (\d+) s: the reference worker \(.*\) did not answer "
                         r"a round of \[sdpa\] on tiny-random-llama within \d+ s and was killed", stopped)
    assert found is not None, stopped
    seconds = int(found.group(1))
    assert 3 <= seconds < 60
    assert after["ab"]["details"] == [f"the reference stopped answering in test_user.py::test_sdpa (after {seconds} "
                                      f"s, killed); this session starts no other: no A/B for the tests after it"]
    assert run.report["ab"]["summary"] == _summary(not_comparable=2)
    run.result.stdout.fnmatch_lines([f"AB not comparable test_user.py::test_sdpa: {stopped[:40]}*",
                                     "AB not comparable test_user.py::test_static_cache: the reference stopped "
                                     "answering in test_user.py::test_sdpa*",
                                     "*--opt-ab-fail=latency:20%: no test could be judged (the reference stopped "
                                     "answering*): the run fails"])
    started = _started(pytester.path)
    assert len(started) == 1 and not _running(started[0])  # killed, and no second worker to hang again


def test_a_package_bump_is_what_differs_not_identical_stacks(run_user: Any, pytester: pytest.Pytester) -> None:
    installed = importlib.metadata.version("optimum-quanto")
    # the reference's optimum-quanto one release older: its metadata first on the reference's path
    older = pytester.path / "older" / "optimum_quanto-0.2.6.dist-info"
    older.mkdir(parents=True)
    (older / "METADATA").write_text("Metadata-Version: 2.1\nName: optimum-quanto\nVersion: 0.2.6\n")
    reference = _reference(pytester.path, pythonpath=older.parent)
    run = run_user(SDPA_TEST, "--opt-rounds=2", f"--opt-ab={reference}", "--opt-report")
    run.result.assert_outcomes(passed=1)
    top = run.report["ab"]
    assert top["differs"] == {"optimum-quanto": [f"{installed} (candidate)", "0.2.6 (reference)"]}
    assert top["note"] is None and run.test("test_sdpa")["ab"]["note"] is None
    # the full lists are kept: every distribution of each interpreter, the same but for the bump
    candidate, reference_versions = top["candidate"]["versions"], top["reference"]["versions"]
    assert {"torch", "transformers", "numpy", "safetensors", "pytest"} <= set(candidate)
    assert reference_versions == {**candidate, "optimum-quanto": "0.2.6"}
    assert top["candidate"]["complete"] is top["reference"]["complete"] is True
    output = run.result.stdout.str()
    assert f"what differs: optimum-quanto {installed} (candidate) / 0.2.6 (reference)" in output
    assert f"candidate (optimum-quanto {installed}) vs reference (optimum-quanto 0.2.6)" in output
    assert "identical stacks" not in output  # was: "what differs: nothing (identical stacks) ... a null comparison"


def test_a_dead_workers_error_names_the_configuration_and_its_last_lines_and_the_gate_says_what_happened(
        run_user: Any, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CRASH_ENV, "generate:1")  # every worker exits at its first round, unanswered
    reference = _reference(pytester.path)
    run = run_user(SDPA_TEST, "-q", f"--opt-ab={reference}", "--opt-ab-fail=latency:20%")
    run.result.assert_outcomes(failed=1)
    error = run.test("test_sdpa")["error"]
    said, _, lines = error.partition("\n")
    assert said.endswith(f"died during a round of [sdpa] on tiny-random-llama: exit status {CRASH_STATUS}; its last "
                         f"lines on stderr:"), error  # was: the session's cache key, a tuple
    # the tail as a terminal shows it (a progress bar's last state), the worker's own last words last
    assert lines.splitlines()[-1] == f"  ab_worker: {CRASH_ENV}=generate:1: exiting with status {CRASH_STATUS} " \
                                     f"without answering", error
    assert "\r" not in error and "| 0/21 [" not in error  # a progress bar once, at its last state
    # once, not chained; counted above the short summary, which repeats the message whole where pytest sees CI set
    failures = run.result.stdout.str().partition("short test summary info")[0]
    assert failures.count("the reference environment's worker died") == 1
    # the candidate measured, then the test failed: said so, not "none measured anything"
    run.result.stdout.fnmatch_lines(["*--opt-ab-fail=latency:20%: no test has an A/B record (1 test ran, and none "
                                     "kept figures in the report (1 failed)): the run fails*"])
    assert not any(_running(pid) for pid in _started(pytester.path))


# rounds padded to a steady pause per forward pass (tests/slowdown.py): the candidate's twice the reference's
SLOWED_CANDIDATE = sleepy_conftest('''
IN_REFERENCE = sys.argv[0].endswith("ab_worker.py")
''', "0.02 if IN_REFERENCE else 0.04")

SLEEPY_TEST = '''
import pytest

@pytest.mark.optimization("sleepy")
def test_sleepy(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=3)
'''


def test_three_rounds_never_call_a_change_regressed_that_their_words_call_no_significant_difference(
        run_user: Any, pytester: pytest.Pytester) -> None:
    """3 rounds a side: too few for an interval or a significant rank test, so each figure's word is "no significant
    difference"; the gate said "regressed" on the same line (its median rule). One judge, one answer: the rounds
    could not resolve the change, and the line says so."""
    reference = _reference(pytester.path)
    run = run_user(SLEEPY_TEST, "--opt-rounds=3", f"--opt-ab={reference}", "--opt-ab-fail=latency:20%", "--opt-report",
                   conftest=SLOWED_CANDIDATE)
    run.result.assert_outcomes(passed=1)
    assert run.result.ret == pytest.ExitCode.OK  # inconclusive never fails a run
    ab = run.test("test_sleepy")["ab"]
    latency = ab["figures"]["latency"]
    assert latency["change_pct"] > 50 and latency["word"] == "no significant difference", latency
    assert ab["verdict"] == "inconclusive", ab
    line = next(line for line in run.result.stdout.lines if line.startswith("  test_sleepy: candidate vs reference"))
    assert "no significant difference" in line and line.endswith("; inconclusive (latency: not resolved by the rounds)")
    assert "regressed" not in line
    run.result.stdout.fnmatch_lines(["AB INCONCLUSIVE test_user.py::test_sleepy: latency * (+*%, limit 20%)*"])
