"""Advice as text for people, as JSON for machines, and as the validation test file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..files import write_atomic
from .advice import Advice, ValidationPlan

SENTENCE = "The cat eats the red apple every morning."  # ~10 tokens with common tokenizers
TOKENS_PER_SENTENCE = 10


def _section(title: str, lines: list[str], bullet: str = "- ") -> list[str]:
    if not lines:
        lines = ["(none)"]
        bullet = ""
    return [title] + [f"  {bullet}{line}" for line in lines] + [""]


def render_text(advice: Advice, test_path: str | None = None) -> str:
    """The report: recommended change, configuration, why, support, tradeoffs, questions, validation."""
    out: list[str] = []
    out += _section("Recommended change", [advice.title], bullet="")
    out += _section("Configuration", [advice.marker_line()] if advice.configuration else [], bullet="")
    why = list(advice.why) + [figure.text() for figure in advice.figures]
    out += _section("Why", why)
    if advice.measured:
        source = f" (from {advice.measured_source})" if advice.measured_source else ""
        out += _section(f"Measured{source}", [figure.text() for figure in advice.measured])
    out += _section("Supported by", advice.documentation)
    out += _section("Expected tradeoffs", advice.tradeoffs)
    if advice.workload_tradeoffs:
        out += _section("Workload tradeoffs (not optimizations)", advice.workload_tradeoffs)
    out += _section("Open compatibility questions", advice.open_questions)
    out += _section("Assumptions / questions to answer", advice.assumptions)
    out += _section("Validation", validation_lines(advice, test_path))
    out.append(advice.verification_line())
    return "\n".join(out) + "\n"


def validation_lines(advice: Advice, test_path: str | None) -> list[str]:
    if advice.test is None or not advice.configuration:
        return ["Nothing new to validate."]
    plan = advice.test
    path = test_path or "test_recommended_change.py"
    lines = []
    if test_path:
        lines.append(f"Test written to {test_path}.")
    else:
        lines.append(f"Write the test: add --write-test {path} to this command.")
    lines.append(f"Run it: pytest {path} --opt-report")
    checks = ", ".join(f"{key}={value}" for key, value in advice.budgets.items())
    lines.append(f"It runs {plan.num_prompts} prompt(s) of ~{plan.input_tokens} tokens, {plan.max_new_tokens} new "
                 f"tokens, batch {plan.batch_size}, on {plan.model}; it measures peak memory, latency and "
                 f"output similarity against the baseline and checks {checks}.")
    baseline = " + ".join(c.label() for c in plan.baseline) or "eager attention, dynamic cache, no quantization"
    lines.append(f"The plugin also runs the baseline ({baseline}) for the comparison: run the test where the "
                 f"baseline fits; max_memory checks the optimized peak only.")
    lines += [f"Note: {note}." for note in plan.notes]
    return lines


def render_json(advice: Advice, test_path: str | None = None) -> str:
    data = advice.to_dict()
    if data["validation"] is not None:
        data["validation"]["test_path"] = test_path
        if test_path:
            data["validation"]["command"] = f"pytest {test_path} --opt-report"
    return json.dumps(data, indent=2) + "\n"


def _q(text: str) -> str:
    """A double-quoted Python string literal (JSON escapes are valid Python escapes)."""
    return json.dumps(text)


def model_marker_args(plan: ValidationPlan) -> str:
    """The arguments of the ``opt_model`` marker that loads the plan's model: ``"NAME", dtype="float32"``."""
    model_args = [_q(plan.model)]
    if plan.revision:
        model_args.append(f"revision={_q(plan.revision)}")
    model_args.append(f"dtype={_q(plan.dtype)}")
    return ", ".join(model_args)


def prompts_lines(plan: ValidationPlan, name: str = "PROMPTS") -> list[str]:
    """A module constant of ``plan.num_prompts`` prompts of about ``plan.input_tokens`` tokens each."""
    sentences = max(1, plan.input_tokens // TOKENS_PER_SENTENCE)
    indent = " " * (len(name) + 4)
    return [
        f"# ~{plan.input_tokens} tokens per prompt",
        f"{name} = [f\"Request {{i}}: \" + \" \".join([{_q(SENTENCE)}] * {sentences})",
        f"{indent}for i in range({plan.num_prompts})]",
    ]


def bench_test_lines(advice: Advice, name: str = "test_recommended_change", prompts: str = "PROMPTS",
                     before_def: tuple[str, ...] = (), docstring: str | None = None) -> list[str]:
    """One ``opt_bench`` test of the advice's configuration and budgets (its markers, then the function);
    ``before_def``: comment lines between the markers and ``def``."""
    plan = advice.test
    if plan is None or not advice.configuration:
        raise ValueError("this advice has no configuration to validate")
    lines = []
    if plan.baseline:
        lines.append(f"@pytest.mark.opt_baseline({', '.join(change.marker_arg() for change in plan.baseline)})")
    lines += [advice.marker_line(), *before_def, f"def {name}(opt_bench):"]
    if docstring:
        lines.append(f'    """{docstring}"""')
    lines.append(f"    opt_bench(prompts={prompts}, max_new_tokens={plan.max_new_tokens}, "
                 f"batch_size={plan.batch_size})")
    return lines


def test_file_prologue(docstring: list[str], plan: ValidationPlan) -> list[str]:
    """A written test file's first lines: its docstring (lines, quotes added), the imports and the model marker."""
    return [
        f'"""{docstring[0]}', *docstring[1:], '"""',
        "",
        "import pytest",
        "",
        "from pytest_transformers_opt import techniques  # noqa: F401  (used by techniques.NAME(...) markers)",
        "",
        f"pytestmark = pytest.mark.opt_model({model_marker_args(plan)})",
    ]


def validation_test_source(advice: Advice) -> str:
    """The validation test: a pytest file that the plugin runs (``pytest PATH --opt-report``)."""
    plan: ValidationPlan | None = advice.test
    if plan is None or not advice.configuration:
        raise ValueError("this advice has no configuration to validate")
    lines = [
        *test_file_prologue([f"Validation test written by `pytest-opt advise`: {advice.title}.", "",
                             "Run: pytest THIS_FILE --opt-report",
                             "Replace PROMPTS with prompts from your real workload for a representative "
                             "measurement."], plan),
        "",
        *prompts_lines(plan),
        "",
        "",
        *bench_test_lines(advice),
        "",
    ]
    return "\n".join(lines)


def write_test(advice: Advice, path: str | os.PathLike[str]) -> Path:
    """Write the validation test atomically, with the permissions of any new file (``files.write_atomic``)."""
    target = Path(path).expanduser()
    write_atomic(target, validation_test_source(advice))
    return target
