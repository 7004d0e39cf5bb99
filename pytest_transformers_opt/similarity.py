"""How close the optimized outputs are to the baseline's, on the prefix they share.

For each prompt, the common prefix is the run of greedy tokens equal in both. Next-token
distributions are compared at every step whose context is still identical (the prefix plus the
first divergent step): KL(baseline || optimized), and whether the top-1 tokens agree.
``token_match`` is the prefix length over the requested length. A divergence where the baseline
itself had two tokens within ``NEAR_TIE_LOGPROB_GAP`` nats is a near-tie: float rounding may pick
either, so for lossless techniques it counts as a match.
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


def compare_runs(baseline_tokens: list[list[int]], optimized_tokens: list[list[int]], requested: int,
                 baseline_logprobs: list[Any] | None = None, optimized_logprobs: list[Any] | None = None) -> Similarity:
    """Similarity of two greedy runs over the same prompts (see module docstring)."""
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
    kls: list[float] = []
    agreements: list[float] = []
    ties: list[bool] = []
    for index, prefix in enumerate(prefixes):
        base_lp, opt_lp = baseline_logprobs[index].double(), optimized_logprobs[index].double()
        steps = min(prefix + 1, base_lp.shape[0], opt_lp.shape[0])
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
    return result
