"""The execution census end to end: taken on both sides, the same on every run of one stack, off when asked, and
compared exactly by --opt-compare-fail, naming what changed and giving it as a timing verdict's cause."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from census_techniques import MATMUL_CHANGE, extra_matmul_conftest, item_hook_conftest  # tests/ is on sys.path

EXTRA_MATMUL_CONFTEST = extra_matmul_conftest('os.environ.get("EXTRA_MATMUL")')

PLUS_TEST = '''
import pytest

@pytest.mark.optimization("sdpa_plus")
def test_plus(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=5)
'''


def _census(run: Any, name: str) -> dict[str, Any]:
    census = run.test(name)["census"]
    assert census is not None, run.result.stdout.str()
    return census


def test_the_census_is_taken_on_both_sides_and_is_the_same_on_every_run_of_one_stack(run_user: Any) -> None:
    first = _census(run_user(PLUS_TEST, "--opt-rounds=3", conftest=EXTRA_MATMUL_CONFTEST), "test_plus")
    second = _census(run_user(PLUS_TEST, "--opt-rounds=5"), "test_plus")
    # exactly: rounds, warm-up and timings differ, what runs does not (what counting took is apart: a time)
    assert first.pop("seconds")["optimized"] > 0 and second.pop("seconds")["baseline"] > 0
    assert first == second
    optimized, baseline = first["optimized"], first["baseline"]
    assert optimized["decode_steps"] == 4 and optimized["generate_calls"] == 1
    # the proof in counts: sdpa runs its fused op in every layer of every step, the eager baseline never
    assert optimized["ops_per_step"].get("aten::scaled_dot_product_attention") == 2, optimized["ops_per_step"]
    assert not any("scaled_dot_product" in op for op in baseline["ops"]), baseline["ops"]
    assert optimized["kernels"] is None and "CUDA" in optimized["unavailable"]["kernels"]
    assert first["why_not"] == {}


def test_census_off_leaves_each_side_null_with_the_reason(run_user: Any) -> None:
    run = run_user(PLUS_TEST, "--opt-rounds=3", "--opt-census=off", conftest=EXTRA_MATMUL_CONFTEST)
    census = _census(run, "test_plus")
    assert census["optimized"] is None and census["baseline"] is None
    assert census["why_not"] == {"optimized": "--opt-census=off", "baseline": "--opt-census=off"}


def test_an_extra_matmul_per_layer_is_caught_by_ops_zero_and_named_as_the_latency_verdicts_cause(
        run_user: Any, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    first = run_user(PLUS_TEST, "--opt-rounds=5", conftest=EXTRA_MATMUL_CONFTEST)
    old = pytester.path / "old.json"
    old.write_text(json.dumps(copy.deepcopy(first.report)), encoding="utf-8")
    monkeypatch.setenv("EXTRA_MATMUL", "1")
    run = run_user(PLUS_TEST, "--opt-rounds=5", "-q", f"--opt-compare={old}", "--opt-compare-fail=ops:0,latency:10%")
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED  # ops:0 regressed: the gate fails the run
    regression = run.test("test_plus")["regression"]
    assert regression["verdict"] == "regressed", regression
    # two decoder layers, one matmul each, in every decode step
    ops_detail = next(d for d in regression["details"] if d.startswith("ops "))
    assert MATMUL_CHANGE in ops_detail and ops_detail.endswith(": regressed"), ops_detail
    (ops_record,) = [r for r in regression["judged"] if r["metric"] == "ops"]
    assert ops_record["rule"] == "exact" and MATMUL_CHANGE in ops_record["changes"]
    # the latency verdict (regressed or, at this size, inconclusive) names the census difference as its cause
    (latency,) = [r for r in regression["judged"] if r["metric"] == "latency"]
    assert latency["verdict"] in ("regressed", "inconclusive")
    assert regression["cause"]["changed"] is True
    assert regression["cause"]["text"].startswith("the census changed: ")
    assert MATMUL_CHANGE in regression["cause"]["lines"], regression["cause"]
    out = run.result.stdout.str()
    assert MATMUL_CHANGE in out, out
    # the baseline did not change: its census is the same in both reports
    assert run.test("test_plus")["census"]["baseline"] == first.test("test_plus")["census"]["baseline"]


GRAPH_BREAK_CONFTEST = item_hook_conftest('os.environ.get("ITEM_IN_ATTENTION")')

COMPILE_TEST = '''
import pytest

@pytest.mark.optimization("compile_with_hook")
def test_compiled(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=4)
'''


def test_a_graph_break_in_a_compiled_model_fails_graph_breaks_zero_naming_its_reason(
        run_user: Any, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    first = run_user(COMPILE_TEST, "--opt-rounds=3", conftest=GRAPH_BREAK_CONFTEST)
    whole = _census(first, "test_compiled")["optimized"]
    assert whole["graph_breaks"] == 0 and whole["compiled_calls"] == 3 and whole["unique_graphs"] == 1, whole
    old = pytester.path / "old.json"
    old.write_text(json.dumps(first.report), encoding="utf-8")
    monkeypatch.setenv("ITEM_IN_ATTENTION", "1")
    run = run_user(COMPILE_TEST, "--opt-rounds=3", f"--opt-compare={old}", "--opt-compare-fail=graph_breaks:0")
    broken = _census(run, "test_compiled")["optimized"]
    assert broken["graph_breaks"] >= 1, broken
    assert any("Tensor.item()" in reason for reason in broken["graph_break_reasons"]), broken
    regression = run.test("test_compiled")["regression"]
    assert regression["verdict"] == "regressed", regression
    assert regression["details"][0].startswith(f"graph breaks 0 -> {broken['graph_breaks']}: ")
    assert "Tensor.item()" in regression["details"][0]
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED


# A technique that notes, around every generate call, whether a profiler was recording it
PROFILED_CONFTEST = '''
import contextlib, json, os
import pytest
import torch
from pytest_transformers_opt.techniques.caches import StaticCacheTechnique


class NotedStatic(StaticCacheTechnique):
    name = "noted_static"

    @contextlib.contextmanager
    def around_generate(self, model):
        with open(os.environ["CALLS_LOG"], "a") as log:
            log.write(json.dumps(torch.autograd.profiler._is_profiler_enabled) + "\\n")
        yield


@pytest.hookimpl(optionalhook=True)
def pytest_opt_register_techniques(registry):
    registry.register(NotedStatic)
'''

TWICE_TEST = '''
import pytest

@pytest.mark.optimization("noted_static")
def test_first(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=4)

@pytest.mark.optimization("noted_static")
def test_second(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=4)
'''


def test_the_census_runs_once_a_test_outside_every_timed_round_and_is_stable_across_tests(
        run_user: Any, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    log = pytester.path / "calls.log"
    monkeypatch.setenv("CALLS_LOG", str(log))
    run = run_user(TWICE_TEST, "--opt-rounds=4", conftest=PROFILED_CONFTEST)
    assert run.result.ret == pytest.ExitCode.OK, run.result.stdout.str()
    profiled = [json.loads(line) for line in log.read_text().splitlines()]
    # every call of the optimized configuration: warm-up, verification, 4 timed rounds, the census; one profiled
    assert profiled.count(True) == 2, profiled  # one census call per test, of the optimized side
    for name in ("test_first", "test_second"):
        row = run.test(name)
        assert row["optimized"]["rounds"] == 4 and len(row["optimized"]["latency_samples_s"]) == 4
    # the second test reuses the session's loaded, warmed model: its census is the first's exactly
    first, second = run.test("test_first")["census"], run.test("test_second")["census"]
    # the baseline is counted once a session: the second test reuses the first's count, and took no time for it
    assert first.pop("seconds")["baseline"] > 0 and second.pop("seconds")["baseline"] is None
    assert first == second and first["optimized"] != first["baseline"]
    # a static cache's decode step writes into its preallocated tensors: no concatenation of the cache
    assert first["optimized"]["ops_per_step"].get("aten::cat", 0) < first["baseline"]["ops_per_step"]["aten::cat"]
