"""Clocks and memory gauges: every figure the plugin gates comes from here.

Timing: the device is synchronised before each clock read, so CUDA work queued by ``generate`` is
counted where it ran. Memory: on CUDA, ``reset_peak_memory_stats``/``max_memory_allocated`` (what
torch allocated) plus NVML (what the device reports in use, including what torch does not see);
on CPU, the process high-water mark ``VmHWM`` after resetting it through ``/proc/self/clear_refs``,
with a sampling thread as the fallback where that file is not writable. Figures are deltas over
what was resident before, so models already cached in the session do not count.
"""

from __future__ import annotations

import gc
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterator
from contextlib import contextmanager

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


# CPython keeps a thread's Python frames in chunks of 16 KiB that it maps when the stack outgrows one and
# unmaps when the stack shrinks back (Python/pystate.c: push_chunk, _PyThreadState_PopFrame). A pytest
# session's stack is deep; where a chunk boundary falls inside generate()'s call tree, every crossing maps and
# unmaps a chunk and faults its pages in. On this project's 2-core VM that made the same tiny-model generate
# 7% slower in the pytest process (116 page faults a call) than in the A/B worker, whose stack is shallow
# (0 faults), and the A/B null judged a regression (benchmarks/RESULTS.md, "the null's bias, found").
# Timed calls therefore start in a frame that reserves STACK_HEADROOM_BYTES: the chunk it is given holds it
# twice over, so what the call stacks on top finds that much room before the next boundary.
STACK_HEADROOM_BYTES = 256 * 1024


def _call(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return function(*args, **kwargs)


def _with_reserved_stack(function: Any) -> Any:
    try:  # a larger co_stacksize than the code needs only reserves frame space the interpreter never touches
        function.__code__ = function.__code__.replace(co_stacksize=STACK_HEADROOM_BYTES // 8)
    except (AttributeError, TypeError, ValueError):  # another interpreter: the call goes through as it is
        pass
    return function


_call_with_headroom = _with_reserved_stack(_call)


def call_with_stack_headroom(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` with ``STACK_HEADROOM_BYTES`` of Python frame stack free above it, wherever
    the caller's stack ends: a timed region neither pays for mapping stack chunks nor depends on how deep the
    caller (pytest, a worker) called it."""
    return _call_with_headroom(function, args, kwargs)


def synchronize(device: str) -> None:
    """Wait for queued device work so a clock read after it is honest."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def now(device: str) -> float:
    """A monotonic clock reading taken after the device finished its queued work."""
    synchronize(device)
    return time.perf_counter()


def _status_kib(field_name: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def current_rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def _reset_high_water_mark() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); False where not allowed."""
    try:
        with _CLEAR_REFS.open("w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


@dataclass
class PeakReading:
    """Peak memory over a region, as a delta over what was resident when it started."""

    peak_delta_bytes: int | None = None
    resident_delta_bytes: int | None = None  # still held when the region ended
    method: str = ""
    device_used_bytes: int | None = None  # NVML: memory in use on the device at the peak reading
    reserved_peak_delta_bytes: int | None = None  # CUDA: the caching allocator's reserved peak (fragmentation shows here)


class _RssSampler:
    """Fallback for kernels without clear_refs: sample RSS every few milliseconds."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peak = current_rss_bytes() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_bytes() or 0)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "_RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_bytes() or 0)


def _nvml_used_bytes(device: str) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            from .hardware import nvml_handle

            handle = nvml_handle(pynvml, int(device.split(":")[1]) if ":" in device else 0)
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


_LIBC_TRIM: list[Any] = []  # glibc's malloc_trim, looked up once (empty list: not looked up yet)


def return_freed_memory() -> None:
    """Hand memory the process freed back to the system (glibc's ``malloc_trim(0)``; a no-op elsewhere).

    glibc keeps freed blocks in its heap: after a load that held float weights for a moment (a load-time
    quantization, a converter), RSS stays high until something reuses them, so a "resident" reading
    counted the transient and the next region's allocations came for free. Either way a figure said
    more about what ran before than about the region measured (sdpa read 0.74x or 1.17x of eager
    depending on which loaded first)."""
    if not _LIBC_TRIM:
        try:
            import ctypes

            _LIBC_TRIM.append(ctypes.CDLL("libc.so.6").malloc_trim)
        except (OSError, AttributeError):
            _LIBC_TRIM.append(None)
    trim = _LIBC_TRIM[0]
    if trim is not None:
        trim(0)


_SMAPS = Path("/proc/self/smaps")
_MAPS = Path("/proc/self/maps")  # the same mappings without their page counts
_MADV_DONTNEED = 4  # Linux: drop the range's pages from this process; file pages fault back in from the file
MappingKey = tuple[int, int, str]  # (start, end, path)


def _file_mapping_key(line: str) -> MappingKey | None:
    """The key of a maps/smaps mapping line that maps a regular file's data, else None (also for smaps' field lines)."""
    parts = line.split()
    if not parts or "-" not in parts[0] or len(parts) < 5 or parts[0].endswith(":"):
        return None
    path = " ".join(parts[5:])
    # a file's data (torch maps safetensors "rw-p"), never code, a device or a deleted file
    regular = path.startswith("/") and not path.startswith(("/dev/", "/memfd:")) and "(deleted)" not in path
    if not regular or parts[1][2] == "x":
        return None
    start, end = (int(x, 16) for x in parts[0].split("-"))
    return start, end, path


def mapped_files() -> set[MappingKey]:
    """The keys of :func:`file_mappings`, read from ``/proc/self/maps``: 2 ms where smaps took 55 ms in a process
    with torch and transformers imported (the kernel counts every mapping's pages for smaps); what a load's
    "before" needs. Empty where it cannot be read."""
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return set()
    return {key for key in map(_file_mapping_key, lines) if key is not None}


def file_mappings() -> dict[MappingKey, tuple[int, int]]:
    """This process's non-executable mappings of regular files: (start, end, path) -> (Rss, Anonymous)
    bytes; empty where ``/proc/self/smaps`` cannot be read."""
    mappings: dict[MappingKey, tuple[int, int]] = {}
    key: MappingKey | None = None
    rss = 0
    try:
        lines = _SMAPS.read_text().splitlines()
    except OSError:
        return mappings
    for line in lines:
        if line[:1].isupper():  # a field line ("Rss:   12 kB") of the mapping above
            if key is not None and line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif key is not None and line.startswith("Anonymous:"):
                mappings[key] = (rss, int(line.split()[1]) * 1024)
        else:
            key = _file_mapping_key(line)
    return mappings


def release_file_pages(since: Collection[MappingKey]) -> int:
    """Drop this process's resident pages of file mappings made after ``since`` was read (the checkpoint
    files a load mapped) that hold nothing but the file's own bytes; the bytes dropped.

    A load-time quantization reads the float checkpoint through its memory map; its float tensors that
    stay (embeddings, norms) are views into that map, so the whole map stays, and every page the
    quantizer read stays resident (measured: 405 MiB of smollm2-135m's 513 MiB after bnb_8bit on CPU,
    beside 209 MiB of weights). Pages of a mapping without private (copied-on-write, "Anonymous") pages
    are the file's bytes: dropped, those the model uses fault back in from the file on its next touch,
    so what is resident after one forward pass is what the configuration uses. A mapping with any
    private page is left alone (dropping it would lose a write)."""
    released = 0
    mappings = {key: value for key, value in file_mappings().items() if key not in since}
    if not mappings:
        return 0
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        return 0
    for (start, end, _path), (rss, anonymous) in mappings.items():
        if rss and not anonymous and madvise(start, end - start, _MADV_DONTNEED) == 0:
            released += rss
    return released


@contextmanager
def track_peak_memory(device: str) -> Iterator[PeakReading]:
    """Measure the peak memory of the enclosed region on ``device`` (see module docstring)."""
    reading = PeakReading()
    gc.collect()
    if device.startswith("cuda"):
        import torch

        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        reserved_before = torch.cuda.memory_reserved(device)
        try:
            yield reading
        finally:
            synchronize(device)
            reading.peak_delta_bytes = int(torch.cuda.max_memory_allocated(device) - before)
            reading.resident_delta_bytes = int(torch.cuda.memory_allocated(device) - before)
            reading.reserved_peak_delta_bytes = int(torch.cuda.max_memory_reserved(device) - reserved_before)
            reading.device_used_bytes = _nvml_used_bytes(device)
            reading.method = "torch.cuda.max_memory_allocated"
        return
    return_freed_memory()
    before = current_rss_bytes()
    if before is not None and _reset_high_water_mark():
        try:
            yield reading
        finally:
            peak_kib = _status_kib("VmHWM")
            gc.collect()
            return_freed_memory()  # what the region still holds, not what it freed
            after = current_rss_bytes()
            reading.peak_delta_bytes = None if peak_kib is None else max(0, peak_kib * 1024 - before)
            reading.resident_delta_bytes = None if after is None else max(0, after - before)
            reading.method = "VmHWM"
        return
    sampler = _RssSampler()
    with sampler:
        yield reading
    after = current_rss_bytes()
    reading.peak_delta_bytes = max(0, sampler.peak - (before or 0)) if before is not None else None
    reading.resident_delta_bytes = max(0, (after or 0) - (before or 0)) if before is not None else None
    reading.method = "RSS sampling"


LOAD_TRANSIENT_NOTE_RATIO = 1.25  # a load peak this far above the running peak is worth a line ...
LOAD_TRANSIENT_NOTE_BYTES = 16 * 2**20  # ... and this much above it (a tiny model's loader buffers are not)


def load_transient_note(side: Any) -> str | None:
    """A line for the test's notes when the optimized side's load held much more than it runs in (a
    load-time quantization reads the float weights first): where the figures come from, so a
    reader does not take the load for the configuration."""
    load_peak, peak = getattr(side, "load_peak_bytes", None), getattr(side, "peak_memory_bytes", None)
    if not load_peak or not peak or load_peak < max(LOAD_TRANSIENT_NOTE_RATIO * peak, peak + LOAD_TRANSIENT_NOTE_BYTES):
        return None
    from ..units import format_bytes

    return (f"loading peaked at {format_bytes(load_peak)} (load_peak_bytes: what loading held beyond what the "
            f"configuration keeps, e.g. float weights while they are quantized), the configuration then runs in {format_bytes(peak)} (resident "
            f"{format_bytes(side.resident_bytes or 0)} + generation {format_bytes(side.generation_peak_bytes or 0)}); "
            f"the memory ratio compares the running peaks, max_memory checks both")


_frozen_with_modules: tuple[int, str, int] | None = None  # what _imported() said when this process last froze


def _imported() -> tuple[int, str, int]:
    """How many modules are imported, and the latest one (a module removed and another imported, or the same one
    imported again, as pytester's in-process runs do, changes it too)."""
    last = next(reversed(sys.modules), "")
    return len(sys.modules), last, id(sys.modules.get(last))


def freeze_long_lived_objects() -> None:
    """Move every object alive now (torch's and transformers' modules, classes, functions: 300k+ of them)
    out of the garbage collector's sight; again whenever modules were imported since the last time.

    Every memory reading starts with a full collection so that tensors in reference cycles are gone;
    with the stack imported one collection scans all of it, 0.16 s on this 2-core machine (0.35 s in a
    process that ran pytester sessions), several times a test. Frozen, a collection scans only what was
    made since: models and what they leave behind are still collected. Garbage is collected first, so
    nothing dead is frozen.

    Called when the session first probes the hardware and before each of its tests: what a test imports
    later (a model's architecture, bitsandbytes, quanto, inductor: 265k objects in the matrix of tiny
    models) is frozen before the next test, or each later collection scanned it (40-110 ms each, a third of
    a cell's time). Nothing is frozen where no module was imported since, so a test's models are frozen only
    where they outlive a test that imported something: :func:`release_memory` then collects them with
    ``thaw``. Never undone: a second session in the same process (``pytest.main`` called again, pytester's
    in-process runs) finds the stack frozen and pays no second full collection."""
    global _frozen_with_modules
    if _imported() == _frozen_with_modules:
        return
    gc.collect()
    gc.freeze()
    _frozen_with_modules = _imported()


def release_memory(device: str, thaw: bool = False) -> None:
    """Drop unreferenced tensors and return cached device blocks. ``thaw``: also what was alive when the
    process last froze and is garbage now (a model that a freeze found cached, compiled graphs that held
    weights): every object is collected once (0.2-0.4 s), then frozen again."""
    if thaw and _frozen_with_modules is not None:
        gc.unfreeze()
        gc.collect()
        gc.freeze()
    else:
        gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def median(values: list[float]) -> float | None:
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


@dataclass
class RoundTiming:
    """One measured round: the whole workload once (all its batches)."""

    latency_s: float  # wall time per generate call (mean over the round's batches)
    ttft_s: float | None  # time to the first token per call (mean over the round's batches)
    steps: int  # new tokens per sequence
    tokens: int  # tokens generated over the whole round
    total_s: float  # wall time of the whole round

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.steps <= 1:
            return None
        return (self.latency_s - self.ttft_s) / (self.steps - 1)


@dataclass
class Timings:
    """The measured rounds of one side (baseline or optimized); warm-up rounds are kept apart."""

    rounds: list[RoundTiming] = field(default_factory=list)
    warmup_s: list[float] = field(default_factory=list)

    def latency_samples(self) -> list[float]:
        return [r.latency_s for r in self.rounds]

    def ttft_samples(self) -> list[float]:
        """Each round's time to the first token (rounds that measured it): ``ttft_s`` is their median."""
        return [r.ttft_s for r in self.rounds if r.ttft_s is not None]

    def tpot_samples(self) -> list[float]:
        return [tpot for tpot in (r.tpot_s for r in self.rounds) if tpot is not None]

    def throughput_samples(self) -> list[float]:
        return [r.tokens / r.total_s for r in self.rounds if r.total_s > 0]

    @property
    def latency_s(self) -> float | None:
        return median(self.latency_samples())

    @property
    def ttft_s(self) -> float | None:
        return median(self.ttft_samples())

    @property
    def tpot_s(self) -> float | None:
        return median(self.tpot_samples())

    @property
    def throughput_tok_s(self) -> float | None:
        return median(self.throughput_samples())

    @property
    def tokens(self) -> int:
        return self.rounds[0].tokens if self.rounds else 0
