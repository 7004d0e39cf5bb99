"""Unit tests of the pieces a verdict is made of: warm-up, significance, similarity, budget checks."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_transformers_opt.bench import warm_until_stable, warmup_bounds
from pytest_transformers_opt.budgets import Budget, check_budgets
from pytest_transformers_opt.results import OptResult, SideMetrics, Workload
from pytest_transformers_opt.similarity import NEAR_TIE_LOGPROB_GAP, Similarity, compare_runs
from pytest_transformers_opt.stats import mann_whitney_greater, min_p_value


def _rounds(values):
    it = iter(values)
    return lambda: next(it)


def test_warm_up_runs_until_two_rounds_agree_within_bounds():
    assert warm_until_stable(_rounds([10, 5, 3, 2.9, 2.0]), minimum=2, maximum=10) == [10, 5, 3, 2.9]
    assert warm_until_stable(_rounds([1.0, 1.0, 1.0, 1.0, 1.0]), minimum=5, maximum=13) == [1.0] * 5
    assert warm_until_stable(_rounds([9, 1, 9, 1]), minimum=1, maximum=4) == [9, 1, 9, 1]  # never stable: capped
    assert warm_until_stable(_rounds([]), minimum=0, maximum=0) == []
    assert warmup_bounds(1, compiled=False, cuda=False) == (1, 4)  # CPU: what was asked, then up to 3 more
    assert warmup_bounds(1, compiled=True, cuda=False) == (2, 5)  # ... a compiled first call never counts
    assert warmup_bounds(0, compiled=False, cuda=True) == (0, 0)  # 0 asked: no warm-up on any device
    assert warmup_bounds(1, compiled=True, cuda=True)[0] == 5  # compiled on CUDA: at least 5
    assert warmup_bounds(3, compiled=False, cuda=True)[1] > 3


def test_mann_whitney_exact_values():
    assert mann_whitney_greater([6, 7, 8, 9, 10], [1, 2, 3, 4, 5]) == pytest.approx(1 / 252)
    assert mann_whitney_greater([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(1.0)
    assert 0.4 < mann_whitney_greater([1, 3, 5, 7, 9], [2, 4, 6, 8, 10]) < 0.8
    assert min_p_value(5, 5) == pytest.approx(1 / 252)
    assert min_p_value(3, 3) == pytest.approx(1 / 20)  # 3+3 rounds can never reach p < 0.05


def _logprobs(rows):
    return torch.tensor(rows, dtype=torch.float64).log_softmax(-1)


def test_similarity_identical_divergent_near_tie_and_nan():
    lp = _logprobs([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 5.0]])
    same = compare_runs([[0, 1, 2]], [[0, 1, 2]], 3, [lp], [lp.clone()])
    assert same.token_match == 1.0 and same.kl_mean == pytest.approx(0.0, abs=1e-12) and same.top1 == 1.0
    other = _logprobs([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    diverged = compare_runs([[0, 1, 2]], [[0, 0, 2]], 3, [lp], [other])
    assert diverged.token_match == pytest.approx(1 / 3)
    assert diverged.compared_steps == 2 and diverged.top1 == 0.5 and diverged.kl_max > 1
    assert not diverged.near_tie
    tie = _logprobs([[5.0, 5.0 - NEAR_TIE_LOGPROB_GAP / 2, 0.0]])
    tied = compare_runs([[0]], [[1]], 1, [tie], [tie.clone()])
    assert tied.token_match == 0.0 and tied.near_tie and tied.effective_token_match == 1.0
    broken = compare_runs([[0, 1, 2]], [[0, 1, 2]], 3, [lp], [lp * float("nan")])
    assert math.isnan(broken.kl_mean)


def _result(similarity=None, base_latency=(1.0,) * 5, opt_latency=(1.0,) * 5, base_mem=100 * 2**20,
            opt_mem=100 * 2**20) -> OptResult:
    import statistics

    def side(samples, memory):
        return SideMetrics(latency_s=statistics.median(samples), latency_samples_s=list(samples),
                           peak_memory_bytes=memory, rounds=len(samples))

    return OptResult(baseline=side(base_latency, base_mem), optimized=side(opt_latency, opt_mem),
                     similarity=similarity, workload=Workload(["p"], 4, 1, 5, 1), techniques=["x"],
                     baseline_techniques=["eager"])


def test_nan_never_passes_whatever_the_budget():
    nan = Similarity(token_match=1.0, kl_mean=float("nan"), top1=float("nan"))
    checks = check_budgets(_result(nan), {"max_kl": Budget("max_kl", 1e9, "marker"),
                                          "min_top1": Budget("min_top1", 0.0, "marker")})
    assert [c.ok for c in checks] == [False, False]
    assert all("NaN" in (c.note or "") for c in checks)


def test_memory_slack_and_speed_significance():
    slightly_over = _result(opt_mem=100 * 2**20 + 2**19)  # +0.5 MiB on a 100 MiB limit
    [check] = check_budgets(slightly_over, {"max_memory_ratio": Budget("max_memory_ratio", 1.0, "marker")})
    assert check.ok and "slack" in check.note
    far_over = _result(opt_mem=110 * 2**20)
    assert not check_budgets(far_over, {"max_memory_ratio": Budget("max_memory_ratio", 1.0, "marker")})[0].ok
    noisy_tie = _result(base_latency=(1.0, 1.2, 0.9, 1.1, 1.0), opt_latency=(1.05, 1.0, 1.1, 0.95, 1.15))
    [check] = check_budgets(noisy_tie, {"min_speedup": Budget("min_speedup", 1.0, "marker")})
    assert check.ok and "within noise" in check.note
    slower = _result(base_latency=(1.0, 1.01, 0.99, 1.0, 1.02), opt_latency=(1.3, 1.31, 1.29, 1.3, 1.32))
    [check] = check_budgets(slower, {"min_speedup": Budget("min_speedup", 1.0, "marker")})
    assert not check.ok and "significant" in check.note
    too_few = _result(base_latency=(1.0, 1.0), opt_latency=(1.3, 1.3))
    [check] = check_budgets(too_few, {"min_speedup": Budget("min_speedup", 1.0, "marker")})
    assert not check.ok and "too few rounds" in check.note
