"""The next recommendation from what an earlier run measured (a ``--opt-report-json`` file).

Measured figures are shown as measured, with the hardware they were measured on, and they decide
the next step: a lossy technique that met memory but missed a similarity budget steps back to a
less lossy one (bnb_4bit -> bnb_8bit); a memory failure steps to the next memory technique; a
speed failure to the next speed technique; a run that passed moves on (continuous batching for
concurrent serving) or says that no further change is needed.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import OptConfigError
from ..report.schema import load_report as load_report_file, reader_problem
from ..report.view import agreement_counts
from ..techniques.attention import FlashAttention2
from ..units import failure_reason
from ..verdict.budgets import SIMILARITY_BUDGETS, SPEED_BUDGETS
from .advice import Advice, Figure
from .change import (ATTENTION, CACHING, COMPILATION, CONTINUOUS_BATCHING, QUANTIZATION, Change, find,
                     parse_technique, replace_family)
from .compat import compatibility_questions, flash_attention_capable
from .docs import default_similarity, documentation_for, measurable, tradeoffs_for
from .estimates import normalize_dtype, weight_bytes
from .model_config import ModelShape, is_builtin_model, load_model_shape
from .recommend import (apply_change, budgets_for, max_batch_tokens_for, recommend, size_literal, speed_lever,
                        title_for, validation_plan)
from .workload import ServingScenario, capability_text, merge_hardware, parse_compute_capability, resolve

FROM_REPORT_REMEDY = "accepted: a report written by pytest --opt-report-json=PATH"
MEMORY_BUDGETS = ("max_memory", "max_memory_ratio")
FLOAT32 = "float32"
# the similarity record's figures (its counts go with them: report.view.agreement_counts)
SIMILARITY_FIGURES = ("token_match", "kl_mean", "kl_max", "top1")
_OOM = re.compile(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|cannot allocate memory", re.I)
_METRICS = (("peak_memory_bytes", "peak memory", "bytes"), ("latency_s", "latency (median)", "s"),
            ("ttft_s", "time to first token", "s"), ("tpot_s", "time per output token", "s"),
            ("throughput_tok_s", "throughput", "tok/s"), ("load_time_s", "load time", "s"),
            ("compile_time_s", "compile time", "s"))
_BUDGET_UNITS = {"max_memory": "bytes", "max_ttft": "s", "max_tpot": "s", "max_latency": "s",
                 "min_throughput": "tok/s", "min_speedup": "x"}


# ---------------------------------------------------------------- reading

def validate_report(report: Any, what: str = "--from-report") -> dict[str, Any]:
    """The report itself, or ``OptConfigError`` saying why it is not a schema-1 plugin report."""
    problem = reader_problem(report)
    if problem is not None:
        raise OptConfigError(f"{what}: {problem}; {FROM_REPORT_REMEDY}")
    checked: dict[str, Any] = report
    return checked


def load_report(path: str | Path, what: str = "--from-report") -> dict[str, Any]:
    """Read and check a JSON report (``report.schema.load_report``); every problem names ``what``.

    Only what the advisor reads is checked (``full_schema=False``): a trimmed or hand-written report
    with a test record is enough to advise from."""
    return load_report_file(Path(path).expanduser(), source=what, remedy=FROM_REPORT_REMEDY, full_schema=False)


def hardware_from_environment(environment: dict[str, Any]) -> dict[str, Any]:
    """The report's environment block as the ``hardware`` dict the advisor takes."""
    keys = ("torch", "transformers", "accelerate", "bitsandbytes", "kernels")
    versions = {**{key: environment.get(key) for key in keys if key in environment},
                **(environment.get("versions") or {})}
    device = str(environment.get("device") or "").split(":")[0] or None
    return {"device": device, "gpu_name": environment.get("gpu_name"),
            "compute_capability": environment.get("compute_capability"),
            "gpu_memory_bytes": environment.get("gpu_memory_bytes"),
            "bf16_supported": environment.get("bf16_supported"), "versions": versions}


def describe_hardware(environment: dict[str, Any]) -> str:
    """``NVIDIA H100 (compute capability 9.0)`` or ``cpu``."""
    name = environment.get("gpu_name")
    if name:
        cc = environment.get("compute_capability")
        return f"{name}, compute capability {cc}" if cc else str(name)
    return str(environment.get("device") or "an unnamed device")


# ---------------------------------------------------------------- what was measured

def measured_figures(test: dict[str, Any], where: str) -> list[Figure]:
    """Every figure of one test record, each labelled measured with the hardware."""
    out: list[Figure] = []
    for side in ("optimized", "baseline"):
        metrics = test.get(side) or {}
        for key, label, unit in _METRICS:
            if metrics.get(key) is not None:
                out.append(Figure(f"{side} {label}", metrics[key], "measured", unit, where))
    if test.get("speedup") is not None:
        out.append(Figure("speedup (baseline latency / optimized)", test["speedup"], "measured", "x", where))
    if test.get("memory_ratio") is not None:
        out.append(Figure("memory ratio (optimized / baseline peak)", test["memory_ratio"], "measured", "ratio", where))
    for key in SIMILARITY_FIGURES:
        value = (test.get("similarity") or {}).get(key)
        if value is not None:
            counts = agreement_counts(test, key)
            out.append(Figure(f"similarity {key}" + (f" ({counts})" if counts else ""), value, "measured", "ratio",
                              where))
    for budget in test.get("budgets") or []:
        if budget.get("measured") is None:
            continue
        unit = _BUDGET_UNITS.get(budget["name"], "ratio")
        verdict = {True: "met", False: "FAILED", None: "not checked"}[budget.get("ok")]
        limit = Figure("", budget.get("limit"), "stated", unit).value_text()
        out.append(Figure(f"budget {budget['name']} (limit {limit}, {verdict})", budget["measured"], "measured",
                          unit, where))
    return out


def _budget_limit(test: dict[str, Any], name: str) -> float | None:
    for budget in test.get("budgets") or []:
        if budget.get("name") == name and isinstance(budget.get("limit"), (int, float)):
            return float(budget["limit"])
    return None


def _user_budget_limit(test: dict[str, Any], name: str, defaults: dict[str, float]) -> float | None:
    """The limit of budget ``name`` when the user set it (marker or ini), not the technique's default: read
    from the budget's ``source``, or, in a report without one, from its differing from ``defaults``."""
    for budget in test.get("budgets") or []:
        if budget.get("name") != name or not isinstance(budget.get("limit"), (int, float)):
            continue
        source = budget.get("source")
        user_set = source in ("marker", "ini") if source else defaults.get(name) != budget["limit"]
        return float(budget["limit"]) if user_set else None
    return None


def _pick_test(tests: list[dict[str, Any]], model: str | None) -> tuple[dict[str, Any] | None, list[str]]:
    """The record that decides the next step: the first failure, else the passing run furthest along
    (most technique families stacked; then the best speedup, then the smallest memory ratio)."""
    notes: list[str] = []
    if model:
        same = [t for t in tests if (t.get("model") or {}).get("name_or_path") in (model, Path(model).name)
                or Path(str((t.get("model") or {}).get("name_or_path", ""))).name == Path(model).name]
        if same:
            tests = same
        else:
            notes.append(f"no test in the report used {model}; all of its tests were considered")
    ran = [t for t in tests if t.get("outcome") in ("passed", "failed", "error")]
    # a failed budget under --opt-budgets=warn passes the test: still the first thing to fix
    failed = [t for t in ran if t.get("outcome") != "passed" or t.get("failed_budgets")]
    if failed:
        return failed[0], notes
    if ran:
        def progress(test: dict[str, Any]) -> tuple[int, float, float]:
            speedup, ratio = test.get("speedup"), test.get("memory_ratio")
            families = {parse_technique(str(t)).family for t in test.get("techniques") or []}
            if COMPILATION in families:
                families.add(CACHING)  # compile brings its static cache with it
            return (len(families),
                    speedup if isinstance(speedup, (int, float)) else 0.0,
                    -ratio if isinstance(ratio, (int, float)) else float("-inf"))
        return max(ran, key=progress), notes
    skipped = [t for t in tests if t.get("outcome") == "skipped"]
    return (skipped[0] if skipped else None), notes


# ---------------------------------------------------------------- the next step

_CACHE_NEXT = {"static_cache": Change("offloaded_static_cache"),
               "sliding_window_cache": Change("quantized_cache", {"backend": "quanto", "nbits": 4}),
               "quantized_cache": Change("offloaded_cache")}


def _next_memory(stack: list[Change], shape: ModelShape | None, dtype: str,
                 peak: float | None, resident: float | None = None) -> tuple[Change, str]:
    """The next memory step. ``peak`` is the configuration's running peak (resident + generation) and
    ``resident`` what it holds once loaded, both measured; a load's transient is never the basis."""
    weights, cache = find(stack, QUANTIZATION), find(stack, CACHING)
    weights_share = None
    basis = "estimate"
    if resident and peak:  # measured: what the loaded configuration holds, not what its load held for a moment
        weights_share, basis = min(1.0, resident / peak), "measured"
    elif shape is not None and peak:
        quant = weights.name if weights and weights.name in ("bnb_8bit", "bnb_4bit") else None
        weights_share = weight_bytes(shape, dtype, quant) / peak
    weights_dominate = weights_share is None or weights_share >= 0.5
    share = "" if weights_share is None else f" (weights ~{weights_share:.0%} of the running peak, {basis})"
    if weights is not None and weights.name == "bnb_8bit" and weights_dominate:
        return Change("bnb_4bit"), f"8-bit weights still exceed the memory budget{share}: 4-bit halves them again."
    if cache is not None and cache.name in _CACHE_NEXT:
        return _CACHE_NEXT[cache.name], f"{cache.label()} still exceeds the memory budget: the next cache step."
    if find(stack, COMPILATION) and cache is None:
        return Change("offloaded_static_cache"), ("compile's static cache is allocated at full length: offloading "
                                                  "it keeps the static shape but moves it to CPU RAM.")
    if weights is None and weights_dominate:
        return Change("bnb_8bit"), f"The weights are the largest part{share}: 8-bit weights, the least lossy step."
    if cache is None:
        return (Change("quantized_cache", {"backend": "quanto", "nbits": 4}),
                f"The KV cache and activations are the larger part{share}: quantize the KV cache.")
    return Change("tensor_parallel", {"tp_size": 2}), "No single-GPU memory step is left: split the model over 2 GPUs."


def _next_quality(stack: list[Change], dtype: str) -> tuple[Change | None, str, list[Change]]:
    names = {change.name: change for change in stack}
    if "bnb_4bit" in names:
        return Change("bnb_8bit"), "4-bit weights missed the similarity budget: 8-bit weights lose less.", \
            replace_family(stack, Change("bnb_8bit"))
    cache = names.get("quantized_cache")
    if cache is not None and int(cache.params.get("nbits", 4)) < 4:
        better = Change("quantized_cache", {**cache.params, "nbits": 4})
        why = "The 2-bit KV cache missed the similarity budget: 4 bits lose less."
        return better, why, replace_family(stack, better)
    if cache is not None:
        return Change("offloaded_cache"), ("The quantized KV cache missed the similarity budget: offloading keeps "
                                           "it in full precision."), replace_family(stack, Change("offloaded_cache"))
    if "bnb_8bit" in names:
        tp = Change("tensor_parallel", {"tp_size": 2})
        return tp, ("8-bit weights missed the similarity budget: keep full-precision weights and split them over "
                    "2 GPUs instead."), [c for c in stack if c.family != QUANTIZATION] + [tp]
    strict = ", ".join(f"{name}={limit:g}" for name, limit in default_similarity(stack, FLOAT32).items())
    if dtype == FLOAT32:  # no rounding to blame: never propose again the configuration that just failed
        return None, (f"A lossless technique missed its similarity budget in float32 (budgets {strict}), where "
                      f"rounding cannot explain it: the technique or its kernel changes the outputs; fix or drop "
                      f"it; no new technique is proposed."), []
    return None, (f"A lossless technique missed its similarity budget in {dtype}: rerun in float32 (budgets "
                  f"{strict}) to tell numerical noise from a bug; no new technique is proposed."), stack


def _speed_lever(stack: list[Change], shape: ModelShape | None, workload: ServingScenario,
                 hardware: dict[str, Any] | None, concurrency: int) -> tuple[Change, str] | None:
    """recommend.speed_lever with the facts a report and the stated workload give."""
    merged = merge_hardware(workload, hardware)
    device = merged.device or (str((hardware or {}).get("device") or "").split(":")[0] or None)
    capability = parse_compute_capability(merged.compute_capability) if merged.compute_capability else None
    return speed_lever(shape, stack, device, capability, merged.versions, workload.batch_size, concurrency)


def _next_speed(stack: list[Change], workload: ServingScenario, hardware: dict[str, Any] | None,
                concurrency: int, input_tokens: int, shape: ModelShape | None = None) -> tuple[Change | None, str]:
    names = {change.name for change in stack}
    attention = find(stack, ATTENTION)
    if concurrency > 1 and "continuous_batching" not in names:
        return (Change("continuous_batching", {"max_batch_tokens": max_batch_tokens_for(input_tokens)}),
                f"{concurrency} concurrent requests: continuous batching raises throughput.")
    if attention is None or attention.name == "eager":
        return Change("sdpa"), "Attention still runs eagerly: sdpa is usually faster."
    lever = _speed_lever(stack, shape, workload, hardware, concurrency)
    if lever is not None and "continuous_batching" not in names:
        return lever
    if "compile" not in names and "continuous_batching" not in names:
        return Change("compile"), "Next speed step: a static cache with torch.compile."
    if flash_attention_capable(workload, hardware) and attention.name != "flash_attention_2":
        return Change(FlashAttention2.name), (f"The GPU supports FlashAttention-2 (compute capability >= "
                                              f"{capability_text(FlashAttention2.min_capability)}).")
    if "kernels" not in names:
        return Change("kernels"), "Next speed step: optimized hub kernels."
    return None, "Every speed technique in the catalogue was tried."


# ---------------------------------------------------------------- entry point

def advise_from_report(report: dict[str, Any], workload: ServingScenario | None = None, *,
                       hardware: dict[str, Any] | None = None, config: Any = None,
                       source: str | None = None) -> Advice:
    """The next recommendation after the run recorded in ``report`` (a schema-1 JSON report).

    ``workload``: what the user states now (wins over the run's figures); ``hardware`` wins over
    the report's environment; ``config`` is the model config when the report's model is not local.
    """
    report = validate_report(report)
    environment = report.get("environment") or {}
    where = describe_hardware(environment)
    hardware = {**hardware_from_environment(environment), **(hardware or {})}
    test, notes = _pick_test(report["tests"], workload.model if workload else None)
    if test is None:
        raise OptConfigError("--from-report: the report holds no test records (did any test use opt_bench?)")
    model_info = test.get("model") or {}
    run = test.get("workload") or {}
    stated = workload or ServingScenario()
    memory_limit = _budget_limit(test, "max_memory")
    on_cpu = (stated.device or hardware.get("device")) == "cpu"
    limit_bytes = int(memory_limit) if memory_limit else None
    derived = ServingScenario(
        model=stated.model or model_info.get("name_or_path"),
        revision=stated.revision or model_info.get("revision"),
        dtype=stated.dtype or _known_dtype(model_info.get("dtype")),
        input_tokens=stated.input_tokens or run.get("input_tokens") or None,
        max_new_tokens=stated.max_new_tokens or run.get("max_new_tokens") or None,
        batch_size=stated.batch_size or run.get("batch_size") or None,
        gpu_memory_bytes=stated.gpu_memory_bytes or (None if on_cpu else limit_bytes),
        cpu_memory_bytes=stated.cpu_memory_bytes or (limit_bytes if on_cpu else None),
        **{key: getattr(stated, key) for key in ("device", "concurrency", "problem", "attention", "gpu_name",
                                                 "compute_capability", "versions")},
    )
    if memory_limit and not (stated.cpu_memory_bytes if on_cpu else stated.gpu_memory_bytes):
        notes.append(f"the run's max_memory budget ({size_literal(int(memory_limit))}) is taken as the memory "
                     f"available")
    for key in ("max_new_tokens", "input_tokens", "batch_size"):
        if getattr(stated, key) and run.get(key) and getattr(stated, key) != run.get(key):
            notes.append(f"the run measured {key}={run[key]}, the stated workload asks {getattr(stated, key)}: "
                         f"the measurements may not carry over")

    shape = _try_shape(config, derived, notes)
    stack = [parse_technique(str(t)) for t in test.get("techniques") or []]
    baseline = [parse_technique(str(t)) for t in test.get("baseline_techniques") or []]
    measured = measured_figures(test, where)
    dtype = normalize_dtype(derived.dtype) if derived.dtype else "bfloat16"
    config_text = " + ".join(c.label() for c in stack) or "the baseline"
    headline = f"Measured run {test.get('nodeid', '?')}: {config_text}, {test.get('outcome')}"

    change, new_stack, stage, why, headline = _decide(test, stack, shape, derived, hardware, dtype, where,
                                                      headline)
    if change is not None and new_stack is stack:
        new_stack = apply_change(stack, change)
    if stage == "quality" and change is None and new_stack and dtype != FLOAT32:
        # a lossless technique that missed its budgets in half precision: the configuration is proposed for the
        # float32 rerun the advice asks for, with float32's budgets, never again with the budget it failed
        derived = replace(derived, dtype=FLOAT32)
        notes.append(f"the budgets shown are float32's, for that rerun; the {dtype} budgets the run failed are not "
                     f"proposed again")

    advice = _build(change, new_stack, stage, shape, derived, hardware, baseline, test, stack, dtype)
    # Without a change the title already carries the reason: do not repeat it under Why.
    reason = [why] if change is not None or (new_stack and not why.startswith("No further change")) else []
    advice.why = [headline + "."] + reason + [f"Note: {note}." for note in notes] + advice.why
    advice.measured = measured
    advice.measured_source = source or f"report created {report.get('created', '?')}"
    # Only a run that measured (passed or failed on its budgets) covers the configuration it proposes again.
    advice.measured_covers_change = change is None and test.get("outcome") in ("passed", "failed") and bool(new_stack) \
        and derived.dtype == dtype  # a float32 rerun was not measured
    if change is None:
        advice.title = why if why.startswith("No further change") else f"No new technique: {why}"
    return advice


def _decide(test: dict[str, Any], stack: list[Change], shape: ModelShape | None, derived: ServingScenario,
            hardware: dict[str, Any], dtype: str, where: str,
            headline: str) -> tuple[Change | None, list[Change], str | None, str, str]:
    """What the measurements say to do next: (change, new stack, stage, why, headline)."""
    config_text = " + ".join(c.label() for c in stack) or "the baseline"
    peak = (test.get("optimized") or {}).get("peak_memory_bytes")
    change: Change | None = None
    new_stack = stack
    stage = None
    outcome = test.get("outcome")
    failed = [str(name) for name in test.get("failed_budgets") or []]
    concurrency = derived.concurrency or 1
    if outcome == "skipped":
        reason = test.get("skip_reason") or "no reason recorded"
        headline += f" ({reason})"
        attention = find(stack, ATTENTION)
        if attention is not None and attention.name.startswith("flash_attention"):
            change = Change("sdpa")
            why = "FlashAttention could not run on that machine: sdpa runs almost everywhere."
            new_stack = replace_family(stack, change)
        else:
            why = f"The technique was skipped, so nothing was measured: {reason}."
    elif outcome == "error" and not _OOM.search(str(test.get("error") or "")):
        error = failure_reason(test.get("error"))
        why = (f"The run errored before measuring: {error}. {config_text} did not run as tested, so it is not "
               f"proposed again: fix that first; no new technique is proposed.")
        new_stack = []  # never recommend a configuration the run showed cannot run
    elif outcome == "error" or any(name in MEMORY_BUDGETS for name in failed):
        headline += "" if outcome == "error" else f"; failed {', '.join(failed)}"
        optimized = test.get("optimized") or {}
        stage = "memory"
        limit, load_peak = _budget_limit(test, "max_memory"), optimized.get("load_peak_bytes")
        if outcome != "error" and limit and load_peak and load_peak > limit and peak and peak <= limit:
            # a load transient: a further technique would read the same float weights at load
            why = (f"Only loading exceeded max_memory: the load's own peak was {size_literal(int(load_peak))} "
                   f"(the float weights read while they are quantized), and the configuration then runs in "
                   f"{size_literal(int(peak))} (measured), within the budget. Leave room for the load, or save "
                   f"the quantized model once (save_pretrained) and load that; no new technique is proposed.")
        else:
            change, why = _next_memory(stack, shape, dtype, peak, optimized.get("resident_bytes"))
    elif any(name in SIMILARITY_BUDGETS for name in failed):
        headline += f"; met {'memory' if _budget_limit(test, 'max_memory') else 'its other budgets'}, " \
                    f"failed {', '.join(failed)}"
        change, why, new_stack = _next_quality(stack, dtype)
        stage = "quality"
    elif any(name in SPEED_BUDGETS for name in failed):
        headline += f"; failed {', '.join(failed)}"
        change, why = _next_speed(stack, derived, hardware, concurrency, derived.input_tokens or 512, shape)
        stage = "speed"
    elif outcome == "failed" and not failed and not _failed_in_the_test(test.get("error")):
        # the configuration itself raised (transformers refused it, a kernel failed): it cannot run as tested
        error = failure_reason(test.get("error"))
        why = (f"The run failed before it measured anything: {config_text} raised {error}. That configuration "
               f"cannot run as tested, so it is not proposed again: drop the technique the error names, or "
               f"change what it asks; no new technique is proposed.")
        new_stack = []
    elif outcome == "failed":
        detail = f"budgets {', '.join(failed)}" if failed else "an assertion of the test itself"
        why = f"The run failed on {detail}; no technique change follows from that."
    else:
        headline += "; every budget met"
        if concurrency > 1 and not find(stack, CONTINUOUS_BATCHING):
            tokens = max_batch_tokens_for(derived.input_tokens or 512)
            change = Change("continuous_batching", {"max_batch_tokens": tokens})
            why = f"It passed; with {concurrency} concurrent requests continuous batching is the next step."
            stage = "concurrency"
        elif derived.problem == "speed" and not find(stack, CONTINUOUS_BATCHING) \
                and (lever := _speed_lever(stack, shape, derived, hardware, concurrency)) is not None:
            change, why, stage = lever[0], f"It passed; the next speed step is {lever[0].label()}. {lever[1]}", "speed"
        elif derived.problem == "speed" and not find(stack, COMPILATION) and not find(stack, CONTINUOUS_BATCHING):
            change, why, stage = Change("compile"), "It passed; the next speed step is compile.", "speed"
        else:
            why = (f"No further change needed: {config_text} met every budget on {where} (measured) for a "
                   f"workload of {concurrency} concurrent request(s).")
    return change, new_stack, stage, why, headline


def _failed_in_the_test(error: Any) -> bool:
    """The test's own code failed it (an ``assert``, ``pytest.fail``), not the configuration it measured."""
    reason = failure_reason(error)
    return reason.startswith(("AssertionError", "Failed:", "assert ")) or str(error or "").lstrip().startswith("assert ")


def _known_dtype(value: Any) -> str | None:
    try:
        return normalize_dtype(value) if value else None
    except OptConfigError:  # "auto" or an exotic dtype: let the config decide
        return None


def _try_shape(config: Any, workload: ServingScenario, notes: list[str]) -> ModelShape | None:
    source = config if config is not None else workload.model
    if source is None:
        notes.append("the report names no model: no estimates")
        return None
    try:
        return load_model_shape(source, workload.revision)
    except OptConfigError as exc:
        notes.append(f"model config not read ({exc}); only measured figures are shown")
        return None


def _build(change: Change | None, stack: list[Change], stage: str | None, shape: ModelShape | None,
           workload: ServingScenario, hardware: dict[str, Any], baseline: list[Change], test: dict[str, Any],
           previous: list[Change], dtype: str) -> Advice:
    """The Advice for ``stack``: with estimates when the config was read, from measurements alone otherwise."""
    resolved = resolve(workload, shape, hardware)
    if shape is not None and change is not None:
        advice = recommend(shape, resolved, hardware, current=previous, baseline=baseline, forced=change,
                           stage_hint=stage or "speed", configuration=stack)
    else:
        tiny = is_builtin_model(workload.model or "")
        advice = Advice(
            title=title_for(change) if change else "", change=change, configuration=stack,
            budgets=budgets_for(stack, change, resolved, tiny, stage == "memory"), stage=stage, why=[],
            figures=[], documentation=documentation_for(change or (stack[-1] if stack else None)),
            tradeoffs=tradeoffs_for(change),
            open_questions=compatibility_questions(resolved.workload, stack, hardware, shape),
            assumptions=[a.text() for a in sorted(resolved.assumptions, key=lambda a: not a.matters)],
            test=validation_plan(shape, resolved, stack, workload.model, baseline) if change else None,
        )
    limit = _budget_limit(test, "max_memory")
    if limit and "max_memory" not in advice.budgets:  # memory was met: the next step must keep meeting it
        advice.budgets = {"max_memory": size_literal(int(limit)), **advice.budgets}
    # A similarity limit the user set (not the failing technique's default) is their requirement: keep it.
    for name in SIMILARITY_BUDGETS:
        user_limit = _user_budget_limit(test, name, default_similarity(previous, dtype))
        if user_limit is not None:
            advice.budgets[name] = user_limit
    advice.budgets = measurable(stack, advice.budgets)  # the written test must be able to pass as written
    return advice
