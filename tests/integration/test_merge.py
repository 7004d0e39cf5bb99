"""``pytest-opt merge`` end to end: shards run as separate pytest sessions (one under ``-n 2``) merge into
the rows of one unsharded run; duplicates are errors naming both files; the same test on two hardware
types stays two rows; a merged report gates with ``--opt-compare`` and with ``merge --compare``; bad
input files are one line and exit status 2.

The four sessions (one unsharded, three shards) run once per module: the first test that needs them
runs them and keeps their reports in a module-wide folder.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest

from pytest_transformers_opt import files
from pytest_transformers_opt.cli import main
from pytest_transformers_opt.report.schema import validate_report

from conftest import FAST_ARGS

USER_TESTS = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=2)

@pytest.mark.optimization("static_cache")
def test_static_cache(opt_bench):
    opt_bench(max_new_tokens=2)

@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.optimization("sdpa")
def test_lengths(opt_bench, tokens):
    opt_bench(max_new_tokens=tokens)

@pytest.mark.optimization("sdpa")
def test_two_calls(opt_bench):
    opt_bench(max_new_tokens=1)
    opt_bench(max_new_tokens=2)

@pytest.mark.optimization("sdpa", max_latency="1 ns")
def test_over_budget(opt_bench):
    opt_bench(max_new_tokens=1)

@pytest.mark.optimization("flash_attention_2")
def test_needs_a_gpu(opt_bench):
    opt_bench(max_new_tokens=1)
'''

CHEAP = (*FAST_ARGS, "--opt-rounds=1", "--opt-warmup=0", "-p", "no:randomly")
SHARD_1 = ("test_user.py::test_sdpa", "test_user.py::test_static_cache")
SHARD_2 = ("test_user.py::test_lengths", "test_user.py::test_two_calls")  # under xdist: one worker (two: xdist_run)
SHARD_3 = ("-k", "over_budget or needs_a_gpu")
H200 = "NVIDIA H200"
COMPARED = ("nodeid", "outcome", "techniques", "baseline_techniques", "model", "hardware", "call", "failed_budgets",
            "skip_reason")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shard reports are kept: under pytest-xdist one folder for the session's workers (the
    session's base temp folder is theirs alone), so they are made once, not once per worker."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.mktemp("merge-runs")
    shared = tmp_path_factory.getbasetemp().parent / "merge-runs"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture
def runs(pytester: pytest.Pytester, store: Path) -> dict[str, Path]:
    """full.json (every test in one session) and shard1..3.json, made by the first test that asks."""
    paths = {name: store / f"{name}.json" for name in ("full", "shard1", "shard2", "shard3")}
    with open(store / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other xdist worker waits for them, then reads them
        if not all(path.exists() for path in paths.values()):
            _make_runs(pytester, paths)
    return paths


def _make_runs(pytester: pytest.Pytester, paths: dict[str, Path]) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    sessions = {"full": (pytester.runpytest, ()), "shard1": (pytester.runpytest, SHARD_1),
                "shard2": (pytester.runpytest_subprocess, ("-n", "1", *SHARD_2)),
                "shard3": (pytester.runpytest, SHARD_3)}
    for name, (run, selection) in sessions.items():
        written = pytester.path / f"{name}.json"
        result = run(*CHEAP, f"--opt-report-json={written}", *selection)
        assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
        assert written.exists(), result.stdout.str()
        shutil.copy(written, paths[name])


def merge(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main(["merge", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def read(path: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(path.read_text())
    validate_report(report)
    return report


def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """What a merge must keep of each row (not the timings), in the report's order."""
    return [{key: test.get(key) for key in COMPARED} for test in report["tests"]]


def with_hardware(source: Path, target: Path, hardware: str) -> Path:
    """A copy of a report as if its run had been on other hardware."""
    report = json.loads(source.read_text())
    report["environment"]["hardware"] = hardware
    for test in report["tests"]:
        test["hardware"] = hardware
    target.write_text(json.dumps(report))
    return target


def scaled(report: dict[str, Any], factor: float, nodeid: str | None = None,
           hardware: str | None = None) -> dict[str, Any]:
    """A copy with the optimized latency (its per-round samples too) scaled, for the rows that match."""
    report = copy.deepcopy(report)
    for test in report["tests"]:
        if (nodeid and test["nodeid"] != nodeid) or (hardware and test["hardware"] != hardware):
            continue
        optimized = test["optimized"]
        if optimized is None:
            continue
        optimized["latency_samples_s"] = [v * factor for v in optimized["latency_samples_s"]]
        optimized["latency_s"] = statistics.median(optimized["latency_samples_s"])
    return report


def test_three_shards_merge_into_the_rows_of_one_unsharded_run(runs, capsys, tmp_path):
    full = read(runs["full"])
    assert len(full["tests"]) == 8 and full["summary"]["failed"] == 1 and full["summary"]["skipped"] == 1
    shards = [read(runs[f"shard{n}"]) for n in (1, 2, 3)]
    assert [len(s["tests"]) for s in shards] == [2, 4, 2]
    merged_path, md, html = tmp_path / "merged.json", tmp_path / "merged.md", tmp_path / "merged.html"
    code, out, err = merge(capsys, runs["shard3"], runs["shard1"], runs["shard2"], "-o", merged_path,
                           "--md", md, "--html", html)
    assert (code, err) == (0, "")
    assert out.splitlines() == [f"merging 3 reports into {merged_path} ...",
                                f"wrote {merged_path} (8 tests from 3 shards)"]
    merged = read(merged_path)
    assert rows(merged) == rows(full)  # test by test, in the unsharded run's order
    assert merged["summary"] == full["summary"]
    assert all(isinstance(t["hardware"], str) and t["hardware"] for t in merged["tests"])
    # each shard keeps its own run: where it came from, its environment, settings and summary
    assert [s["source"] for s in merged["shards"]] == [str(runs[f"shard{n}"]) for n in (3, 1, 2)]
    assert [s["summary"] for s in merged["shards"]] == [shards[2]["summary"], shards[0]["summary"],
                                                         shards[1]["summary"]]
    assert merged["shards"][0]["environment"] == shards[2]["environment"] == merged["environment"]
    assert merged["settings"] == shards[2]["settings"]
    source_of = {t["nodeid"]: n for n, s in enumerate((shards[2], shards[0], shards[1])) for t in s["tests"]}
    assert {t["nodeid"]: t["shard"] for t in merged["tests"]} == source_of
    # the figures are the shard's own, untouched
    by_id = {t["nodeid"]: t for t in shards[1]["tests"]}
    for test in merged["tests"]:
        if test["nodeid"] in by_id:
            assert test["optimized"] == by_id[test["nodeid"]]["optimized"]
    # the renderers got the merged report
    assert "test_lengths[1]" in md.read_text() and "test_two_calls" in md.read_text()
    assert html.read_text().lstrip().lower().startswith("<!doctype html") and "test_over_budget" in html.read_text()


def test_a_merged_report_merges_again_and_keeps_its_shards(runs, capsys, tmp_path):
    first = tmp_path / "first.json"
    assert merge(capsys, runs["shard1"], runs["shard2"], "-o", first)[0] == 0
    again = tmp_path / "again.json"
    code, out, _ = merge(capsys, first, runs["shard3"], "-o", again)
    assert code == 0 and out.splitlines()[-1] == f"wrote {again} (8 tests from 3 shards)"
    merged = read(again)
    assert rows(merged) == rows(read(runs["full"]))
    assert [s["source"] for s in merged["shards"]] == [str(runs["shard1"]), str(runs["shard2"]), str(runs["shard3"])]
    assert {t["shard"] for t in merged["tests"] if t["nodeid"].startswith("test_user.py::test_lengths")} == {1}


@pytest.mark.parametrize("inputs, needle", [
    # one file given twice says so (test_round2_reports.py::test_merge_of_one_file_given_twice_says_so)
    (("shard2", "full"), "is in both '{shard2}' and '{full}'"),
], ids=["overlapping-selections"])
def test_the_same_test_on_the_same_hardware_twice_is_an_error_naming_both_files(runs, capsys, tmp_path, inputs,
                                                                                 needle):
    target = tmp_path / "merged.json"
    code, _, err = merge(capsys, *(runs[name] for name in inputs), "-o", target)
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("pytest-opt merge: error: test 'test_user.py::test_")
    assert needle.format(**{name: runs[name] for name in runs}) in err
    assert "select disjoint tests per shard" in err
    assert not target.exists()


def test_the_same_test_on_two_hardware_types_stays_two_rows(runs, capsys, tmp_path):
    h200 = with_hardware(runs["shard1"], tmp_path / "shard1-h200.json", H200)
    target = tmp_path / "merged.json"
    assert merge(capsys, h200, runs["shard1"], "-o", target)[0] == 0
    merged = read(target)
    cpu = read(runs["shard1"])["tests"][0]["hardware"]
    assert cpu.startswith("CPU: ")
    assert [(t["nodeid"], t["hardware"], t["shard"]) for t in merged["tests"]] == sorted(
        [("test_user.py::test_sdpa", H200, 0), ("test_user.py::test_sdpa", cpu, 1),
         ("test_user.py::test_static_cache", H200, 0), ("test_user.py::test_static_cache", cpu, 1)])
    assert merged["summary"]["passed"] == 4
    assert [s["environment"]["hardware"] for s in merged["shards"]] == [H200, cpu]


def test_pytest_opt_compare_accepts_a_merged_report_and_gates_each_row_on_its_own_hardware(
        runs, capsys, tmp_path, pytester):
    old = tmp_path / "old.json"
    h200 = with_hardware(runs["shard1"], tmp_path / "shard1-h200.json", H200)
    assert merge(capsys, runs["shard1"], runs["shard2"], h200, "-o", old)[0] == 0
    pytester.makepyfile(test_user=USER_TESTS)
    new = pytester.path / "new.json"
    # a gate on a figure one round measures without noise: the verdicts say which row each test met
    result = pytester.runpytest(*CHEAP, *SHARD_1, f"--opt-report-json={new}", f"--opt-compare={old}",
                                "--opt-compare-fail=kl_mean:1")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.no_fnmatch_line("*not comparable*")
    verdicts = {t["nodeid"]: t["regression"]["verdict"] for t in read(new)["tests"]}
    assert verdicts == {"test_user.py::test_sdpa": "ok", "test_user.py::test_static_cache": "ok"}

    # the same merged report, its CPU rows 1000 times faster: this run regressed against them (not the H200 rows)
    faster = tmp_path / "old-faster.json"
    faster.write_text(json.dumps(scaled(read(old), 0.001, hardware=read(new)["tests"][0]["hardware"])))
    result = pytester.runpytest(*CHEAP, "test_user.py::test_sdpa", f"--opt-report-json={new}",
                                f"--opt-compare={faster}", "--opt-compare-fail=latency:10%")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["REGRESSED test_user.py::test_sdpa: latency * (+*%, limit 10%)*",
                                 "*1 test regressed past --opt-compare-fail=latency:10%*"])
    assert read(new)["tests"][0]["regression"]["verdict"] == "regressed"


def test_merge_compare_gates_the_merged_result_like_pytest(runs, capsys, tmp_path):
    shards = [runs[f"shard{n}"] for n in (1, 2, 3)]
    base, target = tmp_path / "base.json", tmp_path / "merged.json"
    assert merge(capsys, *shards, "-o", base)[0] == 0
    # against itself (one round per test is too noisy to compare two live runs' latencies here): two CPU jobs
    # cannot vouch for 10% (their between-run term), so each test is listed as inconclusive and nothing fails
    code, out, err = merge(capsys, *shards, "-o", target, "--compare", base, "--compare-fail", "latency:10%")
    assert (code, err) == (0, "")
    assert f"compare: 0 regressed, 7 inconclusive, 0 improved, 0 ok, 0 new, 1 not comparable (against {base})" in out
    assert sum(line.startswith("INCONCLUSIVE ") and "detectable " in line for line in out.splitlines()) == 7
    assert out.splitlines()[-1] == f"wrote {target} (8 tests from 3 shards)"

    old = tmp_path / "old.json"
    old.write_text(json.dumps(scaled(read(base), 0.01, nodeid="test_user.py::test_sdpa")))
    code, out, err = merge(capsys, *shards, "-o", target, "--compare", old, "--compare-fail", "latency:10%")
    assert code == 1
    assert [line for line in out.splitlines() if line.startswith("REGRESSED")] == [
        line for line in out.splitlines() if line.startswith("REGRESSED test_user.py::test_sdpa: latency ")]
    assert "REGRESSED test_user.py::test_sdpa: latency" in out
    assert err == (f"pytest-opt merge: 1 test regressed past --compare-fail=latency:10% against --compare={old}: "
                   "exit status 1\n")
    merged = read(target)  # written, with the verdicts, as pytest writes its own
    verdicts = {t["nodeid"]: t["regression"]["verdict"] for t in merged["tests"]}
    assert verdicts["test_user.py::test_sdpa"] == "regressed"
    assert verdicts["test_user.py::test_needs_a_gpu"] == "not comparable"
    judged = merged["tests"][[t["nodeid"] for t in merged["tests"]].index("test_user.py::test_sdpa")]["regression"]
    assert judged["judged"][0]["metric"] == "latency" and judged["judged"][0]["verdict"] == "regressed"

    # --compare alone: verdicts, never a failing status
    assert merge(capsys, *shards, "-o", target, "--compare", old)[0] == 0


def test_merge_compare_against_a_merged_report_matches_rows_by_hardware(runs, capsys, tmp_path):
    h200 = with_hardware(runs["shard1"], tmp_path / "shard1-h200.json", H200)
    old = tmp_path / "old.json"
    assert merge(capsys, runs["shard1"], h200, "-o", old)[0] == 0
    slower = tmp_path / "shard1-h200-slower.json"
    slower.write_text(json.dumps(scaled(read(h200), 100.0)))
    code, out, _ = merge(capsys, runs["shard1"], slower, "-o", tmp_path / "new.json", "--compare", old,
                         "--compare-fail", "latency:10%")
    assert code == 1
    regressed = sorted(line.split(": latency ")[0] for line in out.splitlines() if line.startswith("REGRESSED"))
    assert regressed == [f"REGRESSED test_user.py::test_sdpa on {H200}", f"REGRESSED test_user.py::test_static_cache on {H200}"]
    assert "compare: 2 regressed, 2 inconclusive, 0 improved, 0 ok, 0 new, 0 not comparable" in out
    verdicts = {(t["nodeid"], t["hardware"]): t["regression"]["verdict"] for t in read(tmp_path / "new.json")["tests"]}
    assert sorted(verdicts.values()) == ["inconclusive", "inconclusive", "regressed", "regressed"]
    assert all(v == "regressed" for (_, hardware), v in verdicts.items() if hardware == H200)


def _not_json(path: Path) -> None:
    path.write_text("{not json")


def _wrong_schema(path: Path) -> None:
    path.write_text(json.dumps({"schema": "pytest-transformers-opt/report", "schema_version": 1, "tests": "none"}))


def _huge(path: Path) -> None:
    with open(path, "wb") as handle:  # sparse: past a report's size limit, written in no time
        handle.truncate(files.MAX_REPORT_BYTES + 1)


@pytest.mark.parametrize("make, needle", [
    (_not_json, "is not JSON"),
    (_wrong_schema, "cannot be used: invalid pytest-transformers-opt/report"),
    (_huge, f"over the limit of {files.MAX_REPORT_BYTES} bytes"),
], ids=["not-json", "wrong-schema", "huge"])
def test_a_bad_input_file_is_one_line_naming_it_and_exit_status_2(runs, capsys, tmp_path, make, needle):
    bad = tmp_path / "bad.json"
    make(bad)
    target = tmp_path / "merged.json"
    code, _, err = merge(capsys, runs["shard1"], bad, "-o", target)
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("pytest-opt merge: error: ")
    assert str(bad) in err and needle in err and "give JSON reports written by this plugin" in err
    assert not target.exists()


@pytest.mark.parametrize("argv, needle", [
    (["--compare-fail", "latency:10%"], "--compare-fail: needs --compare OLD.json"),
    (["--compare", "{shard1}", "--compare-fail", "latency:ten"], "--compare-fail: 'latency:ten'"),
    (["--compare", "{missing}"], "--compare: cannot read the report"),
    (["--md", "{missing_folder}/m.md"], "--md: the folder of"),
], ids=["compare-fail-alone", "bad-spec", "missing-old", "no-folder"])
def test_bad_options_are_one_line_and_exit_status_2(runs, capsys, tmp_path, argv, needle):
    target = tmp_path / "merged.json"
    values = {"shard1": runs["shard1"], "missing": tmp_path / "missing.json", "missing_folder": tmp_path / "nope"}
    code, out, err = merge(capsys, runs["shard1"], "-o", target, *(a.format(**values) for a in argv))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert needle in err
    assert not target.exists() and out == ""


def test_usage_errors_exit_2_in_one_line(capsys):
    code, _, err = merge(capsys, "a.json")  # no -o
    assert code == 2
    assert err.splitlines() == ["pytest-opt merge: error: the following arguments are required: -o/--output "
                                "(see pytest-opt merge --help)"]
