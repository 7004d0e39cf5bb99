"""--opt-compare-confirm: a regression against the window of recorded runs fails the gate only when a second
measurement of the same test, taken after the other tests of the session, regresses too.

Dashboards that gate merges on a window of runs (PyTorch's) call a regression after two consecutive violations:
one slow measurement is too often a busy machine. Here the second measurement comes in the same session: the
session re-runs the test (``OptSession.confirm_regressions``), its figures ride on the row as ``confirmation``,
and ``confirm_verdicts`` decides with both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..units import clip
from ..verdict.compare import IMPROVED_TAG, INCONCLUSIVE_TAG, OK_TAG, REGRESSED_TAG, verdict_keys
from ..verdict.judge import NEW, NOT_COMPARABLE, REGRESSED

if TYPE_CHECKING:
    from ..options import Settings

_REASON_CHARS = 160
# what a row's confirmation keeps of the second measurement: what the window judges, and how the test ended
CONFIRMATION_KEYS = ("outcome", "error", "baseline", "optimized", "speedup", "speedup_interval", "memory_ratio",
                     "similarity")


def confirmation_wanted(settings: "Settings") -> bool:
    """A window of recorded runs as the reference, a gate on it, and confirmation on (the default)."""
    return bool(settings.compare_history and settings.compare_thresholds and settings.compare_confirm)


def confirmation_of(again: Mapping[str, Any]) -> dict[str, Any]:
    """The part of the second measurement's row (``again``) that a row keeps as its ``confirmation``."""
    return {key: again.get(key) for key in CONFIRMATION_KEYS}


def confirm_verdicts(report: dict[str, Any], verdicts: dict[str, dict[str, Any]],
                     judge: Callable[[dict[str, Any]], dict[str, dict[str, Any]]]) -> list[str]:
    """Each regressed row that was measured again, judged once more on its ``confirmation`` by ``judge`` (the
    verdicts of a report, as the first judgement was made). A regression stands only when the confirmation
    regresses too (or did not finish: nothing clears the first measurement); otherwise the row takes the
    confirmation's verdict and says it was a one-off. Returns a terminal line per row measured again."""
    keys = verdict_keys(report)
    second: dict[str, dict[str, Any]] = {}
    for test, key in zip(report.get("tests") or [], keys):
        confirmation = test.get("confirmation")
        if key is not None and isinstance(confirmation, dict) and verdicts.get(key, {}).get("verdict") == REGRESSED:
            second[key] = {**test, **confirmation}
    if not second:
        return []
    again = judge({**report, "tests": list(second.values())})  # the same node ids and hardware: the same keys
    lines = []
    for key, test in second.items():
        first, repeat = verdicts[key], again.get(key, {})
        if test.get("outcome") != "passed" or repeat.get("verdict") in (None, NEW, NOT_COMPARABLE):
            first["confirmed"] = True
            # the error's first line, as the terminal's other one-line reasons (an assertion's explanation follows it)
            lines = str(test.get("error") or "").strip().splitlines()
            why = clip(lines[0] if lines else str(test.get("outcome")), _REASON_CHARS)
            first["details"] = [*first.get("details", []), f"measured again after the other tests, it did not give a "
                                f"verdict ({why}): the first measurement's regression stands"]
            lines.append(f"CONFIRMED {key}: the second measurement gave no verdict ({why}): the regression stands")
            continue
        shown = "; ".join(detail for detail in repeat.get("details", [])[1:] if detail.endswith(
            (REGRESSED_TAG, INCONCLUSIVE_TAG, OK_TAG, IMPROVED_TAG)))
        if repeat["verdict"] == REGRESSED:
            first["confirmed"] = True
            first["details"] = [*first.get("details", []), f"confirmed: measured again after the other tests: {shown}"]
            lines.append(f"CONFIRMED {key}: measured again after the other tests, it regressed again: {shown}")
            continue
        first.update(confirmed=False, first_verdict=REGRESSED, verdict=repeat["verdict"])
        first.pop("cause", None)  # the cause of the verdict the row now has (the second measurement's), if any
        if "cause" in repeat:
            first["cause"] = repeat["cause"]
        first["details"] = [f"regressed at first, not confirmed: measured again after the other tests it was "
                            f"{repeat['verdict']} (the gate fails a test only when both measurements regress)",
                            *first.get("details", []), f"the second measurement: {shown}"]
        lines.append(f"NOT CONFIRMED {key}: regressed at first, {repeat['verdict']} when measured again after the "
                     f"other tests (a one-off: the gate passes it): {shown}")
    return lines
