"""Sequential rounds: measure until every speed budget's verdict is settled, not a fixed count.

``--opt-rounds=auto`` (the default) and ``--opt-rounds=MIN..MAX`` run at least MIN interleaved
rounds and then one more at a time, up to MAX, while a speed budget's verdict is still open. A
verdict is settled when two independent questions give the same answer:

* Wald's sequential probability ratio test on the rounds' log excess over the limit (for
  ``min_speedup``: log(optimized x limit / baseline) of each interleaved pair) between "within the
  limit" (mean 0) and "``SLOWDOWN_MARGIN`` beyond it" (errors ``FALSE_ALARM_RATE`` and
  ``MISS_RATE``), the noise estimated from the rounds themselves; and
* the budget's own rule (``budgets.check_budgets``: the medians, and for ``min_speedup`` the
  one-sided Mann-Whitney test), which stays the verdict.

The SPRT decides when to stop, never what the verdict is: a run that stops early has exactly the
verdict the same rounds would have had at a fixed count, and one whose two answers disagree goes
on to MAX and is judged there by the budget's rule, as a fixed count is. A failure no look could
settle (a MAX below ``MIN_FAIL_ROUNDS``, or a rule that judged the medians alone) is confirmed as a
fixed count's is: as many rounds again, judged on all of them. A test with no speed budget runs the
rounds the report's 95% interval needs (``MIN_BOOTSTRAP_SAMPLES``).
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import OptConfigError
from ..units import parse_non_negative_int, shown
from .budgets import BORDERLINE, MEDIANS_ONLY, SPEED_BUDGETS, Budget, BudgetCheck
from .stats import MIN_BOOTSTRAP_SAMPLES, SIGNIFICANCE, min_signed_rank_p_value

if TYPE_CHECKING:
    from ..engine.measure import RoundTiming

MAX_ROUNDS = 1000  # measured rounds per side: more only burns CI time (the medians settle long before)
SEQUENTIAL_MIN_ROUNDS = 3  # the fewest rounds at which a noise estimate means anything
MIN_FAIL_ROUNDS = 4  # the fewest at which the Mann-Whitney test can reach p < 0.05: no earlier failure
SEQUENTIAL_MAX_ROUNDS = 10  # the cap while a verdict stays open: a fixed count's 5 rounds and its 5 confirming ones
SLOWDOWN_MARGIN = 0.10  # the SPRT's alternative: 10% beyond the limit (20% slowdowns are caught every time)
FALSE_ALARM_RATE = 0.001  # the SPRT's error when it stops on a failure: a failed gate blocks a merge
MISS_RATE = 0.01  # its error when it stops on a pass
NOISE_FLOOR = 0.005  # the smallest per-round noise (log scale) assumed: a few equal rounds prove nothing more
WITHIN, BEYOND = "within", "beyond"


@dataclass(frozen=True)
class RoundsRule:
    """How many timed rounds a test runs: ``maximum`` None for a fixed count (``minimum`` rounds)."""

    minimum: int
    maximum: int | None = None

    @property
    def sequential(self) -> bool:
        return self.maximum is not None

    def report_minimum(self) -> int:
        """Rounds a test without a speed budget runs: enough for the report's 95% interval (within the cap)."""
        if self.maximum is None:
            return self.minimum
        return min(max(self.minimum, MIN_BOOTSTRAP_SAMPLES), self.maximum)

    def __repr__(self) -> str:  # as the option is written (the --help default, the report header)
        if self == AUTO_ROUNDS:
            return "auto"
        return f"{self.minimum}..{self.maximum}" if self.sequential else str(self.minimum)


AUTO_ROUNDS = RoundsRule(SEQUENTIAL_MIN_ROUNDS, SEQUENTIAL_MAX_ROUNDS)
# auto's cap while an --opt-ab-fail verdict on rounds is open: telling a 10% slowdown from a 5% limit at a
# 2-core CPU's paired spread (0.19 on log time) takes ~55 pairs on average; of 200 simulated 10% slowdowns a
# cap of 100 left 15% open and found 84%, 200 left 1.5% open and found 96% (benchmarks/ab_rounds_sim.py)
AB_MAX_ROUNDS = 200
# ... and within this many seconds of a test's timed rounds (every side's, wall time): past auto's own 10 rounds an
# open A/B verdict stops here and is judged on what ran. A GPU test of 3 s a round would otherwise take 10 minutes to
# reach 200 (one did not finish in 255 s on the H200); the slowest study case here, smollm2-135m on 2 cores at 5 s a
# round, settled in 50 rounds (250 s). MIN..MAX has no time cap: its MAX is the user's.
AB_MAX_SECONDS = 300.0
# the fewest pairs on which the A/B's signed-rank rule can reach significance, and so judges pairs (5)
AB_MIN_PAIRS = next(n for n in range(1, MAX_ROUNDS) if min_signed_rank_p_value(n) < SIGNIFICANCE)
MAX_WARMUP = 100  # warm-up rounds per side
ROUNDS_FORMS = (f"N (a fixed count, 1 to {MAX_ROUNDS}), MIN..MAX (sequential) or auto "
                f"({SEQUENTIAL_MIN_ROUNDS}..{SEQUENTIAL_MAX_ROUNDS}; to {AB_MAX_ROUNDS} while an --opt-ab-fail verdict is open, "
                f"within {AB_MAX_SECONDS:g} s of a test's timed rounds)")


def parse_rounds(value: object, where: str = "rounds") -> RoundsRule:
    """``5`` / ``"5"`` (fixed), ``"auto"`` or ``"MIN..MAX"`` (sequential); a bad value names the forms."""
    if isinstance(value, RoundsRule):
        return value
    text = value.strip().lower() if isinstance(value, str) else None
    if text == "auto":
        return AUTO_ROUNDS
    if text is not None and ".." in text:
        match = re.fullmatch(r"([0-9]{1,30})\.\.([0-9]{1,30})", text)
        if match is None:
            raise OptConfigError(f"{where}: {shown(value, 40)} is not MIN..MAX; accepted: {ROUNDS_FORMS}")
        low = parse_non_negative_int(match[1], f"{where} (MIN of MIN..MAX)", minimum=1, maximum=MAX_ROUNDS)
        high = parse_non_negative_int(match[2], f"{where} (MAX of MIN..MAX)", minimum=max(low, 2), maximum=MAX_ROUNDS)
        return RoundsRule(low, high)
    try:
        return RoundsRule(parse_non_negative_int(value, where, minimum=1, maximum=MAX_ROUNDS))
    except OptConfigError as exc:
        raise OptConfigError(f"{exc}; accepted: {ROUNDS_FORMS}") from None


def log_excess(name: str, limit: float, optimized: "list[RoundTiming]",
               baseline_latencies: list[float] | None, baseline_median: float | None) -> list[float]:
    """Per round, how far beyond ``limit`` the budget's figure lies, on a log scale (> 0: beyond).

    ``min_speedup`` pairs round i of each side when both sides ran interleaved rounds here
    (``baseline_latencies``), else compares each optimized round with the baseline's median (a
    stored baseline).
    """
    if name == "min_speedup":
        latencies = [r.latency_s for r in optimized]
        if baseline_latencies is not None and len(baseline_latencies) == len(optimized):
            pairs = list(zip(latencies, baseline_latencies))
        elif baseline_median:
            pairs = [(o, baseline_median) for o in latencies]
        else:
            return []
        return [math.log(o * limit / b) for o, b in pairs if o > 0 and b > 0]
    if name == "min_throughput":
        return [math.log(limit * r.total_s / r.tokens) for r in optimized if r.tokens > 0 and r.total_s > 0]
    values: list[float | None] = ([r.latency_s for r in optimized] if name == "max_latency"
                                  else [r.ttft_s for r in optimized] if name == "max_ttft"
                                  else [r.tpot_s for r in optimized])
    return [math.log(v / limit) for v in values if v is not None and v > 0]


def _robust(excess: list[float]) -> tuple[float, list[float]]:
    """(noise, rounds clipped). The noise is the larger of the rounds' standard deviation and their
    median absolute deviation (x 1.4826), at least ``NOISE_FLOOR``: either alone is often far too small
    in 3-round samples (the deviation alone gave 3.2% false alarms instead of 1.3% in a simulation of
    null runs with 5% normal noise). Each round is clipped to within 3 noises of the
    median, so one stalled round on a shared machine moves the test by a bounded step."""
    middle = statistics.median(excess)
    spread = 1.4826 * statistics.median(abs(x - middle) for x in excess)
    sigma = max(spread, statistics.stdev(excess), NOISE_FLOOR)
    return sigma, [min(max(x, middle - 3 * sigma), middle + 3 * sigma) for x in excess]


def sprt(excess: list[float], margin: float = SLOWDOWN_MARGIN, false_alarm: float = FALSE_ALARM_RATE,
         miss: float = MISS_RATE) -> str | None:
    """WITHIN or BEYOND once Wald's test between mean 0 and log(1 + margin) decides; None while open.

    Normal rounds (the noise estimated from them and clipping, see ``_robust``): the log-likelihood
    ratio of n rounds is delta / sigma^2 x sum(x - delta / 2), against Wald's bounds
    log((1 - miss) / false_alarm) and log(miss / (1 - false_alarm)).
    """
    if len(excess) < 2:
        return None
    delta = math.log1p(margin)
    sigma, clipped = _robust(excess)
    llr = delta / sigma**2 * sum(x - delta / 2 for x in clipped)
    if llr >= math.log((1 - miss) / false_alarm) and len(excess) >= MIN_FAIL_ROUNDS:
        return BEYOND
    if llr <= math.log(miss / (1 - false_alarm)):
        return WITHIN
    return None


def rounds_to_settle(excess: list[float], margin: float = SLOWDOWN_MARGIN) -> float:
    """Wald's expected rounds for the SPRT to settle at either hypothesis, at this noise (the larger)."""
    if len(excess) < 2:
        return math.inf
    sigma, _ = _robust(excess)
    bound = max(math.log((1 - MISS_RATE) / FALSE_ALARM_RATE), -math.log(MISS_RATE / (1 - FALSE_ALARM_RATE)))
    return 2 * sigma**2 * bound / math.log1p(margin) ** 2


def _answers(how: dict[str, str]) -> str:
    """``name: how it was reached; ...`` for a note."""
    return "; ".join(f"{name}: {word}" for name, word in how.items())


@dataclass
class RoundsDecision:
    """What the sequential rule decided, for the report (``rounds_decision``)."""

    rule: RoundsRule
    rounds: int = 0
    settled: bool = True
    budgets: dict[str, str] = field(default_factory=dict)  # speed budget -> how its verdict was reached
    ab: dict[str, str] = field(default_factory=dict)  # --opt-ab-fail threshold on rounds -> how its verdict was reached
    ab_settled: bool = True
    ab_max_rounds: int | None = None  # the cap while an A/B verdict is open (``ab_cap``); None: no A/B gate on rounds
    ab_max_seconds: float | None = None  # auto's time cap on those rounds (``ab_time_cap``); None: the count alone
    ab_stopped_by_time: bool = False  # an A/B verdict was still open when the time cap stopped the rounds
    doubted: bool = False  # too noisy to settle, and the rule failed a budget at the report's minimum or later
    # speed budgets the rule fails where no look could have settled a failure (fewer than MIN_FAIL_ROUNDS
    # rounds, or the medians alone): never a verdict by itself, they are measured again (``unsettled_failures``)
    unsettled_failures: list[str] = field(default_factory=list)
    confirmation_rounds: int = 0  # rounds run again to confirm them

    def to_dict(self) -> dict[str, Any]:
        ab = None
        if self.ab_max_rounds is not None:
            ab = {"max_rounds": self.ab_max_rounds, "max_seconds": self.ab_max_seconds,
                  "stopped_by_time": self.ab_stopped_by_time, "settled": self.ab_settled, "thresholds": dict(self.ab)}
        return {"rule": "sequential", "min_rounds": self.rule.minimum, "max_rounds": self.rule.maximum,
                "rounds": self.rounds, "settled": self.settled, "margin": SLOWDOWN_MARGIN,
                "false_alarm_rate": FALSE_ALARM_RATE, "miss_rate": MISS_RATE, "budgets": dict(self.budgets),
                "ab": ab}

    def note(self) -> str | None:
        """The test's note on its rounds; None without a speed budget or an A/B gate on rounds (the report's
        minimum ran)."""
        parts = [part for part in (self._budgets_note(), self._ab_note()) if part]
        return "sequential rounds: " + "; ".join(parts) if parts else None

    def _budgets_note(self) -> str | None:
        if not self.budgets:
            return None
        how = _answers(self.budgets)
        if self.settled:
            return f"every speed budget settled after {self.rounds} rounds ({how})"
        if self.confirmation_rounds:
            return (f"{', '.join(self.unsettled_failures)} failed after {self.rounds} rounds, "
                    f"too few to settle a failure (a failure needs {MIN_FAIL_ROUNDS} rounds per side and a "
                    f"significance test), so {self.confirmation_rounds} more rounds ran and its own rule judged all "
                    f"{self.rounds + self.confirmation_rounds} ({how})")
        return f"a speed budget was still open after {self.rounds} rounds, judged by its own rule there ({how})"

    def _ab_note(self) -> str | None:
        if not self.ab:
            return None
        how = _answers(self.ab)
        if self.ab_settled:
            return f"every --opt-ab-fail verdict on rounds settled after {self.rounds} rounds ({how})"
        cap = (f"the time cap: {self.ab_max_seconds:g} s of timed rounds, for auto" if self.ab_stopped_by_time
               else "the cap")
        return (f"an --opt-ab-fail verdict was still open after {self.rounds} rounds ({cap}), judged by the gate's "
                f"rule there ({how})")


def keep_going(decision: RoundsDecision, budgets: dict[str, Budget], checks: list[BudgetCheck],
               optimized: "list[RoundTiming]", baseline_latencies: list[float] | None,
               baseline_median: float | None) -> bool:
    """After ``decision.rounds`` rounds: True while another round could settle a speed budget.

    A budget is settled when the SPRT agrees with the budget's rule; a failure only where the rule
    failed it on a significance test (not on the medians alone, as it must below 4 rounds per side).
    Rounds stop when every speed budget is settled, at the cap, or when the rounds are too noisy for
    the SPRT to settle before the cap (Wald's expected rounds beyond it) and the rule has passed every
    open budget clearly (not within noise) at every look since the report's minimum: otherwise the
    rounds go on to the cap, as a fixed count's confirming rounds would, and the rule judges there.
    A failure that stands where no look could settle one is listed in ``decision.unsettled_failures``
    for the caller to confirm with a second set of rounds.
    """
    rule, rounds = decision.rule, decision.rounds
    assert rule.maximum is not None
    decision.budgets = {}
    decision.unsettled_failures = []
    still_open: list[tuple[bool, bool]] = []  # (the rule clearly passes it, too noisy to settle before the cap)
    for check in checks:
        budget = budgets.get(check.name)
        if budget is None or check.name not in SPEED_BUDGETS:
            continue
        if check.ok is None:  # not measurable in this run: nothing more rounds could decide
            decision.budgets[check.name] = "not measured"
            continue
        note = check.note or ""
        excess = log_excess(check.name, budget.limit, optimized, baseline_latencies, baseline_median)
        answer = sprt(excess)
        rule_word = "passes" if check.ok else "fails"
        if answer == (WITHIN if check.ok else BEYOND) and not note.endswith(MEDIANS_ONLY):
            decision.budgets[check.name] = f"{rule_word}, settled (SPRT: {answer} {SLOWDOWN_MARGIN:.0%} of the limit)"
            continue
        if not check.ok and (rounds < MIN_FAIL_ROUNDS or note.endswith(MEDIANS_ONLY)):
            decision.unsettled_failures.append(check.name)
        noisy = rounds_to_settle(excess) > rule.maximum
        still_open.append((check.ok and not note.startswith(BORDERLINE), noisy))
        why = (f"too noisy for the SPRT to settle within {rule.maximum} rounds" if noisy
               else "SPRT open" if answer is None else f"SPRT {answer} {SLOWDOWN_MARGIN:.0%} of the limit")
        decision.budgets[check.name] = f"{rule_word} by its rule; {why}"
    decision.settled = not still_open
    if decision.settled or rounds >= rule.maximum:
        return False
    if all(noisy for _, noisy in still_open) and rounds >= rule.report_minimum():
        if not all(clear for clear, _ in still_open):
            decision.doubted = True
        return decision.doubted
    return True

