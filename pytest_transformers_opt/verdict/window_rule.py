"""The window rule: one threshold of one test judged against a window of its recorded runs (``report.window``
selects the window; this decides), through the one judge (``verdict.judge.decide``).

The window's center is the median of its runs, its spread ``stats.robust_spread`` (1.4826 x MAD), floored for
timed figures at ``MIN_TIMED_SPREAD`` of the center (identical medians are a coarse timer or too few runs, not a
noiseless runner). Today's worsening ``w`` (percent of the center for a relative limit) is tested one-sided against
"worse by the limit ``L``": ``t = (w - L) / se`` with ``se`` the spread of one new run against a median of ``n``
runs (``stats.new_run_scale``) and Student's t of ``stats.new_run_degrees_of_freedom(n)``. The p-values of every
window-judged threshold of the run form one family, adjusted by Benjamini-Hochberg (``adjust``); the detectable
size is ``L + t_crit * se`` at the family's first bar ``SIGNIFICANCE / m``.

A census threshold (``ops:0``, ``graph_breaks:0`` ...) is not a statistic: a census is exact, a window of one stack
holds equal censuses, so it is judged exactly against the window's newest run with a census
(``census_against_newest``, by ``compare.judge_census_threshold``), never by the window's spread.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .census_diff import census_value, side_census
from .compare import (INCONCLUSIVE_TAG, IMPROVED_TAG, METRICS, NOT_SIGNIFICANT, OK_TAG, REGRESSED_TAG, Sides,
                      Threshold, change_text, judge_census_threshold, limit_text, signed_text, size_text, worsening)
from .judge import INCONCLUSIVE, OK, REGRESSED, IMPROVED, beyond_limit, decide, detectable_size
from .stats import (MIN_WINDOW_RUNS, SIGNIFICANCE, benjamini_hochberg, new_run_degrees_of_freedom, new_run_scale,
                    robust_spread, student_t_isf, student_t_sf)

MIN_TIMED_SPREAD = 0.005
"""Floor of a timed figure's spread, relative to its center: a timer's and a scheduler's noise is never 0."""
WINDOW_RULE = "window"
RECORDED_SIDES = Sides(old="recorded", new="new", record="run")
"""What a census verdict against a recorded run calls its two rows (no between-run term: a census is exact)."""


@dataclass
class WindowFigure:
    """One threshold of one test judged on its window: the statistics, then (``finish``) the verdict."""

    threshold: Threshold
    values: list[float]  # the window's per-run figures
    today: float
    center: float
    spread: float  # in the figure's units, after the floor
    floored: bool
    amount: float  # today's worsening, in the threshold's terms (percent of the center when relative)
    scale: float  # the standard error of ``amount``, in the same terms
    df: float
    p_worse: float
    p_better: float
    p_worse_adjusted: float = 1.0
    p_better_adjusted: float = 1.0
    detectable: float = math.inf
    verdict: str = OK

    @property
    def spread_pct(self) -> float | None:
        return 100.0 * self.spread / abs(self.center) if self.center else None

    def finish(self, family_size: int) -> None:
        """The verdict, once the family's adjusted p-values are set."""
        limit = self.threshold.limit
        # scale 0: every run gave the same figure (memory, similarity): any change past the limit is real
        critical = student_t_isf(SIGNIFICANCE / max(family_size, 1), self.df) if self.scale > 0 else 0.0
        self.detectable = detectable_size(limit, critical, self.scale)
        self.verdict = decide(self.amount, limit, self.p_worse_adjusted, self.p_better_adjusted, self.detectable)

    def detail(self) -> str:
        threshold, fmt = self.threshold, METRICS[self.threshold.metric].fmt
        metric = threshold.metric
        change = (change_text(metric, self.center, self.today) if threshold.relative
                  else signed_text(metric, self.today - self.center))
        spread = f"{self.spread_pct:.1f}%" if threshold.relative and self.spread_pct is not None else fmt(self.spread)
        text = (f"{metric} {fmt(self.today)} vs the window's median {fmt(self.center)} ({change}, limit "
                f"{limit_text(threshold)}), spread {spread}{' (floor)' if self.floored else ''}, detectable "
                f"{size_text(threshold, self.detectable)}")
        past = beyond_limit(abs(self.amount), threshold.limit)
        if past:
            adjusted = self.p_worse_adjusted if self.amount > 0 else self.p_better_adjusted
            text += f", adjusted p={adjusted:.2g}"
        return text + {REGRESSED: REGRESSED_TAG, INCONCLUSIVE: INCONCLUSIVE_TAG, IMPROVED: IMPROVED_TAG}.get(
            self.verdict, OK_TAG)

    def record(self) -> dict[str, Any]:
        """The ``regression.judged`` entry."""
        worse = self.amount >= 0
        note = None
        if self.floored:
            note = f"spread floored at {100 * MIN_TIMED_SPREAD:g}% of the median"
        elif self.verdict == OK and beyond_limit(abs(self.amount), self.threshold.limit):
            note = NOT_SIGNIFICANT
        return {"metric": self.threshold.metric, "threshold": self.threshold.describe(), "old": self.center,
                "new": self.today, "ratio": self.today / self.center if self.center else None, "rule": WINDOW_RULE,
                "p_value": self.p_worse if worse else self.p_better, "rounds": None, "note": note,
                "verdict": self.verdict, "runs": len(self.values), "spread": self.spread,
                "spread_pct": self.spread_pct, "detectable": self.detectable,
                "p_adjusted": self.p_worse_adjusted if worse else self.p_better_adjusted}


def window_figure(threshold: Threshold, values: Sequence[float], today: float) -> WindowFigure | None:
    """The statistics of one threshold on ``values`` (the window's per-run figures) and ``today``; None where the
    window rule cannot judge (fewer than ``MIN_WINDOW_RUNS`` values, a relative limit on a median of 0)."""
    metric = threshold.metric
    if len(values) < MIN_WINDOW_RUNS:
        return None
    center, spread = robust_spread(values)
    if threshold.relative and center == 0:
        return None
    floor = MIN_TIMED_SPREAD * abs(center) if METRICS[metric].timed else 0.0
    floored = spread < floor
    spread = max(spread, floor)
    amount = worsening(metric, center, today, threshold.relative)
    scale = new_run_scale(100.0 * spread / abs(center) if threshold.relative else spread, len(values))
    df = new_run_degrees_of_freedom(len(values))
    if scale > 0:
        p_worse = student_t_sf((amount - threshold.limit) / scale, df)
        p_better = student_t_sf((-amount - threshold.limit) / scale, df)
    else:
        p_worse = 0.0 if beyond_limit(amount, threshold.limit) else 1.0
        p_better = 0.0 if beyond_limit(-amount, threshold.limit) else 1.0
    return WindowFigure(threshold, list(values), today, center, spread, floored, amount, scale, df, p_worse, p_better)


def adjust(figures: Sequence[WindowFigure]) -> None:
    """Each figure's adjusted p-values (Benjamini-Hochberg over the run's window-judged thresholds, regressions
    and improvements as two families) and then its verdict."""
    for adjusted, figure in zip(benjamini_hochberg([f.p_worse for f in figures]), figures):
        figure.p_worse_adjusted = adjusted
    for adjusted, figure in zip(benjamini_hochberg([f.p_better for f in figures]), figures):
        figure.p_better_adjusted = adjusted
    for figure in figures:
        figure.finish(len(figures))


def _census_key(row: Mapping[str, Any], metric: str) -> str | None:
    """The optimized side's ``metric`` as comparable text (a count map or a number); None where not counted."""
    census, _ = side_census(row)
    value = census_value(census, metric)[0] if census is not None else None
    return None if value is None else json.dumps(value, sort_keys=True)


def census_against_newest(threshold: Threshold, window: Sequence[tuple[str, Mapping[str, Any]]],
                          today: dict[str, Any]) -> tuple[str, str, dict[str, Any] | None]:
    """(verdict, detail, judged record) of a census threshold on a window (``window``: (run name, row), newest
    first): exact, against the newest run that counted the metric (the newest run when none did: then
    inconclusive, saying why). Where the window's runs counted more than one value, the detail says how many:
    the stack's own variation, or a change already recorded, that the newest run stands for."""
    metric = threshold.metric
    counted = [(name, row, key) for name, row in window if (key := _census_key(row, metric)) is not None]
    name, row = (counted[0][0], counted[0][1]) if counted else window[0]
    verdict, detail, record = judge_census_threshold(threshold, dict(row), today, RECORDED_SIDES)
    against = (f"against {name}, the window's newest run with {metric} counted (a census is exact: no spread)"
               if counted else f"against {name}, the window's newest run")
    held = len({key for _, _, key in counted})
    if held > 1:
        against += f"; the window's runs held {held} different {metric} censuses, the newest stands for them"
    return verdict, f"{against}: {detail}", record
