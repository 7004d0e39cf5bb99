"""--opt-compare-fail on real sessions judges timed figures on both runs' rounds and the between-run term of two
jobs: noise is inconclusive (never a failure, never a silent pass), a slowdown past the two jobs' error fails.

The test's optimized side is padded to a fixed time per forward pass, so its rounds are steady on a busy
machine; the earlier reports are a reference run's own report with its rounds replaced by the rounds a
noisy (or a faster) earlier run would have written around the reference's median, the latency kept the
median of those rounds. Built around the median, not from the reference's rounds, so that one slow round
of the reference (this machine is shared) does not decide the test.
"""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from slowdown import sleepy_conftest  # tests/ is on sys.path

SLEEPY = sleepy_conftest()

TEST = '''
import pytest

@pytest.mark.optimization("sleepy")
def test_sleepy(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=3)
'''

ROUNDS = "--opt-rounds=6"


def _earlier(report: dict[str, Any], path: Path, samples: list[float]) -> str:
    """The report with the optimized rounds replaced (and the latency their median, as the plugin writes it)."""
    edited = copy.deepcopy(report)
    optimized = edited["tests"][0]["optimized"]
    optimized["latency_samples_s"] = samples
    optimized["latency_s"] = statistics.median(samples) if samples else optimized["latency_s"]
    path.write_text(json.dumps(edited))
    return str(path)


@pytest.fixture()
def reference(run_user: Any) -> dict[str, Any]:
    run = run_user(TEST, ROUNDS, conftest=SLEEPY)
    assert run.result.ret == pytest.ExitCode.OK
    return copy.deepcopy(run.report)


def _judged(run: Any) -> dict[str, Any]:
    (judged,) = run.test("test_sleepy")["regression"]["judged"]
    return judged  # type: ignore[no-any-return]


def _median(report: dict[str, Any]) -> float:
    return float(report["tests"][0]["optimized"]["latency_s"])


def test_a_noisy_null_is_inconclusive_and_listed_in_every_verbosity(run_user: Any, reference: dict[str, Any],
                                                                     pytester: pytest.Pytester) -> None:
    """An earlier run of the same test with three rounds 70% faster and one a huge outlier: its median is
    >10% below this run's, its other rounds are this run's. (70%, not 40%: the reference session ran minutes
    before this one, and under the suite's load this run once read 19% faster than it, a ratio of 1.007.)"""
    median = _median(reference)
    noisy = [0.3 * median, 0.303 * median, 0.306 * median, median, 1.01 * median, 20 * median]
    earlier = _earlier(reference, pytester.path / "noisy.json", noisy)
    run = run_user(TEST, ROUNDS, "-q", f"--opt-compare={earlier}", "--opt-compare-fail=latency:10%")
    judged = _judged(run)
    assert judged["ratio"] > 1.1  # the median-only rule would have failed this run
    assert judged["rule"] == "between-run" and judged["p_value"] >= 0.05 and judged["note"] == "not significant"
    assert judged["verdict"] == "inconclusive" and judged["detectable"] > 20
    assert run.result.ret == pytest.ExitCode.OK  # inconclusive never fails the run ...
    run.result.stdout.fnmatch_lines([  # ... and is said under -q, with the size the two jobs could have seen
        "INCONCLUSIVE *test_sleepy: latency * (+*%, limit 10%), ratio *x, between-run p=* on 6+6 rounds, not "
        "significant, with the CPU default between runs (10% a figure, 3% a speedup), detectable *%; cause: the "
        "census did not change*",
        "compare: 0 regressed, 1 inconclusive, 0 improved, 0 ok*"])


def test_a_real_slowdown_fails(run_user: Any, reference: dict[str, Any], pytester: pytest.Pytester) -> None:
    """An earlier run twice as fast in every round: this run is slower past the limit, significantly. (Twice,
    not 25%: the reference session ran minutes before this one on a shared machine, and a busy spell during
    it once made this run's rounds faster than the reference's median / 1.25 x 1.10.)"""
    faster = [_median(reference) / 2 * spread for spread in (0.98, 0.99, 1.0, 1.0, 1.01, 1.02)]
    earlier = _earlier(reference, pytester.path / "faster.json", faster)
    run = run_user(TEST, ROUNDS, f"--opt-compare={earlier}", "--opt-compare-fail=latency:10%")
    judged = _judged(run)
    assert judged["rule"] == "between-run" and judged["p_value"] < 0.05 and judged["verdict"] == "regressed"
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED
    run.result.stdout.fnmatch_lines(["REGRESSED *test_sleepy: latency * (+*%, limit 10%), ratio *x, "
                                     "between-run p=* on 6+6 rounds, with the CPU default between runs *",
                                     "*1 test regressed past --opt-compare-fail=latency:10%*: the run fails"])


def test_an_old_report_without_samples_falls_back_to_the_median_rule_and_says_so(
        run_user: Any, reference: dict[str, Any], pytester: pytest.Pytester) -> None:
    edited = copy.deepcopy(reference)
    edited["tests"][0]["optimized"]["latency_s"] /= 2  # twice as fast: a reference minutes old drifts (see above)
    earlier = _earlier(edited, pytester.path / "old.json", [])  # written before reports kept rounds
    run = run_user(TEST, ROUNDS, f"--opt-compare={earlier}", "--opt-compare-fail=latency:10%")
    judged = _judged(run)
    assert judged["rule"] == "median" and judged["p_value"] is None
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED
    run.result.stdout.fnmatch_lines([
        "REGRESSED *test_sleepy: latency * (+*%, limit 10%), ratio *x, "
        "median rule: the old report keeps no per-round latency samples, with the CPU default between runs (10% a "
        "figure, 3% a speedup), detectable 33.3%; cause: the census did not change*",
        "median rule (1 test): latency: the old report keeps no per-round latency samples"])
