"""Sequential rounds end to end: a user's tests under the default ``--opt-rounds=auto``.

Timing on a shared 2-core machine is noisy, so these tests assert what holds at any noise: how many
rounds each kind of test may run, that the record says why, and that the verdict is the budget's.
"""

from __future__ import annotations

import pytest

from pytest_transformers_opt.verdict.sequential import SEQUENTIAL_MAX_ROUNDS, SEQUENTIAL_MIN_ROUNDS
from pytest_transformers_opt.verdict.stats import MIN_BOOTSTRAP_SAMPLES

from slowdown import slowdown_technique

CONFTEST = '''
import contextlib
import time

from pytest_transformers_opt.techniques import Technique


''' + slowdown_technique("FourTimesSlower", "four_times_slower", 3) + '''

def pytest_opt_register_techniques(registry):
    registry.register(FourTimesSlower)
'''

TESTS = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_no_speed_budget(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa", min_speedup=0.001)
def test_far_within_its_budget(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("four_times_slower", min_speedup=1.0)
def test_much_slower(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa", min_speedup=0.001)
def test_fixed_count(opt_bench):
    opt_bench(max_new_tokens=4, rounds=4)

@pytest.mark.optimization("sdpa", max_latency="1000 s")
def test_own_range(opt_bench):
    opt_bench(max_new_tokens=4, rounds="2..3")

@pytest.mark.optimization("sdpa")
def test_bad_range(opt_bench):
    opt_bench(max_new_tokens=4, rounds="5..2")
'''


def _rounds(entry: dict) -> int:
    assert entry["optimized"]["rounds"] == entry["baseline"]["rounds"]  # interleaved: one per side per round
    return entry["optimized"]["rounds"]


def test_rounds_stop_where_the_verdict_is_settled(run_user) -> None:
    run = run_user(TESTS, "--opt-rounds=auto", "--opt-warmup=0", "--opt-report", conftest=CONFTEST)
    run.result.assert_outcomes(passed=4, failed=2)
    settings = run.report["settings"]
    assert (settings["rounds"], settings["max_rounds"]) == (SEQUENTIAL_MIN_ROUNDS, SEQUENTIAL_MAX_ROUNDS)
    run.result.stdout.fnmatch_lines([f"*medians of {SEQUENTIAL_MIN_ROUNDS} to {SEQUENTIAL_MAX_ROUNDS} (sequential*"])

    # no speed budget: the rounds the report's interval needs, and the interval is there
    plain = run.test("test_no_speed_budget")
    assert _rounds(plain) == MIN_BOOTSTRAP_SAMPLES
    assert plain["rounds_decision"] == {
        "rule": "sequential", "min_rounds": SEQUENTIAL_MIN_ROUNDS, "max_rounds": SEQUENTIAL_MAX_ROUNDS,
        "rounds": MIN_BOOTSTRAP_SAMPLES, "settled": True, "margin": 0.1, "false_alarm_rate": 0.001, "miss_rate": 0.01,
        "budgets": {}, "ab": None}  # no --opt-ab-fail: nothing of the A/B gate held the rounds
    assert plain["speedup_interval"] is not None
    assert not any(note.startswith("sequential rounds") for note in plain["notes"])
    assert plain["workload"]["max_rounds"] == SEQUENTIAL_MAX_ROUNDS

    # a budget 1000x away from the measurement: settled at the minimum, or, if this machine is too
    # noisy for the SPRT, at the report's minimum; never the cap
    within = run.test("test_far_within_its_budget")
    decision = within["rounds_decision"]
    assert SEQUENTIAL_MIN_ROUNDS <= _rounds(within) == decision["rounds"] <= MIN_BOOTSTRAP_SAMPLES
    assert decision["budgets"]["min_speedup"].startswith("passes")
    assert decision["settled"] == (decision["budgets"]["min_speedup"] == "passes, settled (SPRT: within 10% of the "
                                                                          "limit)")
    assert any(note.startswith("sequential rounds: ") for note in within["notes"])

    # four times slower than a budget of 1.0: fails by the budget's own rule, which the message gives
    slow = run.test("test_much_slower")
    assert slow["outcome"] == "failed" and slow["failed_budgets"] == ["min_speedup"]
    assert slow["rounds_decision"]["budgets"]["min_speedup"].startswith("fails")
    assert _rounds(slow) <= 2 * MIN_BOOTSTRAP_SAMPLES
    assert "after a second set of rounds" not in slow["error"]  # sequential rounds confirm as they go

    # a fixed count is a fixed count: no decision recorded
    fixed = run.test("test_fixed_count")
    assert _rounds(fixed) == 4 and fixed["rounds_decision"] is None and fixed["workload"]["max_rounds"] is None

    # opt_bench's own range: an absolute budget settles too
    own = run.test("test_own_range")
    assert 2 <= _rounds(own) <= 3
    assert (own["rounds_decision"]["min_rounds"], own["rounds_decision"]["max_rounds"]) == (2, 3)
    assert own["rounds_decision"]["budgets"]["max_latency"].startswith("passes")

    # a bad range is that test's error, naming the forms
    bad = run.test("test_bad_range")
    assert bad["outcome"] == "failed"
    assert "opt_bench(rounds=...) (MAX of MIN..MAX): 2 must be a whole number >= 5" in bad["error"]


@pytest.mark.parametrize("value", ["auto", "3..7"])
def test_the_rule_is_read_from_the_ini(pytester: pytest.Pytester, value: str) -> None:
    pytester.makeini(f"[pytest]\nopt_rounds = {value}\n")
    pytester.makepyfile("def test_uses_the_plugin(opt_model):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-report-json=report.json")
    result.assert_outcomes(passed=1)
    import json
    settings = json.loads((pytester.path / "report.json").read_text())["settings"]
    assert (settings["rounds"], settings["max_rounds"]) == ((3, 10) if value == "auto" else (3, 7))
