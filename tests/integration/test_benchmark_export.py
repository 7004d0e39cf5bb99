"""The rounds opt_bench timed appear in pytest-benchmark's output: JSON, saved runs, `compare`."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
from pytest_benchmark.stats import Stats

from pytest_transformers_opt.compat import benchmark_storage
from pytest_transformers_opt.report.benchmark_export import side_name

from conftest import XDIST_ROUNDS

# one round, no warm-up, for the runs that check names, files and messages rather than the rounds' statistics
CHEAP = ("--opt-rounds=1", "--opt-warmup=0")

USER_TESTS = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.parametrize("tokens", [3])
@pytest.mark.optimization("static_cache")
def test_static(opt_bench, tokens):
    opt_bench(max_new_tokens=tokens)

@pytest.mark.optimization("flash_attention_2")
def test_skipped_on_cpu(opt_bench):
    opt_bench()
'''

OWN_BENCHMARK = '''

def test_own_benchmark(benchmark):
    benchmark(sum, range(1000))
'''


def _benchmarks(path: Path) -> dict[str, dict]:
    return {b["fullname"]: b for b in json.loads(path.read_text())["benchmarks"]}


def _saved_runs(root: Path) -> list[Path]:
    return sorted(root.glob(".benchmarks/*/*.json"))


def test_two_benchmarks_per_test_in_json_and_autosave(run_user, pytester):
    run = run_user(USER_TESTS, "--opt-rounds=3", "--opt-warmup=0", "--benchmark-json=benchmark.json",
                   "--benchmark-autosave")
    run.result.assert_outcomes(passed=2, skipped=1)
    benchmarks = _benchmarks(pytester.path / "benchmark.json")
    assert sorted(benchmarks) == ["test_user.py::test_sdpa[baseline]", "test_user.py::test_sdpa[optimized]",
                               "test_user.py::test_static[3-baseline]", "test_user.py::test_static[3-optimized]"]
    for name, benchmark in benchmarks.items():
        side = benchmark["extra_info"]["opt_side"]
        entry = run.test(name.rpartition("::")[2].split("[")[0] + ("[3]" if "static" in name else ""))
        samples = entry[side]["latency_samples_s"]
        # the rounds themselves, with pytest-benchmark's own statistics of them
        assert benchmark["stats"]["data"] == samples and benchmark["stats"]["rounds"] == len(samples) >= 3
        expected = Stats()
        for sample in samples:
            expected.update(sample)
        assert benchmark["stats"]["median"] == pytest.approx(expected.median) \
            == pytest.approx(statistics.median(samples))
        assert benchmark["stats"]["iqr"] == pytest.approx(expected.iqr)
        assert benchmark["group"] == f"transformers-opt: {entry['nodeid']}"
        assert benchmark["extra_info"]["techniques"] == (entry["techniques"] if side == "optimized"
                                                     else entry["baseline_techniques"])
        assert benchmark["extra_info"]["ttft_s"] == entry[side]["ttft_s"]
        assert benchmark["extra_info"]["speedup"] == entry["speedup"]
    assert benchmarks["test_user.py::test_sdpa[optimized]"]["extra_info"]["similarity"]["token_match"] == 1.0
    saved = _saved_runs(pytester.path)
    assert len(saved) == 1
    assert _benchmarks(saved[0]).keys() == benchmarks.keys()
    run.result.stdout.fnmatch_lines(["*transformers-opt: Wrote benchmark data in: benchmark.json*",
                                     "*transformers-opt: Saved benchmark data in:*.benchmarks*"])


def test_pytest_benchmark_compare_reads_two_saved_runs(run_user, pytester):
    for _ in range(2):
        run = run_user(USER_TESTS, *CHEAP, "--benchmark-autosave", "-k", "sdpa")
        run.result.assert_outcomes(passed=1, deselected=2)
    assert len(_saved_runs(pytester.path)) == 2
    compare = subprocess.run([str(Path(sys.executable).with_name("pytest-benchmark")), "compare", "--group-by=group",
                              "--columns=median,rounds"], cwd=pytester.path, capture_output=True, text=True, timeout=120)
    assert compare.returncode == 0, compare.stderr
    assert "transformers-opt: test_user.py::test_sdpa" in compare.stdout
    rows = [line for line in compare.stdout.splitlines() if line.startswith("test_sdpa[")]
    assert len(rows) == 4  # baseline and optimized, from each of the two runs
    assert {row.split()[0] for row in rows} == {"test_sdpa[baseline]", "test_sdpa[optimized]"}


def test_added_next_to_a_projects_own_benchmarks(run_user, pytester):
    run = run_user(USER_TESTS + OWN_BENCHMARK, *CHEAP, "--benchmark-json=benchmark.json")
    run.result.assert_outcomes(passed=3, skipped=1)
    names = [b["fullname"] for b in json.loads((pytester.path / "benchmark.json").read_text())["benchmarks"]]
    assert "test_user.py::test_own_benchmark" in names
    assert sorted(n for n in names if "[" in n) == ["test_user.py::test_sdpa[baseline]",
                                                      "test_user.py::test_sdpa[optimized]",
                                                      "test_user.py::test_static[3-baseline]",
                                                      "test_user.py::test_static[3-optimized]"]
    # pytest-benchmark wrote the file; ours went into it once, not into a second write
    assert "transformers-opt: Wrote benchmark data" not in run.result.stdout.str()


def test_complete_under_xdist(xdist_run):
    """Both inner workers' rounds in one file (the shared ``-n 2`` session of tests/conftest.py)."""
    xdist_run.result.assert_outcomes(passed=3, skipped=1)
    benchmarks = _benchmarks(xdist_run.folder / "benchmark.json")
    assert sorted(benchmarks) == [f"test_user.py::{name}[{side}]" for name in ("test_8bit", "test_sdpa")
                                  for side in ("baseline", "optimized")] + [
        "test_user.py::test_static[3-baseline]", "test_user.py::test_static[3-optimized]"]
    assert all(b["stats"]["rounds"] == XDIST_ROUNDS for b in benchmarks.values())
    xdist_run.result.stdout.fnmatch_lines(["*transformers-opt: Wrote benchmark data in: benchmark.json*"])


def test_a_failed_budget_still_exports_its_rounds_with_the_outcome(run_user, pytester):
    run = run_user('''
import pytest

@pytest.mark.optimization("sdpa", max_latency="1 ns")
def test_too_strict(opt_bench):
    opt_bench(max_new_tokens=3)
''', *CHEAP, "--benchmark-json=benchmark.json")
    run.result.assert_outcomes(failed=1)
    benchmarks = _benchmarks(pytester.path / "benchmark.json")
    assert {b["extra_info"]["outcome"] for b in benchmarks.values()} == {"failed"}
    assert benchmarks["test_user.py::test_too_strict[optimized]"]["extra_info"]["failed_budgets"] == ["max_latency"]


def test_benchmark_disable_writes_nothing(run_user, pytester):
    run = run_user(USER_TESTS, *CHEAP, "--benchmark-disable", "--benchmark-json=benchmark.json", "-k", "sdpa")
    run.result.assert_outcomes(passed=1, deselected=2)
    assert not (pytester.path / "benchmark.json").exists()


def test_an_unwritable_benchmark_storage_fails_the_run_cleanly(run_user, pytester):
    blocked = pytester.path / "not-a-folder"
    blocked.write_text("a file where the storage folder would go")
    run = run_user(USER_TESTS, *CHEAP, f"--benchmark-storage={blocked}", "--benchmark-save=run1", "-k", "sdpa")
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED
    run.result.stdout.fnmatch_lines(["transformers-opt: could not write the pytest-benchmark data: [[]Errno *"])
    assert "Traceback" not in run.result.stdout.str()
    assert run.test("test_sdpa")["outcome"] == "passed"  # the opt report was written all the same


def test_unwritable_benchmark_json_is_a_usage_error(run_user, pytester):
    run = run_user(USER_TESTS, f"--benchmark-json={pytester.path / 'missing' / 'benchmark.json'}")
    assert run.result.ret == pytest.ExitCode.USAGE_ERROR
    run.result.stderr.fnmatch_lines(["*--benchmark-json: the folder*missing* does not exist*"])


@pytest.mark.parametrize(("nodeid", "side", "expected"), [
    ("t.py::test_a", "baseline", "t.py::test_a[baseline]"),
    ("t.py::test_a[x-1]", "optimized", "t.py::test_a[x-1-optimized]"),
    ("t.py::TestC::test_a", "optimized", "t.py::TestC::test_a[optimized]"),
])
def test_side_names_follow_pytests_parameter_ids(nodeid, side, expected):
    assert side_name(nodeid, side) == expected


def test_runs_without_pytest_benchmark(run_user):
    run = run_user(USER_TESTS, *CHEAP, "-p", "no:benchmark", "-k", "sdpa")
    run.result.assert_outcomes(passed=1, deselected=2)
    assert run.test("test_sdpa")["optimized"]["latency_samples_s"]


def test_storage_without_load_storage_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """pytest-benchmark does not document ``utils.load_storage``: a release without it is one readable error."""
    monkeypatch.setitem(sys.modules, "pytest_benchmark.utils", types.ModuleType("pytest_benchmark.utils"))
    with pytest.raises(RuntimeError, match=r"has no utils\.load_storage.*--benchmark-json=PATH still writes"):
        benchmark_storage(f"file://{tmp_path}", logger=None, netrc=None)
