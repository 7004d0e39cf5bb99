"""The ``around_generate`` contract (issue 40, item 6), as a user's conftest relies on it.

What a technique's context installs on the model (a replaced ``generate`` or ``generate_batch``, a replaced
``forward``) is what every run of its configuration calls, timed rounds included, and the work the context
does on entering is inside the clock. "generation: one timed-call helper" read the bound ``model.generate``
before entering the context, so a wrapper it installed never ran; no test noticed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Each call the user's replacement sees is a line in this file of the user's project: the test's node id
# (pytest's PYTEST_CURRENT_TEST, less its " (call)" phase).
CALLS_FILE = "calls.txt"
GENERATE_PAUSE_S = 0.2
FORWARD_PAUSE_S = 0.05
ENTER_PAUSE_S = 0.3
NEW_TOKENS = 4

CONFTEST = f'''
import contextlib
import functools
import os
import pathlib
import time

import pytest

from pytest_transformers_opt.techniques import Technique

CALLS = pathlib.Path(__file__).with_name({CALLS_FILE!r})


def note_call():
    with CALLS.open("a") as calls:
        calls.write(os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0] + "\\n")


@contextlib.contextmanager
def replaced(model, name, pause):
    """``model.<name>`` replaced by a wrapper that notes each call and sleeps ``pause`` first, while the context is open."""
    original = getattr(model, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        note_call()
        time.sleep(pause)
        return original(*args, **kwargs)

    setattr(model, name, wrapper)
    try:
        yield
    finally:
        delattr(model, name)


class WrapsGenerate(Technique):
    """Wraps generate (and generate_batch, continuous batching's call) while generating: a tracer, a profiler."""
    name = "wraps_generate"
    family = "test"
    summary = "wraps generate while generating"

    @contextlib.contextmanager
    def around_generate(self, model):
        with replaced(model, "generate", {GENERATE_PAUSE_S}), replaced(model, "generate_batch", {GENERATE_PAUSE_S}):
            yield


class ReplacesForward(Technique):
    """Replaces the model's forward while generating: a kernel of its own."""
    name = "replaces_forward"
    family = "test"
    summary = "replaces forward while generating"

    def around_generate(self, model):
        return replaced(model, "forward", {FORWARD_PAUSE_S})


class SleepsOnEnter(Technique):
    """Sets up before every generate call (its enter sleeps) and does nothing after."""
    name = "sleeps_on_enter"
    family = "test"
    summary = "sleeps when its context is entered"

    @contextlib.contextmanager
    def around_generate(self, model):
        time.sleep({ENTER_PAUSE_S})
        yield


@pytest.hookimpl(optionalhook=True)
def pytest_opt_register_techniques(registry):
    registry.register(WrapsGenerate)
    registry.register(ReplacesForward)
    registry.register(SleepsOnEnter)
'''


def _user_tests(technique: str, *, with_batching: bool) -> str:
    """A user's test file: ``technique`` on ``generate()``, and stacked with continuous batching
    (``generate_batch()``) when ``with_batching``."""
    source = f'''
import pytest

@pytest.mark.optimization("{technique}")
def test_generate(opt_bench):
    opt_bench(max_new_tokens={NEW_TOKENS})
'''
    if with_batching:
        source += f'''
@pytest.mark.optimization("continuous_batching", "{technique}")
def test_generate_batch(opt_bench):
    opt_bench(max_new_tokens={NEW_TOKENS})
'''
    return source


def _calls(project: Path) -> dict[str, int]:
    """Calls of the user's replacement, per test name."""
    path = project / CALLS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    counts: dict[str, int] = {}
    for nodeid in lines:
        name = nodeid.rsplit("::", 1)[-1]
        counts[name] = counts.get(name, 0) + 1
    return counts


def _generate_calls(side: dict) -> int:
    """The generate calls the plugin makes on the optimized side: its warm-up rounds, its timed rounds, the
    untimed verified run (no forced run: the replacements change no token, so nothing diverges) and the census's
    untimed call (a technique's context wraps it as it wraps every call: the census counts what the user runs)."""
    return len(side["warmup_s"]) + side["rounds"] + 1 + 1


def test_a_replaced_generate_is_what_every_run_calls(run_user, pytester: pytest.Pytester) -> None:
    """A context that replaces ``model.generate`` (``generate_batch`` for continuous batching) with a wrapper
    sleeping 0.2 s: the wrapper runs in every warm-up round, timed round and the verified run, and its sleep
    is in every timed round's latency. With the method read before the context, it was never called."""
    run = run_user(_user_tests("wraps_generate", with_batching=True), conftest=CONFTEST)
    run.result.assert_outcomes(passed=2)
    expected = {test: _generate_calls(run.test(test)["optimized"]) for test in ("test_generate", "test_generate_batch")}
    assert _calls(pytester.path) == expected
    for test in expected:
        optimized = run.test(test)["optimized"]
        assert optimized["rounds"] >= 2 and optimized["warmup_s"], test
        assert min(optimized["latency_samples_s"]) >= GENERATE_PAUSE_S, test
        assert min(optimized["warmup_s"]) >= GENERATE_PAUSE_S, test


def test_a_replaced_forward_is_what_generate_runs(run_user, pytester: pytest.Pytester) -> None:
    """A context that replaces ``model.forward`` with one sleeping 0.05 s a call: generate calls it for every
    new token of every run, and the timed rounds carry its sleeps."""
    run = run_user(_user_tests("replaces_forward", with_batching=False), conftest=CONFTEST)
    run.result.assert_outcomes(passed=1)
    optimized = run.test("test_generate")["optimized"]
    # one forward pass per new token: the prompt's, then one a generated token but the last
    assert _calls(pytester.path) == {"test_generate": NEW_TOKENS * _generate_calls(optimized)}
    assert min(optimized["latency_samples_s"]) >= NEW_TOKENS * FORWARD_PAUSE_S


def test_work_on_entering_the_context_is_inside_the_clock(run_user) -> None:
    """A context that sleeps 0.3 s when entered, before the call: every timed round of ``generate`` and of
    ``generate_batch`` lasts that long at least, and so does the time to the first token of ``generate``
    (the call's clock starts before the context is entered)."""
    run = run_user(_user_tests("sleeps_on_enter", with_batching=True), conftest=CONFTEST)
    run.result.assert_outcomes(passed=2)
    for test in ("test_generate", "test_generate_batch"):
        optimized, baseline = run.test(test)["optimized"], run.test(test)["baseline"]
        assert min(optimized["latency_samples_s"]) >= ENTER_PAUSE_S, test
        assert min(baseline["latency_samples_s"]) < ENTER_PAUSE_S, test  # the baseline has no such context
    assert min(run.test("test_generate")["optimized"]["ttft_samples_s"]) >= ENTER_PAUSE_S
