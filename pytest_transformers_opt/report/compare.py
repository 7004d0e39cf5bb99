"""``--opt-compare=old.json`` in the terminal: reading the earlier report and saying what the judge
(``verdict.compare``, ``verdict.judge``) decided. Nothing here decides a verdict."""

from __future__ import annotations

from typing import Any

from ..verdict.compare import INCONCLUSIVE_TAG, MEDIAN_RULE, REGRESSED_TAG, VERDICTS
from ..verdict.judge import INCONCLUSIVE, NOT_COMPARABLE, OK, REGRESSED
from .schema import load_report, read_notes

COMPARE_REMEDY = "give a JSON report written by this plugin (pytest --opt-report-json=PATH)"


def load_compare_report(path: str, source: str = "--opt-compare", remedy: str = COMPARE_REMEDY) -> dict[str, Any]:
    """The earlier report, read by ``schema.load_report``; a problem names ``source`` (the option, or the
    variable ``PYTEST_OPT_COMPARE`` when the path came from there) and ends with ``remedy``."""
    return load_report(path, source=source, remedy=remedy)


def _tests(count: int) -> str:
    return f"{count} test{'s' if count != 1 else ''}"


def cause_text(result: Any) -> str | None:
    """The census's word on a verdict (``regression.cause.text``: what changed in what runs, or that nothing
    did), for every rendering to show beside the verdict; None where the verdict has none."""
    cause = result.get("cause") if isinstance(result, dict) else None
    text = cause.get("text") if isinstance(cause, dict) else None
    return text.strip() if isinstance(text, str) and text.strip() else None


def _with_cause(line: str, result: dict[str, Any]) -> str:
    cause = cause_text(result)
    return f"{line}; cause: {cause}" if cause else line


def _tagged(details: list[str], tag: str) -> list[str]:
    """The details that end in ``tag`` (a verdict's own), without it."""
    return [d[: -len(tag)] for d in details if d.endswith(tag)]


def summarise(verdicts: dict[str, dict[str, Any]], against: str, old: dict[str, Any] | None = None,
              order: tuple[str, ...] = VERDICTS) -> list[str]:
    """Terminal lines: what the reader ignored in the ``old`` report (written by another version); each
    regressed test with what regressed; each inconclusive test with what could not be judged and the size it
    could have detected (both with the census's cause where a timed verdict has one); the tests the median rule judged, and why; the reasons tests were not compared; the
    counts, of every verdict in ``order``."""
    lines: list[str] = [f"note: {note}" for note in read_notes(old)]
    counts = {verdict: 0 for verdict in order}
    not_comparable: dict[str, int] = {}
    median_rule: dict[str, int] = {}
    for nodeid, result in verdicts.items():
        verdict = result.get("verdict", OK)
        counts[verdict] = counts.get(verdict, 0) + 1
        details = [str(d) for d in result.get("details") or []]
        if verdict == REGRESSED:
            shown = [d[: -len(REGRESSED_TAG)] if d.endswith(REGRESSED_TAG) else d
                     for d in details if REGRESSED_TAG in d] or details
            lines.append(_with_cause(f"REGRESSED {nodeid}: {'; '.join(shown)}", result))
        elif verdict == INCONCLUSIVE:
            lines.append(_with_cause(f"INCONCLUSIVE {nodeid}: {'; '.join(_tagged(details, INCONCLUSIVE_TAG) or details)}",
                                     result))
        elif verdict == NOT_COMPARABLE:
            for reason in details:
                not_comparable[reason] = not_comparable.get(reason, 0) + 1
        for record in result.get("judged") or []:
            if isinstance(record, dict) and record.get("rule") == MEDIAN_RULE:
                why = f"{record.get('metric')}: {record.get('note')}"
                median_rule[why] = median_rule.get(why, 0) + 1
    for why, count in median_rule.items():
        lines.append(f"median rule ({_tests(count)}): {why}")
    for reason, count in not_comparable.items():
        lines.append(f"not comparable ({_tests(count)}): {reason}")
    counted = ", ".join(f"{counts[v]} {v}" for v in order)
    extra = ", ".join(f"{n} {v}" for v, n in counts.items() if v not in order)
    lines.append(f"compare: {counted}{', ' + extra if extra else ''} (against {against})")
    return lines
