"""Scenario logic: find the stage that breaks first, then propose ONE change for that stage.

Stages and what the protocol says to investigate there:
  load            -> weights and loading settings  -> weight quantization (bnb_8bit, else bnb_4bit)
  long-input      -> attention allocations         -> a memory-efficient attention backend
  long-generation -> the KV cache                  -> a cache technique (quantized / offloaded)
  concurrency     -> per-request state, scheduling -> continuous batching
  speed (fits)    -> compile (static cache + torch.compile), or continuous batching when concurrent
Shorter inputs, shorter generations or fewer concurrent requests are only ever listed as
workload tradeoffs, never proposed as the change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..errors import OptConfigError
from ..techniques.moe import grouped_mm_problem
from ..techniques.speculative import PromptLookup
from ..units import format_bytes
from .advice import Advice, Figure, ValidationPlan
from .change import (ATTENTION, CACHING, COMPILATION, CONTINUOUS_BATCHING, EXPERTS, SPECULATIVE_DECODING, Change,
                     find, replace_family)
from .compat import compatibility_questions, flash_attention_capable
from .docs import default_similarity, documentation_for, tradeoffs_for
from .estimates import STAGES, StageEstimate, count_params, reserve_what, stage_estimates, weight_bytes
from .model_config import ModelShape, is_builtin_model, load_model_shape
from .workload import MEMORY_STAGES, Resolved, ServingScenario, describe_limit, resolve

TINY_MAX_NEW_TOKENS = 16  # keeps the written test to seconds on CPU for built-in models
TINY_MAX_INPUT_TOKENS = 64
MAX_TEST_PROMPTS = 64
SPEED_BUDGET = 1.1  # min_speedup asked of a speed technique (not for tiny models: timing noise)
SPEED_CHANGES = ("compile", "continuous_batching", "sdpa", "flash_attention_2", "kernels", "experts", "prompt_lookup",
                 "assisted_decoding")  # the changes asked for that speedup


@dataclass
class Context:
    """Everything a strategy needs: the model shape, the resolved workload and probed hardware."""

    shape: ModelShape
    resolved: Resolved
    hardware: dict[str, Any] | None
    current: list[Change]
    notes: list[str] = field(default_factory=list)  # extra "why" lines from the strategy

    @property
    def limit(self) -> int | None:
        return self.resolved.memory_limit_bytes

    def stages(self, stack: list[Change], **override: int) -> list[StageEstimate]:
        r = self.resolved
        figures = {"input_tokens": r.input_tokens, "max_new_tokens": r.max_new_tokens,
                   "batch_size": r.batch_size, "concurrency": r.concurrency, **override}
        return stage_estimates(self.shape, r.dtype, stack, figures["input_tokens"], figures["max_new_tokens"],
                               figures["batch_size"], figures["concurrency"], device=r.device,
                               attention=r.attention)

    def first_break(self, stack: list[Change], **override: int) -> StageEstimate | None:
        if self.limit is None:
            return None
        cpu = self.resolved.workload.cpu_memory_bytes
        for stage in self.stages(stack, **override):
            if stage.total > self.limit or (cpu is not None and self.resolved.device == "cuda"
                                            and stage.host_bytes > cpu):
                return stage
        return None

    def fits(self, stack: list[Change], **override: int) -> bool:
        return self.limit is not None and self.first_break(stack, **override) is None

    def peak(self, stack: list[Change]) -> int:
        return max(stage.total for stage in self.stages(stack))


# ---------------------------------------------------------------- strategies, one per stage

def _for_load(ctx: Context) -> Change:
    if ctx.limit is None:
        ctx.notes.append("GPU memory was not stated: 8-bit is proposed as the least lossy weight quantization; "
                         "if it still does not fit, 4-bit is the next step.")
        return Change("bnb_8bit")
    eight, four = (apply_change(ctx.current, Change(q)) for q in ("bnb_8bit", "bnb_4bit"))
    if ctx.fits(eight):
        ctx.notes.append("With 8-bit weights the whole workload fits (estimate), so 4-bit's larger quality loss "
                         "is not needed.")
        return Change("bnb_8bit")
    if ctx.fits(four):
        ctx.notes.append("8-bit weights do not leave room for the workload (estimate); 4-bit weights do.")
        return Change("bnb_4bit")
    broken = ctx.first_break(four)
    if broken is not None and broken.stage != "load":
        ctx.notes.append(f"4-bit weights load, but the {broken.stage} stage still breaks (estimate): after this "
                         f"change is validated, the next one is for that stage.")
        return Change("bnb_4bit")
    for size in (2, 4, 8):
        if ctx.fits(ctx.current + [Change("tensor_parallel", {"tp_size": size})]):
            ctx.notes.append(f"Even 4-bit weights do not fit one GPU (estimate); split over {size} GPUs they do.")
            return Change("tensor_parallel", {"tp_size": size})
    ctx.notes.append("Even 4-bit weights do not fit (estimate): 4-bit is the largest single reduction; "
                     "a bigger GPU or several GPUs are needed for the rest.")
    return Change("bnb_4bit")


def _cache_candidates(ctx: Context) -> list[Change]:
    tokens = ctx.resolved.input_tokens + ctx.resolved.max_new_tokens
    if find(ctx.current, COMPILATION):  # compile needs a static cache: only its offloaded form stacks
        return [Change("offloaded_static_cache")]
    out = []
    if ctx.shape.sliding_window and tokens > ctx.shape.sliding_window:
        out.append(Change("sliding_window_cache"))
    out += [Change("quantized_cache", {"backend": "quanto", "nbits": 4}), Change("offloaded_cache"),
            Change("quantized_cache", {"backend": "quanto", "nbits": 2})]
    tried = {change for change in ctx.current}
    return [change for change in out if change not in tried] or out[-1:]


def _for_generation(ctx: Context) -> Change:
    candidates = _cache_candidates(ctx)
    if ctx.limit is None:
        ctx.notes.append(f"Memory was not stated: {candidates[0].label()} is proposed as the first cache step.")
        return candidates[0]
    for change in candidates:
        if ctx.fits(apply_change(ctx.current, change)):
            skipped = candidates[: candidates.index(change)]
            if skipped:
                ctx.notes.append(f"{', '.join(c.label() for c in skipped)} would not make it fit (estimate).")
            return change
    best = min(candidates, key=lambda c: ctx.peak(apply_change(ctx.current, c)))
    ctx.notes.append(f"No cache technique alone makes the workload fit (estimate); {best.label()} needs the least.")
    return best


def _for_long_input(ctx: Context) -> Change:
    backend = find(ctx.current, ATTENTION)
    name = backend.name if backend else ctx.resolved.attention
    capable = flash_attention_capable(ctx.resolved.workload, ctx.hardware)
    flash_ok = bool(capable) and ctx.resolved.dtype != "float32"
    if name == "eager":
        ctx.notes.append("Eager attention materializes an input x input score matrix per layer; a tiled backend "
                         "keeps attention memory linear in the input length.")
        return Change("flash_attention_2" if flash_ok else "sdpa")
    if name == "sdpa" and flash_ok:
        ctx.notes.append("sdpa can fall back to a kernel that materializes the scores (padded batches); "
                         "flash_attention_2 always tiles.")
        return Change("flash_attention_2")
    stage = next(s for s in ctx.stages(ctx.current) if s.stage == "long-input")
    kv_part = next(value for label, value in stage.parts if label.startswith("KV cache"))
    activations = next(value for label, value in stage.parts if label.startswith("prefill activations"))
    if activations > kv_part:
        ctx.notes.append("Attention is already memory-efficient; the prefill activations dominate, and continuous "
                         "batching prefills in chunks of max_batch_tokens.")
        return Change("continuous_batching", {"max_batch_tokens": 1024})
    ctx.notes.append("Attention is already memory-efficient; the input's KV cache dominates.")
    return _for_generation(ctx)


def max_batch_tokens_for(input_tokens: int) -> int:
    """A starting token budget per continuous-batching step: the input length, rounded, in [256, 4096]."""
    return max(256, min(4096, 1 << max(0, input_tokens - 1).bit_length()))


def _for_concurrency(ctx: Context) -> Change:
    ctx.notes.append("Continuous batching schedules requests dynamically and admits new ones as memory frees, "
                     "instead of holding every request's state at once.")
    return Change("continuous_batching", {"max_batch_tokens": max_batch_tokens_for(ctx.resolved.input_tokens)})


def experts_choice(device: str | None, compute_capability: tuple[int, int] | None,
                   torch_version: str | None) -> str | None:
    """The experts implementation to propose: grouped_mm, the Experts backends page's pick on CPU and for
    prefill on a GPU (where transformers decodes with batched_mm itself), unless a known fact rules it out;
    then batched_mm on a GPU (fastest for small inputs); None on a CPU (the page advises against batched_mm
    there, and eager is what the baseline runs)."""
    if grouped_mm_problem(device or "cuda", compute_capability, torch_version, device or "cuda") is None:
        return "grouped_mm"
    return None if device == "cpu" else "batched_mm"


def speed_lever(shape: ModelShape | None, stack: list[Change], device: str | None,
                compute_capability: tuple[int, int] | None, versions: dict[str, str | None],
                batch_size: int | None, concurrency: int) -> tuple[Change, str] | None:
    """A speed change to try before compile, with why: a mixture-of-experts model's experts implementation,
    then speculative decoding when one sequence decodes at a time (``batch_size`` as stated: transformers
    runs speculative decoding at batch size 1 only). None when neither applies."""
    if shape is not None and shape.num_experts > 1 and find(stack, EXPERTS) is None:
        implementation = experts_choice(device, compute_capability, versions.get("torch"))
        if implementation is not None:
            gpu = (" On a GPU transformers decodes with batched_mm under grouped_mm by itself (fastest for "
                   "small inputs)." if implementation == "grouped_mm" and device != "cpu" else "")
            return (Change("experts", {"implementation": implementation}),
                    f"The model is a mixture of experts ({shape.num_experts} experts per MoE layer): the experts "
                    f"implementation decides how their matmuls run. The baseline loops over the selected experts "
                    f"(eager); {implementation} runs each projection of all tokens as one "
                    f"{'grouped' if implementation == 'grouped_mm' else 'batched'} GEMM.{gpu}")
    if batch_size is not None and batch_size <= (PromptLookup.max_batch_size or batch_size) and concurrency == 1 \
            and find(stack, SPECULATIVE_DECODING) is None:
        return (Change(PromptLookup.name),
                "One sequence per generate call and one request at a time: decoding is latency-bound, one "
                "forward pass per token. Speculative decoding checks several proposed tokens in one forward "
                "pass and keeps the model's own greedy tokens; prompt_lookup proposes them from n-grams of the "
                "prompt (no draft model). With a small draft model that shares the tokenizer, "
                "assisted_decoding(assistant=...) is the other form.")
    return None


def _for_speed(ctx: Context) -> Change:
    if ctx.resolved.concurrency > 1:
        return _for_concurrency(ctx)
    r = ctx.resolved
    lever = speed_lever(ctx.shape, ctx.current, r.device, r.compute_capability, r.versions,
                        r.workload.batch_size, r.concurrency)
    if lever is not None:
        ctx.notes.append(f"It fits (or memory is not the problem), so the next gain is speed. {lever[1]}")
        return lever[0]
    ctx.notes.append("It fits (or memory is not the problem), so the next gain is speed: a static cache lets "
                     "generate() compile the forward pass.")
    return Change("compile")


STRATEGIES: dict[str, Callable[[Context], Change]] = {
    "load": _for_load, "long-input": _for_long_input, "long-generation": _for_generation,
    "concurrency": _for_concurrency, "speed": _for_speed,
}
TITLES = {
    "bnb_8bit": "Quantize the weights to 8-bit with bitsandbytes (bnb_8bit)",
    "bnb_4bit": "Quantize the weights to 4-bit NF4 with bitsandbytes (bnb_4bit)",
    "quantized_cache": "Quantize the KV cache",
    "offloaded_cache": "Offload the KV cache to CPU RAM (offloaded_cache)",
    "offloaded_static_cache": "Offload the static KV cache to CPU RAM (offloaded_static_cache)",
    "sliding_window_cache": "Cap the KV cache at the model's sliding window (sliding_window_cache)",
    "sdpa": "Switch attention to PyTorch scaled-dot-product attention (sdpa)",
    "flash_attention_2": "Switch attention to FlashAttention-2 (flash_attention_2)",
    "compile": "Compile generation with a static cache (compile)",
    "continuous_batching": "Serve requests with continuous batching",
    "tensor_parallel": "Split the model over several GPUs with tensor parallelism",
    "kernels": "Load optimized hub kernels (kernels)",
    "experts": "Switch the mixture-of-experts forward (experts)",
    "prompt_lookup": "Decode speculatively with prompt lookup (prompt_lookup)",
    "assisted_decoding": "Decode speculatively with a draft model (assisted_decoding)",
}


def apply_change(stack: list[Change], change: Change) -> list[Change]:
    """``stack`` with ``change``: it replaces its own family. Continuous batching runs its own paged
    cache, so it excludes compile and every cache technique (and they exclude it); compile needs a
    static cache, so a dynamic quantized or offloaded cache replaces it."""
    exclusive = {CONTINUOUS_BATCHING: (COMPILATION, CACHING), COMPILATION: (CONTINUOUS_BATCHING,),
                 CACHING: (CONTINUOUS_BATCHING,)}
    drop = exclusive.get(change.family, ())
    if change.name in ("quantized_cache", "offloaded_cache"):
        drop += ("compile",)
    return replace_family(stack, change, also_drop=drop)


def title_for(change: Change) -> str:
    base = TITLES.get(change.name, f"Apply {change.name}")
    return base if not change.params else f"{base}: {change.label()}"


# ---------------------------------------------------------------- choosing the stage

def choose_stage(ctx: Context) -> tuple[str, list[str]]:
    """The stage to act on and why: the earlier of the estimated first break and the reported problem."""
    problem = ctx.resolved.workload.problem
    broken = ctx.first_break(ctx.current)
    order = {stage: i for i, stage in enumerate(STAGES)}
    if broken and problem in MEMORY_STAGES and order[problem] < order[broken.stage]:
        return str(problem), [f"You reported the problem at {problem}; the estimates break later, at "
                              f"{broken.stage}, so the reported stage comes first."]
    if broken:
        extra = [] if problem in (None, broken.stage) else [
            f"You reported {problem}, but the estimates say the workload breaks earlier, at {broken.stage}: "
            f"that has to be fixed first."]
        return broken.stage, [f"Stage that breaks first: {broken.stage}: it needs {needs_text(broken)} "
                              f"against {describe_limit(ctx.resolved)}."] + extra
    if problem in MEMORY_STAGES:
        basis = ("the estimates fit, but they can miss fragmentation or other processes on the device; "
                 "what you observed takes precedence over the estimate"
                 if ctx.limit is not None else "memory was not stated, so the reported stage is used")
        return problem, [f"Stage: {problem}, as reported; {basis}."]
    if ctx.limit is not None:
        peak = max(ctx.stages(ctx.current), key=lambda stage: stage.total)
        return "speed", [f"No stage breaks: the peak, {needs_text(peak)}, fits {describe_limit(ctx.resolved)}."]
    return "speed", ["Memory was not stated and no problem stage was given: the workload is assumed to fit, "
                     "and the goal is speed."]


# ---------------------------------------------------------------- figures and tradeoffs

def stack_text(stack: list[Change]) -> str:
    return f"with {' + '.join(c.label() for c in stack)}" if stack else "as is (eager, no optimization)"


def needs_text(stage: StageEstimate) -> str:
    """A stage's need as the fit check counts it: the workload's own peak plus the runtime reserve."""
    if not stage.reserve:
        return f"{format_bytes(stage.total)} (estimate)"
    return (f"{format_bytes(stage.workload)} (estimate) plus the {format_bytes(stage.reserve)} runtime reserve, "
            f"{format_bytes(stage.total)} in all")


def stage_figures(ctx: Context, stack: list[Change], prefix: str = "") -> list[Figure]:
    """Each stage's peak as the workload needs it: what the plugin measures (a delta over what was resident
    before load), so without the runtime reserve, which reserve_figure states once."""
    return [Figure(f"{prefix}peak at stage {stage.stage}", stage.workload, "estimate") for stage in ctx.stages(stack)]


def reserve_figure(ctx: Context) -> list[Figure]:
    """The runtime reserve the fit check keeps free on top of every stage's peak (none when not counted)."""
    reserve = ctx.stages([])[0].reserve
    if not reserve:
        return []
    what = reserve_what(ctx.resolved.device)
    return [Figure(f"runtime reserve ({what}) kept free on top of each peak when checking the fit; not part of "
                   f"what the plugin measures", reserve, "estimate")]


def _largest_fitting(ctx: Context, key: str, current: int) -> int | None:
    """The largest value of one workload figure (below the current one) that fits, by bisection."""
    if current <= 1 or not ctx.fits(ctx.current, **{key: 1}):
        return None
    low, high = 1, current - 1
    while low < high:
        mid = (low + high + 1) // 2
        if ctx.fits(ctx.current, **{key: mid}):
            low = mid
        else:
            high = mid - 1
    return low


def workload_tradeoffs(ctx: Context, stage: str) -> list[str]:
    """What a smaller workload would fit without any change: tradeoffs, never optimizations."""
    if ctx.limit is None or stage not in MEMORY_STAGES or ctx.fits(ctx.current):
        return []
    r = ctx.resolved
    options = [("max_new_tokens", r.max_new_tokens, "Cap generations at {} new tokens (instead of {})"),
               ("input_tokens", r.input_tokens, "Truncate inputs to {} tokens (instead of {})"),
               ("concurrency", r.concurrency, "Serve {} concurrent requests (instead of {})"),
               ("batch_size", r.batch_size, "Use batches of {} sequences (instead of {})")]
    out = []
    for key, value, text in options:
        found = _largest_fitting(ctx, key, value)
        if found is not None:
            out.append(text.format(found, value) + ": the estimate then fits without any change. This is a "
                       "workload tradeoff (less text or fewer requests served), not an optimization.")
    if not out:
        out.append("No shorter input, generation or lower concurrency fits without a change (estimate): the "
                   "weights alone are the problem.")
    return out


# ---------------------------------------------------------------- budgets and the validation test

def size_literal(num: int) -> str:
    """``"24 GiB"`` for a round figure, else ``"23.5 GiB"``-style text that parse_size reads back."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20)):
        if num % factor == 0:
            return f"{num // factor} {unit}"
    return f"{num / 2**30:.2f} GiB" if num >= 2**30 else f"{num / 2**20:.1f} MiB"


def budgets_for(stack: list[Change], change: Change | None, resolved: Resolved, tiny: bool,
                memory_goal: bool) -> dict[str, Any]:
    budgets: dict[str, Any] = {}
    if memory_goal and resolved.memory_limit_bytes is not None:
        budgets["max_memory"] = size_literal(resolved.memory_limit_bytes)
    if change is not None and change.name in SPEED_CHANGES and not memory_goal and not tiny:
        budgets["min_speedup"] = SPEED_BUDGET
    budgets.update(default_similarity(stack, resolved.dtype))
    return budgets


def validation_plan(shape: ModelShape | None, resolved: Resolved, stack: list[Change], model: str | None,
                    baseline: list[Change]) -> ValidationPlan:
    """The validation test's model and workload; built-in tiny models get short lengths."""
    name = model or (shape.name if shape else "tiny-random-llama")
    tiny = is_builtin_model(name)
    path = os.path.abspath(name) if os.path.exists(name) else name
    notes = []
    if os.path.isfile(path):
        path = os.path.dirname(path)
    input_tokens, max_new, batch = resolved.input_tokens, resolved.max_new_tokens, resolved.batch_size
    if tiny:
        input_tokens = min(input_tokens, TINY_MAX_INPUT_TOKENS)
        max_new, batch = min(max_new, TINY_MAX_NEW_TOKENS), min(batch, 2)
        notes.append(f"built-in tiny model: lengths capped ({input_tokens} input, {max_new} new tokens) so it "
                     f"runs in seconds on CPU")
    cb = find(stack, CONTINUOUS_BATCHING)
    prompts = min(MAX_TEST_PROMPTS, batch * (resolved.concurrency if cb else 1))
    return ValidationPlan(model=path, revision=resolved.workload.revision, dtype=resolved.dtype,
                          input_tokens=input_tokens, max_new_tokens=max_new, batch_size=batch,
                          num_prompts=prompts, baseline=baseline, notes=tuple(notes))


# ---------------------------------------------------------------- entry points

def advise(workload: ServingScenario, config: Any = None, hardware: dict[str, Any] | None = None) -> Advice:
    """One recommendation for ``workload``; ``config`` overrides ``workload.model`` as the config source.

    ``hardware``: probed facts (device, gpu_name, compute_capability, gpu_memory_bytes,
    bf16_supported, versions); stated workload values win over probed ones.
    """
    source = config if config is not None else workload.model
    if source is None:
        raise OptConfigError("--model: required (a model folder, a config.json path, a hub id in the local "
                             "cache, or tiny-random-llama), unless --from-report gives the model")
    shape = load_model_shape(source, workload.revision)
    return recommend(shape, resolve(workload, shape, hardware), hardware)


def recommend(shape: ModelShape, resolved: Resolved, hardware: dict[str, Any] | None = None,
              current: list[Change] | None = None, baseline: list[Change] | None = None,
              forced: Change | None = None, stage_hint: str | None = None,
              configuration: list[Change] | None = None) -> Advice:
    """Build the ``Advice``; ``current`` is what runs today, ``forced`` a change decided elsewhere
    (from measurements), ``stage_hint`` the stage to act on instead of the estimated one, and
    ``configuration`` the resulting stack when the change is more than a same-family swap."""
    if current is None:
        current = [] if resolved.attention == "eager" else [Change(resolved.attention)]
    if baseline is None:
        baseline = [] if resolved.attention == "eager" else [Change(resolved.attention)]
    ctx = Context(shape, resolved, hardware, current)
    why: list[str]
    if stage_hint is not None:
        stage, why = stage_hint, []
    else:
        stage, why = choose_stage(ctx)
    change = forced or STRATEGIES[stage](ctx)
    why += ctx.notes
    stack = configuration if configuration is not None else apply_change(current, change)

    counts = count_params(shape)
    figures = [Figure("parameters", counts.total, "estimate", unit="count"),
               Figure(f"weights in {resolved.dtype}", weight_bytes(shape, resolved.dtype), "estimate")]
    figures += stage_figures(ctx, current, prefix=f"{stack_text(current)}: ")
    broken = ctx.first_break(current)
    if broken is not None:
        figures += [Figure(f"  {label}", value, "estimate") for label, value in broken.parts]
    figures += stage_figures(ctx, stack, prefix=f"{stack_text(stack)}: ")
    figures += reserve_figure(ctx)
    if resolved.memory_limit_bytes is not None:
        where = "GPU memory" if resolved.device == "cuda" else "CPU RAM"
        figures.append(Figure(f"{where} available", resolved.memory_limit_bytes, resolved.memory_limit_source))
    after = ctx.first_break(stack)
    if resolved.memory_limit_bytes is not None:
        why.append("With the change the estimates fit." if after is None else
                   f"With the change the estimates still break at {after.stage}: the next change will follow "
                   f"once this one is validated.")
    memory_goal = stage in MEMORY_STAGES or stage == "memory"
    tiny = shape.is_builtin_tiny
    # The versions assumed in resolve() are already a stated assumption: no second question for them.
    questions = compatibility_questions(replace(resolved.workload, versions=resolved.versions), stack, hardware,
                                        shape)
    assumptions = [a.text() for a in sorted(resolved.assumptions, key=lambda a: not a.matters)]
    assumptions += [f"Model config: {note}." for note in shape.notes]
    return Advice(
        title=title_for(change),
        change=change,
        configuration=stack,
        budgets=budgets_for(stack, change, resolved, tiny, memory_goal),
        stage=stage,
        why=why,
        figures=figures,
        documentation=documentation_for(change),
        tradeoffs=tradeoffs_for(change),
        workload_tradeoffs=workload_tradeoffs(ctx, stage),
        open_questions=questions,
        assumptions=assumptions,
        test=validation_plan(shape, resolved, stack, resolved.workload.model, baseline),
    )
