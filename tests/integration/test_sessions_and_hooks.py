"""Loads once per configuration, baseline once per workload, hooks, budgets message, report files."""

from __future__ import annotations

import json

COUNTING_CONFTEST = '''
import json
import pytest
from pytest_transformers_opt.session import SESSION_KEY

@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    opt = session.config.stash[SESSION_KEY]
    with open("counts.json", "w") as handle:
        json.dump({"loads": [list(map(str, key[1])) for key in opt.models.loads],
                   "reference_runs": opt.reference_run_count}, handle)
'''


def test_one_load_per_configuration_and_one_baseline_run_per_workload(run_user, pytester):
    run = run_user('''
import pytest

@pytest.mark.optimization("sdpa")
def test_a(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa", max_kl=0.5)
def test_b_same_config(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("static_cache")
def test_c_generation_time_technique_shares_the_baseline_weights(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa")
def test_d_other_workload(opt_bench):
    opt_bench(max_new_tokens=6)
''', conftest=COUNTING_CONFTEST)
    run.result.assert_outcomes(passed=4)
    counts = json.loads((pytester.path / "counts.json").read_text())
    # eager baseline weights once, sdpa weights once; static_cache reuses the eager weights
    assert sorted(counts["loads"]) == [["eager"], ["sdpa"]]
    # one reference run for max_new_tokens=4 (shared by a, b, c), one for 6
    assert counts["reference_runs"] == 2


REGISTER_CONFTEST = '''
from pytest_transformers_opt.techniques import Technique

class NoRepeat(Technique):
    name = "no_repeat_bigrams"
    family = "generation"
    summary = "forbid repeated bigrams"

    def configure_generation(self, gen, ctx):
        gen.kwargs["no_repeat_ngram_size"] = 2

class SilentFallback(Technique):
    name = "pretend_fast"
    family = "generation"
    summary = "claims an effect that never happens"

    def verify_run(self, model, evidence):
        return "pretend_fast did not run its kernel"

def pytest_opt_register_techniques(registry):
    registry.register(NoRepeat)
    registry.register(SilentFallback)
'''


def test_project_techniques_through_the_hook(run_user):
    run = run_user('''
import pytest

@pytest.mark.optimization("no_repeat_bigrams", min_token_match=0.0, max_kl=100)
def test_custom(opt_bench):
    result = opt_bench(max_new_tokens=12)
    assert result.optimized.tokens_generated == 3 * 12
    # the tiny model repeats itself greedily; forbidding repeated bigrams must change its output
    assert result.optimized.texts != result.baseline.texts
    assert result.similarity.token_match < 1.0

@pytest.mark.optimization("pretend_fast")
def test_fallback_is_caught(opt_bench):
    opt_bench(max_new_tokens=4)
''', conftest=REGISTER_CONFTEST)
    run.result.assert_outcomes(passed=1, failed=1)
    run.result.stdout.fnmatch_lines(["*silent fallback: pretend_fast did not run its kernel*"])
    assert run.test("test_custom")["techniques"] == ["no_repeat_bigrams"]


def test_a_budget_failure_lists_every_budget(run_user):
    run = run_user('''
import pytest

@pytest.mark.optimization("sdpa", max_latency="1 us", max_memory="10 GiB", min_top1=0.5)
def test_too_tight(opt_bench):
    opt_bench(max_new_tokens=4)
''')
    run.result.assert_outcomes(failed=1)
    run.result.stdout.fnmatch_lines([
        "*budgets failed (max_latency) (after a second set of rounds) for [[]sdpa[]] vs baseline [[]eager[]] on tiny-random-llama:",
        "*budget*measured*limit*verdict*source*",
    ])
    out = run.result.stdout.str()
    for line_start in ("min_token_match", "max_kl", "max_latency", "max_memory", "min_top1"):
        assert any(line.startswith(line_start) for line in out.splitlines()), line_start
    assert "FAILED   marker" in out or "FAILED  marker" in out
    entry = run.test("test_too_tight")
    assert entry["failed_budgets"] == ["max_latency"]
    assert {b["name"]: b["source"] for b in entry["budgets"]}["max_kl"] == "default"


def test_warn_and_off_modes(run_user):
    source = '''
import pytest

@pytest.mark.optimization("sdpa", max_latency="1 us")
def test_too_tight(opt_bench):
    opt_bench(max_new_tokens=4)
'''
    warn = run_user(source, "--opt-budgets=warn")
    warn.result.assert_outcomes(passed=1)
    assert warn.test("test_too_tight")["failed_budgets"] == ["max_latency"]
    off = run_user(source, "--opt-budgets=off")
    off.result.assert_outcomes(passed=1)
    assert off.test("test_too_tight")["budgets"] == []


def test_report_terminal_json_markdown_html(run_user, pytester, monkeypatch):
    from pytest_transformers_opt.report.schema import validate_report

    summary = pytester.path / "step-summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    run = run_user('''
import pytest

@pytest.mark.optimization("static_cache", "sdpa")
def test_fast(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("flash_attention_2")
def test_gpu(opt_bench):
    opt_bench()
''', "--opt-report", f"--opt-report-md={pytester.path / 'r.md'}", f"--opt-report-html={pytester.path / 'r.html'}")
    run.result.assert_outcomes(passed=1, skipped=1)
    run.result.stdout.fnmatch_lines([
        "*transformers optimization report*",
        "test*techniques*outcome*TTFT ms opt/base*TPOT ms opt/base*tok/s opt/base*speedup*peak mem opt/base*"
        "mem ratio*token match*KL mean*top-1*failed budgets*",
        "test_fast*static_cache, sdpa*passed*",
        "*test_gpu: flash_attention_2 needs a CUDA GPU*",
    ])
    report = run.report
    validate_report(report)
    assert report["summary"] == {"passed": 1, "failed": 0, "skipped": 1, "error": 0}
    assert report["environment"]["torch"] and report["environment"]["transformers"]
    markdown = (pytester.path / "r.md").read_text()
    assert "test_fast" in markdown and "flash_attention_2 needs a CUDA GPU" in markdown
    assert summary.read_text().strip() == markdown.strip()
    html = (pytester.path / "r.html").read_text()
    assert "<svg" in html and "test_fast" in html
    fast = run.test("test_fast")  # 2 rounds (the suite's quick setting): too few for an interval, and said so
    assert fast["speedup_interval"] is None and fast["speedup_verdict"] is None
    assert "needs at least 5" in fast["speedup_interval_note"]


def test_speedup_and_memory_ratio_carry_their_interval_and_verdict_in_every_format(run_user, pytester):
    from pytest_transformers_opt.verdict.results import MEMORY_VERDICTS, SPEEDUP_VERDICTS

    run = run_user('''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=4)
''', "--opt-rounds=5", "--opt-report", f"--opt-report-md={pytester.path / 'r.md'}",
                   f"--opt-report-html={pytester.path / 'r.html'}")
    run.result.assert_outcomes(passed=1)
    test = run.test("test_sdpa")
    low, high = test["speedup_interval"]
    assert low <= test["speedup"] <= high
    expected = "faster" if low > 1.0 else "slower" if high < 1.0 else "no significant difference"
    assert test["speedup_verdict"] == expected and expected in SPEEDUP_VERDICTS
    assert test["speedup_interval_note"] is None
    assert test["memory_ratio_interval"] is None and "read once per side" in test["memory_ratio_interval_note"]
    assert test["memory_ratio_verdict"] in MEMORY_VERDICTS
    shown = f"[{low:.2f}-{high:.2f}]"
    short = "n.s." if expected == "no significant difference" else expected
    row = next(line for line in run.result.stdout.lines if line.startswith("test_sdpa "))
    assert f"{shown} {short}" in row  # the terminal table
    markdown = (pytester.path / "r.md").read_text()
    assert shown.replace("[", "\\[").replace("]", "\\]") + f" {expected}" in markdown
    html = (pytester.path / "r.html").read_text()
    assert f'<span class="reason">{shown} {expected}</span>' in html and 'class="whisker"' in html
