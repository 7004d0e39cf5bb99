"""Unit tests of the one-sided Wilcoxon signed-rank test (verdict/stats.py) that judges an ``--opt-ab`` row's
interleaved rounds on their pairs: hand-computed cases, and scipy's ``wilcoxon(alternative="greater")`` on
seeded random samples, with and without ties (and zeros, which both drop)."""

from __future__ import annotations

import math
import random

import pytest

from pytest_transformers_opt.verdict.stats import (EXACT_SIGNED_RANK_PAIRS, SIGNIFICANCE, _signed_rank_counts,
                                                   min_signed_rank_p_value, wilcoxon_signed_rank_greater)


@pytest.mark.parametrize("differences, p_value", [
    ([1.0, 2.0, 3.0, 4.0, 5.0], 1 / 32),  # every sign positive: the one pattern of 2**5 with W+ = 15
    ([-1.0, 2.0, 3.0, 4.0, 5.0], 2 / 32),  # W+ = 14: {1..5} and {2..5} reach it
    ([1.0, -2.0, 3.0, 4.0, 5.0], 3 / 32),  # W+ = 13: and {1, 3, 4, 5}
    ([0.3, -0.1, 0.2], 2 / 8),  # W+ = 5 of ranks 3 and 2: {3, 2} and {3, 2, 1}
    ([-1.0, -2.0, -3.0], 1.0),  # every sign negative: W+ = 0, which every pattern reaches
    ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 1 / 32),  # a zero is dropped: the test is on the other five
    ([], 1.0),
    ([0.0, 0.0], 1.0),
])
def test_exact_values_by_hand(differences: list[float], p_value: float) -> None:
    assert wilcoxon_signed_rank_greater(differences) == pytest.approx(p_value)


def test_ties_take_the_normal_approximation_with_its_tie_and_continuity_corrections() -> None:
    # six equal differences: average rank 3.5 each, W+ = 21; mean 6 * 7 / 4, variance 6 * 7 * 13 / 24 less
    # (6**3 - 6) / 48 for the tie of six; the statistic 0.5 nearer the mean
    z = (21 - 10.5 - 0.5) / math.sqrt(6 * 7 * 13 / 24 - (6 ** 3 - 6) / 48)
    assert wilcoxon_signed_rank_greater([0.01] * 6) == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)))
    # past EXACT_SIGNED_RANK_PAIRS the normal approximation too, without ties
    n = EXACT_SIGNED_RANK_PAIRS + 1
    z = (n * (n + 1) / 2 - n * (n + 1) / 4 - 0.5) / math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
    assert wilcoxon_signed_rank_greater([float(i) for i in range(1, n + 1)]) == pytest.approx(
        0.5 * math.erfc(z / math.sqrt(2)))


@pytest.mark.parametrize("n", [1, 5, 12, EXACT_SIGNED_RANK_PAIRS])
def test_the_exact_counts_cover_every_sign_pattern_symmetrically(n: int) -> None:
    counts = _signed_rank_counts(n)
    assert len(counts) == n * (n + 1) // 2 + 1 and sum(counts) == 2 ** n
    assert counts == counts[::-1]  # W+ and W- = n(n+1)/2 - W+ are alike under the null


def test_the_smallest_p_value_of_n_pairs_and_where_it_reaches_significance() -> None:
    assert [min_signed_rank_p_value(n) for n in (0, 1, 4, 5, 10)] == [1.0, 0.5, 1 / 16, 1 / 32, 1 / 1024]
    assert min_signed_rank_p_value(4) >= SIGNIFICANCE > min_signed_rank_p_value(5)
    for n in (4, 5, 10):  # reached when every difference is positive
        assert wilcoxon_signed_rank_greater([float(i) for i in range(1, n + 1)]) == pytest.approx(
            min_signed_rank_p_value(n))


SEEDS = range(12)


@pytest.mark.parametrize("seed", SEEDS)
def test_scipy_agrees_without_ties(seed: int) -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(seed)
    n = rng.randint(5, EXACT_SIGNED_RANK_PAIRS)
    differences = [rng.gauss(rng.choice([-0.5, 0.0, 0.5]), 1.0) for _ in range(n)]
    expected = stats.wilcoxon(differences, alternative="greater", method="exact").pvalue
    assert wilcoxon_signed_rank_greater(differences) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_scipy_agrees_with_ties_and_zeros(seed: int) -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(seed)
    n = rng.randint(20, 90)
    # quarter steps from -2 to +2.5: many tied absolute values, and some zeros
    differences = [0.25 * rng.randint(-8, 10) for _ in range(n)]
    kept = [abs(d) for d in differences if d != 0]
    assert len(set(kept)) < len(kept)  # ties, so the normal approximation
    expected = stats.wilcoxon(differences, alternative="greater", method="approx", correction=True,
                              zero_method="wilcox").pvalue
    assert wilcoxon_signed_rank_greater(differences) == pytest.approx(expected, rel=1e-9, abs=1e-12)
