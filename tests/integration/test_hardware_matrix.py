"""The Markdown and HTML reports' hardware matrix, over reports a user's runs wrote.

Two runs of one user's test file (here, on this CPU) stand for two CI shards on two GPU types: each
run's JSON report gets its rows' ``hardware`` rewritten to the GPU it stands for, and the rows are
joined into one document, as a merge of the two shards would hold them.
"""

from __future__ import annotations

import copy
import html
import json
import re
from typing import Any

import pytest

from pytest_transformers_opt.report.html import render_html
from pytest_transformers_opt.report.markdown import render_markdown
from pytest_transformers_opt.report.schema import validate_report
from pytest_transformers_opt.report.view import format_kl, format_ratio_verdict

CHEAP = ("--opt-rounds=1", "--opt-warmup=0")
H200 = "NVIDIA H200"
A100 = "NVIDIA A100-SXM4-80GB"
HOPPER_REASON = "needs compute capability >= 9.0 | found 8.0 <A100>"

USER_TESTS = f'''
import os
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=2, rounds=5)  # 5 rounds a side: the speedup gets its interval and verdict
    opt_bench(max_new_tokens=2)

@pytest.mark.skipif(os.environ.get("MATRIX_GPU") == "a100", reason={HOPPER_REASON!r})
@pytest.mark.optimization("sdpa")
def test_needs_hopper(opt_bench):
    opt_bench(max_new_tokens=2)
'''


def _run(pytester: pytest.Pytester, name: str, *args: str) -> dict[str, Any]:
    path = pytester.path / f"{name}.json"
    result = pytester.runpytest("-p", "no:cacheprovider", *CHEAP, f"--opt-report-json={path}", *args)
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    report: dict[str, Any] = json.loads(path.read_text())
    validate_report(report)
    return report


def _on(report: dict[str, Any], hardware: str) -> dict[str, Any]:
    """The report as if its run had been on ``hardware``."""
    report = copy.deepcopy(report)
    for test in report["tests"]:
        test["hardware"] = hardware
    report["environment"]["hardware"] = hardware
    return report


def _joined(*reports: dict[str, Any]) -> dict[str, Any]:
    """One document with every report's rows (the first one's environment and settings)."""
    joined = copy.deepcopy(reports[0])
    joined["tests"] = [test for report in reports for test in copy.deepcopy(report["tests"])]
    joined["summary"] = {key: sum(report["summary"][key] for report in reports) for key in reports[0]["summary"]}
    validate_report(joined)
    return joined


_RUNS: dict[str, Any] = {}  # the two runs, made once for the module's tests (pytester is per test)


@pytest.fixture
def runs(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    if not _RUNS:
        pytester.makepyfile(test_user=USER_TESTS)
        md, page = pytester.path / "h200.md", pytester.path / "h200.html"
        on_h200 = _run(pytester, "h200", f"--opt-report-md={md}", f"--opt-report-html={page}")
        monkeypatch.setenv("MATRIX_GPU", "a100")
        on_a100 = _run(pytester, "a100")
        _RUNS.update(h200=_on(on_h200, H200), a100=_on(on_a100, A100), md=md.read_text(), html=page.read_text(),
                     single=on_h200)
    return copy.deepcopy(_RUNS)


def _row(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(test for test in report["tests"] if test["nodeid"].split("::")[-1] == name)


def _md_matrix(markdown: str, nodeid: str) -> list[list[str]]:
    """The cells of the matrix table under ``#### `nodeid```` (split on unescaped pipes)."""
    lines = markdown.splitlines()
    start = lines.index(f"#### `{nodeid}`") + 2
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return table


def _html_matrix(page: str, nodeid: str) -> str:
    start = page.index(f'<h3 class="matrix-test"><code>{html.escape(nodeid)}</code></h3>')
    return page[start: page.index("</table>", start)]


def test_two_hardware_report_has_one_matrix_per_test_in_markdown(runs: dict[str, Any]) -> None:
    h200, a100 = runs["h200"], runs["a100"]
    markdown = render_markdown(_joined(h200, a100))
    assert markdown.count("### Hardware matrix") == 1
    # every row's nodeid, the second opt_bench call with its suffix, in the results table's order
    nodeids = [test["nodeid"] for test in h200["tests"]]
    assert sorted(n.split("::")[-1] for n in nodeids) == ["test_needs_hopper", "test_sdpa",
                                                          "test_sdpa[opt_bench call 2]"]
    assert re.findall(r"^#### `(.*)`$", markdown, re.M) == nodeids  # the results table's order
    for nodeid in nodeids:
        table = _md_matrix(markdown, nodeid)
        assert table[0] == ["Figure", A100, H200]  # sorted, whichever shard came first
        assert [row[0] for row in table[2:]] == ["Speedup", "Peak memory ratio", "KL mean", "Outcome"]
        assert all(len(row) == 3 for row in table)

    sdpa = _md_matrix(markdown, _row(h200, "test_sdpa")["nodeid"])
    speedups = [format_ratio_verdict(_row(report, "test_sdpa"), "speedup") for report in (a100, h200)]
    assert all(re.fullmatch(r"[0-9.]+x \[[0-9.]+-[0-9.]+\] (faster|slower|no significant difference)", s)
               for s in speedups), speedups  # 5 rounds: the interval and the verdict word are there
    assert sdpa[2] == ["Speedup", *(s.replace("[", "\\[").replace("]", "\\]") for s in speedups)]
    assert sdpa[4] == ["KL mean", *(format_kl(_row(r, "test_sdpa")["similarity"]["kl_mean"]) for r in (a100, h200))]
    assert sdpa[5] == ["Outcome", "passed", "passed"]
    second = _md_matrix(markdown, _row(h200, "test_sdpa[opt_bench call 2]")["nodeid"])
    assert second[2] == ["Speedup", *(format_ratio_verdict(_row(r, "test_sdpa[opt_bench call 2]"), "speedup")
                                      for r in (a100, h200))]

    # the results table names each row's hardware: the same test id is there once per GPU
    results = markdown.split("### Results", 1)[1].split("\n### ", 1)[0].splitlines()
    assert next(line for line in results if line.startswith("| Test |")).startswith("| Test | Hardware | Techniques |")
    sdpa_rows = [line for line in results if line.startswith(f"| `{_row(h200, 'test_sdpa')['nodeid']}` |")]
    assert sorted(line.split(" | ")[1] for line in sdpa_rows) == [A100, H200]

    hopper = _md_matrix(markdown, _row(h200, "test_needs_hopper")["nodeid"])
    assert hopper[2][1] == "-" and hopper[2][2] == format_ratio_verdict(_row(h200, "test_needs_hopper"), "speedup")
    # skipped on the A100 only, with its reason: the pipe and the markup escaped, the cell still one cell
    assert hopper[5] == ["Outcome", "skipped: needs compute capability \\>= 9.0 \\| found 8.0 \\<A100\\>", "passed"]


def test_two_hardware_report_has_the_same_matrix_in_html(runs: dict[str, Any]) -> None:
    h200, a100 = runs["h200"], runs["a100"]
    page = render_html(_joined(a100, h200))
    assert page.count('<section id="hardware-matrix">') == 1
    assert page.index('id="results"') < page.index('id="hardware-matrix"')
    sdpa = _html_matrix(page, _row(h200, "test_sdpa")["nodeid"])
    assert f"<th>Figure</th><th>{A100}</th><th>{H200}</th>" in sdpa
    speedups = "".join(f"<td>{format_ratio_verdict(_row(r, 'test_sdpa'), 'speedup')}</td>" for r in (a100, h200))
    assert f"<tr><td>Speedup</td>{speedups}</tr>" in sdpa
    kls = "".join(f"<td>{format_kl(_row(r, 'test_sdpa')['similarity']['kl_mean'])}</td>" for r in (a100, h200))
    assert f"<tr><td>KL mean</td>{kls}</tr>" in sdpa
    hopper = _html_matrix(page, _row(h200, "test_needs_hopper")["nodeid"])
    assert ("<tr><td>Outcome</td><td>skipped: needs compute capability &gt;= 9.0 | found 8.0 &lt;A100&gt;</td>"
            "<td>passed</td></tr>") in hopper
    assert "<A100>" not in page


def test_one_hardware_report_has_no_matrix(runs: dict[str, Any]) -> None:
    # what the plugin wrote for the one run, and the same report rendered again
    assert "Hardware matrix" not in runs["md"]
    assert "hardware-matrix" not in runs["html"]
    single = runs["single"]
    assert {test["hardware"] for test in single["tests"]} == {single["environment"]["hardware"]}
    assert "Hardware matrix" not in render_markdown(single)
    assert "| Test | Techniques |" in render_markdown(single)  # one hardware: no Hardware column
    assert "hardware-matrix" not in render_html(single)
    # two shards on the same GPU type are one column: no matrix either
    same = _joined(runs["h200"], _on(runs["a100"], H200))
    assert "Hardware matrix" not in render_markdown(same) and "hardware-matrix" not in render_html(same)


def test_rows_without_hardware_count_as_the_runs_own(runs: dict[str, Any]) -> None:
    h200 = runs["h200"]
    sdpa = _row(h200, "test_sdpa")
    sdpa["hardware"] = None  # a worker that never probed: the run's own, environment.hardware
    joined = _joined(h200, runs["a100"])
    table = _md_matrix(render_markdown(joined), sdpa["nodeid"])
    assert table[0] == ["Figure", A100, H200] and table[5] == ["Outcome", "passed", "passed"]
    del joined["environment"]["hardware"]  # an older report: the row's hardware is not known
    table = _md_matrix(render_markdown(joined), sdpa["nodeid"])
    assert table[0] == ["Figure", A100, H200, "unknown hardware"]
    assert table[5] == ["Outcome", "passed", "not run on this hardware", "passed"]
