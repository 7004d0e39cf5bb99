"""The report's identity, its schema check, and the one reader of a report file.

``REPORT_SCHEMA`` and ``REPORT_SCHEMA_VERSION`` are the only Python copy of what a report says it is
(``report_schema.json`` states the same, and a test holds them together). ``validate_report`` uses
``jsonschema`` when it is installed (the full schema in ``report_schema.json``) and otherwise a small
built-in check of the fields that say what the document is. ``load_report`` reads a file that
``--opt-compare`` or ``pytest-opt advise --from-report`` was pointed at, and turns every way that can
go wrong into one :class:`~pytest_transformers_opt.errors.OptConfigError` line that names the option,
the file, the problem and what is accepted.

Within one ``schema_version`` a reader accepts what every earlier version of the plugin wrote: renamed
keys (``_RENAMED``) are read as today's, unknown keys are dropped, and an optional object that still
does not fit is read as null, each with a note (``read_notes``); ``tests/data/reports/`` keeps a report
of every layout. A change a reader cannot take that way bumps ``schema_version``, with a reader for the
old one. ``report_text`` is the writers' side: no report is written that its readers would refuse.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from importlib import resources
from typing import Any

from .. import files
from ..errors import OptConfigError
from ..files import JsonProblem, MAX_JSON_DEPTH, check_shape, read_json
from ..units import shown

REPORT_SCHEMA = "pytest-transformers-opt/report"
REPORT_SCHEMA_VERSION = 1
SCHEMA_RESOURCE = "report_schema.json"

_MAX_ERRORS_SHOWN = 8
_OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")


@lru_cache(maxsize=1)
def _schema_text() -> str:
    return resources.files(__package__).joinpath(SCHEMA_RESOURCE).read_text(encoding="utf-8")


def load_schema() -> dict[str, Any]:
    """The report's JSON Schema (draft 2020-12) as a fresh dict."""
    schema: dict[str, Any] = json.loads(_schema_text())
    return schema


def _where(path: Any) -> str:
    """``tests[0].baseline.latency_s`` from a jsonschema path deque."""
    text = "report"
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def _identity_problem(report: Any) -> str | None:
    """Why ``report`` is not a schema_version 1 report at all, or None when it says it is one."""
    if not isinstance(report, dict):
        return f"a report is a JSON object; found {type(report).__name__}"
    if report.get("schema") != REPORT_SCHEMA:
        found = shown(report["schema"]) if "schema" in report else "no \"schema\" key"
        return f"not a pytest-transformers-opt report: expected \"schema\": \"{REPORT_SCHEMA}\"; found {found}"
    version = report.get("schema_version")
    if version != REPORT_SCHEMA_VERSION or isinstance(version, bool):
        found = shown(version) if "schema_version" in report else "no \"schema_version\" key"
        return (
            f"report schema_version {found} is not supported; this version of "
            f"pytest-transformers-opt reads schema_version {REPORT_SCHEMA_VERSION}"
        )
    return None


def _builtin_problems(report: dict[str, Any]) -> list[str]:
    """The small check used when jsonschema is not installed."""
    problems: list[str] = []
    tests = report.get("tests")
    if not isinstance(tests, list):
        problems.append(f"report.tests: expected a list of test records; found {shown(tests)}")
        tests = []
    for index, test in enumerate(tests):
        if not isinstance(test, dict):
            problems.append(f"report.tests[{index}]: expected an object; found {shown(test)}")
            continue
        if not isinstance(test.get("nodeid"), str) or not test.get("nodeid"):
            problems.append(f"report.tests[{index}].nodeid: expected a test id; found {shown(test.get('nodeid'))}")
        if test.get("outcome") not in _OUTCOMES:
            problems.append(
                f"report.tests[{index}].outcome: {shown(test.get('outcome'))} is not one of {list(_OUTCOMES)}"
            )
    for key in ("environment", "settings", "summary"):
        if not isinstance(report.get(key), dict):
            problems.append(f"report.{key}: expected an object; found {shown(report.get(key))}")
    return problems


def _jsonschema_problems(report: dict[str, Any]) -> list[str] | None:
    """Every schema violation as ``where: what``; None when jsonschema is not installed."""
    try:
        import jsonschema
        from jsonschema.exceptions import best_match
    except ImportError:
        return None
    validator_class = jsonschema.Draft202012Validator
    validator = validator_class(load_schema(), format_checker=validator_class.FORMAT_CHECKER)
    problems = []
    def order(error: Any) -> list[tuple[int, Any]]:
        return [(0, part) if isinstance(part, int) else (1, str(part)) for part in error.absolute_path]

    for error in sorted(validator.iter_errors(report), key=order):
        if error.context:  # oneOf / anyOf: say what was wrong inside the branch that came closest
            error = best_match(error.context)
        problems.append(f"{_where(error.absolute_path)}: {error.message}")
    return problems


def validate_report(report: dict[str, Any]) -> None:
    """Raise ``ValueError`` with a readable message when ``report`` is not a valid report.

    The message names each problem by its place in the report (``report.tests[0].outcome``),
    at most eight of them, and how many more there were.
    """
    problem = _identity_problem(report)
    if problem is not None:
        raise ValueError(problem)
    problems = _jsonschema_problems(report)
    if problems is None:
        problems = _builtin_problems(report)
    if problems:
        shown = problems[:_MAX_ERRORS_SHOWN]
        more = len(problems) - len(shown)
        lines = [f"invalid {REPORT_SCHEMA} (schema_version {REPORT_SCHEMA_VERSION}):"]
        lines += [f"  - {line}" for line in shown]
        if more:
            lines.append(f"  ... and {more} more")
        raise ValueError("\n".join(lines))


def reader_problem(report: Any) -> str | None:
    """Why ``report`` cannot be read at all (see ``load_report``'s ``full_schema=False``), or None.

    The least every reader needs: a schema_version 1 report whose ``tests`` is a list of objects and
    whose ``environment``, when present, is an object."""
    problem = _identity_problem(report)
    if problem is not None:
        return problem
    tests = report.get("tests")
    if not isinstance(tests, list) or not all(isinstance(test, dict) for test in tests):
        return f"report.tests: expected a list of test records; found {shown(tests)}"
    if not isinstance(report.get("environment", {}), dict):
        return f"report.environment: expected an object; found {shown(report['environment'])}"
    return None


class ReadReport(dict[str, Any]):
    """A report ``load_report`` read, with ``read_notes``: what it ignored or renamed in a report written by
    another version of the plugin (same ``schema_version``), one line each."""

    read_notes: list[str]


def read_notes(report: Any) -> list[str]:
    """What the reader ignored or renamed in ``report`` (see ``ReadReport``); [] for any other dict."""
    return list(getattr(report, "read_notes", []))


# Renamed fields of earlier layouts of schema_version 1, each read into today's: (where, old key, reader).
def _rounds_decision_error_rate(decision: dict[str, Any]) -> None:
    # one error rate for both errors (written before false_alarm_rate and miss_rate were told apart)
    rate = decision.pop("error_rate")
    decision.setdefault("false_alarm_rate", rate)
    decision.setdefault("miss_rate", rate)


_RENAMED: tuple[tuple[str, str, str, Any], ...] = (
    ("rounds_decision", "error_rate", "false_alarm_rate and miss_rate", _rounds_decision_error_rate),
)
# Optional objects of a test row that a reader may drop (null) when an earlier layout's keys do not fit.
_DROPPABLE = ("rounds_decision", "regression", "ab")


def _general(path: Any) -> str:
    """``tests[].rounds_decision.error_rate`` from a path: every row alike, so one note says it."""
    text = "report"
    for part in path:
        text += "[]" if isinstance(part, int) else f".{part}"
    return text


def _at(report: Any, path: Any) -> Any:
    for part in path:
        report = report[part]
    return report


def _read_earlier_layouts(report: dict[str, Any]) -> list[str]:
    """Make a report written by another version of the same ``schema_version`` readable, in place: renamed
    keys read as today's, unknown keys dropped, an optional object whose keys do not fit dropped (null).
    Returns one note per kind of change; what still does not fit is left for the schema check to refuse."""
    try:
        import jsonschema
    except ImportError:  # the built-in check reads only what it needs: nothing to tolerate
        return []
    notes: dict[str, int] = {}
    tests = report.get("tests")
    for test in tests if isinstance(tests, list) else []:
        for field, old_key, new_keys, read in _RENAMED:
            part = test.get(field) if isinstance(test, dict) else None
            if isinstance(part, dict) and old_key in part:
                read(part)
                note = f"read report.tests[].{field}.{old_key} (an earlier layout) as {new_keys}"
                notes[note] = notes.get(note, 0) + 1
    validator = jsonschema.Draft202012Validator(load_schema())
    for _ in range(3):  # dropping a key can only uncover errors deeper in the same object
        changed = False
        for error in list(validator.iter_errors(report)):
            path = list(error.absolute_path)
            if error.validator == "additionalProperties" and isinstance(error.instance, dict):
                known = error.schema.get("properties", {})
                container = _at(report, path)
                for key in [k for k in container if k not in known]:
                    del container[key]
                    note = f"ignored {_general([*path, key])} (unknown to this version)"
                    notes[note] = notes.get(note, 0) + 1
                    changed = True
                continue
            for depth in range(len(path), 0, -1):  # the innermost droppable object holding the problem
                if path[depth - 1] in _DROPPABLE and len(path) >= 2 and path[0] == "tests":
                    parent = _at(report, path[:depth - 1])
                    if parent.get(path[depth - 1]) is not None:
                        parent[path[depth - 1]] = None
                        note = f"ignored {_general(path[:depth])} ({error.message})"
                        notes[note] = notes.get(note, 0) + 1
                        changed = True
                    break
        if not changed:
            break
    return [note if count == 1 else f"{note}, in {count} places" for note, count in notes.items()]


def report_text(report: dict[str, Any]) -> str:
    """The file text of a report the plugin writes; ``ValueError`` saying why when its own reader would refuse
    it (over ``files.MAX_REPORT_BYTES`` or ``files.MAX_REPORT_ITEMS``): nothing the plugin writes is refused
    when it reads it back."""
    try:
        check_shape(report, MAX_JSON_DEPTH, files.MAX_REPORT_ITEMS)
    except JsonProblem as exc:
        held = str(exc).removeprefix("cannot be used: ")
        raise ValueError(f"a report reader would refuse this report ({held}); nothing written: split the run (or "
                         f"the merge) into smaller reports") from None
    text = json.dumps(report, indent=2, allow_nan=False) + "\n"
    size = len(text.encode("utf-8"))
    if size > files.MAX_REPORT_BYTES:
        raise ValueError(f"the report would be {size} bytes, over the limit of {files.MAX_REPORT_BYTES} bytes a "
                         f"report reader accepts; nothing written: split the run (or the merge) into smaller reports")
    return text


def load_report(path: str | os.PathLike[str], *, source: str | None = None, remedy: str | None = None,
                full_schema: bool = True, notes: list[str] | None = None) -> dict[str, Any]:
    """Read and check a JSON report written by ``--opt-report-json``: the one reader of report files.

    Every problem is one :class:`OptConfigError` line, ``<source>: <what is wrong with the report
    '<path>'>; <remedy>``: the file cannot be read, is not JSON or passes a limit of the guarded
    ``files.read_json`` (regular files, size, depth and number limits), is not a pytest-transformers-opt
    report, has another ``schema_version``, or does not match the schema. ``source`` is where the path
    came from (an option or a variable), ``remedy`` what the caller accepts instead. ``full_schema=False``
    checks only what ``reader_problem`` needs, for a reader that takes trimmed or hand-written reports.
    """
    where = os.fspath(path)
    prefix = f"{source}: " if source else ""
    suffix = f"; {remedy}" if remedy else ""
    report = read_json(where, what="the report", source=source, remedy=remedy, max_bytes=files.MAX_REPORT_BYTES,
                       max_items=files.MAX_REPORT_ITEMS)
    problem = _identity_problem(report) if full_schema else reader_problem(report)
    ignored: list[str] = []
    if problem is None and full_schema:
        try:
            try:
                validate_report(report)
            except ValueError:  # perhaps an earlier layout: read it as one, then check again
                ignored = _read_earlier_layouts(report)
                validate_report(report)
        except ValueError as exc:  # one line: a usage error is read on one line
            head, *problems = str(exc).splitlines()
            problem = " ".join([head, "; ".join(line.strip(" -") for line in problems)]).strip()
    if problem is not None:
        raise OptConfigError(f"{prefix}the report {where!r} cannot be used: {problem}{suffix}")
    checked = ReadReport(report)
    checked.read_notes = [f"{prefix}the report {where!r}: {note}" for note in ignored]
    if notes is not None:
        notes += checked.read_notes
    return checked
