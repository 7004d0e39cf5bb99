"""The CUDA branch of peak-memory measurement, against a faked caching allocator (no GPU here)."""

from __future__ import annotations

import pytest
import torch

from pytest_transformers_opt.engine import measure


class FakeAllocator:
    """What torch.cuda's allocator statistics would say while a region allocates and frees."""

    def __init__(self) -> None:
        self.allocated, self.reserved = 100, 200
        self.peak_allocated, self.peak_reserved = 100, 200
        self.calls: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: self.calls.append("sync"))
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak_allocated)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(measure, "_nvml_used_bytes", lambda device: 5_000)

    def reset(self, device: object = None) -> None:
        self.calls.append("reset")
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def work(self, peak: int, reserved_peak: int, left: int) -> None:
        self.peak_allocated = max(self.peak_allocated, self.allocated + peak)
        self.peak_reserved = max(self.peak_reserved, self.reserved + reserved_peak)
        self.allocated += left


def test_cuda_peak_is_the_allocators_peak_over_the_region_with_reserved_and_nvml(monkeypatch):
    allocator = FakeAllocator()
    allocator.install(monkeypatch)
    allocator.peak_allocated = 10_000  # an earlier test's peak must not count
    with measure.track_peak_memory("cuda:0") as reading:
        allocator.work(peak=700, reserved_peak=1_024, left=50)
    assert allocator.calls[:2] == ["sync", "reset"] and allocator.calls[-1] == "sync"  # synchronised both ends
    assert reading.peak_delta_bytes == 700
    assert reading.resident_delta_bytes == 50
    assert reading.reserved_peak_delta_bytes == 1_024
    assert reading.device_used_bytes == 5_000
    assert reading.method == "torch.cuda.max_memory_allocated"


def test_cpu_regions_have_no_reserved_figure():
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so fresh pages, not ones freed earlier
    with measure.track_peak_memory("cpu") as reading:
        block = bytearray(64 << 20)
        block[::4096] = b"x" * len(block[::4096])
        del block
    assert reading.reserved_peak_delta_bytes is None
    assert reading.peak_delta_bytes is not None and reading.peak_delta_bytes >= 48 << 20
