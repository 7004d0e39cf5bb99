"""Unit tests of ``--opt-ab``'s verdicts (verdict/ab.py, report/ab.py) on crafted report rows: the figures and
their words, the gate judged as ``--opt-compare-fail`` judges (threshold and significance), the metrics refused
across environments, what differs between two stacks, and the session end's lines and exit status."""

from __future__ import annotations

import copy
import statistics
from types import SimpleNamespace
from typing import Any

import pytest

from ab_reports import CANDIDATE, REFERENCE_ROUNDS, ab_record, reference_versions, report, row
from pytest_transformers_opt.errors import OptConfigError
from pytest_transformers_opt.report.ab import ab_summary, complete_ab, gate_lines, merge_ab
from pytest_transformers_opt.verdict.ab import judge_ab
from pytest_transformers_opt.verdict.compare import METRICS, parse_compare_fail
from pytest_transformers_opt.report.schema import validate_report
from pytest_transformers_opt.report.view import ab_header_lines, ab_line
from pytest_transformers_opt.report.writer import ReportWriter, session_end
from pytest_transformers_opt.verdict.ab import (AB_METRICS, IDENTICAL_STACKS, REFUSED_METRICS, ab_figures,
                                                check_ab_thresholds, stack_note, what_differs)

SLOWER = [r * 1.10 for r in REFERENCE_ROUNDS]  # the candidate 10% slower, round by round
SAME = REFERENCE_ROUNDS[5:] + REFERENCE_ROUNDS[:5]  # the same rounds in another order: a null
# Medians 8% apart, but rounds this spread apart cannot tell 8% from 5%: the machine's noise is the candidate's
# own (its rounds in another order than the reference's), so no pair tells more than the rounds do.
NOISY_REFERENCE = [0.100, 0.130, 0.070, 0.115, 0.085, 0.125, 0.075, 0.100, 0.120, 0.080]
NOISY_SLOWER = [0.140, 0.078, 0.108, 0.131, 0.083, 0.108, 0.150, 0.072, 0.125, 0.090]
# The same spread shared by both sides of each round (the machine slow or quick for a whole turn), every
# candidate round 6% to 8% slower than the reference's beside it.
SHARED_NOISE_SLOWER = [r * f for r, f in zip(NOISY_REFERENCE, (1.07, 1.065, 1.075, 1.07, 1.08, 1.06, 1.072, 1.068,
                                                              1.074, 1.066))]
# And a null: each candidate round within 1% of the reference's beside it.
SHARED_NOISE_SAME = [r * f for r, f in zip(NOISY_REFERENCE, (1.01, 0.99, 1.005, 0.995, 1.0, 1.008, 0.992, 1.003,
                                                            0.997, 1.0))]


def gate(text: str) -> list[Any]:
    return check_ab_thresholds(parse_compare_fail(text, "--opt-ab-fail"))


def judged(candidate_rounds: list[float], reference_rounds: list[float], thresholds: str, **ab: Any) -> dict[str, Any]:
    record = ab_record(reference_rounds, **ab)
    test = row("t.py::test_a", candidate_rounds, record)
    record = test["ab"]
    record["figures"] = ab_figures(test, record)
    record.update(judge_ab(test, record, gate(thresholds)))
    return record


# --------------------------------------------------------------------------- figures


def test_a_ten_percent_slower_candidate_over_ten_paired_rounds_is_slower_with_its_interval() -> None:
    test = row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS))
    figures = ab_figures(test, test["ab"])
    assert list(figures) == ["latency", "ttft", "tpot", "throughput", "peak_memory"]
    latency = figures["latency"]
    assert latency["change_pct"] == pytest.approx(10.0)
    low, high = latency["interval_pct"]
    assert low == pytest.approx(10.0) and high == pytest.approx(10.0)  # paired: every round's ratio is 1.10
    assert latency["word"] == "slower"
    assert latency["p_value"] < 0.001  # one-sided, in the direction of the change
    # the other timed figures keep no rounds: their change alone, said so
    assert figures["throughput"]["change_pct"] == pytest.approx(100 * (1 / 1.1 - 1))
    assert figures["throughput"]["interval_pct"] is None and figures["throughput"]["word"] is None
    assert "no per-round throughput samples" in figures["throughput"]["note"]
    # peak memory is read once per side: its word allows the memory budgets' slack
    assert figures["peak_memory"]["word"] == "no significant difference"


def test_a_faster_candidate_is_faster_and_the_words_of_memory() -> None:
    faster = row("t.py::test_a", [r * 0.8 for r in REFERENCE_ROUNDS], ab_record(REFERENCE_ROUNDS), memory=150 * 2**20)
    figures = ab_figures(faster, faster["ab"])
    assert figures["latency"]["word"] == "faster" and figures["latency"]["change_pct"] == pytest.approx(-20.0)
    assert figures["peak_memory"]["word"] == "larger" and figures["peak_memory"]["change_pct"] == pytest.approx(50.0)
    smaller = row("t.py::test_a", REFERENCE_ROUNDS, ab_record(REFERENCE_ROUNDS), memory=50 * 2**20)
    assert ab_figures(smaller, smaller["ab"])["peak_memory"]["word"] == "smaller"


def test_the_same_rounds_in_another_order_are_no_significant_difference() -> None:
    test = row("t.py::test_a", SAME, ab_record(REFERENCE_ROUNDS))
    latency = ab_figures(test, test["ab"])["latency"]
    assert latency["change_pct"] == pytest.approx(0.0)
    low, high = latency["interval_pct"]
    assert low <= 0.0 <= high
    assert latency["word"] == "no significant difference" and latency["p_value"] > 0.05


def test_blocks_are_resampled_side_by_side_and_too_few_rounds_fall_back_to_the_rank_test() -> None:
    blocks = row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS, mode="blocks"))
    low, high = ab_figures(blocks, blocks["ab"])["latency"]["interval_pct"]
    assert low < 10.0 < high  # each side resampled on its own: the shared round-to-round spread stays in
    few = row("t.py::test_a", SLOWER[:4], ab_record(REFERENCE_ROUNDS[:4]))
    latency = ab_figures(few, few["ab"])["latency"]
    assert latency["interval_pct"] is None and "a 95% interval needs at least 5" in latency["note"]
    assert latency["word"] == "slower"  # 4+4 separated rounds: p = 1/70 < 0.05
    edited = row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS))
    edited["optimized"]["latency_s"] = 1.0  # samples that do not give the median describe something else
    assert ab_figures(edited, edited["ab"])["latency"]["p_value"] is None


# --------------------------------------------------------------------------- the gate


def test_a_ten_percent_slower_candidate_is_regressed_at_latency_5_percent() -> None:
    record = judged(SLOWER, REFERENCE_ROUNDS, "latency:5%")
    assert record["verdict"] == "regressed"
    [judgement] = record["judged"]
    # interleaved rounds: judged on their pairs
    assert judgement["rule"] == "wilcoxon-signed-rank" and judgement["rounds"] == [10, 10]
    assert judgement["p_value"] < 0.01  # every pair +10%: ten tied differences, the normal approximation's p
    assert judgement["old"] == pytest.approx(0.1001) and judgement["new"] == pytest.approx(0.1001 * 1.1)
    # past 15% it is within the limit: the threshold is needed as well as significance
    assert judged(SLOWER, REFERENCE_ROUNDS, "latency:15%")["verdict"] == "ok"
    # and the other way round: the reference slower is an improvement
    assert judged(REFERENCE_ROUNDS, SLOWER, "latency:5%")["verdict"] == "improved"


def test_a_same_stack_null_is_ok() -> None:
    record = judged(SAME, REFERENCE_ROUNDS, "latency:5%,peak_memory:5%,kl_mean:0.01")
    assert record["verdict"] == "ok"
    assert [r["verdict"] for r in record["judged"]] == ["ok"]


def test_a_slower_median_without_significance_is_inconclusive_never_ok() -> None:
    """The medians moved past the limit but the pairs cannot say so significantly: the gate cannot vouch for the
    test (issue 40: never "ok" for what it could not see), nor fail it; it says how large a change it could see."""
    record = judged(NOISY_SLOWER, NOISY_REFERENCE, "latency:5%")
    assert record["figures"]["latency"]["change_pct"] > 5.0  # the medians moved past the limit ...
    assert record["verdict"] == "inconclusive"  # ... but not significantly
    [judgement] = record["judged"]
    assert judgement["note"] == "not significant" and judgement["rule"] == "wilcoxon-signed-rank"
    assert judgement["detectable"] > 2 * 5.0
    assert record["details"][0].endswith(f" on 10 pairs, not significant, detectable {judgement['detectable']:.3g}%: "
                                         f"inconclusive")
    test = row("t.py::test_a", NOISY_SLOWER, record)
    assert ab_line(report(test), test).endswith("; inconclusive (latency: not resolved by the rounds)")
    lines, failure = gate_lines(report(test), gate("latency:5%"), "--opt-ab-fail=latency:5%")
    assert failure is None  # inconclusive never fails a run ...
    assert any(line.startswith("AB INCONCLUSIVE t.py::test_a: latency 100.0 ms -> ") and "detectable" in line
               for line in lines)  # ... and is always listed


def test_interleaved_rounds_are_judged_on_their_pairs_where_unpaired_rounds_cannot_tell() -> None:
    """The point of the paired rule: every round 6-8% slower than the reference's beside it, under a spread of
    +-30% the two share. On the pairs the shared noise cancels and 7% is told from 5%; the same samples ranked
    unpaired (blocks mode, whose rounds are not taken in turns) cannot tell: inconclusive, with the size they could see."""
    paired = judged(SHARED_NOISE_SLOWER, NOISY_REFERENCE, "latency:5%")
    [judgement] = paired["judged"]
    assert paired["verdict"] == "regressed" and paired["figures"]["latency"]["change_pct"] == pytest.approx(6.9)
    assert judgement["rule"] == "wilcoxon-signed-rank" and judgement["rounds"] == [10, 10]
    assert judgement["p_value"] == pytest.approx(1 / 1024)  # every pair past +5%
    assert paired["details"][0] == ("latency 100.0 ms -> 106.9 ms (+6.9%, limit 5%), ratio 1.07x, Wilcoxon "
                                    f"signed-rank p=0.00098 on 10 pairs, detectable {judgement['detectable']:.3g}%: "
                                    "regressed")
    assert 5.0 < judgement["detectable"] < 6.9  # the pairs could see this change
    unpaired = judged(SHARED_NOISE_SLOWER, NOISY_REFERENCE, "latency:5%", mode="blocks")
    [judgement] = unpaired["judged"]
    assert unpaired["verdict"] == "inconclusive" and judgement["note"] == "not significant"
    assert judgement["rule"] == "mann-whitney" and judgement["p_value"] > 0.05 and judgement["rounds"] == [10, 10]
    assert judgement["detectable"] > 10.0
    assert unpaired["details"][0].endswith(f"Mann-Whitney p=0.34 on 10+10 rounds, not significant, detectable "
                                           f"{judgement['detectable']:.3g}%: inconclusive")


def test_a_null_under_shared_noise_is_ok_and_the_paired_rule_is_rendered_where_mann_whitney_is() -> None:
    null = judged(SHARED_NOISE_SAME, NOISY_REFERENCE, "latency:5%")
    assert null["verdict"] == "ok" and null["judged"][0]["rule"] == "wilcoxon-signed-rank"
    assert null["judged"][0]["p_value"] > 0.5 and null["judged"][0]["note"] is None
    # the gate's line, the report (schema-valid) and the row's line (the terminal's, the Markdown's and the HTML's)
    made = report(row("t.py::test_a", SHARED_NOISE_SLOWER, ab_record(NOISY_REFERENCE)))
    complete_ab(made, gate("latency:5%"), CANDIDATE)
    validate_report(made)
    lines, failure = gate_lines(made, gate("latency:5%"), "--opt-ab-fail=latency:5%")
    assert lines[0].startswith("AB REGRESSED t.py::test_a: latency +6.9% [")
    assert lines[0].endswith("(reference 100.0 ms, candidate 106.9 ms; limit 5%, Wilcoxon signed-rank p=0.00098 on "
                             "10 pairs)")
    assert failure is not None and ab_line(made, made["tests"][0]).endswith("; regressed")


def test_the_paired_rule_judges_an_improvement_and_mirrors_throughput() -> None:
    """The reference 6-8% slower in every pair is an improvement; throughput, higher is better, regresses when
    it falls past the limit in every pair, and improves when it rises."""
    faster = judged(NOISY_REFERENCE, SHARED_NOISE_SLOWER, "latency:5%")
    assert faster["verdict"] == "improved" and faster["judged"][0]["rule"] == "wilcoxon-signed-rank"
    assert faster["judged"][0]["p_value"] < 0.01
    # unpaired, +-30% noise cannot vouch for 5%: an improvement it cannot confirm, and blind to twice the limit
    assert judged(NOISY_REFERENCE, SHARED_NOISE_SLOWER, "latency:5%", mode="blocks")["verdict"] == "inconclusive"

    def throughput(candidate_rounds: list[float], reference_rounds: list[float], mode: str) -> dict[str, Any]:
        test = row("t.py::test_a", candidate_rounds, ab_record(reference_rounds, mode=mode))
        for side, rounds in ((test["optimized"], candidate_rounds), (test["ab"]["optimized"], reference_rounds)):
            side["throughput_samples_tok_s"] = [8 / r for r in rounds]  # 8 tokens a round
            side["throughput_tok_s"] = statistics.median(side["throughput_samples_tok_s"])
        return judge_ab(test, test["ab"], gate("throughput:5%"))

    slower = throughput(SHARED_NOISE_SLOWER, NOISY_REFERENCE, "interleaved")
    assert slower["verdict"] == "regressed" and slower["judged"][0]["rule"] == "wilcoxon-signed-rank"
    assert slower["details"][0].startswith("throughput 80.0 tok/s -> 74.8 tok/s (-6.5%, limit -5%)")
    assert throughput(SHARED_NOISE_SLOWER, NOISY_REFERENCE, "blocks")["verdict"] == "inconclusive"
    assert throughput(NOISY_REFERENCE, SHARED_NOISE_SLOWER, "interleaved")["verdict"] == "improved"
    assert throughput(SHARED_NOISE_SAME, NOISY_REFERENCE, "interleaved")["verdict"] == "ok"


def test_rounds_that_are_not_pairs_are_judged_unpaired() -> None:
    """Unequal counts (a side ran a round more), or a figure that kept fewer samples than its side ran rounds
    (TTFT where a round did not measure it: which round is unknown), are ranked unpaired."""
    unequal = judged(SHARED_NOISE_SLOWER, NOISY_REFERENCE[:9], "latency:5%")
    assert unequal["judged"][0]["rule"] == "mann-whitney" and unequal["judged"][0]["rounds"] == [9, 10]
    for kept, rule in ((10, "wilcoxon-signed-rank"), (9, "mann-whitney")):
        test = row("t.py::test_a", SHARED_NOISE_SLOWER, ab_record(NOISY_REFERENCE))
        for side, rounds in ((test["optimized"], SHARED_NOISE_SLOWER), (test["ab"]["optimized"], NOISY_REFERENCE)):
            side["ttft_samples_s"] = [r / 4 for r in rounds[:kept]]
            side["ttft_s"] = statistics.median(side["ttft_samples_s"])
        [judgement] = judge_ab(test, test["ab"], gate("ttft:5%"))["judged"]
        assert judgement["rule"] == rule and judgement["rounds"] == [kept, kept], kept


def test_fewer_than_five_pairs_are_ranked_unpaired_or_judged_by_the_medians() -> None:
    """Four pairs cannot reach p < 0.05 on their signs (1/16 at best): 4+4 rounds ranked unpaired still can
    (1/70), as before the paired rule; three, neither: the medians alone cannot say how large a change they could
    show, so a worsening past the limit is inconclusive (never "no significant difference ...; regressed")."""
    four = judged(SLOWER[:4], REFERENCE_ROUNDS[:4], "latency:5%")
    assert four["verdict"] == "regressed" and four["judged"][0]["rule"] == "mann-whitney"
    assert four["judged"][0]["rounds"] == [4, 4]
    three = judged(SLOWER[:3], REFERENCE_ROUNDS[:3], "latency:5%")
    assert three["verdict"] == "inconclusive" and three["judged"][0]["rule"] == "median"
    assert three["judged"][0]["note"] == "too few rounds (3+3) for a significance test"
    assert three["details"][0].endswith("median rule: too few rounds (3+3) for a significance test, detectable size "
                                        "unknown: inconclusive")


def test_kl_mean_is_judged_on_the_cross_environment_similarity() -> None:
    drifted = judged(SAME, REFERENCE_ROUNDS, "kl_mean:0.01", kl_mean=0.05)
    assert drifted["verdict"] == "regressed"
    assert any(d.startswith("kl_mean 0 -> 0.05") and d.endswith(": regressed") for d in drifted["details"])
    assert judged(SAME, REFERENCE_ROUNDS, "kl_mean:0.01", kl_mean=0.001)["verdict"] == "ok"
    assert judged(SAME, REFERENCE_ROUNDS, "top1:0.05", top1=0.9)["verdict"] == "regressed"


def test_the_median_rule_says_which_side_in_the_ab_words() -> None:
    record = judged(SLOWER, REFERENCE_ROUNDS, "ttft:5%")
    assert record["verdict"] == "inconclusive"  # no rounds in one job: nothing says what the medians could show
    assert record["judged"][0]["note"] == "the reference side keeps no per-round ttft samples"
    test = row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS))
    test["ab"]["optimized"] = None
    assert judge_ab(test, test["ab"], gate("latency:5%")) == {
        "verdict": "not judged", "details": ["no measurement on the reference side"]}


@pytest.mark.parametrize("metric", REFUSED_METRICS)
def test_speedup_and_memory_ratio_are_refused_across_environments(metric: str) -> None:
    with pytest.raises(OptConfigError) as info:
        gate(f"latency:5%,{metric}:10%")
    message = str(info.value)
    assert message.startswith(f"--opt-ab-fail: '{metric}:10%' cannot be judged across environments: ")
    assert "baseline" in message and message.endswith("accepted: " + ", ".join(AB_METRICS))
    with pytest.raises(OptConfigError, match="^opt_ab_fail: "):
        check_ab_thresholds(parse_compare_fail(f"{metric}:1"), where="opt_ab_fail")


def test_every_other_metric_of_the_comparison_is_accepted() -> None:
    assert sorted(AB_METRICS) == sorted(m for m in METRICS if m not in REFUSED_METRICS)
    assert [t.metric for t in gate(",".join(f"{m}:1%" for m in AB_METRICS))] == list(AB_METRICS)


# --------------------------------------------------------------------------- what differs


def test_what_differs_names_only_the_packages_whose_versions_differ() -> None:
    candidate = {"torch": "2.13.0", "transformers": "5.24.0", "kernels": None}
    reference = {"torch": "2.13.0", "transformers": "5.22.0", "kernels": "0.10.0"}
    assert what_differs(candidate, reference) == {"transformers": ["5.24.0 (candidate)", "5.22.0 (reference)"],
                                                  "kernels": ["not installed (candidate)", "0.10.0 (reference)"]}
    assert stack_note(candidate, reference) is None
    assert what_differs(candidate, dict(candidate)) == {}
    assert stack_note(candidate, dict(candidate)) == IDENTICAL_STACKS
    assert stack_note({}, reference) is None  # nothing reported by both: nothing to tell


# --------------------------------------------------------------------------- the report and the session end


def test_complete_ab_fills_the_rows_and_the_top_level_and_stays_schema_valid() -> None:
    bumped = ab_record(REFERENCE_ROUNDS, versions=reference_versions(transformers="5.22.0"))
    made = report(row("t.py::test_a", SLOWER, bumped), row("t.py::test_b", REFERENCE_ROUNDS, None))
    top = complete_ab(made, gate("latency:5%"), CANDIDATE)
    assert top is made["ab"]
    assert top["differs"] == {"transformers": ["5.24.0 (candidate)", "5.22.0 (reference)"]}
    assert top["note"] is None and top["thresholds"] == "latency:5%"
    assert top["summary"] == {"regressed": 1, "inconclusive": 0, "improved": 0, "ok": 0, "not comparable": 0, "not judged": 0}
    assert made["tests"][0]["ab"]["verdict"] == "regressed" and made["tests"][0]["ab"]["note"] is None
    assert "ab" not in made["tests"][1]
    validate_report(made)
    line = ab_line(made, made["tests"][0])
    assert line.startswith("candidate (transformers 5.24.0) vs reference (transformers 5.22.0): latency +10.0% "
                           "[+10.0%, +10.0%] slower, TTFT +10.0%, ")
    assert line.endswith(", peak memory +0.0% no significant difference, KL mean 0.0005, top-1 100.0%; regressed")
    assert ab_header_lines(made) == [
        "candidate /venv/candidate/bin/python vs reference /venv/reference/bin/python",
        "what differs: transformers 5.24.0 (candidate) / 5.22.0 (reference)",
        "--opt-ab-fail=latency:5%: 1 regressed, 0 inconclusive, 0 improved, 0 ok, 0 not comparable, 0 not judged"]
    # without thresholds: figures and stacks, no verdict; completing again replaces what was there
    complete_ab(made, (), CANDIDATE)
    assert "verdict" not in made["tests"][0]["ab"] and made["ab"]["thresholds"] is None
    assert ab_summary(made) == {"regressed": 0, "inconclusive": 0, "improved": 0, "ok": 0, "not comparable": 0, "not judged": 1}
    assert complete_ab(report(row("t.py::test_b", SLOWER, None)), gate("latency:5%"), CANDIDATE) is None


def test_an_ab_of_two_identical_stacks_says_so() -> None:
    made = report(row("t.py::test_a", SAME, ab_record(REFERENCE_ROUNDS)))
    top = complete_ab(made, (), CANDIDATE)
    assert top is not None and top["note"] == IDENTICAL_STACKS and top["differs"] == {}
    assert made["tests"][0]["ab"]["note"] == IDENTICAL_STACKS
    assert ab_line(made, made["tests"][0]).startswith("candidate vs reference (identical stacks): latency +0.0% ")
    assert ab_header_lines(made)[1].startswith("what differs: nothing (identical stacks)")


def test_the_gate_lines_name_each_regressed_test_with_its_interval_limit_and_p_value() -> None:
    made = report(row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS, versions=reference_versions(torch="2.12.0"))),
                  row("t.py::test_b", SAME, ab_record(REFERENCE_ROUNDS, versions=reference_versions(torch="2.12.0"))))
    thresholds = gate("latency:5%")
    complete_ab(made, thresholds, CANDIDATE)
    lines, failure = gate_lines(made, thresholds, "--opt-ab-fail=latency:5%")
    assert lines[0].startswith("AB REGRESSED t.py::test_a: latency +10.0% [+10.0%, +10.0%] (reference 100.1 ms, "
                               "candidate 110.1 ms; limit 5%, Wilcoxon signed-rank p=0.0014 on 10 pairs)")
    assert lines[1:] == ["A/B: 1 regressed, 0 inconclusive, 0 improved, 1 ok, 0 not comparable, 0 not judged (--opt-ab-fail=latency:5% against the "
                         "reference /venv/reference/bin/python)"]
    assert failure == ("1 test regressed past --opt-ab-fail=latency:5% against the reference "
                       "/venv/reference/bin/python: the run fails")


def test_a_gate_with_no_ab_record_or_nothing_judged_fails_saying_why() -> None:
    thresholds = gate("latency:5%")
    lines, failure = gate_lines(report(row("t.py::test_a", SLOWER, None)), thresholds, "--opt-ab-fail=latency:5%")
    assert lines == ["A/B: 0 regressed, 0 inconclusive, 0 improved, 0 ok, 0 not comparable, 0 not judged (--opt-ab-fail=latency:5%)"]
    assert failure == ("--opt-ab-fail=latency:5%: no test has an A/B record (1 test measured, none in the reference "
                       "environment): the run fails")
    nothing = gate_lines(report(), thresholds, "G")[1]
    assert nothing == "G: no test has an A/B record (no test used opt_bench): the run fails"
    unmeasured = report(row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS)))
    unmeasured["tests"][0]["ab"]["optimized"] = None
    complete_ab(unmeasured, thresholds, CANDIDATE)
    assert gate_lines(unmeasured, thresholds, "G")[1] == ("G: no test could be judged (no measurement on the "
                                                          "reference side): the run fails")


class _Reporter:
    verbosity = -2  # -qq: the gate's lines are said all the same

    def __init__(self) -> None:
        self.lines: list[tuple[str, bool]] = []

    def write_line(self, line: str, red: bool = False) -> None:
        self.lines.append((line, red))

    def write_sep(self, sep: str, title: str) -> None:
        self.lines.append((title, False))


def _writer(made: dict[str, Any], ab_fail: str | None, *, report_on: bool = False) -> ReportWriter:
    """A ReportWriter over a stand-in session whose report is ``made`` (built already)."""
    # as options.Settings holds them: the text as set, where it was set, and the parsed thresholds
    settings = SimpleNamespace(ab_fail=ab_fail, ab_thresholds=gate(ab_fail) if ab_fail else [],
                               sources={"ab_fail": "--opt-ab-fail"}, report=report_on,
                               report_json=None, report_md=None, report_html=None, history=None,
                               compare=None, compare_report=None, trace="off", census=True)
    config = SimpleNamespace(stash=pytest.Stash(),
                             hook=SimpleNamespace(pytest_opt_report_extra=SimpleNamespace(get_hookimpls=list)))
    session = SimpleNamespace(settings=settings, config=config, is_xdist_worker=False, records={"t": None},
                              worker_entries={}, ab_candidate=CANDIDATE)
    writer = ReportWriter(session)  # type: ignore[arg-type]  # a stand-in session
    writer._ab(made)
    end = session_end(config)  # type: ignore[arg-type]  # its stand-in config
    end.built, end.report = True, made
    return writer


def test_the_session_end_fails_the_run_and_prints_the_lines_in_every_verbosity_mode() -> None:
    made = report(row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS)))
    writer = _writer(made, "latency:5%")
    assert made["ab"]["summary"]["regressed"] == 1
    assert writer.finish(pytest.ExitCode.OK) == pytest.ExitCode.TESTS_FAILED
    reporter = _Reporter()
    writer.terminal(reporter)
    printed = [line for line, _ in reporter.lines]
    assert printed[0].startswith("AB REGRESSED t.py::test_a: latency +10.0% [+10.0%, +10.0%]")
    assert printed[1].startswith("A/B: 1 regressed, 0 inconclusive, 0 improved, 0 ok, 0 not comparable, 0 not judged (--opt-ab-fail=latency:5% ")
    assert reporter.lines[2] == ("transformers-opt: 1 test regressed past --opt-ab-fail=latency:5% against the "
                                 "reference /venv/reference/bin/python: the run fails", True)
    # a null passes, and a failing exit status stays what it was
    assert _writer(report(row("t.py::test_a", SAME, ab_record(REFERENCE_ROUNDS))), "latency:5%").finish(
        pytest.ExitCode.OK) == pytest.ExitCode.OK
    assert _writer(copy.deepcopy(made), "latency:5%").finish(pytest.ExitCode.INTERRUPTED) == pytest.ExitCode.INTERRUPTED


def test_the_session_end_fails_a_gate_without_ab_records_and_reports_without_a_gate() -> None:
    writer = _writer(report(row("t.py::test_a", SLOWER, None)), "latency:5%")
    assert writer.finish(pytest.ExitCode.OK) == pytest.ExitCode.TESTS_FAILED
    reporter = _Reporter()
    writer.terminal(reporter)
    assert reporter.lines[-1][0].endswith("no test has an A/B record (1 test measured, none in the reference "
                                          "environment): the run fails")
    # --opt-ab without a gate: the records are completed, nothing fails, the --opt-report section shows them
    made = report(row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS, versions=reference_versions(torch="2.12.0"))))
    writer = _writer(made, None, report_on=True)
    assert made["ab"]["thresholds"] is None and writer.finish(pytest.ExitCode.OK) == pytest.ExitCode.OK
    reporter = _Reporter()
    writer.terminal(reporter)
    printed = [line for line, _ in reporter.lines]
    start = printed.index("A/B against another environment:")
    assert printed[start + 1:start + 4] == [
        "  candidate /venv/candidate/bin/python vs reference /venv/reference/bin/python",
        "  what differs: torch 2.13.0 (candidate) / 2.12.0 (reference)",
        "  test_a: candidate (torch 2.13.0) vs reference (torch 2.12.0): latency +10.0% [+10.0%, +10.0%] slower, "
        "TTFT +10.0%, TPOT +10.0%, throughput -9.1%, peak memory +0.0% no significant difference, KL mean 0.0005, "
        "top-1 100.0%"]
    assert not any(red for _, red in reporter.lines)


def test_merging_keeps_the_first_stacks_and_says_where_the_shards_differ() -> None:
    one = {"candidate": CANDIDATE, "reference": {"python": "/r1", "versions": {"torch": "2.12.0"}},
           "differs": {}, "note": None, "thresholds": "latency:5%", "summary": {}}
    two = {**one, "reference": {"python": "/r2", "versions": {"torch": "2.11.0"}}, "thresholds": None}
    rows = [row("a.py::t", SLOWER, ab_record(REFERENCE_ROUNDS))]
    merged = merge_ab([("a.json", one), ("b.json", None), ("c.json", two)], rows)
    assert merged is not None and merged["reference"] == one["reference"]
    assert merged["merge_note"] == ("the shards' references differ: /r1 (torch 2.12.0) in a.json; /r2 (torch 2.11.0) "
                                    "in c.json; the shards' --opt-ab-fail thresholds differ: latency:5% / none")
    assert merged["summary"] == {"regressed": 0, "inconclusive": 0, "improved": 0, "ok": 0, "not comparable": 0, "not judged": 1}
    same = merge_ab([("a.json", one), ("c.json", copy.deepcopy(one))], rows)
    assert same is not None and same["merge_note"] is None
    assert merge_ab([("a.json", None)], rows) is None


def test_an_oversubscribed_machine_is_said_in_the_notes_and_a_quiet_one_is_not() -> None:
    """Above one runnable process per core the scheduler favours the worker that ran least (the reference's,
    idle between turns): the test's notes say so, with the load and the cores; at or below, nothing."""
    from pytest_transformers_opt.verdict.reference_side import oversubscribed_note

    note = oversubscribed_note({"load_average": [1.2, 7.9], "cores": 2})
    assert note is not None and "load average 7.9 on 2 cores" in note and "reference's figures may look faster" in note
    assert oversubscribed_note({"load_average": [1.2, 2.0], "cores": 2}) is None
    assert oversubscribed_note({"load_average": None, "cores": 2}) is None
    assert oversubscribed_note(None) is None


def test_ttft_tpot_and_throughput_get_intervals_and_the_rank_test_from_their_per_round_samples() -> None:
    """Each side keeps every round's TTFT, TPOT and throughput: the A/B words and the gate use them as they use
    the latency rounds (a 10% slower TTFT in every round regresses at ttft:5% by the sample rule)."""
    candidate, reference = row("t.py::test_a", SLOWER, ab_record(REFERENCE_ROUNDS)), ab_record(REFERENCE_ROUNDS)
    for side, rounds in ((candidate["optimized"], SLOWER), (reference["optimized"], REFERENCE_ROUNDS)):
        side["ttft_samples_s"] = [r / 8 for r in rounds]
        side["tpot_samples_s"] = [r / 10 for r in rounds]
        side["throughput_samples_tok_s"] = [8 / r for r in rounds]
        side["ttft_s"], side["tpot_s"] = side["latency_s"] / 8, side["latency_s"] / 10
        side["throughput_tok_s"] = 8 / side["latency_s"]
    candidate["ab"] = reference
    figures = ab_figures(candidate, reference)
    for metric, word in (("ttft", "slower"), ("tpot", "slower"), ("throughput", "faster")):
        record = figures[metric]
        assert record["note"] is None and record["interval_pct"] is not None, (metric, record)
        assert record["p_value"] < 0.01
    assert figures["ttft"]["interval_pct"] == pytest.approx([10.0, 10.0])  # paired: every round 10% slower
    assert figures["throughput"]["word"] == "slower"  # throughput fell: the slower word for a higher-is-better figure
    candidate["ab"]["figures"] = figures
    verdict = judge_ab(candidate, candidate["ab"], gate("ttft:5%,throughput:5%"))
    assert verdict["verdict"] == "regressed"
    notes = [judged["note"] for judged in verdict["judged"]]
    assert all(note is None or "per-round" not in note for note in notes), notes
