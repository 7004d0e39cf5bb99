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
``MIN_WINDOW_RUNS`` runs the spread says too little (see below), and the test is judged against the newest of
them as against one report (``compare.compare_test``, on its per-round samples), said so.

**The rule**, per threshold of ``--opt-compare-fail``, on each run's figure (its median over rounds):
the window's center is the median of its runs, its spread ``verdict.stats.robust_spread`` (1.4826 x MAD),
floored for timed figures at ``MIN_TIMED_SPREAD`` of the center (identical medians are a coarse timer or
too few runs, not a noiseless runner; a zero spread would make any change past the limit significant).
Today's worsening ``w`` (percent of the center for a relative limit) is tested one-sided against "worse by
the limit ``L``": ``t = (w - L) / se`` with ``se`` the spread of one new run against a median of ``n`` runs
(``stats.new_run_scale``) and Student's t of ``stats.new_run_degrees_of_freedom(n)`` (a MAD carries fewer
degrees of freedom than a standard deviation). The p-values of every window-judged threshold of the run form
one family, adjusted by Benjamini-Hochberg (``stats.benjamini_hochberg``): when nothing changed (what a CI
gate must not fail on) that keeps the chance of any false regression in the run at ``SIGNIFICANCE``, as Holm
would, and when a change moves many tests together (a slower torch) it flags more of them than Holm.
Improvements are a family of their own, tested the same way the other way round.

**The verdicts.** ``regressed``: past the limit and significant after adjustment; ``improved`` likewise the
other way; otherwise ``inconclusive`` where the window could not have flagged a change of
``DETECTABLE_FACTOR`` times the limit (its *detectable size*, ``L + t_crit * se`` at the family's first
Benjamini-Hochberg bar ``SIGNIFICANCE / m``, is larger), since then a real regression would pass unseen; else
``ok``. ``inconclusive`` never fails the run but is listed with its detectable size.
"""

from __future__ import annotations

import datetime as _dt
import functools
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..units import shown
from ..verdict.ab import differing_versions, version_text
from ..verdict.stats import (MIN_WINDOW_RUNS, SIGNIFICANCE, benjamini_hochberg, new_run_degrees_of_freedom,
                             new_run_scale, robust_spread, student_t_isf, student_t_sf)
from .compare import (INCONCLUSIVE, INCONCLUSIVE_TAG, INFORMATIONAL_METRICS, METRICS, NOT_SIGNIFICANT,
                      REGRESSED_TAG, Threshold, beyond_limit, change_text, compare_test, figure_value,
                      hardware_differences, judge_threshold, limit_text, measurement_missing, row_environment,
                      row_hardware, signed_text, size_text, summarise, test_differences, verdict_keys, worsening)
from .history import History, HistoryRun, load_history, run_names

READ_FACTOR = 2  # the window is drawn from the newest READ_FACTOR * N files: room for other hardware and stacks
MIN_TIMED_SPREAD = 0.005
"""Floor of a timed figure's spread, relative to its center: a timer's and a scheduler's noise is never 0."""
DETECTABLE_FACTOR = 2.0
"""A window that could not flag a worsening of twice the limit cannot vouch for the test: ``inconclusive``."""
WINDOW_RULE = "window"
WINDOW_VERDICTS: tuple[str, ...] = ("regressed", INCONCLUSIVE, "improved", "ok", "new", "not comparable")
_SEVERITY = ("regressed", INCONCLUSIVE, "improved", "ok")  # a test's verdict is its worst threshold's
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
    missing = measurement_missing(test, "new")
    if missing is not None:
        return Selection(verdict="not comparable", reasons=[missing])
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
        return Selection(verdict="new", reasons=["not in the recorded runs"])
    if not same_hardware:
        here = shown(row_hardware(test, environment) or environment.get("gpu_name") or environment.get("device"))
        return Selection(verdict="not comparable", reasons=[
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
        selection.verdict = "not comparable"
        if selection.stack_note:
            usable = "usable " if unusable else ""
            selection.reasons.append(f"{selection.stack_note}: no {usable}recorded run of this stack")
        if unusable or not selection.stack_note:
            selection.reasons.append(unusable or "no usable recorded run")
    elif selection.stack_note:
        count = _runs(len(selection.rows))
        selection.stack_note += (f": judged against the {count} of this stack" if len(selection.rows) >= MIN_WINDOW_RUNS
                                 else f": judged against the newest of the {count} of this stack")
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
# the rule


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
    verdict: str = "ok"

    @property
    def spread_pct(self) -> float | None:
        return 100.0 * self.spread / abs(self.center) if self.center else None

    def finish(self, family_size: int) -> None:
        """The verdict, once the family's adjusted p-values are set."""
        limit = self.threshold.limit
        if self.scale > 0:
            critical = student_t_isf(SIGNIFICANCE / max(family_size, 1), self.df)
            self.detectable = limit + critical * self.scale
        else:  # every run gave the same figure (memory, similarity): any change past the limit is real
            self.detectable = limit
        if beyond_limit(self.amount, limit) and self.p_worse_adjusted < SIGNIFICANCE:
            self.verdict = "regressed"
        elif beyond_limit(-self.amount, limit) and self.p_better_adjusted < SIGNIFICANCE:
            self.verdict = "improved"
        elif beyond_limit(self.amount, limit) or beyond_limit(self.detectable, DETECTABLE_FACTOR * limit):
            # worse past the limit but within the window's noise, or a window too noisy to see twice the limit:
            # not a pass the window vouches for (never a silent ok), not a failure either
            self.verdict = INCONCLUSIVE
        else:
            self.verdict = "ok"

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
        if self.verdict == "regressed":
            return text + REGRESSED_TAG
        if self.verdict == INCONCLUSIVE:
            return text + INCONCLUSIVE_TAG
        if self.verdict == "improved":
            return text + ": improved"
        return text + ": ok"

    def record(self) -> dict[str, Any]:
        """The ``regression.judged`` entry."""
        worse = self.amount >= 0
        note = None
        if self.floored:
            note = f"spread floored at {100 * MIN_TIMED_SPREAD:g}% of the median"
        elif self.verdict == "ok" and beyond_limit(abs(self.amount), self.threshold.limit):
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
    empty: bool  # the folder holds no recorded run yet: this run starts the history
    said: bool  # the lines are printed in every verbosity mode: an inconclusive test (never a silent pass), a
    # changed stack, an empty history
    report_lines: list[str] = field(default_factory=list)  # under --opt-report: each ok or improved test's figures


def judged_lines(verdicts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """``ok NODEID: latency ... spread 1.5%, detectable 13.6%`` for each test the window judged ok or improved (the
    regressed and inconclusive ones have lines of their own in every verbosity mode)."""
    lines = []
    for nodeid, result in verdicts.items():
        verdict = result.get("verdict")
        if verdict not in ("ok", "improved") or not isinstance(result.get("reference"), dict):
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
    for metric in INFORMATIONAL_METRICS:
        values = [v for v in (figure_value(row.row, metric) for row in rows) if v is not None]
        today = figure_value(test, metric)
        if metric not in gated and values and today is not None:
            center, fmt = statistics.median(values), METRICS[metric].fmt
            details.append(f"{metric} {fmt(today)} vs the window's median {fmt(center)} "
                           f"({change_text(metric, center, today)})")
    verdict = next((v for v in _SEVERITY if v in verdicts), "ok")
    result: dict[str, Any] = {"verdict": verdict, "details": details, "reference": reference}
    if judged:
        result["judged"] = judged
    return result


def _against_newest(selection: Selection, test: dict[str, Any], thresholds: Sequence[Threshold], folder: str
                    ) -> dict[str, Any]:
    """A test whose window is too short: judged against its newest recorded run as against one report."""
    newest = selection.rows[0]
    result = compare_test(newest.row, test, list(thresholds))
    result["details"] = [f"against {newest.name} alone: the window has {_runs(len(selection.rows))} of this test "
                         f"(at least {MIN_WINDOW_RUNS} needed for a run-to-run spread)",
                         *([selection.stack_note] if selection.stack_note else []), *result["details"]]
    result["reference"] = reference_record([newest], "report", folder)
    return result


def _window_parts(selection: Selection, test: dict[str, Any], thresholds: Sequence[Threshold]
                  ) -> list[WindowFigure | tuple[str, str, dict[str, Any] | None]]:
    parts: list[WindowFigure | tuple[str, str, dict[str, Any] | None]] = []
    for threshold in thresholds:
        values = [(row, v) for row in selection.rows if (v := figure_value(row.row, threshold.metric)) is not None]
        today = figure_value(test, threshold.metric)
        figure = window_figure(threshold, [v for _, v in values], today) if today is not None else None
        if figure is not None:
            parts.append(figure)
        else:  # missing today, too few runs with it, a relative limit from 0: as against the newest run with it
            newest = values[0][0] if values else selection.rows[0]
            verdict, detail, record = judge_threshold(threshold, newest.row, test)
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


def _newest_run_only(selection: Selection) -> bool:
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
                verdicts[key] = {"verdict": "new", "details": [f"no recorded run in {folder} yet"]}
        lines = [f"note: no recorded run in {folder} yet: nothing to compare (a run recorded there with "
                 f"--opt-history starts the window)",
                 *summarise(verdicts, f"the runs recorded in {folder}", None, WINDOW_VERDICTS)[-1:]]
        return WindowComparison(verdicts, lines, 0, [], True, True)
    history = read_history(folder, size)
    pending: list[_Pending] = []
    newest_only = 0
    stack_notes: dict[str, int] = {}
    stack_changed = False
    for test, key in zip(report.get("tests") or [], keys):
        if key is None:
            continue
        selection = select_window(history.runs, test, row_environment(report, test), size)
        stack_changed = stack_changed or selection.stack_note is not None
        if selection.stack_note and selection.rows:
            stack_notes[selection.stack_note] = stack_notes.get(selection.stack_note, 0) + 1
        if not selection.rows:
            verdicts[key] = {"verdict": selection.verdict or "not comparable", "details": selection.reasons}
        elif _newest_run_only(selection):
            verdicts[key] = _against_newest(selection, test, thresholds, folder)
            newest_only += 1
        else:
            pending.append(_Pending(key, selection, test, _window_parts(selection, test, thresholds)))
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
    if newest_only:
        lines.append(f"against the newest run only ({_tests(newest_only)}): the window has fewer than "
                     f"{MIN_WINDOW_RUNS} runs of the test on this hardware and stack")
    lines += confirmation_lines
    lines += summarise(verdicts, f"the window of up to {_runs(size)} in {folder}", None, WINDOW_VERDICTS)
    said = stack_changed or bool(confirmation_lines) \
        or any(result.get("verdict") == INCONCLUSIVE for result in verdicts.values())
    return WindowComparison(verdicts, lines, len(history.runs), list(history.left_out), False, said,
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
        if not selection.rows:
            continue
        if _newest_run_only(selection):
            regressed = compare_test(selection.rows[0].row, entry, thresholds)["verdict"] == "regressed"
        else:
            parts = _window_parts(selection, entry, thresholds)
            for part in parts:
                if isinstance(part, WindowFigure):
                    adjust([part])  # a family of one
            regressed = any((part.verdict if isinstance(part, WindowFigure) else part[0]) == "regressed"
                            for part in parts)
        if regressed:
            suspects.append(entry)
    return suspects
