"""Shared helpers: run a user's test file through a real pytest session (pytester), fast."""

from __future__ import annotations

import fcntl
import functools
import gc
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

# Compiled graphs cost the suite most of its cold-cache time (inductor's g++, about 1.5 s a kernel on 2 cores). Two
# habits keep them few:
# - tests that compile tiny-random-llama and do not care about the workload use opt_bench's default one, so inductor's
#   cache finds the graph the first of them compiled (not the README's main job's: inductor's CPU code is made for the
#   thread count, one per xdist worker here, two there);
# - inductor compiles in the process that asks (set before torch is imported): its default pool of compile workers,
#   two processes that each import torch, saved no time on 2 shared cores and cost 3 CPU-seconds a compiling process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# pytester's in-process runs drop every module first imported inside them when they end. torch
# extensions register C++ operator libraries once per process, so re-importing them in the next
# run fails ("Only a single TORCH_LIBRARY ..."). Importing them here, in the outer process, keeps
# them for every inner run.
import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401
import torch._inductor  # noqa: E402,F401
import torch.distributed._functional_collectives  # noqa: E402,F401
import transformers  # noqa: E402,F401
from transformers import (AutoModelForCausalLM, BitsAndBytesConfig, GPT2LMHeadModel, LlamaForCausalLM,  # noqa: E402,F401
                          MistralForCausalLM, Qwen3ForCausalLM)
from transformers.generation import ContinuousBatchingConfig  # noqa: E402,F401
import transformers.generation.continuous_batching  # noqa: E402,F401
import transformers.integrations.bitsandbytes  # noqa: E402,F401
import bitsandbytes  # noqa: E402,F401
import optimum.quanto  # noqa: E402,F401
import hqq  # noqa: E402,F401
import accelerate  # noqa: E402,F401
# hypothesis' pytest plugin imports hypothesis (some 75 modules, each rewritten by pytest's assertion rewriter, with no
# bytecode cache under PYTHONDONTWRITEBYTECODE) in every in-process run that has not got it yet: kept here, once.
import hypothesis  # noqa: E402,F401
# jsonschema (and attrs, referencing, rpds: some 40 modules) is imported by the first report read or written inside a
# run, and was imported again by each of them: 38 times in 93 tests, a third of their reports' validation time
import jsonschema  # noqa: E402,F401
import jsonschema.exceptions  # noqa: E402,F401

from pytest_transformers_opt.engine import tiny_models  # noqa: E402

# The same for the plugin's own modules: a session imports its stages on first use, and an in-process
# run would drop them at its end, so the next run imported (and pytest's assertion rewriter parsed and
# rewrote, with no bytecode cache under PYTHONDONTWRITEBYTECODE) some 100 modules again: about a third
# of each run's time. Imported once here, they stay, as they would in a user's one session.
import pkgutil  # noqa: E402
import pytest_transformers_opt  # noqa: E402

for _module in pkgutil.walk_packages(pytest_transformers_opt.__path__, "pytest_transformers_opt."):
    if not _module.name.endswith(("__main__", "tp_worker")):  # scripts, run as their own processes
        importlib.import_module(_module.name)
from pytest_transformers_opt.report.schema import validate_report  # noqa: E402

from model_shapes import LLAMA_8B  # noqa: E402  (tests/ is on sys.path: pytest's rootdir conftest import)

# Resolved now, before pytester points HOME at a temporary folder: inner runs use the real cache
# of built-in models instead of training a fresh one each.
_MODEL_CACHE = str(tiny_models.cache_root())


INNER_ADDOPTS = "-p no:randomly -p no:asyncio"


@pytest.hookimpl(tryfirst=True)  # as pytest-xdist's is; registered after it, so this one runs first
def pytest_cmdline_main(config: pytest.Config) -> None:
    """This suite under ``-n`` steals work unless --dist was given: its tests range from milliseconds to minutes
    (the real-model tier, the matrix), and under ``load`` one worker was left with a queue of them for the
    last ~140 s of a 700 s run while the other idled (benchmarks/RESULTS.md, the suite's time). Runs before
    pytest-xdist's hook, which would make ``-n``'s unset distribution ``load``."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "no":
        config.option.dist = "worksteal"


# The suite's longest tests (40-80 s each on 2 cores), run first: work stealing then fits the short tests around
# them, where one of them started last kept its worker busy for a minute after the other had finished. Not the
# tests that share an inner -n 2 session (xdist_run, test_merge's runs): both workers would wait on its lock.
LONGEST_FIRST = (
    "test_real_model.py::test_real_model_tier_passes_lossy_techniques_and_continuous_batching_with_default_budgets",
    "test_compile_cache.py::test_second_run_is_warm_and_a_torch_change_misses",
    "test_real_model.py::test_real_model_tier_passes_lossless_techniques_with_default_budgets",
    "test_matrix.py::test_every_technique_on_every_architecture_passes_or_says_why",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.rsplit("/", 1)[-1], len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(tryfirst=True)  # before any fixture of the test is made: they are the test's, not frozen
def pytest_runtest_setup(item: pytest.Item) -> None:
    """What this worker holds between tests is frozen before each one. The plugin freezes the stack, and before each
    test what was imported since (engine/measure.py), as a user's one session needs; this worker's hundreds of
    in-process sessions leave survivors behind that it never froze (25k objects after the first test, 107k after 90), and every
    memory reading's full collection scanned them: 10 ms, then 130 ms each, several times a test. A test's own
    collection then scans only what the test made (1 ms), and three files' 93 tests ran in 14 s, not 20.
    Collected first, so nothing dead is frozen."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _hermetic_inner_runs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inner pytest runs use the real model cache, see no PYTEST_OPT_* or PYTEST_XDIST_* variable from outside, and run
    torch on one thread (the tiny models gain nothing from more; on 2 shared cores spinning threads
    make each run several times slower)."""
    monkeypatch.setenv(tiny_models.CACHE_ENV, _MODEL_CACHE)
    for key in list(os.environ):
        # PYTEST_XDIST_*: under `pytest -n 2` this process is a worker, the inner run is not (pytest-benchmark
        # would take it for one and disable itself)
        if key.startswith(("PYTEST_OPT_", "PYTEST_XDIST_")):
            monkeypatch.delenv(key)
    # plugins of the test extra that act on every session once installed (for tests/integration/test_plugin_compat.py):
    # pytest-randomly reorders and reseeds, pytest-asyncio warns at start-up (an error under -W error). Inner runs
    # go without them; a test that wants one names it (`-p randomly` after this undoes the `no:`). pytester clears
    # PYTEST_ADDOPTS when it is made: made first, so that this is set after
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")
    monkeypatch.setenv("PYTEST_ADDOPTS", INNER_ADDOPTS)
    # the plugin sets torch's threads at its hardware probe (--opt-cpu-threads, auto: all the cores outside
    # xdist): inner runs keep the one thread; tests of that option unset this
    monkeypatch.setenv("PYTEST_OPT_CPU_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_CHECKOUT = str(Path(__file__).resolve().parents[1])


@pytest.fixture(autouse=True)
def _checkout_stays_off_sys_path() -> Iterator[None]:
    """A test that leaves the checkout on ``sys.path`` (a script loaded in-process: they put it there to run
    uninstalled) errors here. Left there, the checkout's ``*.egg-info`` is a second pytest11 distribution for every
    later in-process run of this worker, which then warns that the plugin "cannot be rewritten": two warnings in
    the outcome counts of whichever tests xdist happened to send there (CI failed on it twice)."""
    was_there = _CHECKOUT in sys.path
    yield
    if not was_there and _CHECKOUT in sys.path:
        sys.path[:] = [entry for entry in sys.path if entry != _CHECKOUT]
        pytest.fail(f"this test left {_CHECKOUT} on sys.path: load scripts with benchmark_scripts.load_module_file",
                    pytrace=False)


@pytest.fixture()
def model_dir(tmp_path: Path) -> str:
    """A folder holding only Llama-3.1-8B's config.json: what the advisor reads (never weights)."""
    folder = tmp_path / "llama-8b-shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    return str(folder)


# Few rounds keep the suite quick on 2 cores; the figures are still real measurements.
FAST_ARGS = ("-p", "no:cacheprovider", "--opt-rounds=2", "--opt-warmup=1")


class UserRun:
    def __init__(self, result: pytest.RunResult, report_path: Path) -> None:
        self.result = result
        self.report_path = report_path

    @functools.cached_property
    def report(self) -> dict[str, Any]:
        """The run's JSON report, checked against the package's JSON Schema (read and checked once)."""
        report = json.loads(self.report_path.read_text())
        validate_report(report)
        return report

    def test(self, name: str) -> dict[str, Any]:
        for entry in self.report["tests"]:
            if entry["nodeid"].endswith("::" + name):
                return entry
        raise KeyError(f"{name} not in report: {[t['nodeid'] for t in self.report['tests']]}")


@pytest.fixture
def run_user(pytester: pytest.Pytester) -> Callable[..., UserRun]:
    """Write ``test_user.py`` (and an optional conftest) and run pytest on it with a JSON report."""

    def run(source: str, *args: str, conftest: str | None = None) -> UserRun:
        if conftest is not None:
            pytester.makeconftest(conftest)
        pytester.makepyfile(test_user=source)
        report = pytester.path / "opt-report.json"
        result = pytester.runpytest(*FAST_ARGS, f"--opt-report-json={report}", *args)
        assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
        return UserRun(result, report)

    return run


# One `pytest -n 2` session over a small project, run once per suite run (under the suite's own xdist too) and
# inspected by the xdist tests of test_gating.py, test_benchmark_export.py and test_history.py: each inner worker
# is a fresh process importing torch and transformers (tens of seconds on the loaded 2 cores), so the three
# sessions they ran became one, with every output they look at.
XDIST_PROJECT = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=3)

@pytest.mark.parametrize("tokens", [3])
@pytest.mark.optimization("static_cache")
def test_static(opt_bench, tokens):
    opt_bench(max_new_tokens=tokens)

@pytest.mark.optimization("flash_attention_2")
def test_skipped_on_cpu(opt_bench):
    opt_bench()

@pytest.mark.optimization("bnb_8bit")
def test_8bit(opt_bench):
    opt_bench(max_new_tokens=3)
'''
XDIST_ROUNDS = 2
XDIST_ARGS = ("-n", "2", "-p", "no:cacheprovider", f"--opt-rounds={XDIST_ROUNDS}", "--opt-warmup=0",
              "--opt-report-json=report.json", "--opt-report", "--benchmark-json=benchmark.json", "--opt-history=runs")


class XdistRun:
    """The session's project folder (test_user.py, report.json, benchmark.json, runs/) and its pytest result."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        done = json.loads((folder / "result.json").read_text())
        self.result = pytest.RunResult(done["ret"], done["stdout"].splitlines(), done["stderr"].splitlines(),
                                       done["duration"])


@pytest.fixture(scope="session")
def xdist_run(tmp_path_factory: pytest.TempPathFactory) -> XdistRun:
    """``pytest`` + :data:`XDIST_ARGS` over :data:`XDIST_PROJECT` in a subprocess, as pytester runs one (its
    environment made as :func:`_hermetic_inner_runs` makes it), made by the first test that asks."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the outer session's workers share it: the other one waits, then reads it
    folder = shared / "xdist-run"
    with open(shared / "xdist-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "result.json").exists():
            folder.mkdir(exist_ok=True)
            (folder / "test_user.py").write_text(XDIST_PROJECT)
            env = {key: value for key, value in os.environ.items()
                   if not key.startswith(("PYTEST_OPT_", "PYTEST_XDIST_", "PYTEST_ADDOPTS"))}
            env.update({tiny_models.CACHE_ENV: _MODEL_CACHE, "PYTEST_ADDOPTS": INNER_ADDOPTS,
                        "PYTEST_OPT_CPU_THREADS": "1", "HOME": str(folder), "PY_COLORS": "0"})
            start = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "pytest", f"--basetemp={folder / 'basetemp'}", *XDIST_ARGS],
                                  cwd=folder, env=env, capture_output=True, text=True, timeout=600, check=False)
            (folder / "result.json").write_text(json.dumps({"ret": done.returncode, "stdout": done.stdout,
                                                            "stderr": done.stderr,
                                                            "duration": time.monotonic() - start}))
    return XdistRun(folder)

