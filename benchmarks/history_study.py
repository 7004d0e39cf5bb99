"""History study (issue 21, "history as the reference"): real recorded histories of the tiny model.

Every session is a real pytest run of a small user project (one test per technique, ``tiny-random-llama``,
the plugin's default model, ``max_new_tokens`` 32, ``--opt-rounds=5``, ``--opt-budgets=off``), one at a time,
with ``PYTEST_OPT_CPU_THREADS=1``. Each test stacks a registered study technique, ``history_slowdown``, on its
technique: it changes nothing until the script sets ``HISTORY_STUDY_SLOWDOWN_PCT`` for a session, and then
busy-waits that percent of each generate call's own wall time after the call returns (inside the plugin's
clock), so the *optimized* configuration's generate is that much slower and the baseline is untouched.

``--changepoint``: one history of ``--sessions`` (30) sessions, each recorded with ``--opt-history=DIR``;
sessions are numbered from 1 and from session ``--slow-from`` (20) on the optimized side is ``--slowdown`` (20)
percent slower. Then ``pytest-opt history DIR --json`` (the command itself, as a subprocess) finds the change
points; each is mapped back to the session that recorded its first run after the change (1-based). Goal: found
at run 20 +- 1 for latency. The achieved slowdown is read from the reports (optimized median latency and the
in-session speedup, before and after). Also prints the command's text output.

    python benchmarks/history_study.py --changepoint [--sessions 30] [--slow-from 20] [--slowdown 20]
        [--techniques sdpa,static_cache] [--keep DIR] [--out FILE] [-- PYTEST_ARGS]

``--changepoint --reanalyse --keep DIR`` runs no session: it analyses the sessions an earlier run kept in DIR
again (their reports, ``DIR/reports/session-NNN.json``, and the history, ``DIR/history``).

``--window``: ``--opt-compare=DIR`` against a window of recorded runs. ``--warm`` (10) sessions recorded into DIR
with no gate; then ``--sessions-null`` (20) null sessions, each judged with ``--opt-compare=DIR
--opt-compare-window=10 --opt-compare-fail=speedup:10%,latency:10% --opt-compare-confirm=0`` and recorded too
(the window slides), and ``--sessions-slowed`` (20) sessions with the optimized side ``--window-slowdown`` (15)
percent slower, judged the same way but not recorded (no ``--opt-history``), taken in turn with the null ones
so that the machine's drift falls on both. Each test's verdict per threshold is read from its JSON report's
``regression.judged`` entries (``metric``, ``verdict``). Goals: at most 1 of 20 null sessions with any
``regressed``, per threshold; slowed: ``speedup:10%`` caught (a test ``regressed``) in at least 19 of 20; at
``latency:10%`` every slowed test ``regressed`` or ``inconclusive``, never ``ok``.

    python benchmarks/history_study.py --window [--warm 10] [--sessions-null 20] [--sessions-slowed 20]
        [--window-size 10] [--confirm 0] [--window-slowdown 15] [--keep DIR] [--out FILE] [-- PYTEST_ARGS]

Both print a Markdown section for benchmarks/RESULTS.md, headed by the exact command line, and announce each
session on stdout as it starts and ends.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
TEST_FILE = "test_history_study.py"
SLOWDOWN_ENV = "HISTORY_STUDY_SLOWDOWN_PCT"
TECHNIQUES = ("sdpa", "static_cache")
MODEL = "tiny-random-llama"
MAX_NEW_TOKENS = 32
ROUNDS = 5
THREADS = "1"
WINDOW_FAIL = "speedup:10%,latency:10%"
WINDOW_METRICS = ("speedup", "latency")
NAME = re.compile(r"^\d{8}T\d{6}Z")  # a recorded run's file name starts with its UTC time

CONFTEST = textwrap.dedent(f'''
    import contextlib
    import os
    import time

    from pytest_transformers_opt.techniques import Technique


    class HistorySlowdown(Technique):
        """Busy-waits {SLOWDOWN_ENV} percent of each generate call's own wall time after it returns: the
        optimized configuration that much slower (0 or unset: changes nothing)."""
        name = "history_slowdown"
        family = "study"
        summary = "slowdown set by {SLOWDOWN_ENV}"

        @contextlib.contextmanager
        def around_generate(self, model):
            factor = float(os.environ.get("{SLOWDOWN_ENV}", "0")) / 100.0
            started = time.perf_counter()
            yield
            if factor > 0:
                until = time.perf_counter() + (time.perf_counter() - started) * factor
                while time.perf_counter() < until:
                    pass


    def pytest_opt_register_techniques(registry):
        registry.register(HistorySlowdown)
''')


def case_name(technique: str) -> str:
    """The test function of one technique: ``test_static_cache``."""
    return "test_" + re.sub(r"\W", "_", technique)


def project_source(model: str, techniques: Sequence[str], max_new_tokens: int) -> str:
    """One test per technique on ``model`` (the default prompts), each with ``history_slowdown`` stacked on."""
    tests = "".join(f"\n\n@pytest.mark.optimization({technique!r}, \"history_slowdown\")\n"
                    f"def {case_name(technique)}(opt_bench):\n    opt_bench(max_new_tokens={max_new_tokens})\n"
                    for technique in techniques)
    return f"import pytest\n\npytestmark = pytest.mark.opt_model({model!r})\n{tests}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--changepoint", action="store_true", help="one recorded history with a slowdown, then pytest-opt history")
    mode.add_argument("--window", action="store_true", help="--opt-compare=DIR against a window: null and slowed sessions")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--techniques", default=",".join(TECHNIQUES), help="comma-separated, one test each")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    parser.add_argument("--rounds", default=str(ROUNDS), help="--opt-rounds of every session")
    parser.add_argument("--threads", default=THREADS, help="PYTEST_OPT_CPU_THREADS of every session")
    parser.add_argument("--sessions", type=int, default=30, help="changepoint: sessions in the history")
    parser.add_argument("--slow-from", type=int, default=20, help="changepoint: first slowed session (1-based)")
    parser.add_argument("--slowdown", type=float, default=20.0, help="changepoint: percent")
    parser.add_argument("--warm", type=int, default=10, help="window: sessions recorded before any is judged")
    parser.add_argument("--sessions-null", type=int, default=20, help="window: null sessions (judged, recorded)")
    parser.add_argument("--sessions-slowed", type=int, default=20, help="window: slowed sessions (judged, not recorded)")
    parser.add_argument("--window-size", type=int, default=10, help="window: --opt-compare-window")
    parser.add_argument("--window-fail", default=WINDOW_FAIL, help="window: --opt-compare-fail")
    parser.add_argument("--confirm", default="0", choices=("0", "1"), help="window: --opt-compare-confirm")
    parser.add_argument("--window-slowdown", type=float, default=15.0, help="window: percent")
    parser.add_argument("--reanalyse", action="store_true",
                        help="changepoint: run no session, analyse the sessions kept in --keep DIR again")
    parser.add_argument("--keep", type=Path, default=None, help="the project folder to use and keep (else a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.reanalyse and not (args.changepoint and args.keep is not None):
        parser.error("--reanalyse needs --changepoint and --keep DIR (a folder an earlier run kept)")
    if args.changepoint and not 1 <= args.slow_from <= args.sessions:
        parser.error(f"--slow-from {args.slow_from}: the sessions are numbered 1 to {args.sessions}")
    return args


# --------------------------------------------------------------------------- sessions


@dataclass
class Session:
    number: int  # 1-based, in the order run
    scenario: str
    status: int
    seconds: float
    report: dict[str, Any] | None
    recorded: str | None = None  # the history file this session wrote
    tail: str = ""

    def rows(self) -> list[dict[str, Any]]:
        return list((self.report or {}).get("tests") or [])


def announce(text: str) -> None:
    print(f"[{dt.datetime.now().strftime('%H:%M:%S')}] {text}", flush=True)


def history_names(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.json") if NAME.match(p.name)} if folder.is_dir() else set()


def run_session(root: Path, number: int, total: int, scenario: str, slowdown: float, pytest_args: Sequence[str],
                args: argparse.Namespace, history: Path | None = None) -> Session:
    """One pytest session of the project in ``root``; ``history``: the folder it records into (to find its file)."""
    report = root / "reports" / f"session-{number:03d}.json"
    report.parent.mkdir(exist_ok=True)
    before = history_names(history) if history is not None else set()
    env = {"OMP_NUM_THREADS": args.threads, **os.environ, "PYTEST_OPT_CPU_THREADS": args.threads,
           SLOWDOWN_ENV: f"{slowdown:g}"}
    for name in ("PYTEST_OPT_HISTORY", "PYTEST_OPT_COMPARE", "PYTEST_OPT_COMPARE_FAIL", "PYTEST_OPT_COMPARE_WINDOW"):
        env.pop(name, None)  # only what the study passes
    announce(f"session {number}/{total} ({scenario}{f', optimized side +{slowdown:g}%' if slowdown else ''}) starts")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-W", "ignore", "--opt-budgets=off", f"--opt-rounds={args.rounds}",
                           f"--opt-report-json={report}", *pytest_args, *args.pytest_args, TEST_FILE],
                          cwd=root, check=False, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    data = json.loads(report.read_text()) if report.exists() else None
    new = sorted(history_names(history) - before) if history is not None else []
    session = Session(number, scenario, done.returncode, seconds, data, new[-1] if new else None,
                      (done.stdout + done.stderr)[-3000:])
    outcomes = ", ".join(f"{row['nodeid'].rsplit('::', 1)[-1]} {row.get('outcome')}" for row in session.rows())
    announce(f"session {number}/{total} ends: {seconds:.1f} s, exit {done.returncode}"
             f"{f', recorded {session.recorded}' if session.recorded else ''}; {outcomes or 'no report'}")
    return session


def pytest_opt() -> list[str]:
    """The ``pytest-opt`` command of this interpreter's environment."""
    script = Path(sys.executable).with_name("pytest-opt")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pytest_transformers_opt.cli"]


def make_project(args: argparse.Namespace, prefix: str) -> tuple[Path, Any]:
    """The project folder (``--keep`` or a temporary one) with its conftest and test file; the second value
    is the TemporaryDirectory to clean up (None with --keep)."""
    if args.keep is not None:
        root, holder = args.keep.resolve(), None
        root.mkdir(parents=True, exist_ok=True)
    else:
        holder = tempfile.TemporaryDirectory(prefix=prefix)
        root = Path(holder.name)
    techniques = [t for t in args.techniques.split(",") if t]
    (root / "conftest.py").write_text(CONFTEST)
    (root / TEST_FILE).write_text(project_source(args.model, techniques, args.max_new_tokens))
    return root, holder


def options_missing(options: Iterable[str]) -> list[str]:
    """The options this environment's pytest does not know (read from ``pytest --help``)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--help"], capture_output=True, text=True, check=False)
    return [option for option in options if option not in done.stdout]


def command_line() -> str:
    return " ".join(shlex.quote(part) for part in [".venv/bin/python", *sys.argv])


# --------------------------------------------------------------------------- changepoint mode


@dataclass
class PointRow:
    """One change point as the study reports it."""

    test: str
    metric: str
    session: int | None  # the 1-based session that recorded the first run after the change
    run: str
    change: float | None
    interval: tuple[float, float] | None
    p_value: float
    worse: bool | None
    before_median: float
    after_median: float


@dataclass
class SeriesRow:
    test: str
    hardware: str | None
    metric: str
    runs: int
    note: str | None
    points: list[PointRow] = field(default_factory=list)
    values: list[tuple[int | None, float]] = field(default_factory=list)  # (session, value), oldest first

    def step(self, slow_from: int) -> tuple[float | None, float | None]:
        """The series' noise before session ``slow_from`` (robust CV: 1.4826 MAD / median) and its step there
        (median from it / median before - 1); None where a side is empty or its median not positive."""
        before = [v for n, v in self.values if n is not None and n < slow_from]
        after = [v for n, v in self.values if n is not None and n >= slow_from]
        if not before or not after or statistics.median(before) <= 0:
            return None, None
        center = statistics.median(before)
        noise = 1.4826 * statistics.median(abs(v - center) for v in before) / center
        return noise, statistics.median(after) / center - 1


def session_numbers(sessions: Sequence[Session]) -> dict[str, int]:
    """History file name -> the 1-based number of the session that recorded it."""
    return {s.recorded: s.number for s in sessions if s.recorded}


def series_rows(document: Mapping[str, Any], session_of: Mapping[str, int]) -> list[SeriesRow]:
    """Every series of ``pytest-opt history --json``'s output, its change points mapped to session numbers
    (a run name the study did not record maps to None)."""
    rows = []
    for series in document.get("series") or []:
        row = SeriesRow(series["nodeid"].rsplit("::", 1)[-1], series.get("hardware"), series["metric"],
                        len(series.get("runs") or []), series.get("note"))
        row.values = [(session_of.get(name), value) for name, value in zip(series.get("runs") or [],
                                                                           series.get("values") or [])]
        for point in series.get("change_points") or []:
            name = point["run"]["name"]
            interval = point.get("interval")
            row.points.append(PointRow(row.test, row.metric, session_of.get(name), name, point.get("change"),
                                       tuple(interval) if interval else None, point["p_value"], point.get("worse"),
                                       point["before_median"], point["after_median"]))
        rows.append(row)
    return rows


def found_at(row: SeriesRow, at: int, tolerance: int = 1) -> bool:
    """A change point of the series at session ``at`` +- ``tolerance``."""
    return any(p.session is not None and abs(p.session - at) <= tolerance for p in row.points)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def _figure(metric: str, value: float) -> str:
    if metric == "latency":
        return f"{value * 1000:.2f} ms"
    if metric == "speedup":
        return f"{value:.3f}x"
    if metric == "peak_memory":
        return f"{value / 2**20:.1f} MiB"
    return f"{value:.3g}"


def achieved(sessions: Sequence[Session], slow_from: int) -> list[dict[str, Any]]:
    """Per test: median optimized latency, baseline latency and speedup of the sessions before and from
    ``slow_from``, and their ratios (what the injected slowdown achieved, and the machine's drift)."""
    tests: dict[str, dict[str, list[list[float]]]] = {}
    for session in sessions:
        side = 0 if session.number < slow_from else 1
        for row in session.rows():
            figures = tests.setdefault(row["nodeid"].rsplit("::", 1)[-1],
                                       {"optimized": [[], []], "baseline": [[], []], "speedup": [[], []]})
            for key in ("optimized", "baseline"):
                value = (row.get(key) or {}).get("latency_s")
                if isinstance(value, (int, float)):
                    figures[key][side].append(value)
            if isinstance(row.get("speedup"), (int, float)):
                figures["speedup"][side].append(row["speedup"])
    out = []
    for test, figures in tests.items():
        entry: dict[str, Any] = {"test": test}
        for key, (before, after) in figures.items():
            if before and after:
                entry[key] = (statistics.median(before), statistics.median(after),
                              statistics.median(after) / statistics.median(before))
        out.append(entry)
    return out


def kept_sessions(root: Path, slow_from: int) -> list[Session]:
    """The sessions of a kept changepoint folder, from their reports (``reports/session-NNN.json``), each with
    the history file named by its report's time (``created``); wall times are not kept (0)."""
    names = sorted(history_names(root / "history"))
    used: set[str] = set()
    sessions = []
    for path in sorted((root / "reports").glob("session-*.json")):
        number = int(path.stem.split("-")[1])
        data = json.loads(path.read_text())
        stamp = dt.datetime.fromisoformat(data["created"]).astimezone(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        recorded = next((name for name in names if name.startswith(stamp) and name not in used), None)
        if recorded is not None:
            used.add(recorded)
        summary = data.get("summary") or {}
        status = 1 if summary.get("failed") or summary.get("error") else 0
        sessions.append(Session(number, "slowed" if number >= slow_from else "null", status, 0.0, data, recorded))
    return sessions


def run_changepoint(args: argparse.Namespace) -> tuple[str, bool]:
    root, holder = make_project(args, "history-study-cp-")
    try:
        history = root / "history"
        sessions: list[Session] = []
        began = time.perf_counter()
        if args.reanalyse:
            sessions = kept_sessions(root, args.slow_from)
            if not sessions:
                raise SystemExit(f"--reanalyse: {root / 'reports'} holds no session report")
        elif history_names(history):
            raise SystemExit(f"{history} already holds recorded runs: give an empty --keep folder, or --reanalyse")
        for number in range(1, args.sessions + 1) if not args.reanalyse else ():
            slowed = number >= args.slow_from
            sessions.append(run_session(root, number, args.sessions, "slowed" if slowed else "null",
                                        args.slowdown if slowed else 0.0, [f"--opt-history={history}"], args,
                                        history))
        seconds = 0.0 if args.reanalyse else time.perf_counter() - began
        detection = subprocess.run([*pytest_opt(), "history", str(history), "--json"], capture_output=True,
                                   text=True, check=False)
        if detection.returncode != 0:
            raise SystemExit(f"pytest-opt history --json exited {detection.returncode}: {detection.stderr}")
        document = json.loads(detection.stdout)
        text = subprocess.run([*pytest_opt(), "history", str(history)], capture_output=True, text=True, check=False)
        rows = series_rows(document, session_numbers(sessions))
        return changepoint_markdown(args, sessions, rows, document, text.stdout + text.stderr, seconds)
    finally:
        if holder is not None:
            holder.cleanup()


def changepoint_markdown(args: argparse.Namespace, sessions: Sequence[Session], rows: Sequence[SeriesRow],
                         document: Mapping[str, Any], text: str, seconds: float) -> tuple[str, bool]:
    recorded = sum(s.recorded is not None for s in sessions)
    failed = [s for s in sessions if s.status != 0]
    first = next((s.report for s in sessions if s.report), None) or {}
    hardware = next((row.get("hardware") for row in first.get("tests") or [] if row.get("hardware")), "?")
    if seconds:
        took = f"({seconds / 60:.1f} min, {seconds / max(len(sessions), 1):.1f} s each)"
    else:  # --reanalyse: the span of the reports' times
        created = sorted(str((s.report or {}).get("created")) for s in sessions if s.report)
        took = f"(re-analysed; their reports dated {created[0]} to {created[-1]})" if created else "(re-analysed)"
    lines = [f"    {command_line()}", "",
             f"{len(sessions)} sessions run back to back {took}, {recorded} recorded; sessions numbered from 1, the optimized side +{args.slowdown:g}% from session "
             f"{args.slow_from} on (sessions {args.slow_from}-{len(sessions)}). Model {args.model}, techniques "
             f"{args.techniques} (each with `history_slowdown` stacked on), max_new_tokens {args.max_new_tokens}, "
             f"--opt-rounds={args.rounds}, --opt-budgets=off, PYTEST_OPT_CPU_THREADS={args.threads}; hardware "
             f"`{hardware}`." + (f" Sessions with a non-zero exit: {', '.join(f'{s.number} ({s.status})' for s in failed)}."
                                  if failed else ""), "",
             "What the slowdown achieved (median over the sessions before / from the slowed one):", "",
             "| test | optimized latency | ratio | baseline latency (drift) | ratio | in-session speedup | ratio | "
             "slowdown it implies (speedup before / after - 1) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for entry in achieved(sessions, args.slow_from):
        cells = []
        for key, fmt in (("optimized", "latency"), ("baseline", "latency"), ("speedup", "speedup")):
            if key in entry:
                before, after, ratio = entry[key]
                cells += [f"{_figure(fmt, before)} -> {_figure(fmt, after)}", f"{ratio:.3f}"]
            else:
                cells += ["-", "-"]
        cells.append(_pct(1 / entry["speedup"][2] - 1) if "speedup" in entry else "-")
        lines.append(f"| {entry['test']} | {' | '.join(cells)} |")
    lines += ["", f"`pytest-opt history DIR --json` ({document.get('runs_read')} runs read): every series, its change "
              f"points by session (1-based), size = ratio of the segments' medians - 1 with its 95% interval:", "",
              "| test | metric | runs | noise before (robust CV) | step (medians) | change points: session (file), size "
              f"[95% interval], medians, p | at session {args.slow_from} +- 1 |", "| --- | --- | --- | --- | --- | --- | --- |"]
    goal = True
    for row in rows:
        points = "; ".join(
            f"**{p.session if p.session is not None else '?'}** ({p.run.removesuffix('.json')}), {_pct(p.change)}"
            + (f" [{_pct(p.interval[0])}, {_pct(p.interval[1])}]" if p.interval else "")
            + f", {_figure(row.metric, p.before_median)} -> {_figure(row.metric, p.after_median)}, p={p.p_value:.2g}"
            for p in row.points) or (row.note or "none")
        hit = found_at(row, args.slow_from)
        if row.metric == "latency":
            goal = goal and hit
        noise, step = row.step(args.slow_from)
        lines.append(f"| {row.test} | {row.metric} | {row.runs} | {'-' if noise is None else f'{noise:.1%}'} | "
                     f"{_pct(step)} | {points} | {'yes' if hit else 'no'} |")
    lines += ["", f"Goal (latency: found at session {args.slow_from} +- 1 in every test): **{'met' if goal else 'missed'}**.",
              "", "`pytest-opt history DIR` (text):", ""]
    lines += ["    " + line for line in text.rstrip().splitlines()]
    return "\n".join(lines), goal


# --------------------------------------------------------------------------- window mode


def threshold_verdicts(report: Mapping[str, Any], metrics: Sequence[str] = WINDOW_METRICS) -> dict[str, list[str]]:
    """Per metric of ``metrics``: each test's verdict on that threshold, from ``regression.judged`` (a test
    whose regression record has no entry for it: its overall verdict, e.g. ``new``, ``not comparable``; no
    record at all: ``none``)."""
    found: dict[str, list[str]] = {metric: [] for metric in metrics}
    for test in report.get("tests") or []:
        regression = test.get("regression") or {}
        judged = {entry.get("metric"): entry.get("verdict") for entry in regression.get("judged") or []}
        for metric in metrics:
            verdict = str(judged.get(metric) or regression.get("verdict") or "none")
            if verdict == "regressed" and regression.get("confirmed") is False:
                verdict = "one-off"  # --opt-compare-confirm=1: measured again, it did not regress again
            found[metric].append(verdict)
    return found


def judged_entries(report: Mapping[str, Any], metric: str) -> list[dict[str, Any]]:
    """Every test's ``regression.judged`` entry for ``metric`` (tests without one left out)."""
    return [entry for test in report.get("tests") or []
            for entry in (test.get("regression") or {}).get("judged") or [] if entry.get("metric") == metric]


@dataclass
class WindowTally:
    scenario: str
    metric: str
    sessions: int = 0
    any_regressed: int = 0  # sessions in which a test regressed on this threshold
    any_inconclusive: int = 0  # ... with none regressed and a test inconclusive
    all_ok: int = 0  # ... every test ok
    other: int = 0  # ... the rest (improved, new, not comparable, no report)
    tests: dict[str, int] = field(default_factory=dict)  # verdict -> tests
    ratios: list[float] = field(default_factory=list)  # each judged test: today / the window's median
    detectable: list[float] = field(default_factory=list)  # each judged test: the window's detectable size
    spreads: list[float] = field(default_factory=list)  # each judged test: the window's spread, % of its median
    rules: set[str] = field(default_factory=set)

    def add_entries(self, entries: Iterable[Mapping[str, Any]]) -> None:
        for entry in entries:
            for key, values in (("ratio", self.ratios), ("detectable", self.detectable), ("spread_pct", self.spreads)):
                if isinstance(entry.get(key), (int, float)):
                    values.append(float(entry[key]))
            if entry.get("rule"):
                self.rules.add(str(entry["rule"]))

    def add(self, verdicts: Sequence[str]) -> None:
        self.sessions += 1
        for verdict in verdicts:
            self.tests[verdict] = self.tests.get(verdict, 0) + 1
        if "regressed" in verdicts:
            self.any_regressed += 1
        elif "inconclusive" in verdicts:
            self.any_inconclusive += 1
        elif verdicts and all(v == "ok" for v in verdicts):
            self.all_ok += 1
        else:
            self.other += 1


def window_tallies(sessions: Iterable[Session], metrics: Sequence[str] = WINDOW_METRICS) -> dict[tuple[str, str], WindowTally]:
    """(scenario, metric) -> the sessions' verdicts counted; warm-up sessions (not judged) are left out."""
    tallies: dict[tuple[str, str], WindowTally] = {}
    for session in sessions:
        if session.scenario == "warm-up":
            continue
        verdicts = threshold_verdicts(session.report or {}, metrics)
        for metric in metrics:
            tally = tallies.setdefault((session.scenario, metric), WindowTally(session.scenario, metric))
            tally.add(verdicts[metric])
            tally.add_entries(judged_entries(session.report or {}, metric))
    return tallies


def window_goals(tallies: Mapping[tuple[str, str], WindowTally], null: int, slowed: int) -> dict[str, bool]:
    """The issue's goals, scaled to the session counts (1 of 20 null sessions, 19 of 20 slowed)."""
    goals = {}
    for metric in WINDOW_METRICS:
        tally = tallies.get(("null", metric))
        if tally is not None:
            goals[f"null {metric}: at most {max(1, null // 20)} of {null} with any regressed"] = \
                tally.any_regressed <= max(1, null // 20)
    speed = tallies.get(("slowed", "speedup"))
    if speed is not None:
        need = slowed - max(1, slowed // 20) if slowed >= 20 else slowed
        goals[f"slowed speedup: caught in at least {need} of {slowed}"] = speed.any_regressed >= need
    latency = tallies.get(("slowed", "latency"))
    if latency is not None:
        goals["slowed latency: no test ok (regressed or inconclusive)"] = latency.tests.get("ok", 0) == 0
    return goals


def run_window(args: argparse.Namespace) -> tuple[str, bool]:
    missing = options_missing(["--opt-compare-window", "--opt-compare-confirm"])
    if "--opt-compare-window" in missing:
        raise SystemExit("this environment's pytest lacks --opt-compare-window: the window mode needs it")
    args.confirm_missing = "--opt-compare-confirm" in missing  # then left out: every verdict is the raw one
    root, holder = make_project(args, "history-study-window-")
    try:
        history = root / "history"
        if history_names(history):
            raise SystemExit(f"{history} already holds recorded runs: give an empty --keep folder")
        record = [f"--opt-history={history}"]
        gate = [f"--opt-compare={history}", f"--opt-compare-window={args.window_size}",
                f"--opt-compare-fail={args.window_fail}"]
        if not args.confirm_missing:
            gate.append(f"--opt-compare-confirm={args.confirm}")
        plan: list[tuple[str, float, list[str]]] = [("warm-up", 0.0, record)] * args.warm
        for index in range(max(args.sessions_null, args.sessions_slowed)):  # in turn: drift falls on both
            if index < args.sessions_null:
                plan.append(("null", 0.0, [*record, *gate]))
            if index < args.sessions_slowed:
                plan.append(("slowed", args.window_slowdown, gate))
        sessions: list[Session] = []
        began = time.perf_counter()
        for number, (scenario, slowdown, options) in enumerate(plan, 1):
            sessions.append(run_session(root, number, len(plan), scenario, slowdown, options, args,
                                        history if any(o.startswith("--opt-history=") for o in options) else None))
        return window_markdown(args, sessions, time.perf_counter() - began)
    finally:
        if holder is not None:
            holder.cleanup()


def window_markdown(args: argparse.Namespace, sessions: Sequence[Session], seconds: float) -> tuple[str, bool]:
    tallies = window_tallies(sessions)
    goals = window_goals(tallies, args.sessions_null, args.sessions_slowed)
    exits: dict[str, dict[int, int]] = {}
    for session in sessions:
        exits.setdefault(session.scenario, {}).setdefault(session.status, 0)
        exits[session.scenario][session.status] += 1
    lines = [f"    {command_line()}", "",
             f"{len(sessions)} sessions ({seconds / 60:.1f} min): {args.warm} warm-up sessions recorded, then "
             f"{args.sessions_null} null sessions (judged, recorded: the window slides) and {args.sessions_slowed} "
             f"sessions with the optimized side +{args.window_slowdown:g}% (judged, not recorded), in turn. Gate "
             f"`--opt-compare-window={args.window_size} --opt-compare-fail={args.window_fail}"
             + ("` (this pytest has no --opt-compare-confirm yet: left out, every verdict the raw one)"
                if getattr(args, "confirm_missing", False) else f" --opt-compare-confirm={args.confirm}`")
             + f"; model {args.model}, techniques {args.techniques}, "
             f"max_new_tokens {args.max_new_tokens}, --opt-rounds={args.rounds}, PYTEST_OPT_CPU_THREADS={args.threads}. "
             "Exit statuses: " + "; ".join(f"{scenario} " + ", ".join(f"{code}: {count}" for code, count in sorted(c.items()))
                                           for scenario, c in exits.items()) + ".", "",
             "| scenario | threshold | sessions | any regressed | else any inconclusive | all ok | other | tests by verdict | "
             "today / window median, median (min-max) | window spread, median | detectable size, median (max) | rule |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (scenario, metric), tally in sorted(tallies.items(), key=lambda item: (item[0][0] != "null", item[0])):
        limit = next((term for term in args.window_fail.split(",") if term.startswith(metric + ":")), metric)
        by_verdict = ", ".join(f"{verdict} {count}" for verdict, count in sorted(tally.tests.items()))
        ratios = (f"{statistics.median(tally.ratios):.3f} ({min(tally.ratios):.3f}-{max(tally.ratios):.3f})"
                  if tally.ratios else "-")
        spread = f"{statistics.median(tally.spreads):.1f}%" if tally.spreads else "-"
        detectable = (f"{statistics.median(tally.detectable):.1f}% ({max(tally.detectable):.1f}%)"
                      if tally.detectable else "-")
        lines.append(f"| {scenario} | `{limit}` | {tally.sessions} | {tally.any_regressed} | {tally.any_inconclusive} | "
                     f"{tally.all_ok} | {tally.other} | {by_verdict} | {ratios} | {spread} | {detectable} | "
                     f"{', '.join(sorted(tally.rules)) or '-'} |")
    lines += [""] + [f"- {goal}: **{'met' if met else 'missed'}**" for goal, met in goals.items()]
    return "\n".join(lines), all(goals.values())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    text, met = run_changepoint(args) if args.changepoint else run_window(args)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
