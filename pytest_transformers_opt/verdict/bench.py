"""``opt_bench()``: baseline and optimized on one workload, measured, compared, checked.

Order of work: the asked-for warm-up rounds for both sides (kept apart; the first optimized
warm-up includes any compilation, reported as ``compile_time_s``), the baseline reference run
(tokens, distributions and peak memory; once per model and workload in a session), the optimized
verification run (the same, plus the proof that each technique ran), more warm-up rounds until two
in a row agree on every side (bounded, see ``warmup_bounds``), then interleaved timed rounds,
alternating which side goes first so neither always runs on a warmer cache.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest

from .baselines import (BaselineStore, StoredBaseline, baseline_key, hardware_fingerprint, measurements_usable,
                        similarity_against_stored)
from .budgets import BORDERLINE, SPEED_BUDGETS, check_budgets, format_checks
from .census_sides import TENSOR_PARALLEL, census_sides, census_trace_path
from .decode_efficiency import decode_estimates
from ..compat import compiled_graph_count
from ..errors import OptConfigError, OptProofError
from ..engine.generation import GenerationRun, generated_all, new_token_counts, run_generation
from ..engine.loading import ModelRequest
from ..engine.model import LoadedModel, OptModel
from ..engine.measure import PeakReading, Timings, load_transient_note, track_peak_memory
from ..engine.progress import Work, long_work
from .reference_side import AlternatingBlocks, ReferenceSide, ab_mode, oversubscribed_note
from .results import DEFAULT_PROMPTS, OptResult, SideMetrics, Workload, model_arguments, report_model_identity
from .ab_rounds import ab_cap, ab_keep_going, ab_thresholds_to_settle, ab_time_cap
from .sequential import MAX_WARMUP, RoundsDecision, keep_going, parse_rounds
from .similarity import compare_runs, diverged, forced_run_note
from ..units import parse_non_negative_int, shown

if TYPE_CHECKING:
    from ..plan import TestPlan
    from ..session import OptSession

DEFAULT_MAX_NEW_TOKENS = 24
MAX_NEW_TOKENS = 2**20  # the bound for a model whose config names no max_position_embeddings


WARMUP_TOLERANCE = 0.05
COMPILED_MIN_WARMUP = 2
CUDA_COMPILED_MIN_WARMUP = 5
CPU_MAX_EXTRA_WARMUP = 3  # CPU rounds settle fast; a few extra keep the suite quick
CUDA_MAX_EXTRA_WARMUP = 8  # clocks ramp and autotuning settles


def warmup_bounds(requested: int, compiled: bool, cuda: bool) -> tuple[int, int]:
    """(minimum, maximum) warm-up rounds per side.

    The minimum is what was asked, raised to ``COMPILED_MIN_WARMUP`` for compiled configurations
    (their first call compiles; ``CUDA_COMPILED_MIN_WARMUP`` on CUDA, where CUDA graphs are recorded
    on a later call). Those rounds run before the verification run; after it, warm-up goes on until
    two rounds in a row agree (see :func:`warm_until_stable`), up to the maximum: ``CPU_MAX_EXTRA_WARMUP``
    or ``CUDA_MAX_EXTRA_WARMUP`` more. A requested 0 (not compiled) is (0, 0): no warm-up at all.
    """
    minimum = requested
    if compiled:
        minimum = max(minimum, CUDA_COMPILED_MIN_WARMUP if cuda else COMPILED_MIN_WARMUP)
    if minimum == 0:
        return 0, 0
    return minimum, minimum + (CUDA_MAX_EXTRA_WARMUP if cuda else CPU_MAX_EXTRA_WARMUP)


def rounds_agree(first: float | tuple[float, ...], second: float | tuple[float, ...],
                 tolerance: float = WARMUP_TOLERANCE) -> bool:
    """True when every side's seconds in ``second`` are within ``tolerance`` (relative) of ``first``."""
    a = first if isinstance(first, tuple) else (first,)
    b = second if isinstance(second, tuple) else (second,)
    return len(a) == len(b) and all(x > 0 and abs(y - x) / x < tolerance for x, y in zip(a, b))


def warm_until_stable(run_round: Callable[[], Any], minimum: int, maximum: int,
                      tolerance: float = WARMUP_TOLERANCE, previous: Any = ()) -> list[Any]:
    """Run warm-up rounds, at least ``minimum`` and at most ``maximum``, until the last two agree.

    ``run_round`` returns the round's seconds, or a tuple of seconds (one per side: all must agree).
    ``previous`` are rounds run before (the last of them is compared with the first new one), so
    warm-up resumed after the verification run still needs a steady round after it. Returns the new
    rounds.
    """
    rounds: list[Any] = []
    while len(rounds) < maximum:
        rounds.append(run_round())
        history = [*previous, *rounds]
        if len(rounds) >= minimum and len(history) >= 2 and rounds_agree(history[-2], history[-1], tolerance):
            break
    return rounds


def build_workload(session: "OptSession", opt: OptModel, prompts: Any, max_new_tokens: Any, batch_size: Any,
                   rounds: Any, warmup: Any) -> Workload:
    """Validate ``opt_bench`` arguments (a bad one is this test's error) and fill in defaults."""
    if prompts is None:
        prompts = list(DEFAULT_PROMPTS)
    elif isinstance(prompts, str):
        prompts = [prompts]
    if (not isinstance(prompts, (list, tuple)) or not prompts
            or not all(isinstance(p, str) and p for p in prompts)):
        raise OptConfigError(f"opt_bench(prompts=...): got {shown(prompts, 80)}; accepted: a string or a non-empty list of "
                             f"non-empty strings")
    prompts = list(prompts)
    positions = _max_positions(opt)
    new_tokens = parse_non_negative_int(DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
                                        "opt_bench(max_new_tokens=...)" + (
                                            f" for {opt.request.name_or_path} (max_position_embeddings="
                                            f"{positions})" if positions else ""),
                                        minimum=1, maximum=positions or MAX_NEW_TOKENS)
    batch = parse_non_negative_int(len(prompts) if batch_size is None else batch_size,
                                   "opt_bench(batch_size=...)", minimum=1)
    batch = _batch_within_limits(opt, batch, given=batch_size is not None)
    rule = parse_rounds(session.settings.rounds if rounds is None else rounds, "opt_bench(rounds=...)")
    n_warmup = parse_non_negative_int(session.settings.warmup if warmup is None else warmup,
                                      "opt_bench(warmup=...)", minimum=0, maximum=MAX_WARMUP)
    n_warmup = warmup_bounds(n_warmup, opt.generation.compile, session.hardware.is_cuda)[0]
    input_tokens = max(len(opt.tokenizer.encode(p)) for p in prompts)
    if positions is not None and input_tokens + new_tokens > positions:
        # past the position table generate() fails with a bare IndexError (GPT-2) or degrades silently
        raise OptConfigError(
            f"opt_bench(max_new_tokens={new_tokens}): the longest prompt has {input_tokens} tokens, so "
            f"{input_tokens} + {new_tokens} = {input_tokens + new_tokens} positions, but "
            f"{opt.request.name_or_path} has max_position_embeddings={positions}; accepted: input tokens + "
            f"max_new_tokens <= {positions} (shorter prompts or fewer new tokens)")
    return Workload(prompts=prompts, max_new_tokens=new_tokens, batch_size=min(batch, len(prompts)),
                    rounds=rule.minimum, max_rounds=rule.maximum, warmup=n_warmup, input_tokens=input_tokens)


def _batch_within_limits(opt: OptModel, batch: int, given: bool) -> int:
    """The batch size both sides run: at most what every technique takes in one generate call (speculative
    decoding: one sequence); a larger one given explicitly is an error naming the technique."""
    limits = [(t.max_batch_size, t.label()) for t in opt.techniques if t.max_batch_size]
    if not limits:
        return batch
    limit, label = min(limits)
    if given and batch > limit:
        raise OptConfigError(f"opt_bench(batch_size={batch}): {label} generates at most {limit} sequence(s) per "
                             f"generate call; accepted: batch_size <= {limit}, or leave it out (both sides then run "
                             f"the prompts {limit} at a time)")
    return min(batch, limit)


def _max_positions(opt: OptModel) -> int | None:
    """The model's ``max_position_embeddings`` (GPT-2's ``n_positions`` maps to it), None when it has none."""
    config = getattr(opt.model, "config", None) or opt.probe_context.model_config
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_length(run: GenerationRun, side: str, labels: list[str], workload: Workload,
                 other: str | None = None) -> None:
    """Fail the test when ``side``'s run did not generate exactly ``max_new_tokens`` per sequence: speed,
    throughput and similarity over fewer tokens than the other side's compare different work.
    ``other`` names the other side's count where it ran (e.g. "the baseline [eager] returned 8")."""
    if generated_all(run.tokens, workload.max_new_tokens):
        return
    against = f"; {other}" if other else ""
    raise OptProofError(
        f"{side} generation with [{', '.join(labels)}] returned {new_token_counts(run.tokens)} new tokens per sequence, "
        f"not the {workload.max_new_tokens} asked for (max_new_tokens={workload.max_new_tokens}{against}): both "
        f"sides must generate exactly max_new_tokens (EOS never stops generation here), so a different count "
        f"is the configuration's doing (its own max_new_tokens, eos_token_id, stopping criteria or generate "
        f"wrapper), and speed or similarity over different work would compare nothing")


def _reference_run(session: "OptSession", base: OptModel, workload: Workload) -> tuple[GenerationRun, PeakReading]:
    """The baseline's tokens, distributions and generation memory: once per (model, workload)."""
    key = (base.loaded.key, repr(sorted(base.generation.kwargs.items())), workload.key())
    if key not in session.reference_runs:
        with track_peak_memory(base.device) as reading:
            run = run_generation(base, workload.prompts, workload.max_new_tokens, batch_size=workload.batch_size,
                                 keep_logits=True)
        check_length(run, "baseline", base.labels, workload)
        session.reference_runs[key] = (run, reading)
        session.reference_run_count += 1
    return session.reference_runs[key]


def _peak(opt: OptModel, generation: PeakReading) -> int | None:
    """Peak of the configuration as it runs: its resident weights + its generation peak. The load's own
    transient (``load_peak_bytes``) is reported apart: with it in the ratio, a ratio would measure the
    loader and the order of loads, not the technique (max_memory still checks both)."""
    if generation.peak_delta_bytes is None or opt.loaded.resident_bytes is None:
        return opt.loaded.load_peak_bytes
    return opt.loaded.resident_bytes + generation.peak_delta_bytes


def _side(timings: Timings, *, peak: int | None, load_time: float | None, texts: list[str],
          memory: PeakReading | None = None, memory_method: str = "", compile_time: float | None = None,
          recompiles: int | None = None, loaded: LoadedModel | None = None) -> SideMetrics:
    return SideMetrics(
        load_peak_bytes=loaded.load_peak_bytes if loaded else None,
        resident_bytes=loaded.resident_bytes if loaded else None,
        generation_peak_bytes=memory.peak_delta_bytes if memory else None,
        ttft_s=timings.ttft_s, tpot_s=timings.tpot_s, latency_s=timings.latency_s,
        throughput_tok_s=timings.throughput_tok_s, peak_memory_bytes=peak, load_time_s=load_time,
        compile_time_s=compile_time, tokens_generated=timings.tokens, texts=texts, rounds=len(timings.rounds),
        recompiles=recompiles, warmup_s=list(timings.warmup_s), latency_samples_s=timings.latency_samples(),
        ttft_samples_s=timings.ttft_samples(), tpot_samples_s=timings.tpot_samples(),
        throughput_samples_tok_s=timings.throughput_samples(),
        memory_method=memory.method if memory else memory_method,
        device_memory_used_bytes=memory.device_used_bytes if memory else None,
        reserved_memory_bytes=memory.reserved_peak_delta_bytes if memory else None,
    )


@dataclass
class StoredContext:
    """The stored baseline of this (model, revision, dtype, baseline, workload), when stored ones are used."""

    store: BaselineStore
    key: str
    stored: StoredBaseline | None
    measurements_ok: bool
    why_not: str


def model_key_extra(request: ModelRequest) -> dict[str, Any] | None:
    """What else decides the loaded model, for the stored baseline's key: every ``opt_model`` argument
    beyond name, revision and dtype that is not its default (``num_hidden_layers=1``,
    ``trust_remote_code``, ``gguf_file`` ...). None for a plain model, so its key stays as it was."""
    return model_arguments(request)  # the report's model identity holds the same (results.report_model_identity)


def _stored_context(session: "OptSession", plan: "TestPlan", workload: Workload) -> StoredContext | None:
    """None when this project does not use stored baselines (default folder absent, no --opt-update-baselines).

    A folder given explicitly (``--opt-baselines``, ini or environment) that does not exist is not
    silently ignored: the test runs against the live baseline and its notes say so.
    """
    settings = session.settings
    folder = Path(settings.baselines)  # absolute: resolved once at configure time
    source = settings.sources.get("baselines", "default")
    store = BaselineStore(folder)
    request = plan.marked.model
    key = baseline_key(request.name_or_path, request.revision, plan.probe_context.dtype, plan.baseline.labels,
                       workload.to_dict(), model_key_extra(request))
    if not settings.update_baselines and not folder.is_dir():
        if source == "default":
            return None
        return StoredContext(store, key, None, False,
                             f"stored baselines requested ({source}={folder}) but that folder does not exist: "
                             f"no stored baseline used, baseline measured live; check the path, or create it "
                             f"with --opt-update-baselines")
    stored = None if settings.update_baselines else store.load(key)  # corrupt/foreign: OptConfigError
    if stored is None:
        why = "" if settings.update_baselines else store.missing_message(key, plan.nodeid)
        if why and source != "default":
            why = f"stored baselines requested ({source}={folder}) but none holds this test's key: {why}"
        return StoredContext(store, key, None, False, why)
    ok, why = measurements_usable(stored, hardware_fingerprint(session.hardware.as_environment()))
    return StoredContext(store, key, stored, ok, why)


AB_NOT_FOR_TENSOR_PARALLEL = ("--opt-ab: no A/B for tensor_parallel (its ranks are torchrun processes of this "
                              "environment; the reference has no worker for them)")


def _reference_metrics(timings: Timings, loaded: dict[str, Any], run: Any) -> SideMetrics:
    """The reference environment's optimized side, in the same figures as the candidate's (``_side``)."""
    generation_peak = run.generation_peak_bytes
    resident = loaded.get("resident_bytes")
    peak = resident + generation_peak if resident is not None and generation_peak is not None \
        else loaded.get("load_peak_bytes")
    side = _side(timings, peak=peak, load_time=loaded.get("load_time_s"), texts=list(run.texts),
                 memory_method=run.memory_method or loaded.get("memory_method") or "")
    side.load_peak_bytes, side.resident_bytes = loaded.get("load_peak_bytes"), resident
    side.generation_peak_bytes = generation_peak
    return side


MEASURE_ANNOUNCE_AFTER_S = 20.0  # then a line every progress.HEARTBEAT_S: no silence over 30 s


@dataclass
class Measurement:
    """What run_bench measured, and how to measure the same interleaved rounds again (confirm-on-failure;
    None where the sides cannot take turns): kept off the public ``OptResult``."""

    result: OptResult
    remeasure: Callable[[], OptResult] | None = None


def run_bench(session: "OptSession", plan: "TestPlan", get_base: Callable[[], OptModel], opt: OptModel,
              workload: Workload) -> Measurement:
    """Measure, compare and record; the caller checks the budgets.

    The baseline model is loaded only when it is needed: a stored baseline measured on this very
    hardware replaces it, so a 4-bit test on a small GPU can be judged against a baseline captured on
    a large one. A measurement still running after ``MEASURE_ANNOUNCE_AFTER_S`` gets progress lines.
    """
    with long_work(f"measuring [{', '.join(plan.declared)}] in {plan.nodeid}", after_s=MEASURE_ANNOUNCE_AFTER_S) as work:
        return _measure(session, plan, get_base, opt, workload, work)


def _measure(session: "OptSession", plan: "TestPlan", get_base: Callable[[], OptModel], opt: OptModel,
             workload: Workload, work: Work) -> Measurement:
    def once(side: OptModel, **kwargs: Any) -> GenerationRun:
        which = "optimized" if side is opt else "baseline"
        try:
            run = run_generation(side, workload.prompts, workload.max_new_tokens, batch_size=workload.batch_size,
                                 **kwargs)
        except (OptConfigError, OptProofError):
            raise
        except Exception as exc:
            raise RuntimeError(f"{which} generation with [{', '.join(side.labels)}] raised "
                               f"{type(exc).__name__}: {exc}") from exc
        counts[which] = new_token_counts(run.tokens)
        other_side, other = ("baseline", base) if side is opt else ("optimized", opt)
        check_length(run, which, side.labels, workload, other=None if other is None or other_side not in counts else
                     f"the {other_side} [{', '.join(other.labels)}] returned {counts[other_side]}")
        return run

    counts: dict[str, str] = {}  # side -> new tokens per sequence of its latest run

    notes: list[str] = []
    limited = [t.label() for t in opt.techniques if t.max_batch_size and t.max_batch_size == workload.batch_size]
    if limited and len(workload.prompts) > workload.batch_size:
        notes.append(f"batch size {workload.batch_size} on both sides: {limited[0]} generates at most "
                     f"{workload.batch_size} sequence(s) per generate call")
    stored_ctx = _stored_context(session, plan, workload)
    stored = stored_ctx.stored if stored_ctx else None
    if stored_ctx and stored is None and stored_ctx.why_not:
        notes.append(stored_ctx.why_not)
    base: OptModel | None = None
    if stored_ctx is None or stored is None or not stored_ctx.measurements_ok:
        base = get_base()
    if opt.tensor_parallel_size:
        result = _run_tensor_parallel_bench(session, plan, get_base() if base is None else base, opt, workload, once)
        if session.settings.ab:
            result.notes.append(AB_NOT_FOR_TENSOR_PARALLEL)
        result.census = {"optimized": None, "baseline": None,
                         "why_not": {"optimized": TENSOR_PARALLEL, "baseline": TENSOR_PARALLEL}}
        return Measurement(result)
    base_timings, opt_timings = Timings(), Timings()  # the reference's requests are timed out from opt_timings
    ab: ReferenceSide | None = None  # interleaved: the reference's side takes a turn in every round
    blocks: AlternatingBlocks | None = None  # or its rounds in blocks of their own, between the candidate's
    if session.settings.ab:
        mode, why = ab_mode(session, opt, base)
        if mode == "interleaved":
            ab = ReferenceSide.start(session, plan, opt, workload, check_length, opt_timings)
        elif mode == "blocks":
            assert why is not None
            blocks = AlternatingBlocks(session, plan, [opt] + ([base] if base is not None else []), workload,
                                       check_length, why, opt_timings)
            notes.append(blocks.note())
        elif why:
            notes.append(why)

    minimum, maximum = warmup_bounds(workload.warmup, opt.generation.compile, session.hardware.is_cuda)

    def warm_both() -> tuple[float, ...]:
        work.status = f"warm-up round {len(opt_timings.warmup_s) + 1}"
        # the baseline first, so a wrong token count on the optimized side is told against the baseline's
        seconds = [once(base).timing.total_s] if base is not None else []
        base_timings.warmup_s.extend(seconds)
        seconds.insert(0, once(opt).timing.total_s)
        opt_timings.warmup_s.append(seconds[0])
        if ab is not None:
            seconds.append(ab.warm(session))
        return tuple(seconds)

    # The asked-for rounds first (they include any compilation, and keep one-time costs out of the
    # verification run's memory), then the reference and verification runs, then more warm-up until
    # two rounds in a row agree on every side: the timed rounds start at steady state.
    first = [warm_both() for _ in range(minimum)]
    work.status = "reference and verification runs"
    reference, base_memory = _reference_run(session, base, workload) if base is not None else (None, None)
    if reference is not None:
        counts["baseline"] = new_token_counts(reference.tokens)
    elif stored is not None:
        counts["baseline"] = new_token_counts(stored.tokens)
    with track_peak_memory(opt.device) as opt_memory:
        verification = once(opt, keep_logits=True, observe=True)
    for technique in opt.techniques:
        problem = technique.verify_run(opt.model, verification.evidence)
        if problem:
            raise OptProofError(f"silent fallback: {problem}")
    notes.extend(verification.evidence.notes)  # how the run was set up (e.g. continuous batching's sizing)
    # KL and top-1 at every position: when the free run diverged, the optimized configuration decodes
    # the baseline's tokens once more (outside the timings and the memory reading above)
    if stored is not None:
        target = stored.tokens if stored.topk is not None else None  # a tokens-only store has no KL to measure
    else:
        assert reference is not None  # no stored baseline, so the baseline model was loaded and run
        target = reference.tokens
    forced = None
    if target is not None and verification.logprobs is not None and len(target) == len(verification.tokens) \
            and diverged(target, verification.tokens):
        work.status = "forced run (the baseline's tokens)"
        forced = once(opt, force_tokens=target).logprobs
        notes.append(forced_run_note(len(target), workload.max_new_tokens))

    def verify_reference(side: ReferenceSide) -> None:
        work.status = "reference environment's verification run"
        # identical contexts on both sides: the baseline's tokens, or the candidate's own where none are known
        ab_target = target if target is not None else verification.tokens
        side.verify(session, ab_target)
        side.compare(verification.tokens, forced if diverged(ab_target, verification.tokens) else verification.logprobs,
                     dtype=plan.probe_context.dtype)

    if ab is not None:
        verify_reference(ab)
    if blocks is not None:
        blocks.verify_with = verify_reference  # at its first block
    if stored_ctx is not None and stored is not None:  # stored comes from stored_ctx
        similarity = similarity_against_stored(stored, verification.tokens, verification.logprobs,
                                               workload.max_new_tokens, forced)
        notes.append(f"similarity against the stored baseline {stored_ctx.store.path_for(stored_ctx.key)}"
                     f" (KL is a lower bound from its top-{stored.k})")
        if not stored_ctx.measurements_ok:
            notes.append(stored_ctx.why_not)
        else:
            notes.append("baseline speed and memory from the stored baseline (same hardware fingerprint); "
                         "speedup compares against its medians, not interleaved rounds")
    else:
        assert reference is not None  # no stored baseline, so the baseline model was loaded and run
        similarity = compare_runs(reference.tokens, verification.tokens, workload.max_new_tokens,
                                  reference.logprobs, verification.logprobs, forced, dtype=plan.probe_context.dtype)

    recompiles: list[int] = []
    census: dict[str, Any] = {}  # the row's census, once taken (after the first timed rounds)

    def warm_candidate() -> None:
        """The candidate's sides back on the device after a reference block: one round each, not timed."""
        work.status = "warm-up round after the reference's block"
        if base is not None:
            base_timings.warmup_s.append(once(base).timing.total_s)
        opt_timings.warmup_s.append(once(opt).timing.total_s)

    def finish_blocks() -> None:
        if blocks is not None:
            work.status = "the reference environment's block"
            blocks.finish(len(opt_timings.rounds))

    def timed_round(index: int, of: str) -> None:
        if blocks is not None:
            blocks.candidate_round(index, warm_candidate)
        work.status = f"timed round {index + 1}/{of}"
        # the candidate's optimized side and the reference's (--opt-ab) also take turns at going first
        sides: list[Any] = [s for s in ((base, opt, ab) if index % 2 == 0 else (ab, opt, base)) if s is not None]
        for side in sides:
            if side is ab:
                ab.timed_round(session)
                continue
            run = once(side)
            (base_timings if side is base else opt_timings).rounds.append(run.timing)

    def timed_rounds(count: int | None = None) -> OptResult:
        """A fixed count of interleaved rounds (again, to confirm a failed speed budget)."""
        count = workload.rounds if count is None else count
        graphs_before = compiled_graph_count()
        start = len(opt_timings.rounds)
        for index in range(start, start + count):
            timed_round(index, str(start + count))
        recompiles.append(compiled_graph_count() - graphs_before)
        finish_blocks()
        return result_so_far()

    rule = workload.rounds_rule
    decision = RoundsDecision(rule)
    speed = {name: b for name, b in plan.budgets.items() if name in SPEED_BUDGETS} \
        if session.settings.budgets != "off" else {}

    # --opt-ab-fail thresholds on rounds: interleaved rounds go on while their verdict is open (verdict.ab_rounds)
    ab_gate = ab_thresholds_to_settle(session.settings.ab_thresholds) \
        if ab is not None and ab.not_comparable is None and rule.sequential else []
    if ab_gate:
        decision.ab_max_rounds = ab_cap(rule)
        decision.ab_max_seconds = ab_time_cap(rule)

    def sequential_rounds() -> OptResult:
        """Rounds one at a time until every speed budget and A/B verdict is settled (verdict.sequential and
        verdict.ab_rounds), or the cap."""
        assert rule.maximum is not None
        open_ended = bool(speed or ab_gate)
        minimum = rule.minimum if open_ended else rule.report_minimum()
        cap = max(rule.maximum, decision.ab_max_rounds or 0) if open_ended else minimum
        graphs_before = compiled_graph_count()
        started = time.monotonic()  # auto's time cap on an open A/B verdict counts the rounds' wall time
        for index in range(cap):
            timed_round(index, f"{minimum}..{cap}" if open_ended else str(minimum))
            decision.rounds = index + 1
            if decision.rounds < minimum:
                continue
            if not open_ended:
                break
            interim = result_so_far(intervals=False)
            budgets_open = False
            if speed:
                paired = base_timings.latency_samples() if base is not None else None
                budgets_open = keep_going(decision, speed, check_budgets(interim, speed), opt_timings.rounds,
                                          paired, interim.baseline.latency_s)
            ab_open = False
            if ab_gate and ab is not None and ab.not_comparable is not None:  # the reference stopped: nothing to settle
                decision.ab, decision.ab_max_rounds = {}, None
                ab_open = decision.rounds < rule.report_minimum()  # the rounds a test without the gate runs
            elif ab_gate:
                assert interim.ab is not None  # the reference took a turn in every round
                ab_open = ab_keep_going(decision, ab_gate, {"optimized": interim.optimized.to_dict()}, interim.ab,
                                        session.ab_gate_so_far, elapsed_s=time.monotonic() - started)
            if not (budgets_open or ab_open):
                break
        recompiles.append(compiled_graph_count() - graphs_before)
        finish_blocks()
        return with_decision(result_so_far())

    def confirm_sequential() -> OptResult:
        """A failure the sequential looks could not settle (too few rounds): as many rounds again, judged
        on all, as a fixed count's failure is confirmed."""
        decision.confirmation_rounds = decision.rounds
        result = timed_rounds(decision.rounds)
        total = decision.rounds + decision.confirmation_rounds
        for check in check_budgets(result, speed):
            if check.name in decision.unsettled_failures:
                decision.budgets[check.name] = f"{'passes' if check.ok else 'fails'} by its rule on all {total} rounds"
        return with_decision(result)

    def with_decision(result: OptResult) -> OptResult:
        result.rounds_decision = decision.to_dict()
        note = decision.note()
        if note:
            result.notes.append(note)
        return result

    def result_so_far(intervals: bool = True) -> OptResult:
        compile_time = None
        if opt.generation.compile and opt_timings.warmup_s:
            steady = statistics.median(r.total_s for r in opt_timings.rounds)
            compile_time = max(0.0, opt_timings.warmup_s[0] - steady)
        if base is not None:
            assert reference is not None and base_memory is not None  # the baseline model ran the reference
            baseline = _side(base_timings, peak=_peak(base, base_memory), load_time=base.loaded.load_time_s,
                             texts=reference.texts, memory=base_memory, loaded=base.loaded)
        else:
            assert stored is not None  # no baseline model: its figures come from the stored baseline
            baseline = stored.side_metrics()
        optimized = _side(opt_timings, peak=_peak(opt, opt_memory), load_time=opt.loaded.load_time_s,
                          texts=verification.texts, memory=opt_memory, compile_time=compile_time,
                          recompiles=sum(recompiles) if opt.generation.compile else None, loaded=opt.loaded)
        optimized.paged_cache_bytes = verification.evidence.paged_cache_bytes
        optimized.record_draft(verification.evidence.draft)
        reference_side = ab if ab is not None else blocks.side if blocks is not None else None
        ab_record = reference_side.record(_reference_metrics) if reference_side is not None else None
        result = OptResult(
            ab=ab_record,
            baseline=baseline,
            optimized=optimized,
            similarity=similarity, workload=workload, techniques=plan.declared, baseline_techniques=plan.baseline.labels,
            model=report_model_identity(plan.marked.model, plan.probe_context.dtype),
            notes=list(notes) + [n for n in [load_transient_note(optimized), oversubscribed_note(ab_record)] if n],
            estimates=_decode_estimates(session, opt, workload, optimized) if intervals else {},
            census=census.get("sides"), trace_file=census.get("trace"),
        )
        # a stored baseline's rounds were not taken in turns
        return result.with_intervals(paired=base is not None) if intervals else result

    if maximum:
        warm_until_stable(warm_both, 1, maximum - minimum, previous=first)
    if blocks is not None:
        blocks.warmup_rounds = len(opt_timings.warmup_s)
    if workload.max_rounds is not None:
        result = sequential_rounds()
        # every round ran while a verdict was open: nothing is left to confirm, unless a failure stands on
        # rounds too few to settle one (a range whose MAX is below MIN_FAIL_ROUNDS): never a median-only failure
        measurement = Measurement(result, remeasure=confirm_sequential if decision.unsettled_failures else None)
    else:
        result = timed_rounds()
        measurement = Measurement(result, remeasure=timed_rounds)
    # the census: one untimed call a side, at steady state (after the timed rounds, never inside one)
    census["sides"], census["trace"] = census_sides(
        session, plan, opt, base, once, sum(recompiles) if opt.generation.compile else None, work, workload.key(),
        trace_path=census_trace_path(session, plan))
    result.census, result.trace_file = census["sides"], census["trace"]
    if ab is not None:  # the reference's census too, after the rounds: its record then says what differs
        ab.take_census(session)
        result.ab = ab.record(_reference_metrics)
    counted = census["sides"].get("optimized")
    for technique in opt.techniques if counted is not None else ():
        problem = technique.verify_census(counted)
        if problem:
            raise OptProofError(f"silent fallback (the census): {problem}")
    # reference is set exactly when the baseline model ran; stored_ctx is never None when updating
    if session.settings.update_baselines and stored_ctx is not None and reference is not None:
        _save_baseline(session, plan, stored_ctx, reference, result)
    return measurement


def _save_baseline(session: "OptSession", plan: "TestPlan", ctx: StoredContext, reference: GenerationRun,
                   result: OptResult) -> None:
    """--opt-update-baselines: write the baseline once per key per session (atomic, locked)."""
    if ctx.key in session.saved_baselines:
        return
    request = plan.marked.model
    baseline = StoredBaseline.build(
        model=request.name_or_path, revision=request.revision, dtype=plan.probe_context.dtype,
        baseline_techniques=plan.baseline.labels, workload=result.workload.to_dict(), tokens=reference.tokens,
        logprobs=reference.logprobs, measurements=result.baseline, environment=session.hardware.as_environment(),
        texts=reference.texts, extra=model_key_extra(request))
    path = ctx.store.save(baseline, update=True)
    session.saved_baselines.add(ctx.key)
    result.notes.append(f"baseline stored in {path}")


def _decode_estimates(session: "OptSession", opt: OptModel, workload: Workload, optimized: SideMetrics) -> dict[str, float]:
    """Decode bandwidth (an estimate): for ``generate()`` on one process; continuous batching's
    steps mix requests at different stages, so a per-step byte count would mean little there."""
    if opt.generation.continuous_batching is not None:
        return {}
    kv_bits = (opt.generation.kwargs.get("cache_config") or {}).get("nbits")
    return decode_estimates(opt.model, workload, optimized.tpot_s, session.hardware.memory_bandwidth_bytes_s,
                            kv_bits=kv_bits)


def _run_tensor_parallel_bench(session: "OptSession", plan: "TestPlan", base: OptModel, opt: OptModel,
                               workload: Workload, once: Any) -> OptResult:
    """The optimized side runs in tp_size torchrun processes; the baseline in this one.

    The two sides cannot take turns round by round, so each side's rounds run as one block: the
    report says so in the test's notes.
    """
    from ..engine.tensor_parallel import TensorParallelUnavailable, run_tensor_parallel

    base_timings = Timings()

    def warm_base() -> float:
        base_timings.warmup_s.append(once(base).timing.total_s)
        return base_timings.warmup_s[-1]

    # the same rule as run_bench's for the side measured here (the worker warms up its own side)
    minimum, maximum = warmup_bounds(workload.warmup, False, session.hardware.is_cuda)
    first = [warm_base() for _ in range(minimum)]
    reference, base_memory = _reference_run(session, base, workload)
    if maximum:
        warm_until_stable(warm_base, 1, maximum - minimum, previous=first)
    rounds = workload.rounds_rule.report_minimum()  # two blocks, not turns: nothing to stop early on
    for _ in range(rounds):
        base_timings.rounds.append(once(base).timing)
    request = plan.marked.model
    attention = next((t.impl for t in opt.techniques if t.family == "attention" and hasattr(t, "impl")), "eager")
    try:
        tp = run_tensor_parallel(
            plan.model_path, dtype=request.dtype, tp_size=opt.tensor_parallel_size or 2, prompts=workload.prompts,
            max_new_tokens=workload.max_new_tokens, batch_size=workload.batch_size, rounds=rounds,
            warmup=workload.warmup, device_type=session.hardware.device_type, attn_implementation=attention,
            revision=request.revision, trust_remote_code=request.trust_remote_code,
            from_pretrained_kwargs=dict(request.from_pretrained_kwargs), force_tokens=reference.tokens)
    except TensorParallelUnavailable as exc:
        pytest.skip(exc.reason)
    problem = tp.problem()
    if problem:
        raise OptProofError(f"silent fallback: {problem}")
    similarity = compare_runs(reference.tokens, tp.tokens, workload.max_new_tokens, reference.logprobs, tp.logprobs,
                              tp.forced_logprobs, dtype=plan.probe_context.dtype)
    forced_note = ([forced_run_note(len(reference.tokens), workload.max_new_tokens, "in the ranks")]
                   if tp.forced_logprobs is not None else [])
    return OptResult(
        baseline=_side(base_timings, peak=_peak(base, base_memory), load_time=base.loaded.load_time_s,
                       texts=reference.texts, memory=base_memory, loaded=base.loaded),
        optimized=_side(tp.timings(), peak=tp.peak_memory_bytes, load_time=tp.load_time_s, texts=list(tp.texts),
                        memory_method=tp.memory_method), similarity=similarity, workload=workload, techniques=plan.declared,
        baseline_techniques=base.labels,
        model=report_model_identity(request, plan.probe_context.dtype),
        notes=[f"tensor_parallel: {tp.world_size} torchrun ranks, {min(tp.sharded_params)} sharded parameters per "
               f"rank; peak memory is the largest rank's; baseline and optimized rounds ran as two blocks, not "
               f"interleaved", *forced_note],
    ).with_intervals(paired=False)


def judge_budgets(session: "OptSession", plan: "TestPlan", measured: Measurement) -> OptResult:
    """Check the budgets (none in ``off`` mode).

    A failed timing budget is confirmed first: the same number of interleaved rounds again, judged
    on all rounds together, so one noisy burst on a shared CI machine does not fail a merge. A
    ``min_speedup`` that is below its limit but not significantly so gets the same extra rounds, so
    a real slowdown hidden by noise in the first rounds is still caught.
    """
    result = measured.result
    if session.settings.budgets == "off":
        result.budgets = []
        return result
    result.budgets = check_budgets(result, plan.budgets)
    # below the speed limit but not significantly so: more rounds decide, in either direction
    borderline = any(c.name == "min_speedup" and c.ok and (c.note or "").startswith(BORDERLINE)
                     for c in result.budgets)
    if (set(result.failed_budgets) & set(SPEED_BUDGETS) or borderline) and measured.remeasure is not None:
        result = measured.remeasure()
        result.confirmed = True
        result.budgets = check_budgets(result, plan.budgets)
    return result


def enforce_budgets(session: "OptSession", plan: "TestPlan", result: OptResult) -> None:
    """In ``enforce`` mode, failed budgets fail the test with the full budget table."""
    failed = result.failed_budgets
    if failed and session.settings.budgets == "enforce":
        confirmed = " (after a second set of rounds)" if result.confirmed else ""
        pytest.fail(
            f"budgets failed ({', '.join(failed)}){confirmed} for [{', '.join(plan.declared)}] vs baseline "
            f"[{', '.join(result.baseline_techniques)}] on {plan.marked.model.name_or_path}:\n"
            f"{format_checks(result.budgets)}",
            pytrace=False,
        )
