"""Running a workload through one configuration: ``generate()`` or ``generate_batch()``.

Every call is greedy and generates exactly ``max_new_tokens``: EOS never stops generation
(``eos_token_id=-1``, accepted by ``generate`` and ``generate_batch`` alike), so both sides do the same
work (a run that returns another count fails its test: ``generated_all``) and greedy picks the raw argmax, the token the compared distributions rank first. Time to first token is read by a logits
processor on its first call, after a device synchronisation, so it works for any batch size and
for compiled models (the processor runs outside the compiled forward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Literal

from ..compat import continuous_batching_manager
from . import quiet_logs  # noqa: F401  (its log filters hold wherever a run happens: A/B and TP workers too)
from .census import StepMark, marked_call
from .measure import RoundTiming, call_with_stack_headroom, now
from .progress import long_work
from .repeated_messages import said_once
from ..techniques import RunEvidence
from ..techniques.speculative import drafting

if TYPE_CHECKING:
    from .model import OptModel


NEVER_STOP = -1  # an EOS id no token has


@dataclass
class GenerationRun:
    """Tokens (and optionally per-step log-probabilities) for each prompt, and how long it took."""

    tokens: list[list[int]]
    texts: list[str]
    logprobs: list[Any] | None  # per prompt: float tensor [steps, vocab] (log-softmax of raw logits)
    timing: RoundTiming
    evidence: RunEvidence = field(default_factory=RunEvidence)


def new_token_counts(tokens: list[list[int]]) -> str:
    """The new tokens per sequence a run returned, as a phrase: \"8\", or \"2 to 8\" when rows differ."""
    counts = sorted({len(row) for row in tokens})
    if not counts:
        return "no sequences"
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"


def generated_all(tokens: list[list[int]], max_new_tokens: int) -> bool:
    """Every sequence has exactly ``max_new_tokens`` new tokens: what every call here asks for, since EOS
    never stops generation (a shorter or longer row is the configuration's doing, e.g. a technique's own
    ``max_new_tokens`` or stopping criteria)."""
    return bool(tokens) and all(len(row) == max_new_tokens for row in tokens)


class _FirstTokenTimer:
    """A no-op logits processor that notes when the first token's scores exist (the model's: calls made while a
    speculative technique drafts are the draft's, or prompt lookup's check of its candidates)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.first_token_at: float | None = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self.first_token_at is None and not drafting():
            self.first_token_at = now(self.device)
        return scores


class ForceTokens:
    """A logits processor that makes generation decode given tokens (forced decoding).

    At step ``i`` (read from the length of ``input_ids``, so it holds for any cache or compiled
    forward) row ``r`` gets every score set to -inf except ``tokens[r][i]``: greedy then picks that
    token, and the next step's distribution is the configuration's own at the baseline's context. A
    row whose tokens are exhausted (a baseline that stopped early) is left as it is. The raw
    distributions are read from ``output_logits`` (taken before any processor); this one goes last so
    no other processor changes the forced choice.
    """

    def __init__(self, tokens: list[list[int]], prompt_length: int) -> None:
        self.tokens = [list(t) for t in tokens]
        self.prompt_length = prompt_length

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        step = input_ids.shape[1] - self.prompt_length
        forced = scores
        for row, wanted in enumerate(self.tokens):
            if 0 <= step < len(wanted):
                if forced is scores:
                    forced = scores.clone()
                forced[row].fill_(float("-inf"))
                forced[row, wanted[step]] = 0.0
        return forced


def _batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@contextlib.contextmanager
def _observers(opt: "OptModel", evidence: RunEvidence | None = None) -> Iterator[None]:
    """Enter every technique's ``observe`` context when ``evidence`` is to be recorded (a verified run):
    the plugin's own spies, outside the clock."""
    with contextlib.ExitStack() as stack:
        if evidence is not None:
            for technique in opt.techniques:
                stack.enter_context(technique.observe(opt.model, evidence))
        yield


@contextlib.contextmanager
def _around_generate(opt: "OptModel") -> Iterator[None]:
    """Enter every technique's ``around_generate`` context (backend flags, hooks, profilers). Inside the
    clock: it is part of the configuration's generate call as its user runs it, so work it does before
    or after the call counts (``max_latency`` is the whole call's wall time)."""
    with contextlib.ExitStack() as stack:
        for technique in opt.techniques:
            stack.enter_context(technique.around_generate(opt.model))
        yield


def run_generation(opt: "OptModel", prompts: list[str], max_new_tokens: int, *, batch_size: int | None = None,
                   keep_logits: bool = False, observe: bool = False, extra: dict[str, Any] | None = None,
                   force_tokens: list[list[int]] | None = None, census_marks: bool = False) -> GenerationRun:
    """Run the prompts once through ``opt`` and return tokens, texts, timing and evidence.

    ``observe``: let every technique record what its proof needs (``Technique.observe``) into the run's
    evidence; for the verification run, never a timed one (the observers cost time).

    ``force_tokens`` (one token list per prompt): decode these tokens instead of the greedy ones
    (:class:`ForceTokens`), with the configuration's own generate arguments; implies ``keep_logits``.

    ``census_marks``: the run is a census's (``engine.census``, under its profiler): each generate call is marked,
    and each decode step by a processor in the first-token clock's place (the clock's device synchronisation would
    count as the configuration's)."""
    if force_tokens is not None:
        if opt.generation.continuous_batching is not None:
            raise ValueError("forced decoding needs generate(); continuous batching returns tokens only")
        if len(force_tokens) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(force_tokens)} forced token lists")
        keep_logits = True
    if opt.generation.continuous_batching is not None:
        return _run_continuous_batching(opt, prompts, max_new_tokens, census_marks=census_marks)
    import torch

    device, tokenizer, model = opt.device, opt.tokenizer, opt.model
    size = batch_size or len(prompts)
    limits = [t.max_batch_size for t in opt.techniques if t.max_batch_size]
    size = min([size, *limits])  # e.g. speculative decoding verifies one sequence at a time
    evidence = RunEvidence(requested=len(prompts), compiled=bool(opt.generation.compile))
    # one-time work the first generate call does (e.g. compiling), announced while it runs
    first_call_work = [w for w in (t.prepare_generation(model, opt.generation) for t in opt.techniques) if w]
    tokens: list[list[int]] = []
    logprobs: list[Any] = []
    latencies: list[float] = []
    ttfts: list[float] = []
    round_start = now(device)
    for first, batch in zip(range(0, len(prompts), size), _batches(prompts, size)):
        encoded = tokenizer(batch, return_tensors="pt", padding=True).to(device)
        timer = _FirstTokenTimer(device)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens, eos_token_id=NEVER_STOP, do_sample=False,
            pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True, output_logits=keep_logits,
        )
        kwargs.update(opt.generation.kwargs)
        kwargs.update(extra or {})
        # the timer first, then any processors a technique or the caller added
        kwargs["logits_processor"] = [StepMark() if census_marks else timer, *kwargs.get("logits_processor", [])]
        if force_tokens is not None:
            kwargs["logits_processor"].append(ForceTokens(force_tokens[first : first + len(batch)],
                                                          encoded["input_ids"].shape[1]))
        # outside the clock reads: the lines are written before ``start`` and after ``end``
        announce = (long_work(f"{'; '.join(first_call_work)} for [{', '.join(opt.labels)}]", detail="first generate call")
                    if first_call_work and not tokens else contextlib.nullcontext())
        # said_once: a message repeated on every step (bitsandbytes' 8-bit cast) is shown once per session
        with announce, said_once(), torch.inference_mode(), _observers(opt, evidence if observe else None):
            output, start, end = call_with_stack_headroom(_timed, opt, "generate", {**encoded, **kwargs}, census_marks)
        latencies.append(end - start)
        if timer.first_token_at is not None:
            ttfts.append(timer.first_token_at - start)
        new_tokens = output.sequences[:, encoded["input_ids"].shape[1] :]
        tokens.extend(new_tokens.tolist())
        evidence.cache = generated_cache(output)
        if keep_logits:
            steps = torch.stack(output.logits, dim=1).float().log_softmax(dim=-1).cpu()
            logprobs.extend(steps[i] for i in range(steps.shape[0]))
    total = now(device) - round_start
    evidence.finished_requests = len(tokens)
    steps_done = len(tokens[0]) if tokens else 0
    timing = RoundTiming(latency_s=sum(latencies) / len(latencies), ttft_s=(sum(ttfts) / len(ttfts)) if ttfts else None,
                         steps=steps_done, tokens=sum(len(t) for t in tokens), total_s=total)
    texts = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    return GenerationRun(tokens=tokens, texts=texts, logprobs=logprobs if keep_logits else None, timing=timing,
                         evidence=evidence)


def _timed(opt: "OptModel", method: Literal["generate", "generate_batch"],
           kwargs: dict[str, Any], census_marks: bool = False) -> tuple[Any, float, float]:
    """``opt.model.<method>(**kwargs)`` inside ``_around_generate``, between two clock reads; called through
    ``call_with_stack_headroom``. The method is looked up once the contexts are entered: what a technique's
    context installs (a wrapper of ``generate``, a tracer) is what runs, as it would in its user's code."""
    start = now(opt.device)
    with _around_generate(opt), (marked_call() if census_marks else contextlib.nullcontext()):
        output = getattr(opt.model, method)(**kwargs)
    return output, start, now(opt.device)


def generated_cache(output: Any) -> Any:
    """The cache a ``generate`` output holds: its field is ``cache`` since transformers 5.2x (reading the old
    name ``past_key_values`` there logs a deprecation message), ``past_key_values`` before."""
    name = "cache" if "cache" in getattr(output, "__dataclass_fields__", {}) else "past_key_values"
    return getattr(output, name, None)


def _paged_cache_bytes(model: Any) -> int | None:
    """Bytes of the paged KV cache tensor the last ``generate_batch(persistent_manager=True)`` allocated."""
    manager = continuous_batching_manager(model)
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    tensor = getattr(cache, "cache_tensor", None)
    return int(tensor.nbytes) if tensor is not None else None


def _run_continuous_batching(opt: "OptModel", prompts: list[str], max_new_tokens: int, *,
                             census_marks: bool = False) -> GenerationRun:
    """``generate_batch()``: all prompts scheduled together; per-request timestamps give TTFT."""
    from transformers import GenerationConfig

    from ..compat import continuous_batching_config, continuous_batching_page_size
    from ..techniques.serving import size_continuous_batching
    from ..units import format_bytes

    tokenizer, device, model = opt.tokenizer, opt.device, opt.model
    inputs = [tokenizer.encode(p) for p in prompts]
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=NEVER_STOP,
                              pad_token_id=tokenizer.pad_token_id)
    given = opt.generation.continuous_batching or {}
    page_size = continuous_batching_page_size(given)
    lengths = [len(i) for i in inputs]
    sized, derived = size_continuous_batching(given, lengths, max_new_tokens, page_size)
    cb_config, _ = continuous_batching_config(sized)
    # a manager left by an interrupted run would be reused, sized for its own workload
    model.destroy_cached_continuous_batching_manager()
    try:
        # persistent: the manager outlives the call, so its cache's bytes can be read (then freed below)
        outputs, start, end = call_with_stack_headroom(_timed, opt, "generate_batch", dict(
            inputs=inputs, generation_config=config, continuous_batching_config=cb_config, record_timestamps=True,
            progress_bar=False, persistent_manager=True), census_marks)
        cache_bytes = _paged_cache_bytes(model)
    finally:
        manager = continuous_batching_manager(model)
        if manager is not None:
            manager.batch_processor = None  # drops the cache tensor now, not at the next collection
        model.destroy_cached_continuous_batching_manager()
    notes: list[str] = []
    if derived:
        figures = ", ".join(f"{k}={sized[k]}{'' if k in derived else ' (given)'}"
                            for k in ("num_blocks", "max_batch_tokens") if k in sized)
        how = "; ".join(f"{k} = {why}" for k, why in derived.items())
        notes.append(f"continuous_batching sized for the workload: {figures} (derived: {how})")
    if cache_bytes is not None:
        notes.append(f"continuous_batching's paged KV cache preallocated {format_bytes(cache_bytes)} "
                     f"({cb_config.num_blocks} blocks of {page_size} tokens); it is part of the optimized peak memory")
    # generate_batch names requests req_0, req_1 ... in input order
    ordered = [outputs[k] for k in sorted(outputs, key=lambda k: int(str(k).rsplit("_", 1)[-1]))]
    errors = [o.error for o in ordered if getattr(o, "error", None)]
    if errors:
        raise RuntimeError(f"generate_batch reported request errors: {errors[:3]}")
    tokens = [list(o.generated_tokens) for o in ordered]
    ttfts = [o.timestamps[0] - o.created_time for o in ordered if getattr(o, "timestamps", None)]
    evidence = RunEvidence(used_generate_batch=True, requested=len(prompts),
                           finished_requests=sum(1 for o in ordered if o.is_finished()),
                           paged_cache_bytes=cache_bytes, notes=notes)
    steps = len(tokens[0]) if tokens else 0
    timing = RoundTiming(latency_s=end - start, ttft_s=(sum(ttfts) / len(ttfts)) if ttfts else None, steps=steps,
                         tokens=sum(len(t) for t in tokens), total_s=end - start)
    return GenerationRun(tokens=tokens, texts=tokenizer.batch_decode(tokens, skip_special_tokens=True), logprobs=None,
                         timing=timing, evidence=evidence)
