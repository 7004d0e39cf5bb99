"""Similarity judged with its sample size and its dtype: the Wilson bound, the dtype's near-tie gap, the flips
``compare_runs`` counts, and how ``check_budgets`` judges ``min_top1`` and ``min_token_match`` with them."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import binomtest

from pytest_transformers_opt.verdict.budgets import Budget, check_budgets, format_checks
from pytest_transformers_opt.verdict.results import OptResult, SideMetrics, Workload
from pytest_transformers_opt.verdict.similarity import (NEAR_TIE_GAPS, NEAR_TIE_LOGPROB_GAP, Similarity, compare_runs,
                                                        near_tie_gap, wilson_interval)


# ------------------------------------------------------------------------------------------ the Wilson bound

@pytest.mark.parametrize("successes, trials", [(15, 16), (44, 48), (5, 6), (70, 72), (1, 3), (0, 16), (16, 16), (0, 1),
                                               (1, 1), (999, 1000)])
def test_wilson_interval_matches_scipy(successes: int, trials: int) -> None:
    reference = binomtest(successes, trials).proportion_ci(confidence_level=0.95, method="wilson")
    low, high = wilson_interval(successes, trials)
    assert low == pytest.approx(reference.low, abs=1e-9) and high == pytest.approx(reference.high, abs=1e-9)
    assert 0.0 <= low <= successes / trials <= high <= 1.0


def test_wilson_bound_widens_with_fewer_steps_and_is_exact_at_the_ends() -> None:
    # 2 flips in 16 steps (0.875) may come from an agreement of 0.95; 50 in 400 (the same 0.875) cannot
    assert wilson_interval(14, 16)[1] > 0.95 > wilson_interval(350, 400)[1]
    uppers = [wilson_interval(7 * n // 8, n)[1] for n in (8, 16, 48, 200, 2000)]  # the same 0.875 each time
    assert uppers == sorted(uppers, reverse=True)  # more steps, tighter bound
    assert wilson_interval(16, 16) == (pytest.approx(0.8064, abs=1e-4), 1.0)  # all agree: the top is exactly 1
    assert wilson_interval(0, 16)[0] == 0.0
    assert wilson_interval(15, 16)[1] < 1.0  # so a limit of 1.0 still needs every step


@pytest.mark.parametrize("successes, trials, needle", [(1, 0, "at least one trial"), (-1, 4, "within 0..4"),
                                                       (5, 4, "within 0..4")])
def test_wilson_interval_refuses_impossible_counts(successes: int, trials: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        wilson_interval(successes, trials)


# ------------------------------------------------------------------------------------------ the dtype's gap

def test_near_tie_gap_fits_the_dtype() -> None:
    assert near_tie_gap("float32") == near_tie_gap(None) == NEAR_TIE_LOGPROB_GAP
    assert near_tie_gap("torch.bfloat16") == near_tie_gap("bfloat16") == NEAR_TIE_GAPS["bfloat16"]
    assert near_tie_gap("auto") == NEAR_TIE_LOGPROB_GAP  # a dtype the table does not name: the strictest
    # bf16 keeps 8 bits of mantissa, fp16 11, fp32 24: the gap grows as precision shrinks
    assert near_tie_gap("bfloat16") > near_tie_gap("float16") > near_tie_gap("float32")


# ------------------------------------------------------------------------------------------ counting flips

def _logprobs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log_softmax(-1)


def _flipped(move: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Four steps; at step 2 the baseline prefers token 0 and the optimized side token 1, the pair's gap moving by
    ``move`` nats (half on each side)."""
    base = [[4.0, 0.0, 0.0], [0.0, 4.0, 0.0], [1.0 + move / 4, 1.0 - move / 4, 0.0], [0.0, 0.0, 4.0]]
    opt = [row[:] for row in base]
    opt[2] = [1.0 - move / 4, 1.0 + move / 4, 0.0]
    return _logprobs(base), _logprobs(opt)


def test_top1_flips_and_their_near_ties_follow_the_dtype() -> None:
    move = (NEAR_TIE_GAPS["float32"] + NEAR_TIE_GAPS["bfloat16"]) / 2  # a tie in bf16, not in fp32
    base, opt = _flipped(move)
    tokens = [[0, 1, 0, 2]]
    for dtype, ties in (("float32", 0), ("bfloat16", 1)):
        result = compare_runs(tokens, tokens, 4, [base], [opt], forced_logprobs=[opt], dtype=dtype)
        assert (result.top1, result.compared_steps, result.top1_flips) == (0.75, 4, 1)
        assert result.near_tie_flips == ties and result.near_tie_gap == near_tie_gap(dtype)
        assert result.top1_agreeing == 3 + ties
    far = compare_runs(tokens, tokens, 4, [base], [_flipped(1.0)[1]], forced_logprobs=[_flipped(1.0)[1]],
                       dtype="bfloat16")
    assert far.top1_flips == 1 and far.near_tie_flips == 0  # 1 nat is no rounding, even in bf16


def test_a_divergence_is_a_near_tie_only_when_both_sides_were_close() -> None:
    base, opt = _flipped(NEAR_TIE_LOGPROB_GAP / 2)
    tied = compare_runs([[0, 1, 0, 2]], [[0, 1, 1, 2]], 4, [base], [opt], forced_logprobs=[opt])
    assert tied.divergences == tied.near_tie_divergences == 1 and tied.near_tie
    assert tied.token_match == 0.5 and tied.effective_token_match == 1.0
    # the baseline was as close, but the optimized side moved far past it: not rounding
    pushed = opt.clone()
    pushed[2] = _logprobs([[0.0, 3.0, 0.0]])[0]
    real = compare_runs([[0, 1, 0, 2]], [[0, 1, 1, 2]], 4, [base], [pushed], forced_logprobs=[pushed])
    assert real.divergences == 1 and real.near_tie_divergences == 0 and not real.near_tie


def test_nan_leaves_top1_nan_and_the_flips_uncounted() -> None:
    base, opt = _flipped(0.0)
    broken = compare_runs([[0, 1, 0, 2]], [[0, 1, 0, 2]], 4, [base], [opt * float("nan")])
    assert math.isnan(broken.top1) and math.isnan(broken.kl_mean)
    assert broken.top1_flips is None and broken.top1_agreeing is None


# ------------------------------------------------------------------------------------------ the budgets

def _result(similarity: Similarity, prompts: int = 1, tokens: int = 16) -> OptResult:
    side = SideMetrics(latency_s=1.0, latency_samples_s=[1.0] * 3, peak_memory_bytes=2**20, rounds=3)
    return OptResult(baseline=side, optimized=side, similarity=similarity,
                     workload=Workload(["p"] * prompts, tokens, 1, 3, 0), techniques=["sdpa"],
                     baseline_techniques=["eager"])


def _top1(steps: int, flips: int, ties: int = 0) -> Similarity:
    return Similarity(token_match=1.0, kl_mean=1e-4, top1=(steps - flips) / steps, compared_steps=steps,
                      top1_flips=flips, near_tie_flips=ties)


def test_min_top1_passes_on_its_upper_bound_and_says_how_it_was_judged() -> None:
    budget = {"min_top1": Budget("min_top1", 0.95, "default")}
    [one_flip] = check_budgets(_result(_top1(16, 1)), budget)
    assert one_flip.ok and one_flip.measured == 0.9375  # the measured figure stays the raw agreement
    assert one_flip.note == "1 flip in 16 steps; Wilson upper bound 0.989"
    assert format_checks([one_flip]).splitlines()[1] == \
        "min_top1  0.9375    >= 0.95  ok (1 flip in 16 steps; Wilson upper bound 0.989)  default"
    [many] = check_budgets(_result(_top1(16, 6)), budget)  # a broken technique: 6 flips in 16
    assert many.ok is False and many.note == f"6 flips in 16 steps; Wilson upper bound {wilson_interval(10, 16)[1]:.3g}"
    [long_run] = check_budgets(_result(_top1(400, 40), tokens=400), budget)  # 0.9 over 400 steps is 0.9
    assert long_run.ok is False
    [tied] = check_budgets(_result(_top1(16, 6, ties=5)), budget)  # near-ties count as agreeing
    assert tied.ok and tied.note == "6 flips in 16 steps, 5 near-tie; Wilson upper bound 0.989"
    [clean] = check_budgets(_result(_top1(16, 0)), budget)
    assert clean.ok and clean.note is None


def test_a_limit_of_one_still_asks_for_every_step() -> None:
    exact = {"min_top1": Budget("min_top1", 1.0, "marker")}
    assert check_budgets(_result(_top1(16, 1)), exact)[0].ok is False
    assert check_budgets(_result(_top1(16, 1, ties=1)), exact)[0].ok is True  # the one flip was a near-tie
    match = {"min_token_match": Budget("min_token_match", 1.0, "default")}
    diverged = Similarity(token_match=15 / 16, divergences=1)
    assert check_budgets(_result(diverged), match)[0].ok is False


def test_min_token_match_is_judged_over_every_requested_token() -> None:
    budget = {"min_token_match": Budget("min_token_match", 0.9, "default")}
    # 3 prompts x 24 tokens, one diverging at step 18: 66 of 72 match (0.917)
    late = Similarity(token_match=66 / 72, divergences=1)
    [check] = check_budgets(_result(late, prompts=3, tokens=24), budget)
    assert check.ok and check.note == "1 of 3 prompts diverged; Wilson upper bound 0.961"
    early = Similarity(token_match=30 / 72, divergences=2)  # two prompts diverging early: broken
    assert check_budgets(_result(early, prompts=3, tokens=24), budget)[0].ok is False
    tied = Similarity(token_match=0.5, divergences=1, near_tie_divergences=1, near_tie=True)
    [check] = check_budgets(_result(tied, prompts=1, tokens=24), {"min_token_match": Budget("min_token_match", 1.0,
                                                                                              "default")})
    assert check.ok and check.measured == 1.0 and check.note == "1 of 1 prompts diverged, 1 at a near-tie (raw token match 0.5)"


def test_nan_never_passes_even_on_a_short_run() -> None:
    nan = Similarity(token_match=1.0, kl_mean=math.nan, top1=math.nan, compared_steps=2)
    [check] = check_budgets(_result(nan, tokens=2), {"min_top1": Budget("min_top1", 0.0, "marker")})
    assert check.ok is False and "NaN" in (check.note or "")
