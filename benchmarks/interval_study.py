"""Time verdict.stats.median_ratio_interval and measure its coverage: python benchmarks/interval_study.py."""
import math, random, statistics, time
from pytest_transformers_opt.verdict.stats import median_ratio_interval

def samples(rng, n, shift, sigma=0.05, drift=0.05):
    common = [rng.gauss(0, drift) for _ in range(n)]
    return ([math.exp(rng.gauss(0, sigma) + c) for c in common],
            [math.exp(rng.gauss(0, sigma) + c) / shift for c in common])

median_ratio_interval([1.0] * 5, [1.0] * 5, paired=True)  # numpy import out of the timing
for n in (5, 1000):
    rng = random.Random(n)
    base, opt = samples(rng, n, 1.1)
    times = []
    for _ in range(25 if n == 5 else 10):
        t = time.perf_counter(); median_ratio_interval(base, opt, paired=True); times.append(time.perf_counter() - t)
    print(f"rounds={n}: median {statistics.median(times)*1e3:.2f} ms, min {min(times)*1e3:.2f} ms, max {max(times)*1e3:.2f} ms over {len(times)} calls")
t = time.perf_counter()
print("coverage of 1.0 under the null (200 seeded trials each), and 30% shift excluded:")
for n in (3, 4, 5, 7, 10, 20):
    rng = random.Random(13)
    res = [median_ratio_interval(*samples(rng, n, 1.0), paired=True) for _ in range(200)]
    if res[0] is None:
        print(f"  rounds={n}: no interval (below MIN_BOOTSTRAP_SAMPLES)"); continue
    cov = sum(lo <= 1.0 <= hi for lo, hi in res) / 200
    sh = [median_ratio_interval(*samples(rng, n, 1.3), paired=True) for _ in range(200)]
    excl = sum(lo > 1.0 for lo, hi in sh) / 200
    print(f"  rounds={n}: null coverage {cov:.3f}; 30% faster: interval above 1.0 in {excl:.3f}")
