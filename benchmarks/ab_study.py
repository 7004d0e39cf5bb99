"""A/B study (issue 20): can ``--opt-ab``'s verdict be trusted on this machine?

Every session is a real pytest run of a small user project (one test per technique, one model) with
``--opt-ab=<reference python> --opt-ab-fail=<threshold> --opt-report-json=...``; the verdicts are read from
the JSON report, each test's ``ab`` record (``verdict``, ``figures``).

Default mode, three scenarios of ``--runs`` sessions each, taken in turn so that the machine's drift falls on
all three:

* ``null``: the reference is a wrapper script that execs this same interpreter, so both sides run the same
  stack: a test judged ``regressed`` is a false regression (goal: at most 1 of 20 sessions with any);
* ``slowed candidate``: the pytest session (the candidate) runs with a folder on its PYTHONPATH whose
  ``sitecustomize.py`` busy-waits ``--slowdown`` percent of each top-level transformers model call (the
  model's forward) after it returns; the reference worker does not see it (its environment drops PYTHONPATH): every
  test should be ``regressed`` (goal: 19 of 20 sessions);
* ``slowed reference``: the wrapper puts that folder on the reference's PYTHONPATH only: every test should be
  ``improved`` (goal: 19 of 20 sessions).

    python benchmarks/ab_study.py [--runs 20] [--model tiny-random-llama] [--slowdown 10]
        [--ab-fail latency:5%] [--techniques sdpa,static_cache] [--scenarios null,slowed-candidate,slowed-reference]
        [--keep DIR] [--out FILE] [-- PYTEST_ARGS]

``--keep DIR`` keeps every session's JSON report with its exit status and wall time, and the study's parameters;
``--reanalyse --keep DIR`` prints the table of those sessions again without running any (a 20-session study takes
hours):

    python benchmarks/ab_study.py --reanalyse --keep DIR [--out FILE]

``--cost`` measures what the A/B costs instead: each test's wall time in sessions without and with ``--opt-ab``
(a reference that is this same interpreter), in turn (goal: at most 1.6x):

    python benchmarks/ab_study.py --cost [--runs 3] [--model tiny-random-llama] [-- PYTEST_ARGS]

``--pair`` measures one real pair instead: the reference is another environment's interpreter (default
``.venv-kernels/bin/python``: transformers 5.22, built by ``scripts/kernels_env.sh``) against this one, on
``smollm2-135m`` for sdpa, static_cache and compile; every figure with its 95% interval and p-value:

    python benchmarks/ab_study.py --pair [--reference PYTHON] [--model smollm2-135m]
        [--techniques sdpa,static_cache,compile] [--runs 1] [--out FILE] [-- PYTEST_ARGS]

Both print a Markdown table for benchmarks/RESULTS.md, headed by the exact command line. The study's table also
shows its sessions judged again by the rule before pairs (Mann-Whitney on unpaired rounds), from the same reports:
the two rules compared on the same rounds, the machine's drift between sessions out of the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
TEST_FILE = "test_ab_study.py"
KERNELS_PYTHON = ROOT / ".venv-kernels" / "bin" / "python"

STUDY_AB_FAIL = "latency:5%"
PAIR_AB_FAIL = "latency:5%,peak_memory:5%,kl_mean:0.01"  # the dependency-ab workflow's
STUDY_TECHNIQUES = ("sdpa", "static_cache")
PAIR_TECHNIQUES = ("sdpa", "static_cache", "compile")

JUDGED = ("regressed", "improved", "ok")  # the other verdict, "not judged": a side without a measurement
# scenario -> the verdict every test should get in it
SCENARIOS: dict[str, str] = {"null": "ok", "slowed candidate": "regressed", "slowed reference": "improved"}

# The slow-down, as a sitecustomize: Python imports it at start-up from the first folder on sys.path that has
# one, so it acts in exactly the processes that have its folder on their PYTHONPATH. It patches transformers when
# transformers.modeling_utils is first imported (an import hook), so a process that never imports it pays nothing.
# It wraps PreTrainedModel's call only, not torch's Module: a wrapper on every module's call (each Linear, each
# norm) cost the tiny model's generate +9.6% in-process with nothing busy-waited (RESULTS, issue 20), so a
# "10%" slow-down there was +30-50%; a model's call is a handful per token.
SLOWDOWN_SITECUSTOMIZE = '''\
"""Written by benchmarks/ab_study.py: this environment, @PCT@% slower. Every top-level transformers model call (a
model's forward, not the models or layers inside it) busy-waits @PCT@% of its own time after it returns, outside
torch.compile's graphs."""
import sys
import threading
import time

FACTOR = @FACTOR@
_state = threading.local()


def _slow_down(model_class, module_call):
    def slowed(self, *args, **kwargs):
        if getattr(_state, "inside", False) or sys.modules["torch"].compiler.is_compiling():
            return module_call(self, *args, **kwargs)
        _state.inside = True
        started = time.perf_counter()
        try:
            return module_call(self, *args, **kwargs)
        finally:
            _state.inside = False
            until = time.perf_counter() + (time.perf_counter() - started) * FACTOR
            while time.perf_counter() < until:
                pass

    model_class.__call__ = slowed


def _patch(modeling_utils):
    _slow_down(modeling_utils.PreTrainedModel, sys.modules["torch"].nn.Module.__call__)


class _PatchOnImport:
    """On the import of transformers.modeling_utils: load it as usual, then slow its PreTrainedModel down."""

    target = "transformers.modeling_utils"

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if _PatchOnImport.target in sys.modules:
    _patch(sys.modules[_PatchOnImport.target])
else:
    sys.meta_path.insert(0, _PatchOnImport())
'''


def write_slowdown(folder: Path, pct: float) -> Path:
    """A folder holding only the slow-down ``sitecustomize.py`` (``pct`` percent of each top-level forward)."""
    folder.mkdir(parents=True, exist_ok=True)
    source = SLOWDOWN_SITECUSTOMIZE.replace("@FACTOR@", repr(pct / 100.0)).replace("@PCT@", f"{pct:g}")
    (folder / "sitecustomize.py").write_text(source, encoding="utf-8")
    return folder


def write_wrapper(path: Path, python: str, pythonpath: Path | None = None) -> Path:
    """An executable script that execs ``python`` with its arguments (same process: stdin, stdout and signals
    stay the worker's); with ``pythonpath``, that folder goes first on PYTHONPATH, before what the caller set
    (the A/B worker's own package folder)."""
    lines = ["#!/bin/sh"]
    if pythonpath is not None:
        lines += [f"PYTHONPATH={shlex.quote(str(pythonpath))}${{PYTHONPATH:+:$PYTHONPATH}}", "export PYTHONPATH"]
    lines.append(f'exec {shlex.quote(python)} "$@"')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    path.chmod(0o755)
    return path


def case_name(technique: str) -> str:
    """The test function of one technique: ``test_static_cache``."""
    return "test_" + re.sub(r"\W", "_", technique)


def project_source(model: str, techniques: Sequence[str], max_new_tokens: int) -> str:
    """The user project: one test per technique on ``model``, the default prompts."""
    tests = "".join(f"\n\n@pytest.mark.optimization({technique!r})\ndef {case_name(technique)}(opt_bench):\n"
                    f"    opt_bench(max_new_tokens={max_new_tokens})\n" for technique in techniques)
    return f"import pytest\n\npytestmark = pytest.mark.opt_model({model!r})\n{tests}"


# --------------------------------------------------------------------------- reading the reports


@dataclass
class ABRow:
    """One test's A/B record, as the study reads it."""

    test: str
    outcome: str
    verdict: str | None  # None: no A/B record (skipped, error); "not judged": a side without a measurement
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)
    similarity: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    why: str = ""  # a skip reason or the error's first line
    gate: dict[str, Any] = field(default_factory=dict)  # the gate's judged latency record: its rule and p-value
    unpaired_verdict: str | None = None  # the same record judged by Mann-Whitney on unpaired rounds
    rounds: int | None = None  # the candidate's timed rounds (sequential rounds: as many as the verdicts needed)
    ab_open_at_cap: bool = False  # sequential rounds reached the A/B cap with a verdict still open

    def change(self, metric: str = "latency") -> float | None:
        return (self.figures.get(metric) or {}).get("change_pct")

    def p_value(self, metric: str = "latency") -> float | None:
        return (self.figures.get(metric) or {}).get("p_value")


def ab_rows(report: dict[str, Any], ab_fail: str | None = None) -> list[ABRow]:
    """Every test row of a JSON report with its ``ab`` record (``verdict``, ``figures``, ``similarity``, ``note``);
    with ``ab_fail``, each judged record judged again on unpaired rounds (Mann-Whitney, the rule before pairs)."""
    from pytest_transformers_opt.verdict.ab import judge_ab
    from pytest_transformers_opt.verdict.compare import parse_compare_fail

    thresholds = parse_compare_fail(ab_fail, "--ab-fail") if ab_fail else []
    rows = []
    for test in report.get("tests", []):
        ab = test.get("ab") or {}
        why = (test.get("skip_reason") or next(iter(str(test.get("error") or "").strip().splitlines()), "")
               or ("; ".join(map(str, ab.get("details") or [])) if ab.get("verdict") not in JUDGED else ""))
        gate = next((record for record in ab.get("judged") or [] if record.get("metric") == "latency"), {})
        unpaired = (judge_ab(test, ab, thresholds, paired=False)["verdict"]
                    if thresholds and ab.get("verdict") in JUDGED else None)
        sequential = (test.get("rounds_decision") or {}).get("ab") or {}
        rows.append(ABRow(test=test["nodeid"].rsplit("::", 1)[-1], outcome=test.get("outcome", "?"),
                          verdict=ab.get("verdict"), figures=ab.get("figures") or {},
                          similarity=ab.get("similarity") or {}, note=ab.get("note"), why=why, gate=gate,
                          unpaired_verdict=unpaired, rounds=(test.get("optimized") or {}).get("rounds"),
                          ab_open_at_cap=sequential.get("settled") is False))
    return rows


@dataclass
class Session:
    scenario: str
    status: int  # pytest's exit status: 1 when --opt-ab-fail found a regression
    rows: list[ABRow]
    seconds: float
    ab: dict[str, Any] = field(default_factory=dict)  # the report's top-level "ab" (stacks, what differs)
    tail: str = ""  # the end of pytest's output, for a session without a report

    @property
    def verdicts(self) -> list[str | None]:
        return [row.verdict for row in self.rows]

    def all_are(self, verdict: str) -> bool:
        return bool(self.rows) and all(v == verdict for v in self.verdicts)

    def any_is(self, verdict: str) -> bool:
        return verdict in self.verdicts

    def unpaired(self) -> "Session":
        """This session as the unpaired rule judged it (rows without that verdict keep theirs)."""
        rows = [ABRow(row.test, row.outcome, row.unpaired_verdict or row.verdict) for row in self.rows]
        return Session(self.scenario, self.status, rows, self.seconds)


@dataclass
class Tally:
    scenario: str
    sessions: int
    as_expected: int  # sessions in which every test got the scenario's verdict
    any_regressed: int
    any_improved: int
    exit_1: int
    other_exit: int
    not_judged: int  # tests without a verdict
    identical_stacks: int  # sessions whose every A/B record says "identical stacks"
    changes: list[float]  # latency change_pct of every judged test
    p_values: list[float]  # the gate's latency p-value of every judged test
    rules: list[str]  # the rule that judged each
    rounds: list[int]  # the timed rounds of every judged test
    open_at_cap: int  # tests whose A/B verdict was still open at the sequential cap
    seconds: float
    problems: list[str]


def tally(sessions: Sequence[Session], scenario: str) -> Tally:
    """What the sessions of one scenario show against what it should show (``SCENARIOS``)."""
    mine = [s for s in sessions if s.scenario == scenario]
    rows = [row for s in mine for row in s.rows]
    problems = sorted({f"{row.test}: {row.verdict or row.outcome}{': ' + row.why if row.why else ''}"
                       for row in rows if row.verdict not in JUDGED})
    problems += [f"session without a report (exit {s.status}): {s.tail.strip().splitlines()[-1] if s.tail.strip() else ''}"
                 for s in mine if not s.rows]
    return Tally(
        scenario=scenario, sessions=len(mine), as_expected=sum(s.all_are(SCENARIOS[scenario]) for s in mine),
        any_regressed=sum(s.any_is("regressed") for s in mine), any_improved=sum(s.any_is("improved") for s in mine),
        exit_1=sum(s.status == 1 for s in mine), other_exit=sum(s.status not in (0, 1) for s in mine),
        not_judged=sum(row.verdict not in JUDGED for row in rows),
        identical_stacks=sum(bool(s.rows) and all(row.note == "identical stacks" for row in s.rows) for s in mine),
        changes=[c for row in rows if (c := row.change()) is not None],
        p_values=[p for row in rows if (p := row.gate.get("p_value")) is not None],
        rules=sorted({str(row.gate["rule"]) for row in rows if row.gate.get("rule")}),
        rounds=[row.rounds for row in rows if row.verdict in JUDGED and row.rounds is not None],
        open_at_cap=sum(row.ab_open_at_cap for row in rows),
        seconds=sum(s.seconds for s in mine), problems=problems)


def _spread(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    if not values:
        return "-"
    return f"{fmt(statistics.median(values))} ({fmt(min(values))} to {fmt(max(values))})"


def study_table(sessions: Sequence[Session], *, command: str, model: str, techniques: Sequence[str],
                slowdown: float, ab_fail: str) -> str:
    wall = sum(s.seconds for s in sessions)
    lines = [f"    {command}", "",
             f"{model}, tests: {', '.join(techniques)}; --opt-ab-fail={ab_fail}; slowed side: +{slowdown:g}% of each "
             f"forward (busy-wait); {len(sessions)} sessions, {wall:.0f} s", "",
             "| scenario | sessions | every test as expected | any `regressed` | any `improved` | exit 1 | other exit | "
             "tests not judged | identical stacks noted | latency change, median (min to max) | gate's p, median (min "
             "to max) | rule | timed rounds per test, median (min to max) | open at the cap |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    earlier = ["", "The same sessions, each A/B record judged again by the rule before pairs (one-sided Mann-Whitney "
               "of the candidate's rounds against the reference's moved by the limit, unpaired):", "",
               "| scenario | sessions | every test as expected | any `regressed` | any `improved` |",
               "| --- | --- | --- | --- | --- |"]
    problems: list[str] = []
    for scenario, expected in SCENARIOS.items():
        t = tally(sessions, scenario)
        if not t.sessions:
            continue
        lines.append(f"| {scenario} | {t.sessions} | {t.as_expected} (`{expected}`) | {t.any_regressed} | "
                     f"{t.any_improved} | {t.exit_1} | {t.other_exit} | {t.not_judged} | {t.identical_stacks} | "
                     f"{_spread(t.changes, lambda v: f'{v:+.1f}%')} | {_spread(t.p_values, lambda v: f'{v:.2g}')} | "
                     f"{', '.join(t.rules) or '-'} | {_spread(t.rounds, lambda v: f'{v:.0f}')} | {t.open_at_cap} |")
        problems += [f"{scenario}: {p}" for p in t.problems]
        u = tally([s.unpaired() for s in sessions], scenario)
        earlier.append(f"| {scenario} | {u.sessions} | {u.as_expected} (`{expected}`) | {u.any_regressed} | "
                       f"{u.any_improved} |")
    if any(row.unpaired_verdict for s in sessions for row in s.rows):
        lines += earlier
    if problems:
        lines += ["", "Not judged:", *(f"- {p}" for p in problems)]
    return "\n".join(lines)


def _fmt_figure(metric: str, value: Any) -> str:
    from pytest_transformers_opt.verdict.compare import METRICS

    if not isinstance(value, (int, float)):
        return "-"
    return METRICS[metric].fmt(value) if metric in METRICS else f"{value:.4g}"


def _fmt_change(figure: dict[str, Any]) -> str:
    change = figure.get("change_pct")
    if change is None:
        return "-"
    interval = figure.get("interval_pct")
    return f"{change:+.1f}%" + (f" [{interval[0]:+.1f}%, {interval[1]:+.1f}%]" if interval else " [no interval]")


def _stack(side: dict[str, Any]) -> str:
    versions = side.get("versions") or {}
    shown = ", ".join(f"{name} {version}" for name, version in versions.items() if version)
    return f"{side.get('python', '?')} ({shown})"


def pair_table(sessions: Sequence[Session], *, command: str, model: str) -> str:
    lines = [f"    {command}", ""]
    ab = next((s.ab for s in sessions if s.ab), {})
    if ab:
        lines += [f"candidate: {_stack(ab.get('candidate') or {})}", "",
                  f"reference: {_stack(ab.get('reference') or {})}", "",
                  "differs: " + ("; ".join(f"{name} {' vs '.join(map(str, sides))}"
                                           for name, sides in (ab.get("differs") or {}).items()) or "nothing"), ""]
    lines += [f"{model}; {len(sessions)} session(s), {sum(s.seconds for s in sessions):.0f} s; change = candidate vs "
              "reference, [95% interval]", "",
              "| session | test | verdict | figure | candidate | reference | change [95% interval] | p | says |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for number, session in enumerate(sessions, 1):
        for row in session.rows:
            if not row.figures:
                lines.append(f"| {number} | {row.test} | {row.outcome} | - | - | - | - | - | {row.why[:100]} |")
                continue
            for metric, figure in row.figures.items():
                p = figure.get("p_value")
                lines.append(f"| {number} | {row.test} | {row.verdict or '-'} | {metric} | "
                             f"{_fmt_figure(metric, figure.get('candidate'))} | {_fmt_figure(metric, figure.get('reference'))} | "
                             f"{_fmt_change(figure)} | {'-' if p is None else f'{p:.2g}'} | {figure.get('word') or '-'} |")
            if row.similarity:
                sim = row.similarity
                lines.append(f"| {number} | {row.test} | {row.verdict or '-'} | similarity | KL mean "
                             f"{_fmt_figure('kl_mean', sim.get('kl_mean'))}, top-1 {_fmt_figure('top1', sim.get('top1'))} | "
                             f"| | | {sim.get('note') or ''} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- running sessions


def session_command(reference: str, ab_fail: str, report: Path, extra_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-W", "ignore",
            "--opt-budgets=off", f"--opt-ab={reference}", f"--opt-ab-fail={ab_fail}", f"--opt-report-json={report}",
            *extra_args, TEST_FILE]


def session_env(candidate_pythonpath: Path | None) -> dict[str, str]:
    # one torch thread unless told otherwise, as in verdict_study.py: on 2 shared cores spinning threads turn a
    # busy neighbour into rounds 10x slower. The CI's step summary is not the study's to write.
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    env.pop("GITHUB_STEP_SUMMARY", None)
    if candidate_pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(candidate_pythonpath), env.get("PYTHONPATH")) if p)
    return env


SessionRunner = Callable[..., "tuple[int, dict[str, Any] | None, str]"]  # run_session's shape


def run_session(root: Path, *, reference: str, ab_fail: str, report: Path, extra_args: Sequence[str],
                candidate_pythonpath: Path | None = None) -> tuple[int, dict[str, Any] | None, str]:
    """One pytest session of the project in ``root``: (exit status, the JSON report or None, output's end)."""
    report.unlink(missing_ok=True)
    done = subprocess.run(session_command(reference, ab_fail, report, extra_args), cwd=root, check=False,
                          env=session_env(candidate_pythonpath), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    data = json.loads(report.read_text(encoding="utf-8")) if report.exists() else None
    return done.returncode, data, done.stdout[-3000:]


def _session(scenario: str, runner: SessionRunner, root: Path, report: Path, keep: Path | None,
             **kwargs: Any) -> Session:
    started = time.perf_counter()
    status, data, tail = runner(root, report=report, **kwargs)
    session = Session(scenario, status, ab_rows(data, kwargs.get("ab_fail")) if data else [],
                      time.perf_counter() - started, (data or {}).get("ab") or {}, tail)
    if keep is not None:
        _keep_session(keep, session, report if report.exists() else None)
    return session


# --------------------------------------------------------------------------- kept sessions, tabulated again

KEPT_STUDY = "study.json"  # what the study was: the command and the table's parameters (written by main)
KEPT_SESSION = ".session.json"  # beside each kept report: what the report does not hold (exit status, wall time)


def _keep_session(keep: Path, session: Session, report: Path | None) -> None:
    keep.mkdir(parents=True, exist_ok=True)
    number = len(list(keep.glob("*" + KEPT_SESSION))) + 1
    stem = report.stem if report is not None else f"{session.scenario.replace(' ', '-')}-no-report-{number:02d}"
    if report is not None:
        shutil.copyfile(report, keep / report.name)
    record = {"number": number, "scenario": session.scenario, "status": session.status, "seconds": session.seconds,
              "tail": session.tail, "report": report.name if report is not None else None}
    (keep / (stem + KEPT_SESSION)).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def load_kept(folder: Path) -> tuple[dict[str, Any], list[Session]]:
    """The study's parameters and its sessions, in the order they ran, from a folder ``--keep`` wrote."""
    study = folder / KEPT_STUDY
    if not study.is_file():
        raise SystemExit(f"ab_study.py: {folder} holds no {KEPT_STUDY}: --reanalyse reads a folder that --keep "
                         f"filled (each report beside its {KEPT_SESSION}, and the study's {KEPT_STUDY})")
    params: dict[str, Any] = json.loads(study.read_text(encoding="utf-8"))
    sessions = []
    records = [json.loads(path.read_text(encoding="utf-8")) for path in folder.glob("*" + KEPT_SESSION)]
    for record in sorted(records, key=lambda r: r["number"]):
        report = folder / record["report"] if record["report"] else None
        if report is not None and not report.is_file():
            raise SystemExit(f"ab_study.py: {report} is missing: its session record names it")
        data = json.loads(report.read_text(encoding="utf-8")) if report is not None else None
        sessions.append(Session(record["scenario"], record["status"],
                                ab_rows(data, params.get("ab_fail")) if data else [], record["seconds"],
                                (data or {}).get("ab") or {}, record["tail"]))
    return params, sessions


def tabulate(params: dict[str, Any], sessions: Sequence[Session]) -> str:
    """The table of a study (or a pair) from its parameters, as main prints it after running the sessions."""
    if params["mode"] == "pair":
        return pair_table(sessions, command=params["command"], model=params["model"])
    return study_table(sessions, command=params["command"], model=params["model"], techniques=params["techniques"],
                       slowdown=params["slowdown"], ab_fail=params["ab_fail"])


def _progress(number: int, total: int, session: Session) -> None:
    verdicts = ", ".join(f"{row.test}: {row.verdict or row.outcome}" for row in session.rows) or "no report"
    print(f"[{number}/{total}] {session.scenario}: exit {session.status}, {verdicts} ({session.seconds:.0f} s)",
          file=sys.stderr, flush=True)


def run_study(*, runs: int, scenarios: Sequence[str], model: str, techniques: Sequence[str], slowdown: float,
              ab_fail: str, max_new_tokens: int, extra_args: Sequence[str], keep: Path | None = None,
              runner: SessionRunner = run_session) -> list[Session]:
    """``runs`` sessions of each scenario, the scenarios in turn."""
    sessions: list[Session] = []
    with tempfile.TemporaryDirectory(prefix="ab-study-") as folder:
        root = Path(folder)
        (root / TEST_FILE).write_text(project_source(model, techniques, max_new_tokens), encoding="utf-8")
        slow = write_slowdown(root / "slowdown", slowdown)
        same = write_wrapper(root / "reference-python", sys.executable)
        slowed = write_wrapper(root / "reference-python-slowed", sys.executable, pythonpath=slow)
        # scenario -> (the reference interpreter, the folder on the candidate's PYTHONPATH)
        setups: dict[str, tuple[Path, Path | None]] = {
            "null": (same, None), "slowed candidate": (same, slow), "slowed reference": (slowed, None)}
        for index in range(runs):
            for scenario in scenarios:
                reference, candidate_pythonpath = setups[scenario]
                report = root / f"{scenario.replace(' ', '-')}-{index + 1:02d}.json"
                session = _session(scenario, runner, root, report, keep, reference=str(reference), ab_fail=ab_fail,
                                   extra_args=extra_args, candidate_pythonpath=candidate_pythonpath)
                sessions.append(session)
                _progress(len(sessions), runs * len(scenarios), session)
    return sessions


def run_pair(*, reference: str, runs: int, model: str, techniques: Sequence[str], ab_fail: str, max_new_tokens: int,
             extra_args: Sequence[str], keep: Path | None = None, runner: SessionRunner = run_session) -> list[Session]:
    """``runs`` sessions of the real pair: this environment (candidate) against ``reference``."""
    sessions: list[Session] = []
    with tempfile.TemporaryDirectory(prefix="ab-pair-") as folder:
        root = Path(folder)
        (root / TEST_FILE).write_text(project_source(model, techniques, max_new_tokens), encoding="utf-8")
        for index in range(runs):
            session = _session("pair", runner, root, root / f"pair-{index + 1:02d}.json", keep, reference=reference,
                               ab_fail=ab_fail, extra_args=extra_args)
            sessions.append(session)
            _progress(index + 1, runs, session)
    return sessions


# --------------------------------------------------------------------------- cost: wall time with and without --opt-ab

WHOLE_SESSION = "(the whole session, process start to exit)"
_DURATION = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+\S+::(\w+)", re.MULTILINE)


def seconds_per_test(output: str) -> dict[str, float]:
    """Each test's wall time (setup + call + teardown) from pytest's ``--durations=0`` lines."""
    seconds: dict[str, float] = {}
    for value, _phase, name in _DURATION.findall(output):
        seconds[name] = seconds.get(name, 0.0) + float(value)
    return seconds


def run_cost(*, runs: int, model: str, techniques: Sequence[str], max_new_tokens: int,
             extra_args: Sequence[str]) -> list[tuple[str, dict[str, float]]]:
    """``runs`` pairs of sessions of the same project, without and with ``--opt-ab`` (a reference that is this
    same interpreter), in turn: ("without" | "with", test -> seconds) per session."""
    results: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="ab-cost-") as folder:
        root = Path(folder)
        (root / TEST_FILE).write_text(project_source(model, techniques, max_new_tokens), encoding="utf-8")
        same = write_wrapper(root / "reference-python", sys.executable)
        for index in range(runs):
            for kind in ("without", "with"):
                command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-W",
                           "ignore", "--opt-budgets=off", "--durations=0", "--durations-min=0", *extra_args, TEST_FILE]
                if kind == "with":
                    command.insert(-1, f"--opt-ab={same}")
                started = time.monotonic()
                done = subprocess.run(command, cwd=root, check=False, env=session_env(None), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
                seconds = seconds_per_test(done.stdout)
                # what no test's durations hold: the imports before the first test, the worker's launch, the reports
                seconds[WHOLE_SESSION] = time.monotonic() - started
                results.append((kind, seconds))
                print(f"[{len(results)}/{2 * runs}] {kind} --opt-ab: exit {done.returncode}, "
                      + ", ".join(f"{name} {value:.1f} s" for name, value in seconds.items()), file=sys.stderr, flush=True)
    return results


def cost_table(results: Sequence[tuple[str, dict[str, float]]], *, command: str, model: str) -> str:
    """Per test: median wall time without and with --opt-ab, and their ratio (goal: at most 1.6x)."""
    tests = sorted({name for _kind, seconds in results for name in seconds})
    lines = [f"    {command}", "", f"Model `{model}`; each test's wall time (setup + call + teardown, pytest's "
             f"`--durations`), median over {sum(1 for k, _ in results if k == 'with')} sessions each, taken in turn.", "",
             "| test | without --opt-ab | with --opt-ab | ratio |", "| --- | --- | --- | --- |"]
    for name in tests:
        without = [s[name] for k, s in results if k == "without" and name in s]
        with_ab = [s[name] for k, s in results if k == "with" and name in s]
        if without and with_ab:
            a, b = statistics.median(without), statistics.median(with_ab)
            lines.append(f"| {name} | {a:.1f} s | {b:.1f} s | {b / a:.2f}x |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def _command_line(argv: Sequence[str]) -> str:
    return shlex.join([sys.executable if not sys.executable.startswith(str(ROOT)) else
                       os.path.relpath(sys.executable, ROOT), "benchmarks/ab_study.py", *argv])


def main(argv: Sequence[str] | None = None, runner: SessionRunner = run_session) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=None, help="sessions per scenario (study: 20, pair: 1)")
    parser.add_argument("--model", default=None, help="study: tiny-random-llama; pair: smollm2-135m")
    parser.add_argument("--techniques", default=None,
                        help=f"comma-separated (study: {','.join(STUDY_TECHNIQUES)}; pair: {','.join(PAIR_TECHNIQUES)})")
    parser.add_argument("--slowdown", type=float, default=10.0, help="percent of each forward the slowed side waits")
    parser.add_argument("--ab-fail", default=None, help=f"study: {STUDY_AB_FAIL}; pair: {PAIR_AB_FAIL}".replace("%", "%%"))
    parser.add_argument("--scenarios", default="null,slowed-candidate,slowed-reference",
                        help="comma-separated: null, slowed-candidate, slowed-reference")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--pair", action="store_true", help="instead: this environment against --reference")
    parser.add_argument("--cost", action="store_true",
                        help="instead: each test's wall time without and with --opt-ab (a same-interpreter reference)")
    parser.add_argument("--reference", default=str(KERNELS_PYTHON), help="pair: the reference environment's python")
    parser.add_argument("--keep", type=Path, default=None, help="copy every session's JSON report into this folder")
    parser.add_argument("--reanalyse", action="store_true",
                        help="with --keep DIR: run no session, tabulate again the sessions an earlier run kept there")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --, e.g. -- --opt-rounds=7")
    args = parser.parse_args(argv)
    if args.reanalyse and args.keep is None:
        parser.error("--reanalyse needs --keep DIR (a folder an earlier run kept)")
    command = _command_line(argv)

    def kept(params: dict[str, Any]) -> dict[str, Any]:
        if args.keep is not None:
            if (args.keep / KEPT_STUDY).exists():  # two studies' sessions in one folder would be tabulated as one
                raise SystemExit(f"ab_study.py: --keep {args.keep} holds an earlier study's sessions ({KEPT_STUDY}): "
                                 "give an empty --keep folder, or --reanalyse")
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / KEPT_STUDY).write_text(json.dumps({"command": command, **params}, indent=1) + "\n",
                                                encoding="utf-8")
        return {"command": command, **params}

    if args.reanalyse:
        params, kept_sessions = load_kept(args.keep)
        text = (f"Tabulated again from the kept sessions (`{command}`):\n\n" + tabulate(params, kept_sessions))
    elif args.cost:
        model = args.model or "tiny-random-llama"
        results = run_cost(runs=args.runs or 3, model=model, techniques=_split(args.techniques, STUDY_TECHNIQUES),
                           max_new_tokens=args.max_new_tokens, extra_args=args.pytest_args)
        text = cost_table(results, command=command, model=model)
    elif args.pair:
        reference = Path(args.reference)
        if not (reference.is_file() and os.access(reference, os.X_OK)):
            raise SystemExit(f"ab_study.py: no reference interpreter at {reference}: build .venv-kernels with "
                             "`bash scripts/kernels_env.sh` (transformers 5.22), or name one with --reference")
        params = kept({"mode": "pair", "model": args.model or "smollm2-135m"})
        sessions = run_pair(reference=str(reference), runs=args.runs or 1, model=params["model"],
                            techniques=_split(args.techniques, PAIR_TECHNIQUES), ab_fail=args.ab_fail or PAIR_AB_FAIL,
                            max_new_tokens=args.max_new_tokens, extra_args=args.pytest_args, keep=args.keep,
                            runner=runner)
        text = tabulate(params, sessions)
    else:
        scenarios = [s.replace("-", " ") for s in _split(args.scenarios, ())]
        unknown = [s for s in scenarios if s not in SCENARIOS]
        if unknown:
            parser.error(f"unknown scenario {', '.join(unknown)}; known: null, slowed-candidate, slowed-reference")
        params = kept({"mode": "study", "model": args.model or "tiny-random-llama",
                       "techniques": _split(args.techniques, STUDY_TECHNIQUES), "slowdown": args.slowdown,
                       "ab_fail": args.ab_fail or STUDY_AB_FAIL})
        sessions = run_study(runs=args.runs or 20, scenarios=scenarios, model=params["model"],
                             techniques=params["techniques"], slowdown=args.slowdown, ab_fail=params["ab_fail"],
                             max_new_tokens=args.max_new_tokens, extra_args=args.pytest_args, keep=args.keep,
                             runner=runner)
        text = tabulate(params, sessions)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


def _split(text: str | None, default: Sequence[str]) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()] if text else list(default)


if __name__ == "__main__":
    raise SystemExit(main())
