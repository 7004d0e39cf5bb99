"""How well ``pytest-opt history`` finds change points (issue 21): python benchmarks/changepoint_study.py.

100 seeded histories of 60 runs (gaussian noise of 3% CV around 1.0) with a +10% step at run 40 (the first
run at 1.1 is index 40): how many have a change point within 2 runs of it, whether its interval holds the
true +10%, and how many other change points they report. 100 seeded null histories (no step): how many
report any change point. Each series goes through ``report.changepoints.analyse``, the function the
command calls for every series it prints. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import sys
import time

from pytest_transformers_opt.report.changepoints import (MAX_P_VALUE, MIN_SEGMENT, PENALTY_PER_LOG_RUN,
                                                          PERMUTATIONS, Series, SeriesAnalysis, analyse)
from pytest_transformers_opt.report.history import RunName

START = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def history(seed: int, runs: int, cv: float, step: float, at: int) -> list[float]:
    rng = random.Random(seed)
    return [(1.0 + (step if n >= at else 0.0)) * (1.0 + rng.gauss(0.0, cv)) for n in range(runs)]


def analysed(values: list[float]) -> tuple[SeriesAnalysis, float]:
    """The analysis the command prints for a series of these values, and the seconds it took."""
    names = tuple(RunName(f"{(START + dt.timedelta(hours=n)):%Y%m%dT%H%M%SZ}.json", START + dt.timedelta(hours=n))
                  for n in range(len(values)))
    began = time.perf_counter()
    result = analyse(Series("tests/test_study.py::test_step", "CPU: study", "latency", names, tuple(values)))
    return result, time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", type=int, default=100)
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--cv", type=float, default=0.03)
    parser.add_argument("--step", type=float, default=0.10)
    parser.add_argument("--at", type=int, default=40)
    args = parser.parse_args(argv)
    analysed([1.0, 1.1] * 5)  # numpy, ruptures and scipy imported out of the timing
    found = covered = others = 0
    times = []
    for seed in range(args.histories):
        result, seconds = analysed(history(seed, args.runs, args.cv, args.step, args.at))
        times.append(seconds)
        near = [p for p in result.change_points if abs(p.index - args.at) <= 2]
        found += bool(near)
        covered += any(p.interval is not None and p.interval[0] <= args.step <= p.interval[1] for p in near)
        others += len(result.change_points) - len(near)
    null_reports = null_points = 0
    for seed in range(args.histories):
        result, seconds = analysed(history(10_000 + seed, args.runs, args.cv, 0.0, args.at))
        times.append(seconds)
        null_reports += bool(result.change_points)
        null_points += len(result.change_points)
    n = args.histories
    print(f"    {' '.join(['python', *sys.argv])}\n")
    print(f"ruptures Binseg (l2, min_size {MIN_SEGMENT}, penalty {PENALTY_PER_LOG_RUN} log(runs) on the robust "
          f"z-scores), permutation test of each change point's segment on the ranks ({PERMUTATIONS} shuffles), kept at "
          f"p <= {MAX_P_VALUE}.\n")
    print("| histories | what | count | goal |")
    print("| --- | --- | --- | --- |")
    print(f"| {n} with a +{args.step:.0%} step at run {args.at} ({args.runs} runs, CV {args.cv:.0%}) | step found "
          f"within 2 runs | **{found}/{n}** | at least {0.95 * n:.0f} |")
    print(f"| same | 95% interval of the found step holds +{args.step:.0%} | {covered}/{found} | - |")
    print(f"| same | other change points reported | {others} in {n} histories | - |")
    print(f"| {n} null ({args.runs} runs, CV {args.cv:.0%}, no step) | a change point reported | "
          f"**{null_reports}/{n}** ({null_points} change points) | at most {0.05 * n:.0f} |")
    print(f"\nTime per history ({args.runs} runs, detection + interval): median "
          f"{statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms over {len(times)}.")
    return 0 if found >= 0.95 * n and null_reports <= 0.05 * n else 1


if __name__ == "__main__":
    sys.exit(main())
