"""Issue 19, round two: the plugin beside pytest's own switches and other plugins.

- a project conftest written the README's way runs with the plugin disabled (``-p no:transformers_opt``);
- pytest-timeout cutting the first test's setup does not break the session (torch is imported before
  the first test's timer starts);
- ``-n 2`` filters torch's import-time deprecation warnings as a single process does (the xdist rows of
  test_plugin_compat.py).
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from conftest import FAST_ARGS

ROOT = Path(__file__).resolve().parents[2]


def _documented_hook_examples() -> list[tuple[str, str]]:
    """Every Python block of the documentation (docs/ and the README) that implements one of the plugin's hooks."""
    found = []
    for page in [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]:
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
        found += [(f"{page.relative_to(ROOT)} block {n}", block) for n, block in enumerate(blocks, 1)
                  if re.search(r"^def pytest_opt_", block, flags=re.M)]
    return found


def _hookspec_examples() -> list[str]:
    """The conftest examples in the hook specs' docstrings, dedented."""
    from pytest_transformers_opt import hookspecs

    examples = []
    for spec in (hookspecs.pytest_opt_register_techniques, hookspecs.pytest_opt_report_extra):
        example = textwrap.dedent((spec.__doc__ or "").split("::", 1)[1])
        examples.append(example)
    return examples


def _hook_examples() -> list[tuple[str, str]]:
    examples = _documented_hook_examples()
    assert examples, "no documented hook example found"
    examples.append(("example_project/tests/conftest.py", (ROOT / "example_project/tests/conftest.py").read_text()))
    examples += [(f"hookspecs example {n}", block) for n, block in enumerate(_hookspec_examples(), 1)]
    return examples


def test_every_hook_has_an_example():
    text = "\n".join(source for _, source in _hook_examples())
    assert "def pytest_opt_register_techniques(" in text
    assert "def pytest_opt_report_extra(" in text


@pytest.mark.parametrize("where, conftest", _hook_examples(), ids=[where for where, _ in _hook_examples()])
def test_a_conftest_written_the_documented_way_runs_with_the_plugin_disabled(pytester, where, conftest):
    pytester.makeconftest(conftest)
    pytester.makepyfile(test_user="def test_plain():\n    assert 1 + 1 == 2\n")
    result = pytester.runpytest("-p", "no:transformers_opt", "-p", "no:cacheprovider")
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output and "unknown hook" not in output, (where, output[-2000:])
    result.assert_outcomes(passed=1)
    assert result.ret == 0


def test_the_examples_still_work_with_the_plugin_on(run_user, monkeypatch):
    """``optionalhook=True`` changes nothing while the plugin is loaded: the documented technique is registered and
    measured, the report_extra example's fields are in the report."""
    monkeypatch.delenv("GITHUB_SHA", raising=False)
    run = run_user('''
import pytest

@pytest.mark.optimization("repetition_penalty", min_token_match=0.0, max_kl=100, min_top1=0.0)
def test_measured(opt_bench):
    opt_bench(max_new_tokens=2)
''', conftest=next(block for _, block in _documented_hook_examples() if "registry.register(" in block) + "\n" + _hookspec_examples()[1])
    run.result.assert_outcomes(passed=1)
    assert run.test("test_measured")["techniques"] == ["repetition_penalty"]
    assert run.test("test_measured")["extra"] == {"ticket": "OPT-12"}
    assert run.report["extra"] == {"commit": None}


# -- item 11: pytest-timeout and the plugin's one import of torch -------------------------------------------
# A busy machine, made repeatable: torch's import takes SLOW_S seconds halfway through (after its C extension
# loaded), longer than the --timeout the project sets.
SLOW_TORCH_CONFTEST = """
import sys, time

class SlowTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch._tensor":
            time.sleep(3.0)
        return None

sys.meta_path.insert(0, SlowTorch())
"""

PATIENT = "@pytest.mark.timeout(900)  # a measurement's own time, not the import's"


def _timed_run(pytester: pytest.Pytester, source: str) -> tuple[pytest.RunResult, Path]:
    pytester.makeconftest(SLOW_TORCH_CONFTEST)
    pytester.makepyfile(test_user=source)
    report = pytester.path / "opt-report.json"
    # a fresh process: torch is imported for the first time, as in a user's session
    result = pytester.runpytest_subprocess(*FAST_ARGS, "-p", "timeout", "--timeout=1", f"--opt-report-json={report}")
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output and "partially initialized" not in output, output[-3000:]
    assert result.ret in (0, 1), output[-3000:]  # never a crash (139: segmentation fault)
    return result, report


def test_pytest_timeout_never_cuts_the_torch_import_of_a_test_that_uses_the_fixtures(pytester):
    result, report = _timed_run(pytester, f"""
import pytest

def test_hardware_first(opt_hardware):  # its setup would have imported torch, under the 1 s timer
    assert opt_hardware.device == "cpu"

{PATIENT}
@pytest.mark.optimization("sdpa")
def test_measured(opt_bench):
    opt_bench(max_new_tokens=2)
""")
    result.assert_outcomes(passed=2)
    # done after collection, before the first test: announced, since it took longer than a few seconds
    result.stdout.fnmatch_lines(["collected 2 items",
                                 "transformers-opt: importing torch and transformers (once per session, before the "
                                 "first test) ...",
                                 "transformers-opt: importing torch and transformers: done in *"])
    written = json.loads(report.read_text())
    assert written["summary"]["passed"] == 1 and [t["outcome"] for t in written["tests"]] == ["passed"]


def test_a_timeout_during_the_torch_import_fails_that_test_alone(pytester):
    """A test that asks for a fixture through ``request.getfixturevalue`` imports torch inside its own timer: the
    timeout takes effect once the import is whole, that test fails, the next one runs and the report is written."""
    result, report = _timed_run(pytester, f"""
import pytest

def test_asks_late(request):
    request.getfixturevalue("opt_hardware")

{PATIENT}
@pytest.mark.optimization("sdpa")
def test_loads_after_it(request):
    assert request.getfixturevalue("opt_model").model is not None
""")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_user.py::test_asks_late - Failed: Timeout*"])
    written = json.loads(report.read_text())
    assert {t["nodeid"].rsplit("::", 1)[1]: t["outcome"] for t in written["tests"]} == {"test_loads_after_it": "passed"}


def test_a_signal_that_arrives_during_the_import_is_handled_once_it_is_complete():
    """The mechanism alone: SIGALRM (pytest-timeout's) and SIGINT (Ctrl-C) are recorded during the block and raised
    again, once each, after it, to the handlers installed before."""
    import signal

    from pytest_transformers_opt.engine.heavy_imports import signals_held

    handled: list[tuple[int, str]] = []
    where = ["inside"]

    def record(number: int, frame: object) -> None:
        handled.append((number, where[0]))

    previous = {signum: signal.signal(signum, record) for signum in (signal.SIGALRM, signal.SIGINT)}
    try:
        with signals_held():
            signal.raise_signal(signal.SIGALRM)
            signal.raise_signal(signal.SIGALRM)
            signal.raise_signal(signal.SIGINT)
            assert handled == []
            where[0] = "after"
        assert handled == [(signal.SIGALRM, "after"), (signal.SIGINT, "after")]
        assert signal.getsignal(signal.SIGALRM) is record and signal.getsignal(signal.SIGINT) is record
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# -- item 22: `-n 2` shows none of torch's import-time DeprecationWarnings ----------------------------------
# Under pytest-xdist the controller runs no test: its first import of transformers was the advisor's, at the
# session's end, outside the quiet import a single process does in its first test (torch.utils.mkldnn's 14
# `script_method` warnings in the summary). Proven by the pytest-xdist rows of test_plugin_compat.py (`-n 2`
# in a fresh process, "script_method" nowhere in the output), which also keep the run short.
