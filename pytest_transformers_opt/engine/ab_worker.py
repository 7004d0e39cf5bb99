"""The reference side of an A/B run: ``python -u -m pytest_transformers_opt.engine.ab_worker`` under the
reference environment's interpreter, driven by :class:`pytest_transformers_opt.engine.ab_client.ReferenceWorker`.

Started by the client, never by users. It imports this checkout's measurement code (the client puts a
folder holding only a link to this package on ``PYTHONPATH``) and the reference environment's torch and
transformers, so that only the stack differs: models load through :func:`loading.load_model`, rounds run
through :func:`generation.run_generation` on an ``OptModel`` built as the session builds one, memory is
read by :func:`measure.track_peak_memory`.

The protocol is JSON lines: requests on stdin, responses on a private copy of the original stdout (fd 1
then points at stderr, so whatever a library prints never lands in a response). On start the worker says
``{"ok": true, "event": "ready", ...}`` unprompted (or ``{"ok": false, "error": ...}`` and exits 3 when the
stack cannot be imported); then it answers ``load``, ``generate``, ``park``, ``census`` and ``close`` one at a time.
``census`` takes the execution census of a loaded configuration in one untimed generate call
(``engine.census.census_of``, as the candidate takes its own); a census that cannot be taken is answered
``census: null`` with ``why_not``, never as a failed request. A request
that fails is answered ``{"ok": false, "error": "Type: message", "traceback": ...}`` and the worker goes
on. End of stdin (the client is gone) ends it; on Linux it also dies with the process that started it
(``PR_SET_PDEATHSIG``). Log-probabilities travel as safetensors files in a folder the worker owns and
removes when it ends (never pickle).

``_PYTEST_OPT_AB_WORKER_CRASH_AT=OP:N[:FILE]`` (for the plugin's own tests only) makes the worker exit with
status 70 on receiving its N-th ``OP`` request, without answering: a worker that dies mid-round. With
``FILE``, only a worker that finds no such file crashes, and it creates it first: one crash per session.
``_PYTEST_OPT_AB_WORKER_HANG_AT=OP:N[:FILE]`` (the same form) makes it stop answering instead: it sleeps for good
on receiving its N-th ``OP`` request, a reference that hangs mid-test.

The ready line's ``versions`` are every distribution the interpreter can import (``installed_distributions``),
so that any package bump between the two stacks shows, not only the few the plugin names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from .hardware import HardwareInfo
    from .loading import ModelCache, ModelRequest
    from .model import LoadedModel, OptModel
    from ..techniques import ProbeContext, Technique, TechniqueRegistry

_PARENT_AT_START = os.getppid()  # read before anything else: compared after PR_SET_PDEATHSIG is set

IMPORT_FAILED_STATUS = 3  # the reference cannot import the stack: the ready line says why
CRASH_ENV = "_PYTEST_OPT_AB_WORKER_CRASH_AT"
CRASH_STATUS = 70
HANG_ENV = "_PYTEST_OPT_AB_WORKER_HANG_AT"
THREADS_ENV = "PYTEST_OPT_CPU_THREADS"
MAX_LOADED_MODELS = 2
ERROR_LINE_CHARS = 2000
_PR_SET_PDEATHSIG = 1


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (a multi-line message joined), clipped."""
    from ..units import clip

    return clip(f"{type(exc).__name__}: {' '.join(str(exc).split())}".rstrip(": "), ERROR_LINE_CHARS)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the one that started it ends, also when that one is killed; if it
    ended already (before the call), end now. Elsewhere a no-op: end of stdin ends the worker instead."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != _PARENT_AT_START:  # the parent ended between our start and the prctl
        os._exit(0)


def take_protocol_stream() -> BinaryIO:
    """A private copy of fd 1 for the responses; fd 1 itself (``print``, C libraries) goes to stderr."""
    protocol = os.fdopen(os.dup(1), "wb", buffering=0)  # os.dup: not inherited by the worker's children
    os.dup2(2, 1)
    return protocol


def drop_working_directory_from_path() -> None:
    """``-m`` puts the working directory first on ``sys.path`` (unless ``PYTHONSAFEPATH`` is set): modules of
    the candidate's project must not shadow the reference's packages (the worker keeps the candidate's working
    directory, so relative paths in a request mean what they mean there)."""
    if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path.pop(0)


def canonical_name(name: str) -> str:
    """A distribution's name as PyPI compares names (PEP 503): ``Optimum_Quanto`` and ``optimum-quanto`` are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_distributions() -> dict[str, str | None]:
    """Every distribution this interpreter can import, by canonical name, sorted: the version found first on
    ``sys.path`` where one is installed twice (the one ``importlib.metadata.version`` gives). Copies vendored
    inside another package are left out: setuptools puts its ``_vendor`` folder on ``sys.path`` once imported,
    so a process that imported it would list packages the same interpreter, fresh, does not."""
    found: dict[str, str | None] = {}
    for distribution in importlib.metadata.distributions():
        name = distribution.metadata["Name"] if distribution.metadata is not None else None
        if name and "_vendor" not in Path(str(distribution.locate_file(""))).parts:
            found.setdefault(canonical_name(str(name)), distribution.version)
    return dict(sorted(found.items()))


def import_the_stack() -> None:
    """torch, then transformers, then the plugin's engine: the first that fails is named."""
    from .heavy_imports import import_stack

    for what, name in (("torch", "torch"), ("transformers", "transformers")):
        try:
            __import__(name)
        except BaseException as exc:  # noqa: BLE001 - anything an import raises is the answer
            raise StackUnavailable(f"the reference environment cannot import {what}: {one_line(exc)}") from exc
    try:
        import_stack()
        from . import generation, loading, measure  # noqa: F401
        from ..techniques import build_registry  # noqa: F401
    except BaseException as exc:  # noqa: BLE001
        raise StackUnavailable(f"the reference environment cannot import the plugin's engine: {one_line(exc)}") from exc


class StackUnavailable(Exception):
    """The reference environment cannot run the plugin's engine (said in the ready line)."""


def _crash_point(variable: str = CRASH_ENV) -> tuple[str, int] | None:
    op, _, rest = os.environ.get(variable, "").partition(":")
    count, _, once = rest.partition(":")
    if once:
        if Path(once).exists():
            return None
        Path(once).touch()
    return (op, int(count)) if op and count.isdigit() else None


def conftest_module_name(path: Path) -> tuple[Path, str]:
    """Where pytest's default import mode puts a conftest: (the folder it prepends to ``sys.path``, the
    module name): ``conftest`` beside no ``__init__.py``, else its dotted package path."""
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        parts.insert(0, folder.name)
        folder = folder.parent
    return folder, ".".join(parts)


@dataclasses.dataclass
class _Configuration:
    """One loaded configuration, by the client's key: what its rounds run with."""

    request: ModelRequest
    path: str
    device: str
    techniques: list[Technique]
    context: ProbeContext
    load_key: tuple[Any, ...]
    opt: OptModel | None = None
    recompiles: int = 0  # graphs dynamo compiled during its timed rounds (``generate`` with ``timed``)


class Worker:
    """The worker's state: the registry (built-in plus conftest registrations), hardware per device, loaded
    models (at most ``MAX_LOADED_MODELS``), configurations by key, and its scratch folder."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self._registry: TechniqueRegistry | None = None
        self._conftest_errors: dict[str, str | None] = {}  # path -> None (loaded) or why not
        self._hardware: dict[str, HardwareInfo] = {}
        self._models: dict[str, ModelCache] = {}
        self._configurations: dict[str, _Configuration] = {}
        self._counts: dict[str, int] = {}
        self._files = 0
        self._crash = _crash_point()
        self._hang = _crash_point(HANG_ENV)

    # -- requests -------------------------------------------------------------------------------------
    def handle(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """The response to one request; None for ``close``."""
        op = request.get("op")
        self._counts[str(op)] = self._counts.get(str(op), 0) + 1
        if self._crash is not None and self._crash == (op, self._counts[str(op)]):
            sys.stderr.write(f"ab_worker: {CRASH_ENV}={op}:{self._counts[str(op)]}: exiting with status "
                             f"{CRASH_STATUS} without answering\n")
            sys.stderr.flush()
            os._exit(CRASH_STATUS)
        if self._hang is not None and self._hang == (op, self._counts[str(op)]):
            sys.stderr.write(f"ab_worker: {HANG_ENV}={op}:{self._counts[str(op)]}: no longer answering\n")
            sys.stderr.flush()
            while True:
                time.sleep(3600)
        if op == "close":
            return None
        if op == "load":
            return self.load(request)
        if op == "generate":
            return self.generate(request)
        if op == "park":
            return self.park(request)
        if op == "census":
            return self.census(request)
        raise ValueError(f"unknown op {op!r}; known: load, generate, park, census, close")

    def load(self, request: dict[str, Any]) -> dict[str, Any]:
        from ..errors import OptConfigError
        from .loading import ModelRequest

        key = str(request["key"])
        self._configurations.pop(key, None)
        if self._hardware:  # a test's first request, as a session's test setup: what earlier ones imported is frozen
            from .measure import freeze_long_lived_objects

            freeze_long_lived_objects()
        model = request["model"]
        model_request = ModelRequest(name_or_path=model["name_or_path"], revision=model.get("revision"),
                                     dtype=model.get("dtype"), trust_remote_code=bool(model.get("trust_remote_code")),
                                     from_pretrained_kwargs=tuple((model.get("from_pretrained_kwargs") or {}).items()),
                                     origin="the A/B reference")
        device = str(request.get("device") or "cpu")
        path = str(request["path"])
        registry, skip = self.registry([str(p) for p in request.get("conftests") or []])
        techniques: list[Technique] = []
        context: ProbeContext | None = None
        if skip is None:
            try:
                techniques, context, skip = self._probed(registry, request.get("techniques") or [], model_request,
                                                         path, device)
            except OptConfigError as exc:
                skip = f"in the reference environment: {exc}"
        response: dict[str, Any] = {"ok": True, "skip": skip, "load_time_s": None, "load_peak_bytes": None,
                                    "resident_bytes": None, "memory_method": None,
                                    "labels": [t.label() for t in techniques]}
        if skip is not None or context is None:
            return response
        load_time = [t for t in techniques if t.load_time]
        # as the session keys its cache: configurations with the same load-time techniques share the weights
        load_key = (model_request.identity(), tuple(sorted(t.label() for t in load_time)), device)
        configuration = _Configuration(model_request, path, device, techniques, context, load_key)
        loaded = self._loaded(configuration)
        self._configurations[key] = configuration
        response.update(load_time_s=loaded.load_time_s, load_peak_bytes=loaded.load_peak_bytes,
                        resident_bytes=loaded.resident_bytes, memory_method=loaded.memory_method)
        return response

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        from ..compat import compiled_graph_count
        from .generation import run_generation
        from .measure import track_peak_memory

        key = str(request["key"])
        configuration = self._configurations.get(key)
        if configuration is None:
            raise ValueError(f"no configuration loaded under the key {key!r} (load it first; a skipped load has none)")
        opt = self._opt_model(configuration)
        force = request.get("force_tokens")
        memory = bool(request.get("memory"))
        observe = bool(request.get("observe"))
        graphs_before = compiled_graph_count()
        with track_peak_memory(opt.device) if memory else contextlib.nullcontext() as reading:
            run = run_generation(opt, [str(p) for p in request["prompts"]], int(request["max_new_tokens"]),
                                 batch_size=request.get("batch_size"), keep_logits=bool(request.get("keep_logits")),
                                 observe=observe, force_tokens=force)
        if request.get("timed"):  # as the candidate counts its recompiles: graphs compiled in its timed rounds
            configuration.recompiles += compiled_graph_count() - graphs_before
        problems = None
        if observe:
            problems = [p for p in (t.verify_run(opt.model, run.evidence) for t in opt.techniques) if p]
        return {"ok": True, "timing": dataclasses.asdict(run.timing), "tokens": run.tokens, "texts": run.texts,
                "logprobs_file": self._write_logprobs(run.logprobs),
                "generation_peak_bytes": reading.peak_delta_bytes if reading is not None else None,
                "memory_method": reading.method if reading is not None else None, "problems": problems}

    def park(self, request: dict[str, Any]) -> dict[str, Any]:
        """``--opt-ab-mode=blocks``: move the configuration's model to the host (``to: host``) while the candidate
        runs its block, or back to its device (``to: device``)."""
        from .parking import park

        key = str(request["key"])
        configuration = self._configurations.get(key)
        if configuration is None:
            raise ValueError(f"no configuration loaded under the key {key!r} (load it first; a skipped load has none)")
        model = self._opt_model(configuration).model
        seconds = park(model, "cpu" if request.get("to") == "host" else configuration.device)
        return {"ok": True, "seconds": seconds}

    def census(self, request: dict[str, Any]) -> dict[str, Any]:
        """The configuration's execution census, taken as the candidate takes its own (``census_of``: one untimed
        generate call of the workload under the profiler): ``census`` (None where it could not be taken) and
        ``why_not``."""
        from .census import census_of
        from .generation import run_generation

        key = str(request["key"])
        configuration = self._configurations.get(key)
        if configuration is None:
            raise ValueError(f"no configuration loaded under the key {key!r} (load it first; a skipped load has none)")
        opt = self._opt_model(configuration)
        prompts, max_new_tokens = [str(p) for p in request["prompts"]], int(request["max_new_tokens"])
        census, why_not, _trace = census_of(
            opt, lambda **kwargs: run_generation(opt, prompts, max_new_tokens, batch_size=request.get("batch_size"),
                                                 **kwargs),
            cuda=self.hardware(configuration.device).is_cuda,
            recompiles=configuration.recompiles if opt.generation.compile else None)
        return {"ok": True, "census": census, "why_not": why_not}

    # -- pieces ---------------------------------------------------------------------------------------
    def registry(self, conftests: list[str]) -> tuple[TechniqueRegistry, str | None]:
        """The catalogue with every given conftest's registrations; a skip reason when one cannot be loaded."""
        from ..techniques import build_registry

        if self._registry is None:
            self._registry = build_registry()
        skip = None
        for path in conftests:
            if path not in self._conftest_errors:
                self._conftest_errors[path] = self._register_from(Path(path), self._registry)
            if self._conftest_errors[path] is not None and skip is None:
                skip = f"the reference environment could not load {path}: {self._conftest_errors[path]}"
        return self._registry, skip

    @staticmethod
    def _register_from(path: Path, registry: TechniqueRegistry) -> str | None:
        """Import a conftest as pytest's default import mode would, and call its
        ``pytest_opt_register_techniques``; None when that worked, else why not (one line)."""
        import importlib

        folder, name = conftest_module_name(path)
        try:
            if str(folder) not in sys.path:
                sys.path.insert(0, str(folder))
            if name == "conftest":  # one top-level conftest module at a time, as pytest does
                sys.modules.pop("conftest", None)
            module = importlib.import_module(name)
            if Path(getattr(module, "__file__", "") or "").resolve() != path.resolve():
                return f"importing it as {name!r} found {getattr(module, '__file__', None)} instead"
            register = getattr(module, "pytest_opt_register_techniques", None)
            if register is not None:
                register(registry=registry)
        except BaseException as exc:  # noqa: BLE001 - a conftest may raise anything, SystemExit included
            traceback.print_exc()  # to stderr: the client keeps the last lines
            return one_line(exc)
        return None

    def hardware(self, device: str) -> HardwareInfo:
        """Probed once per device; torch's CPU threads set with it (``PYTEST_OPT_CPU_THREADS``), before any model runs."""
        if device not in self._hardware:
            from .cpu_threads import apply_cpu_threads, parse_cpu_threads
            from .hardware import probe_hardware
            from .measure import freeze_long_lived_objects

            freeze_long_lived_objects()  # as the session does: each memory reading's collection stays quick
            hardware = probe_hardware(device)
            apply_cpu_threads(parse_cpu_threads(os.environ.get(THREADS_ENV) or "auto"), hardware)
            self._hardware[device] = hardware
        return self._hardware[device]

    def _probed(self, registry: TechniqueRegistry, specs: list[Any], request: ModelRequest, path: str,
                device: str) -> tuple[list[Technique], ProbeContext, str | None]:
        """The techniques resolved in this environment, the probe context and the first probe's refusal."""
        from ..compat import config_as_loaded
        from ..errors import OptConfigError
        from ..techniques import ProbeContext, TechniqueSpec
        from ..techniques.base import checked_probe
        from .loading import read_model_config

        techniques = [registry.resolve(TechniqueSpec.of(str(name), **dict(params or {})), "its catalogue")
                      for name, params in specs]
        config = config_as_loaded(read_model_config(request, path), dict(request.from_pretrained_kwargs))
        dtype = request.dtype or str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
        context = ProbeContext(hardware=self.hardware(device), model_config=config, dtype=dtype)
        for technique in techniques:
            if technique.runs_in_subprocesses:
                return techniques, context, (f"an A/B reference does not run {technique.label()} (its rounds run "
                                             f"in torchrun processes)")
            reason = checked_probe(technique, context)
            if reason is not None:
                return techniques, context, f"in the reference environment: {reason}"
        return techniques, context, None

    def _cache(self, device: str) -> ModelCache:
        from .loading import ModelCache

        if device not in self._models:
            self._models[device] = ModelCache(device, max_models=MAX_LOADED_MODELS)
        return self._models[device]

    def _loaded(self, configuration: _Configuration) -> LoadedModel:
        from .loading import load_model

        load_time = [t for t in configuration.techniques if t.load_time]
        cache = self._cache(configuration.device)
        return cache.get(configuration.load_key, lambda: load_model(configuration.request, configuration.path, load_time,
                                                                    configuration.context, configuration.device,
                                                                    configuration.load_key))

    def _opt_model(self, configuration: _Configuration) -> OptModel:
        """The configuration's ``OptModel``, built once as ``OptSession.opt_model`` builds one (again only when
        its weights were evicted meanwhile and loaded afresh)."""
        from ..techniques import GenerationSettings
        from .model import OptModel

        loaded = self._loaded(configuration)
        if configuration.opt is None or configuration.opt.loaded is not loaded:
            generation = GenerationSettings()
            for technique in configuration.techniques:
                technique.configure_generation(generation, configuration.context)
            configuration.opt = OptModel(loaded=loaded, techniques=configuration.techniques, generation=generation,
                                         request=configuration.request, device=configuration.device,
                                         probe_context=configuration.context)
        return configuration.opt

    def _write_logprobs(self, logprobs: list[Any] | None) -> str | None:
        if logprobs is None:
            return None
        from safetensors.torch import save_file

        self._files += 1
        path = self.scratch / f"logprobs-{self._files}.safetensors"
        save_file({str(i): t.detach().float().cpu().contiguous() for i, t in enumerate(logprobs)}, str(path))
        return str(path)


def _send(protocol: BinaryIO, payload: dict[str, Any]) -> None:
    protocol.write(json.dumps(payload, default=str).encode() + b"\n")


def serve(protocol: BinaryIO, stdin: BinaryIO, scratch: Path) -> int:
    worker = Worker(scratch)
    while True:
        line = stdin.readline()
        if not line:
            return 0  # end of input: the client is gone
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError(f"a request is a JSON object, not {type(request).__name__}")
            response = worker.handle(request)
        except Exception as exc:  # noqa: BLE001 - every failure is this request's answer; the worker goes on
            traceback.print_exc()
            response = {"ok": False, "error": one_line(exc), "traceback": traceback.format_exc()[-8000:]}
        if response is None:
            _send(protocol, {"ok": True, "event": "closed"})
            return 0
        _send(protocol, response)


def main() -> int:
    protocol = take_protocol_stream()
    die_with_parent()
    drop_working_directory_from_path()
    try:
        import_the_stack()
    except StackUnavailable as exc:
        _send(protocol, {"ok": False, "error": str(exc), "python": sys.executable})
        return IMPORT_FAILED_STATUS
    from .repeated_messages import new_session

    new_session()
    scratch = Path(tempfile.mkdtemp(prefix="opt-ab-worker-"))
    try:
        _send(protocol, {"ok": True, "event": "ready", "python": sys.executable,
                         "python_version": platform.python_version(), "versions": installed_distributions(), "pid": os.getpid(),
                         "package": str(Path(__file__).resolve().parents[1]), "scratch": str(scratch)})
        return serve(protocol, sys.stdin.buffer, scratch)
    except BrokenPipeError:  # the client stopped reading: it is gone
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
