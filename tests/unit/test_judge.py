"""The one judge (issue 40, item 1): one decision rule for every comparison, and no verdict word decided outside
``verdict/``."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

import pytest_transformers_opt
from pytest_transformers_opt.verdict.judge import (DETECTABLE_FACTOR, IMPROVED, INCONCLUSIVE, OK, REGRESSED,
                                                   VERDICT_WORDS, decide, decide_exact, detectable_size, worst)

PACKAGE = Path(pytest_transformers_opt.__file__).parent


@pytest.mark.parametrize("amount, p_worse, p_better, detectable, verdict", [
    (25.0, 0.01, 1.0, 15.0, REGRESSED),      # past the limit, significant
    (25.0, 0.20, 1.0, 15.0, INCONCLUSIVE),   # past the limit, not significant: never a silent ok
    (25.0, 0.20, 1.0, 40.0, INCONCLUSIVE),
    (-25.0, 1.0, 0.01, 15.0, IMPROVED),      # symmetric
    (-25.0, 1.0, 0.20, 15.0, OK),            # an improvement it cannot confirm is no risk: ok when it could see
    (3.0, 0.9, 0.9, 15.0, OK),               # within, and a change of twice the limit would have been flagged
    (3.0, 0.9, 0.9, 21.0, INCONCLUSIVE),     # within, but blind to twice the limit
    (3.0, 0.9, 0.9, 20.0, OK),               # exactly twice the limit is still seen
    (3.0, 0.9, 0.9, math.inf, INCONCLUSIVE),  # no error known: cannot vouch
])
def test_decide_is_the_one_rule(amount: float, p_worse: float, p_better: float, detectable: float,
                                verdict: str) -> None:
    assert decide(amount, 10.0, p_worse, p_better, detectable) == verdict


def test_an_exact_figure_is_judged_on_its_value() -> None:
    assert decide_exact(0.02, 0.01) == REGRESSED
    assert decide_exact(0.01, 0.01) == OK  # at the limit is within it
    assert decide_exact(-0.5, 0.01) == IMPROVED
    assert detectable_size(10.0, 1.645, 0.0) == 10.0
    assert detectable_size(10.0, 1.645, math.inf) == math.inf
    assert DETECTABLE_FACTOR == 2.0


def test_a_tests_verdict_is_its_worst_thresholds() -> None:
    assert worst([OK, IMPROVED, INCONCLUSIVE]) == INCONCLUSIVE
    assert worst([IMPROVED, REGRESSED, INCONCLUSIVE]) == REGRESSED
    assert worst([OK, IMPROVED]) == IMPROVED
    assert worst([]) == OK


def _verdict_literals(source: str, name: str) -> list[str]:
    """Where ``source`` (the module ``name``) writes a verdict word as a string literal, other than as a mapping key (``row["accepted"]``,
    ``{"ok": ...}``, ``budget.get("ok")``) or in a docstring: a verdict decided, or compared, by hand."""
    tree = ast.parse(source)
    allowed: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            allowed.add(id(body[0].value))  # a docstring
        if isinstance(node, ast.Dict):
            allowed.update(id(key) for key in node.keys if key is not None)
        if isinstance(node, ast.Subscript):
            allowed.add(id(node.slice))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args:
            allowed.add(id(node.args[0]))
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.iter, (ast.Tuple, ast.List)):
            allowed.update(id(element) for element in node.iter.elts)  # the keys a loop reads
    return [f"{name}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in VERDICT_WORDS and id(node) not in allowed]


def test_no_verdict_word_is_decided_outside_verdict() -> None:
    """report/ reads, writes and renders: every verdict word it shows comes from ``verdict.judge``'s constants, set
    by the judge; a literal ``"regressed"`` there would be a second rule (or a check that drifts from the first)."""
    found = [hit for path in sorted((PACKAGE / "report").rglob("*.py"))
             for hit in _verdict_literals(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))]
    assert found == []


def test_the_house_check_finds_a_verdict_decided_by_hand() -> None:
    """The check above can fail: a renderer that decides a word by hand is caught, its keys are not."""
    source = ('def f(x):\n    """regressed"""\n    row = {"ok": 1}\n'
              '    return "regressed" if x else row["ok"] or row.get("inconclusive")\n')
    assert _verdict_literals(source, "probe.py") == ["probe.py:4: 'regressed'"]
