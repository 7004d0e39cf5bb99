"""Progress lines for long work: building a built-in model, loading, compiling, launching torchrun.

``with long_work("building tiny-random-llama", detail="about 2 min"):`` writes one line through
pytest's terminal reporter when the work starts, a line every ``HEARTBEAT_S`` seconds while it
runs (with the work's current ``status``), and one when it ends, with its duration. Work that is
only sometimes long passes ``after_s``: nothing is written unless it is still running by then.

The session's reporter is module state, set by ``pytest_configure`` (:func:`install`) and removed
by ``pytest_unconfigure``, so loading and building code need no ``config`` argument. Nothing is
written under ``-qq``, in pytest-xdist workers (they have no terminal of their own) or outside a
pytest session (the CLI, torchrun ranks).

Capture is touched from the main thread only. There a line is written with pytest's capture suspended
(what its live logging does), so it reaches the terminal during a test's setup and call. The heartbeat
thread never suspends capture (that is process-wide: a line the test prints meanwhile would miss its
``capsys`` and land on the terminal): it writes to a duplicate of the terminal's file descriptor, taken
at configure while capture is off, or straight to the reporter's stream when that is in memory (pytester).
Every line starts on a fresh line, also when pytest's progress dots (``-q``) are mid-line.
"""

from __future__ import annotations

import os
import sys
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
    # sys.stdout at configure (the stream pytest's terminal reporter writes to) and a duplicate of its
    # file descriptor, for lines written off the main thread; None when it has no descriptor
    stdout: Any = None
    terminal_fd: int | None = None
    # the reporter's current line when a heartbeat ended it on the terminal (pytest does not know it did)
    ended_line: str | None = None

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
        with self.lock:
            if threading.current_thread() is threading.main_thread():
                self._write_in_main_thread(reporter, text)
            else:
                self._write_off_main_thread(reporter, text)

    def flush(self) -> None:
        """Send what pytest's reporter still buffers to the terminal, so that a line the heartbeat thread
        writes later does not overtake it. Main thread only."""
        reporter = self.reporter
        if reporter is None or threading.current_thread() is not threading.main_thread():
            return
        with self.lock:
            if sys.stdout is self.stdout:  # capture is off (between tests, or -s): nothing to switch
                reporter.flush()
            elif getattr(getattr(reporter, "_tw", None), "_current_line", "") and not getattr(reporter, "currentfspath",
                                                                                            None):
                # -q: pytest writes the dots unflushed (default and -v flush when a test starts)
                with self._capture_off():
                    reporter.flush()

    def close(self) -> None:
        if self.terminal_fd is not None:
            os.close(self.terminal_fd)
            self.terminal_fd = None

    def _capture_off(self) -> Any:
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        return capture.global_and_fixture_disabled() if capture is not None else _nothing()

    def _write_in_main_thread(self, reporter: Any, text: str) -> None:
        writer = getattr(reporter, "_tw", None)
        with self._capture_off():
            current = getattr(writer, "_current_line", "")
            if self.ended_line is not None and current is self.ended_line:
                reporter.currentfspath = None  # a heartbeat already ended the line pytest left open
            elif current and not getattr(reporter, "currentfspath", None) and writer is not None:
                writer.line()  # -q: the dots are mid-line, and write_line only ends a line it started
            self.ended_line = None
            reporter.write_line(PREFIX + text)
            # flushed: CI logs are pipes, where a line left in the buffer is as silent as none
            reporter.flush()

    def _write_off_main_thread(self, reporter: Any, text: str) -> None:
        writer = getattr(reporter, "_tw", None)
        if writer is None:  # not pytest's terminal reporter: its own write_line is all there is
            reporter.write_line(PREFIX + text)
            reporter.flush()
            return
        stream = getattr(writer, "_file", None)
        current = getattr(writer, "_current_line", "")
        lead = ""
        if current and current is not self.ended_line:
            lead, self.ended_line = "\n", current
        line = lead + PREFIX + text + "\n"
        try:
            if self.terminal_fd is not None and stream is self.stdout:
                data = line.encode(getattr(stream, "encoding", None) or "utf-8", errors="replace")
                while data:
                    data = data[os.write(self.terminal_fd, data):]
            elif stream is not None and _descriptor(stream) is None:
                stream.write(line)  # in memory (pytester's inline runs): no capture redirects it
                stream.flush()
            # else: a stream capture may redirect, which only the main thread may switch off: no line
        except (OSError, ValueError):  # the terminal went away (a closed pipe): progress lines are not worth an error
            pass


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _descriptor(stream: Any) -> int | None:
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None


_SINKS: list[_Sink] = []  # a stack: pytester runs a session inside a session


def _verbosity(config: Any) -> int:
    try:
        return int(config.get_verbosity())
    except Exception:
        return int(getattr(config.option, "verbose", 0) or 0)


def install(config: Any) -> None:
    """Write progress lines to ``config``'s terminal (none in xdist workers: their output is not shown)."""
    if hasattr(config, "workerinput"):
        return
    # called from pytest_configure, where capture is suspended: stdout's descriptor is the terminal's
    sink = _Sink(config, stdout=sys.stdout)
    descriptor = _descriptor(sys.stdout)
    if descriptor is not None:
        try:
            sink.terminal_fd = os.dup(descriptor)
        except OSError:
            sink.terminal_fd = None
    _SINKS.append(sink)


def uninstall(config: Any) -> None:
    """Stop writing to ``config``'s terminal (the enclosing session's, if any, is used again)."""
    for sink in _SINKS:
        if sink.config is config:
            sink.close()
    _SINKS[:] = [sink for sink in _SINKS if sink.config is not config]


def _sink() -> _Sink | None:
    sink = _SINKS[-1] if _SINKS else None
    return sink if sink is not None and sink.reporter is not None else None


def say(text: str) -> None:
    """One line on the terminal now (``transformers-opt: text``), also from inside a test's setup or call;
    nothing where progress lines are not written (``-qq``, xdist workers, outside a session)."""
    sink = _sink()
    if sink is not None:
        sink.write(text)


def rough_duration(seconds: float) -> str:
    """``about 40 s`` or ``about 3 min``: an estimate's precision, not a measurement's."""
    if seconds >= 90:
        return f"about {seconds / 60:.0f} min"
    return f"about {max(10, 10 * round(seconds / 10)):.0f} s" if seconds >= 10 else f"about {seconds:.0f} s"


def load_average() -> float | None:
    """The machine's 1-minute load average (runnable processes), None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def estimate(idle_s: float, machine: str = "an idle machine") -> str:
    """An estimate that says what it assumes, and says so when the machine is not idle: ``about 40 s on
    an idle machine`` or ``about 40 s on an idle machine, longer here: load 9.1 on 2 cores``. Work measured
    at 918 s against 40 s on a busy 2-core machine: the estimate cannot know, the heartbeat shows the pace."""
    text = f"{rough_duration(idle_s)} on {machine}"
    load, cores = load_average(), cpu_cores()
    if load is not None and load > cores:  # more runnable processes than cores: each gets a share of one
        text += f", longer here: load {load:.1f} on {cores} core{'s' if cores != 1 else ''}"
    return text


def projected_left(done: int, total: int, seconds: float) -> str:
    """What is left of ``total`` steps at the pace of the ``done`` measured so far, for a heartbeat:
    ``about 2 min left at the pace so far``."""
    left = seconds / max(1, done) * max(0, total - done)
    return f"{rough_duration(left)} left at the pace so far"


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
    else:
        sink.flush()
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
