"""How well ``pytest-opt history`` finds change points: ``python benchmarks/changepoint_study.py [--power] [--otava PY]``.

Default (issue 21): 100 seeded histories of 60 runs (gaussian noise of 3% CV around 1.0) with a +10% step at
run 40 (the first run at 1.1 is index 40): how many have a change point within 2 runs of it, whether its
interval holds the true +10%, and how many other change points they report; 100 seeded null histories (no
step): how many report any change point.

``--power`` (issue 40, red-team finding 3): seeded histories of every length from 6 to 40 runs, under three
noises (gaussian 2%, 3% and 5% CV; 5% with a busy runner, each run slowed by 10-50% with probability 0.1), with
a step of +10%, +20%, +30% or +60% at a run drawn from 3 to length - 3: how many have a change point at
exactly the step's run; and null histories of the same lengths and noises: how many report any.

``--otava PY`` (with ``--power`` or alone): Apache Otava's own detection (``otava.analysis.compute_change_points``
with its defaults: window 50, p <= 0.001, the function ``otava analyze`` calls per metric) run by the
interpreter ``PY`` where ``apache-otava`` is installed, on the red-team's 8-run history and on a sample of the
simulated ones, and ``otava analyze`` run on the CSV ``pytest-opt history --format otava-csv`` writes for the
8-run history, with the otava.yaml ``pytest-opt history --help`` prints.

Each series goes through ``report.changepoints.analyse``, the function the command calls for every series it
prints. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pytest_transformers_opt import cli
from pytest_transformers_opt.report.changepoints import (MAX_P_VALUE, MIN_SEGMENT, PENALTY_PER_LOG_RUN,
                                                          PERMUTATIONS, Series, SeriesAnalysis, analyse)
from pytest_transformers_opt.report.history import RunName

START = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
LENGTHS = range(6, 41)
BANDS = ((6, 7), (8, 9), (10, 13), (14, 19), (20, 29), (30, 40))
STEPS = (0.10, 0.20, 0.30, 0.60)
NOISES = {"2%": (0.02, 0.0), "3%": (0.03, 0.0), "5%": (0.05, 0.0), "5% + busy runs": (0.05, 0.1)}  # (CV, chance of a busy run)
RED_TEAM_MS = [27.1, 29.4, 30.8, 27.9, 44.2, 51.6, 47.3, 47.7]  # finding 3: 27-31 ms, then 44-52 ms from run 5
OTAVA_LENGTHS = (6, 7, 8, 10, 14, 20, 30, 40)
_OTAVA_SCRIPT = """
import json, sys
from otava.analysis import compute_change_points
out = []
for values in json.load(sys.stdin):
    points, _ = compute_change_points(values)  # Otava's defaults: window_len 50, max_pvalue 0.001
    out.append([[int(p.index), float(p.stats.forward_change_percent()), float(p.stats.pvalue)] for p in points])
json.dump(out, sys.stdout)
"""


def history(seed: int, runs: int, cv: float, step: float, at: int, busy: float = 0.0) -> list[float]:
    """``runs`` values around 1.0 (1 + ``step`` from index ``at``), gaussian noise of ``cv``; with probability
    ``busy`` a run is slowed by 10-50% (a busy runner)."""
    rng = random.Random(seed)
    values = []
    for n in range(runs):
        value = (1.0 + (step if n >= at else 0.0)) * (1.0 + rng.gauss(0.0, cv))
        if busy and rng.random() < busy:
            value *= rng.uniform(1.1, 1.5)
        values.append(value)
    return values


def analysed(values: list[float]) -> tuple[SeriesAnalysis, float]:
    """The analysis the command prints for a series of these values, and the seconds it took."""
    names = tuple(RunName(f"{(START + dt.timedelta(hours=n)):%Y%m%dT%H%M%SZ}.json", START + dt.timedelta(hours=n))
                  for n in range(len(values)))
    began = time.perf_counter()
    result = analyse(Series("tests/test_study.py::test_step", "CPU: study", "latency", names, tuple(values)))
    return result, time.perf_counter() - began


def method() -> str:
    return (f"ruptures Binseg (l2, min_size {MIN_SEGMENT}, penalty {PENALTY_PER_LOG_RUN} log(runs) over the noise of "
            f"successive differences), kept at p <= {MAX_P_VALUE} by Student's t-test of the split (times the "
            f"positions it could take) or a permutation test of its segment's ranks ({PERMUTATIONS} shuffles).")


def sixty_runs(args: argparse.Namespace) -> bool:
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
    print("| histories | what | count | goal |")
    print("| --- | --- | --- | --- |")
    print(f"| {n} with a +{args.step:.0%} step at run {args.at} ({args.runs} runs, CV {args.cv:.0%}) | step found "
          f"within 2 runs | **{found}/{n}** | at least {0.95 * n:.0f} |")
    print(f"| same | 95% interval of the found step holds +{args.step:.0%} | {covered}/{found} | - |")
    print(f"| same | other change points reported | {others} in {n} histories | - |")
    print(f"| {n} null ({args.runs} runs, CV {args.cv:.0%}, no step) | a change point reported | "
          f"**{null_reports}/{n}** ({null_points} change points) | at most {0.05 * n:.0f} |")
    print(f"\nTime per history ({args.runs} runs, detection + interval): median "
          f"{statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms over {len(times)}.\n")
    return found >= 0.95 * n and null_reports <= 0.05 * n


def _band(length: int) -> int:
    return next(n for n, (low, high) in enumerate(BANDS) if low <= length <= high)


def _cell(hits: int, total: int) -> str:
    return f"{hits}/{total}" if hits != total else f"**{hits}/{total}**"


def power(args: argparse.Namespace) -> bool:
    """The power table (step found at its run, by length band) and the null table; True when a +60% step is found
    at its run in every history of the 2% and 3% noises, and the null false rate is at most 1%."""
    header = "| noise | step | " + " | ".join(f"{low}-{high} runs" for low, high in BANDS) + " | all |"
    rule = "| --- | --- | " + " | ".join("---" for _ in BANDS) + " | --- |"
    print(f"Histories of every length from {LENGTHS.start} to {LENGTHS.stop - 1} runs, {args.per_length} per length, "
          f"noise and step; the step at a run drawn from {MIN_SEGMENT} to length - {MIN_SEGMENT}. A cell counts the "
          f"histories with a change point at exactly the step's run.\n")
    print(header)
    print(rule)
    goal_met = True
    shortest: dict[tuple[str, float], int | None] = {}
    for noise, (cv, busy) in NOISES.items():
        for step in STEPS:
            hits, totals = [0] * len(BANDS), [0] * len(BANDS)
            found_by_length: dict[int, int] = {}
            for length in LENGTHS:
                for rep in range(args.per_length):
                    seed = 1_000_003 * length + 7919 * rep + int(step * 1000) + 17 * list(NOISES).index(noise)
                    at = random.Random(seed).randint(MIN_SEGMENT, length - MIN_SEGMENT)
                    result, _ = analysed(history(seed, length, cv, step, at, busy))
                    hit = any(point.index == at for point in result.change_points)
                    band = _band(length)
                    hits[band] += hit
                    totals[band] += 1
                    found_by_length[length] = found_by_length.get(length, 0) + hit
            if step == 0.60 and cv <= 0.03 and not busy and sum(hits) != sum(totals):
                goal_met = False
            # the shortest length from which at least 95% of histories find the step, at every longer length too
            shortest[(noise, step)] = next((length for length in LENGTHS if all(
                found_by_length[longer] >= 0.95 * args.per_length for longer in LENGTHS if longer >= length)), None)
            cells = " | ".join(_cell(h, t) for h, t in zip(hits, totals))
            print(f"| {noise} | +{step:.0%} | {cells} | {_cell(sum(hits), sum(totals))} |")
    print("\nThe shortest history from which at least 95% find the step at its run (at that length and every longer "
          "one up to 40):\n")
    print("| noise | " + " | ".join(f"+{step:.0%}" for step in STEPS) + " |")
    print("| --- | " + " | ".join("---" for _ in STEPS) + " |")
    for noise in NOISES:
        print(f"| {noise} | " + " | ".join(f"{shortest[(noise, step)]} runs" if shortest[(noise, step)] else "over 40"
                                          for step in STEPS) + " |")
    print(f"\nNull histories (no step), {args.nulls} per length and noise: how many report any change point.\n")
    print(header.replace("| step ", "", 1))
    print(rule.replace("| --- ", "", 1))
    worst = 0.0
    for noise, (cv, busy) in NOISES.items():
        hits, totals = [0] * len(BANDS), [0] * len(BANDS)
        for length in LENGTHS:
            for rep in range(args.nulls):
                seed = 5_000_011 * length + 104_729 * rep + 31 * list(NOISES).index(noise)
                result, _ = analysed(history(seed, length, cv, 0.0, 0, busy))
                band = _band(length)
                hits[band] += bool(result.change_points)
                totals[band] += 1
        worst = max(worst, sum(hits) / sum(totals))
        print(f"| {noise} | " + " | ".join(f"{h}/{t}" for h, t in zip(hits, totals))
              + f" | {sum(hits)}/{sum(totals)} ({100 * sum(hits) / sum(totals):.2f}%) |")
    print()
    return goal_met and worst <= 0.01


def run_otava(python: str, series: list[list[float]]) -> list[list[list[float]]]:
    """Otava's change points (index, forward change in percent, p-value) of each series, in ``python``."""
    done = subprocess.run([python, "-c", _OTAVA_SCRIPT], input=json.dumps(series), capture_output=True, text=True,
                          timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"Otava failed in {python}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _ours(values: list[float]) -> list[int]:
    return [point.index for point in analysed(values)[0].change_points]


def red_team_csv_through_otava(python: str) -> None:
    """The red-team's 8-run history recorded as ``--opt-history`` names its runs (crafted reports, the integration
    tests' rows), written by ``pytest-opt history --format otava-csv`` and read by ``otava analyze`` with the
    printed otava.yaml."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ab_reports import report, row  # the integration tests' schema-valid rows

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "history"
        folder.mkdir()
        for n, latency in enumerate(RED_TEAM_MS):
            moment = START + dt.timedelta(hours=n)
            made = report(row("tests/test_x.py::test_sdpa", [latency / 1000] * 5, None))
            made["created"] = moment.isoformat()
            (folder / f"{moment:%Y%m%dT%H%M%SZ}-c{n:06d}.json").write_text(json.dumps(made), encoding="utf-8")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cli.main(["history", str(folder), "--metric", "latency"])
        ours = out.getvalue()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cli.main(["history", str(folder), "--format", "otava-csv"])
        (Path(scratch) / "sdpa.csv").write_text(out.getvalue(), encoding="utf-8")
        yaml = "\n".join(line[2:] for line in cli._OTAVA_YAML.splitlines())  # as --help prints it, unedited
        (Path(scratch) / "otava.yaml").write_text(yaml + "\n", encoding="utf-8")
        otava = str(Path(python).with_name("otava"))
        done = subprocess.run([otava, "analyze", "sdpa", "--config-file", "otava.yaml"], cwd=scratch,
                              capture_output=True, text=True, timeout=600, check=False)
        print(f"`pytest-opt history DIR --metric latency` on the red-team's 8 runs ({', '.join(map(str, RED_TEAM_MS))} "
              f"ms):\n\n```text\n{ours.strip()}\n```\n")
        print(f"`otava analyze sdpa` (exit {done.returncode}) on the CSV `pytest-opt history DIR --format otava-csv` "
              f"wrote, with the otava.yaml `pytest-opt history --help` prints:\n\n```text\n{done.stdout.strip() or done.stderr.strip()[-1500:]}\n```\n")


def otava_agreement(args: argparse.Namespace) -> None:
    red_team_csv_through_otava(args.otava)
    cases: list[tuple[str, float, int, int, list[float]]] = []  # noise, step, length, step index, values
    for noise in ("5%", "5% + busy runs"):
        cv, busy = NOISES[noise]
        for step in (0.0, 0.20, 0.60):
            for length in OTAVA_LENGTHS:
                for rep in range(args.otava_per_length):
                    seed = 7_000_003 * length + 613 * rep + int(step * 1000) + 17 * list(NOISES).index(noise)
                    at = random.Random(seed).randint(MIN_SEGMENT, length - MIN_SEGMENT) if step else 0
                    cases.append((noise, step, length, at, history(seed, length, cv, step, at, busy)))
    theirs = run_otava(args.otava, [values for *_, values in cases])
    print(f"Both detectors on the same seeded histories: lengths {', '.join(map(str, OTAVA_LENGTHS))}, "
          f"{args.otava_per_length} per length, noise and step (Otava: `compute_change_points` with its defaults). "
          f"With a step, a detector counts when it has a change point at exactly the step's run; null, when it "
          f"reports any. \"Same\" counts the histories where both report the same runs.\n")
    print("| noise | step | runs | this plugin | Otava | same change points |")
    print("| --- | --- | --- | --- | --- | --- |")
    groups: dict[tuple[str, float, str], list[tuple[bool, bool, bool]]] = {}
    for (noise, step, length, at, values), other in zip(cases, theirs):
        ours = _ours(values)
        otava = [int(point[0]) for point in other]
        band = "6-8" if length <= 8 else ("10-14" if length <= 14 else "20-40")
        ours_hit = (at in ours) if step else bool(ours)
        otava_hit = (at in otava) if step else bool(otava)
        groups.setdefault((noise, step, band), []).append((ours_hit, otava_hit, ours == otava))
    for (noise, step, band), results in groups.items():
        total = len(results)
        what = f"+{step:.0%}" if step else "none (false change points)"
        print(f"| {noise} | {what} | {band} | {sum(r[0] for r in results)}/{total} | {sum(r[1] for r in results)}/"
              f"{total} | {sum(r[2] for r in results)}/{total} |")
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--histories", type=int, default=100)
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--cv", type=float, default=0.03)
    parser.add_argument("--step", type=float, default=0.10)
    parser.add_argument("--at", type=int, default=40)
    parser.add_argument("--power", action="store_true", help="power by length (6-40) and step size, and the null")
    parser.add_argument("--per-length", type=int, default=40, help="--power: histories per length, noise and step")
    parser.add_argument("--nulls", type=int, default=100, help="--power: null histories per length and noise")
    parser.add_argument("--otava", metavar="PY", help="an interpreter with apache-otava installed: compare with it")
    parser.add_argument("--otava-per-length", type=int, default=20)
    args = parser.parse_args(argv)
    analysed([1.0, 1.1] * 5)  # numpy, ruptures and scipy imported out of the timing
    print(f"    {' '.join(['python', *sys.argv])}\n")
    print(method() + "\n")
    if args.power or args.otava:
        ok = power(args) if args.power else True
        if args.otava:
            otava_agreement(args)
        return 0 if ok else 1
    return 0 if sixty_runs(args) else 1


if __name__ == "__main__":
    sys.exit(main())
