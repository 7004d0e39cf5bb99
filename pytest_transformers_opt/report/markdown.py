"""The report as Markdown: the text of ``--opt-report-md`` and of ``$GITHUB_STEP_SUMMARY``.

Layout, top to bottom: a one-line summary; with ``--opt-compare``, what the run was compared with and the
verdicts' counts (each test's verdict, reference, spread and detectable size in its Regression cell, and a timed
verdict's census cause last); for a
merged report, its shards (each one's machine and settings, and a warning where they differ); the failed
budgets (test, budget, measured, limit); the results table, one row per test, tests with failed budgets first; with ``--opt-ab``, the A/B
against the reference environment (what differs between the stacks, then a line per test, its census's difference
under it); when the
tests ran on two or more kinds of hardware (a merged report of shards), the hardware matrix; estimated figures in a
section of their own (never in a column of measured ones); compile times with the compile cache's
state; the skipped techniques grouped by reason; failures and errors; the advisor's summary; the environment in a collapsed
``<details>`` block.

Every cell comes from :mod:`.view`, shared with the HTML page and the terminal table, so the
renderings show the same figures in the same words; this module only lays them out and escapes them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from .ab import census_text
from .view import (AB_INTRO, AB_NO_ROWS, AB_TITLE, MATRIX_INTRO, MISSING, SHARD_COLUMNS, ab_header_lines, ab_lines, advice_lines,
                   budgets_mode_note, columns, compare_note, compile_rows, context_text, environment_rows,
                   environment_title, estimate_rows, failed_budget_rows, hardware_matrices, has_ab, one_line,
                   problem_rows, shard_rows, shard_settings_note, skipped_groups, spans_hardware, summary_text,
                   table_rows)
from .view import SPECULATIVE_NOTE, SPECULATIVE_TITLE, speculative_rows


# --------------------------------------------------------------------------- markdown


_MD_SPECIAL = re.compile(r"([\\`*\[\]<>|~])")
_MD_ENTITY = re.compile(r"&(?=#?[A-Za-z0-9]+;)")
_MD_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def md_text(text: Any) -> str:
    """Text safe in a Markdown table cell or list item: one line, Markdown and HTML inert.

    Backslash-escapes what GitHub would read as markup (``| * ` [ ] < > ~ \\``, and ``_`` where
    it could start emphasis; ``&`` where it would start an entity), so a ``|`` in a reason cannot
    split a table cell and a ``<tag>`` stays text.
    """
    line = _MD_ENTITY.sub("&amp;", one_line(str(text)))
    line = _MD_SPECIAL.sub(r"\\\1", line)
    return _MD_UNDERSCORE.sub(r"\\_", line)


def md_code(text: Any, *, in_table: bool) -> str:
    """Inline code (for test ids): a fence longer than any backtick run inside; pipes escaped in tables."""
    line = one_line(str(text))
    longest = max((len(run) for run in re.findall(r"`+", line)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if line.startswith("`") or line.endswith("`") or longest else ""
    if in_table:
        line = line.replace("|", "\\|")
    return f"{fence}{pad}{line}{pad}{fence}"


def _md_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """The report as GitHub-flavoured Markdown (a step summary or an issue's text)."""
    out: list[str] = ["## Optimization report", ""]
    out.append(f"**{summary_text(report)}**" + (f" · {md_text(context_text(report))}" if context_text(report) else ""))
    for note in (budgets_mode_note(report), shard_settings_note(report), compare_note(report)):
        if note:
            out += ["", f"> {md_text(note)}"]
    by_hardware = spans_hardware(report)  # a merged report: each per-test table says which hardware

    shards = shard_rows(report)
    if len(shards) > 1:
        out += ["", "### Shards", ""]
        out += _md_table([header for _, header in SHARD_COLUMNS],
                         ([md_text(row[key]) for key, _ in SHARD_COLUMNS] for row in shards))

    budget_rows = failed_budget_rows(report)
    if budget_rows:
        out += ["", "### Failed budgets", ""]
        with_note = any(row["note"] for row in budget_rows)
        headers = (["Test"] + (["Hardware"] if by_hardware else []) + ["Budget", "Measured", "Limit", "Source"]
                   + (["Note"] if with_note else []))
        cells = []
        for row in budget_rows:
            cell = [md_code(row["test"], in_table=True), *([md_text(row["hardware"])] if by_hardware else []),
                    md_text(row["budget"]), md_text(row["measured"]), md_text(row["limit"]), md_text(row["source"])]
            if with_note:
                cell.append(md_text(row["note"]) or MISSING)
            cells.append(cell)
        out += _md_table(headers, cells)

    out += ["", "### Results", ""]
    rows = table_rows(report)
    if rows:
        cols = columns(report)
        cells = []
        for _test, row in rows:
            cells.append([md_code(row[key], in_table=True) if key == "test" else md_text(row[key]) for key, _ in cols])
        out += _md_table([header for _, header in cols], cells)
    else:
        out.append("No test used `opt_bench` in this run.")

    if has_ab(report):
        out += ["", f"### {AB_TITLE}", "", md_text(AB_INTRO), ""]
        out += [f"**{md_text(line)}**  " for line in ab_header_lines(report)]
        out.append("")
        compared = ab_lines(report)
        for test, line in compared:
            out.append(f"- {md_code(test.get('nodeid'), in_table=False)}: {md_text(line)}")
            census = census_text(test)  # what the two stacks run differently, under its line
            if census:
                out.append(f"  - {md_text(census)}")
        if not compared:
            out.append(md_text(AB_NO_ROWS))

    matrices = hardware_matrices(report)
    if matrices:
        out += ["", "### Hardware matrix", "", md_text(MATRIX_INTRO)]
        for matrix in matrices:
            out += ["", f"#### {md_code(matrix.test, in_table=False)}", ""]
            out += _md_table([md_text(header) for header in matrix.headers],
                             ([md_text(cell) for cell in row] for row in matrix.cells))

    estimates = estimate_rows(report)
    if estimates:
        out += ["", "### Estimated figures (estimate)", "",
                "Not measured in this run; kept apart from the measured figures above.", ""]
        out += _md_table(
            ["Test"] + (["Hardware"] if by_hardware else []) + ["Figure", "Value (estimate)"],
            ([md_code(row["test"], in_table=True), *([md_text(row["hardware"])] if by_hardware else []),
              md_text(row["figure"]), md_text(row["value"]) + " (estimate)"] for row in estimates),
        )

    compiled = compile_rows(report)
    if compiled:
        out += ["", "### Compile time", "", "Warm-up time of the first compiled call, not in the figures above.", ""]
        out += _md_table(["Test", "Compile time", "Compile cache", "Recompiles"],
                         ([md_code(row["test"], in_table=True), md_text(row["compile_time"]), md_text(row["cache"]),
                           md_text(row["recompiles"])] for row in compiled))

    drafted = speculative_rows(report)
    if drafted:
        out += ["", f"### {SPECULATIVE_TITLE}", "", SPECULATIVE_NOTE, ""]
        out += _md_table(["Test", "Acceptance rate", "Accepted per step", "Accepted", "Proposed", "Steps"],
                         ([md_code(row["test"], in_table=True), *(md_text(row[key]) for key in
                           ("acceptance_rate", "accepted_per_step", "accepted", "proposed", "steps"))]
                          for row in drafted))

    groups = skipped_groups(report)
    if groups:
        count = sum(len(tests) for _, tests in groups)
        out += ["", f"### Skipped techniques ({count} {'test' if count == 1 else 'tests'})", ""]
        for reason, tests in groups:
            out.append(f"- {md_text(reason)} ({len(tests)} {'test' if len(tests) == 1 else 'tests'})")
            for test in tests:
                techniques = " + ".join(str(name) for name in test.get("techniques") or [])
                suffix = f" — {md_text(techniques)}" if techniques else ""
                out.append(f"  - {md_code(test.get('nodeid'), in_table=False)}{suffix}")

    problems = problem_rows(report)
    if problems:
        out += ["", "### Failures and errors", ""]
        out += [f"- {md_code(row['test'], in_table=False)} ({row['outcome']}): {md_text(row['error'])}"
                for row in problems]

    advice = advice_lines(report)
    if advice:
        out += ["", "### Advice", ""] + [f"- {md_text(line)}" for line in advice]

    out += ["", "<details>", f"<summary>{md_text(environment_title(report))}</summary>", ""]
    out += _md_table(["Item", "Value"], ([md_text(label), md_text(value)] for label, value in environment_rows(report)))
    out += ["", "</details>", ""]
    return "\n".join(out)
