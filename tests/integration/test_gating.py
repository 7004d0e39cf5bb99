"""Merge gating end to end: --opt-compare verdicts and exit status, stored baselines, xdist reports."""

from __future__ import annotations

import copy
import json

import pytest

# one round, no warm-up: these runs are about verdicts, notes and files, with latencies scaled 100x apart
CHEAP = ("--opt-rounds=1", "--opt-warmup=0")

SDPA_TEST = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=4)
'''


def _scaled_report(run, factor: float, path) -> str:
    """The run's own report with the optimized latency scaled: a synthetic earlier run."""
    report = copy.deepcopy(run.report)  # run.report is read once and shared
    for test in report["tests"]:
        for key in ("latency_s", "ttft_s", "tpot_s"):
            test["optimized"][key] *= factor
        test["optimized"]["throughput_tok_s"] /= factor
    path.write_text(json.dumps(report))
    return str(path)


def test_compare_fails_the_run_on_a_regression_and_passes_on_an_improvement(run_user, pytester):
    first = run_user(SDPA_TEST, *CHEAP)
    first.result.assert_outcomes(passed=1)
    much_faster_before = _scaled_report(first, 0.01, pytester.path / "old-fast.json")
    regressed = run_user(SDPA_TEST, *CHEAP, "--opt-report", f"--opt-compare={much_faster_before}",
                         "--opt-compare-fail=latency:10%")
    regressed.result.assert_outcomes(passed=1)  # the test itself passed ...
    assert regressed.result.ret == pytest.ExitCode.TESTS_FAILED  # ... the run fails on the regression
    regressed.result.stdout.fnmatch_lines(["REGRESSED *test_sdpa: latency * (+*%, limit 10%)*",
                                           "compare: 1 regressed, 0 inconclusive, 0 improved*"])
    assert regressed.test("test_sdpa")["regression"]["verdict"] == "regressed"

    much_slower_before = _scaled_report(first, 100.0, pytester.path / "old-slow.json")
    improved = run_user(SDPA_TEST, *CHEAP, f"--opt-compare={much_slower_before}", "--opt-compare-fail=latency:10%")
    assert improved.result.ret == pytest.ExitCode.OK
    assert improved.test("test_sdpa")["regression"]["verdict"] == "improved"


def test_compare_file_that_is_not_a_report_is_a_usage_error(run_user, pytester):
    bogus = pytester.path / "bogus.json"
    bogus.write_text('{"hello": 1}')
    run = run_user(SDPA_TEST, f"--opt-compare={bogus}")
    assert run.result.ret == pytest.ExitCode.USAGE_ERROR
    run.result.stderr.fnmatch_lines(["*--opt-compare:*not a*report*"])
    assert not run.report_path.exists()  # nothing half-written


FOUR_BIT = '''
import pytest

@pytest.mark.optimization("bnb_4bit")
def test_4bit(opt_bench):
    opt_bench(max_new_tokens=6)
'''


def test_stored_baselines_create_use_and_refuse_corrupt(run_user, pytester):
    created = run_user(FOUR_BIT, *CHEAP, "--opt-update-baselines")
    created.result.assert_outcomes(passed=1)
    files = sorted((pytester.path / ".opt-baselines").glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert stored["schema"] == "pytest-transformers-opt/baseline" and len(stored["tokens"]) == 3

    used = run_user(FOUR_BIT, *CHEAP)
    used.result.assert_outcomes(passed=1)
    entry = used.test("test_4bit")
    assert any("similarity against the stored baseline" in note for note in entry["notes"])
    assert any("same hardware fingerprint" in note for note in entry["notes"])
    assert entry["similarity"]["top1"] >= 0.85

    # a different fingerprint: similarity still from the file, speed and memory measured live
    stored["fingerprint"] = "device=cuda; gpu=NVIDIA H200"
    files[0].write_text(json.dumps(stored))
    mismatch = run_user(FOUR_BIT, *CHEAP)
    mismatch.result.assert_outcomes(passed=1)
    assert any("measured live" in note for note in mismatch.test("test_4bit")["notes"])

    files[0].write_text("{ not json")
    corrupt = run_user(FOUR_BIT, *CHEAP)
    corrupt.result.assert_outcomes(failed=1)
    corrupt.result.stdout.fnmatch_lines([f"*{files[0].name}*--opt-update-baselines*"])
    assert files[0].read_text() == "{ not json"  # never overwritten without the flag


def test_a_missing_stored_baseline_says_how_to_create_it(run_user, pytester):
    (pytester.path / ".opt-baselines").mkdir()
    run = run_user(FOUR_BIT, *CHEAP)
    run.result.assert_outcomes(passed=1)
    assert any("--opt-update-baselines" in note for note in run.test("test_4bit")["notes"])


def test_reports_are_complete_under_xdist(xdist_run):
    """The rows of both inner workers in one report (the shared ``-n 2`` session of tests/conftest.py)."""
    xdist_run.result.assert_outcomes(passed=3, skipped=1)
    data = json.loads((xdist_run.folder / "report.json").read_text())
    assert sorted(t["nodeid"].split("::")[-1] for t in data["tests"]) == [
        "test_8bit", "test_sdpa", "test_skipped_on_cpu", "test_static[3]"]
    assert data["summary"] == {"passed": 3, "failed": 0, "skipped": 1, "error": 0}
    assert all(t["optimized"] for t in data["tests"] if t["outcome"] == "passed")
    xdist_run.result.stdout.fnmatch_lines(["*transformers optimization report*", "test_sdpa*sdpa*passed*"])


def test_opt_bench_without_an_optimization_marker_is_an_error(run_user):
    run = run_user('''
def test_nothing_to_measure(opt_bench):
    opt_bench()
''')
    run.result.assert_outcomes(errors=1)
    run.result.stdout.fnmatch_lines(["*mark the test with @pytest.mark.optimization*"])
