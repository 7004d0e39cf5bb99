"""``--opt-ab`` in the report: each test's A/B record completed, the report's top-level ``ab``, the gate of
``--opt-ab-fail`` and the merge of shards' records.

A row's ``ab`` record arrives with what the reference environment measured (``mode``, ``reference``: its
interpreter and package versions, ``optimized``: its side's figures, ``similarity``: the candidate's
distributions against the reference's, ``census``: the reference's execution census). ``complete_ab`` adds each
figure's change (``verdict.ab``), the note ``identical stacks`` where the two environments report the same versions,
``census_changes`` (what the candidate runs differently, whatever the timing says) and, with thresholds, the verdict
(a timed one regressed or inconclusive with the census's ``cause``).

The verdict is ``--opt-compare-fail``'s, by the same code: the reference plays the earlier run, the candidate
this one, and a reference is, to itself, perfectly similar. So a timed threshold regresses only when the
medians moved past the limit **and** a one-sided test on both sides' rounds is significant: on the pairs
(Wilcoxon signed-rank) where the rounds were taken in turns, so that the machine's noise both sides of a
round share cancels; unpaired (Mann-Whitney) in ``blocks`` mode, whose rounds are not taken in turns.
"""

from __future__ import annotations

import platform
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..compat import package_version
from ..verdict.ab import IDENTICAL_STACKS, ab_figures, stack_note, stack_versions, what_differs
from ..verdict.ab import ab_census_changes, judge_ab
from ..verdict.census_diff import shortened
from ..verdict.compare import (INCONCLUSIVE_TAG, METRICS, REGRESSED_TAG, SAMPLE_RULES, Threshold, limit_text,
                               sample_rule_text)
from .compare import cause_text
from ..verdict.judge import IMPROVED, INCONCLUSIVE, NOT_COMPARABLE, NOT_JUDGED, OK, REGRESSED, not_comparable

AB_VERDICTS: tuple[str, ...] = (REGRESSED, INCONCLUSIVE, IMPROVED, OK, NOT_COMPARABLE, NOT_JUDGED)
JUDGED = (REGRESSED, INCONCLUSIVE, IMPROVED, OK)


def ab_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The test rows that carry an A/B record."""
    return [test for test in report.get("tests") or [] if isinstance(test, dict) and isinstance(test.get("ab"), dict)]


def candidate_stack(packages: Iterable[str]) -> dict[str, Any]:
    """This process's stack as a reference's is recorded: its interpreter, its Python version and the installed
    version (None: not installed) of each of ``packages``."""
    return {"python": sys.executable, "python_version": platform.python_version(),
            "versions": {name: package_version(name) for name in packages if name != "python"}}


def describe_thresholds(thresholds: Sequence[Threshold]) -> str | None:
    return ",".join(threshold.describe() for threshold in thresholds) or None


def complete_ab(report: dict[str, Any], thresholds: Sequence[Threshold] = (),
                candidate: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Complete every row's ``ab`` record in place (figures, note, and with ``thresholds`` the verdict) and set
    the report's top-level ``ab``; returns it, or None (and leaves the report alone) when no row has one.

    ``candidate``: this environment's stack (``{"python", "versions", "python_version"?}``); by default this
    process's versions of the packages the reference reports."""
    rows = ab_rows(report)
    if not rows:
        return None
    reference = rows[0]["ab"].get("reference")
    if candidate is None:
        candidate = candidate_stack(stack_versions(reference))
    candidate_versions = stack_versions(candidate)
    for row in rows:
        ab = row["ab"]
        ab["figures"] = ab_figures(row, ab)
        ab["note"] = stack_note(candidate_versions, stack_versions(ab.get("reference")))
        if "census" in ab:  # an earlier report's record has none: left as it was
            ab["census_changes"] = ab_census_changes(row, ab)[0]
        for key in ("verdict", "details", "judged", "cause"):
            ab.pop(key, None)
        if ab.get("not_comparable"):  # the reference could not run it, or stopped answering: with or without a gate
            ab.update(not_comparable([str(ab["not_comparable"])]))
        elif thresholds:
            ab.update(judge_ab(row, ab, thresholds))
    reference_versions = stack_versions(reference)
    top = {"candidate": dict(candidate), "reference": reference,
           "differs": what_differs(candidate_versions, reference_versions),
           "note": stack_note(candidate_versions, reference_versions),
           "thresholds": describe_thresholds(thresholds), "summary": ab_summary(report)}
    report["ab"] = top
    return top


def ab_summary(report: Mapping[str, Any]) -> dict[str, int]:
    """Rows with an A/B record per verdict (``not comparable``: the reference could not run the test's
    configuration or stopped answering; ``not judged``: without thresholds, or without a measurement)."""
    counts = {verdict: 0 for verdict in AB_VERDICTS}
    for row in ab_rows(report):
        verdict = row["ab"].get("verdict")
        counts[verdict if verdict in counts else NOT_JUDGED] += 1
    return counts


def inconclusive_texts(ab: Mapping[str, Any]) -> list[str]:
    """What the gate could not judge, one detail per threshold (its change, limit, rule and detectable size)."""
    return [str(d)[: -len(INCONCLUSIVE_TAG)] for d in ab.get("details") or [] if str(d).endswith(INCONCLUSIVE_TAG)]


def inconclusive_metrics(ab: Mapping[str, Any]) -> list[str]:
    """The metrics of ``inconclusive_texts``."""
    return [text.split(" ", 1)[0] for text in inconclusive_texts(ab)]


def census_text(row: Mapping[str, Any]) -> str | None:
    """What the census says under a row's A/B line: the cause of its timed verdict where it has one (``cause: the
    census changed: ...``, or that it did not), else ``census: aten::mm +2 per step (48 -> 50); ...`` (the candidate
    against the reference), ``census: unchanged``, or why the two were not compared; None for a record from before
    the census."""
    ab = row.get("ab")
    if not isinstance(ab, Mapping) or "census" not in ab:
        return None
    cause = cause_text(ab)
    if cause:
        return f"cause: {cause}"
    changes = ab.get("census_changes")
    if isinstance(changes, list):
        return f"census: {shortened([str(line) for line in changes])}" if changes else "census: unchanged"
    return f"census: not compared ({ab_census_changes(row, ab)[1]})"


# --------------------------------------------------------------------------- the gate (session end)


def _percent(value: float) -> str:
    return f"{value:+.1f}%"


def interval_text(value: Any) -> str:
    """``[+8.0%, +16.0%]`` from a figure's ``interval_pct``; "" when it has none."""
    if not isinstance(value, list) or len(value) != 2:
        return ""
    return f"[{_percent(value[0])}, {_percent(value[1])}]"


def _regressed_texts(ab: Mapping[str, Any], thresholds: Sequence[Threshold]) -> list[str]:
    """What regressed, one text per threshold: a timed figure's change with its interval, the two medians, the
    limit and the rule that judged it; any other, as the comparison's detail says it."""
    pending = [r for r in ab.get("judged") or [] if isinstance(r, dict) and r.get("verdict") == REGRESSED]
    by_text = {threshold.describe(): threshold for threshold in thresholds}
    found = ab.get("figures")
    figures: dict[str, Any] = found if isinstance(found, dict) else {}
    texts = []
    for detail in [str(d) for d in ab.get("details") or [] if str(d).endswith(REGRESSED_TAG)]:
        metric = detail.split(" ", 1)[0]
        record = next((r for r in pending if r.get("metric") == metric), None)
        figure = figures.get(metric)
        threshold = by_text.get(str(record.get("threshold"))) if record is not None else None
        if record is None or threshold is None or not isinstance(figure, dict) or figure.get("change_pct") is None:
            texts.append(detail[: -len(REGRESSED_TAG)])
            continue
        pending.remove(record)
        fmt = METRICS[metric].fmt
        if record.get("rule") in SAMPLE_RULES:
            rule = sample_rule_text(record["rule"], record["p_value"], record.get("rounds"))
        else:
            rule = f"median rule: {record.get('note')}"
        interval = interval_text(figure.get("interval_pct"))
        texts.append(f"{metric} {_percent(figure['change_pct'])}{' ' + interval if interval else ''} (reference "
                     f"{fmt(figure['reference'])}, candidate {fmt(figure['candidate'])}; limit "
                     f"{limit_text(threshold)}, {rule})")
    return texts


def _tests(count: int) -> str:
    return f"{count} test{'s' if count != 1 else ''}"


def _why_nothing(report: Mapping[str, Any]) -> str:
    """Why no row of the report has an A/B record."""
    tests = [t for t in report.get("tests") or [] if isinstance(t, dict)]
    if not tests:
        return "no test used opt_bench"
    measured = sum(isinstance(t.get("optimized"), dict) for t in tests)
    if not measured:  # a test may have measured and then failed or been skipped: its row keeps no figures
        outcomes = ", ".join(f"{count} {outcome}" for outcome, count in
                             Counter(str(t.get("outcome")) for t in tests).items())
        return f"{_tests(len(tests))} ran, and none kept figures in the report ({outcomes})"
    return f"{_tests(measured)} measured, none in the reference environment"


def gate_lines(report: Mapping[str, Any], thresholds: Sequence[Threshold], label: str
               ) -> tuple[list[str], str | None]:
    """The session end's lines for ``--opt-ab-fail`` (``label``: the option as set, ``--opt-ab-fail=latency:5%``):
    one ``AB REGRESSED`` line per regressed test, one ``AB INCONCLUSIVE`` line per test the rounds could not
    judge (with the size they could have detected), each with the census's cause of a timed verdict, one ``AB not
    comparable`` line per test the reference could not run or stopped answering in, one ``AB census changed`` line
    per other test whose census differs from the reference's (whatever its timing says), the count line; and why
    the run fails (None: it passes). Without ``thresholds`` (``--opt-ab`` alone), only the ``AB not comparable`` and
    ``AB census changed`` lines, and nothing fails."""
    rows = ab_rows(report)
    lines: list[str] = []
    for row in rows:
        ab = row["ab"]
        cause = cause_text(ab)
        because = f"; cause: {cause}" if cause else ""
        if ab.get("verdict") == REGRESSED:
            lines.append(f"AB REGRESSED {row.get('nodeid')}: {'; '.join(_regressed_texts(ab, thresholds))}{because}")
        elif ab.get("verdict") == INCONCLUSIVE:
            lines.append(f"AB INCONCLUSIVE {row.get('nodeid')}: {'; '.join(inconclusive_texts(ab))}{because}")
        elif ab.get("verdict") == NOT_COMPARABLE:
            lines.append(f"AB not comparable {row.get('nodeid')}: "
                         f"{'; '.join(str(d) for d in ab.get('details') or []) or 'no reason given'}")
        changes = ab.get("census_changes")
        if isinstance(changes, list) and changes and not cause:  # a cause names the changes already
            lines.append(f"AB census changed {row.get('nodeid')}: {shortened([str(line) for line in changes])}")
    if not thresholds:
        return lines, None
    counts = ab_summary(report)
    top = report.get("ab")
    reference = top.get("reference") if isinstance(top, dict) else None
    python = reference.get("python") if isinstance(reference, dict) else None
    against = f" against the reference {python}" if python else ""
    identical = f", {IDENTICAL_STACKS}" if isinstance(top, dict) and top.get("note") == IDENTICAL_STACKS else ""
    lines.append(f"A/B: {', '.join(f'{counts[v]} {v}' for v in AB_VERDICTS)} ({label}{against}{identical})")
    if not rows:
        return lines, f"{label}: no test has an A/B record ({_why_nothing(report)}): the run fails"
    regressed = counts[REGRESSED]
    if regressed:
        return lines, f"{_tests(regressed)} regressed past {label}{against}: the run fails"
    if not any(counts[v] for v in JUDGED):  # a gate that judged nothing does not pass
        reasons = list(dict.fromkeys(str(d) for row in rows for d in (row["ab"].get("details") or [])[:1]))
        return lines, f"{label}: no test could be judged ({'; '.join(reasons[:3]) or 'no reason given'}): the run fails"
    return lines, None


# --------------------------------------------------------------------------- merge


def _stack_key(stack: Any) -> str:
    return repr(sorted(stack_versions(stack).items())) + repr(stack.get("python") if isinstance(stack, dict) else None)


def _stacks_note(role: str, stacks: list[tuple[str, Any]]) -> str | None:
    """Where the shards' ``role`` stacks (candidate or reference) differ: each one's interpreter and the versions
    that are not the same in all, with the shards that used it; None when they are the same."""
    distinct: dict[str, tuple[Any, list[str]]] = {}
    for source, stack in stacks:
        distinct.setdefault(_stack_key(stack), (stack, []))[1].append(source)
    if len(distinct) < 2:
        return None
    versions = [stack_versions(stack) for stack, _ in distinct.values()]
    names = dict.fromkeys(name for found in versions for name in found)
    varying = [name for name in names if len({found.get(name) for found in versions}) > 1]
    parts = []
    for (stack, sources), found in zip(distinct.values(), versions):
        python = stack.get("python") if isinstance(stack, dict) else None
        packages = ", ".join(f"{name} {found.get(name) or 'not installed'}" for name in varying)
        parts.append(f"{python}{f' ({packages})' if packages else ''} in {', '.join(sources)}")
    return f"the shards' {role}s differ: {'; '.join(parts)}"


def merge_ab(shards: Sequence[tuple[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The merged report's top-level ``ab`` from each shard's (``(source, ab or None)``): the first's stacks and
    thresholds, the summary recounted from the merged ``rows``, and ``merge_note`` where the shards ran against
    different references, from different candidates, or with different thresholds. None when no shard has one."""
    records = [(source, ab) for source, ab in shards if isinstance(ab, dict)]
    if not records:
        return None
    first = records[0][1]
    notes = [note for note in (_stacks_note("reference", [(s, ab.get("reference")) for s, ab in records]),
                               _stacks_note("candidate", [(s, ab.get("candidate")) for s, ab in records]))
             if note]
    stacks_differ = bool(notes)
    thresholds = list(dict.fromkeys(str(ab.get("thresholds") or "none") for _, ab in records))
    if len(thresholds) > 1:
        notes.append(f"the shards' --opt-ab-fail thresholds differ: {' / '.join(thresholds)}")
    merged = {key: first.get(key) for key in ("candidate", "reference", "differs", "note", "thresholds")}
    if stacks_differ:  # no one pair of stacks: each row's line names its own
        merged["note"] = None
    merged["summary"] = ab_summary({"tests": rows})
    merged["merge_note"] = "; ".join(notes) or None
    return merged
