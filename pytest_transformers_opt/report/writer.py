"""The report: one record per test that used the plugin, as a terminal table and a JSON file.

``build_report`` makes the versioned JSON document; every other format (terminal, Markdown, HTML)
renders that document, so they cannot disagree.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import math
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest

from ..files import JSON_INT_LIMIT, MAX_JSON_DEPTH, write_atomic  # the reader's bounds, so what is written reads back
from ..verdict.results import CALL_SUFFIX, call_nodeid, report_model_identity
from ..units import failure_reason, format_duration
from .schema import REPORT_SCHEMA, REPORT_SCHEMA_VERSION, report_text, validate_report
from .view import (AB_NO_ROWS, AB_TITLE, ab_header_lines, ab_lines, compile_cache_text, format_memory, format_percent,
                   format_rate, has_ab, terminal_table)
from .view import speculative_rows

if TYPE_CHECKING:
    from ..session import OptSession, TestRecord
    from .history import History

AdviceSource = Callable[[dict[str, Any]], list[str]]
"""What the face hands the writer: the built report -> the advisor's summary lines (the advisor comes
after the report stage, so the report never imports it)."""


_LEFT_OUT = object()  # a value _clean leaves out of its container


def _json_safe(value: Any, where: str, dropped: list[str] | None, depth: int) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if -JSON_INT_LIMIT <= value < JSON_INT_LIMIT:
            return value
        if dropped is not None:
            dropped.append(f"{where}: an integer beyond 64 bits, written as null")
        return None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, os.PathLike):
        text = os.fspath(value)
        if isinstance(text, str):
            return text
    container = isinstance(value, (dict, list, tuple, set, frozenset))
    if container and depth > MAX_JSON_DEPTH:  # what files.read_json (--opt-compare) reads back
        if dropped is not None:
            dropped.append(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels, left out")
        return _LEFT_OUT
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                if dropped is not None:
                    dropped.append(f"{where}[{key!r}]: a {type(key).__name__} key (JSON keys are strings), left out")
                continue
            item = _json_safe(item, f"{where}.{key}", dropped, depth + 1)
            if item is not _LEFT_OUT:
                out[key] = item
        return out
    if container:
        items = [_json_safe(item, f"{where}[{n}]", dropped, depth + 1) for n, item in enumerate(value)]
        items = [item for item in items if item is not _LEFT_OUT]
        if isinstance(value, (set, frozenset)):  # no order of its own: one that does not change between runs
            items.sort(key=lambda item: json.dumps(item, sort_keys=True))
        return items
    if dropped is not None:
        dropped.append(f"{where}: {type(value).__name__} is not a JSON value, left out")
    return _LEFT_OUT


def _clean(value: Any, where: str = "report", dropped: list[str] | None = None) -> Any:
    """JSON-safe, by one rule for every value, so that what is written reads back through ``--opt-compare``.

    NaN, infinity and integers beyond 64 bits become null (the schema's 'not a number' marker); a path
    becomes its text, a tuple a list, a set a list sorted by its items' JSON text. What JSON cannot hold
    (another object, a non-string key, nesting deeper than ``files.MAX_JSON_DEPTH``) is left out, and
    named as ``where: why`` in ``dropped`` when given.
    """
    cleaned = _json_safe(value, where, dropped, 1)
    return None if cleaned is _LEFT_OUT else cleaned


def record_entries(session: "OptSession") -> list[dict[str, Any]]:
    """The JSON-safe report entries of every test this process ran (see ``entries_of``)."""
    return [entry for record in session.records.values() for entry in entries_of(record)]


def entries_of(record: "TestRecord") -> list[dict[str, Any]]:
    """One JSON-safe report entry per ``opt_bench`` call of a test (one when it made none).

    A test that called ``opt_bench`` more than once gets a row per call: the first under the test's
    id, the later ones under ``call_nodeid`` ids, each with its ``call`` number, so no call's figures
    or failed budgets are lost and ``--opt-compare`` matches each call with the same call earlier.
    """
    base: dict[str, Any] = {
        "nodeid": record.nodeid, "outcome": record.outcome, "skip_reason": record.skip_reason,
        "error": record.error, "model": None, "techniques": [], "baseline_techniques": [], "workload": None,
        "baseline": None, "optimized": None, "speedup": None, "memory_ratio": None,
        "speedup_interval": None, "speedup_verdict": None, "speedup_interval_note": None,
        "memory_ratio_interval": None, "memory_ratio_verdict": None, "memory_ratio_interval_note": None,
        "similarity": None, "budgets": [], "failed_budgets": [], "estimates": {}, "regression": None,
        "rounds_decision": None,
        "hardware": record.hardware,
    }
    if record.plan is not None:
        plan = record.plan
        base["model"] = report_model_identity(plan.marked.model, plan.probe_context.dtype)
        base["techniques"] = list(plan.declared)
        base["baseline_techniques"] = plan.baseline.labels
    if record.attempts > 1:  # pytest-rerunfailures: the row is the last attempt's
        base["attempts"] = record.attempts
    rows = [{**base, **(_result_dict(record, record.results[0]) if record.results else {})}] \
        if len(record.results) <= 1 else \
        [{**base, **_result_dict(record, result), "nodeid": call_nodeid(record.nodeid, call), "call": call}
         for call, result in enumerate(record.results, start=1)]
    if record.confirmation is not None:  # --opt-compare-confirm measured the test again: each call's second row
        from .confirm import confirmation_of

        again = entries_of(record.confirmation)
        for call, row in enumerate(rows):
            row["confirmation"] = confirmation_of(again[call] if call < len(again) else again[-1])
    return [_clean(row) for row in rows]


def _result_dict(record: "TestRecord", result: Any) -> dict[str, Any]:
    """One opt_bench call's figures, with the test's compile cache state beside a compile time it measured."""
    data: dict[str, Any] = result.to_dict()
    optimized = data.get("optimized")
    if isinstance(optimized, dict):
        optimized["compile_cache"] = record.compile_cache if optimized.get("compile_time_s") is not None else None
    if result.trace_file:  # --opt-trace: the session's file, until the controller places it (report.traces)
        data["trace"] = result.trace_file
    return data


def _entry_order(entry: dict[str, Any]) -> tuple[str, int]:
    return entry["nodeid"].split(CALL_SUFFIX)[0], entry.get("call", 1)


def all_entries(session: "OptSession") -> list[dict[str, Any]]:
    """This process's entries and those the xdist workers sent, by test id (a test's calls in order)."""
    return sorted(record_entries(session) + list(session.worker_entries.values()), key=_entry_order)


def count_outcomes(tests: list[dict[str, Any]]) -> dict[str, int]:
    """The report's ``summary``: tests per outcome (passed, failed, skipped and error always present), and
    ``rerun``, as pytest counts them, when pytest-rerunfailures ran any test again (a test's rows after its
    first opt_bench call repeat its attempts)."""
    summary = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    reruns = 0
    for entry in tests:
        summary[entry["outcome"]] = summary.get(entry["outcome"], 0) + 1
        if entry.get("call", 1) == 1:
            reruns += entry.get("attempts", 1) - 1
    if reruns:
        summary["rerun"] = reruns
    return summary


def build_report(session: "OptSession") -> dict[str, Any]:
    tests = all_entries(session)
    summary = count_outcomes(tests)
    hardware = session.hardware
    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA, "schema_version": REPORT_SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": _clean(hardware.as_environment()),
        "settings": {"budgets_mode": session.settings.budgets, "rounds": session.settings.rounds.minimum,
                     "max_rounds": session.settings.rounds.maximum,
                     "warmup": session.settings.warmup, "device": hardware.device,
                     "default_model": session.settings.model},
        "tests": tests, "summary": summary, "advice": None,
    }
    return report


def render_table(rows: list[list[str]], separator: str = "  ", rule_separator: str = "  ") -> list[str]:
    """Left-aligned columns with a rule under the header row (scripts/device_check.py uses " | ")."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append(separator.join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if n == 0:
            lines.append(rule_separator.join("-" * w for w in widths))
    return lines


def _cache_words(state: Any) -> str:
    text = compile_cache_text(state)
    return f" (compile cache {text})" if text else ""


def terminal_lines(report: dict[str, Any]) -> list[str]:
    """The ``--opt-report`` text: the table, skip reasons, compile times, decode efficiency, errors."""
    if not report["tests"]:
        return ["no test used opt_bench, opt_model or opt_baseline_model"]
    lines = render_table(terminal_table(report))
    skipped = [t for t in report["tests"] if t["outcome"] == "skipped"]
    if skipped:
        lines += ["", "skipped:"]
        lines += [f"  {t['nodeid'].split('::')[-1]}: {t['skip_reason']}" for t in skipped]
    expected = [t for t in report["tests"] if t["outcome"] in ("xfailed", "xpassed")]
    if expected:
        lines += ["", "xfail:"]
        lines += [f"  {t['nodeid'].split('::')[-1]}: {t['outcome']} ({t['skip_reason'] or 'no reason given'})"
                  for t in expected]
    compiled = [t for t in report["tests"] if (t.get("optimized") or {}).get("compile_time_s") is not None]
    if compiled:
        lines += ["", "compile time (warm-up, not in the figures above):"]
        lines += [f"  {t['nodeid'].split('::')[-1]}: {format_duration(t['optimized']['compile_time_s'])}"
                  f"{_cache_words(t['optimized'].get('compile_cache'))}, "
                  f"recompiles during measured rounds: {t['optimized'].get('recompiles')}" for t in compiled]
    drafted = speculative_rows(report)
    if drafted:
        lines += ["", "speculative decoding (draft tokens accepted / proposed in the verified run):"]
        lines += [f"  {r['test'].split('::')[-1]}: acceptance rate {r['acceptance_rate']} ({r['accepted']} of "
                  f"{r['proposed']}), {r['accepted_per_step']} accepted per step over {r['steps']} steps" for r in drafted]
    errors = [t for t in report["tests"] if t["outcome"] in ("failed", "error") and not t["failed_budgets"] and t["error"]]
    if errors:
        lines += ["", "failed or errored (not on budgets):"]
        lines += [f"  {t['nodeid'].split('::')[-1]}: {failure_reason(t['error'])}" for t in errors]
    decoding = [t for t in report["tests"] if "decode_bandwidth_fraction_of_peak" in (t.get("estimates") or {})]
    if decoding:  # needs the device's peak bandwidth: CUDA with NVML
        peak = format_rate(report["environment"].get("gpu_memory_bandwidth_bytes_s"))
        lines += ["", f"decode efficiency (estimate: weights + KV cache read per step / TPOT, against {peak} peak):"]
        lines += [f"  {t['nodeid'].split('::')[-1]}: {format_memory(t['estimates']['decode_bytes_per_step'])} per "
                  f"step, {format_rate(t['estimates']['decode_bandwidth_bytes_s'])} = "
                  f"{format_percent(t['estimates']['decode_bandwidth_fraction_of_peak'])} of peak" for t in decoding]
    noted = [t for t in report["tests"] if t.get("notes")]
    if noted:
        lines += ["", "notes:"]
        lines += [f"  {t['nodeid'].split('::')[-1]}: {note}" for t in noted for note in t["notes"]]
    if has_ab(report):
        compared = ab_lines(report)
        lines += ["", f"{AB_TITLE}:"] + [f"  {line}" for line in ab_header_lines(report)]
        lines += [f"  {t['nodeid'].split('::')[-1]}: {line}" for t, line in compared] or [f"  {AB_NO_ROWS}"]
    if report.get("advice"):
        lines += ["", "next change to try (advisor):"] + [f"  {line}" for line in report["advice"]["summary"]]
    env = report["environment"]
    ab_gate = bool((report.get("ab") or {}).get("thresholds"))
    lines += ["", f"measured on {env.get('device')} ({env.get('gpu_name') or env.get('platform')}), torch "
                  f"{env.get('torch')}, transformers {env.get('transformers')}; all figures measured, medians of "
                  f"{_rounds_text(report['settings'], ab_gate)} interleaved rounds unless a note says otherwise; peak memory is a "
                  f"delta over what was resident before load; speedup [95% interval] and verdict (n.s.: no "
                  f"significant difference)"]
    return lines


def _rounds_text(settings: dict[str, Any], ab_gate: bool = False) -> str:
    if settings.get("max_rounds"):
        further = "; a test's note says where an --opt-ab-fail verdict took it further" if ab_gate else ""
        return f"{settings['rounds']} to {settings['max_rounds']} (sequential: until the speed budgets are settled{further})"
    return str(settings["rounds"])


PREFIX = "transformers-opt: "
REPORT_NOT_WRITTEN_STATUS = pytest.ExitCode.TESTS_FAILED
"""Exit status of a run whose tests passed but a requested report could not be written (README, Options)."""
_SHOWN_DROPPED = 5


@dataclass
class SessionEnd:
    """What the session end found, kept for the terminal summary (``pytest_sessionfinish`` runs before it)."""

    report: dict[str, Any] | None = None
    built: bool = False
    nothing_ran: bool = False  # no test using the plugin's fixtures ran: no file was touched
    problems: list[str] = field(default_factory=list)  # one line each: a writer, the hook, the comparison
    fails_run: list[str] = field(default_factory=list)  # the subset that changes the exit status
    compare_lines: list[str] = field(default_factory=list)
    compare_said: bool = False  # print compare_lines in every verbosity mode (inconclusive tests, a first run)
    compare_report_lines: int = 0  # the first of compare_lines (after the blank one) printed under --opt-report only
    regression_line: str | None = None
    ab_lines: list[str] = field(default_factory=list)  # --opt-ab-fail: each regressed test, the counts
    ab_line: str | None = None  # why --opt-ab-fail fails the run
    history_line: str | None = None  # where --opt-history recorded the run
    trace_line: str | None = None  # --opt-trace: where the traces went, or why none could be kept


_END_KEY = pytest.StashKey[SessionEnd]()


def session_end(config: pytest.Config) -> SessionEnd:
    """This session's end state (created on first use: pytest-benchmark's export may report first)."""
    return config.stash.setdefault(_END_KEY, SessionEnd())


def describe_error(exc: BaseException) -> str:
    """``[Errno 28] No space left on device`` for an OSError, ``TypeError: ...`` otherwise."""
    if isinstance(exc, OSError) and exc.errno and exc.strerror:
        return f"[Errno {exc.errno}] {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


def note_problem(config: pytest.Config, line: str, fails_run: bool) -> None:
    """One line for the terminal summary; ``fails_run``: a requested output is missing (the exit status says so)."""
    end = session_end(config)
    end.problems.append(PREFIX + line)
    if fails_run:
        end.fails_run.append(line)


def _hook_location(config: pytest.Config, exc: BaseException) -> str:
    """`` in conftest.py:12``: the line of the hook implementation the exception came through."""
    codes = {getattr(impl.function, "__code__", None) for impl in config.hook.pytest_opt_report_extra.get_hookimpls()}
    where = ""
    for frame, line in traceback.walk_tb(exc.__traceback__):
        if frame.f_code in codes:
            path = Path(frame.f_code.co_filename)
            try:
                path = path.relative_to(config.rootpath)
            except ValueError:
                pass
            where = f" in {path}:{line}"
    return where


class ReportWriter:
    """Builds the run's report once, at session end, and hands that one document to every output.

    Every stage (building, advice, comparison, the extra-fields hook) and every writer is isolated: a
    failure is one line in the terminal summary, the other writers still write, and pytest's own
    summary still prints. Only a requested output that is missing changes the exit status.
    """

    def __init__(self, session: "OptSession", advice: AdviceSource | None = None) -> None:
        self.session = session
        self.advice = advice
        self.settings = session.settings
        self.config = session.config
        self.end = session_end(session.config)

    def _problem(self, line: str, fails_run: bool = False) -> None:
        note_problem(self.config, line, fails_run)

    def _requested(self) -> list[tuple[str, str]]:
        """(``--opt-report-md=PATH`` as the user set it, key) of every requested report file."""
        return [(f"{self.settings.sources.get(key, key)}={getattr(self.settings, key)}", key)
                for key in ("report_json", "report_md", "report_html") if getattr(self.settings, key)]

    def ran_any(self) -> bool:
        """The rule for writing at all: a test that uses opt_bench, opt_model or opt_baseline_model ran here
        or on an xdist worker (so ``--collect-only`` or a run that deselected them keeps the last report)."""
        return bool(self.session.records or self.session.worker_entries)

    def _report(self) -> dict[str, Any] | None:
        if not self.end.built:
            self.end.built = True
            self.end.report = self._build()
        return self.end.report

    def _build(self) -> dict[str, Any] | None:
        try:
            report = build_report(self.session)
        except Exception as exc:
            self._problem(f"could not build the report: {describe_error(exc)}; no report file was written",
                          fails_run=bool(self._requested()))
            return None
        report["advice"] = self._advice(report)
        self._compare(report)
        self._ab(report)
        self._traces(report)
        return self._extra(report)

    def _advice(self, report: dict[str, Any]) -> dict[str, Any] | None:
        """The advisor's next single change for the run just measured (None when nothing was measured)."""
        if self.advice is None or not any(t.get("optimized") for t in report["tests"]):
            return None
        try:
            return {"summary": self.advice(report)}
        except Exception as exc:  # advice is a bonus: never lose the report over it
            return {"summary": [f"no advice: {type(exc).__name__}: {exc}"]}

    def _compare(self, report: dict[str, Any]) -> None:
        """--opt-compare: a regression verdict per test, kept on the report and summarised for the terminal; against
        one earlier report, or against each test's window of runs recorded in a history folder."""
        settings = self.settings
        if settings.compare is None or (settings.compare_report is None and settings.compare_history is None):
            return
        from ..verdict.compare import attach_verdicts, compare_reports, nothing_judged
        from ..verdict.judge import INCONCLUSIVE, REGRESSED
        from .compare import summarise

        against = f"{settings.sources.get('compare', '--opt-compare')}={settings.compare}"
        first_run = said = False
        report_lines: list[str] = []
        try:
            if settings.compare_history is not None:
                from .window import compare_with_window

                window = compare_with_window(settings.compare_history, report, settings.compare_thresholds,
                                             settings.compare_window, confirm=bool(settings.compare_thresholds))
                verdicts, lines, first_run, said = window.verdicts, window.lines, window.empty, window.said
                report_lines = window.report_lines
            else:
                assert settings.compare_report is not None
                verdicts = compare_reports(settings.compare_report, report, settings.compare_thresholds,
                                           _two_jobs(settings, report))
                lines = summarise(verdicts, settings.compare, settings.compare_report)
                said = any(v.get("verdict") == INCONCLUSIVE for v in verdicts.values())  # never a silent pass
        except Exception as exc:  # a gate that cannot judge must not pass silently
            self._problem(f"{against}: could not compare the reports: {describe_error(exc)}",
                          fails_run=bool(settings.compare_thresholds))
            return
        attach_verdicts(report, verdicts)
        report["compare"] = _compare_record(against, settings, verdicts)
        self.end.compare_lines = ["", *report_lines, *lines]
        self.end.compare_report_lines = len(report_lines)
        regressed = sum(v.get("verdict") == REGRESSED for v in verdicts.values())
        gate = f"{settings.sources.get('compare_fail', '--opt-compare-fail')}={settings.compare_fail}"
        # the first run of a history has nothing to be judged against: said, and not a failure
        unjudged = nothing_judged(verdicts) if settings.compare_thresholds and not first_run else None
        if regressed and settings.compare_thresholds:
            self.end.regression_line = (f"{PREFIX}{regressed} test{'s' if regressed != 1 else ''} regressed past "
                                        f"{gate} against {against}: the run fails")
        elif unjudged is not None:  # a gate that judged nothing does not pass
            self.end.regression_line = f"{PREFIX}{gate} against {against}: {unjudged}: the run fails"
        self.end.compare_said = said

    def _ab(self, report: dict[str, Any]) -> None:
        """--opt-ab: each row's A/B record completed and the report's top-level ``ab``; with --opt-ab-fail, the
        verdicts, the lines the session end prints and, on a regression or nothing judged, why the run fails."""
        thresholds = _ab_thresholds(self.settings)
        if not thresholds and not any(isinstance(t.get("ab"), dict) for t in report["tests"]):
            return
        from .ab import complete_ab, describe_thresholds, gate_lines

        source = getattr(self.settings, "ab_fail_source", None) or self.settings.sources.get("ab_fail", "--opt-ab-fail")
        text = getattr(self.settings, "ab_fail", None)
        gate = f"{source}={text if isinstance(text, str) and text else describe_thresholds(thresholds)}"
        try:
            complete_ab(report, thresholds, getattr(self.session, "ab_candidate", None))
            lines, failure = gate_lines(report, thresholds, gate)  # without thresholds: what could not be compared
        except Exception as exc:  # a gate that cannot judge must not pass silently
            self._problem(f"{gate if thresholds else '--opt-ab'}: could not judge the A/B records: "
                          f"{describe_error(exc)}", fails_run=bool(thresholds))
            return
        self.end.ab_lines = ["", *lines] if lines else []
        self.end.ab_line = PREFIX + failure if failure else None

    def _traces(self, report: dict[str, Any]) -> None:
        """--opt-trace: the traces of the tests asked for moved next to the JSON report (rows' ``trace``), the
        others deleted, once every verdict of the gate is known; the line that says where they went."""
        mode = self.settings.trace
        if mode == "off":
            return
        from .traces import place_traces, traces_folder

        try:
            placed = place_traces(report["tests"], mode, self.settings.report_json,
                                  getattr(self.session, "trace_folder", None))
        except Exception as exc:
            self._problem(f"--opt-trace={mode}: could not keep the traces: {describe_error(exc)}")
            return
        if not self.settings.report_json:
            return  # said by finish, whether or not a test ran
        if not self.settings.census:
            self.end.trace_line = (f"{PREFIX}--opt-trace={mode} needs the census (--opt-census=off): the trace is "
                                   "the census call's; none written")
        elif placed.folder is not None:
            self.end.trace_line = (f"{PREFIX}--opt-trace={mode}: {placed.kept} Chrome trace"
                                   f"{'s' if placed.kept != 1 else ''} of the census call written to {placed.folder}")
        else:
            which = "no test the gate flagged had" if mode != "all" and placed.traced else "no test had"
            self.end.trace_line = (f"{PREFIX}--opt-trace={mode}: {which} a trace; none written to "
                                   f"{traces_folder(self.settings.report_json)}")

    def _extra(self, report: dict[str, Any]) -> dict[str, Any]:
        """The ``pytest_opt_report_extra`` hook, then one JSON-safe document (see ``_clean``).

        A hook that raises, or leaves the report invalid, costs only its own fields."""
        hook = self.config.hook.pytest_opt_report_extra
        dropped: list[str] = []
        if not hook.get_hookimpls():
            return _clean(report, "report", dropped)  # type: ignore[no-any-return]  # _clean keeps a dict a dict
        before = copy.deepcopy(report)
        try:
            hook(config=self.config, report=report)
        except Exception as exc:
            self._problem(f"the pytest_opt_report_extra hook{_hook_location(self.config, exc)} raised "
                          f"{describe_error(exc)}; the report is written without its fields")
            return _clean(before)  # type: ignore[no-any-return]  # _clean keeps a dict a dict
        cleaned = _clean(report, "report", dropped)
        invalid = _schema_problem(cleaned)
        if invalid is not None and _schema_problem(_clean(before)) is None:
            self._problem(f"the pytest_opt_report_extra hook left the report invalid ({invalid}); it is written "
                          "without the hook's fields: put them under report[\"extra\"] or a test's [\"extra\"]")
            return _clean(before)  # type: ignore[no-any-return]  # _clean keeps a dict a dict
        for line in dropped[:_SHOWN_DROPPED]:
            self._problem(f"report field {line} (pytest_opt_report_extra)")
        if len(dropped) > _SHOWN_DROPPED:
            self._problem(f"... and {len(dropped) - _SHOWN_DROPPED} more report fields left out")
        return cleaned  # type: ignore[no-any-return]  # _clean keeps a dict a dict

    def finish(self, exit_status: int) -> int:
        """At session end: write every report file; a regression past --opt-compare-fail or --opt-ab-fail, or a
        requested report that could not be written, fails a run whose tests passed. Never raises."""
        if self.session.is_xdist_worker:  # the controller writes the merged report (and places the traces)
            return exit_status
        if self.settings.trace != "off" and not self.settings.report_json:
            self.end.trace_line = (f"{PREFIX}--opt-trace={self.settings.trace} needs --opt-report-json: the traces "
                                   "go next to the JSON report; none was written")
        try:
            if not self.ran_any():
                self.end.nothing_ran = True
                return exit_status
            report = self._report()
            if report is not None:
                self._write_files(report)
        except Exception as exc:  # a last guard: the stages above catch their own
            self._problem(f"could not finish the report: {describe_error(exc)}", fails_run=bool(self._requested()))
        finally:
            from .traces import remove_own_folder

            remove_own_folder(self.session)
        failed = bool(self.end.fails_run or self.end.regression_line or self.end.ab_line)
        if failed and exit_status == pytest.ExitCode.OK:
            return REPORT_NOT_WRITTEN_STATUS
        return exit_status

    def terminal(self, reporter: Any) -> None:
        """The report under --opt-report; then, in every verbosity mode, each cause of a changed exit status
        and each output that could not be written."""
        if self.session.is_xdist_worker:
            return
        end = self.end
        try:
            if self.settings.report:
                reporter.write_sep("=", "transformers optimization report")
                report = None if end.nothing_ran else self._report()
                if report is None:
                    lines = ["no test used opt_bench, opt_model or opt_baseline_model" if end.nothing_ran
                             else "no report: it could not be built (below)"]
                else:
                    lines = terminal_lines(report) + end.compare_lines + end.ab_lines
                for line in lines:
                    reporter.write_line(line)
            else:
                if end.regression_line or end.compare_said:  # the details the exit status rests on
                    for line in end.compare_lines[1 + end.compare_report_lines:]:
                        reporter.write_line(line)
                for line in end.ab_lines[1:]:  # --opt-ab-fail's verdicts: said in every verbosity mode
                    reporter.write_line(line)
        except Exception as exc:
            self._problem(f"could not print the report: {describe_error(exc)}")
        for line in end.problems + [line for line in (end.regression_line, end.ab_line) if line]:
            reporter.write_line(line, red=True)
        for said in (end.history_line, end.trace_line):
            if said and reporter.verbosity >= -1:  # said under -q too; -qq hides it
                reporter.write_line(said)
        if end.nothing_ran and self._requested() and reporter.verbosity >= 0:
            files = ", ".join(label for label, _ in self._requested())
            reporter.write_line(f"{PREFIX}no test that uses opt_bench, opt_model or opt_baseline_model ran: "
                                f"{files} left as they were")

    def _write(self, label: str, write: Any, requested: bool = True) -> None:
        """Run one writer; a failure is one line naming the file and why (the other writers still run)."""
        try:
            write()
        except Exception as exc:
            self._problem(f"could not write {label}: {describe_error(exc)}", fails_run=requested)

    def _write_files(self, report: dict[str, Any]) -> None:
        """JSON, Markdown (also appended to $GITHUB_STEP_SUMMARY) and HTML, each written atomically, each alone."""
        labels = dict((key, label) for label, key in self._requested())
        paths = {key: Path(getattr(self.settings, key)) for key in labels}
        summary_path = os.environ.get("GITHUB_STEP_SUMMARY")
        recorded = self._record_history(report)
        if "report_json" in labels:
            self._write(labels["report_json"], lambda: write_atomic(paths["report_json"], report_text(report)))
        if "report_md" in labels or summary_path:
            rendered: list[str] = []

            def markdown() -> str:
                if not rendered:
                    from .markdown import render_markdown

                    rendered.append(render_markdown(report))
                return rendered[0]

            if "report_md" in labels:
                self._write(labels["report_md"], lambda: write_atomic(paths["report_md"], markdown()))
            if summary_path:  # set by the CI runner, not asked for: a failure is said, the exit status stays
                self._write(f"$GITHUB_STEP_SUMMARY={summary_path}", lambda: _append(summary_path, markdown() + "\n"),
                            requested=False)
        if "report_html" in labels:
            def html() -> None:
                from .html import render_html

                shown = _traces_from(report, paths.get("report_json"), paths["report_html"])
                write_atomic(paths["report_html"], render_html(shown, history=self._trend_history(report, recorded)))

            self._write(labels["report_html"], html)

    def _history_label(self) -> str:
        return f"{self.settings.sources.get('history', '--opt-history')}={self.settings.history}"

    def _record_history(self, report: dict[str, Any]) -> Path | None:
        """--opt-history: this run's report appended to the folder; one that cannot be written is one line
        and, like a report file that cannot be written, fails a run whose tests passed (a history that
        silently stops recording would leave the trend charts stale with nobody told)."""
        if not self.settings.history:
            return None
        from .history import record_run

        try:
            recorded = record_run(self.settings.history, report, self.settings.history_keep, self.config.rootpath)
        except Exception as exc:
            self._problem(f"could not record the run in {self._history_label()}: {describe_error(exc)}",
                          fails_run=True)
            return None
        pruned = f", {recorded.pruned} older pruned" if recorded.pruned else ""
        self.end.history_line = (f"{PREFIX}run recorded in {recorded.path}; the history holds {recorded.held} "
                                 f"run{'s' if recorded.held != 1 else ''} (keeps the last "
                                 f"{self.settings.history_keep}{pruned}){recorded.note}")
        return recorded.path

    def _trend_history(self, report: dict[str, Any], recorded: Path | None) -> History | None:
        """The recorded runs the HTML report draws trends from (None without --opt-history, or unreadable)."""
        if not self.settings.history:
            return None
        from .history import trend_history

        label = self._history_label()
        try:
            history = trend_history(self.settings.history, report, recorded)
        except Exception as exc:
            self._problem(f"could not read the history {label}: {describe_error(exc)}; the HTML report has no trends")
            return None
        if history.left_out:
            self._problem(f"{len(history.left_out)} file{'s' if len(history.left_out) != 1 else ''} in {label} left "
                          f"out of the trends: {'; '.join(history.left_out[:3])}"
                          + (f"; and {len(history.left_out) - 3} more" if len(history.left_out) > 3 else ""))
        return history


def _compare_record(against: str, settings: Any, verdicts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report's top-level ``compare``: what this run was compared with, and how many tests got each verdict."""
    from .window import WINDOW_VERDICTS

    counts = {verdict: 0 for verdict in WINDOW_VERDICTS}
    for result in verdicts.values():
        verdict = str(result.get("verdict"))
        counts[verdict] = counts.get(verdict, 0) + 1
    window = settings.compare_history is not None
    return {"against": against, "reference": "window" if window else "report",
            "window": settings.compare_window if window else None,
            "gate": settings.compare_fail if settings.compare_thresholds else None, "counts": counts}


def _ab_thresholds(settings: Any) -> list[Any]:
    """--opt-ab-fail, parsed: the settings' ``ab_thresholds`` (``ab_fail`` where that holds the parsed list)."""
    thresholds = getattr(settings, "ab_thresholds", None)
    if thresholds is None:
        thresholds = getattr(settings, "ab_fail", None)
    return list(thresholds) if isinstance(thresholds, list) else []


def _traces_from(report: dict[str, Any], report_json: Path | None, page: Path) -> dict[str, Any]:
    """``report`` with each row's ``trace`` relative to ``page``'s folder (the HTML report's links), not the JSON
    report's; the same report where the two share a folder or no row has a trace."""
    if report_json is None or report_json.parent == page.parent or not any(t.get("trace") for t in report["tests"]):
        return report
    def relative(trace: str) -> str:
        return Path(os.path.relpath(report_json.parent / trace, page.parent)).as_posix()

    tests = [{**t, "trace": relative(t["trace"])} if t.get("trace") else t for t in report["tests"]]
    return {**report, "tests": tests}


def _append(path: str, text: str) -> None:
    """Append ``text`` to the file (the step summary is one file that every step appends to)."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


def _schema_problem(report: dict[str, Any]) -> str | None:
    """The first schema violation of ``report``, or None when it is valid."""
    try:
        validate_report(report)
    except ValueError as exc:
        lines = str(exc).splitlines()
        return lines[1].strip(" -") if len(lines) > 1 else lines[0]
    return None


def _two_jobs(settings: Any, report: dict[str, Any]) -> Any:
    """The sides of a one-report compare: with this runner's between-run spread where ``--opt-history`` holds a
    window of runs for some of this run's tests, else None (each row's device's stated default)."""
    folder = getattr(settings, "history", None)
    if not folder:
        return None
    from ..verdict.compare import Sides
    from .window import between_run_spread

    try:
        found = between_run_spread(str(folder), report, int(getattr(settings, "compare_window", 10) or 10))
    except Exception:  # a history that cannot be read leaves the stated default: never a lost gate
        return None
    return Sides(between_run=found) if found is not None else None
