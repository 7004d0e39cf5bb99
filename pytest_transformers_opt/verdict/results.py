"""What ``opt_bench()`` returns and what the report is built from."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .budgets import BudgetCheck
from .similarity import Similarity

DEFAULT_PROMPTS = (
    "Explain gravity in one sentence.",
    "The cat sees",
    "Name the capital of France.",
)

CALL_SUFFIX = "[opt_bench call "


def call_nodeid(nodeid: str, call: int) -> str:
    """The report id of a test's ``call``-th opt_bench call: the test's own id for the first."""
    return nodeid if call == 1 else f"{nodeid}{CALL_SUFFIX}{call}]"


@dataclass
class Workload:
    prompts: list[str]
    max_new_tokens: int
    batch_size: int
    rounds: int
    warmup: int
    input_tokens: int = 0

    def key(self) -> tuple[Any, ...]:
        """What makes two baseline reference runs interchangeable (rounds do not)."""
        return (tuple(self.prompts), self.max_new_tokens, self.batch_size)

    def to_dict(self) -> dict[str, Any]:
        return {"num_prompts": len(self.prompts), "max_new_tokens": self.max_new_tokens,
                "batch_size": self.batch_size, "input_tokens": self.input_tokens, "rounds": self.rounds,
                "warmup": self.warmup, "prompts": list(self.prompts)}


@dataclass
class SideMetrics:
    """Measured figures of one side (baseline or optimized)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    throughput_tok_s: float | None = None
    peak_memory_bytes: int | None = None
    load_time_s: float | None = None
    compile_time_s: float | None = None
    tokens_generated: int = 0
    texts: list[str] = field(default_factory=list)
    rounds: int = 0
    recompiles: int | None = None
    warmup_s: list[float] = field(default_factory=list)
    latency_samples_s: list[float] = field(default_factory=list)
    memory_method: str = ""
    device_memory_used_bytes: int | None = None  # CUDA: NVML's figure, including memory torch does not see
    reserved_memory_bytes: int | None = None  # CUDA: peak the caching allocator reserved during generation
    paged_cache_bytes: int | None = None  # continuous batching: its paged KV cache's preallocated bytes (in the peak)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("texts")
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in data.items()}


@dataclass
class OptResult:
    baseline: SideMetrics
    optimized: SideMetrics
    similarity: Similarity | None
    workload: Workload
    techniques: list[str]
    baseline_techniques: list[str]
    budgets: list[BudgetCheck] = field(default_factory=list)
    model: dict[str, Any] = field(default_factory=dict)
    confirmed: bool = False  # a speed budget failed once and was measured again
    notes: list[str] = field(default_factory=list)  # how figures were obtained, where it differs
    estimates: dict[str, float] = field(default_factory=dict)  # modelled figures, never beside measured ones

    @property
    def speedup(self) -> float | None:
        b, o = self.baseline.latency_s, self.optimized.latency_s
        return b / o if b and o else None

    @property
    def memory_ratio(self) -> float | None:
        b, o = self.baseline.peak_memory_bytes, self.optimized.peak_memory_bytes
        return o / b if b and o is not None else None

    @property
    def failed_budgets(self) -> list[str]:
        return [c.name for c in self.budgets if c.ok is False]

    def to_dict(self) -> dict[str, Any]:
        def clean(v: float | None) -> float | None:
            return None if v is None or not math.isfinite(v) else v

        sim = None
        if self.similarity:
            sim = {k: (clean(v) if isinstance(v, float) else v) for k, v in self.similarity.to_dict().items()}
        return {
            "model": self.model,
            "techniques": list(self.techniques),
            "baseline_techniques": list(self.baseline_techniques),
            "workload": self.workload.to_dict(),
            "baseline": self.baseline.to_dict(),
            "optimized": self.optimized.to_dict(),
            "speedup": clean(self.speedup),
            "memory_ratio": clean(self.memory_ratio),
            "similarity": sim,
            "budgets": [c.to_dict() for c in self.budgets],
            "failed_budgets": self.failed_budgets,
            "notes": list(self.notes),
            "estimates": {k: v for k, v in self.estimates.items() if math.isfinite(v)},
        }
