"""One GPU set per xdist worker (``--opt-gpus-per-worker``), tested on a CPU machine with faked GPUs.

The assignment is pure logic over a list of device names, so faked ``CUDA_VISIBLE_DEVICES`` values
and device counts exercise all of it; the end-to-end tests run ``pytest -n 2`` in a subprocess with
``CUDA_VISIBLE_DEVICES`` set and read back what each worker saw.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from pytest_transformers_opt.engine import gpu_pinning
from pytest_transformers_opt.errors import OptConfigError
from pytest_transformers_opt.engine.gpu_pinning import (CUDA_VISIBLE_DEVICES, ENV_VAR, GpuPinningPlugin, PINNED_KEY,
                                                 assign_gpus, auto_num_workers, nvml_device_count, pin_worker,
                                                 plan_description, visible_gpus, worker_index)

FOUR = ["0", "1", "2", "3"]
UUIDS = ["GPU-0a1b2c3d-0000-1111-2222-333344445555", "GPU-0a1b2c3d-0000-1111-2222-333344446666",
         "GPU-0a1b2c3d-0000-1111-2222-333344447777", "GPU-0a1b2c3d-0000-1111-2222-333344448888"]


def _count(n: int) -> Callable[[], int]:
    return lambda: n


def _never() -> int:
    raise AssertionError("device_count must not be called when CUDA_VISIBLE_DEVICES is set")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA_VISIBLE_DEVICES or PYTEST_OPT_* from the machine running these tests."""
    monkeypatch.delenv(CUDA_VISIBLE_DEVICES, raising=False)
    for key in list(os.environ):
        if key.startswith("PYTEST_OPT_"):
            monkeypatch.delenv(key)


def fake_config(option: Any = None, *, worker: str | None = None, workers: int = 2, ini: str = "",
                dist: str = "no", tx: list[str] | None = None) -> SimpleNamespace:
    """Just what the pinning reads from a pytest config: getoption, getini, workerinput, stash."""
    options = {"opt_gpus_per_worker": option, "dist": dist, "tx": tx or []}
    config = SimpleNamespace(getoption=lambda name, default=None: options.get(name, default),
                             getini=lambda name: ini if name == "opt_gpus_per_worker" else "",
                             stash=pytest.Stash())
    if worker is not None:
        config.workerinput = {"workerid": worker, "workercount": workers}
    return config


# -- which GPUs are visible -------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "expected"), [
    ("0,1,2,3", FOUR),
    ("3,5,7,9", ["3", "5", "7", "9"]),
    (",".join(UUIDS), UUIDS),
    ("MIG-1f2e3d4c-aaaa-bbbb-cccc-ddddeeeeffff", ["MIG-1f2e3d4c-aaaa-bbbb-cccc-ddddeeeeffff"]),
    (" 0, 1 ,2,", ["0", "1", "2"]),
    ("0,0,1", ["0", "1"]),
    ("", []),
    ("-1", []),
    ("0,1,-1,2", ["0", "1"]),  # as CUDA: an invalid index hides itself and what follows
])
def test_visible_gpus_from_cuda_visible_devices(value: str, expected: list[str]) -> None:
    assert visible_gpus({CUDA_VISIBLE_DEVICES: value}, _never) == expected


def test_visible_gpus_counts_devices_when_the_variable_is_unset() -> None:
    assert visible_gpus({}, _count(4)) == FOUR
    assert visible_gpus({}, _count(0)) == []


def test_nvml_device_count_never_fails() -> None:
    count = nvml_device_count()  # 0 on a machine without a driver, the GPU count on one with
    assert isinstance(count, int) and count >= 0


def test_nvml_device_count_without_nvidia_ml_py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    assert nvml_device_count() == 0


def test_nvml_device_count_reads_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    fake = SimpleNamespace(nvmlInit=lambda: calls.append("init"), nvmlDeviceGetCount=lambda: 8,
                           nvmlShutdown=lambda: calls.append("shutdown"))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert nvml_device_count() == 8
    assert calls == ["init", "shutdown"]


# -- the assignment -----------------------------------------------------------------------------------
def test_four_gpus_two_workers_two_each() -> None:
    assert assign_gpus("gw0", 2, FOUR, 2) == ["0", "1"]
    assert assign_gpus("gw1", 2, FOUR, 2) == ["2", "3"]


def test_one_gpu_each() -> None:
    assert [assign_gpus(f"gw{i}", 1, FOUR, 4) for i in range(4)] == [["0"], ["1"], ["2"], ["3"]]


def test_fewer_workers_than_slots_leave_gpus_unused() -> None:
    assert assign_gpus("gw0", 1, FOUR, 2) == ["0"]
    assert assign_gpus("gw1", 1, FOUR, 2) == ["1"]


def test_a_subset_keeps_the_physical_indices() -> None:
    visible = visible_gpus({CUDA_VISIBLE_DEVICES: "3,5,7,9"}, _never)
    assert assign_gpus("gw0", 2, visible, 2) == ["3", "5"]
    assert assign_gpus("gw1", 2, visible, 2) == ["7", "9"]


def test_uuids_are_shared_out_as_given() -> None:
    assert assign_gpus("gw0", 2, UUIDS, 2) == UUIDS[:2]
    assert assign_gpus("gw1", 2, UUIDS, 2) == UUIDS[2:]


def test_the_slices_are_disjoint_and_cover_the_gpus() -> None:
    eight = [str(i) for i in range(8)]
    for per_worker in (1, 2, 4, 8):
        workers = 8 // per_worker
        slices = [assign_gpus(f"gw{i}", per_worker, eight, workers) for i in range(workers)]
        assert sorted(g for s in slices for g in s) == sorted(eight, key=int)
        assert all(len(s) == per_worker for s in slices)


def test_too_few_gpus_is_an_error_with_the_numbers() -> None:
    with pytest.raises(OptConfigError) as error:
        assign_gpus("gw0", 2, FOUR, 3, source="CUDA_VISIBLE_DEVICES=0,1,2,3")
    message = str(error.value)
    assert message.startswith("--opt-gpus-per-worker=2 with -n 3 needs 6 GPUs; found: 4 "
                              "(CUDA_VISIBLE_DEVICES=0,1,2,3)")
    assert "-n 2" in message  # what would fit


def test_no_gpu_at_all_is_an_error() -> None:
    with pytest.raises(OptConfigError, match=r"needs 2 GPUs; found: 0 \(CUDA_VISIBLE_DEVICES=''\)"):
        assign_gpus("gw0", 1, visible_gpus({CUDA_VISIBLE_DEVICES: ""}, _never), 2,
                    source=gpu_pinning.describe_source({CUDA_VISIBLE_DEVICES: ""}))


@pytest.mark.parametrize("worker_id", ["", "master", "gw", "gwx", "gw-1", "1", "GW0", "gw0 "])
def test_a_malformed_worker_id_is_an_error(worker_id: str) -> None:
    with pytest.raises(OptConfigError, match="is not a pytest-xdist worker id; accepted: gw0, gw1"):
        assign_gpus(worker_id, 1, FOUR, 2)


@pytest.mark.parametrize(("per_worker", "workers"), [(0, 2), (-1, 2), (True, 2), (1, 0)])
def test_bad_counts_are_errors(per_worker: Any, workers: int) -> None:
    with pytest.raises(OptConfigError, match="must be a whole number >= 1"):
        assign_gpus("gw0", per_worker, FOUR, workers)


def test_a_replacement_worker_takes_a_slot_in_range() -> None:
    # xdist numbers on past the worker count when it replaces a crashed worker (gw2 for -n 2).
    assert worker_index("gw12") == 12
    assert assign_gpus("gw2", 2, FOUR, 2) == ["0", "1"]
    assert assign_gpus("gw3", 2, FOUR, 2) == ["2", "3"]


# -- pin_worker: the option, the environment, the process ------------------------------------------------
def test_pin_worker_sets_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUDA_VISIBLE_DEVICES, "0,1,2,3")
    assert pin_worker(fake_config(2, worker="gw1")) == "gw1 pinned to GPUs 2,3"
    assert os.environ[CUDA_VISIBLE_DEVICES] == "2,3"


def test_pin_worker_counts_with_the_given_device_count_when_unset() -> None:
    assert pin_worker(fake_config(1, worker="gw0", workers=4), device_count=_count(4)) == "gw0 pinned to GPUs 0"
    assert os.environ[CUDA_VISIBLE_DEVICES] == "0"


def test_pin_worker_with_a_subset_and_uuids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUDA_VISIBLE_DEVICES, "3,5,7,9")
    assert pin_worker(fake_config(2, worker="gw1"), device_count=_never) == "gw1 pinned to GPUs 7,9"
    env = {CUDA_VISIBLE_DEVICES: ",".join(UUIDS)}
    assert pin_worker(fake_config(1, worker="gw3", workers=4), env=env) == f"gw3 pinned to GPUs {UUIDS[3]}"
    assert env[CUDA_VISIBLE_DEVICES] == UUIDS[3]


def test_pin_worker_too_few_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUDA_VISIBLE_DEVICES, "0,1,2,3")
    with pytest.raises(OptConfigError, match=r"--opt-gpus-per-worker=2 with -n 3 needs 6 GPUs; found: 4 "
                                             r"\(CUDA_VISIBLE_DEVICES=0,1,2,3\)"):
        pin_worker(fake_config(2, worker="gw0", workers=3))
    assert os.environ[CUDA_VISIBLE_DEVICES] == "0,1,2,3"  # left as it was


def test_pin_worker_without_nvml_or_variable_names_the_source() -> None:
    with pytest.raises(OptConfigError, match=r"needs 2 GPUs; found: 0 \(CUDA_VISIBLE_DEVICES unset, devices "
                                             r"counted by NVML\)"):
        pin_worker(fake_config(1, worker="gw0"), device_count=_count(0))
    assert CUDA_VISIBLE_DEVICES not in os.environ


def test_pin_worker_does_nothing_without_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUDA_VISIBLE_DEVICES, "0,1,2,3")
    assert pin_worker(fake_config(None, worker="gw1"), device_count=_never) is None
    assert os.environ[CUDA_VISIBLE_DEVICES] == "0,1,2,3"


def test_pin_worker_does_nothing_on_the_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUDA_VISIBLE_DEVICES, "0,1,2,3")
    assert pin_worker(fake_config(2), device_count=_never) is None
    assert os.environ[CUDA_VISIBLE_DEVICES] == "0,1,2,3"


def test_pin_worker_reads_the_environment_then_the_ini(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUDA_VISIBLE_DEVICES, "0,1,2,3")
    assert pin_worker(fake_config(None, worker="gw1", ini="2")) == "gw1 pinned to GPUs 2,3"
    monkeypatch.setenv(CUDA_VISIBLE_DEVICES, "0,1,2,3")
    monkeypatch.setenv(ENV_VAR, "1")
    assert pin_worker(fake_config(None, worker="gw1", ini="2")) == "gw1 pinned to GPUs 1"  # env beats ini
    monkeypatch.setenv(CUDA_VISIBLE_DEVICES, "0,1,2,3")
    assert pin_worker(fake_config(2, worker="gw1", ini="1")) == "gw1 pinned to GPUs 2,3"  # CLI beats env


@pytest.mark.parametrize(("env", "ini", "source"), [({ENV_VAR: "0"}, "", ENV_VAR), ({ENV_VAR: "two"}, "", ENV_VAR),
                                                   ({}, "1.5", "ini opt_gpus_per_worker")])
def test_a_bad_environment_or_ini_value_is_a_usage_error(env: dict[str, str], ini: str, source: str) -> None:
    with pytest.raises(pytest.UsageError, match=f"^{source}: .* must be a whole number >= 1"):
        pin_worker(fake_config(None, worker="gw0", ini=ini), env={CUDA_VISIBLE_DEVICES: "0,1", **env})


def test_pin_worker_refuses_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    env = {CUDA_VISIBLE_DEVICES: "0,1,2,3"}
    with pytest.raises(OptConfigError, match="cannot pin gw1 to GPUs 2,3: torch already initialised CUDA"):
        pin_worker(fake_config(2, worker="gw1"), env=env)
    assert env[CUDA_VISIBLE_DEVICES] == "0,1,2,3"
    # Already exactly these GPUs (the worker's environment was set so by hand): nothing changes, no error.
    env = {CUDA_VISIBLE_DEVICES: "2,3"}
    assert pin_worker(fake_config(2, worker="gw0", workers=1), env=env) == "gw0 pinned to GPUs 2,3"
    fake_torch.cuda.is_initialized = lambda: False
    assert pin_worker(fake_config(2, worker="gw1"), env={CUDA_VISIBLE_DEVICES: "0,1,2,3"}) == "gw1 pinned to GPUs 2,3"


def test_the_real_torch_has_not_initialised_cuda_here() -> None:
    assert gpu_pinning._cuda_initialised() is False  # CPU machine: the check must not misfire


# -- the controller: check the plan before workers start; -n auto -----------------------------------------
def test_plan_description_on_the_controller() -> None:
    config = fake_config(2, dist="load", tx=["popen", "popen"])
    line = plan_description(config, env={CUDA_VISIBLE_DEVICES: "0,1,2,3"})
    assert line == "GPU pinning: 2 workers x 2 GPUs from CUDA_VISIBLE_DEVICES=0,1,2,3 (gw0: 0,1; gw1: 2,3)"
    config = fake_config(1, dist="load", tx=["3*popen"])
    assert plan_description(config, env={}, device_count=_count(3)) == (
        "GPU pinning: 3 workers x 1 GPU from CUDA_VISIBLE_DEVICES unset, devices counted by NVML (gw0: 0; gw1: 1; gw2: 2)")


def test_plan_description_fails_early_when_gpus_are_short() -> None:
    config = fake_config(2, dist="load", tx=["popen"] * 3)
    with pytest.raises(pytest.UsageError, match=r"--opt-gpus-per-worker=2 with -n 3 needs 6 GPUs; found: 4"):
        plan_description(config, env={CUDA_VISIBLE_DEVICES: "0,1,2,3"})


def test_plan_description_without_xdist_or_option() -> None:
    assert plan_description(fake_config(None, dist="load", tx=["popen"]), env={}, device_count=_never) is None
    assert plan_description(fake_config(1), env={}, device_count=_never) == (
        "GPU pinning: --opt-gpus-per-worker=1 has no effect without pytest-xdist workers (-n K)")
    assert plan_description(fake_config(1, worker="gw0"), env={}, device_count=_never) is None


def test_auto_num_workers_is_one_per_gpu_set() -> None:
    assert auto_num_workers(fake_config(2), env={CUDA_VISIBLE_DEVICES: "0,1,2,3,4"}) == 2
    assert auto_num_workers(fake_config(1), env={}, device_count=_count(8)) == 8
    assert auto_num_workers(fake_config(None), env={}, device_count=_never) is None
    with pytest.raises(pytest.UsageError, match=r"with -n auto needs at least 2 GPUs; found: 1"):
        auto_num_workers(fake_config(2), env={CUDA_VISIBLE_DEVICES: "0"})


def test_the_plugin_hook_turns_errors_into_usage_errors_and_stashes_the_line(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = GpuPinningPlugin()
    monkeypatch.setenv(CUDA_VISIBLE_DEVICES, "0,1")
    config = fake_config(1, worker="gw1")
    plugin.pytest_configure(config)  # type: ignore[arg-type]
    assert config.stash[PINNED_KEY] == "gw1 pinned to GPUs 1" and os.environ[CUDA_VISIBLE_DEVICES] == "1"
    assert plugin.pytest_report_header(config) == "transformers-opt: gw1 pinned to GPUs 1"  # type: ignore[arg-type]
    monkeypatch.setenv(CUDA_VISIBLE_DEVICES, "0")
    with pytest.raises(pytest.UsageError, match="needs 2 GPUs; found: 1"):
        plugin.pytest_configure(fake_config(1, worker="gw0"))  # type: ignore[arg-type]
    quiet = fake_config(None)
    plugin.pytest_configure(quiet)  # type: ignore[arg-type]
    assert plugin.pytest_report_header(quiet) is None  # type: ignore[arg-type]


# -- end to end: pytest -n 2 in a subprocess, GPUs faked through CUDA_VISIBLE_DEVICES ------------------------
RECORDING_CONFTEST = '''
import os
from pathlib import Path

OUT = Path({out!r})

def pytest_configure(config):
    worker = getattr(config, "workerinput", {{}}).get("workerid")
    if worker:  # runs after the plugin's tryfirst pytest_configure: the worker is pinned by now
        (OUT / f"{{worker}}.configure").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
'''

RECORDING_TESTS = '''
import os
from pathlib import Path

OUT = Path({out!r})

def _record(name):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "controller")
    (OUT / f"{{worker}}.{{name}}").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))

def test_one():
    _record("test_one")

def test_two():
    _record("test_two")

def test_three():
    _record("test_three")
'''


def _subprocess_env(monkeypatch: pytest.MonkeyPatch, visible: str) -> None:
    monkeypatch.setenv(CUDA_VISIBLE_DEVICES, visible)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")


def _run_recording(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, visible: str,
                   gpus_per_worker: int) -> tuple[Path, pytest.RunResult]:
    """``pytest -n 2`` in a subprocess over tests that record the CUDA_VISIBLE_DEVICES they see."""
    out = pytester.mkdir("seen")
    pytester.makeconftest(RECORDING_CONFTEST.format(out=str(out)))
    pytester.makepyfile(test_record=RECORDING_TESTS.format(out=str(out)))
    _subprocess_env(monkeypatch, visible)
    result = pytester.runpytest_subprocess("-n", "2", f"--opt-gpus-per-worker={gpus_per_worker}", "-p",
                                           "no:cacheprovider", timeout=240)
    return out, result


def test_each_xdist_worker_sees_its_own_cuda_visible_devices(pytester: pytest.Pytester,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out, result = _run_recording(pytester, monkeypatch, "0,1", gpus_per_worker=1)
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == 0, output
    result.stdout.fnmatch_lines(["*transformers-opt: GPU pinning: 2 workers x 1 GPU from "
                                 "CUDA_VISIBLE_DEVICES=0,1 (gw0: 0; gw1: 1)*", "*3 passed*"])
    assert (out / "gw0.configure").read_text() == "0"
    assert (out / "gw1.configure").read_text() == "1"
    seen_by_tests = {p.name: p.read_text() for p in out.iterdir() if ".test_" in p.name}
    assert len(seen_by_tests) == 3, seen_by_tests
    for name, visible in seen_by_tests.items():
        assert visible == {"gw0": "0", "gw1": "1"}[name.split(".")[0]], seen_by_tests


def test_too_few_gpus_for_the_workers_stops_before_any_worker_starts(pytester: pytest.Pytester,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out, result = _run_recording(pytester, monkeypatch, "0,1,2", gpus_per_worker=2)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(["*--opt-gpus-per-worker=2 with -n 2 needs 4 GPUs; found: 3 "
                                 "(CUDA_VISIBLE_DEVICES=0,1,2)*"])
    assert "Traceback" not in result.stderr.str()
    assert list(out.iterdir()) == []  # no worker configured, no test ran
