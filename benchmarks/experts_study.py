"""MoE experts study: how far each experts implementation's outputs lie from eager's (issue 22, item 4).

Runs real pytest sessions with the plugin on the built-in mixture-of-experts models (``tiny-random-qwen3-moe``,
``tiny-random-gpt-oss``): every test is ``@pytest.mark.optimization(techniques.experts(implementation=X))``
against the plugin's baseline (eager experts), over several prompt sets, in float32 and bfloat16, with budgets
in warn mode so that every run reports its figures (KL mean, top-1 and token_match, as the report has them).
``eager`` against eager is the null row (the same forward on both sides). An injected breakage row,
``top1_only`` (the experts forward of the requested implementation with only each token's first expert, as a
routing bug would), shows what the budgets must still catch.

The experts technique's default similarity budgets (``verdict/budgets.py``) are set from this table:
``python benchmarks/experts_study.py [--sets 4] [--max-new-tokens 24] [--models a,b] [--dtypes float32,bfloat16]``.
"""

from __future__ import annotations

import argparse
import json
import textwrap
import time
from pathlib import Path

# this folder is on sys.path when the script runs: one session runner and one table cell format
from verdict_study import _spread, similarity_session  # noqa: E402

MODELS = ("tiny-random-qwen3-moe", "tiny-random-gpt-oss")
DTYPES = ("float32", "bfloat16")
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
PROMPT_SETS = (
    ("Explain gravity in one sentence.", "The cat sees", "Name the capital of France."),
    ("Write a haiku about the sea.", "def fibonacci(n):", "What is the boiling point of water?"),
    ("List three primary colors.", "Once upon a time, in a small village,", "Translate 'good morning' to Spanish."),
    ("Why is the sky blue?", "The quick brown fox", "Give one tip for writing clear code."),
)

# A breakage a routing bug would cause: each token goes through its first selected expert only (weight 1).
CONFTEST = textwrap.dedent('''
    import torch

    from pytest_transformers_opt.techniques.moe import Experts


    def _top1_only(forward):
        def broken(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            index = top_k_index.clone()
            index[..., 1:] = index[..., :1]
            weights = torch.zeros_like(top_k_weights)
            weights[..., 0] = 1.0
            return forward(self, hidden_states, index, weights, *args, **kwargs)
        return broken


    class Top1Only(Experts):
        """experts(implementation=...) with a routing bug: every token through its first expert only."""
        name = "top1_only"

        def configure_load(self, load, ctx):
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

            key = f"top1_only_{self.impl}"
            if key not in ALL_EXPERTS_FUNCTIONS:
                ALL_EXPERTS_FUNCTIONS.register(key, _top1_only(ALL_EXPERTS_FUNCTIONS[self.impl]))
            load.kwargs["experts_implementation"] = key

        def verify_loaded(self, model):
            return None

        def verify_run(self, model, evidence):
            return None


    def pytest_opt_register_techniques(registry):
        registry.register(Top1Only)
''')


def _cases(sets: int, models: tuple[str, ...], dtypes: tuple[str, ...]) -> list[tuple[str, str, str, str, str, int]]:
    """(case id, model, dtype, label, technique expression, prompt set); each model's cases in a row."""
    rows = [(impl, f"techniques.experts(implementation={impl!r})") for impl in IMPLEMENTATIONS]
    rows.append(("top1_only (breakage)", "TechniqueSpec.of('top1_only', implementation='batched_mm')"))
    cases = []
    for model in models:
        for dtype in dtypes:
            for number, (label, expr) in enumerate(rows):
                for index in range(sets):
                    cases.append((f"{model}-{dtype}-t{number}-set{index}", model, dtype, label, expr, index))
    return cases


def _tests(cases: list[tuple[str, str, str, str, str, int]], max_new_tokens: int) -> str:
    params = ",\n    ".join(
        f"pytest.param({index}, marks=[pytest.mark.opt_model({model!r}, dtype={dtype!r}), "
        f"pytest.mark.optimization({expr})], id={case!r})"
        for case, model, dtype, _, expr, index in cases)
    return (f"import pytest\nfrom pytest_transformers_opt import techniques\n"
            f"from pytest_transformers_opt.techniques import TechniqueSpec\n\n"
            f"PROMPT_SETS = {PROMPT_SETS!r}\n\nCASES = [\n    {params},\n]\n\n\n"
            f"@pytest.mark.parametrize(\"prompt_set\", CASES)\n"
            f"def test_case(opt_bench, prompt_set):\n"
            f"    opt_bench(prompts=list(PROMPT_SETS[prompt_set]), max_new_tokens={max_new_tokens})\n")


def run_study(sets: int, max_new_tokens: int, models: tuple[str, ...], dtypes: tuple[str, ...],
              extra_args: list[str]) -> dict:
    """One pytest session per model, budgets in warn mode so that every run reports its figures."""
    rows: list[dict] = []
    started = time.perf_counter()
    for model in models:
        cases = _cases(sets, (model,), dtypes)
        label_of = {case: (m, dtype, label) for case, m, dtype, label, _, _ in cases}
        print(f"experts study: {model}, {len(cases)} tests ...", flush=True)
        rows += similarity_session(CONFTEST, _tests(cases, max_new_tokens), label_of, extra_args, "experts-study-")
        print(f"experts study: {model} done ({time.perf_counter() - started:.0f} s so far)", flush=True)
    return {"rows": rows, "seconds": time.perf_counter() - started}


def table(result: dict, sets: int, max_new_tokens: int) -> str:
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for row in result["rows"]:
        groups.setdefault(row["key"], []).append(row)
    lines = [f"{sets} prompt set(s) x 3 prompts, max_new_tokens={max_new_tokens}, rounds=1 warmup=0, "
             f"--opt-budgets=warn ({result['seconds']:.0f} s); each cell: median (min-max) over the prompt sets; "
             f"baseline: eager experts, eager attention", "",
             "| model | dtype | experts | runs | KL mean | top-1 | token_match | outcome |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (model, dtype, label), rows in groups.items():
        outcomes = sorted({r["outcome"] for r in rows})
        why = next((r["why"] for r in rows if r["outcome"] != "passed" and r["why"]), "")
        outcome = ", ".join(outcomes) + (f": {why[:90]}" if why else "")
        lines.append(f"| {model} | {dtype} | {label} | {len(rows)} | {_spread([r['kl'] for r in rows])} | "
                     f"{_spread([r['top1'] for r in rows])} | {_spread([r['token_match'] for r in rows])} | {outcome} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", type=int, default=4, help="prompt sets per row (at most %d)" % len(PROMPT_SETS))
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--out", help="also write the rows as JSON here")
    args, extra = parser.parse_known_args(argv)
    sets = max(1, min(args.sets, len(PROMPT_SETS)))
    result = run_study(sets, args.max_new_tokens, tuple(args.models.split(",")), tuple(args.dtypes.split(",")),
                       extra)
    print(table(result, sets, args.max_new_tokens))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
