"""The report: one record per test that used the plugin, as a terminal table and a JSON file.

``build_report`` makes the versioned JSON document; every other format (terminal, Markdown, HTML)
renders that document, so they cannot disagree.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .units import format_bytes, format_duration

if TYPE_CHECKING:
    from .options import Settings
    from .session import OptSession

SCHEMA = "pytest-transformers-opt/report"
SCHEMA_VERSION = 1


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become null (the schema's 'not a number' marker)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def record_entries(session: "OptSession") -> list[dict[str, Any]]:
    """One JSON-safe report entry per test this process ran (xdist workers ship these to the controller)."""
    entries = []
    for record in session.records.values():
        entry: dict[str, Any] = {
            "nodeid": record.nodeid, "outcome": record.outcome, "skip_reason": record.skip_reason,
            "error": record.error, "model": None, "techniques": [], "baseline_techniques": [], "workload": None,
            "baseline": None, "optimized": None, "speedup": None, "memory_ratio": None, "similarity": None,
            "budgets": [], "failed_budgets": [], "estimates": {}, "regression": None,
        }
        if record.plan is not None:
            plan = record.plan
            entry["model"] = {"name_or_path": plan.marked.model.name_or_path, "revision": plan.marked.model.revision,
                              "dtype": plan.probe_context.dtype}
            entry["techniques"] = list(plan.declared)
            entry["baseline_techniques"] = plan.baseline.labels
        if record.result is not None:
            entry.update(record.result.to_dict())
        entries.append(_clean(entry))
    return entries


def all_entries(session: "OptSession") -> list[dict[str, Any]]:
    """This process's entries and those the xdist workers sent, by test id."""
    return sorted(record_entries(session) + list(session.worker_entries), key=lambda t: t["nodeid"])


def build_report(session: "OptSession") -> dict[str, Any]:
    tests = all_entries(session)
    summary = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for entry in tests:
        summary[entry["outcome"]] = summary.get(entry["outcome"], 0) + 1
    hardware = session.hardware
    report: dict[str, Any] = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": _clean(hardware.as_environment()),
        "settings": {"budgets_mode": session.settings.budgets, "rounds": session.settings.rounds,
                     "warmup": session.settings.warmup, "device": hardware.device,
                     "default_model": session.settings.model},
        "tests": tests, "summary": summary, "advice": None,
    }
    return report


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder and rename, so no reader sees half a file."""
    path = path.expanduser()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent.resolve()))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _pair(opt: Any, base: Any, fmt: Any) -> str:
    return f"{fmt(opt)} / {fmt(base)}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _num(value: float | None, pattern: str = "{:.3g}") -> str:
    return "-" if value is None else pattern.format(value)


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    header = ["test", "techniques", "outcome", "TTFT ms opt/base", "TPOT ms opt/base", "tok/s opt/base", "speedup",
              "peak mem opt/base", "mem ratio", "token match", "KL mean", "top-1", "failed budgets"]
    rows = [header]
    ordered = sorted(report["tests"], key=lambda t: (not t["failed_budgets"], t["outcome"] != "failed"))
    for test in ordered:
        base, opt = test.get("baseline") or {}, test.get("optimized") or {}
        sim = test.get("similarity") or {}
        outcome = test["outcome"]
        rows.append([
            test["nodeid"].split("::")[-1], ", ".join(test["techniques"]) or "-", outcome,
            _pair(opt.get("ttft_s"), base.get("ttft_s"), _ms), _pair(opt.get("tpot_s"), base.get("tpot_s"), _ms),
            _pair(opt.get("throughput_tok_s"), base.get("throughput_tok_s"), lambda v: _num(v, "{:.0f}")),
            _num(test.get("speedup"), "{:.2f}x"),
            _pair(opt.get("peak_memory_bytes"), base.get("peak_memory_bytes"), format_bytes),
            _num(test.get("memory_ratio"), "{:.2f}x"), _num(sim.get("token_match"), "{:.2f}"),
            _num(sim.get("kl_mean"), "{:.2e}"), _num(sim.get("top1"), "{:.2f}"),
            ", ".join(test["failed_budgets"]) or "-",
        ])
    return rows


def render_table(rows: list[list[str]], separator: str = "  ", rule_separator: str = "  ") -> list[str]:
    """Left-aligned columns with a rule under the header row."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append(separator.join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if n == 0:
            lines.append(rule_separator.join("-" * w for w in widths))
    return lines


def terminal_lines(report: dict[str, Any]) -> list[str]:
    """The ``--opt-report`` text: the table, skip reasons, compile times, decode efficiency, errors."""
    if not report["tests"]:
        return ["no test used opt_bench, opt_model or opt_baseline_model"]
    lines = render_table(table_rows(report))
    skipped = [t for t in report["tests"] if t["outcome"] == "skipped"]
    if skipped:
        lines += ["", "skipped:"]
        lines += [f"  {t['nodeid'].split('::')[-1]}: {t['skip_reason']}" for t in skipped]
    compiled = [t for t in report["tests"] if (t.get("optimized") or {}).get("compile_time_s") is not None]
    if compiled:
        lines += ["", "compile time (warm-up, not in the figures above):"]
        lines += [f"  {t['nodeid'].split('::')[-1]}: {format_duration(t['optimized']['compile_time_s'])}, "
                  f"recompiles during measured rounds: {t['optimized'].get('recompiles')}" for t in compiled]
    errors = [t for t in report["tests"] if t["outcome"] in ("failed", "error") and not t["failed_budgets"] and t["error"]]
    if errors:
        lines += ["", "failed or errored (not on budgets):"]
        lines += [f"  {t['nodeid'].split('::')[-1]}: {t['error'].splitlines()[-1][:200]}" for t in errors]
    decoding = [t for t in report["tests"] if "decode_bandwidth_fraction_of_peak" in (t.get("estimates") or {})]
    if decoding:  # needs the device's peak bandwidth: CUDA with NVML
        from .render_markdown import format_memory, format_percent, format_rate

        peak = format_rate(report["environment"].get("gpu_memory_bandwidth_bytes_s"))
        lines += ["", f"decode efficiency (estimate: weights + KV cache read per step / TPOT, against {peak} peak):"]
        lines += [f"  {t['nodeid'].split('::')[-1]}: {format_memory(t['estimates']['decode_bytes_per_step'])} per "
                  f"step, {format_rate(t['estimates']['decode_bandwidth_bytes_s'])} = "
                  f"{format_percent(t['estimates']['decode_bandwidth_fraction_of_peak'])} of peak" for t in decoding]
    noted = [t for t in report["tests"] if t.get("notes")]
    if noted:
        lines += ["", "notes:"]
        lines += [f"  {t['nodeid'].split('::')[-1]}: {note}" for t in noted for note in t["notes"]]
    if report.get("advice"):
        lines += ["", "next change to try (advisor):"] + [f"  {line}" for line in report["advice"]["summary"]]
    env = report["environment"]
    lines += ["", f"measured on {env.get('device')} ({env.get('gpu_name') or env.get('platform')}), torch "
                  f"{env.get('torch')}, transformers {env.get('transformers')}; all figures measured, medians of "
                  f"{report['settings']['rounds']} interleaved rounds unless a note says otherwise; peak memory is a "
                  f"delta over what was resident before load"]
    return lines


def _advice(report: dict[str, Any]) -> dict[str, Any] | None:
    """The advisor's next single change for the run just measured (None when nothing was measured)."""
    if not any(t.get("optimized") for t in report["tests"]):
        return None
    from .advisor import advise_from_report

    try:
        return {"summary": advise_from_report(report).summary_lines()}
    except Exception as exc:  # advice is a bonus: never lose the report over it
        return {"summary": [f"no advice: {type(exc).__name__}: {exc}"]}


class ReportWriter:
    """Builds the run's report once, at session end, and hands that one document to every output."""

    def __init__(self, session: "OptSession") -> None:
        self.session = session
        self.settings = session.settings

    def _report(self) -> dict[str, Any]:
        if self.session.final_report is None:
            report = build_report(self.session)
            report["advice"] = _advice(report)
            self._compare(report)
            self.session.config.hook.pytest_opt_report_extra(config=self.session.config, report=report)
            self.session.final_report = report
        return self.session.final_report

    def _compare(self, report: dict[str, Any]) -> None:
        """--opt-compare: a regression verdict per test, kept on the report and summarised for the terminal."""
        if self.settings.compare_report is None:
            return
        from .compare import compare_reports, summarise

        verdicts = compare_reports(self.settings.compare_report, report, self.settings.compare_thresholds)
        for entry in report["tests"]:
            entry["regression"] = verdicts.get(entry["nodeid"])
        self.session.compare_lines = ["", *summarise(verdicts, self.settings.compare)]

    def finish(self, exit_status: int) -> int:
        """At session end: write every report file; a regression past --opt-compare-fail fails the run."""
        if self.session.is_xdist_worker:  # the controller writes the merged report
            return exit_status
        report = self._report()
        self._write_files(report)
        regressed = any((t.get("regression") or {}).get("verdict") == "regressed" for t in report["tests"])
        if regressed and self.settings.compare_thresholds and exit_status == pytest.ExitCode.OK:
            return pytest.ExitCode.TESTS_FAILED
        return exit_status

    def terminal(self, reporter: Any) -> None:
        if not self.settings.report or self.session.is_xdist_worker:
            return
        reporter.write_sep("=", "transformers optimization report")
        for line in terminal_lines(self._report()) + self.session.compare_lines:
            reporter.write_line(line)

    def _write_files(self, report: dict[str, Any]) -> None:
        """JSON, Markdown (also appended to $GITHUB_STEP_SUMMARY) and HTML, each written atomically."""
        wants_summary = bool(os.environ.get("GITHUB_STEP_SUMMARY")) and bool(report["tests"])
        if self.settings.report_json:
            write_atomic(Path(self.settings.report_json), json.dumps(report, indent=2) + "\n")
        if self.settings.report_md or wants_summary:
            from .render_markdown import render_markdown

            markdown = render_markdown(report)
            if self.settings.report_md:
                write_atomic(Path(self.settings.report_md), markdown)
            if wants_summary:
                with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as summary:
                    summary.write(markdown + "\n")
        if self.settings.report_html:
            from .render_html import render_html

            write_atomic(Path(self.settings.report_html), render_html(report))


def print_catalogue(config: pytest.Config, settings: "Settings") -> int:
    """``--opt-techniques``: every technique, whether this machine can run it, and why not."""
    from .session import OptSession

    session = OptSession(config, settings)
    hw = session.hardware
    print(f"technique catalogue on {hw.describe()} (torch {hw.versions.get('torch')}, transformers "
          f"{hw.versions.get('transformers')}):")
    for name, summary, reason in session.technique_support():
        status = "supported" if reason is None else f"unsupported: {reason}"
        print(f"  {name:<24} {summary}\n  {'':<24} -> {status}")
    return 0
