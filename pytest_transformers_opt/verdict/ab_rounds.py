"""The A/B gate's rounds: under sequential rounds, ``--opt-ab-fail`` verdicts on figures every round measures
keep interleaved rounds going until they are settled, as speed budgets do (``verdict.sequential``).

On a quiet GPU the pairs settle at the first looks; on a noisy 2-core CPU (a round's spread 15-25%) telling a
10% slowdown from a 5% limit takes about 50 pairs, where a fixed 10 caught half of them (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .ab import FIGURES
from .sequential import (AB_MAX_ROUNDS, AB_MAX_SECONDS, AB_MIN_PAIRS, AUTO_ROUNDS, BEYOND, WITHIN, RoundsDecision,
                         RoundsRule, sprt)

if TYPE_CHECKING:
    from .compare import Threshold

# The fewest pairs after which the rounds stop at a change (``regressed`` or ``improved``); "no change" stops from
# AB_MIN_PAIRS (5). The one false regression of 20 null sessions stopped at 5 pairs, every pair one way: a slow
# spell of the machine that lasted five rounds and fell on one side's turns (benchmarks/RESULTS.md). A verdict
# that fails a merge waits for 8 (signed-rank p at least 1/256 apart from a spell's); a real slowdown on a quiet
# runner pays 3 rounds more.
AB_MIN_CHANGE_PAIRS = 8

# the gate's verdict on one threshold so far, and the (reference, candidate) rounds it judged as pairs, or None
# (``session.OptSession.ab_gate_so_far``: the rule lives with the report's verdicts, a later stage)
GateSoFar = Callable[["Threshold", dict[str, Any], dict[str, Any]], tuple[str, "tuple[list[float], list[float]] | None"]]


def ab_cap(rule: RoundsRule) -> int:
    """The most rounds a test whose A/B verdict is open runs under the sequential ``rule``: ``auto`` goes on
    to ``AB_MAX_ROUNDS``, any other MIN..MAX stops at the user's MAX. ``3..10`` is ``auto`` (rules are equal by
    value: the workload rebuilds its rule from its two counts, and ``auto`` prints for both)."""
    assert rule.maximum is not None
    return max(rule.maximum, AB_MAX_ROUNDS) if rule == AUTO_ROUNDS else rule.maximum


def ab_time_cap(rule: RoundsRule) -> float | None:
    """The seconds of timed rounds past which ``auto`` stops an open A/B verdict's rounds (once its own maximum
    ran); None for any other MIN..MAX, whose MAX the user chose."""
    return AB_MAX_SECONDS if rule == AUTO_ROUNDS else None


def ab_thresholds_to_settle(thresholds: Sequence["Threshold"]) -> list["Threshold"]:
    """The ``--opt-ab-fail`` thresholds more rounds can settle: a relative limit above 0 on a figure every
    round measures (latency, TTFT, TPOT, throughput). Memory and similarity are measured once; an absolute
    or zero limit has no zone between "no change" and "twice the limit" to settle in."""
    return [t for t in thresholds if t.metric in FIGURES and FIGURES[t.metric][1] is not None
            and t.relative and t.limit > 0]


def _ab_directions(threshold: "Threshold", reference: list[float], candidate: list[float]) -> tuple[str | None, str | None]:
    """Wald's SPRT of the pairs' log-ratios, worse and better (in the figure's direction), each between no
    change (mean 0) and twice the limit (``(1 + limit)^2``): WITHIN, BEYOND (past the limit) or None (open)."""
    worse = [math.log(c / r) for c, r in zip(candidate, reference)]
    if FIGURES[threshold.metric][2]:  # higher is better
        worse = [-x for x in worse]
    twice = (1 + threshold.limit / 100.0) ** 2 - 1
    return sprt(worse, margin=twice), sprt([-x for x in worse], margin=twice)


def ab_keep_going(decision: RoundsDecision, thresholds: Sequence["Threshold"], candidate: dict[str, Any],
                  reference: dict[str, Any], gate_so_far: GateSoFar, elapsed_s: float = 0.0) -> bool:
    """After ``decision.rounds`` interleaved rounds, ``elapsed_s`` seconds of them: True while an ``--opt-ab-fail``
    verdict on rounds is open, up to the count cap (``decision.ab_max_rounds``) and, past the rule's own maximum,
    the time cap (``decision.ab_max_seconds``).

    ``candidate`` and ``reference`` are the two sides as the report holds them (``{"optimized": {...}}``).
    A threshold (``ab_thresholds_to_settle``) is settled when the gate's own rule (``gate_so_far``, ``report.ab``'s:
    the medians past the limit and the one-sided signed-rank test of the pairs) agrees with Wald's SPRT in both
    directions (``_ab_directions``): worse past the limit and ``regressed``, better past it and ``improved``,
    or within it both ways and ``ok``. The SPRT decides when to stop, never the verdict: the gate judges all
    the rounds at the session's end, as it would a fixed count. Until ``AB_MIN_PAIRS`` pairs the rule cannot
    judge on pairs, so the rounds go on; a change (``regressed``, ``improved``) settles only from
    ``AB_MIN_CHANGE_PAIRS`` pairs; a figure whose rounds are not pairs (a round that did not measure
    TTFT) is judged unpaired at the end and holds nothing open.
    """
    decision.ab = {}
    still_open = []
    for threshold in thresholds:
        name = threshold.describe()
        if decision.rounds < AB_MIN_PAIRS:
            decision.ab[name] = f"open (fewer than {AB_MIN_PAIRS} pairs)"
            still_open.append(name)
            continue
        verdict, pairs = gate_so_far(threshold, candidate, reference)
        if pairs is None:
            decision.ab[name] = f"{verdict} by the gate's rule on rounds that are not pairs"
            continue
        worse, better = _ab_directions(threshold, *pairs)
        agreed = (verdict, worse, better) in (("regressed", BEYOND, WITHIN), ("improved", WITHIN, BEYOND),
                                              ("ok", WITHIN, WITHIN))
        if agreed and verdict != "ok" and decision.rounds < AB_MIN_CHANGE_PAIRS:
            decision.ab[name] = f"{verdict} by the gate's rule and the SPRT; a change settles from {AB_MIN_CHANGE_PAIRS} pairs"
            still_open.append(name)
            continue
        if agreed:
            past = {"regressed": "worse by more than the limit", "improved": "better by more than the limit",
                    "ok": "within the limit both ways"}[verdict]
            decision.ab[name] = f"{verdict}, settled (SPRT: {past})"
            continue
        sprt_says = ", ".join(f"{way} {answer or 'open'}" for way, answer in (("worse", worse), ("better", better)))
        decision.ab[name] = f"{verdict} by the gate's rule; SPRT {sprt_says}"
        still_open.append(name)
    decision.ab_settled = not still_open
    if not still_open or decision.rounds >= (decision.ab_max_rounds or 0):
        return False
    assert decision.rule.maximum is not None
    if decision.ab_max_seconds is not None and decision.rounds >= decision.rule.maximum \
            and elapsed_s >= decision.ab_max_seconds:
        decision.ab_stopped_by_time = True
        return False
    return True
