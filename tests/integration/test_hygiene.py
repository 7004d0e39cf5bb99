"""Resource hygiene: a model's memory is released once no remaining test needs it."""

from __future__ import annotations

import json

RSS_CONFTEST = '''
import json
import pytest
from pytest_transformers_opt.engine.loading import prime_loader
from pytest_transformers_opt.engine.measure import current_rss_bytes, release_memory
from pytest_transformers_opt.session import SESSION_KEY

readings = {}
configs = []

def pytest_sessionstart(session):
    configs.append(session.config)
    prime_loader("cpu")
    release_memory("cpu")
    readings["start"] = current_rss_bytes()

def pytest_runtest_logfinish(nodeid, location):  # after the test's teardown, the plugin's included
    opt = configs[0].stash[SESSION_KEY]
    release_memory("cpu")
    readings.setdefault("cached_after", []).append(len(opt.models.keys()))
    readings.setdefault("rss_after", []).append(current_rss_bytes())

@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    release_memory("cpu")
    readings["end"] = current_rss_bytes()
    with open("rss.json", "w") as handle:
        json.dump(readings, handle)
'''

SESSION_OF_SEVERAL_MODELS = '''
import pytest

@pytest.mark.opt_model("small-random-llama-100m")
@pytest.mark.optimization("sdpa", min_token_match=0.0, max_kl=100.0)
def test_big_model(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=2, rounds=1, warmup=0)

@pytest.mark.optimization("compile")
def test_compiled_tiny(opt_bench):
    opt_bench(rounds=1)  # the default workload: one graph for the suite's compile tests (tests/conftest.py)

@pytest.mark.opt_model("tiny-random-qwen3")
@pytest.mark.optimization("sdpa")
def test_other_tiny(opt_bench):
    opt_bench(max_new_tokens=4, rounds=1)
'''


def test_memory_is_released_after_the_last_test_of_a_model(run_user, pytester):
    run = run_user(SESSION_OF_SEVERAL_MODELS, conftest=RSS_CONFTEST)
    run.result.assert_outcomes(passed=3)
    readings = json.loads((pytester.path / "rss.json").read_text())
    mib = 2**20
    # the 100M model (eager baseline + sdpa: two ~400 MiB copies) is gone after its last test
    assert readings["cached_after"][0] == 0
    assert readings["rss_after"][0] - readings["start"] < 0.05 * readings["start"] + 64 * mib, readings
    # nothing is kept once the session ends; the compiled model's graphs went with it
    assert readings["cached_after"][-1] == 0
    assert readings["end"] - readings["start"] < 0.05 * readings["start"] + 64 * mib, readings


def test_a_second_session_in_the_process_finds_the_stack_frozen(pytester, monkeypatch):
    """The long-lived objects are frozen at the process's first hardware probe, and what later imports add before
    a later test: a second session there (pytest.main called again, an in-process pytester run) collects only
    what it made since (its own test module, imported again), never the stack's 300k+ objects again."""
    import gc

    from pytest_transformers_opt.engine import measure

    pytester.makepyfile(test_user="def test_probe(opt_hardware):\n    assert opt_hardware.device_type == 'cpu'\n")
    # the first session in this process (or an earlier one of this worker) froze; tests/conftest.py also freezes
    # what the worker holds before each test, so the freeze count says nothing here: the collections below do
    pytester.runpytest_inprocess("-p", "no:cacheprovider", "--opt-device=cpu").assert_outcomes(passed=1)

    scanned: list[int] = []

    class Watched:
        def __getattr__(self, name: str) -> object:
            return getattr(gc, name)

        def collect(self, *args: int) -> int:
            scanned.append(len(gc.get_objects()))  # what a collection scans: the objects not frozen
            return gc.collect(*args)

    monkeypatch.setattr(measure, "gc", Watched())
    pytester.runpytest_inprocess("-p", "no:cacheprovider", "--opt-device=cpu").assert_outcomes(passed=1)
    frozen = gc.get_freeze_count()
    assert frozen > 100_000 and all(count < frozen / 10 for count in scanned), (scanned, frozen)
