"""The execution census in the A/B (``--opt-ab``): the reference environment counts what the test's optimized
configuration runs there, the report names what the candidate runs differently, ``--opt-ab-fail`` judges the
census's metrics exactly, and a timed A/B verdict that is regressed or inconclusive gives the difference as its
cause. The reference is a wrapper script that execs this same Python; the user's technique knows which environment
it runs in by the worker's script, and adds one matmul per decoder layer in the candidate only, as a transformers
release that adds an op per layer would."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from census_techniques import MATMUL_CHANGE, extra_matmul_conftest  # noqa: E402
from benchmark_scripts import ab_study  # noqa: E402  (tests/ is on sys.path): the reference wrapper
from pytest_transformers_opt.engine.ab_worker import CRASH_ENV

CANDIDATE_MATMUL_CONFTEST = extra_matmul_conftest('not sys.argv[0].endswith("ab_worker.py")')  # the candidate only

PLUS_TEST = '''
import pytest

@pytest.mark.optimization("sdpa_plus")
def test_plus(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=4)
'''



def _reference(folder: Path) -> str:
    return str(ab_study.write_wrapper(folder / "reference-python", sys.executable))


def test_ops_zero_in_the_ab_gate_regresses_naming_the_op_and_a_timed_verdict_gives_it_as_its_cause(
        run_user: Any, pytester: pytest.Pytester) -> None:
    reference = _reference(pytester.path)
    # 3 rounds a side: too few pairs for the latency threshold to be judged, so it is inconclusive, with a cause
    run = run_user(PLUS_TEST, "--opt-rounds=3", f"--opt-ab={reference}", "--opt-ab-fail=ops:0,latency:1%",
                   conftest=CANDIDATE_MATMUL_CONFTEST)
    run.result.assert_outcomes(passed=1)
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED, run.result.stdout.str()  # ops:0 regressed
    row = run.test("test_plus")
    ab = row["ab"]
    reference_census = ab["census"]["reference"]
    assert ab["census"]["why_not"] is None and reference_census is not None, ab["census"]
    # the reference ran the same configuration without the hook: no matmul there, sdpa's fused op in both
    assert "aten::matmul" not in reference_census["ops"]
    assert reference_census["ops_per_step"]["aten::scaled_dot_product_attention"] == 2
    assert row["census"]["optimized"]["ops_per_step"]["aten::matmul"] == 2
    assert ab["census_changes"] == [MATMUL_CHANGE], ab["census_changes"]

    assert ab["verdict"] == "regressed", ab
    ops_detail = next(d for d in ab["details"] if d.startswith("ops "))
    assert MATMUL_CHANGE in ops_detail and ops_detail.endswith(": regressed"), ops_detail
    verdicts = {record["metric"]: record for record in ab["judged"]}
    assert verdicts["ops"]["rule"] == "exact" and MATMUL_CHANGE in verdicts["ops"]["changes"]
    assert verdicts["latency"]["verdict"] == "inconclusive", verdicts["latency"]
    assert ab["cause"]["changed"] is True and ab["cause"]["text"].startswith(f"the census changed: {MATMUL_CHANGE}")
    run.result.stdout.fnmatch_lines([f"AB REGRESSED test_user.py::test_plus: ops *{MATMUL_CHANGE}*; "
                                     f"cause: the census changed: {MATMUL_CHANGE}*"])


def test_without_a_census_threshold_the_ab_row_still_shows_the_census_change(
        run_user: Any, pytester: pytest.Pytester) -> None:
    """Timing alone would say nothing here (one matmul of a 16-wide identity is lost in the noise); the census
    names it on the terminal, in the JSON and under the A/B line of the Markdown and HTML reports. Blocks mode:
    the reference's census is taken in its block, after its timed rounds."""
    reference = _reference(pytester.path)
    run = run_user(PLUS_TEST, "--opt-rounds=3", f"--opt-ab={reference}", "--opt-ab-mode=blocks",
                   "--opt-report-md=report.md", "--opt-report-html=report.html", conftest=CANDIDATE_MATMUL_CONFTEST)
    run.result.assert_outcomes(passed=1)
    assert run.result.ret == pytest.ExitCode.OK, run.result.stdout.str()  # no gate: the census changes fail nothing
    ab = run.test("test_plus")["ab"]
    assert ab["mode"] == "blocks" and ab["census"]["reference"] is not None, ab
    assert ab["census_changes"] == [MATMUL_CHANGE] and "verdict" not in ab, ab
    run.result.stdout.fnmatch_lines([f"AB census changed test_user.py::test_plus: {MATMUL_CHANGE}*"])
    markdown = (pytester.path / "report.md").read_text()
    assert f"  - census: {MATMUL_CHANGE.replace('>', chr(92) + '>')}" in markdown, markdown  # Markdown-inert
    html = (pytester.path / "report.html").read_text()
    assert f'<div class="ab-census">census: {MATMUL_CHANGE.replace(">", "&gt;")}</div>' in html


def test_census_off_asks_the_reference_for_none_and_a_census_threshold_has_nothing_to_compare(
        run_user: Any, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # a worker asked for a census would die without answering, failing the test
    monkeypatch.setenv(CRASH_ENV, "census:1")
    reference = _reference(pytester.path)
    run = run_user(PLUS_TEST, "--opt-rounds=3", f"--opt-ab={reference}", "--opt-ab-fail=ops:0", "--opt-census=off",
                   "--opt-report-md=report.md", conftest=CANDIDATE_MATMUL_CONFTEST)
    run.result.assert_outcomes(passed=1)
    assert run.result.ret == pytest.ExitCode.OK, run.result.stdout.str()  # inconclusive never fails a run
    ab = run.test("test_plus")["ab"]
    assert ab["census"] == {"reference": None, "why_not": "--opt-census=off"}
    assert ab["census_changes"] is None
    assert ab["verdict"] == "inconclusive", ab
    assert ab["details"][0] == ("ops not counted in the reference run: --opt-census=off; nothing to compare: "
                                "inconclusive"), ab["details"]
    markdown = (pytester.path / "report.md").read_text()
    assert "  - census: not compared (no census of the reference: --opt-census=off)" in markdown, markdown
