"""Field reliability, issue 10 items 17-19: steady-state warm-up, progress lines for long work, no
import noise. Each is checked as a user meets it: a real pytest session over a user's test file."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest

from pytest_transformers_opt.engine import tiny_models
from pytest_transformers_opt.verdict.bench import (CPU_MAX_EXTRA_WARMUP, WARMUP_TOLERANCE, rounds_agree, warm_until_stable,
                                           warmup_bounds)

from conftest import FAST_ARGS


def _scripted(values):
    """A warm-up round that returns the next scripted timing (and fails if asked for one too many)."""
    it = iter(values)
    return lambda: next(it)


# -- item 17: the warm-up rule, as pure functions -----------------------------------------------------
def test_warm_up_stops_when_two_rounds_in_a_row_agree():
    assert warm_until_stable(_scripted([1.5, 0.06, 0.05, 0.05, 9.0]), minimum=1, maximum=10) == [1.5, 0.06, 0.05, 0.05]
    # every side must agree: the baseline (second figure) still settling keeps warm-up going
    rounds = [(0.05, 2.0), (0.05, 0.5), (0.05, 0.05), (0.05, 0.051), (9.0, 9.0)]
    assert warm_until_stable(_scripted(rounds), minimum=1, maximum=10) == rounds[:4]


def test_warm_up_stops_at_the_maximum_and_honours_the_minimum():
    assert warm_until_stable(_scripted([9, 1, 9, 1, 9]), minimum=1, maximum=4) == [9, 1, 9, 1]  # never steady
    assert warm_until_stable(_scripted([1.0] * 5), minimum=3, maximum=8) == [1.0] * 3  # steady early, minimum runs
    assert warm_until_stable(_scripted([]), minimum=0, maximum=0) == []


def test_warm_up_resumed_after_the_verification_run_needs_a_steady_round_after_it():
    # the last round before the verification run counts: one new round that agrees with it is enough ...
    assert warm_until_stable(_scripted([0.05, 7.0]), minimum=1, maximum=3, previous=[0.05]) == [0.05]
    # ... one disturbed by the verification run is not
    assert warm_until_stable(_scripted([1.4, 0.05, 0.05, 7.0]), minimum=1, maximum=3, previous=[0.05]) == [1.4, 0.05, 0.05]


def test_warm_up_bounds_apply_on_every_device():
    assert warmup_bounds(1, compiled=False, cuda=False) == (1, 1 + CPU_MAX_EXTRA_WARMUP)
    assert warmup_bounds(1, compiled=True, cuda=False)[0] == 2
    assert warmup_bounds(1, compiled=True, cuda=True)[0] == 5
    assert warmup_bounds(3, compiled=False, cuda=True)[1] > warmup_bounds(3, compiled=False, cuda=False)[1] > 3
    assert warmup_bounds(0, compiled=False, cuda=False) == (0, 0)  # --opt-warmup=0: measured cold, as asked
    assert rounds_agree(1.0, 1.0 + WARMUP_TOLERANCE / 2) and not rounds_agree(1.0, 1.0 + 2 * WARMUP_TOLERANCE)


# -- item 17: end to end ------------------------------------------------------------------------------
COUNTING_CONFTEST = """
import contextlib, json, os

from pytest_transformers_opt.techniques import Technique


class CountedCalls(Technique):
    '''A project technique that notes every generate() call and the verification run, in order.'''

    name = "counted_calls"
    family = "generation"
    summary = "notes generate() calls"

    @contextlib.contextmanager
    def around_generate(self, model):
        _note("generate")
        yield

    def verify_run(self, model, evidence):
        _note("verified")
        return None


def _note(what):
    path = os.path.join(os.path.dirname(__file__), "calls.json")
    calls = json.load(open(path)) if os.path.exists(path) else []
    json.dump(calls + [what], open(path, "w"))


def pytest_opt_register_techniques(registry):
    registry.register(CountedCalls)
"""

STEADY_TEST = """
import pytest

@pytest.mark.optimization("counted_calls", "sdpa")
def test_static_steady(opt_bench):
    opt_bench(max_new_tokens=4)
"""


def _check_warm_up_rule(side: dict, maximum: int) -> None:
    warmup = side["warmup_s"]
    assert 2 <= len(warmup) <= maximum, warmup
    assert len(warmup) == maximum or rounds_agree(warmup[-2], warmup[-1]), warmup


def test_timed_rounds_start_after_a_steady_warm_up_that_follows_the_verification_run(pytester, run_user):
    """Live baseline, then stored baselines (no baseline model loaded): the same rule both times."""
    pytester.makeconftest(COUNTING_CONFTEST)
    calls_file = pytester.path / "calls.json"
    maximum = warmup_bounds(1, compiled=False, cuda=False)[1]
    live = run_user(STEADY_TEST, "--opt-rounds=1", "--opt-warmup=1", "--opt-baselines=bl", "--opt-update-baselines")
    live.result.assert_outcomes(passed=1)
    entry = live.test("test_static_steady")
    for side in ("baseline", "optimized"):
        _check_warm_up_rule(entry[side], maximum)
    calls = json.loads(calls_file.read_text())
    verified = calls.index("verified")
    # after the verification run: warm-up rounds, the timed rounds, then the census's one untimed call
    after = calls[verified + 1:].count("generate") - entry["optimized"]["rounds"] - 1
    assert after >= 1, calls  # at least one warm-up round between the verification run and the timed rounds
    assert calls[:verified].count("generate") - 1 + after == len(entry["optimized"]["warmup_s"]), calls

    calls_file.unlink()
    stored = run_user(STEADY_TEST, "--opt-rounds=1", "--opt-warmup=1", "--opt-baselines=bl")
    stored.result.assert_outcomes(passed=1)
    entry = stored.test("test_static_steady")
    assert any("stored baseline" in note for note in entry["notes"]), entry["notes"]
    _check_warm_up_rule(entry["optimized"], maximum)
    calls = json.loads(calls_file.read_text())
    assert calls[calls.index("verified") + 1:].count("generate") - entry["optimized"]["rounds"] - 1 >= 1, calls


# -- item 18: progress lines ----------------------------------------------------------------------------
# The fast path: the built-in model with 3 training steps (a new fingerprint, so it is really built,
# in seconds instead of minutes) and progress thresholds short enough to see every kind of line. Set with
# monkeypatch, undone after the test: the in-process run shares this worker's modules, and a spec left
# patched made later tests here build their own model (or find no shipped weights for it).


def _fast_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_transformers_opt.engine import loading, progress

    name = "tiny-random-llama"
    monkeypatch.setitem(tiny_models.TINY_MODELS, name,
                        dataclasses.replace(tiny_models.TINY_MODELS[name], train_steps=3))
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(loading, "LOAD_ANNOUNCE_AFTER_S", 0.0)


PROGRESS_TEST = """
import pytest

@pytest.mark.optimization("sdpa")
def test_generates(opt_bench):
    opt_bench(max_new_tokens=2)
"""

PROGRESS_LINE = re.compile(r"^transformers-opt: (building built-in model|still building|loading) ")


def _progress_lines(result: pytest.RunResult) -> list[str]:
    return [line for line in result.outlines if PROGRESS_LINE.match(line)]


@pytest.mark.parametrize("verbosity", ["default", "-qq"])
def test_long_work_prints_progress_lines_unless_very_quiet(pytester, monkeypatch, verbosity):
    cache = pytester.path / "empty-model-cache"
    monkeypatch.setenv(tiny_models.CACHE_ENV, str(cache))  # a machine that never built the model
    _fast_build(monkeypatch)
    pytester.makepyfile(test_user=PROGRESS_TEST)
    args = [*FAST_ARGS, "--opt-rounds=1", "--opt-warmup=0", "-p", "no:randomly"]
    result = pytester.runpytest(*args, *([verbosity] if verbosity != "default" else []))
    assert result.ret == 0, result.stdout.str()  # -qq prints no summary line to parse
    assert list(cache.glob("tiny-random-llama-*/model.safetensors")), "the model was not built into the empty cache"
    lines = _progress_lines(result)
    if verbosity == "-qq":
        assert lines == [] and "transformers-opt:" not in result.stdout.str()
        return
    text = "\n".join(lines)
    # start (with the estimate and where it is cached), heartbeat with the training step, end with its time
    assert re.search(r"building built-in model tiny-random-llama \(first use on this machine, about \d+ (min|s) on an "
                     r"idle machine(, longer here: load [\d.]+ on \d+ cores?)?; cached in .*empty-model-cache", text), text
    assert re.search(r"still building built-in model tiny-random-llama(: training step \d/3, about \d+ (s|min) left at "
                     r"the pace so far)? \(\d+ s so far\)", text), text
    assert re.search(r"building built-in model tiny-random-llama: done in \d+(\.\d+)? (s|ms)", text), text
    assert re.search(r"loading tiny-random-llama \[eager\] on cpu: done in ", text), text
    # each line on a line of its own: the test's dot and the summary are not glued to one
    assert all(line.startswith("transformers-opt: ") for line in lines)
    assert re.search(r"^(test_user\.py )?\.\s+\[100%\]$", result.stdout.str(), re.M), result.stdout.str()


class _Reporter:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write_line(self, line: str) -> None:
        self.lines.append(line)

    def flush(self) -> None:
        pass


class _Config:
    """What progress.py reads of a pytest config: its plugins and its verbosity."""

    def __init__(self, reporter: _Reporter, verbosity: int = 0) -> None:
        self.reporter, self.verbosity = reporter, verbosity
        self.pluginmanager = self

    def get_plugin(self, name: str):
        return self.reporter if name == "terminalreporter" else None

    def get_verbosity(self) -> int:
        return self.verbosity


def test_progress_lines_nest_and_stay_quiet_for_short_work(monkeypatch):
    from pytest_transformers_opt.engine import progress

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.01)
    reporter, quiet_reporter = _Reporter(), _Reporter()
    config, quiet = _Config(reporter), _Config(quiet_reporter, verbosity=-2)
    progress.install(quiet)
    progress.install(config)  # the innermost session's terminal is used
    try:
        with progress.long_work("quick work", after_s=30):
            pass
        assert reporter.lines == []  # finished before it was worth a line
        with progress.long_work("measuring", after_s=0.01):
            with progress.long_work("compiling", detail="first call") as inner:
                inner.status = "tracing"
                time.sleep(0.2)
        lines = reporter.lines
        start, end = lines.index("transformers-opt: compiling (first call) ..."), len(lines) - 1 - [
            line.startswith("transformers-opt: compiling: done in") for line in reversed(lines)].index(True)
        assert any(line.startswith("transformers-opt: still compiling: tracing (") for line in lines[start:end])
        assert not any("measuring" in line for line in lines[start:end]), lines  # the inner work speaks for both
        with pytest.raises(ValueError):
            with progress.long_work("failing work"):
                raise ValueError("x")
        assert reporter.lines[-1].startswith("transformers-opt: failing work: failed after ")
    finally:
        progress.uninstall(config)
    count = len(reporter.lines)
    worker = _Config(reporter)
    worker.workerinput = {"workerid": "gw0"}  # an xdist worker: its output is not shown, nothing is written
    progress.install(worker)
    with progress.long_work("after the session"):  # the enclosing session is -qq: nothing anywhere
        pass
    progress.uninstall(worker)
    progress.uninstall(quiet)
    assert len(reporter.lines) == count and quiet_reporter.lines == []


# -- item 19: no import noise ----------------------------------------------------------------------------
NOISY_TEST = """
import logging

import pytest
import torch


@pytest.mark.optimization("bnb_4bit", max_kl=10.0)
def test_compiles_then_fails(opt_model):
    # bitsandbytes was imported by the 4-bit load (setup); dynamo traces a step (torch's trace log)
    step = torch.compile(lambda x: x * 2, backend="eager")
    assert step(torch.ones(3)).sum() == 6
    logging.getLogger("user.code").warning("the user's own warning is kept")
    assert False, "boom"


@pytest.mark.optimization("bnb_4bit", max_kl=10.0)
def test_four_bit(opt_bench):
    opt_bench(max_new_tokens=2)
"""


def test_no_import_noise_in_output_captured_logs_or_warnings(pytester):
    """A fresh process (bitsandbytes and torch's inductor imported for the first time), under an
    ``-W error::DeprecationWarning`` filter and with the failing test's captured log shown."""
    pytester.makepyfile(test_user=NOISY_TEST)
    report = pytester.path / "r.json"
    result = pytester.runpytest_subprocess(*FAST_ARGS, "--opt-rounds=1", "--opt-warmup=0", "-p", "no:randomly",
                                           "-W", "error::DeprecationWarning", "--log-level=DEBUG",
                                           f"--opt-report-json={report}")
    out = result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=1, failed=1)
    assert "boom" in out and "the user's own warning is kept" in out  # what a user needs is still there
    assert "Captured log" in out
    assert "kernels-community" not in out and "No module named 'kernels'" not in out
    assert "torch.__trace" not in out
    assert "script_method" not in out
    assert {t["nodeid"].rsplit("::", 1)[1]: t["outcome"] for t in json.loads(report.read_text())["tests"]} == {
        "test_compiles_then_fails": "failed", "test_four_bit": "passed"}


def test_bitsandbytes_hub_kernel_refusals_are_dropped_and_other_failures_shown():
    """bitsandbytes falls back to its own CPU kernels when its hub kernel cannot load: the expected refusals
    (no kernels package; kernels >= 0.19 refusing an untrusted repository; the Hub off, HF_HUB_OFFLINE=1) are
    noise, a real failure is not."""
    import logging

    from pytest_transformers_opt.engine import quiet_logs  # noqa: F401  (the plugin imported it already)

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")

    def shown(reason: str) -> bool:
        record = logger.makeRecord(logger.name, logging.WARNING, "ops.py", 252,
                                   "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make "
                                   "sure you already `pip install kernels`", (reason,), None)
        return all(f.filter(record) for f in logger.filters)

    assert not shown("No module named 'kernels'")
    assert not shown("Kernel repository 'kernels-community/quantization-bitsandbytes' could not verify publisher "
                     "trust status. Set trust_remote_code=True or add the repository ID to the allowlist")
    assert not shown("Version 1 of 'kernels-community/quantization-bitsandbytes' is not available in the local "
                     "cache and Hugging Face Hub is in offline mode. Download the kernel while online first")
    assert shown("ConnectError: [Errno 111] Connection refused")
    assert shown("invalid ELF header")
