"""A failed or errored test's reason: one readable line in the terminal, Markdown and HTML reports, the
full error in the JSON (issue 11, item 7)."""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable

import pytest

from pytest_transformers_opt.units import REASON_CHARS, failure_reason

from conftest import UserRun

LONG_PATH = "/tmp/torchinductor_root/ab/" + "c" * 40 + "/" + "kernel_" * 12 + "flex_attention.cpp"

# a user's file as it would fail: an exception whose message opens with a long path, torch's own compile
# error (its command runs past 4,000 characters, so the compiler's diagnostic comes late), an assert, and
# a fixture that errors at setup
USER_TESTS = f'''
import pytest
from torch._inductor.exc import CppCompileError

LONG_PATH = {LONG_PATH!r}


@pytest.fixture
def dataset():
    raise KeyError("no prompts file: the fixture found nothing to load")


def test_path_first(opt_model):
    raise RuntimeError(LONG_PATH + "\\n\\nflex_attention kernel failed to build for head_dim 7\\n"
                       "see " + LONG_PATH + " for the generated source")


def test_compile_error(opt_model):
    command = ["g++", LONG_PATH] + ["-I" + LONG_PATH + "/include" + str(n) for n in range(40)]
    output = LONG_PATH + ":5:10: fatal error: omp.h: No such file or directory\\ncompilation terminated."
    raise CppCompileError(command, output)


def test_assert(opt_model):
    answer = 3
    assert answer == 4, "the model answered 3\\nwhen asked for 4"


def test_fixture_error(dataset, opt_model):
    pass
'''

EXPECTED = {
    "test_path_first": ("failed", "RuntimeError: flex_attention kernel failed to build for head_dim 7"),
    "test_compile_error": ("failed", "CppCompileError: fatal error: omp.h: No such file or directory"),
    "test_assert": ("failed", "AssertionError: the model answered 3"),
    "test_fixture_error": ("error", "KeyError: 'no prompts file: the fixture found nothing to load'"),
}


class _HtmlReasons(HTMLParser):
    """The text of each results row's outcome cell reason, and the "Failures and errors" table's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.outcome_reasons: list[str] = []
        self.problem_rows: list[list[str]] = []
        self._in_reason = self._in_problems = self._in_cell = False
        self._text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = dict(attrs).get("class") or ""
        if tag == "section":
            self._in_problems = dict(attrs).get("id") == "problems"
        elif tag == "span" and "reason" in classes.split():
            self._in_reason, self._text = True, ""
        elif tag == "tr" and self._in_problems:
            self.problem_rows.append([])
        elif tag == "td" and self._in_problems:
            self._in_cell, self._text = True, ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "span" and self._in_reason:
            self.outcome_reasons.append(self._text)
            self._in_reason = False
        elif tag == "td" and self._in_cell:
            self.problem_rows[-1].append(self._text)
            self._in_cell = False
        elif tag == "section":
            self._in_problems = False

    def handle_data(self, data: str) -> None:
        if self._in_reason or self._in_cell:
            self._text += data


def _md_plain(text: str) -> str:
    """Markdown cell text back to plain text (md_text backslash-escapes markup and `&`)."""
    return html.unescape(re.sub(r"\\(.)", r"\1", text))


def _no_cut_path(reason: str, error: str) -> None:
    """Every path-like word of the reason is whole: it occurs in the error as a word of its own."""
    words = set(re.split(r"\s+", error))
    for word in reason.replace("…", " ").split():
        if "/" in word:
            assert word.strip("'\"") in {w.strip("'\"") for w in words}, (word, reason)


def test_failure_reasons_in_every_report(run_user: Callable[..., UserRun], tmp_path: Path) -> None:
    md, page = tmp_path / "report.md", tmp_path / "report.html"
    run = run_user(USER_TESTS, "--opt-rounds=1", "--opt-warmup=0", "--opt-report",
                   f"--opt-report-md={md}", f"--opt-report-html={page}")
    run.result.assert_outcomes(failed=3, errors=1)

    # the JSON keeps the whole error (the compiler's diagnostic comes after 4,000 characters of command)
    errors = {name: run.test(name)["error"] for name in EXPECTED}
    assert len(errors["test_compile_error"]) > 4000
    assert errors["test_compile_error"].rstrip().endswith("compilation terminated.")
    assert errors["test_path_first"].startswith("RuntimeError: " + LONG_PATH + "\n")
    assert "when asked for 4" in errors["test_assert"]
    for name, (outcome, reason) in EXPECTED.items():
        assert run.test(name)["outcome"] == outcome
        assert failure_reason(errors[name]) == reason

    terminal = run.result.stdout.lines
    start = terminal.index("failed or errored (not on budgets):")
    shown = {}
    for line in terminal[start + 1:]:
        if not line.startswith("  "):
            break
        name, _, reason = line.strip().partition(": ")
        shown[name] = reason
    assert shown == {name: reason for name, (_outcome, reason) in EXPECTED.items()}

    markdown = md.read_text()
    listed = dict(re.findall(r"^- `test_user\.py::(\w+)` \((?:failed|error)\): (.*)$", markdown, re.M))
    assert {name: _md_plain(text) for name, text in listed.items()} == shown
    cells = {m[0]: _md_plain(m[1]) for m in re.findall(r"^\| `test_user\.py::(\w+)` \| [^|]* \| ((?:[^|\\]|\\.)*) \|",
                                                        markdown, re.M)}
    assert cells == {name: f"{outcome}: {reason}" for name, (outcome, reason) in EXPECTED.items()}

    parser = _HtmlReasons()
    parser.feed(page.read_text())
    assert sorted(parser.outcome_reasons) == sorted(reason for _outcome, reason in EXPECTED.values())
    problems = {row[0].split("::")[-1]: (row[1], row[2]) for row in parser.problem_rows if row}
    assert problems == EXPECTED

    for name, (_outcome, reason) in EXPECTED.items():
        assert "\n" not in reason and len(reason) <= REASON_CHARS
        _no_cut_path(reason, errors[name])


@pytest.mark.parametrize(("error", "expected"), [
    # torch's own wrapping of a compile error: the innermost type, the compiler's line that names it
    ("torch._inductor.exc.InductorError: CppCompileError: C++ compile error\n\nCommand:\ng++ " + LONG_PATH
     + "\n\nOutput:\n" + LONG_PATH + ":3:1: error: 'x' was not declared\n\nSet TORCHDYNAMO_VERBOSE=1 for more",
     "CppCompileError: error: 'x' was not declared"),
    ("torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:\nRuntimeError: shapes (3) vs (4)",
     "RuntimeError: shapes (3) vs (4)"),
    ("Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n    g()\nZeroDivisionError: division by zero",
     "ZeroDivisionError: division by zero"),
    ("assert 3 == 4\n +  where 3 = len([1, 2, 3])", "AssertionError: assert 3 == 4"),
    ("FileNotFoundError: " + LONG_PATH, "FileNotFoundError: " + LONG_PATH),
    ("did not finish (interrupted, or no call phase report)", "did not finish (interrupted, or no call phase report)"),
    ("", "no message recorded"),
])
def test_reason_of_an_error(error: str, expected: str) -> None:
    assert failure_reason(error) == expected


def test_long_reason_is_cut_on_a_word_and_never_inside_a_path() -> None:
    words = "ValueError: " + " ".join(f"word{n}" for n in range(80))
    reason = failure_reason(words)
    assert reason.endswith("…") and len(reason) <= REASON_CHARS
    assert reason[:-1] in words and words[len(reason) - 1] == " "  # ends where a word did
    deep = "OSError: cannot open " + "/very/deep" * 40 + "/weights.bin for reading"
    assert failure_reason(deep) == "OSError: cannot open …/weights.bin …"
