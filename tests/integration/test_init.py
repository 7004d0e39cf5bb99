"""``pytest-opt init``: the starter tests, the settings and the GPU gate it writes, then pytest there.

One project is initialized once per module (``initialized``) and read by several tests; the pytest run in
it is the issue's done-means: green, with the report.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pytest_transformers_opt.advisor import ServingScenario, advise
from pytest_transformers_opt.cli import main
from pytest_transformers_opt.files import create_atomic
from pytest_transformers_opt.options import OPTIONS
from pytest_transformers_opt.report.schema import validate_report
from pytest_transformers_opt.scaffold import writer as scaffold_writer
from pytest_transformers_opt.verdict.budgets import BUDGETS

from test_workflows import _actionlint, _run_actionlint  # noqa: E402  (tests/integration is on sys.path)

if sys.version_info >= (3, 11):
    import tomllib
else:  # the oldest job's Python: tomli, from the test extra
    import tomli as tomllib

STARTER = "tests/test_optimizations.py"
WORKFLOW = ".github/workflows/gpu-gate.yml"
ACTIONLINT = ".github/actionlint.yaml"
# The advisor's picks for the built-in model on CPU: its own (speed), then the stages load and long-input.
TINY_PICKS = {"test_compile": None, "test_bnb_8bit": "load", "test_sdpa": "long-input"}


@dataclass
class Init:
    code: int
    out: str
    err: str


def init(capsys: pytest.CaptureFixture[str], *argv: str) -> Init:
    code = main(["init", *argv])
    out, err = capsys.readouterr()
    return Init(code, out, err)


def files_under(folder: Path) -> dict[str, str]:
    return {path.relative_to(folder).as_posix(): path.read_text(encoding="utf-8")
            for path in sorted(folder.rglob("*")) if path.is_file()}


def ini_keys() -> set[str]:
    """Every ini key the plugin registers (options.add_options)."""
    return {option.ini for option in OPTIONS if option.ini} | {f"opt_{name}" for name in BUDGETS} | {"opt_baseline"}


def markers_by_test(source: str) -> dict[str, str]:
    """test function name -> the source text of its optimization marker."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            (mark,) = [d for d in node.decorator_list if "optimization" in ast.unparse(d)]
            found[node.name] = "@" + ast.get_source_segment(source, mark)
    return found


def test_init_into_an_empty_folder_then_pytest_there_is_green_with_the_report(pytester, capsys):
    result = init(capsys, "--directory", str(pytester.path))
    assert result.code == 0, result.err
    assert result.err == ""
    written = files_under(pytester.path)
    assert set(written) == {STARTER, "pytest.ini", WORKFLOW, ACTIONLINT}
    assert f"wrote {STARTER}" in result.out and "the advisor picks compile, bnb_8bit, sdpa" in result.out

    # the files as written; only the rounds are cut to one (no warm-up) to keep this test cheap
    run = pytester.runpytest("-p", "no:cacheprovider", "--opt-rounds=1", "--opt-warmup=0")
    assert "INTERNALERROR" not in run.stdout.str() + run.stderr.str()
    run.assert_outcomes(passed=3)
    assert "transformers optimization report" in run.stdout.str()  # opt_report = true, from pytest.ini
    report = json.loads((pytester.path / "opt-report.json").read_text())  # opt_report_json, from pytest.ini
    validate_report(report)
    rows = {entry["nodeid"]: entry for entry in report["tests"]}
    assert set(rows) == {f"{STARTER}::{name}" for name in TINY_PICKS}
    for nodeid, entry in rows.items():
        technique = nodeid.rsplit("::test_", 1)[1]
        assert entry["outcome"] == "passed"
        assert entry["techniques"] == [technique]
        assert entry["model"]["name_or_path"] == "tiny-random-llama"
        assert entry["similarity"]["kl_mean"] is not None  # really measured against the baseline
        assert all(check["ok"] for check in entry["budgets"])
    # the marker's budgets were the ones checked
    budgets = {check["name"] for check in rows[f"{STARTER}::test_bnb_8bit"]["budgets"]}
    assert {"max_kl", "min_top1"} <= budgets


def test_the_starter_tests_are_the_advisors_picks_with_its_markers(tmp_path, capsys):
    result = init(capsys, "--directory", str(tmp_path))
    assert result.code == 0
    source = (tmp_path / STARTER).read_text()
    markers = markers_by_test(source)
    assert list(markers) == list(TINY_PICKS)  # the advisor's own pick first
    for name, problem in TINY_PICKS.items():
        advice = advise(ServingScenario(model="tiny-random-llama", problem=problem))
        assert markers[name] == advice.marker_line()  # what `pytest-opt advise --problem ...` prints
    assert 'pytestmark = pytest.mark.opt_model("tiny-random-llama", dtype="float32")' in source
    # budgets nothing has measured yet are comments, not markers
    compile_block = source[source.index(markers["test_compile"]):source.index("def test_compile")]
    assert "#   min_speedup=1.1" in compile_block and "min_speedup" not in markers["test_compile"]
    sdpa_block = source[source.index(markers["test_sdpa"]):source.index("def test_sdpa")]
    assert '#   max_memory="..."' in sdpa_block
    assert "opt_bench(prompts=PROMPTS, max_new_tokens=16, batch_size=1)" in source  # the tiny model's workload


def test_the_settings_are_valid_plugin_keys(tmp_path, capsys):
    assert init(capsys, "--directory", str(tmp_path)).code == 0
    text = (tmp_path / "pytest.ini").read_text()
    assert "[pytest]" in text
    settings = dict(re.findall(r"^#? ?(opt_\w+) = (.*)$", text, re.MULTILINE))  # commented ones too
    assert {"opt_model", "opt_report", "opt_report_json", "opt_history", "opt_require"} <= set(settings)
    assert set(settings) <= ini_keys()
    parsers = {option.ini: option.parse for option in OPTIONS if option.ini}
    for key, value in settings.items():
        parsers[key](value)  # each value is one its option accepts
    assert settings["opt_model"] == "tiny-random-llama"
    assert not re.search(r"^opt_require", text, re.MULTILINE)  # strict mode stays off on a CPU machine


def test_a_pyproject_without_pytest_settings_gets_the_table_appended(tmp_path, capsys):
    original = '[project]\nname = "mine"\nversion = "1"'  # no final newline
    (tmp_path / "pyproject.toml").write_text(original)
    result = init(capsys, "--directory", str(tmp_path))
    assert result.code == 0, result.err
    assert not (tmp_path / "pytest.ini").exists()
    text = (tmp_path / "pyproject.toml").read_text()
    assert text.startswith(original + "\n")
    data = tomllib.loads(text)
    assert data["project"] == {"name": "mine", "version": "1"}
    options = data["tool"]["pytest"]["ini_options"]
    assert options == {"opt_model": "tiny-random-llama", "opt_report": "true", "opt_report_json": "opt-report.json"}
    assert "pyproject.toml's [tool.pytest.ini_options]" in (tmp_path / STARTER).read_text()


def test_dry_run_prints_exactly_what_a_run_writes_and_writes_nothing(tmp_path, capsys):
    shown_in = tmp_path / "shown"
    shown_in.mkdir()
    dry = init(capsys, "--directory", str(shown_in), "--dry-run")
    assert dry.code == 0 and dry.err == ""
    assert list(shown_in.iterdir()) == []
    written_in = tmp_path / "written"
    assert init(capsys, "--directory", str(written_in)).code == 0  # a missing folder is created
    for path, text in files_under(written_in).items():
        assert f"=== {path} (new file) ===\n{text}" in dry.out
    assert "nothing is written" in dry.out


@pytest.mark.parametrize("existing", [STARTER, WORKFLOW, "pytest.ini", "tests", ".github"])  # a file for a folder too
def test_an_existing_target_refuses_everything(tmp_path, capsys, existing):
    target = tmp_path / existing
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("mine\n")
    before = files_under(tmp_path)
    result = init(capsys, "--directory", str(tmp_path))
    assert result.code == 1
    assert "refused, nothing written" in result.err
    assert existing in result.err
    assert files_under(tmp_path) == before  # the file untouched, and nothing else written


@pytest.mark.parametrize("name, text", [
    ("pyproject.toml", '[project]\nname = "mine"\n\n[tool.pytest.ini_options]\naddopts = "-q"\n'),
    ("tox.ini", "[tox]\nenvlist = py\n\n[pytest]\naddopts = -q\n"),
    ("setup.cfg", "[metadata]\nname = mine\n\n[tool:pytest]\naddopts = -q\n"),
])
def test_pytest_settings_elsewhere_refuse_everything(tmp_path, capsys, name, text):
    (tmp_path / name).write_text(text)
    result = init(capsys, "--directory", str(tmp_path))
    assert result.code == 1
    assert f"  {name}: " in result.err and "add the keys there yourself" in result.err
    assert files_under(tmp_path) == {name: text}
    # --dry-run still shows the keys to add by hand, and says it would refuse
    dry = init(capsys, "--directory", str(tmp_path), "--dry-run")
    assert dry.code == 1 and "opt_report_json" in dry.out and "nothing would be written" in dry.err


def test_a_failure_part_way_undoes_what_was_written(tmp_path, capsys, monkeypatch):
    original = '[project]\nname = "mine"\n'
    (tmp_path / "pyproject.toml").write_text(original)
    real = scaffold_writer.create_atomic

    def fail_on_the_workflow(path, text):
        if str(path).endswith("gpu-gate.yml"):
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(scaffold_writer, "create_atomic", fail_on_the_workflow)
    result = init(capsys, "--directory", str(tmp_path))
    assert result.code == 2
    assert "cannot write" in result.err and "No space left on device" in result.err
    assert "nothing was written" in result.err
    assert files_under(tmp_path) == {"pyproject.toml": original}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pyproject.toml"]  # the folders it made are gone


@pytest.mark.parametrize("argv, option, accepted", [
    (["--gpu-memory", "lots"], "--gpu-memory", '"6 GiB", "800 MB"'),
    (["--gpu-memory=-3 GiB"], "--gpu-memory", '"6 GiB", "800 MB"'),
    (["--model", "no-such-model"], "--model", "tiny-random-llama"),
    (["--model", "FOLDER"], "--model", "has no config.json"),
    (["--directory", "FILE"], "--directory", "not a folder"),
])
def test_bad_options_are_one_line_usage_errors_and_write_nothing(tmp_path, capsys, argv, option, accepted):
    project = tmp_path / "project"
    project.mkdir()
    (tmp_path / "FOLDER").mkdir()
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a in ("FOLDER", "FILE") else a for a in argv]
    result = init(capsys, *(["--directory", str(project)] if "--directory" not in argv else []), *argv)
    assert result.code == 2
    (line,) = result.err.splitlines()
    assert line.startswith(f"pytest-opt init: error: {option}: ") and accepted in line
    assert list(project.iterdir()) == []


def test_a_local_model_folder_with_gpu_memory(tmp_path, capsys):
    """A model folder inside the project is named relative to it; --gpu-memory gives the advisor the memory
    (its picks and max_memory budgets)."""
    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    model = project / "models" / "llama-8b"
    model.mkdir()
    from model_shapes import LLAMA_8B

    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    result = init(capsys, "--directory", str(project), "--model", str(model / "config.json"),
                  "--gpu-memory", "24 GiB")
    assert result.code == 0, result.err
    source = (project / STARTER).read_text()
    assert 'pytest.mark.opt_model("models/llama-8b", dtype="bfloat16")' in source
    assert "opt_model = models/llama-8b" in (project / "pytest.ini").read_text()
    markers = markers_by_test(source)
    assert len(markers) == 3
    for name, marker in markers.items():
        assert 'max_memory="24 GiB"' in marker or "min_speedup" in marker, marker
    own = advise(ServingScenario(model=str(model), gpu_memory_bytes=24 * 2**30))
    assert list(markers.values())[0] == own.marker_line()
    assert source.count("--gpu-memory '24 GiB'") == 3  # each test names the advisor command with its reasons
    # the gate requires the techniques of the starter tests
    names = [name.removeprefix("test_") for name in markers]
    assert f"--opt-require={','.join(names)}" in (project / WORKFLOW).read_text()


def test_the_workflow_passes_actionlint_and_gates_on_the_report(tmp_path, capsys):
    assert init(capsys, "--directory", str(tmp_path)).code == 0
    path = tmp_path / WORKFLOW
    lint = _run_actionlint(tmp_path, path)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    workflow = yaml.safe_load(path.read_text())
    (job,) = workflow["jobs"].values()
    assert job["runs-on"] == ["self-hosted", "gpu"]
    steps = {step.get("name", step.get("uses")): step for step in job["steps"]}
    install = steps["Install the plugin and the project's requirements"]["run"]
    assert re.search(r'pip install "pytest-transformers-opt==[0-9][^"]*"', install)
    run = steps["Run the optimization tests"]["run"]
    assert "--opt-require=compile,bnb_8bit,sdpa" in run and "-m optimization" in run
    assert "--opt-report-json=opt-report.json" in run and '"--opt-compare=$OPT_HISTORY"' in run
    assert "--opt-compare-confirm=1" in run  # main's window, a regression measured twice
    assert steps["Upload the report"]["with"]["path"] == "opt-report.json"
    assert "hashFiles('tests/**')" in steps["Restore the compile cache"]["with"]["key"]
    # (test_gate_workflow_history.py runs these steps: main records, a pull request reads)
    assert steps["Restore main's run history"]["with"]["restore-keys"] == "opt-history-main-gate-"
    assert steps["Save main's run history"]["if"] == "always() && steps.history.outputs.record == 'true'"
    check = subprocess.run(["bash", "-n"], input=run, text=True, capture_output=True, check=False)
    assert check.returncode == 0, check.stderr  # the run step is valid bash


def test_create_atomic_never_replaces_a_file(tmp_path):
    """The writer of new files: a name that exists (created a moment before, by anyone) is refused."""
    target = tmp_path / "test_optimizations.py"
    create_atomic(target, "first\n")
    assert target.read_text() == "first\n"
    with pytest.raises(FileExistsError):
        create_atomic(target, "second\n")
    assert target.read_text() == "first\n"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no temporary file left behind


# --------------------------------------------------------------------------- red team, round three (finding 10)


def _git_init(folder: Path) -> None:
    """A user's project is a git checkout: actionlint finds its .github/actionlint.yaml from the repository root."""
    subprocess.run(["git", "init", "-q", str(folder)], check=True, capture_output=True, timeout=60)


def _actionlint_in(project: Path) -> subprocess.CompletedProcess[str]:
    """actionlint as a user runs it in the project: no -config-file, so it reads the project's own."""
    return subprocess.run([_actionlint(), "-no-color", "-oneline"], cwd=project, capture_output=True, text=True,
                          timeout=120, check=False)


def test_actionlint_passes_the_written_project_with_the_config_init_writes(tmp_path, capsys):
    """Red team: actionlint failed the generated workflow (label "gpu" is unknown), and the
    .github/actionlint.yaml its comment names was not written."""
    _git_init(tmp_path)
    result = init(capsys, "--directory", str(tmp_path))
    assert result.code == 0, result.err
    assert f"wrote {ACTIONLINT}" in result.out
    config = yaml.safe_load((tmp_path / ACTIONLINT).read_text())
    assert config == {"self-hosted-runner": {"labels": ["gpu"]}}
    assert ACTIONLINT in (tmp_path / WORKFLOW).read_text()  # the file the workflow's comment names
    lint = _actionlint_in(tmp_path)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    (tmp_path / ACTIONLINT).unlink()  # without it, what the user saw
    lint = _actionlint_in(tmp_path)
    assert lint.returncode == 1 and 'label "gpu" is unknown' in lint.stdout


@pytest.mark.parametrize("name, text, note", [
    ("actionlint.yaml", "self-hosted-runner:\n  labels:\n    - a100\n", True),
    ("actionlint.yml", "self-hosted-runner:\n  labels: [gpu, a100]\n", False),
])
def test_an_existing_actionlint_config_is_never_overwritten(tmp_path, capsys, name, text, note):
    (tmp_path / ".github").mkdir()
    (tmp_path / ".github" / name).write_text(text)
    result = init(capsys, "--directory", str(tmp_path))
    assert result.code == 0, result.err
    assert (tmp_path / ".github" / name).read_text() == text
    assert set(files_under(tmp_path / ".github")) == {name, "workflows/gpu-gate.yml"}  # no second config
    assert f"wrote {ACTIONLINT}" not in result.out
    lacks = f"note: .github/{name}: exists and is left as it is; actionlint reports the runner label gpu as unknown"
    assert (lacks in result.out) is note


def test_a_crlf_pyproject_keeps_its_line_endings(tmp_path, capsys):
    """Red team: init rewrote a CRLF pyproject.toml to LF (every line of the file shows as changed)."""
    original = b'[project]\r\nname = "mine"\r\nversion = "1"\r\n'
    (tmp_path / "pyproject.toml").write_bytes(original)
    result = init(capsys, "--directory", str(tmp_path))
    assert result.code == 0, result.err
    written = (tmp_path / "pyproject.toml").read_bytes()
    assert written.startswith(original + b"\r\n[tool.pytest.ini_options]\r\n")
    assert written.count(b"\n") == written.count(b"\r\n") > original.count(b"\n")  # no bare LF anywhere
    options = tomllib.loads(written.decode())["tool"]["pytest"]["ini_options"]
    assert options["opt_model"] == "tiny-random-llama"


def test_an_lf_pyproject_stays_lf(tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_bytes(b'[project]\nname = "mine"\n')
    assert init(capsys, "--directory", str(tmp_path)).code == 0
    assert b"\r" not in (tmp_path / "pyproject.toml").read_bytes()


def test_an_invalid_pyproject_is_refused_naming_the_parse_error(tmp_path, capsys):
    """Red team: init appended its table to a pyproject.toml that was not TOML, and reported success."""
    text = '[project]\nname = "mine\nversion = "1"\n'  # an unterminated string
    (tmp_path / "pyproject.toml").write_text(text)
    result = init(capsys, "--directory", str(tmp_path))
    assert result.code == 1
    assert "refused, nothing written" in result.err
    (reason,) = [line for line in result.err.splitlines() if "pyproject.toml" in line]
    assert reason.startswith("  pyproject.toml: is not valid TOML (")
    assert "line 2" in reason  # tomllib's own message, with where
    assert files_under(tmp_path) == {"pyproject.toml": text}


def test_pytest_9_s_tool_pytest_table_is_named_as_it_is(tmp_path, capsys):
    """Red team: a pyproject.toml with pytest 9's [tool.pytest] was refused as having [tool.pytest.ini_options]."""
    text = '[project]\nname = "mine"\n\n[tool.pytest]\naddopts = ["-q"]\n'
    (tmp_path / "pyproject.toml").write_text(text)
    result = init(capsys, "--directory", str(tmp_path))
    assert result.code == 1
    assert ("  pyproject.toml: already has [tool.pytest] (pytest 9's settings table); add the keys there yourself "
            "(--dry-run prints them)") in result.err.splitlines()
    assert "ini_options" not in result.err
    assert files_under(tmp_path) == {"pyproject.toml": text}
    dry = init(capsys, "--directory", str(tmp_path), "--dry-run")
    shown = dry.out[dry.out.index("=== pyproject.toml"):]
    section = shown.split("\n", 1)[1].split("\n=== ")[0]
    assert section.startswith("[tool.pytest]\n")  # the keys to add, under the table the file has
    assert tomllib.loads(section)["tool"]["pytest"]["opt_model"] == "tiny-random-llama"


@pytest.mark.parametrize("text, table", [
    ('[tool.pytest.ini_options]\naddopts = "-q"\n', "tool.pytest.ini_options"),
    ('tool.pytest.ini_options.addopts = "-q"\n', "tool.pytest.ini_options"),  # a dotted key, no header
    ("[tool.pytest]\n", "tool.pytest"),  # empty: pytest 9 reads it as its configuration all the same
    ('[tool.black]\nline-length = 100\n', None),
])
def test_the_pytest_table_is_read_from_the_parsed_file(tmp_path, capsys, text, table):
    (tmp_path / "pyproject.toml").write_text(text)
    result = init(capsys, "--directory", str(tmp_path))
    assert result.code == (1 if table else 0), result.err
    if table:
        assert f"already has [{table}]" in result.err
    else:
        assert "ini_options" in tomllib.loads((tmp_path / "pyproject.toml").read_text())["tool"]["pytest"]
