"""Unit tests of the pieces a verdict is made of: warm-up, significance, similarity, budget checks."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_transformers_opt.verdict.bench import warm_until_stable, warmup_bounds
from pytest_transformers_opt.verdict.budgets import Budget, check_budgets
from pytest_transformers_opt.verdict.results import OptResult, SideMetrics, Workload
from pytest_transformers_opt.verdict.similarity import NEAR_TIE_LOGPROB_GAP, Similarity, compare_runs
from pytest_transformers_opt.verdict.stats import mann_whitney_greater, median_ratio_interval, min_p_value


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



# ---------------------------------------------------------------- the speedup's interval
def _paired_samples(rng, rounds: int, shift: float) -> tuple[list[float], list[float]]:
    """Baseline and optimized latencies of interleaved rounds: per-round noise plus a slow spell both share."""
    common = [rng.gauss(0.0, 0.05) for _ in range(rounds)]
    base = [math.exp(rng.gauss(0.0, 0.05) + c) for c in common]
    opt = [math.exp(rng.gauss(0.0, 0.05) + c) / shift for c in common]
    return base, opt


@pytest.mark.parametrize("rounds", [5, 10])
def test_speedup_interval_covers_the_truth_about_95_percent_and_sees_a_30_percent_shift(rounds):
    import random

    rng = random.Random(13)
    null = [median_ratio_interval(*_paired_samples(rng, rounds, 1.0), paired=True) for _ in range(200)]
    covered = sum(low <= 1.0 <= high for low, high in null) / len(null)
    assert 0.90 <= covered <= 0.995, covered  # a 95% interval: about 190 of 200 hold the true ratio 1.0
    shifted = [median_ratio_interval(*_paired_samples(rng, rounds, 1.3), paired=True) for _ in range(200)]
    assert sum(low > 1.0 for low, _high in shifted) >= 198  # 30% faster: the interval lies above 1.0
    assert sum(low <= 1.3 <= high for low, high in shifted) / len(shifted) >= 0.90


def test_speedup_interval_is_seeded_by_its_samples_and_honest_about_too_few():
    base, opt = [1.0, 1.1, 0.9, 1.05, 0.95], [0.8, 0.85, 0.75, 0.9, 0.82]
    first = median_ratio_interval(base, opt, paired=True)
    assert first == median_ratio_interval(list(base), list(opt), paired=True)  # same samples, same interval
    assert first is not None and first[0] <= 1.0 / 0.82 <= first[1]  # holds the point estimate
    assert median_ratio_interval(base, opt, paired=False) != first  # another question, another stream
    assert median_ratio_interval(base[:4], opt[:4], paired=True) is None  # 4 rounds: too few to say 95%
    assert median_ratio_interval(base, [0.0, *opt[1:]], paired=True) is None  # not a latency
    with pytest.raises(ValueError, match="equal lengths"):
        median_ratio_interval(base, opt[:4] + [1.0, 1.0], paired=True)
    # a slow spell both sides share cancels when whole rounds are resampled
    drift = [1.0, 1.0, 1.6, 1.6, 1.0, 1.0, 1.6, 1.6]
    paired = median_ratio_interval([d * 1.2 for d in drift], drift, paired=True)
    unpaired = median_ratio_interval([d * 1.2 for d in drift], drift, paired=False)
    assert paired is not None and unpaired is not None
    assert paired[1] - paired[0] < unpaired[1] - unpaired[0]


def test_bootstrap_of_a_thousand_rounds_stays_fast():
    import random
    import time

    base, opt = _paired_samples(random.Random(3), 1000, 1.1)
    start = time.perf_counter()
    low, high = median_ratio_interval(base, opt, paired=True)
    assert time.perf_counter() - start < 2.0  # measured ~65 ms; the bound only catches a pathological slowdown
    assert low < 1.1 < high


def test_result_carries_speedup_and_memory_verdicts():
    from pytest_transformers_opt.verdict.results import FASTER, NO_DIFFERENCE, SLOWER, SMALLER

    faster = _result(base_latency=(1.0, 1.01, 0.99, 1.0, 1.02), opt_latency=(0.7, 0.71, 0.69, 0.7, 0.72),
                     opt_mem=80 * 2**20).with_intervals(paired=True)
    low, high = faster.speedup_interval
    assert low <= faster.speedup <= high and low > 1.0
    assert faster.speedup_verdict == FASTER and faster.speedup_interval_note is None
    assert faster.memory_ratio_verdict == SMALLER and faster.memory_ratio_interval is None
    assert "read once per side" in faster.memory_ratio_interval_note
    data = faster.to_dict()
    assert data["speedup_interval"] == [low, high] and data["speedup_verdict"] == "faster"
    assert data["memory_ratio_verdict"] == "smaller" and data["memory_ratio_interval"] is None
    slower = _result(base_latency=(1.0, 1.01, 0.99, 1.0, 1.02), opt_latency=(1.3, 1.31, 1.29, 1.3, 1.32),
                     opt_mem=100 * 2**20 + 2**19).with_intervals(paired=True)
    assert slower.speedup_verdict == SLOWER
    assert slower.memory_ratio_verdict == NO_DIFFERENCE  # +0.5 MiB: inside the memory budgets' slack
    tie = _result(base_latency=(1.0, 1.2, 0.9, 1.1, 1.0), opt_latency=(1.05, 1.0, 1.1, 0.95, 1.15))
    assert tie.with_intervals(paired=True).speedup_verdict == NO_DIFFERENCE
    too_few = _result(base_latency=(1.0, 1.0), opt_latency=(0.5, 0.5)).with_intervals(paired=True)
    assert too_few.speedup_interval is None and too_few.speedup_verdict is None
    assert "needs at least 5" in too_few.speedup_interval_note
    stored = _result(base_latency=(1.0,) * 7, opt_latency=(0.5,) * 5).with_intervals(paired=True)
    assert stored.speedup_verdict == FASTER  # unequal rounds (a stored baseline): each side resampled alone


# ---------------------------------------------------------------- default similarity budgets
def _documented_default_budgets() -> dict[tuple[str, str], dict[str, float]]:
    """The documentation's default-similarity table (docs/hooks/reference.py renders it at build time):
    (quality class, column) -> its budgets."""
    import re

    from doc_examples import reference_hook  # tests/ is on sys.path (pytest's rootdir conftest import)

    lines = reference_hook().similarity_defaults().splitlines()
    columns = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        for column, cell in zip(columns[1:], cells[1:]):
            rows[(cells[0].strip("`"), column)] = {name: float(value)
                                                   for name, value in re.findall(r"`(\w+)=([0-9.e-]+)`", cell)}
    return rows


def test_default_budgets_are_the_documented_table_and_a_quantized_cache_is_classed_by_its_bits() -> None:
    from pytest_transformers_opt.verdict.budgets import default_similarity
    from pytest_transformers_opt.techniques.base import LOSSLESS, LOSSY_4BIT, WEIGHTS_8BIT
    from pytest_transformers_opt.techniques.catalogue import BUILTIN_TECHNIQUES

    documented = _documented_default_budgets()
    assert documented[("lossless", "float32")] == {"min_token_match": 1.0, "max_kl": 1e-3}
    assert documented[("lossless", "bfloat16 / float16")] == default_similarity(LOSSLESS, "bfloat16")
    assert documented[("8bit", "bfloat16 / float16")] == default_similarity(WEIGHTS_8BIT, "bfloat16")
    assert documented[("4bit", "float32")] == default_similarity(LOSSY_4BIT, "float32")
    assert documented[("lossless", "tokens only (continuous batching), float32")] == \
        default_similarity(LOSSLESS, "float32", distributions=False)
    # the values benchmarks/RESULTS.md set them to (healthy smollm2-135m passes, breakage fails)
    assert default_similarity(LOSSLESS, "float16") == {"max_kl": 0.005, "min_top1": 0.95}
    assert default_similarity(WEIGHTS_8BIT, "float32") == {"max_kl": 0.07, "min_top1": 0.85}
    assert default_similarity(LOSSY_4BIT, "bfloat16") == {"max_kl": 0.5, "min_top1": 0.6}
    # a 4-bit quanto KV cache errs like 8-bit weights; 2 bits like 4-bit weights or worse
    cache = next(t for t in BUILTIN_TECHNIQUES if t.name == "quantized_cache")
    assert cache(backend="quanto", nbits=4).quality == WEIGHTS_8BIT
    assert cache(backend="quanto", nbits=2).quality == LOSSY_4BIT
    assert cache(backend="hqq", nbits=8).quality == WEIGHTS_8BIT
    assert cache(backend="hqq", nbits=3).quality == LOSSY_4BIT
