"""The candidate's handle on an A/B reference environment: a worker process under another interpreter.

``ReferenceWorker.start(python, threads=...)`` (``launch`` then ``wait_ready``) checks the interpreter, starts
``python -u -m pytest_transformers_opt.engine.ab_worker`` (see that module for the protocol) with
``PYTHONPATH`` set to a folder holding only a link to this checkout's package, so the reference runs
this measurement code on its own torch and transformers, and waits for the worker's ready line (its
versions). ``load`` then ``generate`` run one configuration there, ``census`` counts what one untimed call of it
runs; ``close`` ends it.

A reference that cannot serve is told apart from one that broke: ``ReferenceUnavailable`` (the
interpreter is missing, or cannot import torch: a skip for the caller), ``ReferenceWorkerDied`` (the
process ended: its exit status and last stderr lines, the test's error), ``ReferenceStoppedAnswering`` (a
request got no answer within its ``timeout_s``: the worker was killed), ``ReferenceError`` (the worker answered
that a request failed; it runs on). No worker outlives this process: ``close`` is registered
with ``atexit``, the worker ends at the end of its input and, on Linux, is killed with the thread that
started it (``PR_SET_PDEATHSIG``), so start it from the main thread.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import os
import queue
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .measure import RoundTiming

if TYPE_CHECKING:
    from .loading import ModelRequest
    from ..techniques import Technique

WORKER_MODULE = "pytest_transformers_opt.engine.ab_worker"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the package the worker must import: this checkout's
STDERR_LINES = 40  # the worker's last stderr lines kept for error messages
STDERR_LINE_CHARS = 2000  # a progress bar redrawn with \r is one endless line
CLOSE_WAIT_S = 5.0  # after its input ends, the worker has this long to exit before it is killed
STRIPPED_ENV = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")  # the candidate's paths stay out of the reference
THREADS_ENV = "PYTEST_OPT_CPU_THREADS"


class ReferenceUnavailable(Exception):
    """The reference environment cannot serve (missing interpreter, no torch, ...); ``reason`` is one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ReferenceWorkerDied(Exception):
    """The worker process ended while it was needed: its exit status and its last stderr lines."""

    def __init__(self, message: str, *, returncode: int | None, lines: list[str]) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.lines = lines


class ReferenceStoppedAnswering(Exception):
    """A request got no answer within its time limit: the worker was killed. ``seconds``: how long it was waited for."""

    def __init__(self, message: str, *, seconds: float) -> None:
        super().__init__(message)
        self.seconds = seconds


class ReferenceError(RuntimeError):  # the design's name; shadows the builtin (weakref) one in this module only
    """The worker answered that a request failed (it keeps running): ``error`` is its one line."""

    def __init__(self, error: str, traceback: str | None = None) -> None:
        super().__init__(error)
        self.error = error
        self.traceback = traceback


@dataclass
class ReferenceRun:
    """One ``generate`` in the reference environment, as ``GenerationRun`` holds one of the candidate's."""

    timing: RoundTiming
    tokens: list[list[int]]
    texts: list[str]
    logprobs: list[Any] | None  # per prompt: float32 tensor [steps, vocab]
    generation_peak_bytes: int | None
    memory_method: str | None
    problems: list[str] | None  # verify_run's reasons, when the run was observed


def describe_status(returncode: int | None) -> str:
    """``exit status 3`` / ``killed by signal SIGKILL (9)`` / ``still running``."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by signal {name} ({-returncode})"
    return f"exit status {returncode}"


def check_interpreter(python: str) -> str:
    """The interpreter's path (a name is looked up on PATH; a link is kept as given: a venv's python is
    one); ``ReferenceUnavailable`` naming the path and what is there instead."""
    given = python
    if os.sep not in python:
        found = shutil.which(python)
        if found is None:
            raise ReferenceUnavailable(f"the reference interpreter {given!r} is not a path and is not on PATH")
        python = found
    path = Path(os.path.abspath(Path(python).expanduser()))
    if not path.exists():
        if path.is_symlink():
            raise ReferenceUnavailable(f"the reference interpreter {path} is a link to {os.readlink(path)}, "
                                       f"which does not exist")
        existing = next(parent for parent in path.parents if parent.exists())
        missing = path.relative_to(existing).parts[0]
        raise ReferenceUnavailable(f"the reference interpreter {path} does not exist ({existing} has no {missing!r})")
    if path.is_dir():
        venv = next((candidate for candidate in (path / "bin" / "python", path / "Scripts" / "python.exe")
                     if candidate.exists()), None)
        hint = f"; a virtual environment? give its interpreter, {venv}" if venv else ""
        raise ReferenceUnavailable(f"the reference interpreter {path} is a folder, not an interpreter{hint}")
    if not os.access(path, os.X_OK):
        mode = stat.filemode(path.stat().st_mode)
        raise ReferenceUnavailable(f"the reference interpreter {path} is not executable (mode {mode})")
    return str(path)


def worker_environment(pythonpath: str, threads: int | None) -> dict[str, str]:
    """This process's environment without its Python paths, plus the link folder and the thread count."""
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED_ENV}
    env["PYTHONPATH"] = pythonpath
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # never write bytecode into this checkout from another Python
    if threads is not None:
        env[THREADS_ENV] = str(threads)
    return env


def _absolute_if_local(path: str) -> str:
    """A local folder as an absolute path; a hub id as it is (the worker may run elsewhere than here)."""
    return os.path.abspath(path) if os.path.exists(path) else path


class ReferenceWorker:
    """One worker process in the reference environment (see the module docstring)."""

    def __init__(self, python: str, process: subprocess.Popen[bytes], pythonpath: str) -> None:
        self.python = python
        self.process = process
        self.versions: dict[str, str | None] = {}
        self.python_version: str | None = None
        self._pythonpath = pythonpath
        self._scratch: str | None = None  # the worker's own folder, removed here too when the worker was killed
        self._names: dict[str, str] = {}  # key -> what its configuration is, in words (the key is the session's own)
        self._closed = False
        self._ready = False
        self._lock = threading.Lock()  # one request at a time
        self._state_lock = threading.Lock()  # close() never waits for a request in flight
        self._responses: queue.Queue[bytes | None] = queue.Queue()
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        assert process.stdout is not None and process.stderr is not None and process.stdin is not None
        self._stdin: IO[bytes] = process.stdin
        self._readers = [threading.Thread(target=self._read_protocol, args=(process.stdout,), daemon=True,
                                          name="opt-ab-protocol"),
                         threading.Thread(target=self._read_stderr, args=(process.stderr,), daemon=True,
                                          name="opt-ab-stderr")]
        for reader in self._readers:
            reader.start()
        atexit.register(self.close)

    # -- start ----------------------------------------------------------------------------------------
    @classmethod
    def start(cls, python: str, *, threads: int | None, timeout_s: float = 300) -> "ReferenceWorker":
        """Start a worker under ``python`` and wait (at most ``timeout_s``) until it is ready.

        ``threads``: torch's CPU threads there (``PYTEST_OPT_CPU_THREADS``); None leaves the variable as
        this process has it (unset: the worker's share of the cores, as here)."""
        worker = cls.launch(python, threads=threads)
        worker.wait_ready(timeout_s)
        return worker

    @classmethod
    def launch(cls, python: str, *, threads: int | None) -> "ReferenceWorker":
        """Start the worker's process and return at once: it imports its torch and transformers while this
        process goes on (``wait_ready`` before the first request)."""
        path = check_interpreter(python)
        pythonpath = tempfile.mkdtemp(prefix="opt-ab-path-")
        try:
            os.symlink(PACKAGE_DIR, Path(pythonpath) / PACKAGE_DIR.name, target_is_directory=True)
            process = subprocess.Popen([path, "-u", "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       env=worker_environment(pythonpath, threads), close_fds=True,
                                       # out of the terminal's process group: a Ctrl-C meant for pytest ends the
                                       # session, and the session ends the worker (a round it is in is finished)
                                       start_new_session=True)
        except OSError as exc:
            shutil.rmtree(pythonpath, ignore_errors=True)
            raise ReferenceUnavailable(f"cannot start the reference interpreter {path}: "
                                       f"{type(exc).__name__}: {exc}") from exc
        return cls(path, process, pythonpath)

    @property
    def ready(self) -> bool:
        """Its ready line was read (``wait_ready`` returned)."""
        return self._ready

    def wait_ready(self, timeout_s: float = 300) -> None:
        """Wait (at most ``timeout_s``) for the worker's ready line; ``ReferenceUnavailable`` (the worker
        killed) when it refused, ended or took too long. Returns at once once ready."""
        if self._ready:
            return
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.close(kill=True)  # one that is not ready by now is not waited for any longer
            raise
        self._ready = True

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._responses.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ReferenceUnavailable(f"the reference interpreter {self.python} did not get its worker ready "
                                           f"within {timeout_s:g} s{self._last_line_clause()}") from None
            if line is None:
                returncode = self._reap()
                raise ReferenceUnavailable(f"the reference interpreter {self.python} ended before its worker was "
                                           f"ready ({describe_status(returncode)}){self._last_line_clause()}")
            ready = _json_object(line)
            if ready is not None and "ok" in ready:
                break
            # printed at start-up, before the worker took stdout over (a sitecustomize, a .pth file)
            self._tail.append(f"(stdout) {line.decode(errors='replace').rstrip()}"[:STDERR_LINE_CHARS])
        if not ready.get("ok"):
            self._reap()
            raise ReferenceUnavailable(str(ready.get("error") or f"the reference worker under {self.python} "
                                                                 f"refused to start{self._last_line_clause()}"))
        package = ready.get("package")
        if package is not None and Path(package) != PACKAGE_DIR:
            raise ReferenceUnavailable(f"the reference interpreter {self.python} imported the plugin from {package}, "
                                       f"not from this checkout's {PACKAGE_DIR}")
        self.versions = dict(ready.get("versions") or {})
        self.python_version = ready.get("python_version")
        self._scratch = ready.get("scratch")

    # -- requests -------------------------------------------------------------------------------------
    def load(self, key: str, request: ModelRequest, path: str, techniques: list[Technique], device: str,
             conftests: list[str], timeout_s: float | None = None) -> dict[str, Any]:
        """Load ``request`` (its local folder ``path``) with ``techniques`` under ``key``; the worker's response:
        ``skip`` (None, or why the reference cannot run it), ``load_time_s``, ``load_peak_bytes``,
        ``resident_bytes``, ``memory_method``, ``labels``. ``conftests``: files whose
        ``pytest_opt_register_techniques`` the worker calls first. ``timeout_s`` (None: no limit), for every
        request: past it the worker is killed and ``ReferenceStoppedAnswering`` raised."""
        self._names[key] = f"[{', '.join(t.label() for t in techniques)}] on {request.name_or_path}"
        model = {"name_or_path": request.name_or_path, "revision": request.revision, "dtype": request.dtype,
                 "trust_remote_code": request.trust_remote_code,
                 "from_pretrained_kwargs": dict(request.from_pretrained_kwargs)}
        return self._call({"op": "load", "key": key, "model": model, "path": _absolute_if_local(path),
                           "techniques": [[t.name, dict(t.params)] for t in techniques], "device": device,
                           "conftests": [os.path.abspath(c) for c in conftests]}, f"loading {self._name(key)}",
                          timeout_s)

    def generate(self, key: str, prompts: list[str], max_new_tokens: int, batch_size: int | None,
                 keep_logits: bool = False, force_tokens: list[list[int]] | None = None, observe: bool = False,
                 memory: bool = False, timed: bool = False, timeout_s: float | None = None) -> ReferenceRun:
        """One round of the configuration loaded under ``key``, as ``run_generation`` runs one here;
        ``memory``: its generation peak too (``track_peak_memory``); ``observe``: verify_run's problems; ``timed``:
        a timed round (the graphs it compiles are the census's recompiles)."""
        response = self._call({"op": "generate", "key": key, "prompts": list(prompts), "max_new_tokens": max_new_tokens,
                               "batch_size": batch_size, "keep_logits": keep_logits, "force_tokens": force_tokens,
                               "observe": observe, "memory": memory, "timed": timed}, f"a round of {self._name(key)}",
                              timeout_s)
        logprobs = None
        if response.get("logprobs_file"):
            logprobs = _read_logprobs(str(response["logprobs_file"]))
        names = {f.name for f in dataclasses.fields(RoundTiming)}
        timing = RoundTiming(**{k: v for k, v in response["timing"].items() if k in names})
        return ReferenceRun(timing=timing, tokens=response["tokens"], texts=response["texts"], logprobs=logprobs,
                            generation_peak_bytes=response.get("generation_peak_bytes"),
                            memory_method=response.get("memory_method"), problems=response.get("problems"))

    def census(self, key: str, prompts: list[str], max_new_tokens: int, batch_size: int | None,
               timeout_s: float | None = None) -> tuple[dict[str, Any] | None, str | None]:
        """(the execution census of one untimed call of the configuration under ``key``, or None; why not), taken
        there as ``verdict.census_sides.census_of`` takes the candidate's."""
        response = self._call({"op": "census", "key": key, "prompts": list(prompts), "max_new_tokens": max_new_tokens,
                               "batch_size": batch_size}, f"the census of {self._name(key)}", timeout_s)
        census, why_not = response.get("census"), response.get("why_not")
        if not isinstance(census, dict):
            return None, str(why_not or "the reference's worker sent no census")
        return census, None

    def park(self, key: str, to: str, timeout_s: float | None = None) -> float:
        """Move the configuration under ``key`` to the host (``"host"``) or back to its device (``"device"``);
        the seconds it took in the worker."""
        return float(self._call({"op": "park", "key": key, "to": to}, f"moving {self._name(key)} to the {to}",
                                timeout_s)["seconds"])

    def _name(self, key: str) -> str:
        return self._names.get(key, key)

    def _call(self, payload: dict[str, Any], what: str, timeout_s: float | None = None) -> dict[str, Any]:
        try:
            data = json.dumps(payload).encode() + b"\n"
        except (TypeError, ValueError) as exc:
            raise ReferenceError(f"{what}: the request cannot be sent to the reference environment as JSON "
                                 f"({exc}); only JSON values (str, numbers, lists, dicts) cross over") from exc
        with self._lock:
            if self._closed:
                raise ReferenceWorkerDied(f"the reference worker ({self.python}) was closed before {what}",
                                          returncode=self.process.returncode, lines=self.stderr_lines())
            try:
                self._stdin.write(data)
                self._stdin.flush()
            except OSError:  # its input is closed: it is gone, or going
                raise self._died(what) from None
            try:
                line = self._responses.get(timeout=timeout_s)
            except queue.Empty:  # it stopped answering: its late answer would answer the next request
                self.close(kill=True)
                assert timeout_s is not None
                raise ReferenceStoppedAnswering(
                    f"the reference worker ({self.python}, pid {self.process.pid}) did not answer {what} within "
                    f"{timeout_s:.0f} s and was killed", seconds=timeout_s) from None
            except BaseException:  # interrupted (Ctrl-C): its answer would answer the next request
                self.close(kill=True)
                raise
            if line is None:
                raise self._died(what)
            response = self._decode(line, f"its answer to {what}")
        if not response.get("ok"):
            raise ReferenceError(str(response.get("error") or "the reference worker answered ok=false"),
                                 response.get("traceback"))
        return response

    def _decode(self, line: bytes, what: str) -> dict[str, Any]:
        value = _json_object(line)
        if value is None:
            self.close(kill=True)
            raise ReferenceWorkerDied(f"the reference worker ({self.python}) broke the protocol in {what}: "
                                      f"{line[:200]!r}", returncode=self.process.returncode, lines=self.stderr_lines())
        return value

    def _died(self, what: str) -> ReferenceWorkerDied:
        returncode = self._reap()
        lines = self.stderr_lines()
        said = last_lines_text(lines)
        error = ReferenceWorkerDied(f"the reference worker ({self.python}, pid {self.process.pid}) died during {what}: "
                                    f"{describe_status(returncode)}{said}", returncode=returncode, lines=lines)
        self.close()
        return error

    # -- state ----------------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return not self._closed and self.process.poll() is None

    def stderr_lines(self) -> list[str]:
        """The worker's last ``STDERR_LINES`` stderr lines."""
        return list(self._tail)

    def close(self, kill: bool = False) -> None:
        """End the worker: its input closed (it exits), killed after ``CLOSE_WAIT_S`` (at once with ``kill``);
        its folders removed. Idempotent; also run at exit."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        if kill and self.process.poll() is None:
            self.process.kill()
        try:
            self._stdin.close()
        except OSError:
            pass
        self._reap()
        for reader in self._readers:
            reader.join(timeout=1.0)  # the stderr pipe may stay open in a grandchild: not waited for
        # the pipes closed here, not by the collector: an unclosed file found by a later collection is a
        # ResourceWarning raised wherever that collection happens to run (an "unraisable" error in pytest)
        for reader, stream in zip(self._readers, (self.process.stdout, self.process.stderr)):
            # a reader still blocked on its pipe (held open by a grandchild) would block the close: left
            if stream is not None and not reader.is_alive():
                stream.close()
        for folder in (self._pythonpath, self._scratch):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)

    def _reap(self) -> int | None:
        """Wait for the process to end (its input closed, or ending), killed after ``CLOSE_WAIT_S``."""
        try:
            return self.process.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        finally:
            # the last stderr lines arrive with the end of the process
            self._readers[1].join(timeout=1.0)

    def _last_line_clause(self) -> str:
        lines = [line for line in self.stderr_lines() if line.strip()]
        return f": {lines[-1].strip()}" if lines else ""

    # -- reader threads -------------------------------------------------------------------------------
    def _read_protocol(self, stream: IO[bytes]) -> None:
        try:
            for line in iter(stream.readline, b""):
                if line.strip():
                    self._responses.put(line)
        except (OSError, ValueError):  # closed under us
            pass
        finally:
            self._responses.put(None)

    def _read_stderr(self, stream: IO[bytes]) -> None:
        try:
            for raw in iter(stream.readline, b""):
                # a progress bar redraws its line after each \r: kept as a terminal shows it, its last state
                line = raw.decode(errors="replace").rstrip("\r\n").rsplit("\r", 1)[-1]
                self._tail.append(line[:STDERR_LINE_CHARS])
        except (OSError, ValueError):
            pass


def last_lines_text(lines: list[str]) -> str:
    """``; its last lines on stderr:`` and the lines (blank ones left out), or that it wrote none."""
    said = [line.rstrip() for line in lines if line.strip()]
    if not said:
        return "; it wrote nothing on stderr"
    return "; its last lines on stderr:\n" + "\n".join(f"  {line}" for line in said)


def _json_object(line: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _read_logprobs(path: str) -> list[Any]:
    """The per-prompt tensors of the worker's safetensors file (read, then removed)."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return [tensors[str(i)] for i in range(len(tensors))]
