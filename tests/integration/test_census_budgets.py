"""The census's budgets (issue 41, item 6): ``max_graph_breaks`` and ``max_syncs_per_step`` read the optimized side's
census, and ``max_recompiles`` reads the census's recompiles (the figure ``--opt-compare-fail=recompiles:N`` judges).
A figure the census cannot give (syncs on a CPU) is said, never passed."""

from __future__ import annotations

from typing import Any

from census_techniques import item_hook_conftest  # tests/ is on sys.path
import pytest

# A user's compile whose model has a .item() in a forward hook of its first attention: dynamo cannot trace it and
# breaks the compiled forward there (the hook and workload of test_census.py: inductor's cache holds their graphs).
ITEM_HOOK_CONFTEST = item_hook_conftest("True")

BROKEN_COMPILE_TEST = '''
import pytest

@pytest.mark.optimization("compile_with_hook", max_graph_breaks=0, max_recompiles=5)
def test_compiled(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=4)
'''


def _budget(row: dict[str, Any], name: str) -> dict[str, Any]:
    (budget,) = [b for b in row["budgets"] if b["name"] == name]
    return budget


def test_a_graph_break_fails_max_graph_breaks_zero_naming_its_reason(run_user: Any) -> None:
    run = run_user(BROKEN_COMPILE_TEST, conftest=ITEM_HOOK_CONFTEST)
    row = run.test("test_compiled")
    census = row["census"]["optimized"]
    assert census["graph_breaks"] >= 1 and any("Tensor.item()" in r for r in census["graph_break_reasons"]), census
    assert row["outcome"] == "failed" and row["failed_budgets"] == ["max_graph_breaks"], row["error"]
    breaks = _budget(row, "max_graph_breaks")
    assert breaks["measured"] == census["graph_breaks"] and breaks["ok"] is False
    assert "Tensor.item()" in breaks["note"], breaks
    # the failure message names the budget and dynamo's reason
    out = run.result.stdout.str()
    assert "budgets failed (max_graph_breaks)" in out and "Tensor.item()" in out, out
    # max_recompiles reads the census's recompiles: one fact, judged by the budget and by the compare gate alike
    recompiles = _budget(row, "max_recompiles")
    assert recompiles["ok"] is True and recompiles["measured"] == census["recompiles"], (recompiles, census)


CPU_BUDGETS_TEST = '''
import pytest

@pytest.mark.optimization("sdpa", max_syncs_per_step=0)
def test_syncs(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=3)

@pytest.mark.optimization("sdpa", max_graph_breaks=0)
def test_breaks_without_compile(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=3)
'''


def test_max_syncs_per_step_on_cpu_says_the_census_has_none_and_does_not_pass(run_user: Any) -> None:
    run = run_user(CPU_BUDGETS_TEST, "--opt-rounds=1")
    row = run.test("test_syncs")
    assert row["census"]["optimized"]["syncs_per_step"] is None
    syncs = _budget(row, "max_syncs_per_step")
    assert syncs["ok"] is False and syncs["measured"] is None
    assert syncs["note"] == ("not measured in this run: the census has no syncs_per_step (CPU: no device for the "
                             "host to wait on)"), syncs
    assert row["outcome"] == "failed" and row["failed_budgets"] == ["max_syncs_per_step"]
    # max_graph_breaks on a configuration that compiles nothing: that test's error, naming what measures it
    broken = run.test("test_breaks_without_compile")
    assert broken["outcome"] == "error"
    assert "budget max_graph_breaks is measured by compilation (compile)" in broken["error"], broken["error"]
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED
