"""The A/B reference worker for real: a worker process under a wrapper-script interpreter (this very
environment, so its results must equal this process's), driven through ``ReferenceWorker``."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from pytest_transformers_opt.engine.ab_client import (ReferenceError, ReferenceRun, ReferenceStoppedAnswering,
                                                      ReferenceUnavailable, ReferenceWorker, ReferenceWorkerDied,
                                                      last_lines_text)
from pytest_transformers_opt.engine.ab_worker import CRASH_ENV, CRASH_STATUS, HANG_ENV, installed_distributions
from pytest_transformers_opt.engine.generation import run_generation
from pytest_transformers_opt.engine.hardware import HardwareInfo
from pytest_transformers_opt.engine.loading import ModelRequest, load_model, resolve_model_path
from pytest_transformers_opt.engine.measure import RoundTiming
from pytest_transformers_opt.engine.model import OptModel
from pytest_transformers_opt.techniques import GenerationSettings, ProbeContext, Technique, build_registry

PROMPTS = ["Hello there", "The cat sat on the mat and"]
NEW_TOKENS = 6
REQUEST = ModelRequest("tiny-random-llama")
THREADS = 1


def wrapper(folder: Path, lines: str = "") -> str:
    """A reference interpreter as a user might give one: a script that execs this environment's Python."""
    script = folder / "reference-python"
    script.write_text(f"#!/bin/sh\n{lines}exec {sys.executable} \"$@\"\n")
    script.chmod(0o755)
    return str(script)


def gone(pid: int) -> bool:
    """The process no longer runs (no such process, or a zombie nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone(pid)


def technique(name: str) -> Technique:
    return build_registry().resolve(name)


def stand_in(name: str) -> Technique:
    """This process's side of a technique that a conftest registers in the reference."""
    made: Technique = type("StandIn", (Technique,), {"name": name})()
    return made


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model_path(REQUEST)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceWorker]:
    # the wrapper's echo lands on the protocol pipe before the worker takes it over: the client sets it aside
    python = wrapper(tmp_path_factory.mktemp("reference"), "echo 'the wrapper says hello on stdout'\n")
    started = ReferenceWorker.start(python, threads=THREADS, timeout_s=240)
    yield started
    started.close()
    assert wait_gone(started.pid)


@pytest.fixture(scope="module")
def eager(worker: ReferenceWorker, model_path: str) -> dict[str, Any]:
    return worker.load("eager", REQUEST, model_path, [technique("eager")], "cpu", [])


@pytest.fixture(scope="module")
def here(model_path: str) -> Any:
    """The same workload in this process (the candidate's side): tokens and log-probabilities."""
    ctx = ProbeContext(hardware=HardwareInfo(device="cpu"))
    key = ("ab-test", "eager")
    loaded = load_model(REQUEST, model_path, [technique("eager")], ctx, "cpu", key)
    opt = OptModel(loaded=loaded, techniques=[technique("eager")], generation=GenerationSettings(), request=REQUEST,
                   device="cpu", probe_context=ctx)
    return run_generation(opt, PROMPTS, NEW_TOKENS, keep_logits=True)


def test_ready_reports_the_reference_stack(worker: ReferenceWorker) -> None:
    assert worker.alive()
    # every distribution, as this very environment has them (the seven the plugin names among them, and the rest)
    assert worker.versions == installed_distributions()
    assert worker.versions["optimum-quanto"] == importlib.metadata.version("optimum-quanto")
    assert {"torch", "transformers", "numpy", "pytest"} <= set(worker.versions) and len(worker.versions) > 20
    assert worker.python_version == ".".join(map(str, sys.version_info[:3]))
    assert worker.python.endswith("reference-python")
    assert "(stdout) the wrapper says hello on stdout" in worker.stderr_lines()
    assert os.getsid(worker.pid) != os.getsid(0)  # out of the terminal's process group: Ctrl-C goes to pytest only


def test_a_round_there_generates_what_this_process_generates(worker: ReferenceWorker, eager: dict[str, Any],
                                                             here: Any) -> None:
    assert eager["ok"] and eager["skip"] is None and eager["labels"] == ["eager"]
    assert eager["load_time_s"] > 0 and eager["memory_method"]
    run = worker.generate("eager", PROMPTS, NEW_TOKENS, batch_size=None)
    assert isinstance(run, ReferenceRun) and isinstance(run.timing, RoundTiming)
    assert run.timing.steps == NEW_TOKENS and run.timing.tokens == NEW_TOKENS * len(PROMPTS)
    assert run.timing.latency_s > 0 and run.timing.ttft_s is not None
    assert run.tokens == here.tokens and run.texts == here.texts
    assert run.logprobs is None and run.generation_peak_bytes is None and run.problems is None


def test_logits_memory_and_the_proof_come_back(worker: ReferenceWorker, eager: dict[str, Any], here: Any) -> None:
    run = worker.generate("eager", PROMPTS, NEW_TOKENS, batch_size=1, keep_logits=True, observe=True, memory=True)
    assert run.tokens == here.tokens
    assert run.logprobs is not None and len(run.logprobs) == len(PROMPTS)
    for theirs, ours in zip(run.logprobs, here.logprobs):
        assert theirs.dtype == torch.float32 and theirs.shape == ours.shape
        torch.testing.assert_close(theirs, ours.float(), atol=1e-4, rtol=1e-4)
    assert run.generation_peak_bytes is not None and run.memory_method
    assert run.problems == []
    assert not list(Path(worker._scratch or "/nonexistent").glob("*.safetensors"))  # read, then removed


def test_forced_tokens_are_decoded_there(worker: ReferenceWorker, eager: dict[str, Any], here: Any) -> None:
    forced = [[t + 1 for t in row] for row in here.tokens]
    run = worker.generate("eager", PROMPTS, NEW_TOKENS, batch_size=None, force_tokens=forced)
    assert run.tokens == forced
    assert run.logprobs is not None and [tuple(t.shape) for t in run.logprobs] == \
        [(NEW_TOKENS, here.logprobs[0].shape[-1])] * len(PROMPTS)


def test_a_technique_the_reference_cannot_run_is_a_skip_with_its_probe_reason(worker: ReferenceWorker,
                                                                                model_path: str) -> None:
    flash = technique("flash_attention_2")
    why_here = flash.probe(ProbeContext(hardware=HardwareInfo(device="cpu")))
    assert why_here  # this machine has no CUDA GPU: the reference probes the same
    response = worker.load("flash", REQUEST, model_path, [flash], "cpu", [])
    assert response["skip"] == f"in the reference environment: {why_here}"
    assert response["load_time_s"] is None
    with pytest.raises(ReferenceError, match="no configuration loaded under the key 'flash'"):
        worker.generate("flash", PROMPTS, 2, batch_size=None)


def test_a_failed_request_is_answered_and_the_worker_runs_on(worker: ReferenceWorker, eager: dict[str, Any]) -> None:
    with pytest.raises(ReferenceError) as failed:
        worker.generate("eager", PROMPTS, NEW_TOKENS, batch_size=None, force_tokens=[[1, 2]])
    assert failed.value.error == "ValueError: 2 prompts but 1 forced token lists"
    assert "Traceback" in (failed.value.traceback or "") and "\n" not in failed.value.error
    assert isinstance(failed.value, RuntimeError)
    assert worker.alive()
    assert len(worker.generate("eager", PROMPTS[:1], 4, batch_size=None).tokens[0]) == 4


NOISY_CONFTEST = """
    import contextlib
    import os

    import torch

    from pytest_transformers_opt.techniques import Technique

    print("conftest: printed to stdout while importing")


    class Noisy(Technique):
        name = "ab_noisy"
        summary = "does nothing but print, to stdout and straight to file descriptor 1"

        def configure_generation(self, gen, ctx):
            print(f"noisy: threads={torch.get_num_threads()}")

        def around_generate(self, model):
            os.write(1, b"noisy: written to fd 1 around generate\\n")
            return contextlib.nullcontext()


    def pytest_opt_register_techniques(registry):
        registry.register(Noisy)
"""


def test_conftest_techniques_run_there_and_prints_never_break_the_protocol(worker: ReferenceWorker, model_path: str,
                                                                           here: Any, tmp_path: Path) -> None:
    conftest = tmp_path / "conftest.py"
    conftest.write_text(textwrap.dedent(NOISY_CONFTEST))
    noisy = stand_in("ab_noisy")
    response = worker.load("noisy", REQUEST, model_path, [technique("eager"), noisy], "cpu", [str(conftest)])
    assert response["skip"] is None and response["labels"] == ["eager", "ab_noisy"]
    run = worker.generate("noisy", PROMPTS, NEW_TOKENS, batch_size=None)
    assert run.tokens == here.tokens
    deadline = time.monotonic() + 5
    while "noisy: written to fd 1 around generate" not in worker.stderr_lines() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = worker.stderr_lines()
    assert "noisy: written to fd 1 around generate" in lines and f"noisy: threads={THREADS}" in lines
    # a technique nothing registered there: a skip, saying so
    unknown = worker.load("unknown", REQUEST, model_path, [stand_in("ab_unregistered")], "cpu", [])
    assert unknown["skip"].startswith("in the reference environment: its catalogue: unknown technique 'ab_unregistered'")


def test_a_conftest_that_cannot_be_imported_there_is_a_skip_naming_it(worker: ReferenceWorker, model_path: str,
                                                                      tmp_path: Path) -> None:
    conftest = tmp_path / "conftest.py"
    conftest.write_text("raise RuntimeError('broken on purpose')\n")
    response = worker.load("broken", REQUEST, model_path, [technique("eager")], "cpu", [str(conftest)])
    assert response["skip"] == f"the reference environment could not load {conftest}: RuntimeError: broken on purpose"
    assert worker.alive()


def test_an_interpreter_that_is_not_there_is_unavailable(tmp_path: Path) -> None:
    missing = tmp_path / "venv" / "bin" / "python"
    with pytest.raises(ReferenceUnavailable) as raised:
        ReferenceWorker.start(str(missing), threads=THREADS)
    assert raised.value.reason == f"the reference interpreter {missing} does not exist ({tmp_path} has no 'venv')"
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ReferenceUnavailable, match=r"is a link to .*elsewhere, which does not exist"):
        ReferenceWorker.start(str(missing), threads=THREADS)
    (tmp_path / "venv" / "bin" / "python").unlink()
    (tmp_path / "venv" / "bin" / "python").write_text("#!/bin/sh\n")
    with pytest.raises(ReferenceUnavailable, match=r"is a folder, not an interpreter; a virtual environment\? give "
                                                    r"its interpreter, .*/venv/bin/python"):
        ReferenceWorker.start(str(tmp_path / "venv"), threads=THREADS)
    with pytest.raises(ReferenceUnavailable, match=r"python is not executable \(mode -rw"):
        ReferenceWorker.start(str(missing), threads=THREADS)
    with pytest.raises(ReferenceUnavailable, match="'no-such-python-3.99' is not a path and is not on PATH"):
        ReferenceWorker.start("no-such-python-3.99", threads=THREADS)


def test_an_interpreter_without_torch_is_unavailable_with_one_line(tmp_path: Path) -> None:
    fake = tmp_path / "shadow" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no torch in this environment (a stand-in)')\n")
    python = wrapper(tmp_path, f'export PYTHONPATH="{fake.parent}:$PYTHONPATH"\n')
    with pytest.raises(ReferenceUnavailable) as raised:
        ReferenceWorker.start(python, threads=THREADS, timeout_s=120)
    assert raised.value.reason == ("the reference environment cannot import torch: ImportError: no torch in this "
                                   "environment (a stand-in)")


def test_an_interpreter_that_never_gets_ready_is_unavailable_and_killed(tmp_path: Path) -> None:
    script = tmp_path / "hangs"
    script.write_text("#!/bin/sh\necho 'starting, slowly' >&2\nexec sleep 60\n")
    script.chmod(0o755)
    began = time.monotonic()
    with pytest.raises(ReferenceUnavailable) as raised:
        ReferenceWorker.start(str(script), threads=THREADS, timeout_s=1)
    assert raised.value.reason == f"the reference interpreter {script} did not get its worker ready within 1 s: " \
                                  f"starting, slowly"
    assert time.monotonic() - began < 4  # killed, not waited for


def test_a_worker_that_dies_mid_round_says_how_and_leaves_nothing(tmp_path: Path, model_path: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CRASH_ENV, "generate:2")
    dying = ReferenceWorker.start(wrapper(tmp_path), threads=THREADS, timeout_s=240)
    try:
        dying.load("eager", REQUEST, model_path, [technique("eager")], "cpu", [])
        assert len(dying.generate("eager", PROMPTS, 4, batch_size=None).tokens) == len(PROMPTS)
        with pytest.raises(ReferenceWorkerDied) as died:
            dying.generate("eager", PROMPTS, 4, batch_size=None)
    finally:
        dying.close()
    assert died.value.returncode == CRASH_STATUS
    message = str(died.value)
    # the configuration in words (never the session's internal key), and the lines it wrote on stderr
    assert (f"died during a round of [eager] on tiny-random-llama: exit status {CRASH_STATUS}; its last lines on "
            f"stderr:") in message
    assert f"{CRASH_ENV}=generate:2: exiting with status {CRASH_STATUS} without answering" in message
    assert gone(dying.pid) and not dying.alive()
    with pytest.raises(ReferenceWorkerDied, match="was closed before"):
        dying.generate("eager", PROMPTS, 4, batch_size=None)


def test_close_ends_the_worker_at_the_end_of_its_input_and_removes_its_folders(tmp_path: Path) -> None:
    started = ReferenceWorker.start(wrapper(tmp_path), threads=THREADS, timeout_s=240)
    folders = [Path(started._pythonpath), Path(started._scratch or "")]
    assert all(folder.is_dir() for folder in folders)
    assert (folders[0] / "pytest_transformers_opt").is_symlink() and len(list(folders[0].iterdir())) == 1
    started.close()
    started.close()  # idempotent
    assert started.process.returncode == 0  # ended by the end of its input, not killed
    assert gone(started.pid) and not any(folder.exists() for folder in folders)


DIES_WITH_A_WORKER = """
import os, signal, sys
from pytest_transformers_opt.engine.ab_client import ReferenceWorker

worker = ReferenceWorker.start(sys.argv[1], threads=1, timeout_s=240)
print(worker.pid, worker._pythonpath, worker._scratch, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no close: only the kernel can end the worker now
"""


def test_no_worker_outlives_a_killed_parent(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(DIES_WITH_A_WORKER)
    done = subprocess.run([sys.executable, str(script), wrapper(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    pid, *folders = done.stdout.split()
    try:
        assert wait_gone(int(pid)), f"worker {pid} outlived its parent"
    finally:  # a killed parent and a killed worker remove nothing: this test does
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def test_a_worker_that_stops_answering_is_killed_at_the_request_time_limit(tmp_path: Path, model_path: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HANG_ENV, "generate:2")
    hanging = ReferenceWorker.start(wrapper(tmp_path), threads=THREADS, timeout_s=240)
    try:
        hanging.load("eager", REQUEST, model_path, [technique("eager")], "cpu", [], timeout_s=120)
        assert len(hanging.generate("eager", PROMPTS, 4, batch_size=None, timeout_s=120).tokens) == len(PROMPTS)
        began = time.monotonic()
        with pytest.raises(ReferenceStoppedAnswering) as stopped:
            hanging.generate("eager", PROMPTS, 4, batch_size=None, timeout_s=2)
        waited = time.monotonic() - began
    finally:
        hanging.close()
    assert 2 <= waited < 10 and stopped.value.seconds == 2
    assert str(stopped.value) == (f"the reference worker ({hanging.python}, pid {hanging.pid}) did not answer a round "
                                  f"of [eager] on tiny-random-llama within 2 s and was killed")
    assert wait_gone(hanging.pid) and not hanging.alive()


def test_the_last_lines_of_a_dead_worker_leave_blank_ones_out_or_say_there_were_none() -> None:
    assert last_lines_text(["", "  ", "\t"]) == "; it wrote nothing on stderr"
    assert last_lines_text([]) == "; it wrote nothing on stderr"
    assert last_lines_text(["", "Traceback (most recent call last):", "", "MemoryError  "]) == \
        "; its last lines on stderr:\n  Traceback (most recent call last):\n  MemoryError"
