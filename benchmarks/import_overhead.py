"""What the plugin costs a pytest session that uses none of it: python benchmarks/import_overhead.py [--rounds N].

Runs a one-test project (no fixture of the plugin) as whole ``python -m pytest -q`` processes, alternating
with and without the plugin (``-p no:transformers_opt``), and prints the added CPU time (fastest run of
each: other jobs only ever add time) and the added wall time (medians); then the plugin's own import time
from ``python -X importtime`` (its modules' cumulative microseconds, pytest and the stdlib preloaded as a
real session has them).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRIVIAL_TEST = "def test_nothing_of_the_plugin():\n    assert True\n"
PRELOADED = "import pytest, importlib.metadata, json, logging, subprocess"  # what a pytest session has already
# pytest-randomly (where installed) imports numpy when it loads, with or without this plugin: left out


def inner_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items()
            if key not in ("PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")}


def timed_session(folder: Path, *args: str) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one whole ``python -m pytest`` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *args], cwd=folder,
                          env=inner_env(), capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"the inner session failed:\n{done.stdout}{done.stderr}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def plugin_import_ms() -> tuple[float, list[tuple[float, str]]]:
    """Cumulative import time of ``pytest_transformers_opt.plugin`` after the preloaded modules, and the
    plugin's five slowest modules (cumulative ms)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c",
                           f"{PRELOADED}; import pytest_transformers_opt.plugin"],
                          capture_output=True, text=True, env=inner_env(), timeout=300,
                          cwd=tempfile.gettempdir())  # not the repository: `-c` puts the working folder first
    own: list[tuple[float, str]] = []
    total = 0.0
    for line in done.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \|(\s*)(\S+)", line)
        if match and match.group(3).startswith("pytest_transformers_opt"):
            cumulative = int(match.group(1)) / 1000
            if match.group(3) == "pytest_transformers_opt.plugin":
                total = cumulative
            own.append((cumulative, match.group(3)))
    top = sorted((entry for entry in own if entry[1] != "pytest_transformers_opt.plugin"), reverse=True)[:5]
    return total, top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="sessions of each kind, alternating")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder_name:
        folder = Path(folder_name)
        (folder / "test_trivial.py").write_text(TRIVIAL_TEST)
        timed_session(folder)  # not counted: fills the OS's file cache
        on, off = [], []
        for _ in range(args.rounds):
            on.append(timed_session(folder))
            off.append(timed_session(folder, "-p", "no:transformers_opt"))
    added_cpu = min(cpu for _, cpu in on) - min(cpu for _, cpu in off)
    added_wall = statistics.median(wall for wall, _ in on) - statistics.median(wall for wall, _ in off)
    print(f"{args.rounds} sessions each; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"with the plugin:    CPU min {min(c for _, c in on):.3f} s, wall median {statistics.median(w for w, _ in on):.3f} s")
    print(f"without the plugin: CPU min {min(c for _, c in off):.3f} s, wall median {statistics.median(w for w, _ in off):.3f} s")
    print(f"added: {added_cpu:.3f} s of CPU time (fastest runs), {added_wall:.3f} s of wall time (medians)")
    imports = [plugin_import_ms() for _ in range(5)]
    best_total, best_top = min(imports)
    print(f"import of pytest_transformers_opt.plugin (fastest of 5, after `{PRELOADED}`): {best_total:.1f} ms; "
          "slowest of its modules (cumulative):")
    for cumulative, name in best_top:
        print(f"  {cumulative:7.1f} ms  {name}")


if __name__ == "__main__":
    main()
