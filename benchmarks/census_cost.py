"""The census's cost (issue 41): what ``--opt-census=on`` adds to a test's wall time, and what counting one generate
call costs under ``torch.profiler`` (what the census uses) and under a ``TorchDispatchMode`` (the alternative).

``sessions`` runs one user test file per case ``--pairs`` times with ``--opt-census=on`` and as many times with
``off``, interleaved (on then off, then off then on, so that neither setting always runs second), each a pytest
session of its own in a subprocess, and reports per case the medians of:

* the test's call: pytest's duration of its call phase (the timed rounds, the similarity check, the census);
* the census: both sides' census calls together, timed around the plugin's ``census_of`` by the project's conftest;
* the census's share of the call with it on, and the ratio of the calls, on over off:

    python benchmarks/census_cost.py sessions [--pairs 5] [--cases tiny-sdpa,tiny-static,smollm2-sdpa]
        [--max-new-tokens 16] [--threads 1] [--out FILE] [-- PYTEST_ARGS]

Cases: ``tiny-sdpa`` (tiny-random-llama, sdpa), ``tiny-static`` (tiny-random-llama, static_cache), ``smollm2-sdpa``
(the built-in pretrained smollm2-135m in float32, sdpa). The plugin's own rounds (``auto``) and warm-up, as a user
runs them, ``--opt-budgets=off``, ``--opt-cpu-threads=1`` (``--threads``, as in the other studies).

``counting`` times, in this process, one eager generate call of a model (sdpa, greedy, ``--max-new-tokens``
tokens) in turns, ``--repeats`` times each: plain; under the census's profiler (``engine.census.CensusTaking``,
the step marks, and the counting of its events, timed apart); under a ``TorchDispatchMode`` that counts every op
the dispatcher runs:

    python benchmarks/census_cost.py counting [--models tiny-random-llama,smollm2-135m] [--repeats 5]
        [--max-new-tokens 16] [--threads 1]

Both print, headed by the exact command line, a Markdown table (stdout), and a line on stderr when long work starts
and ends.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
TEST_FILE = "test_census_cost.py"
TIMES_ENV = "CENSUS_COST_TIMES"
MAX_NEW_TOKENS = 16
CASES: dict[str, tuple[str, str]] = {
    # case: (model, technique)
    "tiny-sdpa": ("tiny-random-llama", "sdpa"),
    "tiny-static": ("tiny-random-llama", "static_cache"),
    "smollm2-sdpa": ("smollm2-135m", "sdpa"),
}
SETTINGS = ("on", "off")
PROMPT = "The capital of France is"

# The project's conftest: pytest's call duration of each test and the census calls' own time, one JSON line a test.
# census_sides.census_of is looked up as a module global by census_sides(), so wrapping it here times every side.
CONFTEST = f'''"""Written by benchmarks/census_cost.py: each test's call duration and its census calls' time."""
import json
import os
import time

from pytest_transformers_opt.verdict import census_sides

_census_of = census_sides.census_of
_census_s = []


def _timed_census_of(*args, **kwargs):
    started = time.perf_counter()
    try:
        return _census_of(*args, **kwargs)
    finally:
        _census_s.append(time.perf_counter() - started)


census_sides.census_of = _timed_census_of


def pytest_runtest_setup(item):
    _census_s.clear()


def pytest_runtest_logreport(report):
    if report.when == "call":
        with open(os.environ["{TIMES_ENV}"], "a", encoding="utf-8") as out:
            out.write(json.dumps({{"nodeid": report.nodeid, "outcome": report.outcome, "call_s": report.duration,
                                  "census_s": list(_census_s)}}) + "\\n")
'''


def announce(text: str) -> None:
    """A progress line, on stderr: stdout holds only the tables."""
    print(f"[{dt.datetime.now().strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def command_line(argv: Sequence[str]) -> str:
    return "python benchmarks/census_cost.py " + shlex.join(argv)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f} ms" if value < 1 else f"{value:.2f} s"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _loads() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


# --------------------------------------------------------------------------- sessions


def project_source(model: str, technique: str, max_new_tokens: int) -> str:
    """One test, as a user writes it: the model, the technique, the plugin's default prompts."""
    return (f"import pytest\n\n\n@pytest.mark.opt_model({model!r})\n@pytest.mark.optimization({technique!r})\n"
            f"def test_census_cost(opt_bench):\n    opt_bench(max_new_tokens={max_new_tokens})\n")


def session_order(pairs: int) -> list[str]:
    """The census settings in the order the sessions run: on, off, off, on, on, off ... (pairs alternate which
    setting goes first, so a machine that speeds up or slows down over the study does not favour one)."""
    order: list[str] = []
    for pair in range(pairs):
        order += list(SETTINGS) if pair % 2 == 0 else list(reversed(SETTINGS))
    return order


@dataclass
class Session:
    census: str  # on / off
    status: int
    wall_s: float  # the pytest process, start to end
    call_s: float | None  # the test's call phase
    census_s: list[float] = field(default_factory=list)  # each side's census call
    tail: str = ""


SessionRunner = Callable[[Path, str, Sequence[str], str], Session]


def run_session(root: Path, census: str, pytest_args: Sequence[str], threads: str) -> Session:
    """One pytest session of the project in ``root`` with ``--opt-census=census``."""
    times = root / "times.jsonl"
    times.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-W", "ignore",
               "--opt-budgets=off", f"--opt-cpu-threads={threads}", f"--opt-census={census}", *pytest_args, TEST_FILE]
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("PYTEST_OPT_") and name != "GITHUB_STEP_SUMMARY"}
    env[TIMES_ENV] = str(times)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=root, env=env, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in times.read_text(encoding="utf-8").splitlines()] if times.exists() else []
    row = rows[0] if rows else {}
    passed = row.get("outcome") == "passed"
    return Session(census, done.returncode, wall, float(row["call_s"]) if passed else None,
                   [float(s) for s in row.get("census_s") or []] if passed else [], done.stdout[-2000:])


@dataclass
class CaseResult:
    case: str
    sessions: list[Session]

    def calls(self, census: str) -> list[float]:
        return [s.call_s for s in self.sessions if s.census == census and s.call_s is not None]

    def census_times(self) -> list[float]:
        """Each on-session's census time, both sides together."""
        return [sum(s.census_s) for s in self.sessions if s.census == "on" and s.call_s is not None and s.census_s]

    def shares(self) -> list[float]:
        """Each on-session's census time over its own call."""
        return [sum(s.census_s) / s.call_s for s in self.sessions
                if s.census == "on" and s.call_s and s.census_s]

    def call_ratio(self) -> float | None:
        on, off = _median(self.calls("on")), _median(self.calls("off"))
        return None if on is None or not off else on / off

    def failed(self) -> int:
        return sum(1 for s in self.sessions if s.call_s is None)


def sessions_table(results: Sequence[CaseResult]) -> str:
    lines = ["| case | sessions on / off | call, census on | call, census off | census (both sides) | "
             "census / call (on) | call on / off |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        shares = result.shares()
        spread = f" ({_pct(min(shares))}-{_pct(max(shares))})" if len(shares) > 1 else ""
        lines.append(f"| {result.case} | {len(result.calls('on'))} / {len(result.calls('off'))} | "
                     f"{_ms(_median(result.calls('on')))} | {_ms(_median(result.calls('off')))} | "
                     f"{_ms(_median(result.census_times()))} | {_pct(_median(shares))}{spread} | "
                     f"{_ratio(result.call_ratio())} |")
    failed = [f"{r.case}: {r.failed()} sessions without a passed call" for r in results if r.failed()]
    return "\n".join(lines + ([""] + failed if failed else []))


def run_sessions(cases: Sequence[str], pairs: int, max_new_tokens: int, threads: str, pytest_args: Sequence[str],
                 runner: SessionRunner = run_session) -> list[CaseResult]:
    results = []
    for case in cases:
        model, technique = CASES[case]
        with tempfile.TemporaryDirectory(prefix="census-cost-") as temporary:
            root = Path(temporary)
            (root / "conftest.py").write_text(CONFTEST, encoding="utf-8")
            (root / TEST_FILE).write_text(project_source(model, technique, max_new_tokens), encoding="utf-8")
            sessions = []
            order = session_order(pairs)
            for number, census in enumerate(order, 1):
                announce(f"{case}: session {number}/{len(order)} (--opt-census={census}) starts; load {_loads()}")
                session = runner(root, census, pytest_args, threads)
                sessions.append(session)
                census_text = " + ".join(f"{s:.2f}" for s in session.census_s) or "-"
                announce(f"{case}: session {number}/{len(order)} ends: exit {session.status}, {session.wall_s:.1f} s, "
                         f"call {session.call_s if session.call_s is None else round(session.call_s, 2)} s, "
                         f"census {census_text} s; load {_loads()}")
                if session.call_s is None:
                    print(session.tail, file=sys.stderr)
            results.append(CaseResult(case, sessions))
    return results


# --------------------------------------------------------------------------- counting


def model_folder(name: str) -> Path:
    """The built-in model's folder (built, converted or unpacked on first use, as for the tests)."""
    from pytest_transformers_opt.engine.real_models import ensure_real_model, is_real_model
    from pytest_transformers_opt.engine.tiny_models import ensure_tiny_model

    return ensure_real_model(name) if is_real_model(name) else ensure_tiny_model(name)


def dispatch_counter() -> Any:
    """A TorchDispatchMode that counts every op the dispatcher runs while it is active, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):  # type: ignore[misc]  # torch's class is untyped
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    return Counting()


@dataclass
class Counting:
    model: str
    plain_s: list[float] = field(default_factory=list)
    profiler_call_s: list[float] = field(default_factory=list)  # the generate call under the profiler
    profiler_count_s: list[float] = field(default_factory=list)  # reading and counting its events, after
    profiler_parse_s: list[float] = field(default_factory=list)  # of which: profile.events() (torch's parse)
    raw_read_s: list[float] = field(default_factory=list)  # the alternative: the raw kineto events' fields, read
    dispatch_s: list[float] = field(default_factory=list)
    profiler_ops: int | None = None  # ops_total of the census
    dispatch_ops: int | None = None  # ops the dispatch mode saw


def time_counting(name: str, repeats: int, max_new_tokens: int) -> Counting:
    """``repeats`` rounds of (plain, profiler, dispatch mode), each one generate call, after one warm-up each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pytest_transformers_opt.engine.census import CensusTaking, StepMark, marked_call

    folder = model_folder(name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    encoded = tokenizer([PROMPT], return_tensors="pt")
    kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    result = Counting(name)

    def plain() -> None:
        with torch.inference_mode():
            model.generate(**encoded, **kwargs)

    def profiled() -> None:
        taking = CensusTaking(cuda=False)
        started = time.perf_counter()
        with torch.inference_mode(), taking.profiling(), marked_call():
            model.generate(**encoded, **kwargs, logits_processor=[StepMark()])
        counted = time.perf_counter()
        taking.profile.events()  # torch builds its FunctionEvent tree once, here; the census reads it
        parsed = time.perf_counter()
        census = taking.census(compiled=False, recompiles=None, graph_break_reasons=(), steps_known=True)
        result.profiler_call_s.append(counted - started)
        result.profiler_count_s.append(time.perf_counter() - counted)
        result.profiler_parse_s.append(parsed - counted)
        result.profiler_ops = int(census["ops_total"])
        # what reading the same events costs without torch's tree (a private API: measured here only)
        started = time.perf_counter()
        raw = [(e.name(), e.start_ns(), e.duration_ns(), e.start_thread_id(), e.device_type())
               for e in taking.profile.profiler.kineto_results.events()]
        result.raw_read_s.append(time.perf_counter() - started)
        assert raw

    def dispatched() -> None:
        mode = dispatch_counter()
        with torch.inference_mode(), mode:
            model.generate(**encoded, **kwargs)
        result.dispatch_ops = sum(mode.counts.values())

    # warm-up: lazy initialisation, the profiler's first start
    plain()
    profiled()
    dispatched()
    for kept in (result.profiler_call_s, result.profiler_count_s, result.profiler_parse_s, result.raw_read_s):
        kept.clear()
    for _ in range(repeats):
        started = time.perf_counter()
        plain()
        result.plain_s.append(time.perf_counter() - started)
        profiled()
        started = time.perf_counter()
        dispatched()
        result.dispatch_s.append(time.perf_counter() - started)
    return result


def counting_table(results: Sequence[Counting]) -> str:
    lines = ["| model | plain call | profiler: call | profiler: counting (of which `profile.events()`) | "
             "raw kineto events, read | profiler, total / plain | dispatch mode: call | dispatch mode / plain | "
             "ops counted: profiler (top-level) / dispatch mode (all) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        plain = _median(r.plain_s)
        total = [c + n for c, n in zip(r.profiler_call_s, r.profiler_count_s)]

        def ratio(value: float | None) -> float | None:
            return None if plain is None or value is None else value / plain

        lines.append(f"| {r.model} | {_ms(plain)} | {_ms(_median(r.profiler_call_s))} | "
                     f"{_ms(_median(r.profiler_count_s))} ({_ms(_median(r.profiler_parse_s))}) | "
                     f"{_ms(_median(r.raw_read_s))} | {_ratio(ratio(_median(total)))} | "
                     f"{_ms(_median(r.dispatch_s))} | {_ratio(ratio(_median(r.dispatch_s)))} | "
                     f"{r.profiler_ops} / {r.dispatch_ops} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    sessions = modes.add_parser("sessions", help="pytest sessions of one test, census on and off, interleaved")
    sessions.add_argument("--pairs", type=int, default=5, help="sessions per setting and case (default: 5)")
    sessions.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    sessions.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    sessions.add_argument("--threads", default="1", help="--opt-cpu-threads of each session (default: 1)")
    sessions.add_argument("--out", type=Path, help="also write the table here")
    sessions.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments for every session")
    counting = modes.add_parser("counting", help="one generate call: plain, under the profiler, under a dispatch mode")
    counting.add_argument("--models", default="tiny-random-llama,smollm2-135m")
    counting.add_argument("--repeats", type=int, default=5)
    counting.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    counting.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (default: 1)")
    counting.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if args.mode == "sessions":
        args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = sorted(set(args.cases) - set(CASES))
        if unknown:
            parser.error(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(CASES)}")
        if args.pairs < 1:
            parser.error("--pairs: at least 1")
    else:
        args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    return args


def main(argv: Sequence[str] | None = None, runner: SessionRunner = run_session) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    header = f"`{command_line(argv)}` (load average at the start: {_loads()})"
    if args.mode == "sessions":
        announce(f"sessions: {len(args.cases)} cases x {2 * args.pairs} sessions start")
        table = sessions_table(run_sessions(args.cases, args.pairs, args.max_new_tokens, args.threads,
                                            args.pytest_args, runner))
        announce("sessions: done")
    else:
        import torch

        torch.set_num_threads(args.threads)
        results = []
        for name in args.models:
            announce(f"counting: {name} starts ({args.repeats} rounds of plain, profiler, dispatch mode)")
            results.append(time_counting(name, args.repeats, args.max_new_tokens))
            announce(f"counting: {name} ends")
        table = counting_table(results)
    text = f"{header}\n\n{table}"
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
