"""The hardware matrix's cells (report.view.hardware_matrices) and their Markdown and HTML layout."""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_transformers_opt.report.html import render_html
from pytest_transformers_opt.report.markdown import render_markdown
from pytest_transformers_opt.report.view import (NOT_RUN_HERE, UNKNOWN_HARDWARE, format_ratio_verdict,
                                                 hardware_matrices, table_row)

H200 = "NVIDIA H200"
A100 = "NVIDIA A100-SXM4-80GB"
CPU = "CPU: AMD EPYC 7763 64-Core Processor"


def _row(nodeid: str, hardware: str | None, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"nodeid": nodeid, "outcome": "passed", "hardware": hardware, "speedup": 1.3,
                           "memory_ratio": 0.9, "similarity": {"kl_mean": 2e-4}}
    row.update(fields)
    return row


def _report(*tests: dict[str, Any], environment: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"tests": list(tests), "environment": environment or {}}


def test_columns_are_every_fingerprint_sorted_whatever_the_row_order() -> None:
    report = _report(_row("t.py::a", H200), _row("t.py::a", CPU), _row("t.py::a", A100))
    (matrix,) = hardware_matrices(report)
    assert matrix.headers == ["Figure", CPU, A100, H200]
    assert [label for label, _cells in matrix.rows] == ["Speedup", "Peak memory ratio", "KL mean", "Outcome"]


def test_cells_are_the_results_tables_cells_interval_and_verdict_included() -> None:
    h200 = _row("t.py::a", H200, speedup=1.12, speedup_interval=[1.05, 1.19], speedup_verdict="faster",
                memory_ratio=0.62, memory_ratio_verdict="smaller")
    a100 = _row("t.py::a", A100, speedup=0.98, speedup_interval=[0.9, 1.07],
                speedup_verdict="no significant difference")
    (matrix,) = hardware_matrices(_report(h200, a100))
    cells = dict(matrix.rows)
    assert cells["Speedup"] == ("0.98x [0.90-1.07] no significant difference", "1.12x [1.05-1.19] faster")
    assert cells["Speedup"][1] == format_ratio_verdict(h200, "speedup") == table_row(h200)["speedup"]
    assert cells["Peak memory ratio"] == (table_row(a100)["memory_ratio"], "0.62x smaller")
    assert cells["KL mean"] == ("0.0002", "0.0002")
    markdown = render_markdown(_report(h200, a100))
    assert "| Speedup | 0.98x \\[0.90-1.07\\] no significant difference | 1.12x \\[1.05-1.19\\] faster |" in markdown
    page = render_html(_report(h200, a100))
    assert "<tr><td>Speedup</td><td>0.98x [0.90-1.07] no significant difference</td>" in page


def test_a_missing_cell_says_why() -> None:
    long_reason = "flash_attention_3 needs a CUDA GPU of compute capability >= 9.0; found: NVIDIA A100 " + "x" * 80
    report = _report(
        _row("t.py::fa3", H200), _row("t.py::fa3", A100, outcome="skipped", skip_reason=long_reason, speedup=None,
                                      memory_ratio=None, similarity=None),
        _row("t.py::only_h200", H200, outcome="failed", failed_budgets=["max_kl"], error="budgets failed: max_kl"),
        _row("t.py::broke", A100, outcome="error", error="Traceback (most recent call last):\nRuntimeError: CUDA OOM"))
    matrices = {matrix.test: dict(matrix.rows) for matrix in hardware_matrices(report)}
    fa3 = matrices["t.py::fa3"]
    assert fa3["Speedup"][0] == "-"
    assert fa3["Outcome"][0].startswith("skipped: flash_attention_3 needs a CUDA GPU of compute capability >= 9.0")
    # shortened to the cell's 100 characters, keeping what was found (the results table has it all)
    assert len(fa3["Outcome"][0]) <= 100 and "found: NVIDIA A100" in fa3["Outcome"][0]
    assert fa3["Outcome"][1] == "passed"
    assert matrices["t.py::only_h200"]["Outcome"] == (NOT_RUN_HERE, "failed budgets: max_kl")
    assert matrices["t.py::only_h200"]["Speedup"] == ("-", "1.30x")
    assert matrices["t.py::broke"]["Outcome"] == ("error: RuntimeError: CUDA OOM", NOT_RUN_HERE)
    # failed budgets first, as in the results table
    assert list(matrices)[0] == "t.py::only_h200"


def test_rows_without_hardware_are_the_runs_own_else_unknown() -> None:
    rows = (_row("t.py::a", None), _row("t.py::a", A100))
    (matrix,) = hardware_matrices(_report(*rows, environment={"hardware": H200}))
    assert matrix.hardware == (A100, H200)
    same = _report(_row("t.py::a", None), _row("t.py::a", H200), environment={"hardware": H200})
    assert hardware_matrices(same) == []
    (matrix,) = hardware_matrices(_report(*rows))
    assert matrix.hardware == (A100, UNKNOWN_HARDWARE)


def test_one_fingerprint_or_none_has_no_matrix_section() -> None:
    for report in (_report(_row("t.py::a", H200), _row("t.py::b", H200)),
                   {"tests": [{"nodeid": "t.py::a", "outcome": "passed"}]}):  # an older report: no hardware field
        assert hardware_matrices(report) == []
        assert "Hardware matrix" not in render_markdown(report)
        assert "hardware-matrix" not in render_html(report)


def test_text_is_escaped_in_both_renderings() -> None:
    report = _report(_row("t.py::a[x|<b>]", "GPU <i>|"), _row("t.py::a[x|<b>]", H200, outcome="skipped",
                                                                 skip_reason="a | pipe & <tag>"))
    markdown = render_markdown(report)
    assert "#### `t.py::a[x|<b>]`" in markdown  # code span: literal, outside a table
    assert "| Figure | GPU \\<i\\>\\| | NVIDIA H200 |" in markdown
    assert "| Outcome | passed | skipped: a \\| pipe & \\<tag\\> |" in markdown
    page = render_html(report)
    assert '<h3 class="matrix-test"><code>t.py::a[x|&lt;b&gt;]</code></h3>' in page
    assert "<th>GPU &lt;i&gt;|</th>" in page
    assert "<td>skipped: a | pipe &amp; &lt;tag&gt;</td>" in page
    assert "<tag>" not in page and "<i>" not in page


_hostile_text = st.text(alphabet=st.sampled_from(list("ab_*|`<>&[]\\~#\n\t é")), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(nodeid=_hostile_text, hardware=_hostile_text, reason=_hostile_text)
def test_any_text_keeps_each_matrix_table_whole(nodeid: str, hardware: str, reason: str) -> None:
    report = _report(_row(nodeid, hardware), _row(nodeid, H200, outcome="skipped", skip_reason=reason),
                     _row("t.py::b", hardware))
    markdown = render_markdown(report)
    section = markdown[markdown.index("### Hardware matrix"):markdown.index("\n<details>")]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert len(rows) >= 2 * 6 and {len(re.split(r"(?<!\\)\|", line[1:-1])) for line in rows} == {3}
    page = render_html(report)
    start = page.index('<section id="hardware-matrix">')
    section = page[start:page.index("</section>", start)]
    assert "<" not in re.sub(r"</?(section|h2|h3|p|code|div|table|thead|tbody|tr|th|td)\b[^<>]*>", "", section)
