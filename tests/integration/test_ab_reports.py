"""``--opt-ab`` records through ``pytest-opt merge``: crafted reports whose rows carry an A/B record (completed as
the session end completes them) merge with their records kept, and the Markdown, HTML and JSON outputs say, per
test, candidate vs reference with only the differing packages, the figures with their intervals and words, and
the verdict; the header says what differs (or that the stacks are identical); shards against different
references are noted. End-to-end runs against a real reference environment are in the session's own tests."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import pytest

from ab_reports import CANDIDATE, REFERENCE_ROUNDS, ab_record, reference_versions, report, row
from pytest_transformers_opt.cli import main
from pytest_transformers_opt.report.ab import complete_ab
from pytest_transformers_opt.verdict.compare import parse_compare_fail
from pytest_transformers_opt.report.schema import validate_report

FIXTURES = Path(__file__).parents[1] / "data" / "reports"
SLOWER = [r * 1.10 for r in REFERENCE_ROUNDS]
SAME = REFERENCE_ROUNDS[5:] + REFERENCE_ROUNDS[:5]
BUMPED = reference_versions(transformers="5.22.0")
LINE_A = ("candidate (transformers 5.24.0) vs reference (transformers 5.22.0): latency +10.0% [+10.0%, +10.0%] "
          "slower, TTFT +10.0%, TPOT +10.0%, throughput -9.1%, peak memory +0.0% no significant difference, "
          "KL mean 0.0005, top-1 100.0%; regressed")
LINE_B = ("candidate (transformers 5.24.0) vs reference (transformers 5.22.0): latency +0.0% [")


def shard(path: Path, *rows: dict[str, Any], thresholds: str | None = "latency:5%,kl_mean:0.01") -> Path:
    """A report as the session end writes it: every A/B record completed, then the file."""
    made = report(*rows)
    complete_ab(made, parse_compare_fail(thresholds) if thresholds else [], CANDIDATE)
    validate_report(made)
    path.write_text(json.dumps(made, indent=2))
    return path


def merge(capsys: pytest.CaptureFixture[str], tmp_path: Path, *inputs: Path) -> tuple[dict[str, Any], str, str, str]:
    """``pytest-opt merge INPUTS -o --md --html``: the merged JSON, the Markdown, the HTML and stdout."""
    out = [tmp_path / name for name in ("merged.json", "merged.md", "merged.html")]
    code = main(["merge", *map(str, inputs), "-o", str(out[0]), "--md", str(out[1]), "--html", str(out[2])])
    printed, err = capsys.readouterr()
    assert (code, err) == (0, ""), err
    merged = json.loads(out[0].read_text())
    validate_report(merged)
    return merged, out[1].read_text(), out[2].read_text(), printed


def test_a_report_with_ab_records_merges_and_renders_them_in_every_format(capsys: pytest.CaptureFixture[str],
                                                                        tmp_path: Path) -> None:
    written = shard(tmp_path / "run.json", row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS, versions=BUMPED)),
                    row("t.py::test_b", SAME, ab_record(REFERENCE_ROUNDS, versions=BUMPED)),
                    row("t.py::test_c", SAME, None))
    original = json.loads(written.read_text())
    merged, markdown, page, printed = merge(capsys, tmp_path, written)
    assert "note:" not in printed  # the reader kept every A/B field: nothing ignored
    # JSON: each row's record as written, the top level recounted from the rows, the shard's own stacks kept
    assert [t.get("ab") for t in merged["tests"]] == [t.get("ab") for t in original["tests"]]
    assert merged["tests"][0]["ab"]["verdict"] == "regressed" and merged["tests"][1]["ab"]["verdict"] == "ok"
    assert merged["ab"] == {**original["ab"], "merge_note": None}
    assert merged["ab"]["differs"] == {"transformers": ["5.24.0 (candidate)", "5.22.0 (reference)"]}
    assert merged["ab"]["summary"] == {"regressed": 1, "inconclusive": 0, "improved": 0, "ok": 1, "not comparable": 0, "not judged": 0}
    assert merged["shards"][0]["ab"] == original["ab"]
    # Markdown: the section, its header, a line per test with an A/B record (none for test_c)
    section = markdown[markdown.index("### A/B against another environment"):markdown.index("<details>")]
    assert "**candidate /venv/candidate/bin/python vs reference /venv/reference/bin/python**" in section
    assert "**what differs: transformers 5.24.0 (candidate) / 5.22.0 (reference)**" in section
    assert "**--opt-ab-fail=latency:5%,kl_mean:0.01: 1 regressed, 0 inconclusive, 0 improved, 1 ok, 0 not comparable, 0 not judged**" in section
    assert f"- `t.py::test_a`: {LINE_A.replace('[', chr(92) + '[').replace(']', chr(92) + ']')}" in section
    assert f"- `t.py::test_b`: {LINE_B.replace('[', chr(92) + '[')}" in section
    assert "test_c" not in section
    # HTML: the same lines, escaped, the regressed one marked
    ab = page[page.index('<section id="ab">'):]
    ab = ab[:ab.index("</section>")]
    assert "<h2>A/B against another environment</h2>" in ab
    assert f'<li class="bad"><code>t.py::test_a</code>: {html.escape(LINE_A)}</li>' in ab
    assert f"<li><code>t.py::test_b</code>: {html.escape(LINE_B)}" in ab
    assert "<strong>what differs: transformers 5.24.0 (candidate) / 5.22.0 (reference)</strong>" in ab
    assert "test_c" not in ab


def test_shards_against_different_references_keep_their_own_lines_and_say_they_differ(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bumped = shard(tmp_path / "bumped.json", row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS, versions=BUMPED)))
    itself = shard(tmp_path / "itself.json",
                   row("t.py::test_b", SAME, ab_record(REFERENCE_ROUNDS, python="/venv/wrapper/python")),
                   thresholds=None)
    merged, markdown, page, _ = merge(capsys, tmp_path, bumped, itself)
    assert [t["nodeid"] for t in merged["tests"]] == ["t.py::test_a", "t.py::test_b"]
    assert merged["tests"][1]["ab"]["note"] == "identical stacks"  # an A/B of an environment with itself says so
    assert merged["ab"]["note"] is None  # no one pair of stacks for the whole merge
    assert merged["ab"]["summary"] == {"regressed": 1, "inconclusive": 0, "improved": 0, "ok": 0, "not comparable": 0, "not judged": 1}
    assert merged["ab"]["merge_note"] == (
        "the shards' references differ: /venv/reference/bin/python (transformers 5.22.0) in "
        f"{tmp_path / 'bumped.json'}; /venv/wrapper/python (transformers 5.24.0) in {tmp_path / 'itself.json'}; "
        "the shards' --opt-ab-fail thresholds differ: latency:5%,kl_mean:0.01 / none")
    lines = [line for line in markdown.splitlines() if line.startswith("- `t.py::")]
    assert lines[0].startswith("- `t.py::test_a`: candidate (transformers 5.24.0) vs reference (transformers 5.22.0): ")
    assert lines[1].startswith("- `t.py::test_b`: candidate vs reference (identical stacks): latency +0.0% ")
    assert "the shards' references differ" in markdown and "the shards&#x27; references differ" in page


def test_a_report_of_an_earlier_layout_merges_with_an_ab_shard(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    # the newest layout written before A/B records existed
    earlier = [path for path in sorted(FIXTURES.glob("layout-*.json")) if '"ab"' not in path.read_text()][-1]
    with_ab = shard(tmp_path / "ab.json", row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS, versions=BUMPED)))
    merged, markdown, _, _ = merge(capsys, tmp_path, earlier, with_ab)
    assert merged["ab"]["reference"]["python"] == "/venv/reference/bin/python" and "ab" not in merged["shards"][0]
    assert sum("ab" in t for t in merged["tests"]) == 1
    assert "### A/B against another environment" in markdown


def test_a_row_whose_ab_record_does_not_fit_is_read_without_it(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    written = shard(tmp_path / "run.json", row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS, versions=BUMPED)))
    odd = json.loads(written.read_text())
    odd["tests"][0]["ab"]["verdict"] = "worse"  # a later version's verdict word: the record is optional
    written.write_text(json.dumps(odd))
    merged, markdown, _, printed = merge(capsys, tmp_path, written)
    assert merged["tests"][0]["ab"] is None
    assert f"note: the report {str(written)!r}: ignored report.tests[].ab (" in printed
    assert "- `t.py::test_a`" not in markdown  # no record, no line; the top level still names the stacks
    assert "**what differs: transformers 5.24.0 (candidate) / 5.22.0 (reference)**" in markdown
    assert "No test of this report was measured in the reference environment." in markdown
