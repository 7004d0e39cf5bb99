"""One GPU set per pytest-xdist worker: ``pytest -n K --opt-gpus-per-worker=G``.

Each worker ``gwI`` gets its own ``G`` GPUs through ``CUDA_VISIBLE_DEVICES`` (``visible[I*G:(I+1)*G]``),
so a multi-GPU runner measures tests in parallel without two workers sharing a device; the
workers' report entries are merged by the controller as usual.

Where the GPUs come from: the controller's ``CUDA_VISIBLE_DEVICES`` (inherited by every worker;
indices, ``GPU-...``/``MIG-...`` UUIDs) when it is set, else every device NVML counts. NVML is used
on purpose: counting with torch could initialise CUDA in the worker, after which
``CUDA_VISIBLE_DEVICES`` is read and fixed for the life of the process.

The controller checks the plan before any worker starts (a usage error naming the numbers when
``K * G`` GPUs are not there), and ``-n auto`` starts one worker per ``G`` GPUs.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, Mapping, MutableMapping

import pytest

from ..errors import OptConfigError
from ..units import parse_non_negative_int

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
OPTION_DEST = "opt_gpus_per_worker"
OPTION_FLAG = "--opt-gpus-per-worker"
ENV_VAR = "PYTEST_OPT_GPUS_PER_WORKER"
INI_KEY = "opt_gpus_per_worker"
PLUGIN_NAME = "transformers-opt-gpu-pinning"
PINNED_KEY = pytest.StashKey[str]()  # the worker's one-line description, once pinned

_WORKER_ID = re.compile(r"gw(\d+)")


# -- pure logic (no process state) -------------------------------------------------------------------
def parse_visible_devices(value: str) -> list[str]:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value names, in order.

    ``""`` names none. Blanks around entries are ignored, as are empty entries and repeats. As CUDA
    does, a negative index (``-1``, the usual "no GPU") hides it and every entry after it.
    """
    devices: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if re.fullmatch(r"-\d+", entry):
            break
        if entry not in devices:
            devices.append(entry)
    return devices


def parse_gpus_per_worker(value: str) -> int:
    """``--opt-gpus-per-worker``: a whole number of GPUs, at least one."""
    return parse_non_negative_int(value, "GPUs per worker", minimum=1)


def visible_gpus(env: Mapping[str, str], device_count: Callable[[], int]) -> list[str]:
    """The GPUs this process may share out: ``CUDA_VISIBLE_DEVICES`` when set, else ``0..device_count()-1``.

    ``device_count`` is called only when the variable is unset; the real caller passes
    :func:`nvml_device_count`, which counts without initialising CUDA.
    """
    if CUDA_VISIBLE_DEVICES in env:
        return parse_visible_devices(env[CUDA_VISIBLE_DEVICES])
    return [str(i) for i in range(max(0, int(device_count())))]


def describe_source(env: Mapping[str, str]) -> str:
    """Where :func:`visible_gpus` took its list from, for messages."""
    if CUDA_VISIBLE_DEVICES in env:
        value = env[CUDA_VISIBLE_DEVICES]
        return f"{CUDA_VISIBLE_DEVICES}={value}" if value.strip() else f"{CUDA_VISIBLE_DEVICES}={value!r}"
    return f"{CUDA_VISIBLE_DEVICES} unset, devices counted by NVML"


def worker_index(worker_id: str) -> int:
    """``gw3`` -> 3; anything else is an ``OptConfigError``."""
    match = _WORKER_ID.fullmatch(str(worker_id))
    if match is None:
        raise OptConfigError(f"{OPTION_FLAG}: {worker_id!r} is not a pytest-xdist worker id; accepted: gw0, gw1, ...")
    return int(match.group(1))


def check_capacity(gpus_per_worker: int, visible: list[str], workers: int, source: str | None = None) -> None:
    """Raise ``OptConfigError`` unless ``workers * gpus_per_worker`` GPUs are visible."""
    if isinstance(gpus_per_worker, bool) or not isinstance(gpus_per_worker, int) or gpus_per_worker < 1:
        raise OptConfigError(f"{OPTION_FLAG}: {gpus_per_worker!r} must be a whole number >= 1")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise OptConfigError(f"{OPTION_FLAG}: the worker count {workers!r} must be a whole number >= 1")
    needed = workers * gpus_per_worker
    if needed > len(visible):
        where = source or f"{CUDA_VISIBLE_DEVICES}={','.join(visible)}"
        raise OptConfigError(
            f"{OPTION_FLAG}={gpus_per_worker} with -n {workers} needs {needed} GPUs; found: {len(visible)} ({where}). "
            f"Use fewer workers (-n {len(visible) // gpus_per_worker or 1}) or fewer GPUs per worker, or set "
            f"{CUDA_VISIBLE_DEVICES} to the GPUs to share out"
        )


def typed_on_command_line(source: str) -> bool:
    """Whether the setting was typed for this run (an error when it cannot apply) rather than set project-wide
    in the ini or the environment (then a note: the run goes on unpinned)."""
    return source == OPTION_FLAG


def unpinned_note(source: str, gpus_per_worker: int, visible: list[str], workers: int | None,
                  env: Mapping[str, str]) -> str | None:
    """Why a project-wide ``opt_gpus_per_worker`` does not apply to this run (too few GPUs for the workers),
    or None when it does."""
    needed = (workers or 1) * gpus_per_worker
    if needed <= len(visible):
        return None
    run = f"-n {workers} needs {needed}" if workers else f"-n auto needs at least {gpus_per_worker}"
    return (f"GPU pinning: {source}={gpus_per_worker} is not applied to this run ({run} GPU{'s' if needed > 1 else ''}; "
            f"found: {len(visible)} ({describe_source(env)})); the workers share the device as without it")


def assign_gpus(worker_id: str, gpus_per_worker: int, visible: list[str], workers: int,
                source: str | None = None) -> list[str]:
    """The GPUs of worker ``gwI``: ``visible[I*G:(I+1)*G]``.

    Raises ``OptConfigError`` for a malformed worker id or when ``workers * G`` exceeds what is
    visible. A worker index at or past ``workers`` is a replacement that pytest-xdist started for a
    crashed worker (it numbers them on); it takes the slot ``I % workers``, which is the crashed
    worker's when the workers crash in order, and may otherwise share GPUs with a live worker.
    """
    index = worker_index(worker_id)
    check_capacity(gpus_per_worker, visible, workers, source)
    slot = index % workers
    return list(visible[slot * gpus_per_worker:(slot + 1) * gpus_per_worker])


# -- process state: options, NVML, the environment ---------------------------------------------------
def nvml_device_count() -> int:
    """GPUs NVML sees (all of them; NVML ignores ``CUDA_VISIBLE_DEVICES``); 0 without NVML or a driver.

    Never touches CUDA, so ``CUDA_VISIBLE_DEVICES`` can still be changed afterwards.
    """
    try:
        import pynvml  # from nvidia-ml-py
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver / no libnvidia-ml: no GPU to share out
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def gpus_per_worker_setting(config: Any, env: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """(value, source) of ``--opt-gpus-per-worker``: CLI, then ``PYTEST_OPT_GPUS_PER_WORKER``, then ini.

    A bad environment or ini value is a ``pytest.UsageError`` naming its source (the CLI value was
    already checked by the option's parser).
    """
    env = os.environ if env is None else env
    cli = config.getoption(OPTION_DEST, None)
    if cli is not None:
        raw, source = cli, OPTION_FLAG
    else:
        raw, source = env.get(ENV_VAR), ENV_VAR
        if raw is not None and not raw.strip():
            raw = None  # empty counts as unset, as for every PYTEST_OPT_* variable (options.py)
        if raw is None:
            try:
                raw = config.getini(INI_KEY) or None
            except (ValueError, KeyError):  # the ini key is not registered (plugin not loaded)
                raw = None
            source = f"ini {INI_KEY}"
    if raw is None:
        return None, "default"
    try:
        return parse_gpus_per_worker(str(raw).strip()), source
    except OptConfigError as exc:
        raise pytest.UsageError(f"{source}: {exc}") from None


def _cuda_initialised() -> bool:
    """True when torch is imported and has initialised CUDA in this process (never imports torch)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    try:
        return bool(is_initialized()) if callable(is_initialized) else False
    except Exception:
        return False


def pin_worker(config: Any, *, env: MutableMapping[str, str] | None = None,
               device_count: Callable[[], int] = nvml_device_count) -> str | None:
    """Pin this pytest-xdist worker to its own GPUs by setting ``CUDA_VISIBLE_DEVICES``.

    Must run before anything initialises CUDA in the worker process: CUDA reads
    ``CUDA_VISIBLE_DEVICES`` once, when it initialises, and ignores later changes. It is therefore
    called from ``pytest_configure`` with ``tryfirst=True`` (:class:`GpuPinningPlugin`), before the
    other plugins configure and before any test or fixture runs. (A conftest that initialises
    CUDA at import time runs earlier still and defeats it; importing torch alone is harmless.)

    Returns a one-line description (``"gw1 pinned to GPUs 2,3"``), or None when there is nothing to
    pin: the option is not set, or this is not an xdist worker (the controller runs no test).
    Raises ``OptConfigError`` when the GPUs do not suffice, the worker id is malformed, or torch
    already initialised CUDA in this process (pinning would silently do nothing).
    """
    env = os.environ if env is None else env
    gpus_per_worker, source = gpus_per_worker_setting(config, env)
    workerinput = getattr(config, "workerinput", None)
    if gpus_per_worker is None or workerinput is None:
        return None
    worker_id = str(workerinput.get("workerid", ""))
    workers = int(workerinput.get("workercount", 0) or 0)
    visible = visible_gpus(env, device_count)
    if not typed_on_command_line(source) and unpinned_note(source, gpus_per_worker, visible, workers, env):
        return None  # the controller said so in its header; this worker runs unpinned
    gpus = assign_gpus(worker_id, gpus_per_worker, visible, workers, describe_source(env))
    value = ",".join(gpus)
    if _cuda_initialised() and env.get(CUDA_VISIBLE_DEVICES) != value:
        raise OptConfigError(
            f"{source}={gpus_per_worker}: cannot pin {worker_id} to GPUs {value}: torch already initialised CUDA "
            f"in this worker (with {describe_source(env)}), and CUDA reads {CUDA_VISIBLE_DEVICES} only when it "
            f"initialises. Something initialised CUDA before pytest_configure (a conftest or plugin calling "
            f"torch.cuda at import time); move that into a fixture, or set {CUDA_VISIBLE_DEVICES} per worker yourself"
        )
    env[CUDA_VISIBLE_DEVICES] = value
    description = f"{worker_id} pinned to GPUs {value}"
    if worker_index(worker_id) >= workers:
        description += f" (replacement worker, slot of gw{worker_index(worker_id) % workers})"
    return description


# -- controller side: check the plan, size -n auto -----------------------------------------------------
def xdist_worker_count(config: Any) -> int | None:
    """How many workers pytest-xdist will start (after ``-n``/``--tx`` resolution), or None without xdist."""
    if getattr(config, "workerinput", None) is not None:
        return None
    if config.getoption("dist", "no") == "no":
        return None
    specs = config.getoption("tx", None) or []
    count = 0
    for spec in specs:
        head, star, _ = str(spec).partition("*")
        count += int(head) if star and head.isdigit() else 1
    return count or None


def plan_description(config: Any, *, env: Mapping[str, str] | None = None,
                     device_count: Callable[[], int] = nvml_device_count) -> str | None:
    """On the controller: check that ``-n K`` workers can have ``G`` GPUs each, and describe the plan.

    Raises ``pytest.UsageError`` (before any worker starts) when they cannot; returns None when the
    option is not set, and a line saying it has no effect when the run is not distributed.
    """
    env = os.environ if env is None else env
    gpus_per_worker, source = gpus_per_worker_setting(config, env)
    if gpus_per_worker is None or getattr(config, "workerinput", None) is not None:
        return None
    workers = xdist_worker_count(config)
    if workers is None:
        return f"GPU pinning: {source}={gpus_per_worker} has no effect without pytest-xdist workers (-n K)"
    visible = visible_gpus(env, device_count)
    if not typed_on_command_line(source):
        note = unpinned_note(source, gpus_per_worker, visible, workers, env)
        if note:
            return note
    try:
        check_capacity(gpus_per_worker, visible, workers, describe_source(env))
    except OptConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    slots = "; ".join(f"gw{i}: {','.join(visible[i * gpus_per_worker:(i + 1) * gpus_per_worker])}"
                      for i in range(workers))
    return (f"GPU pinning: {workers} workers x {gpus_per_worker} GPU{'s' if gpus_per_worker > 1 else ''} "
            f"from {describe_source(env)} ({slots})")


def auto_num_workers(config: Any, *, env: Mapping[str, str] | None = None,
                     device_count: Callable[[], int] = nvml_device_count) -> int | None:
    """For ``-n auto``: one worker per ``G`` visible GPUs, or None (xdist decides) when the option is unset."""
    env = os.environ if env is None else env
    gpus_per_worker, source = gpus_per_worker_setting(config, env)
    if gpus_per_worker is None:
        return None
    visible = visible_gpus(env, device_count)
    if len(visible) < gpus_per_worker and not typed_on_command_line(source):
        return None  # not applied (plan_description says so): xdist sizes -n auto as without it
    if len(visible) < gpus_per_worker:
        raise pytest.UsageError(f"{source}={gpus_per_worker} with -n auto needs at least {gpus_per_worker} "
                                f"GPU{'s' if gpus_per_worker > 1 else ''}; found: {len(visible)} ({describe_source(env)})")
    return len(visible) // gpus_per_worker


class GpuPinningPlugin:
    """The hooks; ``plugin.py`` registers one instance (see ``PLUGIN_NAME``)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        try:
            description = pin_worker(config) if hasattr(config, "workerinput") else plan_description(config)
        except OptConfigError as exc:
            raise pytest.UsageError(str(exc)) from None
        if description:
            config.stash[PINNED_KEY] = description

    def pytest_report_header(self, config: pytest.Config) -> str | None:
        description = config.stash.get(PINNED_KEY, None)
        return f"transformers-opt: {description}" if description else None

    @pytest.hookimpl(tryfirst=True, optionalhook=True)
    def pytest_xdist_auto_num_workers(self, config: pytest.Config) -> int | None:
        return auto_num_workers(config)
