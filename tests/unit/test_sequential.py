"""Sequential rounds (verdict.sequential): the rule's parsing, the SPRT, and when rounds stop."""

from __future__ import annotations

import math
import random

import pytest

from pytest_transformers_opt.engine.measure import RoundTiming
from pytest_transformers_opt.errors import OptConfigError
from pytest_transformers_opt.verdict.budgets import BORDERLINE, MEDIANS_ONLY, Budget, BudgetCheck
from pytest_transformers_opt.verdict.sequential import (
    AUTO_ROUNDS, BEYOND, FALSE_ALARM_RATE, MISS_RATE, SEQUENTIAL_MAX_ROUNDS, SEQUENTIAL_MIN_ROUNDS, SLOWDOWN_MARGIN, WITHIN,
    RoundsDecision, RoundsRule, keep_going, log_excess, parse_rounds, rounds_to_settle, sprt)
from pytest_transformers_opt.verdict.stats import MIN_BOOTSTRAP_SAMPLES


@pytest.mark.parametrize(("text", "rule"), [
    ("5", RoundsRule(5)), (7, RoundsRule(7)), ("auto", AUTO_ROUNDS), (" AUTO ", AUTO_ROUNDS),
    ("2..9", RoundsRule(2, 9)), ("4..4", RoundsRule(4, 4)),
])
def test_rounds_forms(text: object, rule: RoundsRule) -> None:
    assert parse_rounds(text) == rule
    assert parse_rounds(rule) is rule


@pytest.mark.parametrize(("text", "fragment"), [
    ("0", "0 must be a whole number >= 1 and <= 1000"),
    ("9..3", "(MAX of MIN..MAX): 3 must be a whole number >= 9"),
    ("1..1", "(MAX of MIN..MAX): 1 must be a whole number >= 2"),
    ("0..5", "(MIN of MIN..MAX): 0 must be a whole number >= 1"),
    ("3-5", "'3-5' must be a whole number >= 1 and <= 1000; accepted: N (a fixed count, 1 to 1000), MIN..MAX"),
    ("..5", "'..5' is not MIN..MAX"),
    (True, "True must be a whole number"),
])
def test_bad_rounds_name_the_forms(text: object, fragment: str) -> None:
    with pytest.raises(OptConfigError) as info:
        parse_rounds(text, "opt_bench(rounds=...)")
    message = str(info.value)
    assert message.startswith("opt_bench(rounds=...)") and fragment in message


def test_auto_is_written_as_the_option_is_and_needs_the_interval_rounds_without_a_budget() -> None:
    assert repr(AUTO_ROUNDS) == "auto" and repr(RoundsRule(2, 9)) == "2..9" and repr(RoundsRule(5)) == "5"
    assert (AUTO_ROUNDS.minimum, AUTO_ROUNDS.maximum) == (SEQUENTIAL_MIN_ROUNDS, SEQUENTIAL_MAX_ROUNDS)
    assert AUTO_ROUNDS.report_minimum() == max(SEQUENTIAL_MIN_ROUNDS, MIN_BOOTSTRAP_SAMPLES)
    assert RoundsRule(3).report_minimum() == 3  # a fixed count is what was asked for
    assert RoundsRule(2, 3).report_minimum() == 3 and RoundsRule(7, 9).report_minimum() == 7  # within the rule


def _rounds(latencies: list[float]) -> list[RoundTiming]:
    return [RoundTiming(latency_s=s, ttft_s=s / 4, steps=8, tokens=24, total_s=s * 3) for s in latencies]


def test_log_excess_per_budget() -> None:
    opt = _rounds([0.10, 0.12])
    assert log_excess("min_speedup", 1.5, opt, [0.2, 0.2], None) == pytest.approx(
        [math.log(0.10 * 1.5 / 0.2), math.log(0.12 * 1.5 / 0.2)])
    # a stored baseline: each round against its median
    assert log_excess("min_speedup", 1.0, opt, None, 0.1) == pytest.approx([0.0, math.log(1.2)])
    assert log_excess("min_speedup", 1.0, opt, None, None) == []
    assert log_excess("max_latency", 0.1, opt, None, None) == pytest.approx([0.0, math.log(1.2)])
    assert log_excess("max_ttft", 0.025, opt, None, None) == pytest.approx([0.0, math.log(1.2)])
    # throughput 24 tokens / 0.3 s = 80 tok/s against a floor of 100: 25% short
    assert log_excess("min_throughput", 100.0, opt[:1], None, None) == pytest.approx([math.log(100 / 80)])


def test_sprt_settles_clear_cases_and_leaves_the_middle_open() -> None:
    rng = random.Random(1)
    noise = [rng.gauss(0, 0.03) for _ in range(6)]
    assert sprt([x - 0.3 for x in noise]) == WITHIN  # far inside the limit
    assert sprt([x + math.log(1.25) for x in noise]) == BEYOND  # 25% beyond it
    assert sprt([x + math.log(1.25) for x in noise[:3]]) is None  # but never a failure on 3 rounds
    assert sprt([0.0]) is None  # one round is never enough
    # halfway between the two hypotheses the test may end either way: it is no verdict, the rule decides
    halfway = [sprt([rng.gauss(math.log1p(SLOWDOWN_MARGIN) / 2, 0.03) for _ in range(5)]) for _ in range(200)]
    assert {WITHIN, BEYOND, None} == set(halfway)


def test_sprt_false_alarms_stay_near_the_error_rate_at_the_limit() -> None:
    """Null runs exactly at the limit (5% normal noise), stopped at the first decision up to the cap
    (optional stopping included): the share that ends BEYOND is a few times FALSE_ALARM_RATE (the noise
    is estimated from 3 to 10 rounds, so Wald's bound is not exact), and the rule's own significance
    test must agree before rounds stop on a failure; with 20% slowdowns none ends WITHIN."""
    rng = random.Random(7)
    alarms = misses = 0
    trials = 2000
    for _ in range(trials):
        null = [rng.gauss(0, 0.05) for _ in range(SEQUENTIAL_MAX_ROUNDS)]
        slow = [rng.gauss(math.log(1.2), 0.05) for _ in range(SEQUENTIAL_MAX_ROUNDS)]
        for series, wrong in ((null, BEYOND), (slow, WITHIN)):
            for n in range(SEQUENTIAL_MIN_ROUNDS, SEQUENTIAL_MAX_ROUNDS + 1):
                answer = sprt(series[:n])
                if answer is not None:
                    if answer == wrong:
                        if wrong == BEYOND:
                            alarms += 1
                        else:
                            misses += 1
                    break
    assert alarms / trials <= 6 * FALSE_ALARM_RATE, alarms
    assert misses == 0


def test_rounds_to_settle_grows_with_the_noise() -> None:
    quiet, loud = [0.01, -0.01, 0.0, 0.005], [0.5, -0.5, 0.2, -0.3]
    assert rounds_to_settle(quiet) < SEQUENTIAL_MIN_ROUNDS < SEQUENTIAL_MAX_ROUNDS < rounds_to_settle(loud)
    assert rounds_to_settle([0.1]) == math.inf


def _decide(latencies_opt: list[float], latencies_base: list[float], ok: bool, note: str | None = None,
            rule: RoundsRule = AUTO_ROUNDS) -> tuple[bool, RoundsDecision]:
    decision = RoundsDecision(rule, rounds=len(latencies_opt))
    budgets = {"min_speedup": Budget("min_speedup", 1.0, "marker")}
    checks = [BudgetCheck("min_speedup", 1.0, 1.0, ok, "marker", note)]
    go_on = keep_going(decision, budgets, checks, _rounds(latencies_opt), latencies_base, None)
    return go_on, decision


def test_stops_when_the_sprt_agrees_with_the_budgets_rule() -> None:
    fast, base = [0.05, 0.051, 0.049], [0.1, 0.1, 0.101]
    go_on, decision = _decide(fast, base, ok=True)
    assert not go_on and decision.settled
    assert decision.budgets == {"min_speedup": "passes, settled (SPRT: within 10% of the limit)"}
    assert decision.note() == ("sequential rounds: every speed budget settled after 3 rounds (min_speedup: passes, "
                               "settled (SPRT: within 10% of the limit))")
    # the same rounds, but the budget's own rule fails them: no early stop on a disagreement
    go_on, decision = _decide(fast, base, ok=False)
    assert go_on and not decision.settled
    assert decision.budgets["min_speedup"] == "fails by its rule; SPRT within 10% of the limit"


def test_a_slowdown_settles_as_a_failure() -> None:
    # 3 rounds are never a failure (the rule's rank test cannot reach significance yet); 4 can be
    assert _decide([0.13, 0.131, 0.129], [0.1, 0.1, 0.1], ok=False)[0]
    go_on, decision = _decide([0.13, 0.131, 0.129, 0.13], [0.1, 0.1, 0.1, 0.1], ok=False)
    assert not go_on and decision.settled
    assert decision.budgets["min_speedup"] == "fails, settled (SPRT: beyond 10% of the limit)"


def test_noise_too_large_to_settle_gets_a_fixed_counts_rounds() -> None:
    rng = random.Random(3)
    n = MIN_BOOTSTRAP_SAMPLES
    opt = [0.1 * math.exp(rng.gauss(0, 0.6)) for _ in range(2 * n)]
    base = [0.1 * math.exp(rng.gauss(0, 0.6)) for _ in range(2 * n)]
    # below the report's minimum: go on; at it, a clear pass stops
    assert _decide(opt[:n - 1], base[:n - 1], ok=True)[0]
    go_on, decision = _decide(opt[:n], base[:n], ok=True)
    assert not go_on and not decision.settled
    assert decision.budgets["min_speedup"] == f"passes by its rule; too noisy for the SPRT to settle within {SEQUENTIAL_MAX_ROUNDS} rounds"
    assert decision.note().startswith("sequential rounds: a speed budget was still open after 5 rounds")
    # a failure, or a pass within noise (borderline), gets as many rounds again as a fixed count confirms with
    for ok, note in ((False, None), (True, f"{BORDERLINE} (Mann-Whitney p=0.2)")):
        assert _decide(opt[:n], base[:n], ok=ok, note=note)[0]
        assert not _decide(opt, base, ok=ok, note=note)[0]


def test_the_cap_always_stops() -> None:
    rule = RoundsRule(3, 4)
    go_on, decision = _decide([0.1, 0.104, 0.098, 0.103], [0.1, 0.1, 0.1, 0.1], ok=True, rule=rule)
    assert not go_on
    assert decision.to_dict() == {"rule": "sequential", "min_rounds": 3, "max_rounds": 4, "rounds": 4,
                                  "settled": decision.settled, "margin": SLOWDOWN_MARGIN,
                                  "false_alarm_rate": FALSE_ALARM_RATE, "miss_rate": MISS_RATE,
                                  "budgets": decision.budgets, "ab": None}


@pytest.mark.parametrize("rule", [RoundsRule(3, 3), RoundsRule(1, 2), RoundsRule(2, 3)])
def test_a_failure_at_a_cap_below_the_fewest_failing_rounds_is_left_to_confirm(rule: RoundsRule) -> None:
    """A MAX below MIN_FAIL_ROUNDS can never settle a failure: the rule's failure there stands on the
    medians alone, so it is marked for a second set of rounds (bench confirms it), never a verdict."""
    assert rule.maximum is not None
    slow, base = [0.13] * rule.maximum, [0.1] * rule.maximum
    go_on, decision = _decide(slow, base, ok=False, note=f"too few rounds: {MEDIANS_ONLY}", rule=rule)
    assert not go_on and not decision.settled and decision.unsettled_failures == ["min_speedup"]
    decision.confirmation_rounds = decision.rounds
    note = decision.note()
    assert note is not None and f"failed after {rule.maximum} rounds, too few to settle a failure" in note
    assert f"its own rule judged all {2 * rule.maximum}" in note
    # a pass needs no confirmation, and neither does a failure the SPRT settled on enough rounds
    assert _decide(base, base, ok=True, rule=rule)[1].unsettled_failures == []
    settled = _decide([0.13, 0.131, 0.129, 0.13], [0.1] * 4, ok=False, rule=RoundsRule(3, 4))[1]
    assert settled.settled and settled.unsettled_failures == []
    # the medians alone are never a settled failure, at any count (a stored baseline with too few rounds)
    alone = _decide([0.13, 0.131, 0.129, 0.13], [0.1] * 4, ok=False, note=f"too few rounds: {MEDIANS_ONLY}",
                    rule=RoundsRule(3, 4))[1]
    assert not alone.settled and alone.unsettled_failures == ["min_speedup"]


def test_a_budget_that_was_not_measured_leaves_nothing_to_settle() -> None:
    decision = RoundsDecision(AUTO_ROUNDS, rounds=3)
    budgets = {"max_ttft": Budget("max_ttft", 0.1, "marker")}
    checks = [BudgetCheck("max_ttft", 0.1, None, None, "marker", "not measured in this run")]
    assert not keep_going(decision, budgets, checks, _rounds([0.1] * 3), None, None)
    assert decision.settled and decision.budgets == {"max_ttft": "not measured"}
