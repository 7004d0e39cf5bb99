"""The technique x architecture matrix (issue 22): every catalogue technique on every built-in tiny
architecture, in one pytest session written as a user would write it. Each cell passes its proof and its
default budgets, or is skipped with a reason that names the requirement and what was found (the model's
architecture or config property where the reason depends on the model). The README's support matrix is
generated from this run by ``scripts/support_matrix.py``; ``pytest --opt-techniques --opt-model=NAME`` prints
a model's column, the same reasons.

Cost: one in-process session, one prompt, 4 new tokens, one timed round, no warm-up; the baseline run is
shared per model: 45 s alone on 2 cores (73 s before each test froze what earlier ones imported). Three techniques cost far more than the rest on CPU: ``compile`` (an
inductor build of each architecture's decode step, 10-40 s with a cold inductor cache, as in CI),
``tensor_parallel`` (two torchrun processes that import torch and transformers, about 11 s a cell) and
``flex_attention`` (its kernel compiled for each model's heads and mask, on the four models without sliding
layers: 9-37 s a cell); all of them would add 3.5 min. The suite runs each on the architecture that differs most,
for it, from the Llama shape the rest of the suite compiles and shards: ``compile`` on GPT-OSS (sliding and
global layers, attention sinks, experts), ``tensor_parallel`` on Phi-3 (fused projections, its own sharding
plan), ``flex_attention`` on Qwen3 (q/k norms before the scores); ``OPT_MATRIX=full`` runs every cell, as for
the README's table. This test is also the suite's proof that flex_attention, tensor_parallel and compile
reproduce the baseline's tokens on every architecture they run on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmark_scripts import load_module_file  # tests/ is on sys.path (pytest's rootdir conftest import)
from pytest_transformers_opt.engine.tiny_models import TINY_MODELS, tiny_model_config
from pytest_transformers_opt.techniques import build_registry

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "support_matrix.py"
README = ROOT / "README.md"
ARCHITECTURES = [name for name in TINY_MODELS if name.startswith("tiny-random-")]
MATRIX_ARGS = ("--opt-rounds=1", "--opt-warmup=0", "-W", "ignore::DeprecationWarning")
FULL = os.environ.get("OPT_MATRIX") == "full"
# technique: the one model it runs on outside OPT_MATRIX=full
HEAVY_SAMPLE = {"compile": "tiny-random-gpt-oss", "tensor_parallel": "tiny-random-phi3", "flex_attention": "tiny-random-qwen3"}
DEFERRED = set() if FULL else {(name, model) for name, sample in HEAVY_SAMPLE.items() for model in ARCHITECTURES
                               if model != sample}
LOSSLESS = ("sdpa", "static_cache", "compile", "flex_attention", "tensor_parallel")

# The user's file: the catalogue and the built-in models are read, not typed, so a technique or a model added
# later is a new row or column. One prompt longer than the 16-token sliding windows, so that every technique
# meets the sliding layers past their window.
MATRIX_TESTS = '''
import pytest
from pytest_transformers_opt.engine.tiny_models import TINY_MODELS
from pytest_transformers_opt.techniques import TechniqueSpec, build_registry

PROMPT = "The cat sees the red apple every morning. A dog finds a long story in the park."
DEFERRED = {deferred!r}  # cells the quick matrix leaves to OPT_MATRIX=full
CELLS = [pytest.param(f"{{t.name}}-{{model}}", marks=[pytest.mark.opt_model(model),
                             pytest.mark.optimization(TechniqueSpec.of(t.name, **t.example_params))],
                      id=f"{{t.name}}-{{model}}")
         for t in build_registry().classes() for model in TINY_MODELS
         if model.startswith("tiny-random-") and (t.name, model) not in DEFERRED]


@pytest.mark.parametrize("cell", CELLS)
def test_cell(cell, opt_bench):
    opt_bench(prompts=[PROMPT], max_new_tokens=4)
'''


def _cell(nodeid: str) -> tuple[str, str]:
    """(technique name, model) of a cell's test id."""
    inside = nodeid.split("[", 1)[1].rstrip("]")
    for model in ARCHITECTURES:
        if inside.endswith("-" + model):
            return inside[: -len(model) - 1], model
    raise AssertionError(f"{nodeid} is no matrix cell")


def _arch(model: str) -> str:
    return str(tiny_model_config(model).model_type)


def test_every_technique_on_every_architecture_passes_or_says_why(run_user, pytester):
    run = run_user(MATRIX_TESTS.format(deferred=sorted(DEFERRED)), *MATRIX_ARGS)
    entries = {_cell(entry["nodeid"]): entry for entry in run.report["tests"]}
    names = build_registry().names()
    assert set(entries) == {(name, model) for name in names for model in ARCHITECTURES} - DEFERRED
    broken = {cell: entry["error"] for cell, entry in entries.items() if entry["outcome"] not in ("passed", "skipped")}
    assert not broken, "\n".join(f"{name} on {model}: {error}" for (name, model), error in broken.items())
    for (name, model), entry in entries.items():
        if entry["outcome"] == "passed":  # the proof ran (a silent fallback fails); every default budget held
            assert entry["budgets"] and all(b["ok"] for b in entry["budgets"]), (name, model, entry["budgets"])
            assert entry["optimized"]["tokens_generated"] == 4, (name, model)
        else:
            assert re.search(r"needs .+; found: .+", entry["skip_reason"]), (name, model, entry["skip_reason"])
    # a reason that depends on the model names its architecture or the config property it read
    for name in names:
        reasons = {model: entry["skip_reason"] for (cell, model), entry in entries.items()
                   if cell == name and entry["outcome"] == "skipped"}
        if len(set(reasons.values())) > 1 or 0 < len(reasons) < len(ARCHITECTURES):
            for model, reason in reasons.items():
                assert _arch(model) in reason or "config." in reason, (name, model, reason)
    # lossless techniques that ran reproduce the baseline's greedy tokens on every architecture
    for (name, model), entry in entries.items():
        if entry["outcome"] == "passed" and name in LOSSLESS:
            assert entry["similarity"]["token_match"] == 1.0, (name, model, entry["similarity"])
    # tensor parallelism ran as two torchrun ranks, measured apart from the baseline's rounds, and said so
    assert entries[("tensor_parallel", HEAVY_SAMPLE["tensor_parallel"])]["outcome"] == "passed"
    sharded = [entry for (name, model), entry in entries.items()
               if name == "tensor_parallel" and entry["outcome"] == "passed"]
    for entry in sharded:
        assert any("2 torchrun ranks" in note and "not interleaved" in note for note in entry["notes"]), entry["notes"]
        assert entry["optimized"]["peak_memory_bytes"] > 0
    # `--opt-techniques --opt-model=NAME` prints the model's column: each skipped cell's reason, "supported" where
    # the cell ran
    for model in ARCHITECTURES:
        listing = pytester.runpytest("-p", "no:cacheprovider", "--opt-techniques", f"--opt-model={model}")
        assert listing.ret == 0, listing.stdout.str()
        column = {name: reason for name, reason in _column(listing.stdout.str()).items() if (name, model) in entries}
        assert column == {name: entries[(name, model)]["skip_reason"] for name in names
                          if (name, model) in entries}, model
    _readme_matches(run.report_path)


def _readme_matches(report: Path) -> None:
    """The README's support matrix is the one the script makes from this run's report: the whole table after a
    full run, each cell that ran after the quick one (the README's is a full run's). Made on other versions, it
    cannot be compared: said as a skip, after every other check passed."""
    generated = subprocess.run([sys.executable, str(SCRIPT), str(report)], capture_output=True, text=True,
                               check=True).stdout.strip()
    script = _script_module()
    block = script.readme_block(README.read_text(encoding="utf-8"))
    made_on, readme_made_on = generated.splitlines()[0], (block.splitlines() or [""])[0]
    if script.probed_stack(made_on) != script.probed_stack(readme_made_on):
        pytest.skip(f"every cell passed or skipped with its reason; the README's support matrix was made on other "
                    f"versions of what the probes read ({readme_made_on!r}; here: {made_on!r}), so it was not "
                    f"compared")
    regenerate = ("the README's support matrix is not this run's: run OPT_MATRIX=full pytest "
                  "tests/integration/test_matrix.py --basetemp=DIR, then python scripts/support_matrix.py "
                  "DIR/<test>/opt-report.json --write")
    if FULL:
        assert block == generated, regenerate
    else:
        ran, recorded = script.matrix_cells(generated), script.matrix_cells(block)
        assert {cell: recorded.get(cell) for cell in ran} == ran, regenerate


def _column(text: str) -> dict[str, str | None]:
    """``--opt-techniques`` output as technique name -> skip reason (None: supported)."""
    found = re.findall(r"^  (\S+) +\S.*\n +-> (supported|unsupported: .*)$", text, re.MULTILINE)
    return {name: None if verdict == "supported" else verdict.removeprefix("unsupported: ") for name, verdict in found}


def test_opt_techniques_prints_a_models_column(pytester: pytest.Pytester) -> None:
    """``--opt-techniques --opt-model=NAME`` probes with that model's config (a built-in one is not built for
    it); the option beats the ini key, as everywhere; a model that cannot be read is a usage error naming it."""
    pytester.makeini("[pytest]\nopt_model = tiny-random-mistral\n")
    from_ini = pytester.runpytest("-p", "no:cacheprovider", "--opt-techniques")
    assert from_ini.ret == 0
    from_ini.stdout.fnmatch_lines(["technique catalogue for model tiny-random-mistral (mistral, float32; from ini "
                                   "opt_model) on cpu *"])
    mistral = _column(from_ini.stdout.str())
    assert set(mistral) == set(build_registry().names())
    assert mistral["sliding_window_cache"] is None and mistral["sdpa"] is None
    assert mistral["quantized_cache"] == (
        "quantized_cache(backend='quanto', nbits=4) needs a model whose layers all use full attention (transformers' "
        "QuantizedCache); found: 2 of 2 layers sliding_attention (no layer_types; inferred from config.sliding_window)")
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-techniques", "--opt-model=tiny-random-llama")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["technique catalogue for model tiny-random-llama (llama, float32; from --opt-model) *"])
    llama = _column(result.stdout.str())
    assert llama["sliding_window_cache"] == ("sliding_window_cache needs a model with sliding-window attention "
                                             "(config.sliding_window); found: llama without one")
    assert llama["quantized_cache"] is None
    # what does not depend on the model reads the same in both columns
    assert llama["flash_attention_2"] == mistral["flash_attention_2"]
    missing = pytester.runpytest("-p", "no:cacheprovider", "--opt-techniques", "--opt-model=./no-such-model")
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    text = missing.stdout.str() + missing.stderr.str()
    assert "INTERNALERROR" not in text and "Traceback" not in text
    assert "opt_model './no-such-model' (from --opt-model): the path 'no-such-model' does not exist" in text, text


def _entry(technique: str, model: str | None, outcome: str, reason: str | None = None) -> dict[str, object]:
    return {"nodeid": f"test_user.py::test_cell[{technique}-{model}]", "outcome": outcome,
            "skip_reason": reason if outcome in ("skipped", "xfailed") else None,
            "error": reason if outcome in ("failed", "error") else None,
            "model": None if model is None else {"name_or_path": model}, "techniques": [technique] if model else []}


def test_support_matrix_script_writes_and_checks_the_readme_table(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/support_matrix.py on a hand-written report: the built-in models in catalogue order (llama before
    gpt2), one numbered note per distinct reason, a compiler's page of error cut to its head, a test that is no
    cell left out; --write puts the table between the README's markers, --check tells a stale one."""
    import json

    gpu = "flash_attention_2 needs a CUDA GPU of compute capability >= 8.0; found: cpu"
    report = {"schema": "pytest-transformers-opt/report", "schema_version": 1,
              "environment": {"device": "cpu", "versions": {"torch": "2.13.0+cpu", "transformers": "5.24.0",
                                                            "bitsandbytes": "0.50.2", "kernels": None}},
              "tests": [_entry("eager", "tiny-random-gpt2", "passed"), _entry("eager", "tiny-random-llama", "passed"),
                        _entry("flash_attention_2", "tiny-random-gpt2", "skipped", gpu),
                        _entry("flash_attention_2", "tiny-random-llama", "skipped", gpu),
                        _entry("compile", "tiny-random-gpt2", "failed", "CppCompileError: " + "x" * 400),
                        _entry("compile", "tiny-random-llama", "xfailed", "torch 2.13 | inductor bug"),
                        _entry("unrelated", None, "passed")]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    printed = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, check=True)
    expected = "\n".join([
        "Made on cpu with torch 2.13.0+cpu, transformers 5.24.0, bitsandbytes 0.50.2; not installed: kernels.",
        "",
        "Columns: the models `tiny-random-NAME`.",
        "",
        "| technique | `llama` | `gpt2` |",
        "| --- | --- | --- |",
        "| `compile` | xfail (1) | fail (2) |",
        "| `eager` | pass | pass |",
        "| `flash_attention_2` | skip (3) | skip (3) |",
        "",
        "(1) torch 2.13 / inductor bug  ",
        f"(2) CppCompileError: {'x' * (300 - 3 - len('CppCompileError: '))}...  ",
        f"(3) {gpu}",
    ])
    assert printed.stdout.strip() == expected
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n\n<!-- support-matrix:start -->\nold table\n<!-- support-matrix:end -->\n\nafter\n")
    script = _script_module()  # the same main() in this process: a new interpreter per call costs seconds
    args = [str(path), "--readme", str(readme)]
    assert script.main([*args, "--check"]) == 1
    assert "its support matrix is not the one" in capsys.readouterr().err
    assert script.main([*args, "--write"]) == 0
    assert readme.read_text() == (f"# Project\n\n<!-- support-matrix:start -->\n{expected}\n"
                                  f"<!-- support-matrix:end -->\n\nafter\n")
    assert script.main([*args, "--check"]) == 0
    readme.write_text("# Project without markers\n")
    assert script.main([*args, "--check"]) == 2
    assert "no <!-- support-matrix:start --> ... <!-- support-matrix:end --> block" in capsys.readouterr().err


def _script_module() -> Any:
    return load_module_file("support_matrix", SCRIPT)


def test_tables_made_on_stacks_that_differ_only_where_no_probe_reads_are_compared() -> None:
    """The README's table stays checked across a bump of a package no probe reads (accelerate 1.15.0 -> 1.16.0 left
    it unchecked everywhere until it was re-made); torch, transformers, a technique's package or the device do not."""
    script = _script_module()
    readme = ("Made on cpu with torch 2.13.0+cpu, transformers 5.24.0, accelerate 1.15.0, bitsandbytes 0.50.2, "
              "nvidia-ml-py 13.615.71, tokenizers 0.23.3; not installed: flash-attn, kernels.")
    assert script.probed_stack(readme) == ("Made on cpu with torch 2.13.0+cpu, transformers 5.24.0, bitsandbytes "
                                           "0.50.2; not installed: flash-attn, kernels")
    for same in (readme.replace("accelerate 1.15.0", "accelerate 1.16.0"),
                 readme.replace("tokenizers 0.23.3", "tokenizers 0.24.0").replace("nvidia-ml-py 13.615.71, ", ""),
                 readme.replace("kernels.", "kernels, accelerate.").replace("accelerate 1.15.0, ", "")):
        assert script.probed_stack(same) == script.probed_stack(readme), same
    for other in (readme.replace("torch 2.13.0+cpu", "torch 2.14.0+cpu"),
                  readme.replace("bitsandbytes 0.50.2", "bitsandbytes 0.51.0"),
                  readme.replace("not installed: flash-attn, kernels", "not installed: flash-attn"),
                  readme.replace("Made on cpu", "Made on cuda (NVIDIA H200)")):
        assert script.probed_stack(other) != script.probed_stack(readme), other
