"""--opt-trace: the census call's Chrome trace of each test, kept in the session's folder until the report is
written, then moved next to the JSON report for the tests asked for (all, or the ones the gate flagged).

A row carries its trace file's path from the process that measured it (an xdist worker's rows reach the controller
with the path of a file in the worker's folder, on the same machine) until ``place_traces`` moves the file into
``<report stem>.traces/`` and writes the path relative to the JSON report's folder, or deletes it."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ..verdict.judge import INCONCLUSIVE, REGRESSED

if TYPE_CHECKING:
    from ..session import OptSession

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
FOLDER_PREFIX = "pytest-opt-traces-"  # a session's own temporary folder (only such folders are removed)
SUFFIX = ".trace.json"
FLAGGED = (REGRESSED, INCONCLUSIVE)  # a gate's verdicts whose tests --opt-trace=regressed keeps


def trace_file_for(session: "OptSession", nodeid: str) -> str | None:
    """A new file in the session's trace folder (made on first use) for ``nodeid``'s census trace; None without
    --opt-report-json (nothing would keep the trace: the session end says so once)."""
    if not session.settings.report_json:
        return None
    folder = getattr(session, "trace_folder", None)
    if folder is None:
        folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
        session.trace_folder = folder
    name = _UNSAFE.sub("_", nodeid).strip("_")[:150] or "test"
    return str(_unused(Path(folder), name))


def _unused(folder: Path, name: str) -> Path:
    """``folder/name.trace.json``, or ``name-2.trace.json``... where that exists (a test's second opt_bench call,
    its rerun, two node ids that read the same once made safe for a file name)."""
    path, number = folder / f"{name}{SUFFIX}", 1
    while path.exists():
        number += 1
        path = folder / f"{name}-{number}{SUFFIX}"
    return path


def flagged(row: dict[str, Any]) -> bool:
    """The gate flagged the row: its regression or A/B verdict is regressed or inconclusive, or a budget failed."""
    verdicts = [(row.get(key) or {}).get("verdict") for key in ("regression", "ab")]
    return any(verdict in FLAGGED for verdict in verdicts) or bool(row.get("failed_budgets"))


def traces_folder(report_json: str) -> Path:
    """``<report stem>.traces/`` beside the JSON report."""
    path = Path(report_json)
    return path.with_name(f"{path.stem}.traces")


@dataclass
class PlacedTraces:
    """What ``place_traces`` did: traces kept (in ``folder``), and how many measured tests had one."""

    kept: int
    traced: int
    folder: Path | None


def place_traces(tests: Iterable[dict[str, Any]], mode: str, report_json: str | None,
                 own_folder: str | None) -> PlacedTraces:
    """Each row's ``trace`` (a file of a session's temporary folder) moved into ``traces_folder(report_json)`` and
    set to its path relative to the JSON report's folder when ``mode`` asks for the row (``all``; ``regressed``:
    ``flagged``), else the file deleted and ``trace`` null; the traces left by an earlier run in that folder are
    deleted first, and the sessions' temporary folders (``own_folder`` and the workers') at the end."""
    rows = [row for row in tests if isinstance(row.get("trace"), str)]
    temporary = {own_folder} if own_folder else set()
    destination = traces_folder(report_json) if report_json else None
    if destination is not None and destination.is_dir():
        for stale in destination.glob(f"*{SUFFIX}"):
            stale.unlink(missing_ok=True)
    kept = 0
    for row in rows:
        source = Path(row["trace"])
        temporary.add(str(source.parent))
        row["trace"] = None
        if not source.is_file():  # a worker on another machine, or a census that failed before writing
            continue
        if destination is None or not (mode == "all" or flagged(row)):
            source.unlink(missing_ok=True)
            continue
        destination.mkdir(parents=True, exist_ok=True)
        target = _unused(destination, source.name.removesuffix(SUFFIX))
        shutil.move(str(source), target)
        row["trace"] = Path(os.path.relpath(target, destination.parent)).as_posix()
        kept += 1
    for folder in temporary:
        if Path(folder).name.startswith(FOLDER_PREFIX):
            shutil.rmtree(folder, ignore_errors=True)
    return PlacedTraces(kept=kept, traced=len(rows), folder=destination if kept else None)


def remove_own_folder(session: "OptSession") -> None:
    """The session's temporary trace folder, removed (what ``place_traces`` did not reach: no report was built)."""
    folder = getattr(session, "trace_folder", None)
    if folder and Path(folder).name.startswith(FOLDER_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)
