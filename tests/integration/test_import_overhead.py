"""What the plugin costs a session that uses none of it: no import of torch, transformers, numpy or
bitsandbytes (loading torch alone takes a second or more), and at start-up only the plugin's face (hooks,
options, markers, fixtures' declarations), the stages that load and measure models on first use.

How long that takes is a figure, not an assertion (it swings with the machine's load): see
``benchmarks/import_overhead.py`` and its section in benchmarks/RESULTS.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY_MODULES = ("torch", "transformers", "numpy", "bitsandbytes")
PACKAGE = "pytest_transformers_opt"

TRIVIAL_TEST = "def test_nothing_of_the_plugin():\n    assert True\n"

# atexit runs after pytest has finished with every hook, the plugin's session-end ones included
RECORDING_CONFTEST = f'''
import atexit, json, sys

HEAVY_MODULES = {HEAVY_MODULES!r}
loaded = {{}}

def own_modules():
    return sorted(name for name in sys.modules if name.startswith("{PACKAGE}"))

def pytest_configure(config):
    loaded["plugin"] = config.pluginmanager.hasplugin("transformers_opt")
    loaded["at_start"] = own_modules()

def record():
    loaded["heavy"] = sorted(name for name in HEAVY_MODULES if name in sys.modules)
    loaded["at_end"] = own_modules()
    with open("modules.json", "w") as handle:
        json.dump(loaded, handle)

atexit.register(record)
'''

# the stages that load, run and judge models, and the technique catalogue: a session that asks for no
# fixture of the plugin never needs them, neither at start-up nor at its end
MODEL_STAGES = ("engine.loading", "engine.generation", "engine.hardware", "engine.model", "engine.measure",
                "techniques.catalogue", "verdict.bench", "verdict.baselines", "plan", "advisor")


def inner_env() -> dict[str, str]:
    """The environment less what would change the inner session: options from outside, and a switch that
    keeps the plugin from loading at all."""
    return {key: value for key, value in os.environ.items()
            if key not in ("PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")}


def run_session(folder: Path, *args: str) -> None:
    # pytest-randomly (test extra) imports numpy itself when it loads: the plugin's own imports are measured
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", *args], cwd=folder,
                          env=inner_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the inner session failed:\n{done.stdout}{done.stderr}"


@pytest.fixture()
def trivial_session(tmp_path: Path) -> Path:
    (tmp_path / "test_trivial.py").write_text(TRIVIAL_TEST)
    (tmp_path / "conftest.py").write_text(RECORDING_CONFTEST)
    return tmp_path


def modules_of(folder: Path) -> dict[str, object]:
    return json.loads((folder / "modules.json").read_text())


@pytest.mark.parametrize("args", [(), ("-q",), ("--opt-report",)], ids=["header", "quiet", "opt-report"])
def test_a_session_that_uses_none_of_the_plugin_imports_no_heavy_library(
        trivial_session: Path, args: tuple[str, ...]) -> None:
    run_session(trivial_session, *args)
    modules = modules_of(trivial_session)
    assert modules["plugin"], "the plugin did not load in the inner session"
    assert modules["heavy"] == []


def test_only_the_face_is_imported_at_start_up_and_no_model_stage_at_all(trivial_session: Path) -> None:
    run_session(trivial_session, "-q", "--opt-report")
    modules = modules_of(trivial_session)
    stage_modules = [f"{PACKAGE}.{stage}" for stage in MODEL_STAGES]
    loaded_stages = [name for name in modules["at_end"] if name in stage_modules or name.startswith(f"{PACKAGE}.advisor")]
    assert loaded_stages == [], f"a session that uses none of the plugin imported {loaded_stages}"
    # the report writer is the session end's work (--opt-report prints its line), not the start-up's
    assert f"{PACKAGE}.report.writer" not in modules["at_start"]
    assert f"{PACKAGE}.report.writer" in modules["at_end"]
