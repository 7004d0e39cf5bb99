"""Field input, as users and CI runners hit it: crafted files, odd paths, out-of-range values.

Every file the plugin reads but did not write (stored baselines, ``--opt-compare`` reports, the
advisor's ``--from-report`` and ``--model`` files) goes through one guarded reader: 100,000-deep
nesting, a 5000-digit integer, ``1e400``, token ids of 10**30 or a FIFO at the path is one clear
error naming the file and what to do, never a traceback or a hang. Paths are resolved once at
start-up; every file written respects the umask; out-of-range values name the argument, the value
and the accepted range; and every ``PYTEST_OPT_*`` variable read is in README's table.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from pytest_transformers_opt import files
from pytest_transformers_opt.cli import main
from pytest_transformers_opt.errors import OptConfigError
from pytest_transformers_opt.options import OPTIONS

INNER = ("-p", "no:cacheprovider", "--opt-rounds=1", "--opt-warmup=0")
ROOT = Path(__file__).resolve().parents[2]
USAGE_ERROR = pytest.ExitCode.USAGE_ERROR
DEEP = "[" * 100_000 + "]" * 100_000

# A test that leaves a trace when it runs: a usage error must stop the session before it.
SENTINEL = '''
import pathlib

def test_leaves_a_trace():
    pathlib.Path("ran.txt").write_text("ran")
'''


def _no_traceback(result: pytest.RunResult) -> None:
    output = result.stdout.str() + result.stderr.str()
    for word in ("INTERNALERROR", "Traceback (most recent call last)", "RecursionError", "OverflowError"):
        assert word not in output, output


def _one_usage_line(pytester: pytest.Pytester, result: pytest.RunResult, *fragments: str, argparse: bool = False) -> str:
    """Exit 4, no traceback, no test ran, and one ``ERROR:`` line holding every fragment.

    ``argparse``: a bad command-line value, which pytest's own parser reports after its usage line.
    """
    _no_traceback(result)
    assert result.ret == USAGE_ERROR, result.stdout.str() + result.stderr.str()
    lines = [line for line in result.stderr.lines if line.strip()]
    if argparse:
        lines = [line for line in lines if "error: argument" in line]
    assert len(lines) == 1 and (argparse or lines[0].startswith("ERROR: ")), result.stderr.lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not (pytester.path / "ran.txt").exists()
    return lines[0]


def _report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _entry(report: dict[str, Any], name: str) -> dict[str, Any]:
    found = [t for t in report["tests"] if t["nodeid"].split("::")[-1] == name]
    assert len(found) == 1, [t["nodeid"] for t in report["tests"]]
    return found[0]


def _with_marker(text: str, value: Any) -> str:
    """JSON text of a document holding the string "__X__", with ``value``'s literal put in its place."""
    return text.replace('"__X__"', value)


# ------------------------------------------------------------------------------ stored baselines

BASELINE_CASES = ("ok", "deep", "digits", "inf", "token_1e30", "token_2e40", "fifo")

BASELINE_TESTS = '''
import pytest

@pytest.mark.optimization("sdpa")
@pytest.mark.parametrize("case", {cases!r})
def test_case(opt_bench, case):
    opt_bench(prompts=[f"Case {{case}}: the cat eats"], max_new_tokens=4)
'''.format(cases=list(BASELINE_CASES))


def _craft_baseline(path: Path, case: str) -> None:
    """Replace a valid stored baseline by the crafted file of ``case``."""
    data = json.loads(path.read_text())
    if case == "deep":
        path.write_text(DEEP)
    elif case == "digits":
        data["measurements"]["latency_s"] = "__X__"
        path.write_text(_with_marker(json.dumps(data), "9" * 5000))
    elif case == "inf":
        data["measurements"]["latency_s"] = "__X__"
        path.write_text(_with_marker(json.dumps(data), "1e400"))
    elif case == "token_1e30":
        data["tokens"][0][0] = 10**30
        path.write_text(json.dumps(data))
    elif case == "token_2e40":  # fits in 64 bits: the baseline's own schema refuses it
        data["tokens"][0][0] = 2**40
        path.write_text(json.dumps(data))
    elif case == "fifo":
        path.unlink()
        os.mkfifo(path)


def test_crafted_stored_baselines_fail_their_own_test_with_the_file_and_the_fix(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=BASELINE_TESTS)
    first = pytester.runpytest(*INNER, "--opt-baselines=bl", "--opt-update-baselines")
    first.assert_outcomes(passed=len(BASELINE_CASES))
    by_case = {}
    for path in (pytester.path / "bl").glob("*.json"):
        prompt = json.loads(path.read_text())["workload"]["prompts"][0]
        by_case[prompt.split(":")[0].removeprefix("Case ")] = path
    assert sorted(by_case) == sorted(BASELINE_CASES)
    for case, path in by_case.items():
        _craft_baseline(path, case)
    crafted = {case: path.read_bytes() for case, path in by_case.items() if case != "fifo"}

    report_path = pytester.path / "report.json"
    second = pytester.runpytest(*INNER, "--opt-baselines=bl", f"--opt-report-json={report_path}")
    _no_traceback(second)
    second.assert_outcomes(passed=1, failed=len(BASELINE_CASES) - 1)
    report = _report(report_path)
    why = {"deep": "nested deeper than", "digits": "an integer of 5000 digits", "inf": "1e400 is out of range",
           "token_1e30": "does not fit in 64 bits", "token_2e40": "token ids (0 <= id <",
           "fifo": "not a regular file (a FIFO)"}
    for case, path in by_case.items():
        entry = _entry(report, f"test_case[{case}]")
        if case == "ok":
            assert entry["outcome"] == "passed" and entry["similarity"]["token_match"] == 1.0
            continue
        assert entry["outcome"] == "failed", entry
        # the error names the file, what is wrong with it and how to replace it
        assert str(path) in entry["error"] and why[case] in entry["error"], entry["error"]
        assert "--opt-update-baselines" in entry["error"]
    # crafted files are left as they are (never overwritten without --opt-update-baselines)
    assert {case: by_case[case].read_bytes() for case in crafted} == crafted
    assert stat.S_ISFIFO(os.stat(by_case["fifo"]).st_mode)


# ------------------------------------------------------------------------------- --opt-compare

ONE_TEST = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(prompts=["The cat eats"], max_new_tokens=4)
'''


def _craft_reports(folder: Path, report: dict[str, Any]) -> dict[str, Path]:
    """A real report edited as a user (or an attacker) might, one file per case."""
    def with_latency(literal: str) -> str:
        edited = json.loads(json.dumps(report))
        edited["tests"][0]["optimized"]["latency_s"] = "__X__"
        return _with_marker(json.dumps(edited), literal)

    texts = {"deep": DEEP, "digits": with_latency("9" * 5000), "inf": with_latency("1e400"),
             "huge": with_latency(str(10**30)), "digits_401": with_latency("7" * 401)}
    paths = {}
    for case, text in texts.items():
        paths[case] = folder / f"{case}.json"
        paths[case].write_text(text)
    paths["fifo"] = folder / "fifo.json"
    os.mkfifo(paths["fifo"])
    return paths


def test_crafted_compare_reports_are_one_line_usage_errors(pytester: pytest.Pytester,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_user=ONE_TEST)
    good = pytester.path / "good.json"
    pytester.runpytest(*INNER, f"--opt-report-json={good}").assert_outcomes(passed=1)
    crafted = _craft_reports(pytester.path, _report(good))
    (pytester.path / "test_user.py").unlink()
    pytester.makepyfile(test_sentinel=SENTINEL)
    for case, path in crafted.items():
        result = pytester.runpytest("-p", "no:cacheprovider", f"--opt-compare={path}")
        _one_usage_line(pytester, result, "--opt-compare: ", str(path),
                        "give a JSON report written by this plugin")
    # the same file from the environment: the error names the variable that was read
    monkeypatch.setenv("PYTEST_OPT_COMPARE", str(crafted["digits_401"]))
    result = pytester.runpytest("-p", "no:cacheprovider")
    line = _one_usage_line(pytester, result, "PYTEST_OPT_COMPARE: ", "an integer of 401 digits")
    assert "--opt-compare:" not in line
    # and the untouched report still compares
    monkeypatch.setenv("PYTEST_OPT_COMPARE", str(good))
    assert pytester.runpytest("-p", "no:cacheprovider").ret == 0


# ------------------------------------------------------------------------------------ the advisor

def _advise(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["advise", *argv])
    return code, capsys.readouterr().err


def test_advisor_refuses_crafted_configs_and_reports_in_one_line(tmp_path: Path, model_dir: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    report = {"schema": "pytest-transformers-opt/report", "schema_version": 1, "tests": "__X__"}
    cases = {
        "deep": (DEEP, DEEP, "nested deeper than 64 levels"),
        "digits": (_with_marker(json.dumps({**config, "hidden_size": "__X__"}), "9" * 5000),
                   _with_marker(json.dumps(report), "9" * 5000), "an integer of 5000 digits"),
        "inf": (_with_marker(json.dumps({**config, "rope_theta": "__X__"}), "1e400"),
                _with_marker(json.dumps(report), "1e400"), "1e400 is out of range"),
        "huge": (json.dumps({**config, "vocab_size": 10**30}), json.dumps({**report, "tests": [10**30]}),
                 "does not fit in 64 bits"),
    }
    for case, (config_text, report_text, why) in cases.items():
        folder = tmp_path / case
        folder.mkdir()
        (folder / "config.json").write_text(config_text)
        (folder / "report.json").write_text(report_text)
        for option, path in (("--model", folder), ("--model", folder / "config.json"),
                             ("--from-report", folder / "report.json")):
            code, err = _advise(capsys, option, str(path))
            assert code == 2 and err.count("\n") == 1, (case, option, err)
            assert err.startswith(f"pytest-opt advise: error: {option}: ") and why in err, (case, err)
            assert str(folder) in err and "Traceback" not in err
    # a dimension that fits in 64 bits but no model has: the config's own check
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 2**50}))
    code, err = _advise(capsys, "--model", str(tmp_path))
    assert code == 2 and "hidden_size=1125899906842624 is beyond any model" in err
    # a FIFO at the path: refused at the real entry point, never waited on
    fifo_folder = tmp_path / "fifo"
    fifo_folder.mkdir()
    os.mkfifo(fifo_folder / "config.json")
    os.mkfifo(fifo_folder / "report.json")
    for option, path in (("--model", fifo_folder), ("--from-report", fifo_folder / "report.json")):
        done = subprocess.run([sys.executable, "-m", "pytest_transformers_opt", "advise", option, str(path)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert f"{option}: cannot read" in done.stderr and "not a regular file (a FIFO)" in done.stderr


# ------------------------------------------------------------------------- paths, umask, formats

def test_report_paths_expand_home_and_two_formats_cannot_share_a_file(pytester: pytest.Pytester,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    home = Path(os.environ["HOME"])  # pytester's own temporary HOME
    (home / "dir").mkdir(exist_ok=True)
    pytester.makepyfile(test_sentinel=SENTINEL)
    # the start-up check looks at the expanded path: ~/dir is a folder, not a file
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-report-html=~/dir")
    _one_usage_line(pytester, result, "--opt-report-html", f"{home / 'dir'}' is a folder")
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-report-md=~/missing/r.md")
    _one_usage_line(pytester, result, "--opt-report-md", f"{home / 'missing'}' does not exist")
    # one file for two formats, however it is spelled
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-report-json=r.json",
                                "--opt-report-md=./sub/../r.json")
    _one_usage_line(pytester, result, "--opt-report-json and --opt-report-md name the same file",
                    "each report format needs its own path")
    # an empty path on the command line would mean the current directory: refused
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-baselines=")
    _one_usage_line(pytester, result, "--opt-baselines", "'' is an empty path", argparse=True)
    monkeypatch.setenv("PYTEST_OPT_REPORT_HTML", str(pytester.path / "r.json"))
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-report-json=r.json")
    _one_usage_line(pytester, result, "--opt-report-json and PYTEST_OPT_REPORT_HTML name the same file")


def test_written_files_respect_the_umask(pytester: pytest.Pytester, model_dir: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    pytester.makepyfile(test_user=ONE_TEST)
    home = Path(os.environ["HOME"])
    (home / "out").mkdir(exist_ok=True)
    old = os.umask(0o027)
    try:
        result = pytester.runpytest(*INNER, "--opt-report-json=~/out/r.json", "--opt-report-md=~/out/r.md",
                                    "--opt-report-html=~/out/r.html", "--opt-baselines=bl",
                                    "--opt-update-baselines")
        code = main(["advise", "--model", model_dir, "--gpu-memory", "24 GiB",
                     "--write-test", str(pytester.path / "test_validate.py")])
    finally:
        os.umask(old)
    result.assert_outcomes(passed=1)
    assert code == 0, capsys.readouterr().err
    written = [home / "out" / "r.json", home / "out" / "r.md", home / "out" / "r.html",
               *(pytester.path / "bl").glob("*.json"), pytester.path / "test_validate.py"]
    assert len(written) == 5
    assert {str(p): oct(stat.S_IMODE(os.stat(p).st_mode)) for p in written} == {str(p): "0o640" for p in written}
    assert _report(home / "out" / "r.json")["tests"][0]["outcome"] == "passed"
    assert "def test_" in (pytester.path / "test_validate.py").read_text()
    # replacing a file keeps the mode it has (as writing into it would)
    os.chmod(home / "out" / "r.json", 0o604)
    files.write_atomic(home / "out" / "r.json", "{}\n")
    assert stat.S_IMODE(os.stat(home / "out" / "r.json").st_mode) == 0o604
    assert sorted(p.name for p in (home / "out").iterdir()) == ["r.html", "r.json", "r.md"]  # no temporary left


CHDIR_TEST = '''
import os
import pytest

@pytest.mark.optimization("sdpa")
def test_moves_away(opt_bench, tmp_path_factory):
    os.chdir(tmp_path_factory.mktemp("elsewhere"))
    opt_bench(prompts=["The cat eats"], max_new_tokens=4)
'''


def test_a_test_that_changes_directory_writes_where_the_report_says(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=CHDIR_TEST)
    (pytester.path / "out").mkdir()
    result = pytester.runpytest(*INNER, "--opt-baselines=bl", "--opt-update-baselines",
                                "--opt-report-json=out/r.json", f"--basetemp={pytester.path / 'tmp'}")
    result.assert_outcomes(passed=1)
    stored = list((pytester.path / "bl").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["key"] == stored[0].stem
    entry = _entry(_report(pytester.path / "out" / "r.json"), "test_moves_away")
    assert f"baseline stored in {stored[0]}" in entry["notes"]
    assert not [p for p in (pytester.path / "tmp").rglob("*") if p.suffix == ".json"]


def test_ini_baselines_from_a_subfolder_and_a_mistyped_folder(pytester: pytest.Pytester,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\nopt_baselines = bl\n")
    sub = pytester.mkdir("sub")
    (sub / "test_user.py").write_text(ONE_TEST)
    monkeypatch.chdir(sub)
    report_path = pytester.path / "r.json"
    # an empty variable is unset, not "the current directory": the ini folder is used
    monkeypatch.setenv("PYTEST_OPT_BASELINES", "")
    pytester.runpytest(*INNER, "--opt-update-baselines", f"--opt-report-json={report_path}").assert_outcomes(passed=1)
    stored = list((pytester.path / "bl").glob("*.json"))
    assert len(stored) == 1 and not list(sub.rglob("*.json"))
    before = stored[0].read_bytes()
    # run again from the sub-folder: the stored baseline is found; PYTEST_OPT_UPDATE_BASELINES is not a variable
    monkeypatch.setenv("PYTEST_OPT_UPDATE_BASELINES", "1")
    pytester.runpytest(*INNER, f"--opt-report-json={report_path}").assert_outcomes(passed=1)
    notes = _entry(_report(report_path), "test_sdpa")["notes"]
    assert any(n.startswith(f"similarity against the stored baseline {stored[0]}") for n in notes), notes
    assert stored[0].read_bytes() == before
    # a mistyped folder is said in the report, not silently unused (relative to where pytest started)
    pytester.runpytest(*INNER, "--opt-baselines=bll", f"--opt-report-json={report_path}").assert_outcomes(passed=1)
    notes = _entry(_report(report_path), "test_sdpa")["notes"]
    assert any(f"stored baselines requested (--opt-baselines={sub / 'bll'}) but that folder does not exist" in n
               for n in notes), notes


# --------------------------------------------------------------------------- the baseline's key

MODEL_KWARGS = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_full_model(opt_bench):
    opt_bench(prompts=["The cat eats"], max_new_tokens=6)

@pytest.mark.opt_model("tiny-random-llama", num_hidden_layers=1)
@pytest.mark.optimization("sdpa")
def test_one_layer(opt_bench):
    opt_bench(prompts=["The cat eats"], max_new_tokens=6)
'''


def test_model_arguments_are_part_of_the_stored_baseline_key(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=MODEL_KWARGS)
    report_path = pytester.path / "r.json"
    first = pytester.runpytest(*INNER, "--opt-baselines=bl", "--opt-update-baselines",
                               f"--opt-report-json={report_path}")
    first.assert_outcomes(passed=2)
    stored = {name: Path(next(n for n in _entry(_report(report_path), name)["notes"]
                              if n.startswith("baseline stored in ")).removeprefix("baseline stored in "))
              for name in ("test_full_model", "test_one_layer")}
    assert stored["test_full_model"] != stored["test_one_layer"]
    full, one = (json.loads(stored[name].read_text()) for name in ("test_full_model", "test_one_layer"))
    assert full["key"] == stored["test_full_model"].stem and one["key"] == stored["test_one_layer"].stem
    assert full["workload"] == one["workload"]  # same everything but the model argument
    assert full["topk"] != one["topk"]  # two different models were stored
    second = pytester.runpytest(*INNER, "--opt-baselines=bl", f"--opt-report-json={report_path}")
    second.assert_outcomes(passed=2)
    for name, path in stored.items():
        entry = _entry(_report(report_path), name)
        assert any(n.startswith(f"similarity against the stored baseline {path}") for n in entry["notes"])
        assert entry["similarity"]["token_match"] == 1.0  # judged against its own model


# ------------------------------------------------------------------------- out-of-range values

OUT_OF_RANGE = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_prompts_42(opt_bench):
    opt_bench(prompts=42)

@pytest.mark.optimization("sdpa")
def test_a_billion_new_tokens(opt_bench):
    opt_bench(max_new_tokens=10**9)

@pytest.mark.optimization("sdpa")
def test_a_billion_rounds(opt_bench):
    opt_bench(rounds=10**9)

@pytest.mark.opt_model("tiny-random-gpt2")
@pytest.mark.optimization("sdpa")
def test_prompt_past_the_positions(opt_bench):
    opt_bench(prompts=["the cat " * 800], max_new_tokens=4)

@pytest.mark.opt_model("tiny-random-gpt2")
@pytest.mark.optimization("sdpa")
def test_generation_past_the_positions(opt_bench):
    opt_bench(prompts=["The cat eats"], max_new_tokens=1024)

@pytest.mark.optimization("sdpa")
def test_still_runs(opt_bench):
    opt_bench(prompts=["The cat eats"], max_new_tokens=4)
'''


def test_out_of_range_values_name_the_argument_the_value_and_the_range(pytester: pytest.Pytester,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_user=OUT_OF_RANGE)
    report_path = pytester.path / "r.json"
    result = pytester.runpytest(*INNER, f"--opt-report-json={report_path}")
    _no_traceback(result)
    result.assert_outcomes(passed=1, failed=5)
    report = _report(report_path)
    expected: dict[str, list[str]] = {
        "test_prompts_42": ["opt_bench(prompts=...): got 42", "accepted: a string or a non-empty list of non-empty strings"],
        "test_a_billion_new_tokens": ["opt_bench(max_new_tokens=...)", "max_position_embeddings=1024",
                                      "1000000000 must be a whole number >= 1 and <= 1024"],
        "test_a_billion_rounds": ["opt_bench(rounds=...)", "1000000000 must be a whole number >= 1 and <= 1000"],
        "test_prompt_past_the_positions": ["opt_bench(max_new_tokens=4)", "tiny-random-gpt2 has "
                                           "max_position_embeddings=1024", "accepted: input tokens + "
                                           "max_new_tokens <= 1024"],
        "test_generation_past_the_positions": ["opt_bench(max_new_tokens=1024)", "+ 1024 = ",
                                               "max_new_tokens <= 1024"],
    }
    for name, fragments in expected.items():
        entry = _entry(report, name)
        assert entry["outcome"] == "failed" and all(f in entry["error"] for f in fragments), entry["error"]
    assert "IndexError" not in result.stdout.str()
    prompt_tokens = re.search(r"the longest prompt has (\d+) tokens", _entry(report, "test_prompt_past_the_positions")
                              ["error"])
    assert prompt_tokens and int(prompt_tokens.group(1)) > 1024
    # the same bounds for the options and their variables: a usage error before any test runs
    (pytester.path / "test_user.py").unlink()
    pytester.makepyfile(test_sentinel=SENTINEL)
    monkeypatch.setenv("PYTEST_OPT_ROUNDS", "1e29")
    _one_usage_line(pytester, pytester.runpytest("-p", "no:cacheprovider"), "PYTEST_OPT_ROUNDS: ", "'1e29'",
                    ">= 1 and <= 1000")
    monkeypatch.setenv("PYTEST_OPT_ROUNDS", "9" * 5000)
    _one_usage_line(pytester, pytester.runpytest("-p", "no:cacheprovider"), "PYTEST_OPT_ROUNDS: ",
                    "a number of 5000 digits", ">= 1 and <= 1000")
    monkeypatch.delenv("PYTEST_OPT_ROUNDS")
    _one_usage_line(pytester, pytester.runpytest("-p", "no:cacheprovider", f"--opt-rounds={10**9}"),
                    "--opt-rounds", "1000000000 must be a whole number >= 1 and <= 1000", argparse=True)
    _one_usage_line(pytester, pytester.runpytest("-p", "no:cacheprovider", "--opt-warmup=101"),
                    "--opt-warmup", "101 must be a whole number >= 0 and <= 100", argparse=True)


# --------------------------------------------------------------------------- environment variables

def _documented_variables() -> set[str]:
    """The ``environment variable`` column of the documentation's options table (the Reference page,
    generated by docs/hooks/reference.py at build time)."""
    from doc_examples import reference_hook  # tests/ is on sys.path (pytest's rootdir conftest import)

    reference = reference_hook()
    # cells split at the pipes outside code spans (the tables extension keeps a pipe inside one: `--opt-rounds=N|auto`)
    rows = [[cell.replace("\0", "|") for cell in re.sub(r"`[^`]*`", lambda m: m[0].replace("|", "\0"), line).split("|")]
            for line in reference.options().splitlines() if line.startswith("| `--")]
    return {name for row in rows for name in re.findall(r"`(PYTEST_OPT_[A-Z_]+)`", row[3])}


def test_every_variable_read_is_in_the_documented_table() -> None:
    read = {option.env for option in OPTIONS if option.env}
    assert _documented_variables() == read
    # flags that act have no variable at all
    assert {o.flag for o in OPTIONS if o.env is None} == {"--opt-update-baselines", "--opt-techniques"}
    # no module reads a PYTEST_OPT_* variable of its own behind the table's back
    package = ROOT / "pytest_transformers_opt"
    literals = {name for path in package.rglob("*.py")
                for name in re.findall(r"[\"'](PYTEST_OPT_[A-Z_]+)[\"']", path.read_text())}
    assert literals <= read, literals - read
    assert "PYTEST_TRANSFORMERS_OPT_CACHE" in (ROOT / "README.md").read_text()


def test_acting_flags_have_no_variable(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_sentinel=SENTINEL)
    monkeypatch.setenv("PYTEST_OPT_TECHNIQUES", "1")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)  # the tests ran: no catalogue printed instead
    assert (pytester.path / "ran.txt").exists() and "sdpa" not in result.stdout.str()
    assert "Env: PYTEST_OPT_TECHNIQUES" not in pytester.runpytest("--help").stdout.str()


@pytest.mark.parametrize("text, why", [
    ("[" * 65 + "]" * 65, "nested deeper than 64 levels"), (DEEP, "nested deeper than 64 levels"),
    ('{"a": NaN}', "NaN is not a JSON value"), ('[-Infinity]', "-Infinity is not a JSON value"),
    ("[1e400]", "1e400 is out of range"), (f"[{2**63}]", "does not fit in 64 bits"),
    (f"[{-2**63 - 1}]", "does not fit in 64 bits"), ("[" + "9" * 5000 + "]", "an integer of 5000 digits"),
    ("[1, 2", "is not JSON: Expecting"),
])
def test_the_guarded_reader_refuses(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(OptConfigError) as info:
        files.read_json(path, what="the thing", source="--opt-x", remedy="do this")
    message = str(info.value)
    assert message.startswith("--opt-x: ") and str(path) in message and why in message and message.endswith("; do this")


def test_the_guarded_reader_limits_size_and_values(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps(list(range(100))))
    assert files.read_json(path) == list(range(100))
    assert files.read_json(path, max_items=101) == list(range(100))
    with pytest.raises(OptConfigError, match="more than 100 values"):
        files.read_json(path, max_items=100)
    with pytest.raises(OptConfigError, match="over the limit of 10 bytes"):
        files.read_json(path, max_bytes=10)
    assert files.read_json(path, max_depth=1) == list(range(100))
    nested: Callable[[int], str] = lambda n: "[" * n + "]" * n  # noqa: E731
    path.write_text(nested(2))
    with pytest.raises(OptConfigError, match="nested deeper than 1 levels"):
        files.read_json(path, max_depth=1)
