"""The HTML page's "Hardware matrix" section: the cells of :func:`.view.hardware_matrices` laid out.

The Markdown report lays out the same matrices (``markdown.py``), so the two cannot disagree on a cell.
The page's own table and escaping helpers are passed in, so this section is built and escaped as every
other table of the page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from .view import MATRIX_INTRO, hardware_matrices


class HtmlTable(Protocol):
    """The page's table helper (``html._html_table``): headers and rows of plain text, escaped there."""

    def __call__(self, headers: Sequence[str], rows: Iterable[Sequence[str]], *, cls: str = "") -> str: ...


def matrix_html(report: Mapping[str, Any], table: HtmlTable, escape: Callable[[Any], str]) -> list[str]:
    """The section's lines; none when the report's tests ran on one kind of hardware (no section)."""
    matrices = hardware_matrices(report)
    if not matrices:
        return []
    out = ['<section id="hardware-matrix"><h2>Hardware matrix</h2>', f"<p>{escape(MATRIX_INTRO)}</p>"]
    for matrix in matrices:
        out.append(f'<h3 class="matrix-test"><code>{escape(matrix.test)}</code></h3>')
        out.append(table(matrix.headers, matrix.cells, cls="hardware-matrix"))
    out.append("</section>")
    return out
