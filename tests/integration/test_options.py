"""Options, their ini keys and environment variables, as users set them.

A bad value is a usage error (exit code 4) before any test runs, naming the option, ini key or
variable and the accepted forms; CLI beats environment beats ini; ``--opt-techniques``,
``--markers`` and ``--help`` describe the plugin; the report header names the device.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from pytest_transformers_opt.engine import tiny_models
from pytest_transformers_opt.techniques import build_registry

# Resolved now, before pytester points HOME at a temporary folder (see test_bad_input.py).
_MODEL_CACHE = str(tiny_models.cache_root())
INNER = ("-p", "no:cacheprovider", "--opt-rounds=1", "--opt-warmup=0")
USAGE_ERROR = pytest.ExitCode.USAGE_ERROR

# A test that leaves a trace when it runs: a usage error must stop the session before it.
SENTINEL = '''
import pathlib

def test_leaves_a_trace():
    pathlib.Path("ran.txt").write_text("ran")
'''




def _no_internal_error(result: pytest.RunResult) -> None:
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output and "Traceback (most recent call last)" not in output, output


def _glob(text: str) -> str:
    """``text`` as a literal inside an fnmatch pattern."""
    return re.sub(r"([\[\]*?])", r"[\1]", text)


def _usage_error(pytester: pytest.Pytester, result: pytest.RunResult, *fragments: str) -> None:
    """Exit code 4, every fragment in one stderr line, no traceback, and no test ran."""
    _no_internal_error(result)
    assert result.ret == USAGE_ERROR, result.stderr.str()
    result.stderr.fnmatch_lines(["*" + "*".join(_glob(f) for f in fragments) + "*"])
    assert not (pytester.path / "ran.txt").exists()
    assert "passed" not in result.stdout.str() and "failed" not in result.stdout.str()


# --- bad values: command line --------------------------------------------------------------------------
@pytest.mark.parametrize(("option", "fragments"), [
    ("--opt-rounds=0", ["argument --opt-rounds", "0 must be a whole number >= 1"]),
    ("--opt-rounds=x", ["argument --opt-rounds", "'x' must be a whole number >= 1",
                        "accepted: N (a fixed count, 1 to 1000), MIN..MAX (sequential) or auto (3..10; to 200 "
                        "while an --opt-ab-fail verdict is open, within 300 s of a test's timed rounds)"]),
    ("--opt-rounds=5..2", ["argument --opt-rounds", "(MAX of MIN..MAX): 2 must be a whole number >= 5"]),
    ("--opt-rounds=3..x", ["argument --opt-rounds", "'3..x' is not MIN..MAX; accepted: N (a fixed count"]),
    ("--opt-warmup=-1", ["argument --opt-warmup", "-1 must be a whole number >= 0"]),
    ("--opt-warmup=some", ["argument --opt-warmup", "'some' must be a whole number >= 0"]),
    ("--opt-budgets=sometimes", ["argument --opt-budgets", "'sometimes' is not a budget mode",
                                 "accepted: enforce, warn, off"]),
    ("--opt-device=tpu", ["argument --opt-device", "'tpu' is not a device", "accepted: auto, cpu, cuda, cuda:N"]),
    ("--opt-device=cuda:x", ["argument --opt-device", "'cuda:x'", "cuda:N"]),
    ("--opt-require=", ["argument --opt-require", "names no technique", "NAME[,NAME] or all"]),
    ("--opt-gpus-per-worker=0", ["argument --opt-gpus-per-worker", "0 must be a whole number >= 1"]),
])
def test_bad_option_value_is_a_usage_error(pytester: pytest.Pytester, option: str, fragments: list[str]) -> None:
    pytester.makepyfile(SENTINEL)
    result = pytester.runpytest("-p", "no:cacheprovider", option)
    _usage_error(pytester, result, *fragments)


# --- bad values: ini and pyproject.toml ----------------------------------------------------------------
@pytest.mark.parametrize(("key", "value", "fragments"), [
    ("opt_device", "tpu", ["ini opt_device: 'tpu' is not a device", "accepted: auto, cpu, cuda, cuda:N"]),
    ("opt_budgets", "sometimes", ["ini opt_budgets: 'sometimes' is not a budget mode", "enforce, warn, off"]),
    ("opt_rounds", "0", ["ini opt_rounds: rounds: 0 must be a whole number >= 1"]),
    ("opt_warmup", "x", ["ini opt_warmup", "'x' must be a whole number >= 0"]),
    ("opt_require", ",", ["ini opt_require", "names no technique", "NAME[,NAME] or all"]),
    ("opt_report", "maybe", ["ini opt_report", "'maybe' is not a boolean", "true/false"]),
    ("opt_max_kl", "lots", ["ini opt_max_kl", "budget max_kl", "'lots'", "finite number >= 0"]),
    ("opt_max_memory", "lots", ["ini opt_max_memory", "budget max_memory", "'lots'", '"6 GiB"']),
    ("opt_min_top1", "2", ["ini opt_min_top1", "budget min_top1", "from 0 to 1"]),
    ("opt_max_ttft", "soon", ["ini opt_max_ttft", "budget max_ttft", '"50 ms"']),
])
def test_bad_ini_value_is_a_usage_error(pytester: pytest.Pytester, key: str, value: str,
                                        fragments: list[str]) -> None:
    pytester.makeini(f"[pytest]\n{key} = {value}\n")
    pytester.makepyfile(SENTINEL)
    result = pytester.runpytest("-p", "no:cacheprovider")
    _usage_error(pytester, result, *fragments)


def test_bad_pyproject_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyprojecttoml('[tool.pytest.ini_options]\nopt_device = "tpu"\n')
    pytester.makepyfile(SENTINEL)
    result = pytester.runpytest("-p", "no:cacheprovider")
    _usage_error(pytester, result, "ini opt_device: 'tpu' is not a device", "auto, cpu, cuda, cuda:N")


# --- bad values: environment ---------------------------------------------------------------------------
@pytest.mark.parametrize(("variable", "value", "fragments"), [
    ("PYTEST_OPT_BUDGETS", "bogus", ["PYTEST_OPT_BUDGETS: 'bogus' is not a budget mode", "enforce, warn, off"]),
    ("PYTEST_OPT_DEVICE", "tpu", ["PYTEST_OPT_DEVICE: 'tpu' is not a device", "auto, cpu, cuda, cuda:N"]),
    ("PYTEST_OPT_ROUNDS", "0", ["PYTEST_OPT_ROUNDS", "0 must be a whole number >= 1"]),
    ("PYTEST_OPT_ROUNDS", "--1", ["PYTEST_OPT_ROUNDS", "must be a whole number >= 1"]),
    ("PYTEST_OPT_WARMUP", "²", ["PYTEST_OPT_WARMUP", "must be a whole number >= 0"]),
    ("PYTEST_OPT_REPORT", "perhaps", ["PYTEST_OPT_REPORT", "'perhaps' is not a boolean"]),
])
def test_bad_environment_value_is_a_usage_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                variable: str, value: str, fragments: list[str]) -> None:
    monkeypatch.setenv(variable, value)
    pytester.makepyfile(SENTINEL)
    result = pytester.runpytest("-p", "no:cacheprovider")
    _usage_error(pytester, result, *fragments)


# --- report paths are checked before any test runs ------------------------------------------------------
def test_report_json_in_missing_folder_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SENTINEL)
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-report-json=/nonexistent-dir/r.json")
    _usage_error(pytester, result, "--opt-report-json", "'/nonexistent-dir' does not exist")


def test_report_json_that_is_a_folder_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.mkdir("reports")
    pytester.makepyfile(SENTINEL)
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-report-json=reports")
    _usage_error(pytester, result, "--opt-report-json", "/reports' is a folder", "give a file path")


def test_report_json_from_ini_names_the_ini_key(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nopt_report_json = /nonexistent-dir/r.json\n")
    pytester.makepyfile(SENTINEL)
    result = pytester.runpytest("-p", "no:cacheprovider")
    _usage_error(pytester, result, "ini opt_report_json", "does not exist")


# --- precedence: CLI beats environment beats ini -----------------------------------------------------------
# A latency budget no run can meet: it fails whenever budgets are enforced, deterministically (a
# min_speedup failure is judged by a rank test, which one round per side can never make significant).
IMPOSSIBLE_BUDGET = '''
import pytest

@pytest.mark.optimization("static_cache", max_latency="1 us")
def test_impossible_budget(opt_bench):
    opt_bench(max_new_tokens=4)
'''


def _report(pytester: pytest.Pytester) -> dict:
    return json.loads((pytester.path / "report.json").read_text())


def test_cli_beats_environment_beats_ini(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\nopt_budgets = off\n")
    pytester.makepyfile(IMPOSSIBLE_BUDGET)
    monkeypatch.setenv("PYTEST_OPT_BUDGETS", "warn")

    # the command line wins: enforce, so the budget fails the test
    result = pytester.runpytest(*INNER, "--opt-report-json=report.json", "--opt-budgets=enforce")
    _no_internal_error(result)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*budgets failed (max_latency)*", "*max_latency*<= 1 us*FAILED*marker*"])
    assert _report(pytester)["settings"]["budgets_mode"] == "enforce"

    # no option: the environment wins over the ini, warn reports without failing
    result = pytester.runpytest(*INNER, "--opt-report-json=report.json")
    _no_internal_error(result)
    result.assert_outcomes(passed=1)
    report = _report(pytester)
    assert report["settings"]["budgets_mode"] == "warn"
    assert report["tests"][0]["failed_budgets"] == ["max_latency"]

    # no option, no variable: the ini applies, off measures without checking
    monkeypatch.delenv("PYTEST_OPT_BUDGETS")
    result = pytester.runpytest(*INNER, "--opt-report-json=report.json")
    _no_internal_error(result)
    result.assert_outcomes(passed=1)
    report = _report(pytester)
    assert report["settings"]["budgets_mode"] == "off"
    assert report["tests"][0]["failed_budgets"] == [] and report["tests"][0]["outcome"] == "passed"


def test_rounds_precedence_in_the_report_settings(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same order for a number; no test needs to measure to see it (one must use the plugin: a run
    where none did writes no report)."""
    pytester.makeini("[pytest]\nopt_rounds = 7\nopt_warmup = 3\n")
    monkeypatch.setenv("PYTEST_OPT_ROUNDS", "4")
    pytester.makepyfile("def test_uses_the_plugin(opt_model):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-report-json=report.json", "--opt-rounds=2")
    result.assert_outcomes(passed=1)
    assert (_report(pytester)["settings"]["rounds"], _report(pytester)["settings"]["warmup"]) == (2, 3)
    pytester.runpytest("-p", "no:cacheprovider", "--opt-report-json=report.json").assert_outcomes(passed=1)
    assert _report(pytester)["settings"]["rounds"] == 4


# --- --opt-techniques -----------------------------------------------------------------------------------
def test_opt_techniques_prints_the_catalogue_and_exits(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SENTINEL)
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-techniques")
    _no_internal_error(result)
    assert result.ret == 0
    assert not (pytester.path / "ran.txt").exists()
    assert "passed" not in result.stdout.str()
    result.stdout.fnmatch_lines(["technique catalogue on *"])
    text = result.stdout.str()
    for name in build_registry().names():
        block = re.search(rf"^  {re.escape(name)} +\S.*\n +-> (supported|unsupported: \S.*)$", text, re.MULTILINE)
        assert block, f"{name} is missing from the catalogue or has no verdict:\n{text}"
    if not torch.cuda.is_available():
        result.stdout.fnmatch_lines([
            "  flash_attention_2 *",
            "*-> unsupported: flash_attention_2 needs a CUDA GPU of compute capability >= 8.0; found: cpu*",
        ])
        result.stdout.fnmatch_lines(["  flash_attention_3 *", "*-> unsupported: *compute capability >= 9.0*"])
        result.stdout.fnmatch_lines(["  eager *", "*-> supported"])
    else:
        result.stdout.fnmatch_lines(["  flash_attention_2 *", "*-> *"])


# --- --markers and --strict-markers ------------------------------------------------------------------------
def test_markers_are_listed_with_their_signatures(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("-p", "no:cacheprovider", "--markers")
    _no_internal_error(result)
    assert result.ret == 0
    result.stdout.fnmatch_lines([
        "@pytest.mark.optimization(*techniques, **budgets): ?*",
        "@pytest.mark.opt_model(name_or_path, *, revision=None, dtype=None, trust_remote_code=False, "
        "**from_pretrained_kwargs): ?*",
        "@pytest.mark.opt_baseline(*techniques): ?*",
    ])


def test_the_three_markers_pass_under_strict_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile('''
        import pytest

        pytestmark = pytest.mark.opt_model("tiny-random-llama", dtype="float32")

        @pytest.mark.opt_baseline("eager")
        class TestMarked:
            @pytest.mark.optimization("sdpa", max_kl=0.01)
            def test_all_three(self, opt_bench):
                result = opt_bench(max_new_tokens=4)
                assert result.techniques == ["sdpa"]
                assert result.baseline_techniques == ["eager"]
    ''')
    result = pytester.runpytest(*INNER, "--strict-markers")
    _no_internal_error(result)
    result.assert_outcomes(passed=1)


# --- --help ---------------------------------------------------------------------------------------------
# the README's Options section: every option, as --help shows it, and a word of its help text.
DOCUMENTED_OPTIONS = {
    "--opt-report": "report",
    "--opt-report-json=PATH": "JSON",
    "--opt-report-md=PATH": "Markdown",
    "--opt-report-html=PATH": "HTML",
    "--opt-model=NAME": "default model",
    "--opt-device=DEV": "cuda:N",
    "--opt-require=NAMES": "strict mode",
    "--opt-budgets=MODE": "enforce",
    "--opt-baselines=DIR": "baselines",
    "--opt-update-baselines": "baselines",
    "--opt-compare=PATH": "earlier JSON report",
    "--opt-compare-fail=EXPR[,EXPR]": "regressions",
    "--opt-gpus-per-worker=N": "xdist",
    "--opt-techniques": "catalogue",
    "--opt-rounds=N|MIN..MAX|auto": "sequential",
    "--opt-warmup=N": "warm-up",
}


def test_help_shows_every_option_with_help_text(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("-p", "no:cacheprovider", "--help")
    _no_internal_error(result)
    assert result.ret == 0
    lines = result.outlines
    for flag, word in DOCUMENTED_OPTIONS.items():
        result.stdout.fnmatch_lines([f"  {_glob(flag)}*"])
        start = next(i for i, line in enumerate(lines) if line.startswith(f"  {flag}"))
        block = [lines[start][len(flag) + 2:]]
        for line in lines[start + 1:]:
            if not line.startswith(" " * 8) or line.lstrip().startswith("-"):
                break
            block.append(line)
        text = " ".join(" ".join(block).split())
        assert word in text, f"{flag}: help text {text!r} lacks {word!r}"
    result.stdout.fnmatch_lines(["*opt_budgets*", "*opt_max_kl*"])  # the ini keys are documented too


# --- report header -------------------------------------------------------------------------------------
def test_report_header_names_the_device_and_settings(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    # the device is probed when a test first uses the plugin (the probe imports torch): the header says so
    result.stdout.fnmatch_lines([
        "transformers-opt: device auto (probed on first use), torch 2.*, transformers 5.*, "
        "default model tiny-random-llama, budgets enforce",
    ])


def test_report_header_follows_the_options(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\nopt_model = tiny-random-qwen3\n")
    monkeypatch.setenv("PYTEST_OPT_BUDGETS", "warn")
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-device=cpu")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["transformers-opt: device cpu, *default model tiny-random-qwen3, budgets warn"])


# --- the resolved settings -----------------------------------------------------------------------------
def test_settings_are_one_frozen_field_per_option(pytester: pytest.Pytester) -> None:
    from dataclasses import fields

    from pytest_transformers_opt.options import OPTIONS, Settings

    keys = {option.dest.removeprefix("opt_") for option in OPTIONS}
    assert keys <= {f.name for f in fields(Settings)}
    pytester.makeconftest('''
import dataclasses

import pytest
from pytest_transformers_opt.session import SESSION_KEY

def pytest_sessionstart(session):
    settings = session.config.stash[SESSION_KEY].settings
    assert (settings.rounds.minimum, settings.rounds.maximum, settings.warmup, settings.budgets, settings.require) == (2, None, 0, "warn", frozenset({"sdpa"}))
    assert settings.sources["rounds"] == "--opt-rounds" and settings.compare_thresholds == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.rounds = 3
''')
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-rounds=2", "--opt-warmup=0", "--opt-budgets=warn",
                                "--opt-require=sdpa")
    result.assert_outcomes(passed=1)
