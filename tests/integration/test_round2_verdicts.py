"""Issue 19's wrong verdicts, as the user hit them: a sequential range too short to settle a failure,
a technique that generates fewer tokens than asked, work done in ``around_generate``, and
pytest-rerunfailures' reruns of a failing budget.
"""

from __future__ import annotations

import pytest

from pytest_transformers_opt.verdict.budgets import MEDIANS_ONLY

from slowdown import slowdown_technique

# A user's own techniques, registered the README's way.
CONFTEST = '''
import contextlib
import time

import pytest

from pytest_transformers_opt.techniques import Technique


''' + slowdown_technique("TenTimesSlower", "ten_times_slower", 9) + '''

class StopsAtTwo(Technique):
    """A technique with its own generation limit: every call stops after 2 new tokens."""
    name = "stops_at_two"
    family = "test"
    summary = "generates fewer tokens than asked"

    def configure_generation(self, gen, ctx):
        gen.kwargs["max_new_tokens"] = 2


class SleepsAround(Technique):
    """Work before and after every generate call (a setup and a teardown of its own)."""
    name = "sleeps_around"
    family = "test"
    summary = "sleeps around generate"

    @contextlib.contextmanager
    def around_generate(self, model):
        time.sleep(0.3)
        try:
            yield
        finally:
            time.sleep(0.3)


@pytest.hookimpl(optionalhook=True)
def pytest_opt_register_techniques(registry):
    registry.register(TenTimesSlower)
    registry.register(StopsAtTwo)
    registry.register(SleepsAround)
'''


def _rounds(entry: dict) -> int:
    assert entry["optimized"]["rounds"] == entry["baseline"]["rounds"]  # interleaved: one per side per round
    return entry["optimized"]["rounds"]


def _speedup_check(entry: dict) -> dict:
    return next(check for check in entry["budgets"] if check["name"] == "min_speedup")


# -- item 1: a range whose MAX cannot settle a failure ------------------------------------------------

SHORT_RANGES = '''
import pytest

@pytest.mark.optimization("ten_times_slower", min_speedup=1.0)
def test_slower_under_the_option(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("ten_times_slower", min_speedup=1.0)
def test_slower_under_its_own_range(opt_bench):
    opt_bench(max_new_tokens=4, rounds="1..2")

@pytest.mark.optimization("eager", min_speedup=1.0)
def test_null_ab(opt_bench):
    opt_bench(max_new_tokens=4)
'''


def test_a_range_too_short_to_settle_a_failure_confirms_it_as_a_fixed_count_does(run_user) -> None:
    """``--opt-rounds=3..3`` and ``rounds="1..2"``: before the fix a failure stood on the medians of 3 (or
    2) rounds with no confirmation (a null A/B failed 3 of 8). Now it is measured again, as many rounds,
    and the rule's significance test judges all of them."""
    run = run_user(SHORT_RANGES, "--opt-rounds=3..3", "--opt-warmup=0", conftest=CONFTEST)
    for name, ran in (("test_slower_under_the_option", 3), ("test_slower_under_its_own_range", 2)):
        entry = run.test(name)
        assert entry["outcome"] == "failed" and entry["failed_budgets"] == ["min_speedup"], entry["error"]
        assert "budgets failed (min_speedup) (after a second set of rounds)" in entry["error"]
        assert _rounds(entry) == 2 * ran  # the rounds the range allowed, then as many again
        note = _speedup_check(entry)["note"]
        assert note.startswith("significant (Mann-Whitney p=") and MEDIANS_ONLY not in note
        assert entry["rounds_decision"]["rounds"] == ran
        assert entry["rounds_decision"]["budgets"]["min_speedup"] == f"fails by its rule on all {2 * ran} rounds"
        assert any(n.startswith(f"sequential rounds: min_speedup failed after {ran} rounds, too few to settle a "
                                f"failure") for n in entry["notes"]), entry["notes"]
    # the same technique on both sides: whatever the noise, never a failure on the medians alone
    null = run.test("test_null_ab")
    if null["outcome"] == "failed":
        assert _rounds(null) == 6 and _speedup_check(null)["note"].startswith("significant (Mann-Whitney")
    else:
        assert null["outcome"] == "passed" and _rounds(null) in (3, 6)
    counts = run.report["summary"]
    run.result.assert_outcomes(passed=counts["passed"], failed=counts["failed"])


# -- item 2: fewer tokens than asked ------------------------------------------------------------------

FEWER_TOKENS = '''
import pytest

@pytest.mark.optimization("stops_at_two", min_speedup=1.5)
def test_generates_a_quarter(opt_bench):
    opt_bench(max_new_tokens=8)

@pytest.mark.optimization("stops_at_two", min_speedup=1.5)
def test_generates_a_quarter_without_warmup(opt_bench):
    opt_bench(max_new_tokens=8, warmup=0)

@pytest.mark.opt_baseline("eager", "stops_at_two")
@pytest.mark.optimization("sdpa")
def test_short_baseline(opt_bench):
    opt_bench(max_new_tokens=8)
'''


def test_a_technique_that_generates_fewer_tokens_than_asked_fails_naming_both_counts(run_user) -> None:
    """Before the fix a technique that stopped after 2 of 8 tokens passed min_speedup=1.5 at 3.9x, with KL
    over 4 of 16 positions. Every call must return exactly max_new_tokens; the message names the side, its
    count, the count asked for and the other side's."""
    run = run_user(FEWER_TOKENS, conftest=CONFTEST)
    run.result.assert_outcomes(failed=3)
    asked = ("returned 2 new tokens per sequence, not the 8 asked for (max_new_tokens=8; the baseline [eager] "
             "returned 8): both sides must generate exactly max_new_tokens")
    for name in ("test_generates_a_quarter", "test_generates_a_quarter_without_warmup"):
        entry = run.test(name)
        assert entry["outcome"] == "failed"
        assert "optimized generation with [eager, stops_at_two] " + asked in entry["error"]
        assert entry["speedup"] is None and entry["similarity"] is None  # no figures over different work
    short_baseline = run.test("test_short_baseline")
    assert ("baseline generation with [eager, stops_at_two] returned 2 new tokens per sequence, not the 8 asked "
            "for (max_new_tokens=8)") in short_baseline["error"]
    assert run.report["summary"]["failed"] == 3
    run.result.stdout.fnmatch_lines(["*optimized generation with ?eager, stops_at_two? returned 2 new tokens*"])


# -- item 5: work in around_generate ------------------------------------------------------------------

AROUND_GENERATE = '''
import pytest

@pytest.mark.optimization("sleeps_around", max_latency="0.5 s")
def test_sleeps_around_generate(opt_bench):
    opt_bench(max_new_tokens=4)
'''


def test_work_a_technique_does_around_generate_is_on_the_clock(run_user) -> None:
    """A technique sleeping 0.3 s before and after every generate: the user's call takes over 0.6 s, so
    max_latency="0.5 s" fails. Before the fix its context was outside the clock and the test passed at a
    few milliseconds."""
    run = run_user(AROUND_GENERATE, conftest=CONFTEST)
    run.result.assert_outcomes(failed=1)
    entry = run.test("test_sleeps_around_generate")
    assert entry["failed_budgets"] == ["max_latency"]
    assert "budgets failed (max_latency) (after a second set of rounds)" in entry["error"]
    optimized, baseline = entry["optimized"], entry["baseline"]
    assert optimized["latency_s"] >= 0.6 > baseline["latency_s"]
    assert optimized["ttft_s"] >= 0.3  # the first token comes after the work before the call
    check = next(c for c in entry["budgets"] if c["name"] == "max_latency")
    assert check["measured"] == optimized["latency_s"] and check["limit"] == 0.5


# -- item 6: pytest-rerunfailures ---------------------------------------------------------------------

RERUN = '''
import pytest

@pytest.mark.optimization("sdpa", max_latency="0.01 ms")
def test_fails_its_budget(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa")
def test_passes(opt_bench):
    opt_bench(max_new_tokens=4)
'''


def test_a_rerun_replaces_the_attempt_before_it(run_user) -> None:
    """``--reruns 2`` on a failing budget: pytest says "1 failed, 1 passed, 2 rerun". Before the fix each
    attempt became a row (``[opt_bench call N]``) and the JSON said failed: 3."""
    run = run_user(RERUN, "--reruns", "2", "--opt-report-md=opt-report.md", conftest=CONFTEST)
    assert run.result.parseoutcomes() == {"passed": 1, "failed": 1, "rerun": 2}
    assert run.report["summary"] == {"passed": 1, "failed": 1, "skipped": 0, "error": 0, "rerun": 2}
    rows = {entry["nodeid"].split("::")[-1]: entry for entry in run.report["tests"]}
    assert sorted(rows) == ["test_fails_its_budget", "test_passes"]  # one row per test, no "[opt_bench call N]"
    failed = rows["test_fails_its_budget"]
    assert failed["outcome"] == "failed" and failed["attempts"] == 3 and "call" not in failed
    assert failed["failed_budgets"] == ["max_latency"] and "budgets failed (max_latency)" in failed["error"]
    assert "attempts" not in rows["test_passes"]  # ran once
    # the terminal table has one line for it; the Markdown summary counts as pytest does
    assert "opt_bench call" not in run.result.stdout.str()
    markdown = (run.report_path.parent / "opt-report.md").read_text()
    assert "\n**1 passed, 1 failed, 0 skipped, 0 error, 2 rerun**" in markdown
