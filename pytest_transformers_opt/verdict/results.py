"""What ``opt_bench()`` returns and what the report is built from."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .budgets import BudgetCheck, memory_slack_bytes
from .sequential import RoundsRule
from .similarity import Similarity
from ..units import format_bytes

if TYPE_CHECKING:
    from ..engine.loading import ModelRequest

DEFAULT_PROMPTS = (
    "Explain gravity in one sentence.",
    "The cat sees",
    "Name the capital of France.",
)

CALL_SUFFIX = "[opt_bench call "

# The verdict words of a ratio's interval: FASTER when it lies wholly above 1.0, SLOWER wholly below.
FASTER, SLOWER, NO_DIFFERENCE = "faster", "slower", "no significant difference"
SMALLER, LARGER = "smaller", "larger"  # a memory ratio: past the measurement slack either way
SPEEDUP_VERDICTS = (FASTER, SLOWER, NO_DIFFERENCE)
MEMORY_VERDICTS = (SMALLER, LARGER, NO_DIFFERENCE)


def call_nodeid(nodeid: str, call: int) -> str:
    """The report id of a test's ``call``-th opt_bench call: the test's own id for the first."""
    return nodeid if call == 1 else f"{nodeid}{CALL_SUFFIX}{call}]"


@dataclass
class Workload:
    prompts: list[str]
    max_new_tokens: int
    batch_size: int
    rounds: int  # the fixed count, or the sequential rule's minimum
    warmup: int
    input_tokens: int = 0
    max_rounds: int | None = None  # sequential rounds' cap (verdict.sequential); None: a fixed count

    @property
    def rounds_rule(self) -> RoundsRule:
        return RoundsRule(self.rounds, self.max_rounds)

    def key(self) -> tuple[Any, ...]:
        """What makes two baseline reference runs interchangeable (rounds do not)."""
        return (tuple(self.prompts), self.max_new_tokens, self.batch_size)

    def to_dict(self) -> dict[str, Any]:
        return {"num_prompts": len(self.prompts), "max_new_tokens": self.max_new_tokens,
                "batch_size": self.batch_size, "input_tokens": self.input_tokens, "rounds": self.rounds,
                "max_rounds": self.max_rounds, "warmup": self.warmup, "prompts": list(self.prompts)}


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
    # per round, where measured: what an A/B verdict's interval and rank test of these figures need
    ttft_samples_s: list[float] = field(default_factory=list)
    tpot_samples_s: list[float] = field(default_factory=list)
    throughput_samples_tok_s: list[float] = field(default_factory=list)
    memory_method: str = ""
    device_memory_used_bytes: int | None = None  # CUDA: NVML's figure, including memory torch does not see
    reserved_memory_bytes: int | None = None  # CUDA: peak the caching allocator reserved during generation
    paged_cache_bytes: int | None = None  # continuous batching: its paged KV cache's preallocated bytes (in the peak)
    # peak_memory_bytes = resident_bytes + generation_peak_bytes: what the configuration holds while it runs;
    # the load's own transient (a quantization's float weights, a converter's buffers) is load_peak_bytes
    load_peak_bytes: int | None = None
    resident_bytes: int | None = None
    generation_peak_bytes: int | None = None
    # speculative decoding (assisted_decoding, prompt_lookup), from the verified run: draft tokens the model
    # accepted / proposed, and accepted per verification step (each step also yields one token of the model's own)
    acceptance_rate: float | None = None
    mean_accepted_tokens_per_step: float | None = None
    draft_steps: int | None = None
    draft_tokens_proposed: int | None = None
    draft_tokens_accepted: int | None = None

    def record_draft(self, counts: dict[str, int] | None) -> None:
        """Speculative decoding's figures from the verified run's counts (greedy with a constant draft length:
        every timed round drafts and accepts the same)."""
        if not counts:
            return
        steps, proposed, accepted = counts["steps"], counts["proposed"], counts["accepted"]
        self.draft_steps, self.draft_tokens_proposed, self.draft_tokens_accepted = steps, proposed, accepted
        self.acceptance_rate = accepted / proposed if proposed else None
        self.mean_accepted_tokens_per_step = accepted / steps if steps else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("texts")
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in data.items()}


def model_arguments(request: "ModelRequest") -> dict[str, Any] | None:
    """Every ``opt_model`` argument beyond name, revision and dtype that changes the loaded model and is not
    its default (``num_hidden_layers=1``, ``trust_remote_code``, ``gguf_file`` ...), JSON-safe; None for a
    plain model. The stored baseline's key (``bench.model_key_extra``) and the report's model identity
    (``report_model_identity``) both hold it."""
    extra: dict[str, Any] = {}
    for spec in dataclasses.fields(request):
        if spec.name in ("name_or_path", "revision", "dtype", "origin"):
            continue
        value = getattr(request, spec.name)
        if value == spec.default or value in ((), None):
            continue
        if spec.name == "from_pretrained_kwargs":
            extra[spec.name] = {str(k): repr(v) for k, v in value}  # repr: as ModelRequest.identity()
        else:
            extra[spec.name] = value if isinstance(value, (bool, int, float, str)) else repr(value)
    return extra or None


def report_model_identity(request: "ModelRequest", dtype: str | None) -> dict[str, Any]:
    """The report's ``model``: name, revision, dtype and, under ``arguments``, ``model_arguments`` (what
    else changes the loaded model), so ``--opt-compare`` never judges one model against another; no
    ``arguments`` for a plain model, as in reports written before they were recorded."""
    identity: dict[str, Any] = {"name_or_path": request.name_or_path, "revision": request.revision, "dtype": dtype}
    arguments = model_arguments(request)
    if arguments:
        identity["arguments"] = arguments
    return identity


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
    rounds_decision: dict[str, Any] | None = None  # sequential rounds: how many ran and why (RoundsDecision)
    notes: list[str] = field(default_factory=list)  # how figures were obtained, where it differs
    estimates: dict[str, float] = field(default_factory=dict)  # modelled figures, never beside measured ones
    # The uncertainty of the two ratios (set by ``with_intervals``): a 95% interval, the verdict word
    # (SPEEDUP_VERDICTS / MEMORY_VERDICTS) and, where the interval is None, why.
    speedup_interval: tuple[float, float] | None = None
    speedup_verdict: str | None = None
    speedup_interval_note: str | None = None
    memory_ratio_interval: tuple[float, float] | None = None
    memory_ratio_verdict: str | None = None
    memory_ratio_interval_note: str | None = None
    # --opt-ab: the optimized configuration in the reference environment (reference_side.ReferenceSide.record)
    ab: dict[str, Any] | None = None
    # the execution census of both sides (verdict.census_sides): {"optimized", "baseline", "why_not"}
    census: dict[str, Any] | None = None
    trace_file: str | None = None  # --opt-trace: the census call's Chrome trace, where the session keeps it

    @property
    def speedup(self) -> float | None:
        b, o = self.baseline.latency_s, self.optimized.latency_s
        return b / o if b and o else None

    @property
    def memory_ratio(self) -> float | None:
        b, o = self.baseline.peak_memory_bytes, self.optimized.peak_memory_bytes
        return o / b if b and o is not None else None

    def with_intervals(self, *, paired: bool) -> "OptResult":
        """Set the speedup's and the memory ratio's interval and verdict word from the measured samples; self.

        ``paired``: the latency samples are interleaved rounds (round i of each side taken in turn), so
        the bootstrap resamples whole rounds; otherwise (a stored baseline, sides run as two blocks)
        each side on its own. Peak memory is read once per side: there is no spread to bound, so its
        interval stays None and its word compares the difference with the memory budgets' slack.
        """
        from .stats import MIN_BOOTSTRAP_SAMPLES, median_ratio_interval

        self.speedup_interval = self.speedup_verdict = self.speedup_interval_note = None
        if self.speedup is not None:
            base, opt = self.baseline.latency_samples_s, self.optimized.latency_samples_s
            self.speedup_interval = median_ratio_interval(base, opt, paired=paired and len(base) == len(opt))
            if self.speedup_interval is None:
                self.speedup_interval_note = (f"{min(len(base), len(opt))} timed rounds on the smaller side: a 95% "
                                              f"interval needs at least {MIN_BOOTSTRAP_SAMPLES}")
            else:
                low, high = self.speedup_interval
                self.speedup_verdict = FASTER if low > 1.0 else SLOWER if high < 1.0 else NO_DIFFERENCE
        self.memory_ratio_interval = self.memory_ratio_verdict = self.memory_ratio_interval_note = None
        base_bytes, opt_bytes = self.baseline.peak_memory_bytes, self.optimized.peak_memory_bytes
        if self.memory_ratio is not None and base_bytes is not None and opt_bytes is not None:
            slack = memory_slack_bytes(base_bytes)
            difference = opt_bytes - base_bytes
            self.memory_ratio_verdict = SMALLER if difference < -slack else LARGER if difference > slack \
                else NO_DIFFERENCE
            self.memory_ratio_interval_note = (f"peak memory is read once per side, so there is no spread to "
                                               f"bound; the verdict allows {format_bytes(slack)} of measurement "
                                               f"slack, as the memory budgets do")
        return self

    @property
    def failed_budgets(self) -> list[str]:
        return [c.name for c in self.budgets if c.ok is False]

    def to_dict(self) -> dict[str, Any]:
        def clean(v: float | None) -> float | None:
            return None if v is None or not math.isfinite(v) else v

        sim = None
        if self.similarity:
            sim = {k: (clean(v) if isinstance(v, float) else v) for k, v in self.similarity.to_dict().items()}
        data = {
            "model": self.model,
            "techniques": list(self.techniques),
            "baseline_techniques": list(self.baseline_techniques),
            "workload": self.workload.to_dict(),
            "baseline": self.baseline.to_dict(),
            "optimized": self.optimized.to_dict(),
            "speedup": clean(self.speedup),
            "memory_ratio": clean(self.memory_ratio),
            "speedup_interval": list(self.speedup_interval) if self.speedup_interval else None,
            "speedup_verdict": self.speedup_verdict,
            "speedup_interval_note": self.speedup_interval_note,
            "memory_ratio_interval": list(self.memory_ratio_interval) if self.memory_ratio_interval else None,
            "memory_ratio_verdict": self.memory_ratio_verdict,
            "memory_ratio_interval_note": self.memory_ratio_interval_note,
            "similarity": sim,
            "budgets": [c.to_dict() for c in self.budgets],
            "failed_budgets": self.failed_budgets,
            "notes": list(self.notes),
            "rounds_decision": self.rounds_decision,
            "estimates": {k: v for k, v in self.estimates.items() if math.isfinite(v)},
        }
        if self.census is not None:
            data["census"] = self.census
        if self.ab is not None:  # only with --opt-ab: a row without it keeps its earlier layout
            data["ab"] = self.ab
        return data
