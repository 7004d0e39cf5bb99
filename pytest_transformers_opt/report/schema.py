"""Check a JSON report against its schema, and read one back from disk.

``validate_report`` uses ``jsonschema`` when it is installed (the full schema in
``report_schema.json``) and otherwise a small built-in check of the fields that say what the
document is. ``load_report`` reads a file that ``--opt-compare`` or ``pytest-opt advise
--from-report`` was pointed at, and turns every way that can go wrong into an
:class:`~pytest_transformers_opt.errors.OptConfigError` that names the file and the problem.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from importlib import resources
from typing import Any

from ..errors import OptConfigError
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


def load_report(path: str | os.PathLike[str], remedy: str | None = None) -> dict[str, Any]:
    """Read and validate a JSON report written by ``--opt-report-json``.

    Raises :class:`OptConfigError` naming ``path`` and the problem when the file cannot be read,
    is not JSON, is not a pytest-transformers-opt report, has another ``schema_version``, or does
    not match the schema. The file is read by the guarded ``files.read_json`` (regular files,
    size, depth and number limits), and ``remedy`` ends the message when it cannot be read.
    """
    from ..files import read_json

    where = os.fspath(path)
    report = read_json(where, what="the report", remedy=remedy)
    problem = _identity_problem(report)
    if problem is not None:
        raise OptConfigError(f"the report {where!r} cannot be used: {problem}")
    try:
        validate_report(report)
    except ValueError as exc:
        raise OptConfigError(f"the report {where!r} cannot be used: {exc}") from exc
    return report  # type: ignore[no-any-return]
