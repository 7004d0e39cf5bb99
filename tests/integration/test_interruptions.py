"""Failures from outside the plugin's own checks: out of memory at load, and a KeyboardInterrupt."""

from __future__ import annotations

import json

OOM_CONFTEST = '''
import pytest
import torch
from transformers import AutoModelForCausalLM

original = AutoModelForCausalLM.from_pretrained.__func__

def pytest_runtest_setup(item):
    if "oom" in item.name:
        def out_of_memory(cls, *args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
        AutoModelForCausalLM.from_pretrained = classmethod(out_of_memory)

def pytest_runtest_teardown(item):
    AutoModelForCausalLM.from_pretrained = classmethod(original)
'''


def test_out_of_memory_while_loading_fails_that_test_alone(run_user):
    run = run_user('''
import pytest

@pytest.mark.optimization("bnb_8bit")
def test_oom_at_load(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa")
def test_still_runs(opt_bench):
    opt_bench(max_new_tokens=4)
''', conftest=OOM_CONFTEST)
    run.result.assert_outcomes(passed=1, errors=1)
    run.result.stdout.fnmatch_lines([
        "*loading tiny-random-llama with [[]eager, bnb_8bit[]] on cpu out of memory: OutOfMemoryError: CUDA out of "
        "memory. Tried to allocate 20.00 GiB (injected)*"])
    assert run.test("test_still_runs")["outcome"] == "passed"


INTERRUPT_CONFTEST = '''
import contextlib
from pytest_transformers_opt.techniques import Technique

class Interrupt(Technique):
    name = "ctrl_c"
    family = "test"
    summary = "presses Ctrl-C during generation"

    @contextlib.contextmanager
    def around_generate(self, model):
        raise KeyboardInterrupt
        yield

def pytest_opt_register_techniques(registry):
    registry.register(Interrupt)
'''


def test_keyboard_interrupt_keeps_the_finished_tests_report_whole(pytester):
    """In a subprocess: an in-process run would hand the interrupt to the outer session."""
    pytester.makeconftest(INTERRUPT_CONFTEST)
    pytester.makepyfile(test_user='''
import pytest

@pytest.mark.optimization("sdpa")
def test_a_finished(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("ctrl_c")
def test_b_interrupted(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa")
def test_c_never_started(opt_bench):
    opt_bench(max_new_tokens=4)
''')
    report_path = pytester.path / "r.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--opt-rounds=2", f"--opt-report-json={report_path}")
    assert result.ret == 2  # pytest's "interrupted"
    report = json.loads(report_path.read_text())  # parses: written whole
    outcomes = {t["nodeid"].split("::")[-1]: t["outcome"] for t in report["tests"]}
    assert outcomes["test_a_finished"] == "passed"
    assert outcomes.get("test_b_interrupted") != "passed"
    assert "test_c_never_started" not in outcomes
    finished = next(t for t in report["tests"] if t["nodeid"].endswith("test_a_finished"))
    assert finished["optimized"]["latency_s"] > 0
    leftovers = [p.name for p in report_path.parent.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []
