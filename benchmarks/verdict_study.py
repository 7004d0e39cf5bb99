"""Verdict study: can the plugin's gate be trusted on this machine?

Runs real pytest sessions with the plugin against the built-in model and counts verdicts:

* null A/B runs: the same configuration on both sides (a registered no-op technique), gated with
  ``min_speedup=1.0`` and ``max_memory_ratio=1.0`` ("not slower, not larger"): every failure is a
  false alarm;
* injected slowdowns of 5, 10, 20 and 50 percent (a technique that busy-waits that fraction of each
  forward pass), gated with ``min_speedup=1.0``: every failure is a detection;
* injected breakage: NaN logits, one changed token, a silent fallback (compile requested, never
  run): each must fail every time.

Usage: ``python benchmarks/verdict_study.py [--null 100] [--slow 25] [--broken 10] [--out FILE]``.

``--similarity`` measures instead what default similarity budgets are set from: KL mean, top-1 and
token_match of every lossy technique (and lossless ones, for the bf16 class) on ``smollm2-135m`` and
``tiny-random-llama`` in float32 and bfloat16, over prompt sets of the default workload's shape, and of
injected breakage on ``smollm2-135m`` (NaN logits, one changed token, lm_head or every Linear x1.1, a
silent fallback). Budgets run in warn mode so that every run reports its figures; the table gives the
median and min-max over the prompt sets:
``python benchmarks/verdict_study.py --similarity [--sets 4] [--broken-sets 1] [--models a,b] [--skip LABELS]``.

``--dtypes`` picks the dtypes (default ``float32,bfloat16``). Each row also says how many runs the default
budgets would fail under enforce (``failed``: a similarity budget, judged with its sample size and near-ties
as the plugin judges it, or an error), the flips of top-1 in the compared steps and how many were near-ties.

``--near-tie-gaps`` measures what the near-tie gap of each dtype is set from
(``similarity.NEAR_TIE_GAPS``): the baseline (eager attention) decodes each prompt set greedily, SDPA decodes
the same tokens (forced), and at every position the log-probability gap between the baseline's top token and
each of its next four moves by ``pair_gap_move``; a row per dtype gives the moves' median, 99th percentile
and maximum, and every top-1 flip with the baseline's own gap:
``python benchmarks/verdict_study.py --near-tie-gaps [--models smollm2-135m] [--dtypes float32,bfloat16,float16]``.

``--compare`` measures the cross-run gate instead: one reference session, then ``--runs`` null sessions
(the same test again) and ``--runs`` sessions of the same test 25% slower (``--compare-slowdown``), in
alternation, each a real pytest session compared with the reference through ``--opt-compare=ref.json
--opt-compare-fail=latency:10%`` (``--compare-fail``); it counts exit statuses, and how the median-only
rule (ratio of medians past the limit) would have judged the same runs:
``python benchmarks/verdict_study.py --compare [--runs 20] [--out FILE] [-- --opt-rounds=5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CONFTEST = textwrap.dedent('''
    import contextlib
    import time

    import torch

    from pytest_transformers_opt.techniques import Technique
    from pytest_transformers_opt.techniques.catalogue import Compile


    class NullAB(Technique):
        """Changes nothing: both sides run the same configuration."""
        name = "null_ab"
        family = "study"
        summary = "no-op"


    class SlowDown(Technique):
        """Busy-waits pct percent of every forward pass, like a slower kernel would."""
        name = "slowdown"
        family = "study"
        summary = "injected slowdown"
        accepted_params = {"pct": "percent"}

        @contextlib.contextmanager
        def around_generate(self, model):
            started = []
            factor = self.params["pct"] / 100.0

            def before(module, args, kwargs):
                started.append(time.perf_counter())

            def after(module, args, kwargs, output):
                elapsed = time.perf_counter() - started.pop()
                until = time.perf_counter() + elapsed * factor
                while time.perf_counter() < until:
                    pass

            handles = [model.register_forward_pre_hook(before, with_kwargs=True),
                       model.register_forward_hook(after, with_kwargs=True)]
            try:
                yield
            finally:
                for handle in handles:
                    handle.remove()


    @contextlib.contextmanager
    def lm_head_hook(model, hook):
        handle = model.lm_head.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()


    class NanLogits(Technique):
        name = "nan_logits"
        family = "study"
        summary = "injected NaN logits"

        def around_generate(self, model):
            return lm_head_hook(model, lambda m, a, out: out * float("nan"))


    class ChangedToken(Technique):
        """At the third decoding step, the top token loses: one changed token."""
        name = "changed_token"
        family = "study"
        summary = "injected token change"

        def around_generate(self, model):
            calls = [0]

            def hook(module, args, out):
                calls[0] += 1
                if calls[0] == 3:
                    out = out.clone()
                    top = out[:, -1, :].argmax(-1)
                    out[torch.arange(out.shape[0]), -1, top] = -1e4
                return out

            return lm_head_hook(model, hook)


    class CompileFallback(Compile):
        """Asks for compile, but generation silently runs eager."""
        name = "compile_fallback"

        def configure_generation(self, gen, ctx):
            super().configure_generation(gen, ctx)
            gen.kwargs["disable_compile"] = True


    class ScaledWeights(Technique):
        """Weights off by 10%: lm_head or every Linear times 1.1. Done on the outputs (Llama's Linears have
        no bias, so this equals scaling the weights) so that it stacks on a quantized model's own Linears,
        and leaves the tied input embedding as it was."""
        name = "scaled_weights"
        family = "study"
        summary = "injected weight error"
        accepted_params = {"target": "'lm_head' or 'linear'", "factor": "float"}

        @contextlib.contextmanager
        def around_generate(self, model):
            factor = float(self.params.get("factor", 1.1))
            lm_head_only = self.params.get("target", "linear") == "lm_head"
            handles = [module.register_forward_hook(lambda m, a, out: out * factor)
                       for module in model.modules()
                       if isinstance(module, torch.nn.Linear) and (module is model.lm_head or not lm_head_only)]
            try:
                yield
            finally:
                for handle in handles:
                    handle.remove()


    def pytest_opt_register_techniques(registry):
        for technique in (NullAB, SlowDown, NanLogits, ChangedToken, CompileFallback, ScaledWeights):
            registry.register(technique)
''')


def _tests(null: int, slow: int, broken: int) -> str:
    return textwrap.dedent(f'''
        import pytest
        from pytest_transformers_opt.techniques import TechniqueSpec

        def _cases(marker, runs, label):
            return [pytest.param(run, marks=marker, id=f"{{label}}-{{run}}") for run in range(runs)]

        NULL = _cases(pytest.mark.optimization("null_ab", min_speedup=1.0, max_memory_ratio=1.0), {null}, "null")
        SLOW = [case for pct in (5, 10, 20, 50) for case in _cases(
            pytest.mark.optimization(TechniqueSpec.of("slowdown", pct=pct), min_speedup=1.0), {slow}, f"slow{{pct}}")]
        BROKEN = [case for kind in ("nan_logits", "changed_token", "compile_fallback")
                  for case in _cases(pytest.mark.optimization(kind), {broken}, kind)]

        @pytest.mark.parametrize("run", NULL + SLOW + BROKEN)
        def test_case(opt_bench, run):
            opt_bench()
    ''')


def run_study(null: int, slow: int, broken: int, extra_args: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="verdict-study-") as folder:
        root = Path(folder)
        (root / "conftest.py").write_text(CONFTEST)
        (root / "test_study.py").write_text(_tests(null, slow, broken))
        report = root / "report.json"
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                        f"--opt-report-json={report}", *extra_args, "test_study.py"],
                       cwd=root, check=False, stdout=subprocess.DEVNULL, env=os.environ.copy())
        elapsed = time.perf_counter() - started
        data = json.loads(report.read_text())
        if os.environ.get("VERDICT_STUDY_REPORT"):  # keep the session's report, to read a verdict's details
            shutil.copyfile(report, os.environ["VERDICT_STUDY_REPORT"])
    tally: dict[str, list[int]] = {}
    for test in data["tests"]:
        label = test["nodeid"].split("[")[1].rsplit("-", 1)[0]
        group = f"slowdown {label[4:]}%" if label.startswith("slow") else label
        failed = test["outcome"] in ("failed", "error")
        tally.setdefault(group, [0, 0, 0])
        tally[group][0] += failed
        tally[group][1] += 1
        # timed rounds per side, confirming rounds included (a broken technique fails before any)
        tally[group][2] += (test.get("optimized") or {}).get("rounds") or 0
    return {"tally": tally, "seconds": elapsed, "settings": data["settings"]}


# --- similarity mode: the figures that default similarity budgets are set from --------------------
# Prompt sets of the default workload's shape (3 prompts); the first is the plugin's default workload.
PROMPT_SETS = (
    ("Explain gravity in one sentence.", "The cat sees", "Name the capital of France."),
    ("Write a haiku about the sea.", "def fibonacci(n):", "What is the boiling point of water?"),
    ("List three primary colors.", "Once upon a time, in a small village,", "Translate 'good morning' to Spanish."),
    ("Why is the sky blue?", "The quick brown fox", "Give one tip for writing clear code."),
)
# (label, class, technique expression): every lossy technique, and lossless ones for the bf16 class
HEALTHY = (
    ("sdpa", "lossless", '"sdpa"'),
    ("static_cache", "lossless", '"static_cache"'),
    ("compile", "lossless", '"compile"'),
    ("bnb_8bit", "8-bit weights", '"bnb_8bit"'),
    ("quanto_int8", "8-bit weights", '"quanto_int8"'),
    ("bnb_4bit(nf4)", "4-bit weights / quantized KV", 'TechniqueSpec.of("bnb_4bit", quant_type="nf4")'),
    ("hqq_4bit", "4-bit weights / quantized KV", '"hqq_4bit"'),
    ("quantized_cache(quanto,4)", "4-bit weights / quantized KV",
     'TechniqueSpec.of("quantized_cache", backend="quanto", nbits=4)'),
    ("quantized_cache(quanto,2)", "4-bit weights / quantized KV",
     'TechniqueSpec.of("quantized_cache", backend="quanto", nbits=2)'),
)
BROKEN = (
    ("NaN logits", '"nan_logits"'),
    ("one changed token", '"changed_token"'),
    ("lm_head x1.1", 'TechniqueSpec.of("scaled_weights", target="lm_head")'),
    ("every Linear x1.1", 'TechniqueSpec.of("scaled_weights", target="linear")'),
    ("silent fallback (compile never ran)", '"compile_fallback"'),
)
# the weight errors stacked on each lossy technique: does its default budget still catch them?
STACKED_ON = ("bnb_8bit", "quanto_int8", "bnb_4bit(nf4)", "quantized_cache(quanto,4)")
STACKED_BREAKAGE = ("lm_head x1.1", "every Linear x1.1")
SIMILARITY_MODELS = ("smollm2-135m", "tiny-random-llama")
BROKEN_MODEL = "smollm2-135m"
DTYPES = ("float32", "bfloat16")


def _similarity_cases(sets: int, models: tuple[str, ...], skip: frozenset[str], broken_sets: int = 1,
                      only: frozenset[str] = frozenset(), dtypes: tuple[str, ...] = DTYPES,
                      ) -> list[tuple[str, str, str, str, str, int]]:
    """(case id, model, dtype, label, technique expression, prompt set), grouped so that each loaded model
    serves its tests in a row (the session keeps only 3 loaded)."""
    cases = []
    for model in models:
        for dtype in dtypes:
            rows = [(label, expr, sets) for label, _, expr in HEALTHY if label not in skip]
            if model == BROKEN_MODEL:  # far from healthy figures: fewer prompt sets tell enough
                rows += [(label, expr, broken_sets) for label, expr in BROKEN if label not in skip]
                healthy = {label: expr for label, _, expr in HEALTHY}
                broken = dict(BROKEN)
                rows += [(f"{base} + {breakage}", f"{healthy[base]}, {broken[breakage]}", broken_sets)
                         for base in STACKED_ON for breakage in STACKED_BREAKAGE
                         if base not in skip and breakage not in skip and f"{base} + {breakage}" not in skip]
            if only:
                rows = [row for row in rows if row[0] in only]
            for number, (label, expr, count) in enumerate(rows):
                for index in range(count):
                    cases.append((f"{model}-{dtype}-t{number}-set{index}", model, dtype, label, expr, index))
    return cases


def _similarity_tests(cases: list[tuple[str, str, str, str, str, int]], max_new_tokens: int) -> str:
    params = ",\n    ".join(
        f"pytest.param({index}, marks=[pytest.mark.opt_model({model!r}, dtype={dtype!r}), "
        f"pytest.mark.optimization({expr})], id={case!r})"
        for case, model, dtype, _, expr, index in cases)
    return (f"import pytest\nfrom pytest_transformers_opt.techniques import TechniqueSpec\n\n"
            f"PROMPT_SETS = {PROMPT_SETS!r}\n\nCASES = [\n    {params},\n]\n\n\n"
            f"@pytest.mark.parametrize(\"prompt_set\", CASES)\n"
            f"def test_case(opt_bench, prompt_set):\n"
            f"    opt_bench(prompts=list(PROMPT_SETS[prompt_set]), max_new_tokens={max_new_tokens})\n")


def similarity_session(conftest: str, tests: str, label_of: dict[str, tuple[str, str, str]], extra_args: list[str],
                       prefix: str) -> list[dict]:
    """One pytest session over ``tests`` (parametrised by case) in a temporary project with ``conftest``, budgets
    in warn mode so that every run reports its figures; a row per test: its case, ``label_of[case]``, outcome,
    why, similarity figures and budget limits."""
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        root = Path(folder)
        (root / "conftest.py").write_text(conftest)
        (root / "test_study.py").write_text(tests)
        report = root / "report.json"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                        "-W", "ignore", "--opt-budgets=warn", "--opt-rounds=1", "--opt-warmup=0",
                        f"--opt-report-json={report}", *extra_args, "test_study.py"],
                       cwd=root, check=False, stdout=subprocess.DEVNULL, env=os.environ.copy())
        data = json.loads(report.read_text())
    rows = []
    for test in data["tests"]:
        case = test["nodeid"].split("[", 1)[1].rstrip("]")
        similarity = test.get("similarity") or {}
        rows.append({"case": case, "key": label_of[case], "outcome": test["outcome"],
                     "why": test.get("skip_reason") or next(iter((test.get("error") or "").strip().splitlines()), ""),
                     "kl": similarity.get("kl_mean"), "top1": similarity.get("top1"),
                     "token_match": similarity.get("token_match"),
                     "steps": similarity.get("compared_steps"), "flips": similarity.get("top1_flips"),
                     "near_tie_flips": similarity.get("near_tie_flips"),
                     # what enforce would have said: a budget failed (warn mode records it), or the test failed
                     "failed": test["outcome"] in ("failed", "error") or bool(test.get("failed_budgets")),
                     "failed_budgets": list(test.get("failed_budgets") or []),
                     "budgets": {b["name"]: b["limit"] for b in test.get("budgets") or []}})
    return rows


def run_similarity(sets: int, max_new_tokens: int, models: tuple[str, ...], skip: frozenset[str],
                   extra_args: list[str], broken_sets: int = 1, only: frozenset[str] = frozenset(),
                   dtypes: tuple[str, ...] = DTYPES) -> dict:
    """One pytest session per model, budgets in warn mode so that every run reports its figures."""
    label_of = {case: (model, dtype, label)
                for case, model, dtype, label, _, _ in _similarity_cases(sets, models, skip, broken_sets, only, dtypes)}
    rows: list[dict] = []
    started = time.perf_counter()
    for model in models:
        cases = _similarity_cases(sets, (model,), skip, broken_sets, only, dtypes)
        rows += similarity_session(CONFTEST, _similarity_tests(cases, max_new_tokens), label_of, extra_args,
                                   "verdict-study-sim-")
    return {"rows": rows, "seconds": time.perf_counter() - started}


def _spread(values: list[float | None]) -> str:
    """median (min-max) of the finite figures; NaN (written as null) counted and shown apart."""
    import statistics

    finite = [v for v in values if v is not None]
    nan = len(values) - len(finite)
    if not finite:
        return "NaN" if nan else "-"
    text = f"{statistics.median(finite):.3g} ({min(finite):.3g}-{max(finite):.3g})"
    return text + (f", {nan} NaN" if nan else "")


def similarity_table(result: dict, sets: int, max_new_tokens: int) -> str:
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for row in result["rows"]:
        groups.setdefault(row["key"], []).append(row)
    klass = {label: k for label, k, _ in HEALTHY} | {label: "injected breakage" for label, _ in BROKEN}
    klass |= {f"{base} + {breakage}": f"breakage on {klass[base]}" for base in STACKED_ON for breakage in STACKED_BREAKAGE}
    lines = [f"{sets} prompt set(s) (breakage: fewer, see runs) x 3 prompts, max_new_tokens={max_new_tokens}, rounds=1 warmup=0, "
             f"--opt-budgets=warn ({result['seconds']:.0f} s); each cell: median (min-max) over the prompt sets", "",
             "| model | dtype | technique | class | runs | KL mean | top-1 | flips (near-ties) / steps | token_match | "
             "failed under enforce | outcome |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (model, dtype, label), rows in groups.items():
        outcomes = sorted({r["outcome"] for r in rows})
        why = next((r["why"] for r in rows if r["outcome"] != "passed" and r["why"]), "")
        outcome = ", ".join(outcomes) + (f": {why[:90]}" if why else "")
        flips = ", ".join(f"{r.get('flips')} ({r.get('near_tie_flips')}) / {r.get('steps')}" if r.get("flips") is not None
                          else "-" for r in rows)
        failed = sum(r.get("failed", False) for r in rows)
        names = sorted({name for r in rows for name in r.get("failed_budgets", [])})
        lines.append(f"| {model} | {dtype} | {label} | {klass[label]} | {len(rows)} | {_spread([r['kl'] for r in rows])} | "
                     f"{_spread([r['top1'] for r in rows])} | {flips} | {_spread([r['token_match'] for r in rows])} | "
                     f"{failed} / {len(rows)}" + (f" ({', '.join(names)})" if names else "") + f" | {outcome} |")
    return "\n".join(lines)


# --- near-tie gaps: how far rounding moves a token pair's log-probability gap, by dtype ------------------
NEAR_TIE_PARTNERS = 4  # the baseline's top token against each of its next four


def _forced_logprobs(model, encoded, max_new_tokens: int, pad_token_id: int, force=None):
    """Greedy tokens and raw log-probabilities per position, as the plugin's generation reads them; with
    ``force``, the given tokens decoded instead (``generation.ForceTokens``)."""
    import torch

    from pytest_transformers_opt.engine.generation import NEVER_STOP, ForceTokens

    prompt_length = encoded["input_ids"].shape[1]
    processors = [ForceTokens(force, prompt_length)] if force is not None else []
    with torch.inference_mode():
        output = model.generate(**encoded, max_new_tokens=max_new_tokens, eos_token_id=NEVER_STOP, do_sample=False,
                                pad_token_id=pad_token_id, return_dict_in_generate=True, output_logits=True,
                                logits_processor=processors)
    logprobs = torch.stack(output.logits, dim=1).double().log_softmax(-1)
    return output.sequences[:, prompt_length:].tolist(), logprobs


def run_near_tie_gaps(models: tuple[str, ...], dtypes: tuple[str, ...], sets: int, max_new_tokens: int) -> dict:
    """Eager (the baseline) against SDPA at identical contexts, per model and dtype: the move of every pair
    (the baseline's top token, one of its next ``NEAR_TIE_PARTNERS``) and every top-1 flip."""
    import torch
    from transformers import AutoModelForCausalLM

    from pytest_transformers_opt.engine.loading import ModelRequest, load_tokenizer, resolve_model_path
    from pytest_transformers_opt.verdict.similarity import pair_gap_move

    torch.manual_seed(0)
    rows = []
    started = time.perf_counter()
    for name in models:
        request = ModelRequest(name)
        path = resolve_model_path(request)
        tokenizer = load_tokenizer(path, request)
        for dtype in dtypes:
            models_by_kernel = {kernel: AutoModelForCausalLM.from_pretrained(
                path, dtype=getattr(torch, dtype), attn_implementation=kernel).eval() for kernel in ("eager", "sdpa")}
            moves: list[float] = []
            flips: list[dict] = []
            for prompts in PROMPT_SETS[:sets]:
                encoded = tokenizer(list(prompts), return_tensors="pt", padding=True)
                tokens, base = _forced_logprobs(models_by_kernel["eager"], encoded, max_new_tokens,
                                                tokenizer.pad_token_id)
                _, opt = _forced_logprobs(models_by_kernel["sdpa"], encoded, max_new_tokens, tokenizer.pad_token_id,
                                          force=tokens)
                top = base.topk(NEAR_TIE_PARTNERS + 1, dim=-1).indices
                for row in range(base.shape[0]):
                    for step in range(base.shape[1]):
                        b, o = base[row, step], opt[row, step]
                        first = int(top[row, step, 0])
                        for partner in top[row, step, 1:].tolist():
                            moves.append(abs(pair_gap_move(float(b[first]), float(b[partner]),
                                                           float(o[first]), float(o[partner]))))
                        first, picked = int(b.argmax()), int(o.argmax())  # as greedy picks (topk may order ties apart)
                        if picked != first:
                            flips.append({"baseline_gap": float(b[first] - b[picked]),
                                          "move": pair_gap_move(float(b[first]), float(b[picked]),
                                                                float(o[first]), float(o[picked]))})
            rows.append({"model": name, "dtype": dtype, "steps": sets * 3 * max_new_tokens, "moves": moves,
                         "flips": flips})
            del models_by_kernel
    return {"rows": rows, "seconds": time.perf_counter() - started}


def near_tie_table(result: dict, sets: int, max_new_tokens: int) -> str:
    import statistics

    lines = [f"eager (baseline) vs SDPA decoding the same tokens, {sets} prompt set(s) x 3 prompts x {max_new_tokens} "
             f"positions ({result['seconds']:.0f} s); move = |pair_gap_move| for the baseline's top token against each "
             f"of its next {NEAR_TIE_PARTNERS}, in nats", "",
             "| model | dtype | positions | pairs | move median | move p99 | move max | top-1 flips: (baseline gap, move) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        moves = sorted(row["moves"])
        p99 = moves[min(len(moves) - 1, int(0.99 * len(moves)))]
        flips = "; ".join(f"({f['baseline_gap']:.3g}, {f['move']:.3g})" for f in row["flips"]) or "none"
        lines.append(f"| {row['model']} | {row['dtype']} | {row['steps']} | {len(moves)} | {statistics.median(moves):.3g} | "
                     f"{p99:.3g} | {moves[-1]:.3g} | {flips} |")
    return "\n".join(lines)


# --- compare mode: --opt-compare-fail on real sessions, null re-runs against injected slowdowns ---------
COMPARE_CONFTEST = textwrap.dedent('''
    import contextlib
    import os
    import time

    from pytest_transformers_opt.techniques import Technique


    class CompareSlowdown(Technique):
        """Busy-waits VERDICT_STUDY_SLOWDOWN_PCT percent of every generate call's own wall time: the same
        test, that much slower (0: the reference and the null re-runs)."""
        name = "compare_slowdown"
        family = "study"
        summary = "slowdown set by VERDICT_STUDY_SLOWDOWN_PCT"

        @contextlib.contextmanager
        def around_generate(self, model):
            factor = float(os.environ.get("VERDICT_STUDY_SLOWDOWN_PCT", "0")) / 100.0
            if factor <= 0:
                yield
                return
            generate = model.generate

            def slowed(*args, **kwargs):
                started = time.perf_counter()
                output = generate(*args, **kwargs)
                until = time.perf_counter() + (time.perf_counter() - started) * factor
                while time.perf_counter() < until:
                    pass
                return output

            model.generate = slowed  # an instance attribute, removed again below
            try:
                yield
            finally:
                del model.generate


    def pytest_opt_register_techniques(registry):
        registry.register(CompareSlowdown)
''')

COMPARE_TEST = textwrap.dedent('''
    import pytest

    @pytest.mark.optimization("compare_slowdown")
    def test_case(opt_bench):
        opt_bench(prompts=["The cat sees", "Name the capital of France."], max_new_tokens=8)
''')


def _compare_session(root: Path, report: Path, slowdown: float, extra_args: list[str]) -> tuple[int, dict]:
    # one torch thread unless told otherwise: on 2 shared cores, spinning threads turn one busy neighbour
    # into rounds 10x slower, and that is the machine's noise, not the plugin's
    env = {"OMP_NUM_THREADS": "1", **os.environ, "VERDICT_STUDY_SLOWDOWN_PCT": str(slowdown)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-W", "ignore", "--opt-budgets=off", f"--opt-report-json={report}", *extra_args,
                           "test_compare.py"], cwd=root, check=False, stdout=subprocess.DEVNULL, env=env)
    return done.returncode, json.loads(report.read_text())


def run_compare(runs: int, slowdown: float, compare_fail: str, extra_args: list[str]) -> dict:
    """One reference session, then null and slowed sessions in alternation (so drift on the shared
    machine falls on both), each compared with the reference."""
    from pytest_transformers_opt.verdict.compare import METRICS, parse_compare_fail

    (threshold,) = parse_compare_fail(compare_fail)
    rows: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="verdict-study-compare-") as folder:
        root = Path(folder)
        (root / "conftest.py").write_text(COMPARE_CONFTEST)
        (root / "test_compare.py").write_text(COMPARE_TEST)
        reference = root / "ref.json"
        status, ref = _compare_session(root, reference, 0.0, extra_args)
        if status != 0:
            raise SystemExit(f"the reference session failed (exit {status})")
        gate = [f"--opt-compare={reference}", f"--opt-compare-fail={compare_fail}"]
        for index in range(runs):
            for scenario, pct in (("null", 0.0), (f"slowdown {slowdown:g}%", slowdown)):
                status, data = _compare_session(root, root / f"run-{index}.json", pct, [*extra_args, *gate])
                test = data["tests"][0]
                judged = ((test.get("regression") or {}).get("judged") or [{}])[0]
                ratio = judged.get("ratio")
                # the baseline side (the same in every session) slowed by as much: the machine, not the test
                drift = test["baseline"]["latency_s"] / ref["tests"][0]["baseline"]["latency_s"]
                rows.append({"scenario": scenario, "status": status, "rule": judged.get("rule"), "drift": drift,
                             "ratio": ratio, "p_value": judged.get("p_value"),
                             # the median-only rule: the ratio of medians past the limit is a regression
                             "median_rule_regressed": ratio is not None and (
                                 ratio < 1 - threshold.limit / 100 if METRICS[threshold.metric].higher_is_better
                                 else ratio > 1 + threshold.limit / 100),
                             "rounds": judged.get("rounds")})
    return {"rows": rows, "seconds": time.perf_counter() - started, "settings": ref["settings"],
            "reference_samples": ref["tests"][0]["optimized"]["latency_samples_s"]}


def _rounds_rule(settings: dict) -> str:
    """The session's --opt-rounds as it is written (``auto``, ``3..10``, ``5``), from the report's settings."""
    from pytest_transformers_opt.verdict.sequential import RoundsRule

    return repr(RoundsRule(settings["rounds"], settings.get("max_rounds")))


def compare_table(result: dict, compare_fail: str, slowdown: float) -> str:
    import statistics

    settings = result["settings"]
    rule = _rounds_rule(settings)
    lines = [f"rounds={rule} warmup={settings['warmup']}, --opt-compare-fail={compare_fail}, "
             f"{len(result['rows'])} sessions after the reference ({result['seconds']:.0f} s); reference rounds (ms): "
             + ", ".join(f"{1000 * v:.2f}" for v in result["reference_samples"]), "",
             "| scenario | runs | exit 1 (regressed) | other exit | median-only rule: regressed | "
             "ratio of medians, median (min-max) | Mann-Whitney p, median (min-max) | rule | "
             "baseline side's ratio (machine drift), median (min-max) | exit 1 with the baseline side >10% slower too |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for scenario in ("null", f"slowdown {slowdown:g}%"):
        rows = [r for r in result["rows"] if r["scenario"] == scenario]
        if not rows:
            continue
        ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
        ps = [r["p_value"] for r in rows if r["p_value"] is not None]
        spread = (lambda v, f: f"{f(statistics.median(v))} ({f(min(v))}-{f(max(v))})" if v else "-")
        rules = ", ".join(sorted({str(r["rule"]) for r in rows}))
        lines.append(f"| {scenario} | {len(rows)} | {sum(r['status'] == 1 for r in rows)} | "
                     f"{sum(r['status'] not in (0, 1) for r in rows)} | {sum(r['median_rule_regressed'] for r in rows)} | "
                     f"{spread(ratios, lambda x: f'{x:.3f}')} | {spread(ps, lambda x: f'{x:.2g}')} | {rules} | "
                     f"{spread([r['drift'] for r in rows], lambda x: f'{x:.3f}')} | "
                     f"{sum(r['status'] == 1 and r['drift'] > 1.1 for r in rows)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--null", type=int, default=100)
    parser.add_argument("--slow", type=int, default=25, help="runs per injected slowdown")
    parser.add_argument("--broken", type=int, default=10, help="runs per injected breakage")
    parser.add_argument("--similarity", action="store_true",
                        help="instead: KL / top-1 / token_match of every lossy technique and injected breakage")
    parser.add_argument("--sets", type=int, default=len(PROMPT_SETS), help="similarity: prompt sets (1 to 4)")
    parser.add_argument("--broken-sets", type=int, default=1, help="similarity: prompt sets per injected breakage")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="similarity: tokens per prompt")
    parser.add_argument("--models", default=None,
                        help=f"similarity: comma-separated (default {','.join(SIMILARITY_MODELS)}); near-tie gaps: "
                             f"default {BROKEN_MODEL}")
    parser.add_argument("--skip", default="", help="similarity: comma-separated technique labels to leave out")
    parser.add_argument("--only", default="", help="similarity: comma-separated labels to keep (all when empty)")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="similarity and near-tie gaps: comma-separated dtypes (float32, bfloat16, float16)")
    parser.add_argument("--near-tie-gaps", action="store_true",
                        help="instead: how far eager vs SDPA moves a token pair's log-probability gap, by dtype")
    parser.add_argument("--compare", action="store_true",
                        help="instead: --opt-compare-fail on real sessions, null re-runs and injected slowdowns")
    parser.add_argument("--runs", type=int, default=20, help="compare: null sessions, and as many slowed ones")
    parser.add_argument("--compare-slowdown", type=float, default=25.0, help="compare: injected slowdown, percent")
    parser.add_argument("--compare-fail", default="latency:10%", help="compare: the --opt-compare-fail term")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, e.g. --opt-rounds=7")
    args = parser.parse_args(argv)
    if args.compare:
        text = compare_table(run_compare(args.runs, args.compare_slowdown, args.compare_fail, args.pytest_args),
                             args.compare_fail, args.compare_slowdown)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    unknown = [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]
    if unknown:
        parser.error(f"--dtypes: unknown {', '.join(unknown)}; accepted: float32, bfloat16, float16")
    if args.near_tie_gaps:
        sets = max(1, min(args.sets, len(PROMPT_SETS)))
        models = tuple(m for m in (args.models or BROKEN_MODEL).split(",") if m)
        text = near_tie_table(run_near_tie_gaps(models, dtypes, sets, args.max_new_tokens), sets, args.max_new_tokens)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    if args.similarity:
        sets = max(1, min(args.sets, len(PROMPT_SETS)))
        models = tuple(m for m in (args.models or ",".join(SIMILARITY_MODELS)).split(",") if m)
        # commas inside a label's parentheses, quantized_cache(quanto,4), do not separate labels
        skip = frozenset(s.strip() for s in re.split(r",(?![^()]*\))", args.skip) if s.strip())
        only = frozenset(s.strip() for s in re.split(r",(?![^()]*\))", args.only) if s.strip())
        broken_sets = max(1, min(args.broken_sets, len(PROMPT_SETS)))
        text = similarity_table(run_similarity(sets, args.max_new_tokens, models, skip, args.pytest_args,
                                               broken_sets, only, dtypes), sets, args.max_new_tokens)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    result = run_study(args.null, args.slow, args.broken, args.pytest_args)
    settings = result["settings"]
    rule = _rounds_rule(settings)
    lines = [f"rounds={rule} warmup={settings['warmup']} ({result['seconds']:.0f} s)", "",
             "| scenario | failed / runs | meaning | timed rounds per side (mean) |", "| --- | --- | --- | --- |"]
    order = ["null"] + [f"slowdown {p}%" for p in (5, 10, 20, 50)] + ["nan_logits", "changed_token", "compile_fallback"]
    meaning = {"null": "false alarms", "nan_logits": "caught", "changed_token": "caught", "compile_fallback": "caught"}
    for group in order:
        if group in result["tally"]:
            failed, total, rounds = result["tally"][group]
            lines.append(f"| {group} | {failed} / {total} | {meaning.get(group, 'caught')} | {rounds / total:.2f} |")
    all_rounds = sum(rounds for _, _, rounds in result["tally"].values())
    all_runs = sum(total for _, total, _ in result["tally"].values())
    lines.append(f"| all | | | {all_rounds} in {all_runs} tests ({all_rounds / all_runs:.2f}) |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
