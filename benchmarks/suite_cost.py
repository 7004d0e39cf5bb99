"""What each test of a pytest run costs in CPU seconds, not only in wall time (issue 22: the suite's time).

Under ``pytest -n 2`` on 2 cores a test's wall time says little about its cost: a test that runs beside an inner
``-n 2`` session or a torchrun pair waits for the cores, and one that starts subprocesses spends CPU its duration
does not show. Wall time moved 40% between two runs of the same tree on this machine within an hour (710.6 s and
506.8 s), CPU seconds by a few percent. As a plugin, this records for each test its wall time and the CPU seconds
of its process and of the subprocesses it waited for (``getrusage``: self and children), a JSON line per test and
per xdist worker:

    PYTHONPATH=benchmarks SUITE_COST_DIR=DIR python -m pytest tests -n 2 -p suite_cost

Then the files and tests that cost most, and the totals:

    python benchmarks/suite_cost.py DIR [--top 25] [--against OTHER_DIR]

A subprocess's grandchildren (an inner ``-n 2`` session's workers) count once the subprocess has waited for them;
a daemon that outlives its test counts nowhere. Nothing is recorded without ``SUITE_COST_DIR``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

DIR_ENV = "SUITE_COST_DIR"


def _cpu_s() -> tuple[float, float]:
    """CPU seconds (user + system) of this process, and of the children it waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return (yield)
    start, (own, children) = time.time(), _cpu_s()
    try:
        return (yield)
    finally:
        own_after, children_after = _cpu_s()
        row = {"id": item.nodeid, "start": start, "wall": time.time() - start, "self": own_after - own,
               "children": children_after - children}
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(Path(folder) / f"cost-{worker}.jsonl", "a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")


def read_rows(folder: Path) -> list[dict[str, Any]]:
    """Every recorded test of a run, with ``cpu`` (its own and its waited-for children's CPU seconds)."""
    rows = []
    for path in sorted(folder.glob("cost-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            rows.append({**row, "worker": path.stem.removeprefix("cost-"), "cpu": row["self"] + row["children"]})
    if not rows:
        raise SystemExit(f"suite_cost: no cost-*.jsonl in {folder}: run pytest with -p suite_cost and {DIR_ENV}={folder}")
    return rows


def by_file(rows: list[dict[str, Any]]) -> collections.Counter[str]:
    files: collections.Counter[str] = collections.Counter()
    for row in rows:
        files[row["id"].split("::")[0]] += row["cpu"]
    return files


def summary(rows: list[dict[str, Any]], top: int, against: list[dict[str, Any]] | None = None) -> str:
    """The totals, the ``top`` files and tests by CPU seconds (with the other run's figure beside them)."""
    lines = [f"{len(rows)} tests: {sum(r['cpu'] for r in rows):.1f} CPU-s, {sum(r['wall'] for r in rows):.1f} worker-s "
             f"of wall time" + ("" if against is None else
                                f" (other run: {len(against)} tests, {sum(r['cpu'] for r in against):.1f} CPU-s)")]
    files, other_files = by_file(rows), by_file(against or [])
    lines += ["", "CPU-s  " + ("other  " if against is not None else "") + "file"]
    for name, cpu in files.most_common(top):
        lines.append(f"{cpu:6.1f} " + (f"{other_files.get(name, 0.0):6.1f} " if against is not None else "") + name)
    other_tests = {r["id"]: r["cpu"] for r in against or []}
    lines += ["", "CPU-s   wall  " + ("other  " if against is not None else "") + "test"]
    for row in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        other = f"{other_tests[row['id']]:6.1f} " if row["id"] in other_tests else "     - "
        lines.append(f"{row['cpu']:6.1f} {row['wall']:6.1f} " + (other if against is not None else "") + row["id"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--against", type=Path, help="another run's folder, its figures beside these")
    args = parser.parse_args(argv)
    against = read_rows(args.against) if args.against else None
    print(summary(read_rows(args.folder), args.top, against))
    return 0


if __name__ == "__main__":
    sys.exit(main())
