"""The scenario the advice is for, and the assumptions made where the user left details out.

A ``ServingScenario`` (the model, its hardware and the workload served on it) holds what was stated
(``None`` = not given). ``resolve`` fills the gaps from the probed hardware and the model config, or
with a stated assumption plus the question that would settle it: the protocol asks for those details
and says what was assumed.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import OptConfigError
from ..techniques.attention import FlashAttention2
from ..units import format_bytes, parse_non_negative_int, parse_size
from .estimates import normalize_dtype
from .model_config import ModelShape

PROBLEMS = {  # --problem: where memory or speed breaks, and what the protocol investigates there
    "load": "memory runs out while loading the model: weights, loading settings",
    "long-input": "memory breaks on long inputs (prefill): attention allocations",
    "long-generation": "memory runs out as generations grow: the KV cache",
    "concurrency": "many concurrent requests: per-request state, scheduling",
    "speed": "everything fits; generation should be faster",
}
MEMORY_STAGES = ("load", "long-input", "long-generation", "concurrency")
DEVICES = ("cuda", "cpu")
# What the advisor assumes for a figure the user left out (not what opt_bench runs by default).
ASSUMED_INPUT_TOKENS = 512
ASSUMED_MAX_NEW_TOKENS = 256
ASSUMED_CONCURRENCY_FOR_PROBLEM = 8


@dataclass(frozen=True)
class ServingScenario:
    """What the user stated about the model, its hardware and its workload; ``None`` where a detail was not
    given. (``verdict.results.Workload`` is another thing: the prompts and lengths one ``opt_bench`` ran.)"""

    model: str | None = None
    revision: str | None = None
    device: str | None = None  # "cuda" or "cpu"
    gpu_memory_bytes: int | None = None
    cpu_memory_bytes: int | None = None
    input_tokens: int | None = None
    max_new_tokens: int | None = None
    batch_size: int | None = None
    concurrency: int | None = None
    problem: str | None = None
    dtype: str | None = None
    attention: str | None = None  # the attention implementation the user's code loads today
    gpu_name: str | None = None
    compute_capability: str | None = None
    versions: dict[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.problem is not None and self.problem not in PROBLEMS:
            raise OptConfigError(f"--problem: {self.problem!r} is not one of {', '.join(PROBLEMS)}")
        if self.device is not None and self.device not in DEVICES:
            raise OptConfigError(f"--device: {self.device!r} is not one of {', '.join(DEVICES)}")
        for name in ("input_tokens", "max_new_tokens", "batch_size", "concurrency"):
            value = getattr(self, name)
            if value is not None:
                parse_non_negative_int(value, "--" + name.replace("_", "-"), minimum=1)
        for name in ("gpu_memory_bytes", "cpu_memory_bytes"):
            value = getattr(self, name)
            if value is not None:
                parse_size(value, "--" + name.replace("_bytes", "").replace("_", "-"))
        if self.compute_capability is not None:
            parse_compute_capability(self.compute_capability)


def parse_compute_capability(value: object, what: str = "--compute-capability") -> tuple[int, int]:
    """``(8, 0)`` from ``"8.0"`` or ``"8"``."""
    text = str(value).strip()
    major, _, minor = text.partition(".")
    if major.isdigit() and (minor.isdigit() or minor == ""):
        return int(major), int(minor or 0)
    raise OptConfigError(f"{what}: {value!r} is not a compute capability; accepted: MAJOR.MINOR such as 8.0 or 9.0")


def capability_text(capability: tuple[int, int]) -> str:
    """``"8.0"`` from ``(8, 0)``."""
    return f"{capability[0]}.{capability[1]}"


@dataclass(frozen=True)
class Assumption:
    """A detail that was missing: the question that would settle it and what was assumed meanwhile."""

    question: str
    assumed: str
    matters: bool = True  # could the answer change the recommendation?

    def text(self) -> str:
        return f"{self.question} Assumed: {self.assumed}."


@dataclass(frozen=True)
class Resolved:
    """A workload with every figure the estimates need, and the assumptions that filled the gaps."""

    workload: ServingScenario
    device: str
    memory_limit_bytes: int | None  # VRAM on cuda, RAM on cpu; None: fit cannot be checked
    memory_limit_source: str  # "stated" or "probed"
    dtype: str
    attention: str
    input_tokens: int
    max_new_tokens: int
    batch_size: int
    concurrency: int
    compute_capability: tuple[int, int] | None
    versions: dict[str, str | None]
    assumptions: list[Assumption]


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def merge_hardware(workload: ServingScenario, hardware: dict[str, Any] | None) -> ServingScenario:
    """Fill what the user did not state from probed hardware facts (stated values win)."""
    if not hardware:
        return workload
    device = str(hardware.get("device") or "").split(":")[0] or None
    changes: dict[str, Any] = {}
    if workload.device is None and device in DEVICES:
        changes["device"] = device
    if workload.gpu_memory_bytes is None and device == "cuda" and hardware.get("gpu_memory_bytes"):
        changes["gpu_memory_bytes"] = int(hardware["gpu_memory_bytes"])
    if workload.gpu_name is None and hardware.get("gpu_name"):
        changes["gpu_name"] = str(hardware["gpu_name"])
    if workload.compute_capability is None and hardware.get("compute_capability"):
        changes["compute_capability"] = str(hardware["compute_capability"])
    versions = {**(hardware.get("versions") or {}), **workload.versions}
    return replace(workload, versions=versions, **changes)


def resolve(workload: ServingScenario, shape: ModelShape | None, hardware: dict[str, Any] | None = None) -> Resolved:
    """Fill the gaps of ``workload``; every gap that was filled becomes an ``Assumption``."""
    stated = workload
    workload = merge_hardware(workload, hardware)
    probed = workload != stated
    notes: list[Assumption] = []

    device = workload.device or ("cuda" if workload.gpu_memory_bytes or workload.compute_capability else None)
    if device is None and shape is not None and shape.is_builtin_tiny:
        device = "cpu"  # the built-in models exist to run offline on CPU
        notes.append(Assumption("Which device runs the model (--device cuda or cpu)?",
                                "CPU, where the built-in model is meant to run", matters=False))
    elif device is None:
        device = "cuda"
        notes.append(Assumption("Which device runs the model (--device cuda or cpu)?", "a CUDA GPU"))

    if device == "cuda":
        limit = workload.gpu_memory_bytes
        source = "probed" if probed and stated.gpu_memory_bytes is None else "stated"
        if limit is None:
            notes.append(Assumption("How much GPU memory is available (--gpu-memory, e.g. \"24 GiB\")?",
                                    "unknown, so fit cannot be checked and the stage comes from --problem"))
    else:
        limit, source = workload.cpu_memory_bytes, "stated"
        if limit is None:
            notes.append(Assumption("How much CPU RAM is available (--cpu-memory, e.g. \"32 GiB\")?",
                                    "unknown, so fit cannot be checked"))
    if device == "cuda" and workload.cpu_memory_bytes is None:
        notes.append(Assumption("How much CPU RAM is available (--cpu-memory)?",
                                "enough to hold an offloaded KV cache if offloading is proposed", matters=False))

    if workload.dtype:
        dtype = normalize_dtype(workload.dtype)
    elif shape is not None and shape.config_dtype and shape.config_dtype in ("float32", "bfloat16", "float16"):
        dtype = shape.config_dtype
        notes.append(Assumption("Which dtype do you load the model in (--dtype)?",
                                f"{dtype}, the config's dtype", matters=False))
    else:
        dtype = "bfloat16" if device == "cuda" else "float32"
        where = "on a GPU" if device == "cuda" else "on CPU"
        notes.append(Assumption("Which dtype do you load the model in (--dtype)?",
                                f"{dtype} (the config names none; {dtype} {where})"))

    attention = workload.attention or (shape.attn_implementation if shape else None)
    if attention is None:
        attention = "eager"
        notes.append(Assumption("Which attention implementation does your code load (--attention)?",
                                "eager, the plugin's baseline (Transformers itself picks sdpa when it can)"))

    def figure(value: int | None, question: str, default: int, assumed: str, matters: bool = True) -> int:
        if value is not None:
            return value
        notes.append(Assumption(question, assumed.format(default), matters))
        return default

    input_tokens = figure(workload.input_tokens, "How long are the inputs, in tokens (--input-tokens)?",
                          ASSUMED_INPUT_TOKENS, "{} input tokens")
    max_new = figure(workload.max_new_tokens, "How many tokens may a generation produce (--max-new-tokens)?",
                     ASSUMED_MAX_NEW_TOKENS, "{} new tokens")
    batch = figure(workload.batch_size, "How many sequences per generate call (--batch-size)?", 1, "batch size {}")
    if workload.concurrency is None and workload.problem == "concurrency":
        concurrency = figure(None, "How many requests are served concurrently (--concurrency)?",
                             ASSUMED_CONCURRENCY_FOR_PROBLEM,
                             "{} concurrent requests, since --problem concurrency was given without a number")
    else:
        concurrency = figure(workload.concurrency, "How many requests are served concurrently (--concurrency)?",
                             1, "{} concurrent request")

    if workload.problem is None:
        notes.append(Assumption(f"Where does the problem show ({', '.join(PROBLEMS)}; --problem)?",
                                "the stage the estimates say breaks first; speed if everything fits"))
    cc = parse_compute_capability(workload.compute_capability) if workload.compute_capability else None
    if device == "cuda" and cc is None:
        notes.append(Assumption("Which GPU is it, and what is its compute capability (--gpu-name, "
                                "--compute-capability)?", "unknown, so backends that need a recent GPU "
                                f"({FlashAttention2.name}: compute capability >= "
                                f"{capability_text(FlashAttention2.min_capability)}) are not proposed"))
    if shape is not None and workload.revision is None and not shape.is_builtin_tiny:
        notes.append(Assumption("Which model revision do you deploy (--revision)?",
                                "the revision whose config was read", matters=False))
    versions = dict(workload.versions)
    if not versions:
        versions = {name: _installed(name) for name in ("torch", "transformers")}
        found = ", ".join(f"{k} {v}" for k, v in versions.items() if v) or "none found"
        notes.append(Assumption("Which torch and transformers versions does the deployment use?",
                                f"the versions installed here ({found})", matters=False))
    return Resolved(workload=workload, device=device, memory_limit_bytes=limit, memory_limit_source=source,
                    dtype=dtype, attention=attention, input_tokens=input_tokens, max_new_tokens=max_new,
                    batch_size=batch, concurrency=concurrency, compute_capability=cc, versions=versions,
                    assumptions=notes)


def describe_limit(resolved: Resolved) -> str:
    """``24.00 GiB of GPU memory (stated)``."""
    where = "GPU memory" if resolved.device == "cuda" else "CPU RAM"
    return f"{format_bytes(resolved.memory_limit_bytes)} of {where} ({resolved.memory_limit_source})"
