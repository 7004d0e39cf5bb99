"""Issue 19: the package as a user installs and runs it (items 35, 25, 34/38, 23).

Item 35: the package as a user installs it. Its sdist and wheel pass ``twine check --strict``
and carry the Apache-2.0 licence (SPDX expression and the LICENSE file), the project's URLs and the Python
versions it supports; the floors the oldest-versions CI job installs are the floors pyproject.toml
declares, at versions that work together (transformers 5.17 needs accelerate 1.1)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the oldest job's Python: tomli, from the test extra
    import tomli as tomllib

import pytest
from packaging.requirements import Requirement

from conftest import UserRun
from pytest_transformers_opt.engine.cpu_threads import threads_for_this_process, usable_cores

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / ".github" / "oldest-constraints.txt"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# what the issue found installable but broken, or never checked: each is pinned at its floor by the job
FLOORED = ("transformers", "accelerate", "tokenizers", "safetensors", "pytest", "pytest-benchmark", "bitsandbytes")


def _floor(requirement: Requirement) -> str:
    floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
    assert len(floors) == 1, f"{requirement} has no single >= floor"
    return floors[0]


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def _same_version(a: str, b: str) -> bool:
    from packaging.version import Version

    return Version(a) == Version(b)


def test_the_oldest_job_installs_exactly_the_declared_floors() -> None:
    declared = {Requirement(text).name.lower(): Requirement(text) for text in PYPROJECT["project"]["dependencies"]}
    pins = _pins()
    assert sorted(pins) == sorted(FLOORED)
    for name in FLOORED:
        assert _same_version(pins[name], _floor(declared[name])), (
            f"{name}: the oldest job installs {pins[name]}, pyproject.toml declares {declared[name]}")
    # the floor the user hit: accelerate 1.0 installs beside transformers, which then refuses it
    assert _floor(declared["accelerate"]) == "1.1"


def test_sdist_and_wheel_pass_twine_check_strict_with_licence_urls_and_python_versions(tmp_path: Path) -> None:
    # --no-isolation: the installed setuptools (build checks it meets build-system.requires), no download
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=240, check=False)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheel = next(tmp_path.glob("*.whl"))
    sdist = next(tmp_path.glob("*.tar.gz"))

    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
                             capture_output=True, text=True, timeout=120, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2, checked.stdout

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata_name = next(name for name in names if name.endswith(".dist-info/METADATA"))
        metadata = HeaderParser().parsestr(archive.read(metadata_name).decode("utf-8"))
        licence_files = [name for name in names if re.search(r"\.dist-info/licenses/LICENSE$", name)]
        assert len(licence_files) == 1, names
        licence_text = archive.read(licence_files[0]).decode("utf-8")
    assert "Apache License" in licence_text and "Version 2.0, January 2004" in licence_text
    assert licence_text == (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert "License" not in metadata  # the deprecated free-text field (the TOML table) is gone

    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL"))
    assert set(urls) == {"Homepage", "Repository", "Issues"}
    assert all(url.startswith("https://github.com/") and "/pytest-transformers-opt" in url for url in urls.values())
    assert urls["Issues"].endswith("/issues")

    classifiers = metadata.get_all("Classifier")
    minimum = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    versions = [c.rsplit(" :: ", 1)[1] for c in classifiers if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert versions and versions[0] == minimum, classifiers
    assert "Framework :: Pytest" in classifiers

    requires = {Requirement(text).name.lower(): Requirement(text) for text in metadata.get_all("Requires-Dist")}
    assert _floor(requires["accelerate"]) == "1.1"

    with tarfile.open(sdist) as archive:
        assert any(member.name.endswith("/LICENSE") for member in archive.getmembers())


# --------------------------------------------------------------------------- item 25: torch threads per worker

THREADS_TEST = """
import json, pathlib
import torch

def test_threads(opt_model):
    pathlib.Path("threads.json").write_text(json.dumps({"torch": torch.get_num_threads()}))
"""


def _threads_run(run_user, monkeypatch: pytest.MonkeyPatch, *args: str, env: str | None = None,
                 workers: str | None = None) -> tuple[UserRun, int]:
    monkeypatch.delenv("PYTEST_OPT_CPU_THREADS", raising=False)  # the suite's one thread: this test sets its own
    if env is not None:
        monkeypatch.setenv("PYTEST_OPT_CPU_THREADS", env)
    if workers is not None:  # what pytest-xdist sets in each worker's environment
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    run = run_user(THREADS_TEST, *args)
    run.result.assert_outcomes(passed=1)
    threads = json.loads((run.report_path.parent / "threads.json").read_text())["torch"]
    return run, threads


def test_each_xdist_worker_on_cpu_gets_its_share_of_the_cores(run_user, monkeypatch: pytest.MonkeyPatch) -> None:
    run, threads = _threads_run(run_user, monkeypatch, workers="2")
    share = max(1, usable_cores() // 2)
    assert threads == share
    assert run.report["environment"]["cpu_threads"] == share
    assert run.report["environment"]["device"] == "cpu"


def test_outside_xdist_auto_uses_every_core(run_user, monkeypatch: pytest.MonkeyPatch) -> None:
    run, threads = _threads_run(run_user, monkeypatch)
    assert threads == run.report["environment"]["cpu_threads"] == usable_cores()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_set_thread_count_wins_over_the_share(run_user, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    args = ("--opt-cpu-threads=3",) if how == "flag" else ()
    run, threads = _threads_run(run_user, monkeypatch, *args, env="3" if how == "env" else None, workers="2")
    assert threads == run.report["environment"]["cpu_threads"] == 3


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_a_bad_thread_count_is_a_usage_error_naming_the_accepted_forms(pytester: pytest.Pytester, value: str) -> None:
    pytester.makepyfile(test_user="def test_x():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", f"--opt-cpu-threads={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output
    assert f"--opt-cpu-threads: {value!r} is not a CPU thread count; accepted: a thread count (1 to 4096) or auto" in output


def test_ini_opt_cpu_threads_is_read(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_OPT_CPU_THREADS", raising=False)
    pytester.makeini("[pytest]\nopt_cpu_threads = 1\n")
    pytester.makepyfile(test_user=THREADS_TEST)
    report = pytester.path / "r.json"
    result = pytester.runpytest("-p", "no:cacheprovider", f"--opt-report-json={report}")
    result.assert_outcomes(passed=1)
    assert json.loads(report.read_text())["environment"]["cpu_threads"] == 1
    assert json.loads((pytester.path / "threads.json").read_text())["torch"] == 1


def test_the_share_rule() -> None:
    assert threads_for_this_process(None, cores=2, workers=2) == 1
    assert threads_for_this_process(None, cores=16, workers=3) == 5
    assert threads_for_this_process(None, cores=2, workers=8) == 1  # never zero
    assert threads_for_this_process(4, cores=2, workers=8) == 4  # a set count is kept


# --------------------------------------------------------------------------- items 34 and 38: repeated messages

BNB_TESTS = """
import pytest

@pytest.mark.optimization("bnb_8bit", max_kl=1e-12)
def test_8bit_misses_its_budget(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("bnb_8bit")
def test_8bit_again(opt_bench):
    opt_bench(max_new_tokens=4)
"""
CAST_MESSAGE = "MatMul8bitLt: inputs will be cast"


def test_bitsandbytes_cast_message_is_shown_once_per_session(run_user) -> None:
    import logging

    # transformers says a deprecation once per process (warning_once): forget it, so this run shows it if said
    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]
    run = run_user(BNB_TESTS, "-rA", "--opt-rounds=1", "--opt-warmup=0")
    run.result.assert_outcomes(passed=1, failed=1)
    output = run.result.stdout.str() + run.result.stderr.str()
    # the failing test's log is there, with its budget table, and the message once in the whole session
    assert output.count(CAST_MESSAGE) == 1, output.count(CAST_MESSAGE)
    assert "budgets failed (max_kl) for [bnb_8bit]" in output
    assert "past_key_values" not in output  # the plugin reads the generate output's cache by its current name
    assert run.test("test_8bit_misses_its_budget")["outcome"] == "failed"
    assert run.test("test_8bit_again")["outcome"] == "passed"

    # the next session (here: in the same process, as pytester runs it) shows it again, once
    again = run_user(BNB_TESTS.split("\n@pytest.mark.optimization(\"bnb_8bit\")\n")[0], "-rA", "--opt-rounds=1",
                     "--opt-warmup=0")
    again.result.assert_outcomes(failed=1)
    assert (again.result.stdout.str() + again.result.stderr.str()).count(CAST_MESSAGE) == 1


def test_reading_the_generated_cache_logs_no_deprecation(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import torch
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    from pytest_transformers_opt.engine.generation import generated_cache

    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]
    cache = object()
    fields = GenerateDecoderOnlyOutput.__dataclass_fields__
    name = "cache" if "cache" in fields else "past_key_values"  # transformers before 5.2x: the old name
    output = GenerateDecoderOnlyOutput(sequences=torch.zeros(1, 1, dtype=torch.long), **{name: cache})
    with caplog.at_level(logging.WARNING):
        assert generated_cache(output) is cache
    assert not [r for r in caplog.records if "past_key_values" in r.getMessage()]


# --------------------------------------------------------------------------- item 23: built-in names in the advisor

def _advise(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from pytest_transformers_opt.cli import main

    code = main(["advise", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_advise_accepts_the_built_in_real_model_the_readme_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert "`smollm2-135m`" in (ROOT / "README.md").read_text()  # what the user read
    code, out, err = _advise(capsys, "--model", "smollm2-135m", "--json")
    assert code == 0, err
    advice = json.loads(out)
    parameters = next(e["value"] for e in advice["estimates"] if e["label"] == "parameters")
    assert 130e6 < parameters < 140e6  # SmolLM2-135M's config, not the tiny model's
    assert "smollm2-135m" in advice["validation"]["command"] or "smollm2-135m" in json.dumps(advice)


def test_advise_accepts_every_built_in_tiny_model_and_lists_the_names_when_wrong(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pytest_transformers_opt.engine.real_models import REAL_MODELS
    from pytest_transformers_opt.engine.tiny_models import TINY_MODELS

    for name in ("tiny-random-llama", "tiny-random-qwen3"):
        code, out, err = _advise(capsys, "--model", name)
        assert code == 0 and out.startswith("Recommended change\n"), err
    code, out, err = _advise(capsys, "--model", "smollm2-135")  # a typo
    assert code == 2 and out == ""
    assert "--model: 'smollm2-135' is not a folder" in err
    assert all(name in err for name in [*TINY_MODELS, *REAL_MODELS])


def test_example_project_readme_says_how_to_install_from_the_repository() -> None:
    text = (ROOT / "example_project" / "README.md").read_text()
    assert "`pip install pytest-transformers-opt`" not in text  # not published: that command finds nothing
    repository = PYPROJECT["project"]["urls"]["Repository"]
    assert f"pytest-transformers-opt @ git+{repository}" in text
    assert "pip install -e /path/to/pytest-transformers-opt" in text
