"""torch's intra-op threads on CPU: each pytest-xdist worker gets its share of the cores.

torch starts as many OpenMP threads per process as the machine has cores. Under ``pytest -n N`` that is
N x cores spinning threads on the same cores: they fight each other and every neighbour, and one
``generate`` of a small model ran 4-10x slower than on one thread (issue 19, item 25). ``auto`` gives
each worker ``max(1, cores // workers)``; on CUDA the setting is left alone (the GPU does the work).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import OptConfigError

if TYPE_CHECKING:
    from .hardware import HardwareInfo

AUTO = "auto"
MAX_CPU_THREADS = 4096
CPU_THREADS_FORMS = f"a thread count (1 to {MAX_CPU_THREADS}) or auto (the cores divided among pytest-xdist workers)"


def parse_cpu_threads(value: str) -> int | None:
    """``auto`` -> None (decided per process); ``N`` -> N threads."""
    text = str(value).strip().lower()
    if text == AUTO:
        return None
    if text.isdigit() and 1 <= int(text) <= MAX_CPU_THREADS:
        return int(text)
    raise OptConfigError(f"{value!r} is not a CPU thread count; accepted: {CPU_THREADS_FORMS}")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, as taskset or a container sets it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def xdist_workers() -> int:
    """How many pytest-xdist workers share the machine (1 outside xdist): xdist sets the count in each
    worker's environment."""
    raw = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def threads_for_this_process(setting: int | None, cores: int, workers: int) -> int:
    """The thread count: the one set, else this worker's share of the cores."""
    return setting if setting is not None else max(1, cores // max(1, workers))


def apply_cpu_threads(setting: int | None, hardware: HardwareInfo) -> None:
    """On CPU, set torch's intra-op threads; record in ``hardware.cpu_threads`` what torch uses (also on
    CUDA, where it is left as it was)."""
    import torch

    if not hardware.is_cuda:
        torch.set_num_threads(threads_for_this_process(setting, usable_cores(), xdist_workers()))
    hardware.cpu_threads = int(torch.get_num_threads())
