#!/usr/bin/env python3
"""The README's support matrix, generated from a JSON report (never typed by hand).

Reads a report written by ``--opt-report-json`` (the matrix test, ``tests/integration/test_matrix.py``,
leaves one per run) and prints a Markdown table: one row per technique, one column per model, each cell
``pass``, ``skip (n)``, ``xfail (n)``, ``fail (n)`` or ``error (n)``, where ``(n)`` is a numbered note under
the table with the reason, word for word. The first line names the versions the table was made on.

Usage (from the repository root):
    python scripts/support_matrix.py REPORT.json             # print the Markdown
    python scripts/support_matrix.py REPORT.json --write     # put it into README.md between the markers
    python scripts/support_matrix.py REPORT.json --check     # exit 1 when README.md holds another table

The README's table sits between ``<!-- support-matrix:start -->`` and ``<!-- support-matrix:end -->``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"
# the cell word of each outcome, and whether its reason becomes a note (a pass has none)
CELL_WORDS = {"passed": "pass", "skipped": "skip", "xfailed": "xfail", "xpassed": "xpass", "failed": "fail",
              "error": "error"}
NOTE_CHARS = 300
LEADING_VERSIONS = ("torch", "transformers")  # named first; every other package of the report after them
# packages the report records that no probe reads: a bump of one of them alone leaves every cell as it was
NOT_PROBED = ("accelerate", "nvidia-ml-py", "tokenizers")


def made_on(environment: dict[str, Any]) -> str:
    """The line that says what the table was made on: device and every package version the report holds."""
    versions: dict[str, Any] = dict(environment.get("versions") or {})
    for name in LEADING_VERSIONS:
        versions.setdefault(name, environment.get(name))
    device = environment.get("device") or "unknown device"
    if environment.get("gpu_name"):
        device = f"{device} ({environment['gpu_name']})"
    named = [f"{name} {versions[name]}" for name in LEADING_VERSIONS if versions.get(name)]
    others = sorted(name for name in versions if name not in LEADING_VERSIONS)
    named += [f"{name} {versions[name]}" for name in others if versions[name]]
    missing = [name for name in others if not versions[name]]
    absent = f"; not installed: {', '.join(missing)}" if missing else ""
    return f"Made on {device} with {', '.join(named)}{absent}."


def probed_stack(line: str) -> str:
    """A "Made on" line without the packages no probe reads: two tables whose lines agree on this can be compared
    cell by cell (the README's, made on accelerate 1.15.0, against a run on 1.16.0)."""
    head, _, rest = line.rstrip(".").partition(" with ")
    installed, _, absent = rest.partition("; not installed: ")
    kept = [item for item in installed.split(", ") if item.split(" ", 1)[0] not in NOT_PROBED]
    missing = [name for name in absent.split(", ") if name and name not in NOT_PROBED]
    return f"{head} with {', '.join(kept)}" + (f"; not installed: {', '.join(missing)}" if missing else "")


def _model_of(entry: dict[str, Any]) -> str | None:
    model = entry.get("model")
    return model.get("name_or_path") if isinstance(model, dict) else None


def _model_order(names: list[str]) -> list[str]:
    """The built-in models in their catalogue order, any other model after them by name."""
    try:
        from pytest_transformers_opt.engine.tiny_models import TINY_MODELS

        known = list(TINY_MODELS)
    except ImportError:  # run outside the package's environment: by name
        known = []
    return sorted(names, key=lambda name: (known.index(name) if name in known else len(known), name))


def _short_names(models: list[str]) -> tuple[list[str], str]:
    """Column headers without the prefix every model shares up to a dash (``tiny-random-``), and that prefix."""
    prefix = os.path.commonprefix(models) if len(models) > 1 else ""
    prefix = prefix[: prefix.rfind("-") + 1] if "-" in prefix else ""
    if any(name == prefix for name in models):
        prefix = ""
    return [name[len(prefix):] for name in models], prefix


def matrix_markdown(report: dict[str, Any]) -> str:
    """The support matrix of ``report`` as Markdown: the made-on line, the table, the numbered reasons."""
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    rows: list[str] = []
    for entry in report["tests"]:
        model = _model_of(entry)
        if model is None or not entry.get("techniques") or entry.get("call", 1) != 1:
            continue  # not a matrix cell: no model, no technique, or a later opt_bench call of one test
        row = " + ".join(entry["techniques"])
        if row not in rows:
            rows.append(row)
        cells[(row, model)] = entry
    if not cells:
        raise ValueError("the report holds no test with a model and a technique: not a matrix run")
    models = _model_order(sorted({model for _, model in cells}))
    headers, prefix = _short_names(models)
    notes: list[str] = []

    def cell(row: str, model: str) -> str:
        entry = cells.get((row, model))
        if entry is None:
            return "-"
        outcome = str(entry.get("outcome"))
        word = CELL_WORDS.get(outcome, outcome)
        reason = entry.get("skip_reason") if outcome in ("skipped", "xfailed") else entry.get("error")
        if outcome in ("passed", "xpassed") or not reason:
            return word
        reason = " ".join(str(reason).split())  # one line: a note is one list item
        if len(reason) > NOTE_CHARS:  # a compiler's error runs to pages: its head says what failed
            reason = reason[: NOTE_CHARS - 3].rstrip() + "..."
        if reason not in notes:
            notes.append(reason)
        return f"{word} ({notes.index(reason) + 1})"

    table = [["technique", *(f"`{header}`" for header in headers)], ["---"] * (len(models) + 1)]
    table += [[f"`{row}`", *(cell(row, model) for model in models)] for row in sorted(rows)]
    lines = [made_on(report.get("environment") or {}), ""]
    if prefix:
        lines += [f"Columns: the models `{prefix}NAME`.", ""]
    lines += ["| " + " | ".join(line) + " |" for line in table]
    if notes:
        lines += [""] + [f"({n}) {note.replace('|', '/')}  " for n, note in enumerate(notes, start=1)]
        lines[-1] = lines[-1].rstrip()
    return "\n".join(lines)


def matrix_cells(block: str) -> dict[tuple[str, str], str]:
    """A generated table read back: (technique, column) -> the cell with its note written out (``skip: <reason>``);
    ``-`` cells (not run) are left out. So two tables compare cell by cell, whatever their notes' numbering."""
    lines = block.splitlines()
    notes = {match[1]: match[2].strip() for match in (re.match(r"^\((\d+)\) (.*)$", line) for line in lines) if match}
    rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in lines if line.startswith("| ")]
    if len(rows) < 2:
        return {}
    header, cells = rows[0], {}
    for row in rows[2:]:
        for column, text in zip(header[1:], row[1:]):
            if text == "-":
                continue
            note = re.fullmatch(r"(\w+) \((\d+)\)", text)
            cells[(row[0], column)] = f"{note[1]}: {notes.get(note[2], '?')}" if note else text
    return cells


def readme_block(text: str, where: str = "README.md") -> str:
    """What ``text`` holds between the markers (stripped); a ValueError naming what is missing."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{where}: no {START} ... {END} block; put the two markers where the table goes")
    return text[start + len(START):end].strip()


def with_block(text: str, block: str, where: str = "README.md") -> str:
    """``text`` with ``block`` between the markers in place of what was there."""
    readme_block(text, where)  # both markers present, in order
    start, end = text.find(START) + len(START), text.find(END)
    return f"{text[:start]}\n{block}\n{text[end:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="a JSON report written by --opt-report-json (the matrix test's)")
    parser.add_argument("--readme", default=str(README), help="the README to write or check (default: %(default)s)")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="replace the table between the README's markers")
    action.add_argument("--check", action="store_true", help="exit 1 when the README's table is another one")
    args = parser.parse_args(argv)
    from pytest_transformers_opt.errors import OptConfigError
    from pytest_transformers_opt.report.schema import load_report

    try:
        # the fields read here only: a trimmed or hand-written report will do
        block = matrix_markdown(load_report(args.report, source="support_matrix.py", full_schema=False))
        if not (args.write or args.check):
            print(block)
            return 0
        readme = Path(args.readme)
        text = readme.read_text(encoding="utf-8")
        if args.check:
            if readme_block(text, args.readme) == block:
                return 0
            print(f"{args.readme}: its support matrix is not the one {args.report} gives; regenerate it with "
                  f"python scripts/support_matrix.py {args.report} --write", file=sys.stderr)
            return 1
        readme.write_text(with_block(text, block, args.readme), encoding="utf-8")
        print(f"wrote the support matrix ({block.count(chr(10)) + 1} lines) into {args.readme}")
        return 0
    except (OptConfigError, OSError, ValueError) as exc:
        print(f"support_matrix.py: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
