"""torch's threads per pytest-xdist worker on CPU, on a suite-like run (issue 19, item 25).

    python benchmarks/cpu_threads.py [--repeats N] [--workers 2] [TEST_PATH ...]

Runs the example project (by default its attention/cache and quantization tests) under ``pytest -n
WORKERS``, alternating ``--opt-cpu-threads=<every core>`` (torch's own default: each process spins a
thread per core) with the plugin's default ``auto`` (each worker its share of the cores), and prints the
session's wall time and each test's median baseline latency (from the JSON report) for both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "example_project"
DEFAULT_TESTS = ("tests/test_attention_and_cache.py", "tests/test_quantization.py")


def run(workers: int, threads: str, tests: list[str], report: Path) -> tuple[float, dict[str, float]]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_OPT_", "PYTEST_XDIST_"))}
    env["PYTEST_ADDOPTS"] = "-p no:randomly -p no:cacheprovider"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", str(workers), f"--opt-cpu-threads={threads}",
                    "--opt-rounds=3", "--opt-budgets=warn", f"--opt-report-json={report}", *tests],
                   cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=3600, check=False)
    wall = time.perf_counter() - start
    data = json.loads(report.read_text())
    latencies = {test["nodeid"].split("::")[-1]: test["baseline"]["latency_s"]
                 for test in data["tests"] if (test.get("baseline") or {}).get("latency_s") is not None}
    return wall, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS))
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    settings = {f"{cores} threads per worker (torch's default)": str(cores),
                f"auto: {max(1, cores // args.workers)} per worker": "auto"}
    walls: dict[str, list[float]] = {name: [] for name in settings}
    latencies: dict[str, dict[str, list[float]]] = {name: {} for name in settings}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for name, threads in settings.items():  # alternating: a change in the machine's load hits both
                wall, figures = run(args.workers, threads, args.tests, Path(folder) / f"r{repeat}-{threads}.json")
                walls[name].append(wall)
                for test, latency in figures.items():
                    latencies[name].setdefault(test, []).append(latency)
                print(f"  run {repeat + 1}, {name}: {wall:.1f} s", flush=True)
    load = os.getloadavg()[0]
    print(f"\n{cores} cores, -n {args.workers}, {args.repeats} run(s) each, load average {load:.1f} at the end")
    print("| setting | session wall time (median) | " + " | ".join(sorted(latencies[next(iter(settings))])) + " |")
    print("| --- | --- |" + " --- |" * len(latencies[next(iter(settings))]))
    for name in settings:
        cells = [f"{statistics.median(values) * 1000:.0f} ms" for _, values in sorted(latencies[name].items())]
        print(f"| {name} | {statistics.median(walls[name]):.1f} s | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
