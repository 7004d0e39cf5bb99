"""The starter test file: the changes the advisor picks for the model, one ``opt_bench`` test each.

The picks are the advisor's own (``pytest-opt advise``): first its recommendation for the workload as
stated (the stage the estimates say breaks first, else speed), then its recommendation for each stage
of the protocol in turn (load, long-input, long-generation, concurrency, speed), keeping the first
``count`` different techniques. Markers, budgets, workloads and prompts are written by the advisor's
renderer (``advisor.render``), as ``pytest-opt advise --write-test`` writes them.
"""

from __future__ import annotations

import shlex
import textwrap
from dataclasses import dataclass, replace

from ..advisor import Advice, ServingScenario, advise, load_model_shape
from ..advisor.estimates import STAGES
from ..advisor.recommend import SPEED_BUDGET, size_literal
from ..advisor.render import bench_test_lines, prompts_lines, test_file_prologue
from ..advisor.workload import MEMORY_STAGES
from ..units import format_bytes

STARTER_TESTS = 3
WIDTH = 100  # the written file's comment and docstring lines
# None: the advisor's own choice of stage; then every stage of the protocol, in its order.
PROBLEMS_IN_ORDER: tuple[str | None, ...] = (None, *STAGES, "speed")


@dataclass(frozen=True)
class Pick:
    """One change the advisor recommends, and the stage (``--problem``) it was asked about."""

    advice: Advice
    problem: str | None

    @property
    def name(self) -> str:
        assert self.advice.change is not None  # picks() keeps only advice that proposes a change
        return self.advice.change.name


def picks(workload: ServingScenario, count: int = STARTER_TESTS) -> list[Pick]:
    """Up to ``count`` recommendations of different techniques for ``workload`` (the config is read once;
    ``OptConfigError`` naming --model when it cannot be)."""
    shape = load_model_shape(workload.model, workload.revision)
    found: list[Pick] = []
    for problem in PROBLEMS_IN_ORDER:
        advice = advise(replace(workload, problem=problem), config=shape)
        if advice.change is None or advice.test is None or not advice.configuration:
            continue
        if all(pick.name != advice.change.name for pick in found):
            found.append(Pick(advice, problem))
        if len(found) == count:
            break
    return found


def unset_budgets(advice: Advice) -> list[str]:
    """The budgets the advisor leaves out until a run has measured them, as comment text."""
    lines = []
    if advice.stage in MEMORY_STAGES and "max_memory" not in advice.budgets:
        lines.append('max_memory="...": the memory the model may use (give --gpu-memory to `pytest-opt init` '
                     'or `advise` to have it set); the report\'s "peak mem" column is what it checks')
    if advice.stage not in MEMORY_STAGES and "min_speedup" not in advice.budgets:
        lines.append(f"min_speedup={SPEED_BUDGET}: the speedup a speed change should bring, once measured on "
                     f"the hardware you deploy on (on a tiny model timings are noise, so the advisor left it "
                     f"out)")
    return lines


def _comment(text: str) -> str:
    return " ".join(text.split())  # one line, whatever a name held


def _in_docstring(text: str) -> str:
    return _comment(text).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def starter_source(model: str, chosen: list[Pick], gpu_memory_bytes: int | None, config_note: str) -> str:
    """The test file's text; ``model`` is the name the user gave (written as given)."""
    plans = [pick.advice.test for pick in chosen]
    assert all(plan is not None for plan in plans)
    first = chosen[0].advice.test
    assert first is not None
    plan = replace(first, model=model)
    hardware = f" on a GPU with {format_bytes(gpu_memory_bytes)}" if gpu_memory_bytes is not None else ""
    listing = [textwrap.fill(f"- {pick.name} (stage {pick.advice.stage}): {_in_docstring(pick.advice.title)}", WIDTH,
                             subsequent_indent="  ") for pick in chosen]
    about = textwrap.fill(
        f"Run: pytest ({config_note}). Each test loads the model twice (the baseline and the optimized "
        f"configuration), checks the budgets in its marker and proves the change took effect; a technique this "
        f"machine cannot run is skipped with the reason. Replace the prompts with prompts from your real "
        f"workload for a representative measurement.", WIDTH)
    lines = test_file_prologue([
        f"Optimization tests for {_in_docstring(model)}{hardware}, written by `pytest-opt init`.",
        "",
        f"The {len(chosen)} changes the advisor (`pytest-opt advise`) recommends for this model, one test each:",
        *listing,
        "",
        about,
    ], plan)
    names: dict[tuple[int, int], str] = {}
    for pick in chosen:
        test = pick.advice.test
        assert test is not None
        key = (test.input_tokens, test.num_prompts)
        if key not in names:
            names[key] = "PROMPTS" if not names else f"PROMPTS_{len(names) + 1}"
            lines += ["", *prompts_lines(test, names[key])]
    for pick in chosen:
        test = pick.advice.test
        assert test is not None and pick.advice.change is not None
        technique = pick.advice.change.technique
        needs = f" Needs {technique.requirement}." if technique is not None else ""
        advise_command = f"pytest-opt advise --model {shlex.quote(model)}"
        if gpu_memory_bytes is not None:
            advise_command += f" --gpu-memory {shlex.quote(size_literal(gpu_memory_bytes))}"
        if pick.problem is not None:
            advise_command += f" --problem {pick.problem}"
        comments = [f"# The advisor's reasons: {_comment(advise_command)}"]
        unset = unset_budgets(pick.advice)
        if unset:
            comments.append("# Budgets to add once a run has measured them (nothing is measured yet):")
            comments += [textwrap.fill(_comment(text), WIDTH, initial_indent="#   ", subsequent_indent="#     ")
                         for text in unset]
        docstring = textwrap.fill(_in_docstring(f"Stage {pick.advice.stage}: {pick.advice.title}.{needs}"), WIDTH,
                                  subsequent_indent="    ")
        lines += ["", "", *bench_test_lines(pick.advice, f"test_{pick.name}", names[(test.input_tokens,
                                                                                       test.num_prompts)],
                                            before_def=tuple(comments), docstring=docstring)]
    return "\n".join(lines) + "\n"
