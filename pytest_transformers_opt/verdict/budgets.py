"""Budgets: parsing what users write, default similarity budgets, and the verdict table.

A budget comes from the ``optimization`` marker, else from an ini default ``opt_<name>``, else (for
similarity only) from the technique's default. NaN or infinity never passes. ``min_top1`` and
``min_token_match`` are judged with their sample size: the agreement's 95% upper bound (Wilson) over the
compared steps must reach the limit, near-ties counted as agreeing (``similarity`` module).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..errors import OptConfigError
from ..techniques.base import LOSSLESS, LOSSY_4BIT, QUALITY_ORDER, WEIGHTS_8BIT
from ..units import (format_bytes, format_duration, parse_duration, parse_fraction, parse_non_negative_int,
                     parse_positive_float, parse_size, parse_throughput)
from .similarity import wilson_interval

if TYPE_CHECKING:
    from .results import OptResult


@dataclass(frozen=True)
class BudgetDef:
    name: str
    kind: str  # "max" or "min"
    parse: Callable[[Any, str], float]
    measure: Callable[["OptResult"], float | None]
    fmt: Callable[[float | None], str]
    help: str
    # why a figure is missing (said in the check's note; None: no more to say than "not measured")
    unmeasured: Callable[["OptResult"], str | None] = lambda result: None
    # what a failed check adds to its note (e.g. the graph breaks' reasons)
    detail: Callable[["OptResult"], str | None] = lambda result: None


def _fmt_float(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}x"


def _opt(result: "OptResult") -> Any:
    return result.optimized


def _census(result: "OptResult") -> dict[str, Any] | None:
    """The optimized side's execution census (``engine.census``), None where none was taken."""
    counted = (result.census or {}).get("optimized")
    return counted if isinstance(counted, dict) else None


def _census_figure(name: str) -> Callable[["OptResult"], float | None]:
    """A budget's figure read from the optimized side's census: the row's ``census`` is the one source."""
    def measure(result: "OptResult") -> float | None:
        value = (_census(result) or {}).get(name)
        return None if value is None else float(value)
    return measure


def _census_gap(name: str, *also: str) -> Callable[["OptResult"], str | None]:
    """Why the census has no ``name``: no census of the optimized side, or the census's own reason for a null
    (``unavailable``, under ``name`` or one of the fields it is derived from, ``also``)."""
    def why(result: "OptResult") -> str | None:
        counted = _census(result)
        if counted is None:
            reason = ((result.census or {}).get("why_not") or {}).get("optimized")
            return f"no census of the optimized side ({reason or 'not taken'})"
        unavailable = counted.get("unavailable") or {}
        reason = next((unavailable[key] for key in (name, *also) if key in unavailable), None)
        return f"the census has no {name} ({reason})" if reason else None
    return why


def _recompiles(result: "OptResult") -> float | None:
    """The census's recompiles (graphs compiled after the warm-up: the timed rounds' and the census call's), the
    figure ``--opt-compare-fail=recompiles:N`` judges; the timed rounds' count where no census was taken."""
    counted = _census(result)
    value = counted.get("recompiles") if counted is not None else _opt(result).recompiles
    return None if value is None else float(value)


def _graph_break_reasons(result: "OptResult") -> str | None:
    reasons = (_census(result) or {}).get("graph_break_reasons") or []
    return f"graph breaks: {'; '.join(reasons)}" if reasons else None


def _fmt_count(value: float | None) -> str:
    return "-" if value is None else str(int(value))


def _peak_or_load_peak(side: Any) -> int | None:
    """max_memory covers load and generation: the larger of the running peak and the load's own peak."""
    figures = [f for f in (side.peak_memory_bytes, side.load_peak_bytes) if f is not None]
    return max(figures) if figures else None


BUDGETS: dict[str, BudgetDef] = {
    b.name: b
    for b in (
        BudgetDef("max_memory", "max", lambda v, w: float(parse_size(v, w)),
                  lambda r: _peak_or_load_peak(_opt(r)), format_bytes,
                  "peak memory of the optimized model, load and generation: \"6 GiB\", \"800 MB\", int bytes"),
        BudgetDef("max_memory_ratio", "max", lambda v, w: parse_positive_float(v, w),
                  lambda r: r.memory_ratio, _fmt_ratio, "optimized peak / baseline peak: float"),
        BudgetDef("max_ttft", "max", lambda v, w: parse_duration(v, w), lambda r: _opt(r).ttft_s, format_duration,
                  "median time to first token: \"50 ms\", \"1.5 s\", float seconds"),
        BudgetDef("max_tpot", "max", lambda v, w: parse_duration(v, w), lambda r: _opt(r).tpot_s, format_duration,
                  "median time per output token after the first: as max_ttft"),
        BudgetDef("max_latency", "max", lambda v, w: parse_duration(v, w), lambda r: _opt(r).latency_s,
                  format_duration, "median wall time of the whole generate call: as max_ttft"),
        BudgetDef("min_throughput", "min", lambda v, w: parse_throughput(v, w), lambda r: _opt(r).throughput_tok_s,
                  lambda v: "-" if v is None else f"{v:.1f} tok/s", "generated tokens per second: 800, \"800 tok/s\""),
        BudgetDef("min_speedup", "min", lambda v, w: parse_positive_float(v, w), lambda r: r.speedup, _fmt_ratio,
                  "baseline median latency / optimized median latency: float"),
        BudgetDef("min_token_match", "min", lambda v, w: parse_fraction(v, w),
                  lambda r: r.similarity.effective_token_match if r.similarity else None, _fmt_float,
                  "greedy tokens equal to the baseline's, fraction of the requested length (judged by its 95% "
                  "upper bound over the requested tokens; a divergence at a near-tie matches): 0..1"),
        BudgetDef("max_kl", "max", lambda v, w: parse_positive_float(v, w, allow_zero=True),
                  lambda r: r.similarity.kl_mean if r.similarity else None, _fmt_float,
                  "mean KL(baseline || optimized) of next-token distributions at every generated position: float"),
        BudgetDef("min_top1", "min", lambda v, w: parse_fraction(v, w),
                  lambda r: r.similarity.top1 if r.similarity else None, _fmt_float,
                  "top-1 agreement of next-token distributions at every generated position (judged by its 95% "
                  "upper bound over the compared steps; a near-tie flip agrees): 0..1"),
        BudgetDef("max_recompiles", "max", lambda v, w: float(parse_non_negative_int(v, w)),
                  _recompiles, _fmt_count,
                  "recompilations after the warm-up (the timed rounds and the census call; the census's "
                  "recompiles): int", unmeasured=_census_gap("recompiles")),
        BudgetDef("max_graph_breaks", "max", lambda v, w: float(parse_non_negative_int(v, w)),
                  _census_figure("graph_breaks"), _fmt_count,
                  "compile: graph breaks of the compiled forward in the census call (graphs per compiled call "
                  "minus one; a failure names dynamo's reasons): int", unmeasured=_census_gap("graph_breaks"),
                  detail=_graph_break_reasons),
        BudgetDef("max_syncs_per_step", "max", lambda v, w: parse_positive_float(v, w, allow_zero=True),
                  _census_figure("syncs_per_step"), _fmt_float,
                  "CUDA: host-device synchronisations per decode step in the census call (the CPU has none to "
                  "count: not measured there): float",
                  unmeasured=_census_gap("syncs_per_step", "syncs", "ops_per_step")),
        BudgetDef("min_acceptance_rate", "min", lambda v, w: parse_fraction(v, w),
                  lambda r: _opt(r).acceptance_rate, _fmt_float,
                  "speculative decoding: draft tokens the model accepted / draft tokens proposed: 0..1"),
    )
}
# Budgets that only a technique family measures: given on a configuration without one, a marker's is an error
# and an ini default does not apply.
FAMILY_BUDGETS = {"min_acceptance_rate": ("speculative_decoding", "assisted_decoding or prompt_lookup"),
                  "max_graph_breaks": ("compilation", "compile")}
SIMILARITY_BUDGETS = ("min_token_match", "max_kl", "min_top1")
# Timing budgets are noisy: a failure of one is confirmed by more interleaved rounds (a fixed count), and
# sequential rounds go on until each is settled (sequential.py).
SPEED_BUDGETS = ("max_ttft", "max_tpot", "max_latency", "min_throughput", "min_speedup")
# Peak memory readings move by allocator granularity between identical runs.
MEMORY_SLACK_BYTES = 2**20
MEMORY_SLACK_FRACTION = 0.01


def memory_slack_bytes(reference_bytes: float) -> float:
    """How far one peak-memory reading may move from another before it is a change: 1 MiB, or 1% of the
    reference figure where that is more (allocator rounding, what the host's runtime allocates meanwhile)."""
    return max(MEMORY_SLACK_BYTES, MEMORY_SLACK_FRACTION * reference_bytes)
BORDERLINE = "below the limit but within noise"
MEDIANS_ONLY = "median ratio only"  # a min_speedup judged without a significance test (too few rounds)
BUDGET_MODES = ("enforce", "warn", "off")


@dataclass
class Budget:
    name: str
    limit: float
    source: str  # "marker", "ini" or "default"
    raw: Any = None


@dataclass
class BudgetCheck:
    name: str
    limit: float
    measured: float | None
    ok: bool | None  # None: not measurable (explained in note)
    source: str
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.measured is not None and not math.isfinite(self.measured):
            data["measured"] = None
            data["note"] = (self.note or "") + f"measured {self.measured}"
        return data


def parse_budget(name: str, value: Any, where: str) -> float:
    """One budget value; unknown names and malformed values raise ``OptConfigError``."""
    if name not in BUDGETS:
        import difflib

        close = difflib.get_close_matches(name, list(BUDGETS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise OptConfigError(f"{where}: unknown budget {name!r}.{hint} Accepted: {', '.join(BUDGETS)}")
    return BUDGETS[name].parse(value, f"{where}: budget {name}")


def default_similarity(quality: str, dtype: str, distributions: bool = True) -> dict[str, float]:
    """The default similarity budgets of a configuration (README, section Budgets).

    Set from benchmarks/verdict_study.py --similarity on smollm2-135m (benchmarks/RESULTS.md): each KL
    limit lies between the healthy technique's worst figure and the smallest figure of the injected
    breakage it can tell apart (about 2x from each), each top-1 limit at least 0.02 below the healthy worst.
    """
    half = dtype in ("bfloat16", "float16")
    if quality == LOSSY_4BIT:  # nf4 worst KL 0.295, top-1 0.708
        budgets = {"max_kl": 0.5, "min_top1": 0.6}
    elif quality == WEIGHTS_8BIT:  # bnb_8bit worst KL 0.036, top-1 0.889; 4-bit KV 0.037 / 0.917
        budgets = {"max_kl": 0.07, "min_top1": 0.85}
    elif half:  # sdpa vs eager in bf16: worst KL 0.0018, top-1 0.972; MoE experts vs eager: KL 0 (breakage >= 0.0105)
        budgets = {"max_kl": 0.005, "min_top1": 0.95}
    else:  # MoE experts vs eager (benchmarks/experts_study.py): worst KL 2.6e-08; transformers' own MoE tolerance 1e-3
        budgets = {"min_token_match": 1.0, "max_kl": 1e-3}
    if not distributions:  # continuous batching: tokens only
        budgets = {"min_token_match": 1.0 if quality == LOSSLESS and not half else 0.9}
    return budgets


def worst_quality(qualities: list[str]) -> str:
    return max(qualities, key=QUALITY_ORDER.index, default=LOSSLESS)


def resolve_budgets(marker_budgets: dict[str, Any], ini_budgets: dict[str, Any], quality: str, dtype: str,
                    distributions: bool, where: str) -> dict[str, Budget]:
    """Marker beats ini beats the technique's default similarity budgets."""
    resolved: dict[str, Budget] = {}
    for name, limit in default_similarity(quality, dtype, distributions).items():
        resolved[name] = Budget(name, limit, "default", limit)
    for name, raw in ini_budgets.items():
        resolved[name] = Budget(name, parse_budget(name, raw, f"ini opt_{name}"), "ini", raw)
    for name, raw in marker_budgets.items():
        resolved[name] = Budget(name, parse_budget(name, raw, where), "marker", raw)
    return resolved


def drop_inapplicable(budgets: dict[str, Budget], families: set[str], where: str) -> dict[str, Budget]:
    """``budgets`` without the ini defaults that this configuration's technique families cannot measure; a
    marker's such budget raises ``OptConfigError`` naming it and what measures it."""
    kept = dict(budgets)
    for name, (family, techniques) in FAMILY_BUDGETS.items():
        budget = kept.get(name)
        if budget is None or family in families:
            continue
        if budget.source == "marker":
            raise OptConfigError(f"{where}: budget {name} is measured by {family.replace('_', ' ')} ({techniques}), and "
                                 f"this configuration has none; add one of them or drop {name}")
        del kept[name]
    return kept


def check_budgets(result: "OptResult", budgets: dict[str, Budget]) -> list[BudgetCheck]:
    checks = []
    for budget in budgets.values():
        definition = BUDGETS[budget.name]
        measured = definition.measure(result)
        if measured is None:
            why = definition.unmeasured(result)
            checks.append(BudgetCheck(budget.name, budget.limit, None, False if budget.source != "default" else None,
                                      budget.source, "not measured in this run" + (f": {why}" if why else "")))
            continue
        measured = float(measured)
        if not math.isfinite(measured):
            checks.append(BudgetCheck(budget.name, budget.limit, measured, False, budget.source,
                                      "NaN/inf never passes"))
            continue
        ok = measured <= budget.limit if definition.kind == "max" else measured >= budget.limit
        note = None
        if budget.name in ("max_memory", "max_memory_ratio") and not ok:
            ok, note = _memory_within_slack(result, budget, measured)
        if budget.name == "min_speedup" and not ok:
            ok, note = _slowdown_significant(result, budget.limit)
        if budget.name in ("min_top1", "min_token_match") and result.similarity is not None:
            ok, note = _agreement_within_sample(result, budget.name, budget.limit, ok)
        if not ok:
            note = "; ".join(text for text in (note, definition.detail(result)) if text) or None
        checks.append(BudgetCheck(budget.name, budget.limit, measured, ok, budget.source, note))
    return checks


def _agreement_within_sample(result: "OptResult", name: str, limit: float, ok: bool) -> tuple[bool, str | None]:
    """``min_top1`` and ``min_token_match`` judged with their sample size: they pass when the agreement's
    95% upper confidence bound (Wilson, ``similarity.wilson_interval``) over the compared steps reaches the
    limit, near-ties counted as agreeing, so a few flips on a short workload do not fail a healthy technique;
    a limit of 1.0 still asks for every step (the bound reaches 1.0 only then). The measured figure stays
    the raw agreement; the note says how it was judged. Nothing to add (no flip): (ok, None)."""
    similarity = result.similarity
    assert similarity is not None
    if name == "min_top1":
        agreeing, steps, flips = similarity.top1_agreeing, similarity.compared_steps, similarity.top1_flips or 0
        ties = similarity.near_tie_flips or 0
        if agreeing is None or steps == 0 or flips == 0:
            return ok, None
        counted = f"{flips} {_plural(flips, 'flip')} in {steps} steps" + (f", {ties} near-tie" if ties else "")
    else:
        steps = len(result.workload.prompts) * max(result.workload.max_new_tokens, 1)
        raw, divergences = similarity.token_match, similarity.divergences
        if raw is None or steps == 0 or divergences == 0:
            return ok, None
        ties = similarity.near_tie_divergences
        counted = (f"{divergences} of {len(result.workload.prompts)} prompts diverged"
                   + (f", {ties} at a near-tie" if ties else ""))
        if similarity.near_tie:  # every divergence a near-tie: a match
            return ok, f"{counted} (raw token match {raw:.3g})"
        agreeing = min(steps, round(raw * steps))
    upper = wilson_interval(agreeing, steps)[1]
    return upper >= limit, f"{counted}; Wilson upper bound {upper:.3g}"


def _plural(count: int, word: str) -> str:
    return word if count == 1 else word + "s"


def _memory_within_slack(result: "OptResult", budget: Budget, measured: float) -> tuple[bool, str | None]:
    """Over the limit by less than max(1 MiB, 1%) of it is allocator noise, not a regression."""
    if budget.name == "max_memory":
        limit_bytes, over = budget.limit, measured - budget.limit
    else:
        base = result.baseline.peak_memory_bytes or 0
        limit_bytes, over = budget.limit * base, (measured - budget.limit) * base
    slack = memory_slack_bytes(limit_bytes)
    if over <= slack:
        return True, f"over by {format_bytes(over)}, within the {format_bytes(slack)} measurement slack"
    return False, None


def _slowdown_significant(result: "OptResult", limit: float) -> tuple[bool, str | None]:
    """Fail min_speedup only when the optimized rounds are significantly slower than baseline/limit."""
    from .stats import SIGNIFICANCE, mann_whitney_greater, min_p_value

    optimized = [s * limit for s in result.optimized.latency_samples_s]
    baseline = list(result.baseline.latency_samples_s)
    if not baseline or min_p_value(len(optimized), len(baseline)) >= SIGNIFICANCE:
        # too few rounds for any test to reach significance: judge the medians alone, and say so
        return False, f"too few rounds ({len(optimized)}+{len(baseline)}) for a significance test: {MEDIANS_ONLY}"
    p_value = mann_whitney_greater(optimized, baseline)
    if p_value >= SIGNIFICANCE:
        return True, f"{BORDERLINE} (Mann-Whitney p={p_value:.3g})"
    return False, f"significant (Mann-Whitney p={p_value:.3g})"


def format_checks(checks: list[BudgetCheck]) -> str:
    """The one message that lists every budget: measured, limit, verdict."""
    rows = [("budget", "measured", "limit", "verdict", "source")]
    for c in checks:
        definition = BUDGETS[c.name]
        op = "<=" if definition.kind == "max" else ">="
        verdict = "ok" if c.ok else ("n/a" if c.ok is None else "FAILED")
        measured = definition.fmt(c.measured) if c.measured is None or math.isfinite(c.measured) else str(c.measured)
        rows.append((c.name, measured, f"{op} {definition.fmt(c.limit)}", verdict + (f" ({c.note})" if c.note else ""),
                     c.source))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(widths[i]) if i < 4 else cell for i, cell in enumerate(row)).rstrip()
                     for row in rows)
