"""What the machine can do, probed once per session before any model is loaded.

Techniques decide whether they can run from a ``HardwareInfo``; tests build fake ones to exercise
every skip reason on a CPU-only machine.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from ..compat import package_version

TRACKED_PACKAGES = ("torch", "transformers", "accelerate", "bitsandbytes", "kernels", "optimum-quanto",
                    "hqq", "torchao", "flash-attn", "flash_attn_3", "nvidia-ml-py", "tokenizers")


@dataclass
class HardwareInfo:
    """Facts about the device the tests run on (``opt_hardware`` fixture)."""

    device: str = "cpu"  # "cpu", "cuda:0", ...
    device_type: str = "cpu"
    name: str = ""
    compute_capability: tuple[int, int] | None = None
    memory_bytes: int | None = None
    device_count: int = 0  # CUDA devices visible
    bf16_supported: bool = False
    cuda_version: str | None = None
    driver_version: str | None = None
    tf32: bool | None = None
    clocks_mhz: dict[str, int] | None = None  # CUDA, from NVML: sm / memory now, and their maxima
    memory_bandwidth_bytes_s: float | None = None  # CUDA, peak: NVML bus width x max memory clock x 2
    cpu_count: int = field(default_factory=lambda: os.cpu_count() or 1)
    cpu_threads: int | None = None  # torch's intra-op threads in this process (set by engine.cpu_threads)
    cpu_model: str = field(default_factory=lambda: cpu_model_name())
    python: str = field(default_factory=lambda: platform.python_version())
    platform: str = field(default_factory=platform.platform)
    versions: dict[str, str | None] = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def fingerprint(self) -> str:
        """What a result's hardware is called across runs and shards: the GPU's name, or the CPU's model."""
        return self.name if self.is_cuda and self.name else f"CPU: {self.cpu_model}"

    def version(self, package: str) -> str | None:
        return self.versions.get(package, package_version(package))

    def describe(self) -> str:
        """Short text for skip reasons: ``cpu`` or ``cuda:0 (NVIDIA H200, cc 9.0)``."""
        if not self.is_cuda:
            return "cpu"
        cc = f", compute capability {self.compute_capability[0]}.{self.compute_capability[1]}" if self.compute_capability else ""
        return f"{self.device} ({self.name}{cc})"

    def as_environment(self) -> dict[str, Any]:
        """The report's ``environment`` block."""
        cc = self.compute_capability
        return {
            "python": self.python,
            "platform": self.platform,
            "torch": self.versions.get("torch"),
            "transformers": self.versions.get("transformers"),
            "accelerate": self.versions.get("accelerate"),
            "bitsandbytes": self.versions.get("bitsandbytes"),
            "kernels": self.versions.get("kernels"),
            "cuda": self.cuda_version,
            "driver": self.driver_version,
            "device": self.device,
            "gpu_name": self.name if self.is_cuda else None,
            "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
            "gpu_memory_bytes": self.memory_bytes if self.is_cuda else None,
            "device_count": self.device_count,
            "bf16_supported": self.bf16_supported,
            "tf32": self.tf32,
            "gpu_clocks_mhz": self.clocks_mhz,
            "gpu_memory_bandwidth_bytes_s": self.memory_bandwidth_bytes_s,
            "cpu_count": self.cpu_count,
            "cpu_threads": self.cpu_threads,
            "cpu_model": self.cpu_model,
            "hardware": self.fingerprint,
            "versions": dict(self.versions),
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's marketing name (``model name`` in /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as handle:
            for line in handle.read(1 << 20).splitlines():  # one core's block is enough; bounded read
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def peak_memory_bandwidth(bus_width_bits: int, max_memory_clock_mhz: int) -> float:
    """Peak bandwidth from NVML's figures: bus width x memory clock x 2 (double data rate)."""
    return bus_width_bits / 8 * max_memory_clock_mhz * 1e6 * 2


def nvml_handle(nvml: Any, cuda_index: int) -> Any:
    """NVML numbers every GPU in the machine, CUDA only the visible ones (``CUDA_VISIBLE_DEVICES``, as
    ``--opt-gpus-per-worker`` sets it): find the device by its UUID, by index only as a fallback."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
        return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        return nvml.nvmlDeviceGetHandleByIndex(cuda_index)


def nvml_facts(index: int, nvml: Any = None) -> dict[str, Any]:
    """Driver version, clocks and peak memory bandwidth of CUDA device ``index`` from NVML; a fact
    NVML cannot give (no driver, no library, a field the GPU does not report) is simply left out."""
    facts: dict[str, Any] = {}
    try:
        if nvml is None:
            import pynvml  # from nvidia-ml-py

            nvml = pynvml

        nvml.nvmlInit()
    except Exception:
        return facts
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        facts["driver_version"] = version.decode() if isinstance(version, bytes) else str(version)
        handle = nvml_handle(nvml, index)
        clocks = {}
        for label, clock in (("sm", nvml.NVML_CLOCK_SM), ("memory", nvml.NVML_CLOCK_MEM)):
            clocks[label] = int(nvml.nvmlDeviceGetClockInfo(handle, clock))
            clocks[f"{label}_max"] = int(nvml.nvmlDeviceGetMaxClockInfo(handle, clock))
        facts["clocks_mhz"] = clocks
        facts["memory_bandwidth_bytes_s"] = peak_memory_bandwidth(int(nvml.nvmlDeviceGetMemoryBusWidth(handle)),
                                                                  clocks["memory_max"])
    except Exception:  # an older driver without one of these calls: keep what was read
        pass
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return facts


def resolve_device(requested: str, cuda_count: int) -> str:
    """``auto`` -> ``cuda:0`` when a CUDA device is visible, else ``cpu``; ``cuda`` -> ``cuda:0``."""
    if requested == "auto":
        return "cuda:0" if cuda_count > 0 else "cpu"
    if requested == "cuda":
        return "cuda:0"
    return requested


PROBE_ANNOUNCE_AFTER_S = 3.0  # a second or two on an idle machine (CUDA's start, NVML); minutes on a busy one


def probe_hardware(requested_device: str = "auto") -> HardwareInfo:
    """Probe torch, CUDA and the packages that techniques depend on. Loads no model.

    Announced on the terminal when it takes longer than ``PROBE_ANNOUNCE_AFTER_S``: it is the first work
    of a session's first test, and importing torch too when nothing imported it before."""
    from .progress import long_work

    what = "probing the hardware" if "torch" in sys.modules else "importing torch and probing the hardware"
    with long_work(what, detail=f"device {requested_device}, once per session", after_s=PROBE_ANNOUNCE_AFTER_S):
        return _probe(requested_device)


def _probe(requested_device: str) -> HardwareInfo:
    import torch

    versions = {name: package_version(name) for name in TRACKED_PACKAGES}
    # torch.cuda.is_available() is the probe; max_memory_allocated() returns 0 without a GPU.
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = resolve_device(requested_device, cuda_count)
    info = HardwareInfo(device=device, device_type=device.split(":")[0], device_count=cuda_count,
                        versions=versions, cuda_version=torch.version.cuda)
    if info.is_cuda and cuda_count:
        index = int(device.split(":")[1]) if ":" in device else 0
        props = torch.cuda.get_device_properties(index)
        info.name = props.name
        info.compute_capability = (props.major, props.minor)
        info.memory_bytes = int(props.total_memory)
        info.bf16_supported = bool(torch.cuda.is_bf16_supported())
        info.tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        nvml = nvml_facts(index)
        info.driver_version = nvml.get("driver_version")
        info.clocks_mhz = nvml.get("clocks_mhz")
        info.memory_bandwidth_bytes_s = nvml.get("memory_bandwidth_bytes_s")
    else:
        info.name = platform.processor() or platform.machine()
        info.bf16_supported = True  # CPU kernels exist for bf16 (slowly)
        try:
            info.memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            info.memory_bytes = None
    return info
