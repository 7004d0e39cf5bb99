"""The report's identity, its schema check, and the one reader of a report file.

``REPORT_SCHEMA`` and ``REPORT_SCHEMA_VERSION`` are the only Python copy of what a report says it is
(``report_schema.json`` states the same, and a test holds them together). ``validate_report`` uses
``jsonschema`` when it is installed (the full schema in ``report_schema.json``) and otherwise a small
built-in check of the fields that say what the document is. ``load_report`` reads a file that
``--opt-compare`` or ``pytest-opt advise --from-report`` was pointed at, and turns every way that can
go wrong into one :class:`~pytest_transformers_opt.errors.OptConfigError` line that names the option,
the file, the problem and what is accepted.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from importlib import resources
from typing import Any

from ..errors import OptConfigError
from ..files import read_json
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


def load_report(path: str | os.PathLike[str], *, source: str | None = None, remedy: str | None = None,
                full_schema: bool = True) -> dict[str, Any]:
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
    report = read_json(where, what="the report", source=source, remedy=remedy)
    problem = _identity_problem(report) if full_schema else reader_problem(report)
    if problem is None and full_schema:
        try:
            validate_report(report)
        except ValueError as exc:  # one line: a usage error is read on one line
            head, *problems = str(exc).splitlines()
            problem = " ".join([head, "; ".join(line.strip(" -") for line in problems)]).strip()
    if problem is not None:
        raise OptConfigError(f"{prefix}the report {where!r} cannot be used: {problem}{suffix}")
    checked: dict[str, Any] = report
    return checked
