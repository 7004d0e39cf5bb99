"""How close the optimized outputs are to the baseline's.

``token_match`` comes from free-running greedy generation: for each prompt, the common prefix is
the run of greedy tokens equal in both, over the requested length.

Next-token distributions (KL(baseline || optimized), and whether the top-1 tokens agree) are
compared at every generated position with identical contexts. When the free runs produced the same
tokens, their distributions already are; when they diverged, the optimized configuration runs again
through its own generation path while being forced to decode the baseline's tokens
(``forced_logprobs``, see ``generation.run_generation(force_tokens=...)``), so every one of the
``max_new_tokens`` positions of every prompt is compared. Without a forced run (a side that returns
no distributions for forced tokens) only the shared prefix plus the first divergent step is compared,
and the note says so.

A near-tie is a disagreement that rounding alone explains: where the baseline picked token ``a`` and
the optimized configuration token ``b`` at the same context, the pair's log-probability gap moved by
``(base[a] - base[b]) + (opt[b] - opt[a])``, and a move no larger than the configuration's dtype moves
it between two attention kernels (``near_tie_gap``) is a near-tie. It applies to every top-1
disagreement (``top1_flips``, ``near_tie_flips``) and to every free-running divergence
(``divergences``, ``near_tie_divergences``). The budgets (``budgets.check_budgets``) count near-ties
as agreement and judge the agreement with its sample size (``wilson_interval``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

# How far one token pair's log-probability gap may move between two healthy kernels at identical contexts, in
# nats, by dtype. Measured on smollm2-135m, eager vs SDPA attention over 1,152 pairs (benchmarks/verdict_study.py
# --near-tie-gaps, benchmarks/RESULTS.md, issue 40): largest move 2e-05 in float32, 0.5 in bfloat16, 0.0625 in
# float16. Each gap is at least the largest move; float32's keeps its earlier 0.01.
NEAR_TIE_GAPS = {"float32": 1e-2, "bfloat16": 0.5, "float16": 0.1}
# The float32 gap, and the gap of a dtype the table does not name.
NEAR_TIE_LOGPROB_GAP = NEAR_TIE_GAPS["float32"]
# Two-sided 95%: the confidence of the agreement's interval (as vLLM's accuracy gate takes it).
AGREEMENT_CONFIDENCE_Z = 1.959963984540054


def near_tie_gap(dtype: str | None) -> float:
    """The near-tie gap of a configuration's dtype (``"bfloat16"``, ``"torch.float16"``...): float32's
    for float32, a dtype the table does not name, or none."""
    name = str(dtype or "float32").removeprefix("torch.")
    return NEAR_TIE_GAPS.get(name, NEAR_TIE_LOGPROB_GAP)


def wilson_interval(successes: int, trials: int, z: float = AGREEMENT_CONFIDENCE_Z) -> tuple[float, float]:
    """The Wilson score interval of a proportion, ``successes`` of ``trials`` (95% two-sided by default).

    Unlike the normal approximation it stays inside [0, 1] and is not zero-width at 0 or ``trials``
    successes: 16 of 16 agreeing steps give (0.806, 1.0)."""
    if trials <= 0:
        raise ValueError(f"a Wilson interval needs at least one trial, got {trials}")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must be within 0..{trials}, got {successes}")
    p = successes / trials
    centre = p + z * z / (2 * trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    scale = 1 + z * z / trials
    # at 0 and all successes the bound is exact: no rounding just inside or outside [0, 1]
    low = 0.0 if successes == 0 else (centre - half) / scale
    high = 1.0 if successes == trials else (centre + half) / scale
    return low, high


@dataclass
class Similarity:
    token_match: float | None = None
    kl_mean: float | None = None
    kl_max: float | None = None
    top1: float | None = None
    near_tie: bool = False  # there was a divergence, and every divergence was a near-tie
    compared_steps: int = 0  # positions whose distributions were compared (KL, top-1)
    top1_flips: int | None = None  # compared steps whose top-1 tokens differ; None without distributions
    near_tie_flips: int | None = None  # of those, near-ties
    divergences: int = 0  # prompts whose free-running greedy tokens differ
    near_tie_divergences: int = 0  # of those, diverged at a near-tie
    near_tie_gap: float = NEAR_TIE_LOGPROB_GAP  # nats: the dtype's gap the near-ties were judged with
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def effective_token_match(self) -> float | None:
        """``token_match``, with near-tie divergences counted as matches."""
        if self.token_match is None:
            return None
        return 1.0 if self.near_tie else self.token_match

    @property
    def top1_agreeing(self) -> int | None:
        """Compared steps whose top-1 tokens agree, near-tie flips counted as agreeing; None when the flips
        were not counted (no distributions, or a NaN among them)."""
        if self.top1_flips is None or self.top1 is None or not math.isfinite(self.top1):
            return None
        return self.compared_steps - self.top1_flips + (self.near_tie_flips or 0)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def pair_gap_move(base_first: float, base_second: float, opt_first: float, opt_second: float) -> float:
    """How far the log-probability gap between two tokens moved from the baseline to the optimized side:
    ``(base[a] - base[b]) - (opt[a] - opt[b])``, with ``a`` the baseline's pick and ``b`` the optimized one's
    (both terms >= 0 at a disagreement of greedy picks). NaN when either side is NaN."""
    return (base_first - base_second) - (opt_first - opt_second)


def is_near_tie(move: float, gap: float) -> bool:
    """A disagreement that rounding alone explains (a NaN move never is)."""
    return math.isfinite(move) and move <= gap


PREFIX_ONLY_NOTE = ("KL on the shared prefix only: the runs diverged and the optimized side has no forced run, "
                    "so KL and top-1 cover the common prefix and the first divergent step")


def forced_run_note(prompts: int, positions: int, where: str = "of the optimized configuration") -> str:
    """The note a result carries when its KL and top-1 come from a forced run (free-running tokens diverged)."""
    return (f"free-running tokens diverged: KL and top-1 from a forced run {where} decoding the baseline's tokens "
            f"({prompts} prompts x {positions} positions)")


def diverged(baseline_tokens: list[list[int]], optimized_tokens: list[list[int]]) -> bool:
    """Whether any prompt's free-running tokens differ: then a forced run is needed for KL at every position."""
    return len(baseline_tokens) != len(optimized_tokens) or any(
        list(b) != list(o) for b, o in zip(baseline_tokens, optimized_tokens))


def set_agreement(result: Similarity, kls: list[float], flips: int, near_tie_flips: int, saw_nan: bool,
                  divergence_ties: list[bool]) -> None:
    """The figures every comparison ends with (``compare_runs``, ``baselines.similarity_against_stored``):
    KL mean and max, top-1 agreement and its flips, the near-ties. A NaN anywhere makes KL and top-1 NaN
    and leaves the flips uncounted: NaN never passes."""
    result.compared_steps = len(kls)
    result.divergences = len(divergence_ties)
    result.near_tie_divergences = sum(divergence_ties)
    result.near_tie = bool(divergence_ties) and all(divergence_ties)
    if not kls:
        return
    finite = not saw_nan and all(math.isfinite(v) for v in kls)
    result.kl_mean = sum(kls) / len(kls) if finite else math.nan
    result.kl_max = max(kls) if finite else math.nan
    result.top1 = (len(kls) - flips) / len(kls) if finite else math.nan
    if finite:
        result.top1_flips, result.near_tie_flips = flips, near_tie_flips


def compare_runs(baseline_tokens: list[list[int]], optimized_tokens: list[list[int]], requested: int,
                 baseline_logprobs: list[Any] | None = None, optimized_logprobs: list[Any] | None = None,
                 forced_logprobs: list[Any] | None = None, *, dtype: str | None = None) -> Similarity:
    """Similarity of two greedy runs over the same prompts (see module docstring).

    ``forced_logprobs``: the optimized configuration's distributions while decoding the baseline's
    tokens; when given, they replace ``optimized_logprobs`` for KL and top-1 at every position.
    ``dtype``: the configuration's dtype, which sets the near-tie gap (``near_tie_gap``)."""
    if len(baseline_tokens) != len(optimized_tokens):
        raise ValueError(f"baseline has {len(baseline_tokens)} sequences, optimized {len(optimized_tokens)}")
    requested = max(requested, 1)
    prefixes = [common_prefix(b, o) for b, o in zip(baseline_tokens, optimized_tokens)]
    token_match = sum(min(p, requested) / requested for p in prefixes) / max(len(prefixes), 1)
    gap = near_tie_gap(dtype)
    result = Similarity(token_match=token_match, near_tie_gap=gap)
    if baseline_logprobs is None or optimized_logprobs is None:
        result.note = "no per-step distributions on one side (continuous batching returns tokens only)"
        result.divergences = sum(p < min(len(b), len(o))
                                 for p, b, o in zip(prefixes, baseline_tokens, optimized_tokens))
        return result
    forced = forced_logprobs is not None
    if forced_logprobs is not None and len(forced_logprobs) != len(baseline_tokens):
        raise ValueError(f"baseline has {len(baseline_tokens)} sequences, forced run {len(forced_logprobs)}")
    source = forced_logprobs if forced_logprobs is not None else optimized_logprobs
    kls: list[float] = []
    flips = near_tie_flips = 0
    saw_nan = False
    ties: list[bool] = []
    for index, prefix in enumerate(prefixes):
        base_lp = baseline_logprobs[index].double()
        opt_lp = source[index].double()
        # forced: every position has the baseline's context; free: up to the first divergent step
        steps = min(base_lp.shape[0] if forced else prefix + 1, base_lp.shape[0], opt_lp.shape[0])
        if steps == 0:
            continue
        b, o = base_lp[:steps], opt_lp[:steps]
        kl = (b.exp() * (b - o)).sum(dim=-1).clamp_min(0.0)  # KL >= 0; rounding can dip below
        kls.extend(kl.tolist())
        saw_nan = saw_nan or bool(b.isnan().any() or o.isnan().any())
        base_top, opt_top = b.argmax(-1), o.argmax(-1)
        for step in (base_top != opt_top).nonzero().flatten().tolist():
            first, second = int(base_top[step]), int(opt_top[step])
            flips += 1
            near_tie_flips += is_near_tie(pair_gap_move(float(b[step, first]), float(b[step, second]),
                                                        float(o[step, first]), float(o[step, second])), gap)
        if prefix < min(len(baseline_tokens[index]), len(optimized_tokens[index])):
            base_tok, opt_tok = baseline_tokens[index][prefix], optimized_tokens[index][prefix]
            if prefix < min(base_lp.shape[0], opt_lp.shape[0]):  # both sides' distributions at the same context
                ties.append(is_near_tie(pair_gap_move(float(base_lp[prefix, base_tok]), float(base_lp[prefix, opt_tok]),
                                                      float(opt_lp[prefix, base_tok]), float(opt_lp[prefix, opt_tok])),
                                        gap))
            else:
                ties.append(False)
    set_agreement(result, kls, flips, near_tie_flips, saw_nan, ties)
    if not forced and diverged(baseline_tokens, optimized_tokens):
        result.note = PREFIX_ONLY_NOTE
    return result
