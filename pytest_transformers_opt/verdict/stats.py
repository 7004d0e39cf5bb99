"""Small statistics for speed verdicts: a one-sided Mann-Whitney U test, exact for small samples.

Latency samples from 2-core CI machines are noisy and not normal; a rank test asks the question a
gate needs ("is the optimized side really slower?") without assuming a distribution.
"""

from __future__ import annotations

import math
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
    z = (u - mean - 0.5) / sd if sd else 0.0
    return 0.5 * math.erfc(z / math.sqrt(2))


def min_p_value(n1: int, n2: int) -> float:
    """The smallest one-sided p-value samples of these sizes can reach: 1 / C(n1 + n2, n1)."""
    return 1.0 / math.comb(n1 + n2, n1) if n1 and n2 else 1.0
