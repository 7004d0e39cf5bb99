"""How close the optimized outputs are to the baseline's.

``token_match`` comes from free-running greedy generation: for each prompt, the common prefix is
the run of greedy tokens equal in both, over the requested length. A divergence where the baseline
itself had two tokens within ``NEAR_TIE_LOGPROB_GAP`` nats is a near-tie: float rounding may pick
either, so for lossless techniques it counts as a match.

Next-token distributions (KL(baseline || optimized), and whether the top-1 tokens agree) are
compared at every generated position with identical contexts. When the free runs produced the same
tokens, their distributions already are; when they diverged, the optimized configuration runs again
through its own generation path while being forced to decode the baseline's tokens
(``forced_logprobs``, see ``generation.run_generation(force_tokens=...)``), so every one of the
``max_new_tokens`` positions of every prompt is compared. Without a forced run (a side that returns
no distributions for forced tokens) only the shared prefix plus the first divergent step is compared,
and the note says so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

# Log-probability gap under which two candidate tokens are a tie for float32 rounding purposes.
NEAR_TIE_LOGPROB_GAP = 1e-2


@dataclass
class Similarity:
    token_match: float | None = None
    kl_mean: float | None = None
    kl_max: float | None = None
    top1: float | None = None
    near_tie: bool = False  # every divergence was a near-tie in the baseline
    compared_steps: int = 0
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def effective_token_match(self) -> float | None:
        """``token_match``, with near-tie divergences counted as matches."""
        if self.token_match is None:
            return None
        return 1.0 if self.near_tie else self.token_match


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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


def compare_runs(baseline_tokens: list[list[int]], optimized_tokens: list[list[int]], requested: int,
                 baseline_logprobs: list[Any] | None = None, optimized_logprobs: list[Any] | None = None,
                 forced_logprobs: list[Any] | None = None) -> Similarity:
    """Similarity of two greedy runs over the same prompts (see module docstring).

    ``forced_logprobs``: the optimized configuration's distributions while decoding the baseline's
    tokens; when given, they replace ``optimized_logprobs`` for KL and top-1 at every position."""
    if len(baseline_tokens) != len(optimized_tokens):
        raise ValueError(f"baseline has {len(baseline_tokens)} sequences, optimized {len(optimized_tokens)}")
    requested = max(requested, 1)
    prefixes = [common_prefix(b, o) for b, o in zip(baseline_tokens, optimized_tokens)]
    token_match = sum(min(p, requested) / requested for p in prefixes) / max(len(prefixes), 1)
    result = Similarity(token_match=token_match)
    if baseline_logprobs is None or optimized_logprobs is None:
        result.note = "no per-step distributions on one side (continuous batching returns tokens only)"
        result.near_tie = False
        return result
    forced = forced_logprobs is not None
    if forced_logprobs is not None and len(forced_logprobs) != len(baseline_tokens):
        raise ValueError(f"baseline has {len(baseline_tokens)} sequences, forced run {len(forced_logprobs)}")
    source = forced_logprobs if forced_logprobs is not None else optimized_logprobs
    kls: list[float] = []
    agreements: list[float] = []
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
        agreements.extend((b.argmax(-1) == o.argmax(-1)).double().tolist())
        if prefix < min(len(baseline_tokens[index]), len(optimized_tokens[index])):
            step = base_lp[prefix]
            base_tok, opt_tok = baseline_tokens[index][prefix], optimized_tokens[index][prefix]
            ties.append(float(step[base_tok] - step[opt_tok]) <= NEAR_TIE_LOGPROB_GAP)
    result.compared_steps = len(kls)
    if kls:
        finite = all(math.isfinite(v) for v in kls)
        result.kl_mean = sum(kls) / len(kls) if finite else math.nan
        result.kl_max = max(kls) if finite else math.nan
        result.top1 = sum(agreements) / len(agreements)
    result.near_tie = bool(ties) and all(ties)
    if not forced and diverged(baseline_tokens, optimized_tokens):
        result.note = PREFIX_ONLY_NOTE
    return result
