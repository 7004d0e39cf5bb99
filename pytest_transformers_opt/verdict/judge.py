"""The one judge: every comparison's verdict word comes from here (one report, a window of recorded runs, an A/B,
``pytest-opt merge --compare``).

Each comparison path measures its own evidence, in the gated threshold's terms: how much worse the figure is
(``amount``, percent of the old value for a relative limit), one-sided p-values that it is worse (better) than
the limit allows, and the standard error of ``amount`` that gives the **detectable size**: the smallest
worsening this comparison would have flagged, ``limit + z * scale``. The rule is the same for all:

- ``regressed``: worse past the limit, and significantly so;
- ``improved``: the same the other way round;
- ``inconclusive``: worse past the limit but not significantly, or a detectable size above
  ``DETECTABLE_FACTOR`` times the limit: the data could not have flagged a change of the limit's size, so a pass
  would vouch for what it could not see. It never fails a run and is always listed, with the detectable size;
- ``ok``: only when the comparison could have flagged the change and did not.

Rows that cannot be compared at all are ``not comparable`` (with the reason) or ``new``; a verdict within a
reviewed acceptance is ``accepted``. A test's verdict is its worst threshold's (``worst``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from .stats import SIGNIFICANCE

OK = "ok"
REGRESSED = "regressed"
IMPROVED = "improved"
INCONCLUSIVE = "inconclusive"
NOT_COMPARABLE = "not comparable"
ACCEPTED = "accepted"
NEW = "new"
NOT_JUDGED = "not judged"  # an A/B row without thresholds or a measurement on one side
VERDICT_WORDS: tuple[str, ...] = (REGRESSED, INCONCLUSIVE, ACCEPTED, IMPROVED, OK, NEW, NOT_COMPARABLE, NOT_JUDGED)
"""Every word a comparison may end in (SPEC, fourth phase), most severe first."""
JUDGED_VERDICTS: tuple[str, ...] = (REGRESSED, IMPROVED, OK, INCONCLUSIVE, ACCEPTED)
"""Verdicts that compared figures (an inconclusive one did, and says how large a change it could have seen);
``new`` and ``not comparable`` rows judged nothing."""

DETECTABLE_FACTOR = 2.0
"""A comparison that could not flag a worsening of twice the limit cannot vouch for the test: ``inconclusive``.
(No finite sample flags a change of exactly the limit with certainty: the bar is where it would, at the one-sided
error rate, once the change is twice the limit.)"""

_REL_TOL = 1e-9  # a change equal to the limit (up to float rounding) is within it
_SEVERITY = (REGRESSED, INCONCLUSIVE, ACCEPTED, IMPROVED, OK)


def beyond_limit(amount: float, limit: float) -> bool:
    """``amount > limit``, with float rounding at the boundary counted as within."""
    return amount > limit and not math.isclose(amount, limit, rel_tol=_REL_TOL, abs_tol=1e-12)


def detectable_size(limit: float, critical: float, scale: float) -> float:
    """The smallest worsening flagged as significant past ``limit``: ``limit + critical * scale`` (``scale``: the
    standard error of the worsening; 0 for a figure measured exactly, whose every change past the limit is real)."""
    if not math.isfinite(scale):
        return math.inf
    return limit + critical * max(scale, 0.0)


def decide(amount: float, limit: float, p_worse: float, p_better: float, detectable: float,
           significance: float = SIGNIFICANCE) -> str:
    """The verdict of one threshold: ``amount`` is the worsening in the threshold's terms (negative: better),
    ``p_worse`` / ``p_better`` the one-sided p-values that it is worse / better than ``limit`` allows (already
    adjusted for a family where the caller judges one), ``detectable`` the smallest worsening the evidence would
    have flagged."""
    worse, better = beyond_limit(amount, limit), beyond_limit(-amount, limit)
    if worse and p_worse < significance:
        return REGRESSED
    if better and p_better < significance:
        return IMPROVED
    if worse or beyond_limit(detectable, DETECTABLE_FACTOR * limit):
        return INCONCLUSIVE
    return OK


def decide_exact(amount: float, limit: float) -> str:
    """The verdict on a figure read without sampling noise (a count, a stored similarity): past the limit is real."""
    return decide(amount, limit, 0.0, 0.0, limit)


def worst(verdicts: Iterable[str]) -> str:
    """A test's verdict: its worst threshold's (``ok`` when none judged)."""
    given = set(verdicts)
    return next((verdict for verdict in _SEVERITY if verdict in given), OK)


def not_comparable(reasons: list[str]) -> dict[str, Any]:
    """The verdict of a row that cannot be compared, with every reason."""
    return {"verdict": NOT_COMPARABLE, "details": reasons}


def new_row(detail: str) -> dict[str, Any]:
    """The verdict of a row with nothing to compare with yet."""
    return {"verdict": NEW, "details": [detail]}


def is_judged(verdict: Any) -> bool:
    """The verdict compared figures (see ``JUDGED_VERDICTS``)."""
    return verdict in JUDGED_VERDICTS
