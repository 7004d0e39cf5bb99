"""Small statistics for speed verdicts: a one-sided Mann-Whitney U test and a one-sided Wilcoxon signed-rank
test (rounds taken in turns), both exact for small samples, and a seeded bootstrap interval of a ratio of
medians (the reports' speedup).

Latency samples from 2-core CI machines are noisy and not normal; a rank test asks the question a
gate needs ("is the optimized side really slower?") without assuming a distribution.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import struct
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache

SIGNIFICANCE = 0.05


@lru_cache(maxsize=None)
def _u_counts(n1: int, n2: int) -> tuple[int, ...]:
    """Number of rank arrangements giving each U value (no ties), by the classic recursion."""
    if n1 == 0 or n2 == 0:
        return (1,)
    with_x = _u_counts(n1 - 1, n2)  # the largest value is from sample 1: adds n2 to U
    with_y = _u_counts(n1, n2 - 1)
    size = n1 * n2 + 1
    counts = [0] * size
    for u, c in enumerate(with_x):
        counts[u + n2] += c
    for u, c in enumerate(with_y):
        counts[u] += c
    return tuple(counts)


def mann_whitney_greater(x: list[float], y: list[float]) -> float:
    """One-sided p-value for "values of ``x`` tend to be greater than values of ``y``"."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return 1.0
    u = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in x for b in y)
    ties = len(set(x) | set(y)) < n1 + n2
    if n1 * n2 <= 400 and not ties:
        counts = _u_counts(n1, n2)
        total = sum(counts)
        return sum(counts[int(math.ceil(u)):]) / total
    mean = n1 * n2 / 2
    sd = math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)
    return _normal_sf(u - mean - 0.5, sd)


def _normal_sf(excess: float, sd: float) -> float:
    """P(Z > excess / sd) for a standard normal Z: the large-sample tail of a rank statistic (0.5 when sd is 0)."""
    z = excess / sd if sd else 0.0
    return 0.5 * math.erfc(z / math.sqrt(2))


def min_p_value(n1: int, n2: int) -> float:
    """The smallest one-sided p-value samples of these sizes can reach: 1 / C(n1 + n2, n1)."""
    return 1.0 / math.comb(n1 + n2, n1) if n1 and n2 else 1.0


EXACT_SIGNED_RANK_PAIRS = 60  # up to here the exact distribution (2**60 sign patterns, counted in 1831 sums)


@lru_cache(maxsize=None)
def _signed_rank_counts(n: int) -> tuple[int, ...]:
    """Number of sign patterns of the ranks 1..n giving each sum of the positive ranks (no ties): rank n is
    either negative (the sums of n - 1) or positive (those sums plus n)."""
    if n == 0:
        return (1,)
    smaller = _signed_rank_counts(n - 1)
    counts = [*smaller, *([0] * n)]
    for w, c in enumerate(smaller):
        counts[w + n] += c
    return tuple(counts)


def _average_ranks(values: Sequence[float]) -> list[float]:
    """The rank of each value (1 = smallest), tied values sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda index: values[index])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def wilcoxon_signed_rank_greater(differences: Sequence[float]) -> float:
    """One-sided p-value of the Wilcoxon signed-rank test for "the differences tend to be > 0" (paired rounds:
    ``new_i - old_i``, or their log-ratios).

    Zeros are dropped (Wilcoxon's convention, scipy's default ``zero_method="wilcox"``): a pair exactly at the
    tested shift says neither way, and the test is on the others. W+ is the sum of the ranks of the positive
    differences among the absolute values. Without ties and up to ``EXACT_SIGNED_RANK_PAIRS`` differences the
    exact distribution gives ``P(W+ >= w)``; otherwise the normal approximation, its variance corrected for
    tied absolute values and the statistic by 0.5 for continuity (as scipy's ``method="approx"``). 1.0 when no
    difference is left.
    """
    kept = [d for d in differences if d != 0]
    n = len(kept)
    if n == 0:
        return 1.0
    ranks = _average_ranks([abs(d) for d in kept])
    w_plus = sum(rank for rank, d in zip(ranks, kept) if d > 0)
    tie_sizes = list(Counter(ranks).values())
    if n <= EXACT_SIGNED_RANK_PAIRS and max(tie_sizes) == 1:
        counts = _signed_rank_counts(n)
        return sum(counts[int(w_plus):]) / sum(counts)  # no ties: W+ is a whole number; 2**n patterns in all
    mean = n * (n + 1) / 4
    variance = n * (n + 1) * (2 * n + 1) / 24 - sum(t ** 3 - t for t in tie_sizes) / 48
    return _normal_sf(w_plus - mean - 0.5, math.sqrt(variance))


def min_signed_rank_p_value(n: int) -> float:
    """The smallest one-sided p-value ``n`` pairs can reach (every difference on one side): 2 ** -n."""
    return 2.0 ** -n


CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 2000
# Fewer rounds per side and a percentile bootstrap of the median covers far less than it claims
# (measured with 200 seeded null trials: 5 rounds 94.5%, 4 rounds 89%, 3 rounds 74%).
MIN_BOOTSTRAP_SAMPLES = 5


def median_ratio_interval(numerator: Sequence[float], denominator: Sequence[float], *, paired: bool,
                          confidence: float = CONFIDENCE,
                          resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of ``median(numerator) / median(denominator)``.

    ``paired``: the samples are rounds taken in turns (round i of one side next to round i of the
    other), so a resample draws whole rounds and a slow spell shared by both sides cancels in the
    ratio; otherwise each side is resampled on its own. The generator is seeded from the samples
    themselves, so the same samples always give the same interval. The interval is widened, where
    needed, to hold the point estimate. None when a side has fewer than ``MIN_BOOTSTRAP_SAMPLES``
    samples or a sample that is not a positive finite number.
    """
    import numpy as np  # lazily: the plugin imports nothing heavy at start-up

    if paired and len(numerator) != len(denominator):
        raise ValueError(f"paired samples need equal lengths, got {len(numerator)} and {len(denominator)}")
    values = [*numerator, *denominator]
    if min(len(numerator), len(denominator)) < MIN_BOOTSTRAP_SAMPLES or \
            not all(math.isfinite(v) and v > 0 for v in values):
        return None
    digest = hashlib.sha256(struct.pack(f"<?II{len(values)}d", paired, len(numerator), len(denominator),
                                        *values)).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    top, bottom = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    top_index = rng.integers(0, len(top), size=(resamples, len(top)))
    bottom_index = top_index if paired else rng.integers(0, len(bottom), size=(resamples, len(bottom)))
    ratios = np.median(top[top_index], axis=1) / np.median(bottom[bottom_index], axis=1)
    tail = (1.0 - confidence) / 2
    low, high = (float(q) for q in np.quantile(ratios, [tail, 1.0 - tail]))
    point = statistics.median(numerator) / statistics.median(denominator)
    return min(low, point), max(high, point)


# ---------------------------------------------------------------------------------------------
# a new run against a window of earlier runs (``report.window``)

DEFAULT_COMPARE_WINDOW = 10  # recorded runs a test is judged against (--opt-compare-window, merge --compare-window)
MAX_COMPARE_WINDOW = 1000
MIN_WINDOW_RUNS = 5
"""Fewer runs give a spread too uncertain to judge by: with 3, a one-sided 5% bar lies 12 spreads out (the MAD of
3 values carries under one degree of freedom), so nearly every test would be inconclusive."""
MAD_SCALE = 1.4826  # 1 / Phi^-1(3/4): the MAD of normal values times this is their standard deviation
MEAN_DEVIATION_SCALE = math.sqrt(math.pi / 2)  # the same for the mean absolute deviation
MAD_EFFICIENCY = 0.37
"""The MAD's efficiency as a scale against the standard deviation (normal values): a spread from ``n`` runs is
about as good as a standard deviation from ``0.37 (n - 1)`` degrees of freedom. Simulated (400 000 normal windows
of 3 to 30 runs), the new-run statistic below follows the t distribution of those degrees of freedom down to
one-sided tails of 3e-4 (a 150-test family): the plain ``n - 1`` would make a 10-run window's tail 2x too
light there, i.e. false alarms."""


def robust_spread(values: Sequence[float]) -> tuple[float, float]:
    """(median, spread) of ``values``: the spread is ``MAD_SCALE`` times the median absolute deviation, robust to
    a slow run or two; where over half the values are equal (MAD 0) it is the mean absolute deviation, scaled
    alike, so that a few differing values still count; 0 only when every value is the same."""
    center = statistics.median(values)
    deviations = [abs(value - center) for value in values]
    mad = statistics.median(deviations)
    if mad > 0:
        return center, MAD_SCALE * mad
    return center, MEAN_DEVIATION_SCALE * statistics.fmean(deviations)


def new_run_scale(spread: float, runs: int) -> float:
    """The standard error of one new run's value against the median of ``runs`` earlier ones of this spread:
    its own spread, and the median's (pi / 2 / runs of the variance for normal values)."""
    return spread * math.sqrt(1.0 + math.pi / (2.0 * runs))


def new_run_degrees_of_freedom(runs: int) -> float:
    """The degrees of freedom a MAD spread of ``runs`` values carries (see ``MAD_EFFICIENCY``)."""
    return MAD_EFFICIENCY * (runs - 1)


def _beta_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return result


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(x, a, b) / a
    return 1.0 - front * _beta_fraction(1.0 - x, b, a) / b


def student_t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` > 0 degrees of freedom (not necessarily whole): one-sided p-value."""
    if math.isnan(t):
        return 1.0
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * _incomplete_beta(df / (df + t * t), df / 2.0, 0.5)
    return tail if t >= 0 else 1.0 - tail


def student_t_isf(p: float, df: float) -> float:
    """The t with ``student_t_sf(t, df) == p`` (0 < p < 1): the one-sided critical value at error rate ``p``."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a tail probability is between 0 and 1, exclusive; got {p!r}")
    if p > 0.5:
        return -student_t_isf(1.0 - p, df)
    low, high = 0.0, 1.0
    while student_t_sf(high, df) > p:
        low, high = high, high * 2.0
        if high > 1e300:
            return math.inf
    for _ in range(200):  # bisection: the tail falls monotonically
        middle = (low + high) / 2.0
        if student_t_sf(middle, df) > p:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2.0


def benjamini_hochberg(p_values: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values, in the order given: ``p_(i) * m / i`` made monotone from the
    largest down and capped at 1. A test is significant where its adjusted p-value is below the error rate."""
    count = len(p_values)
    order = sorted(range(count), key=lambda index: p_values[index])
    adjusted = [1.0] * count
    running = 1.0
    for rank in range(count, 0, -1):
        index = order[rank - 1]
        running = min(running, p_values[index] * count / rank)
        adjusted[index] = running
    return adjusted


def compare_window_size(value: str) -> int:
    """A window size as typed (--opt-compare-window, merge --compare-window); OptConfigError naming the range."""
    from ..units import parse_non_negative_int

    return parse_non_negative_int(value, "recorded runs in the window", minimum=MIN_WINDOW_RUNS,
                                  maximum=MAX_COMPARE_WINDOW)

