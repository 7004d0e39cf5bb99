"""Progress lines for long work: building a built-in model, loading, compiling, launching torchrun.

``with long_work("building tiny-random-llama", detail="about 2 min"):`` writes one line through
pytest's terminal reporter when the work starts, a line every ``HEARTBEAT_S`` seconds while it
runs (with the work's current ``status``), and one when it ends, with its duration. Work that is
only sometimes long passes ``after_s``: nothing is written unless it is still running by then.

The session's reporter is module state, set by ``pytest_configure`` (:func:`install`) and removed
by ``pytest_unconfigure``, so loading and building code need no ``config`` argument. Nothing is
written under ``-qq``, in pytest-xdist workers (they have no terminal of their own) or outside a
pytest session (the CLI, torchrun ranks).

Lines are written with pytest's capture suspended (what its live logging does), so they reach the
terminal during a test's setup and call, each on a fresh line (``write_line``).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..units import format_duration

PREFIX = "transformers-opt: "
HEARTBEAT_S = 20.0  # under the 30 s of silence a user starts to wonder at


@dataclass
class _Sink:
    config: Any
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def reporter(self) -> Any:
        # looked up when used: pytest's terminal plugin configures after this one
        if _verbosity(self.config) <= -2:
            return None
        return self.config.pluginmanager.get_plugin("terminalreporter")

    def write(self, text: str) -> None:
        reporter = self.reporter
        if reporter is None:
            return
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        # flushed: CI logs are pipes, where a line left in the buffer is as silent as none
        with self.lock:
            if capture is None:
                reporter.write_line(PREFIX + text)
                reporter.flush()
                return
            with capture.global_and_fixture_disabled():
                reporter.write_line(PREFIX + text)
                reporter.flush()


_SINKS: list[_Sink] = []  # a stack: pytester runs a session inside a session


def _verbosity(config: Any) -> int:
    try:
        return int(config.get_verbosity())
    except Exception:
        return int(getattr(config.option, "verbose", 0) or 0)


def install(config: Any) -> None:
    """Write progress lines to ``config``'s terminal (none in xdist workers: their output is not shown)."""
    if not hasattr(config, "workerinput"):
        _SINKS.append(_Sink(config))


def uninstall(config: Any) -> None:
    """Stop writing to ``config``'s terminal (the enclosing session's, if any, is used again)."""
    _SINKS[:] = [sink for sink in _SINKS if sink.config is not config]


def _sink() -> _Sink | None:
    sink = _SINKS[-1] if _SINKS else None
    return sink if sink is not None and sink.reporter is not None else None


@dataclass(eq=False)  # compared by identity: two pieces of work may read the same
class Work:
    """One piece of long work; set ``status`` to say where it is (shown in heartbeat lines)."""

    what: str
    status: str = ""
    started: float = field(default_factory=time.perf_counter)
    announced: bool = False

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started


_RUNNING: list[Work] = []  # innermost last; an announced inner piece of work speaks for the outer ones


def _covered(work: Work) -> bool:
    running = list(_RUNNING)
    return work in running and any(inner.announced for inner in running[running.index(work) + 1:])


def _start_line(work: Work, detail: str) -> str:
    return f"{work.what}{f' ({detail})' if detail else ''} ..."


def _heartbeat(sink: _Sink, work: Work, detail: str, after_s: float, stop: threading.Event) -> None:
    delay = after_s if not work.announced else HEARTBEAT_S
    while not stop.wait(delay):
        delay = HEARTBEAT_S
        if _covered(work):
            continue
        if not work.announced:
            work.announced = True
            sink.write(_start_line(work, detail))
        else:
            status = f": {work.status}" if work.status else ""
            sink.write(f"still {work.what}{status} ({work.elapsed_s:.0f} s so far)")


@contextmanager
def long_work(what: str, *, detail: str = "", after_s: float = 0.0) -> Iterator[Work]:
    """Announce ``what`` (a phrase such as "loading gpt2") on the terminal while the block runs.

    ``detail`` goes on the start line (an estimate, why it happens); ``after_s > 0`` announces the
    work only if it is still running after that many seconds. The end line is written only when the
    start line was.
    """
    work = Work(what)
    sink = _sink()
    if sink is None:
        yield work
        return
    if after_s <= 0:
        work.announced = True
        sink.write(_start_line(work, detail))
    stop = threading.Event()
    thread = threading.Thread(target=_heartbeat, args=(sink, work, detail, after_s, stop), daemon=True,
                              name="transformers-opt-progress")
    _RUNNING.append(work)
    thread.start()
    outcome = "stopped after"  # a skip or an interrupt
    try:
        yield work
        outcome = "done in"
    except Exception:
        outcome = "failed after"
        raise
    finally:
        stop.set()
        thread.join()
        _RUNNING.remove(work)
        if work.announced:
            sink.write(f"{what}: {outcome} {format_duration(work.elapsed_s)}")
