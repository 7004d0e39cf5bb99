"""``--opt-compare=DIR``: each test judged against a window of its recorded runs (``--opt-history=DIR``).

One earlier report is one draw of the runner's noise; a window of runs shows how much this runner's figures
move from run to run, and a test is judged against that. For each test of this run:

**The window.** Its last ``--opt-compare-window=N`` recorded runs (newest first, from the newest ``2N`` files
of the folder, read through ``history.load_history``: a file that does not load or validate is left out and
named) on the same hardware fingerprint (``compare.row_hardware``) and the same stack (``STACK_KEYS`` of the
run's environment: torch, transformers, CUDA, kernels, bitsandbytes) in which the test passed with the same
model and workload (``compare.test_differences``). Runs of another hardware or stack are never pooled. When
runs of another stack lie within the window, the details say since which run the stack changed and what
changed; when none of this stack remain, the test is ``not comparable`` with that reason. With fewer than
``MIN_WINDOW_RUNS`` runs the spread says too little, and the test is ``new``: "building the history (N of 5
runs)", recorded but not judged, said in every verbosity.

**The rule** (``verdict.window_rule``), per threshold of ``--opt-compare-fail``, on each run's figure (its median
over rounds): today's worsening against the window's median, with the window's run-to-run spread as its error,
the p-values of the run's window-judged thresholds adjusted as one family; the verdict is the one judge's
(``verdict.judge.decide``). A census threshold (``ops:0`` ...) is judged exactly against the window's newest run
(``window_rule.census_against_newest``): a census has no spread to weigh. A regressed or inconclusive timed verdict
carries the census difference between the window's newest run and this one as its ``cause``. This module
selects, orchestrates and words; it decides nothing.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..units import shown
from ..verdict.ab import differing_versions, version_text
from ..verdict.census_diff import census_cause
from ..verdict.compare import (INFORMATIONAL_METRICS, METRICS, REPORTS, BetweenRun, Sides, Threshold,
                               default_between_run, change_text, figure_value,
                               hardware_differences, judge_threshold, measurement_missing, row_environment,
                               row_hardware, test_differences, verdict_keys)
from ..verdict.judge import (IMPROVED, INCONCLUSIVE, NEW, NOT_COMPARABLE, OK, REGRESSED, is_judged, new_row,
                             not_comparable, worst)
from ..verdict.stats import MIN_WINDOW_RUNS, robust_spread
from ..verdict.window_rule import (MIN_TIMED_SPREAD, RECORDED_SIDES, WindowFigure, adjust, census_against_newest,
                                   window_figure)
from .compare import summarise
from .history import History, HistoryRun, load_history, run_names

READ_FACTOR = 2  # the window is drawn from the newest READ_FACTOR * N files: room for other hardware and stacks
BUILDING = "building the history"
WINDOW_VERDICTS: tuple[str, ...] = (REGRESSED, INCONCLUSIVE, IMPROVED, OK, NEW, NOT_COMPARABLE)
STACK_KEYS: tuple[tuple[str, str], ...] = (
    ("torch", "torch"), ("transformers", "transformers"), ("cuda", "CUDA"), ("kernels", "kernels"),
    ("bitsandbytes", "bitsandbytes"))
"""(environment key, label) of what makes a stack: runs of two stacks are never pooled."""


def stack_of(environment: Mapping[str, Any]) -> dict[str, str | None]:
    """The stack a run measured with, by ``STACK_KEYS`` label (None: not installed)."""
    return {label: None if environment.get(key) is None else str(environment.get(key)) for key, label in STACK_KEYS}


def stack_change_text(before: Mapping[str, str | None], after: Mapping[str, str | None]) -> str:
    """``transformers 5.22.0 -> 5.24.0, CUDA not installed -> 12.8``: what differs from ``before`` to ``after``."""
    return ", ".join(f"{name} {version_text(old)} -> {version_text(new)}"
                     for name, new, old in differing_versions(after, before))


def period_text(first: _dt.datetime, last: _dt.datetime) -> str:
    """``2026-11-20..2026-12-01`` (one date when both are the same day)."""
    start, end = first.strftime("%Y-%m-%d"), last.strftime("%Y-%m-%d")
    return start if start == end else f"{start}..{end}"


def _runs(count: int) -> str:
    return f"{count} run{'s' if count != 1 else ''}"


def _tests(count: int) -> str:
    return f"{count} test{'s' if count != 1 else ''}"


# ---------------------------------------------------------------------------------------------
# which runs


@dataclass(frozen=True)
class WindowRow:
    """One recorded run of a test: the run and its row."""

    run: HistoryRun
    row: dict[str, Any]

    @property
    def name(self) -> str:
        return self.run.name.name if self.run.name is not None else "this run"

    @property
    def moment(self) -> _dt.datetime:
        assert self.run.name is not None  # recorded runs always have their file's name
        return self.run.name.moment


@dataclass
class Selection:
    """One test's window, newest first, or why it has none (``verdict`` and ``reasons``)."""

    rows: list[WindowRow] = field(default_factory=list)
    verdict: str | None = None  # "new" or "not comparable" when ``rows`` is empty
    reasons: list[str] = field(default_factory=list)
    stack_note: str | None = None  # the stack changed within the window


def _rows_of(run: HistoryRun, nodeid: str) -> list[dict[str, Any]]:
    tests = run.report.get("tests")
    return [t for t in tests if isinstance(t, dict) and t.get("nodeid") == nodeid] if isinstance(tests, list) else []


def select_window(runs: Sequence[HistoryRun], test: dict[str, Any], environment: dict[str, Any], size: int
                  ) -> Selection:
    """The last ``size`` runs of ``runs`` (oldest first, as ``load_history`` gives them) in which ``test`` (a row of
    this run, measured in ``environment``) passed on the same hardware and stack with the same model and workload."""
    missing = measurement_missing(test, REPORTS.new)
    if missing is not None:
        return Selection(verdict=NOT_COMPARABLE, reasons=[missing])
    nodeid, stack = test["nodeid"], stack_of(environment)
    seen_hardware: list[str] = []
    same_hardware: list[WindowRow] = []
    found = False
    for run in reversed(runs):
        for row in _rows_of(run, nodeid):
            found = True
            env = row_environment(run.report, row)
            if hardware_differences(row, env, test, environment):
                seen_hardware.append(shown(row_hardware(row, env) or env.get("gpu_name") or env.get("device")))
                continue
            same_hardware.append(WindowRow(run, row))
            break  # a run holds a test once per hardware
    if not found:
        return Selection(verdict=NEW, reasons=["not in the recorded runs"])
    if not same_hardware:
        here = shown(row_hardware(test, environment) or environment.get("gpu_name") or environment.get("device"))
        return Selection(verdict=NOT_COMPARABLE, reasons=[
            f"measured on different hardware: no recorded run on {here} (recorded on "
            f"{', '.join(dict.fromkeys(seen_hardware))})"])
    selection = Selection()
    other_stack: WindowRow | None = None
    unusable: str | None = None
    for candidate in same_hardware:
        if len(selection.rows) >= size:
            break
        their_stack = stack_of(row_environment(candidate.run.report, candidate.row))
        if their_stack != stack:
            other_stack = other_stack or candidate
            continue
        reasons = test_differences(candidate.row, test)
        if candidate.row.get("outcome") != "passed" and not reasons:
            reasons = [f"the test {candidate.row.get('outcome')} in the recorded run"]
        if reasons:
            unusable = unusable or f"{reasons[0]} ({candidate.name})"
            continue
        selection.rows.append(candidate)
    if other_stack is not None:
        changed = stack_change_text(stack_of(row_environment(other_stack.run.report, other_stack.row)), stack)
        selection.stack_note = f"the stack changed since run {other_stack.name} ({changed})"
    if not selection.rows:
        selection.verdict = NOT_COMPARABLE
        if selection.stack_note:
            usable = "usable " if unusable else ""
            selection.reasons.append(f"{selection.stack_note}: no {usable}recorded run of this stack")
        if unusable or not selection.stack_note:
            selection.reasons.append(unusable or "no usable recorded run")
    elif selection.stack_note:
        count = _runs(len(selection.rows))
        selection.stack_note += (f": judged against the {count} of this stack" if len(selection.rows) >= MIN_WINDOW_RUNS
                                 else f": {count} of this stack recorded so far")
    return selection


def reference_record(rows: Sequence[WindowRow], kind: str, folder: str) -> dict[str, Any]:
    """The ``regression.reference`` of a verdict: a window of runs, or one recorded run (``report``)."""
    moments = [row.moment for row in rows]
    return {"kind": kind, "runs": len(rows), "first": min(moments).isoformat(), "last": max(moments).isoformat(),
            "source": folder if kind == "window" else os.path.join(folder, rows[0].name)}


def reference_text(reference: Mapping[str, Any]) -> str:
    """``window of 10 runs, 2026-11-20..2026-12-01`` or ``the recorded run 20261201T100000Z.json``."""
    if reference.get("kind") != "window":
        return f"the recorded run {os.path.basename(str(reference.get('source')))}"
    first, last = (_dt.datetime.fromisoformat(str(reference[key])) for key in ("first", "last"))
    return f"window of {_runs(int(reference.get('runs') or 0))}, {period_text(first, last)}"


# ---------------------------------------------------------------------------------------------
# a run against its history


@dataclass
class _Pending:
    """One test judged on its window, waiting for the family's adjustment."""

    key: str
    selection: Selection
    test: dict[str, Any]
    parts: list[WindowFigure | tuple[str, str, dict[str, Any] | None]]  # window figures, or judge_threshold's answer


@dataclass
class WindowComparison:
    """The verdict of every test of a run, keyed like ``compare.compare_reports``'s, and what the terminal says."""

    verdicts: dict[str, dict[str, Any]]
    lines: list[str]
    runs_read: int
    left_out: list[str]
    empty: bool  # the history is still being built (no test has MIN_WINDOW_RUNS runs): nothing judged, no failure
    said: bool  # the lines are printed in every verbosity mode: an inconclusive test (never a silent pass), a
    # changed stack, an empty history
    report_lines: list[str] = field(default_factory=list)  # under --opt-report: each ok or improved test's figures


def judged_lines(verdicts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """``ok NODEID: latency ... spread 1.5%, detectable 13.6%`` for each test the window judged ok or improved (the
    regressed and inconclusive ones have lines of their own in every verbosity mode)."""
    lines = []
    for nodeid, result in verdicts.items():
        verdict = result.get("verdict")
        if verdict not in (OK, IMPROVED) or not isinstance(result.get("reference"), dict):
            continue
        judged = [str(d).rsplit(": ", 1)[0] for d in result.get("details") or []
                  if str(d).endswith((": ok", ": improved"))]
        lines.append(f"{verdict} {nodeid}: {'; '.join(judged) or 'no threshold'} ("
                     f"{reference_text(result['reference'])})")
    return lines


def _finish(pending: _Pending, thresholds: Sequence[Threshold], folder: str) -> dict[str, Any]:
    rows, test = pending.selection.rows, pending.test
    reference = reference_record(rows, "window", folder)
    details = [f"against a {reference_text(reference)}"]
    if pending.selection.stack_note:
        details.append(pending.selection.stack_note)
    judged: list[dict[str, Any]] = []
    verdicts: list[str] = []
    for part in pending.parts:
        if isinstance(part, WindowFigure):
            verdicts.append(part.verdict)
            details.append(part.detail())
            judged.append(part.record())
        else:
            verdict, detail, record = part
            verdicts.append(verdict)
            details.append(detail)
            if record is not None:
                judged.append(record)
    gated = {threshold.metric for threshold in thresholds}
    doubted = [threshold.metric for threshold, verdict in zip(thresholds, verdicts)
               if METRICS[threshold.metric].timed and verdict in (REGRESSED, INCONCLUSIVE)]
    for metric in INFORMATIONAL_METRICS:
        values = [v for v in (figure_value(row.row, metric) for row in rows) if v is not None]
        today = figure_value(test, metric)
        if metric not in gated and values and today is not None:
            center, fmt = statistics.median(values), METRICS[metric].fmt
            details.append(f"{metric} {fmt(today)} vs the window's median {fmt(center)} "
                           f"({change_text(metric, center, today)})")
    verdict = worst(verdicts)
    result: dict[str, Any] = {"verdict": verdict, "details": details, "reference": reference}
    if judged:
        result["judged"] = judged
    if doubted:  # what the newest recorded run ran and this one did not (or "did not change")
        result["cause"] = census_cause(rows[0].row, test, old_label=f"newest {RECORDED_SIDES.old}",
                                       new_label=RECORDED_SIDES.new)
    return result


def _building(selection: Selection) -> dict[str, Any]:
    """A test whose window is still short: recorded, not judged, until ``MIN_WINDOW_RUNS`` runs give a spread."""
    result = new_row(f"{BUILDING} ({len(selection.rows)} of {MIN_WINDOW_RUNS} runs of this test on this hardware and "
                     f"stack; judged from {MIN_WINDOW_RUNS})")
    if selection.stack_note:
        result["details"].append(selection.stack_note)
    return result


def _window_parts(selection: Selection, test: dict[str, Any], thresholds: Sequence[Threshold],
                  environment: Mapping[str, Any]) -> list[WindowFigure | tuple[str, str, dict[str, Any] | None]]:
    parts: list[WindowFigure | tuple[str, str, dict[str, Any] | None]] = []
    two_jobs = Sides(between_run=default_between_run(environment))  # a figure too few runs have: as two reports
    for threshold in thresholds:  # one part per threshold, in order (_finish pairs them)
        if METRICS[threshold.metric].census:
            parts.append(census_against_newest(threshold, [(row.name, row.row) for row in selection.rows], test))
            continue
        values = [(row, v) for row in selection.rows if (v := figure_value(row.row, threshold.metric)) is not None]
        today = figure_value(test, threshold.metric)
        figure = window_figure(threshold, [v for _, v in values], today) if today is not None else None
        if figure is not None:
            parts.append(figure)
        else:  # missing today, too few runs with it, a relative limit from 0: as against the newest run with it
            newest = values[0][0] if values else selection.rows[0]
            verdict, detail, record = judge_threshold(threshold, newest.row, test, two_jobs)
            parts.append((verdict, f"against {newest.name} alone ({len(values)} of the window's runs have "
                                   f"{threshold.metric}): {detail}", record))
    return parts


def _signature(folder: str) -> tuple[tuple[str, int, int], ...]:
    """What identifies the folder's recorded runs as they are now: each name, modification time and size."""
    signature = []
    for name in run_names(folder):
        try:
            stat = os.stat(os.path.join(folder, name.name))
        except OSError:  # pruned meanwhile
            continue
        signature.append((name.name, stat.st_mtime_ns, stat.st_size))
    return tuple(signature)


@functools.lru_cache(maxsize=2)
def _read_history(folder: str, size: int, signature: tuple[tuple[str, int, int], ...]) -> History:
    return load_history(folder, READ_FACTOR * size)


def read_history(folder: str, size: int) -> History:
    """The runs a window of ``size`` is drawn from, read once while the folder's runs stay as they are (the
    session end and --opt-compare-confirm ask for the same)."""
    return _read_history(folder, size, _signature(folder))


def _too_short(selection: Selection) -> bool:
    return len(selection.rows) < MIN_WINDOW_RUNS


def compare_with_window(folder: str, report: dict[str, Any], thresholds: Sequence[Threshold], size: int,
                        confirm: bool = False) -> WindowComparison:
    """Every test of ``report`` (this run) against its window in the history ``folder``; with ``confirm``, a
    regressed row that was measured again (``confirmation``, --opt-compare-confirm) regresses only when its
    second measurement does too."""
    keys = verdict_keys(report)
    verdicts: dict[str, dict[str, Any]] = {}
    if not run_names(folder):
        for key in keys:
            if key is not None:
                verdicts[key] = new_row(f"{BUILDING}: no recorded run in {folder} yet")
        lines = [f"{BUILDING}: 0 of {MIN_WINDOW_RUNS} runs recorded in {folder}; nothing is judged until a test has "
                 f"{MIN_WINDOW_RUNS} (a run recorded there with --opt-history starts the window)",
                 *summarise(verdicts, f"the runs recorded in {folder}", None, WINDOW_VERDICTS)[-1:]]
        return WindowComparison(verdicts, lines, 0, [], True, True)
    history = read_history(folder, size)
    pending: list[_Pending] = []
    building: list[int] = []
    stack_notes: dict[str, int] = {}
    stack_changed = False
    for test, key in zip(report.get("tests") or [], keys):
        if key is None:
            continue
        environment = row_environment(report, test)
        selection = select_window(history.runs, test, environment, size)
        stack_changed = stack_changed or selection.stack_note is not None
        if selection.stack_note and selection.rows:
            stack_notes[selection.stack_note] = stack_notes.get(selection.stack_note, 0) + 1
        if not selection.rows:
            verdicts[key] = (new_row(selection.reasons[0]) if selection.verdict == NEW
                             else not_comparable(selection.reasons))
        elif _too_short(selection):
            verdicts[key] = _building(selection)
            building.append(len(selection.rows))
        else:
            pending.append(_Pending(key, selection, test, _window_parts(selection, test, thresholds, environment)))
    adjust([part for p in pending for part in p.parts if isinstance(part, WindowFigure)])
    for item in pending:
        verdicts[item.key] = _finish(item, thresholds, folder)
    confirmation_lines: list[str] = []
    if confirm:
        from .confirm import confirm_verdicts

        confirmation_lines = confirm_verdicts(
            report, verdicts, lambda again: compare_with_window(folder, again, thresholds, size).verdicts)
    moments = [run.name.moment for run in history.runs if run.name is not None]
    lines = [f"reference: each test's last {_runs(size)} recorded in {folder} on its hardware and stack ("
             f"{_runs(len(history.runs))} read" + (f", {period_text(min(moments), max(moments))}" if moments else "")
             + ")"]
    if history.left_out:
        lines.append(f"note: {len(history.left_out)} file{'s' if len(history.left_out) != 1 else ''} left out of "
                     f"the window: {'; '.join(history.left_out[:3])}"
                     + (f"; and {len(history.left_out) - 3} more" if len(history.left_out) > 3 else ""))
    lines += [f"stack changed ({_tests(count)}): {note}" for note, count in stack_notes.items()]
    if building:
        have = f"{min(building)}" if min(building) == max(building) else f"{min(building)}-{max(building)}"
        lines.append(f"{BUILDING} ({_tests(len(building))}): {have} of {MIN_WINDOW_RUNS} runs on this hardware and "
                     f"stack; recorded, not judged, until {MIN_WINDOW_RUNS}")
    lines += confirmation_lines
    lines += summarise(verdicts, f"the window of up to {_runs(size)} in {folder}", None, WINDOW_VERDICTS)
    said = stack_changed or bool(confirmation_lines) or bool(building) \
        or any(result.get("verdict") == INCONCLUSIVE for result in verdicts.values())
    still_building = bool(building) and not any(is_judged(v.get("verdict")) for v in verdicts.values())
    return WindowComparison(verdicts, lines, len(history.runs), list(history.left_out), still_building, said,
                            judged_lines(verdicts))


def regressed_entries(settings: Any, environment: Mapping[str, Any] | None, entries: Sequence[dict[str, Any]]
                      ) -> list[dict[str, Any]]:
    """The entries (report rows of one test, measured in ``environment``) that regress past the run's
    ``--opt-compare-fail`` against their window in the ``--opt-compare`` folder, each judged as a family of one:
    the suspects --opt-compare-confirm measures again. The run's verdicts, adjusted over every test, can only be
    fewer (an adjusted p-value is never below the raw one). [] without a history folder or a gate."""
    folder = getattr(settings, "compare_history", None)
    thresholds = list(getattr(settings, "compare_thresholds", None) or [])
    if folder is None or not thresholds or not run_names(folder):
        return []
    size = int(settings.compare_window)
    history = read_history(folder, size)
    suspects = []
    for entry in entries:
        selection = select_window(history.runs, entry, dict(environment or {}), size)
        if not selection.rows or _too_short(selection):
            continue  # nothing judged yet: nothing to confirm
        parts = _window_parts(selection, entry, thresholds, dict(environment or {}))
        for part in parts:
            if isinstance(part, WindowFigure):
                adjust([part])  # a family of one
        # a census is exact: measuring it again would count the same, so only a timed or measured figure is a suspect
        measured = [part for threshold, part in zip(thresholds, parts) if not METRICS[threshold.metric].census]
        if worst(part.verdict if isinstance(part, WindowFigure) else part[0] for part in measured) == REGRESSED:
            suspects.append(entry)
    return suspects


def between_run_spread(folder: str, report: dict[str, Any], size: int) -> BetweenRun | None:
    """This runner's between-run term from the runs recorded in ``folder``: for latency and for speedup, the
    median, over the tests of ``report`` whose window holds ``MIN_WINDOW_RUNS`` runs or more, of their window's
    robust spread in percent of its center (it holds the rounds' own noise too: a little conservative). None where
    no test has such a window; a metric no window gives keeps the device's stated default."""
    if not run_names(folder):
        return None
    history = read_history(folder, size)
    spreads: dict[str, list[float]] = {"latency": [], "speedup": []}
    default: BetweenRun | None = None
    for test in report.get("tests") or []:
        if not isinstance(test, dict) or not isinstance(test.get("nodeid"), str):
            continue
        environment = row_environment(report, test)
        default = default or default_between_run(environment)
        selection = select_window(history.runs, test, environment, size)
        for metric, found in spreads.items():
            values = [v for row in selection.rows if (v := figure_value(row.row, metric)) is not None]
            center, spread = robust_spread(values) if len(values) >= MIN_WINDOW_RUNS else (0.0, 0.0)
            if center > 0:  # floored as the window rule floors a timed spread: a runner's noise is never 0
                found.append(max(100.0 * spread / center, 100.0 * MIN_TIMED_SPREAD))
    if default is None or not spreads["latency"]:
        return None
    figure = statistics.median(spreads["latency"])
    ratio = statistics.median(spreads["speedup"]) if spreads["speedup"] else default.ratio_pct
    tests = len(spreads["latency"])
    return BetweenRun(figure, ratio, f"this runner's spread between runs ({figure:.1f}% a figure, {ratio:.1f}% a "
                                     f"speedup: {_tests(tests)}' windows in {folder})")
