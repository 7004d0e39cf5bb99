"""Compare study (issue 40, item 2): how often does the one-report compare call a null re-run ``regressed``, how
large a slowdown does it catch, at quiet and under load, and how far apart are two runs' medians?

``collect`` runs ``--sessions`` (20) real pytest sessions of one small user project, one after another, each
writing its JSON report (``--opt-report-json``), and keeps in DIR every session's report with its exit status,
wall time, load averages (at its start and end) and the study's parameters:

    python benchmarks/compare_study.py collect DIR [--sessions 20] [--load quiet|busy1|busy2] [--inject PCT]
        [--model tiny-random-llama[,smollm2]] [--techniques sdpa,static_cache] [--max-new-tokens 16]
        [--threads 1|N|auto] [--add] [-- PYTEST_ARGS]

* the project: one test per technique and model (``opt_bench(max_new_tokens=...)``, the default prompts),
  ``--opt-budgets=off``, the plugin's own rounds; ``--opt-cpu-threads=1`` (``--threads``, 1 as in the other studies:
  on 2 shared cores, torch's spinning threads turn a busy neighbour into rounds 10x slower; ``auto`` for the
  plugin's own); ``smollm2`` is short for the built-in ``smollm2-135m``;
* ``--load busy1`` / ``busy2``: one / two neighbour processes spinning a Python busy loop for the whole session,
  started before it and killed after it;
* ``--inject PCT``: the optimized side PCT% slower: every test stacks the user technique ``compare_slowdown``
  (written into the project's conftest) on its own, which busy-waits PCT/100 of each forward pass's own time after
  it. It is stacked in every session, PCT 0 doing nothing, so that null and injected reports hold the same
  techniques and stay comparable;
* ``--add``: more sessions into a DIR an earlier ``collect`` filled, with its parameters.

``analyse`` runs nothing: it judges the kept reports with the package's one-report comparison (``judge``, the rule
that ``pytest --opt-compare=old.json --opt-compare-fail=latency:10%`` applies) and counts the verdict words:

    python benchmarks/compare_study.py analyse DIR [DIR2] [--compare-fail latency:10%] [--scale PCT ...]
        [--out FILE]

* one folder: its null pairs, each session against the one before it (i, i+1);
* two folders: old from DIR, new from DIR2, session i against session i (DIR2 injected: the detection rate; DIR2
  under another load: a pull request's run on a busier machine than main's);
* ``--scale PCT`` (repeatable): each pair again with the new report's optimized latency (every round and the median)
  PCT% higher, a slowdown simulated on real sessions, labelled "simulated".

It prints, headed by the exact command line, a table of the verdicts per (load, effect) and test, with the median
latency change and the median detectable size where the rule reports one (``judged[].detectable``), and each
folder's spreads: the between-run spread (``robust_spread`` of each test's optimized median latency over the
sessions) and the within-run spread (the median over sessions of the rounds' robust spread), in percent of the
median, the two figures a between-run term is calibrated from.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import importlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

if str(Path(__file__).resolve().parent) not in sys.path:  # imported by the tests rather than run
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_study import KEPT_SESSION, KEPT_STUDY, _spread, case_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEST_FILE = "test_compare_study.py"
MODEL = "tiny-random-llama"
MODEL_SHORT_NAMES = {"smollm2": "smollm2-135m"}
TECHNIQUES = ("sdpa", "static_cache")
MAX_NEW_TOKENS = 16
COMPARE_FAIL = "latency:10%"
LOADS = {"quiet": 0, "busy1": 1, "busy2": 2}  # --load -> busy neighbour processes during each session
SLOWDOWN_TECHNIQUE = "compare_slowdown"
NEIGHBOUR = "while True:\n    pass\n"  # a busy neighbour: one core's worth of spinning Python
VERDICT_ORDER = ("regressed", "improved", "ok", "inconclusive", "not comparable")

sys.path.insert(0, str(ROOT / "tests"))  # tests/slowdown.py: the user technique the verdict tests inject
from slowdown import slowdown_technique  # noqa: E402


def conftest_source(inject_pct: float) -> str:
    """The generated project's conftest: tests/slowdown.py's technique, the optimized side ``inject_pct``% slower
    (each forward busy-waits that share of its own time after it; 0: the same hooks, no wait, so null and
    injected sessions carry the same technique list and the same overhead)."""
    return (f'"""Written by benchmarks/compare_study.py: the optimized side {inject_pct:g}% slower."""\n'
            "import contextlib\nimport time\n\nfrom pytest_transformers_opt.techniques import Technique\n"
            + slowdown_technique("CompareSlowdown", SLOWDOWN_TECHNIQUE, inject_pct / 100.0)
            + "\n\ndef pytest_opt_register_techniques(registry):\n    registry.register(CompareSlowdown)\n")


def model_name(name: str) -> str:
    """``smollm2`` -> ``smollm2-135m``; any other name as given."""
    return MODEL_SHORT_NAMES.get(name, name)


def test_name(model: str, technique: str, models: Sequence[str]) -> str:
    """``test_sdpa``; with several models, ``test_smollm2_135m_sdpa``."""
    return case_name(technique) if len(models) == 1 else case_name(f"{model}_{technique}")


def project_source(models: Sequence[str], techniques: Sequence[str], max_new_tokens: int) -> str:
    """One test per model and technique, each with ``compare_slowdown`` stacked on its technique."""
    tests = "".join(f"\n\n@pytest.mark.opt_model({model!r})\n"
                    f"@pytest.mark.optimization({technique!r}, {SLOWDOWN_TECHNIQUE!r})\n"
                    f"def {test_name(model, technique, models)}(opt_bench):\n"
                    f"    opt_bench(max_new_tokens={max_new_tokens})\n"
                    for model in models for technique in techniques)
    return f"import pytest\n{tests}"


# --------------------------------------------------------------------------- collect


@contextlib.contextmanager
def busy_neighbours(count: int) -> Iterator[list[int]]:
    """``count`` processes spinning a Python loop while the block runs (their pids); killed when it ends, however
    it ends."""
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            processes.append(subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdin=subprocess.DEVNULL,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield [process.pid for process in processes]
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded."""
    return [round(value, 2) for value in os.getloadavg()]


def session_command(report: Path, threads: str, extra_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-W", "ignore",
            "--opt-budgets=off", f"--opt-cpu-threads={threads}", f"--opt-report-json={report}", *extra_args,
            TEST_FILE]


def session_env() -> dict[str, str]:
    """This environment without the plugin's variables (only what the study passes counts) and CI's step summary."""
    return {name: value for name, value in os.environ.items()
            if not name.startswith("PYTEST_OPT_") and name != "GITHUB_STEP_SUMMARY"}


SessionRunner = Callable[[Path, Path, str, Sequence[str]], "tuple[int, str]"]


def run_session(root: Path, report: Path, threads: str, extra_args: Sequence[str]) -> tuple[int, str]:
    """One pytest session of the project in ``root`` writing ``report``: (exit status, the output's end)."""
    done = subprocess.run(session_command(report, threads, extra_args), cwd=root, check=False, env=session_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return done.returncode, done.stdout[-3000:]


def announce(text: str) -> None:
    """A progress line, on stderr: stdout holds only the tables."""
    print(f"[{dt.datetime.now().strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _loads(values: Sequence[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _medians(report: dict[str, Any] | None) -> str:
    cells = []
    for test in (report or {}).get("tests") or []:
        latency = (test.get("optimized") or {}).get("latency_s")
        shown = f"{1000 * latency:.1f} ms" if isinstance(latency, (int, float)) else test.get("outcome", "?")
        cells.append(f"{test['nodeid'].rsplit('::', 1)[-1]} {shown}")
    return ", ".join(cells) or "no report"


def collect(folder: Path, params: dict[str, Any], sessions: int, runner: SessionRunner = run_session) -> None:
    """``sessions`` sessions into ``folder`` (numbered after those it holds), each under ``params['load']``."""
    existing = len(list(folder.glob("*" + KEPT_SESSION)))
    neighbours = LOADS[params["load"]]
    with tempfile.TemporaryDirectory(prefix="compare-study-") as temporary:
        root = Path(temporary)
        (root / "conftest.py").write_text(conftest_source(params["inject"]), encoding="utf-8")
        (root / TEST_FILE).write_text(project_source(params["models"], params["techniques"],
                                                     params["max_new_tokens"]), encoding="utf-8")
        for number in range(existing + 1, existing + sessions + 1):
            name = f"session-{number:03d}"
            report = root / f"{name}.json"
            what = f"session {number - existing}/{sessions} ({name}, {params['load']}" + \
                (f", optimized side +{params['inject']:g}%" if params["inject"] else "") + ")"
            load_start = load_average()
            announce(f"{what} starts; load average {_loads(load_start)}")
            started = time.perf_counter()
            with busy_neighbours(neighbours) as pids:
                status, tail = runner(root, report, params["threads"], params["pytest_args"])
            seconds = time.perf_counter() - started
            load_end = load_average()
            data = json.loads(report.read_text(encoding="utf-8")) if report.exists() else None
            if data is not None:
                (folder / report.name).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
            record = {"number": number, "status": status, "seconds": round(seconds, 2),
                      "report": report.name if data is not None else None, "load": params["load"],
                      "inject": params["inject"], "neighbour_pids": pids, "load_average_start": load_start,
                      "load_average_end": load_end, "started": dt.datetime.now().astimezone().isoformat(),
                      "tail": tail}
            (folder / f"{name}{KEPT_SESSION}").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
            announce(f"{what} ends: exit {status}, {seconds:.1f} s, {_medians(data)}; load average "
                     f"{_loads(load_end)}")


# --------------------------------------------------------------------------- analyse: reading kept folders


@dataclass
class KeptSession:
    number: int
    status: int
    seconds: float
    report: dict[str, Any] | None
    load_average_start: list[float]
    load_average_end: list[float]
    tail: str = ""


@dataclass
class Folder:
    path: Path
    params: dict[str, Any]
    sessions: list[KeptSession]

    @property
    def load(self) -> str:
        return str(self.params.get("load", "?"))

    @property
    def inject(self) -> float:
        return float(self.params.get("inject") or 0.0)

    def reports(self) -> list[dict[str, Any] | None]:
        return [session.report for session in self.sessions]


def load_folder(path: Path) -> Folder:
    """A folder ``collect`` filled: its parameters and its sessions in the order they ran."""
    study = path / KEPT_STUDY
    if not study.is_file():
        raise SystemExit(f"compare_study.py: {path} holds no {KEPT_STUDY}: analyse reads a folder that collect "
                         f"filled (each session's report beside its {KEPT_SESSION}, and the study's {KEPT_STUDY})")
    params = json.loads(study.read_text(encoding="utf-8"))
    sessions = []
    records = [json.loads(p.read_text(encoding="utf-8")) for p in path.glob("*" + KEPT_SESSION)]
    for record in sorted(records, key=lambda r: r["number"]):
        report = path / record["report"] if record.get("report") else None
        if report is not None and not report.is_file():
            raise SystemExit(f"compare_study.py: {report} is missing: its session record names it")
        sessions.append(KeptSession(record["number"], record["status"], record["seconds"],
                                    json.loads(report.read_text(encoding="utf-8")) if report is not None else None,
                                    list(record.get("load_average_start") or []),
                                    list(record.get("load_average_end") or []), record.get("tail") or ""))
    return Folder(path, params, sessions)


# --------------------------------------------------------------------------- analyse: judging pairs


def compare_module() -> ModuleType:
    """The package's one-report comparison: ``verdict.compare``, or ``report.compare`` where it lived before issue
    40, so the rule before can be studied on the same sessions (an archive of an earlier commit first on sys.path,
    as benchmarks/RESULTS.md's issue 40 section did)."""
    for name in ("pytest_transformers_opt.verdict.compare", "pytest_transformers_opt.report.compare"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise
    raise SystemExit("compare_study.py: no pytest_transformers_opt.verdict.compare or .report.compare")


def judge(old: dict[str, Any], new: dict[str, Any], compare_fail: str) -> dict[str, dict[str, Any]]:
    """The rule under study: the verdict of every test of ``new`` against ``old``, as ``--opt-compare=old.json
    --opt-compare-fail=COMPARE_FAIL`` judges it. Repoint this one call to study another rule."""
    compare = compare_module()
    verdicts: dict[str, dict[str, Any]] = compare.compare_reports(old, new, compare.parse_compare_fail(compare_fail))
    return verdicts


Judge = Callable[[dict[str, Any], dict[str, Any], str], dict[str, dict[str, Any]]]


def scaled(report: dict[str, Any], pct: float) -> dict[str, Any]:
    """A copy of ``report`` with every test's optimized latency, its rounds and their median, ``pct`` percent
    higher: a simulated slowdown."""
    factor = 1.0 + pct / 100.0
    copied = copy.deepcopy(report)
    for test in copied.get("tests") or []:
        side = test.get("optimized")
        if not isinstance(side, dict):
            continue
        if isinstance(side.get("latency_s"), (int, float)):
            side["latency_s"] *= factor
        if isinstance(side.get("latency_samples_s"), list):
            side["latency_samples_s"] = [v * factor if isinstance(v, (int, float)) else v
                                         for v in side["latency_samples_s"]]
    return copied


def short(nodeid: str) -> str:
    return nodeid.rsplit("::", 1)[-1]


def _latency(report: dict[str, Any], nodeid: str) -> float | None:
    test = next((t for t in report.get("tests") or [] if t.get("nodeid") == nodeid), None)
    value = ((test or {}).get("optimized") or {}).get("latency_s")
    return float(value) if isinstance(value, (int, float)) else None


@dataclass
class Tally:
    """The verdicts of one (load, effect) over its pairs: per test, and in all."""

    load: str
    effect: str
    pairs: int = 0
    failed_runs: int = 0  # pairs in which any test regressed: the run would fail
    skipped_pairs: int = 0  # pairs with a session that wrote no report
    verdicts: dict[str, dict[str, int]] = field(default_factory=dict)  # test -> verdict -> count
    changes: dict[str, list[float]] = field(default_factory=dict)  # test -> latency change, percent
    detectable: dict[str, list[float]] = field(default_factory=dict)  # test -> the rule's detectable size

    def add(self, old: dict[str, Any], new: dict[str, Any], verdicts: dict[str, dict[str, Any]],
            metric: str) -> None:
        self.pairs += 1
        self.failed_runs += any(v.get("verdict") == "regressed" for v in verdicts.values())
        for nodeid, verdict in verdicts.items():
            test = short(nodeid)
            words = self.verdicts.setdefault(test, {})
            word = str(verdict.get("verdict"))
            words[word] = words.get(word, 0) + 1
            before, after = _latency(old, nodeid), _latency(new, nodeid)
            if before and after is not None:
                self.changes.setdefault(test, []).append(100.0 * (after / before - 1.0))
            for record in verdict.get("judged") or []:
                size = record.get("detectable") if isinstance(record, dict) else None
                if isinstance(size, (int, float)) and record.get("metric") == metric:
                    self.detectable.setdefault(test, []).append(float(size))


def effect_label(old: Folder, new: Folder, scale: float | None) -> str:
    """``null``, ``injected +25%``, ``simulated +10%``, or both."""
    if old.inject == new.inject:
        label = "null" if not old.inject else f"null (both injected +{old.inject:g}%)"
    elif not old.inject:
        label = f"injected +{new.inject:g}%"
    else:
        label = f"injected +{old.inject:g}% -> +{new.inject:g}%"
    if scale is None:
        return label
    simulated = f"simulated {scale:+g}%"
    return simulated if label == "null" else f"{label}, {simulated}"


def pairs(old: Folder, new: Folder | None) -> list[tuple[dict[str, Any] | None, dict[str, Any] | None]]:
    """One folder: each session against the one before it; two: session i of ``old`` against session i of ``new``."""
    if new is None:
        reports = old.reports()
        return list(zip(reports, reports[1:]))
    return list(zip(old.reports(), new.reports()))


def analyse(old: Folder, new: Folder | None, compare_fail: str, scales: Sequence[float] = (),
            judge: Judge = judge) -> list[Tally]:
    """A tally per effect: the pairs as they are, then each ``--scale``; detectable sizes of the first term's metric."""
    metric = compare_fail.split(":", 1)[0].strip()
    target = new if new is not None else old
    load = old.load if new is None or new.load == old.load else f"{old.load} -> {new.load}"
    tallies = []
    for scale in (None, *scales):
        tally = Tally(load, effect_label(old, target, scale))
        for before, after in pairs(old, new):
            if before is None or after is None:
                tally.skipped_pairs += 1
                continue
            after = scaled(after, scale) if scale else after
            tally.add(before, after, judge(before, after, compare_fail), metric)
        tallies.append(tally)
    return tallies


# --------------------------------------------------------------------------- analyse: spreads


@dataclass
class Spread:
    test: str
    sessions: int
    median_latency: float  # seconds: the median over sessions of the optimized median latency
    between_pct: float  # robust spread of the sessions' medians, percent of their median
    within_pct: float  # median over sessions of the rounds' robust spread, percent of that session's median
    rounds: float  # median timed rounds per session
    speedup_between_pct: float  # robust spread of the sessions' in-session speedups (baseline / optimized), percent

    @property
    def median_se_pct(self) -> float:
        """What the within-run spread alone would make two runs' medians differ by: the standard error of a median
        of ``rounds`` values (sqrt(pi / 2 / n) times the spread, for normal values). An estimate."""
        return self.within_pct * math.sqrt(math.pi / (2.0 * self.rounds)) if self.rounds else math.nan

    @property
    def between_term_pct(self) -> float:
        """The between-run spread the rounds do not explain: sqrt(between^2 - median_se^2), 0 when they do. An
        estimate."""
        if math.isnan(self.between_pct) or math.isnan(self.median_se_pct):
            return math.nan
        return math.sqrt(max(0.0, self.between_pct ** 2 - self.median_se_pct ** 2))


def spreads(folder: Folder) -> list[Spread]:
    """Per test, over the folder's sessions: the between-run and the within-run spread of the optimized latency."""
    from pytest_transformers_opt.verdict.stats import robust_spread

    medians: dict[str, list[float]] = {}
    speedups: dict[str, list[float]] = {}
    within: dict[str, list[float]] = {}
    rounds: dict[str, list[int]] = {}
    for report in folder.reports():
        for test in (report or {}).get("tests") or []:
            side = test.get("optimized") or {}
            latency, samples = side.get("latency_s"), side.get("latency_samples_s") or []
            if not isinstance(latency, (int, float)) or latency <= 0:
                continue
            name = short(test["nodeid"])
            medians.setdefault(name, []).append(float(latency))
            if isinstance(test.get("speedup"), (int, float)) and test["speedup"] > 0:
                speedups.setdefault(name, []).append(float(test["speedup"]))
            if len(samples) >= 2:
                center, spread = robust_spread([float(v) for v in samples])
                within.setdefault(name, []).append(100.0 * spread / center)
                rounds.setdefault(name, []).append(len(samples))

    def share(values: Sequence[float]) -> float:
        if len(values) < 2:
            return math.nan
        center, spread = robust_spread(values)
        return 100.0 * spread / center

    return [Spread(name, len(values), statistics.median(values), share(values),
                   statistics.median(within[name]) if within.get(name) else math.nan,
                   statistics.median(rounds[name]) if rounds.get(name) else 0, share(speedups.get(name) or []))
            for name, values in medians.items()]


# --------------------------------------------------------------------------- analyse: tables


def _rate(count: int, total: int) -> str:
    return f"{count}/{total} ({100.0 * count / total:.0f}%)" if total else "-"


def _pct(value: float) -> str:
    return f"{value:+.1f}%"


def verdict_table(tallies: Sequence[Tally], compare_fail: str) -> list[str]:
    threshold = compare_module().parse_compare_fail(compare_fail)[0]
    size_text = compare_module().size_text
    others = sorted({word for t in tallies for words in t.verdicts.values() for word in words} - set(VERDICT_ORDER))
    words = [*VERDICT_ORDER, *others]
    lines = [f"| load | effect | test | pairs | {' | '.join(words)} | regressed rate | runs failed (any test "
             "regressed) | latency change, median (min to max) | detectable, median |",
             "| --- " * (len(words) + 8) + "|"]
    for tally in tallies:
        tests = sorted(tally.verdicts)
        for test in ["all tests", *tests]:
            mine = tests if test == "all tests" else [test]
            counts = {word: sum(tally.verdicts[t].get(word, 0) for t in mine) for word in words}
            judged = sum(counts.values())
            changes = [c for t in mine for c in tally.changes.get(t, [])]
            sizes = [s for t in mine for s in tally.detectable.get(t, [])]
            detectable = (size_text(threshold, statistics.median(sizes)) if sizes and math.isfinite(statistics.median(sizes))
                          else "inf" if sizes else "-")
            lines.append(f"| {tally.load} | {tally.effect} | {test} | {tally.pairs} | "
                         + " | ".join(str(counts[word]) for word in words)
                         + f" | {_rate(counts['regressed'], judged)} | "
                         + (_rate(tally.failed_runs, tally.pairs) if test == "all tests" else "")
                         + f" | {_spread(changes, _pct)} | {detectable} |")
    skipped = [f"{t.load}, {t.effect}: {t.skipped_pairs}" for t in tallies if t.skipped_pairs]
    if skipped:
        lines += ["", "Pairs left out (a session wrote no report): " + "; ".join(skipped)]
    return lines


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}%"


def spread_table(folders: Sequence[Folder]) -> list[str]:
    lines = ["| folder | load | inject | test | sessions | rounds, median | optimized latency, median | between-run "
             "spread | within-run spread, median | within-run spread of a median (estimate) | between-run term "
             "(estimate) | in-session speedup, between-run spread |", "| --- " * 12 + "|"]
    for folder in folders:
        for spread in spreads(folder):
            lines.append(f"| {folder.path.name} | {folder.load} | {folder.inject:g}% | {spread.test} | "
                         f"{spread.sessions} | {spread.rounds:g} | {1000 * spread.median_latency:.2f} ms | "
                         f"{_share(spread.between_pct)} | {_share(spread.within_pct)} | "
                         f"{_share(spread.median_se_pct)} | {_share(spread.between_term_pct)} | "
                         f"{_share(spread.speedup_between_pct)} |")
    return lines


def folder_lines(folder: Folder) -> list[str]:
    """What the folder's sessions were: parameters, exit statuses, wall times, load averages."""
    params, sessions = folder.params, folder.sessions
    failed = [f"{s.number} (exit {s.status})" for s in sessions if s.status != 0]
    threads = sorted({str(((s.report or {}).get("environment") or {}).get("cpu_threads")) for s in sessions
                      if s.report})
    starts = [s.load_average_start[0] for s in sessions if s.load_average_start]
    ends = [s.load_average_end[0] for s in sessions if s.load_average_end]

    def load(values: Sequence[float]) -> str:
        return _spread(values, lambda v: f"{v:.2f}")

    return [f"- `{folder.path}`: {len(sessions)} session{'s' if len(sessions) != 1 else ''}, load `{folder.load}` "
            f"({LOADS.get(folder.load, '?')} busy neighbour(s)), optimized side +{folder.inject:g}%; models "
            f"{', '.join(params.get('models') or [])}, techniques {', '.join(params.get('techniques') or [])}, "
            f"max_new_tokens {params.get('max_new_tokens')}, pytest arguments "
            f"`{shlex.join(params.get('pytest_args') or []) or '(none)'}`, CPU threads {', '.join(threads) or '?'}; "
            f"wall time per session {_spread([s.seconds for s in sessions], lambda v: f'{v:.1f} s')}; 1-minute "
            f"load average at the start {load(starts)}, at the end {load(ends)}"
            + (f"; non-zero exits: {', '.join(failed)}" if failed else ""),
            "  - 1-minute load average per session, start -> end: " + "; ".join(
                f"{s.number}: {s.load_average_start[0]:.2f} -> {s.load_average_end[0]:.2f}" for s in sessions
                if s.load_average_start and s.load_average_end)]


def analysis_text(command: str, old: Folder, new: Folder | None, compare_fail: str, scales: Sequence[float],
                  judge: Judge = judge) -> str:
    folders = [old] if new is None else [old, new]
    pairing = ("each session against the one before it" if new is None else
               f"session i of `{old.path.name}` (old) against session i of `{new.path.name}` (new)")
    lines = [f"    {command}", "", *[line for folder in folders for line in folder_lines(folder)], "",
             f"Verdicts of `--opt-compare-fail={compare_fail}` ({pairing}); \"simulated\": the new report's "
             "optimized latency rounds and median scaled up:", "",
             *verdict_table(analyse(old, new, compare_fail, scales, judge), compare_fail), "",
             "Spreads of the optimized latency, in percent of the median: between-run, the robust spread "
             "(1.4826 MAD) of the sessions' medians; within-run, the median over sessions of the rounds' robust "
             "spread; the within-run spread of a median, sqrt(pi/2/rounds) times that (an estimate); the "
             "between-run term, sqrt(between^2 - that^2) (an estimate); and the between-run spread of the in-session "
             "speedup (baseline / optimized, rounds taken in turn), which a machine slower for a whole session moves "
             "less:", "", *spread_table(folders)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def command_line(argv: Sequence[str]) -> str:
    python = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable
    return shlex.join([python, "benchmarks/compare_study.py", *argv])


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    collecting = modes.add_parser("collect", help="run sessions and keep their reports in DIR",
                                  usage="%(prog)s DIR [options] [-- PYTEST_ARGS]")
    collecting.add_argument("folder", type=Path, metavar="DIR")
    collecting.add_argument("--sessions", type=int, default=20)
    collecting.add_argument("--load", choices=list(LOADS), default="quiet",
                            help="busy neighbour processes during each session: quiet 0, busy1 1, busy2 2")
    collecting.add_argument("--inject", type=float, default=0.0, metavar="PCT",
                            help="the optimized side PCT%% slower (each forward busy-waits PCT/100 of its time)")
    collecting.add_argument("--model", default=MODEL, help="comma-separated models (smollm2: smollm2-135m)")
    collecting.add_argument("--techniques", default=",".join(TECHNIQUES), help="comma-separated, one test each")
    collecting.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    collecting.add_argument("--threads", default="1", help="--opt-cpu-threads of every session: N or auto")
    collecting.add_argument("--add", action="store_true", help="add sessions to a DIR an earlier collect filled")
    analysing = modes.add_parser("analyse", help="judge the kept reports and tabulate")
    analysing.add_argument("folder", type=Path, metavar="DIR")
    analysing.add_argument("second", type=Path, nargs="?", default=None, metavar="DIR2",
                           help="new reports from here, old from DIR")
    analysing.add_argument("--compare-fail", default=COMPARE_FAIL)
    analysing.add_argument("--scale", type=float, action="append", default=[], metavar="PCT",
                           help="also each pair with the new optimized latency PCT%% higher (repeatable)")
    analysing.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    # argparse's subcommands do not pass "--" on: what follows it is pytest's, split off here
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.pytest_args = list(argv[cut + 1:])
    if args.pytest_args and args.mode != "collect":
        parser.error(f"pytest arguments after -- ({shlex.join(args.pytest_args)}) are for collect only")
    if args.mode == "collect":
        if args.sessions < 1:
            parser.error(f"--sessions {args.sessions}: give at least 1")
        if not 0 <= args.inject <= 1000:
            parser.error(f"--inject {args.inject:g}: give a percent from 0 to 1000")
    else:
        from pytest_transformers_opt.errors import OptConfigError

        try:  # a clear error before any work
            compare_module().parse_compare_fail(args.compare_fail, "--compare-fail")
        except OptConfigError as error:
            parser.error(str(error))
        if any(not -100 < pct <= 1000 for pct in args.scale):
            parser.error("--scale: give percents above -100 and at most 1000")
    return args


def study_params(args: argparse.Namespace, command: str) -> dict[str, Any]:
    return {"command": command, "load": args.load, "inject": args.inject,
            "models": [model_name(m) for m in _split(args.model)], "techniques": _split(args.techniques),
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, "pytest_args": list(args.pytest_args),
            "python": sys.executable, "cpus": os.cpu_count()}


SAME_STUDY = ("load", "inject", "models", "techniques", "max_new_tokens", "threads", "pytest_args")


def main(argv: Sequence[str] | None = None, runner: SessionRunner = run_session, judge: Judge = judge) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = command_line(argv)
    if args.mode == "collect":
        params = study_params(args, command)
        study = args.folder / KEPT_STUDY
        if study.exists():
            if not args.add:
                raise SystemExit(f"compare_study.py: {args.folder} holds an earlier collect's sessions ({KEPT_STUDY}): "
                                 "give an empty folder, or --add to add sessions to it")
            earlier = json.loads(study.read_text(encoding="utf-8"))
            differ = [f"{key} {earlier.get(key)!r} -> {params[key]!r}" for key in SAME_STUDY
                      if earlier.get(key) != params[key]]
            if differ:
                raise SystemExit(f"compare_study.py: --add: {args.folder} was collected with other parameters "
                                 f"({'; '.join(differ)}): give the same, or another folder")
        else:
            args.folder.mkdir(parents=True, exist_ok=True)
            study.write_text(json.dumps(params, indent=1) + "\n", encoding="utf-8")
        collect(args.folder, params, args.sessions, runner)
        return 0
    old = load_folder(args.folder)
    new = load_folder(args.second) if args.second is not None else None
    text = analysis_text(command, old, new, args.compare_fail, args.scale, judge)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
