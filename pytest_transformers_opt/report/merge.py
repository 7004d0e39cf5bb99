"""``pytest-opt merge``: one report from the reports of many shards (CI jobs, machines, GPU types).

Each input is read by ``schema.load_report`` (the guarded reader, checked against the full schema).
Rows are keyed by (node id, hardware fingerprint): the same test measured on two GPU types stays two
rows; the same test twice on the same hardware is an error naming both files, because one of the two
measurements would be silently dropped. A row without a fingerprint takes its shard's (see
``shard_hardware``), so every merged row has one.

The merged document is a schema_version 1 report like any other (``--opt-compare``, the renderers and
the advisor read it as they read one run): the first shard's ``environment`` and ``settings``, the
summary recounted from the rows, and ``shards``, one entry per input with its own environment,
settings, summary and ``--opt-ab`` stacks, which each row's ``shard`` points into. Rows keep their A/B
records; the top-level ``ab`` is the first shard's, recounted, with a note where the shards' differ.
"""

from __future__ import annotations

import copy
import datetime as _dt
import os
from dataclasses import dataclass
from typing import Any

from ..errors import OptConfigError
from ..verdict.results import CALL_SUFFIX
from .ab import merge_ab
from ..verdict.compare import row_hardware
from .schema import REPORT_SCHEMA, REPORT_SCHEMA_VERSION, load_report, validate_report
from .writer import count_outcomes

MERGE_REMEDY = "give JSON reports written by this plugin (pytest --opt-report-json=PATH) or by pytest-opt merge"


@dataclass(frozen=True)
class Shard:
    """One input report and the path it was given as."""

    source: str
    report: dict[str, Any]


def load_shards(paths: list[str], notes: list[str] | None = None) -> list[Shard]:
    """Every input, read and schema-checked; the first bad one is an ``OptConfigError`` naming it, and so is
    a file given twice (before anything is read). What a reader ignored in a report written by another
    version of the plugin is appended to ``notes``."""
    given: dict[str, str] = {}
    for path in paths:
        same = os.path.realpath(os.path.expanduser(path))
        if same in given:
            twice = (f"the report {path!r} is given twice" if given[same] == path
                     else f"{given[same]!r} and {path!r} are the same report")
            raise OptConfigError(f"{twice}: give each report once (its tests would be merged with themselves)")
        given[same] = path
    return [Shard(path, load_report(path, remedy=MERGE_REMEDY, notes=notes)) for path in paths]


def shard_hardware(test: dict[str, Any], environment: dict[str, Any]) -> str:
    """The row's hardware fingerprint: its own ``hardware``, else its run's ``environment.hardware``; for a
    report older than both, the run's GPU name on CUDA, else ``CPU: `` and its ``cpu_model`` or, older
    still, its ``platform`` (the best name such a report keeps)."""
    known = row_hardware(test, environment)
    if known is not None:
        return known
    if str(environment.get("device") or "").startswith("cuda") and environment.get("gpu_name"):
        return str(environment["gpu_name"])
    return f"CPU: {environment.get('cpu_model') or environment.get('platform') or 'unknown'}"


def _row_order(test: dict[str, Any]) -> tuple[str, int, str]:
    """By test id (a test's ``opt_bench`` calls in order, as the writer orders them), then hardware."""
    return test["nodeid"].split(CALL_SUFFIX)[0], test.get("call", 1), test["hardware"]


def _shard_entries(shard: Shard) -> list[dict[str, Any]]:
    """What ``shards`` keeps of one input: its own entry, or, for an input that was itself merged, its shards."""
    report = shard.report
    if isinstance(report.get("shards"), list):
        return list(copy.deepcopy(report["shards"]))  # schema-checked: a list of objects
    entry = {"source": shard.source, "created": report["created"], "environment": copy.deepcopy(report["environment"]),
             "settings": copy.deepcopy(report["settings"]), "summary": dict(report["summary"])}
    if isinstance(report.get("extra"), dict):
        entry["extra"] = copy.deepcopy(report["extra"])
    if isinstance(report.get("ab"), dict):  # --opt-ab: this shard's two stacks, which its rows' lines name
        entry["ab"] = copy.deepcopy(report["ab"])
    return [entry]


def merge_reports(shards: list[Shard]) -> dict[str, Any]:
    """The merged report of ``shards`` (at least one); a (node id, hardware) in two inputs is an
    ``OptConfigError`` naming both files."""
    if not shards:
        raise OptConfigError("nothing to merge: give at least one report")
    entries: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    seen: dict[tuple[str, str], str] = {}  # (nodeid, hardware) -> the input it came from
    for shard in shards:
        offset = len(entries)
        inner = _shard_entries(shard)
        entries += inner
        for test in shard.report["tests"]:
            row = copy.deepcopy(test)
            index = offset + test["shard"] if isinstance(test.get("shard"), int) and test["shard"] < len(inner) else offset
            row["hardware"] = shard_hardware(test, entries[index]["environment"])
            row["shard"] = index
            key = (row["nodeid"], row["hardware"])
            if key in seen:
                where = (f"twice in {shard.source!r}" if seen[key] == shard.source
                         else f"in both {seen[key]!r} and {shard.source!r}")
                raise OptConfigError(
                    f"test {row['nodeid']!r} on {row['hardware']!r} is {where}: each (test, hardware) may come from "
                    f"one report only; give each report once and select disjoint tests per shard (pytest-split's "
                    f"--splits/--group, -k or paths)")
            seen[key] = shard.source
            rows.append(row)
    rows.sort(key=_row_order)
    first = shards[0].report
    merged: dict[str, Any] = {
        "schema": REPORT_SCHEMA, "schema_version": REPORT_SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": copy.deepcopy(first["environment"]), "settings": copy.deepcopy(first["settings"]),
        "tests": rows, "summary": count_outcomes(rows), "advice": None, "shards": entries,
    }
    ab = merge_ab([(entry["source"], entry.get("ab")) for entry in entries], rows)
    if ab is not None:
        merged["ab"] = ab
    try:
        validate_report(merged)  # every input was valid: a failure here is a bug, but never a half-valid file
    except ValueError as exc:
        raise OptConfigError(f"the merged report would not be valid, nothing written: {exc}") from None
    return merged
