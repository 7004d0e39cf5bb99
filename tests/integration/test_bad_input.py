"""Bad input, as users write it: every mistake ends as that test's own error or failure.

Each case is a test file a user could write. The message must name the cause and the accepted
forms; pytest must never print INTERNALERROR; and the session runs on: a valid test in the same
file (``test_still_runs``, an sdpa test that calls ``opt_bench``) still passes.

Cases that share a file share one in-process pytest run (one model load instead of one per case);
each case is still its own test here, checking its own section of that run's output.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest

from pytest_transformers_opt.techniques import build_registry

INNER = ("-p", "no:cacheprovider", "--opt-rounds=1", "--opt-warmup=0", "-v")




def _glob(text: str) -> str:
    """``text`` as a literal inside an fnmatch pattern."""
    return re.sub(r"([\[\]*?])", r"[\1]", text)


def _section(result: pytest.RunResult, test: str) -> str:
    """The ERRORS/FAILURES section of one inner test (its header line to the next header)."""
    header = re.compile(rf"^_+ (ERROR at setup of )?{re.escape(test)} _+$")
    lines, inside = [], False
    for line in result.outlines:
        if header.match(line):
            inside = True
            continue
        if inside and (re.match(r"^_{3,} .+ _{3,}$", line) or re.match(r"^={3,}", line)):
            break
        if inside:
            lines.append(line)
    assert inside, f"no section for {test} in:\n{result.stdout.str()}"
    return "\n".join(lines)


STILL_RUNS = '''

@pytest.mark.optimization("sdpa")
def test_still_runs(opt_bench):
    result = opt_bench(max_new_tokens=4)
    assert result.optimized.tokens_generated > 0
'''

# --- the files users write -------------------------------------------------------------------------
NAMES = '''
import pytest

@pytest.mark.optimization("sdp")
def test_typo(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa", "sdpa")
def test_twice(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization()
def test_no_technique(opt_bench):
    opt_bench(max_new_tokens=4)
''' + STILL_RUNS

CONFLICTS = '''
import pytest
from pytest_transformers_opt import techniques

@pytest.mark.optimization("sdpa", "eager")
def test_two_attention_backends(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("bnb_4bit", "bnb_8bit")
def test_two_weight_quantizations(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("compile", techniques.quantized_cache())
def test_compile_with_quantized_cache(opt_bench):
    opt_bench(max_new_tokens=4)
''' + STILL_RUNS

BUDGETS = '''
import pytest

@pytest.mark.optimization("sdpa", max_latncy="1 s")
def test_budget_typo(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa", max_memory="lots")
def test_max_memory_lots(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa", max_ttft="fast")
def test_max_ttft_fast(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa", min_top1=1.5)
def test_min_top1_above_one(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa", max_recompiles=-1)
def test_max_recompiles_negative(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("sdpa", min_speedup=float("nan"))
def test_min_speedup_nan(opt_bench):
    opt_bench(max_new_tokens=4)
''' + STILL_RUNS

PARAMS = '''
import pytest
from pytest_transformers_opt import techniques

@pytest.mark.optimization(techniques.quantized_cache(backend="foo"))
def test_cache_backend_foo(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization(techniques.quantized_cache(nbits=3))
def test_cache_nbits_3(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization(techniques.bnb_4bit(quant_type="int3"))
def test_bnb_quant_type_int3(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization(techniques.tensor_parallel(tp_size=1))
def test_tp_size_1(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization(techniques.continuous_batching(max_batch_tokens=0))
def test_max_batch_tokens_0(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization(42)
def test_not_a_technique(opt_bench):
    opt_bench(max_new_tokens=4)
''' + STILL_RUNS

OPT_MODEL = '''
import pytest

@pytest.mark.opt_model()
def test_no_model_name(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.opt_model("tiny-random-llama", dtype="int7")
def test_dtype_int7(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.opt_model("tiny-random-llama", trust_remote_code="yes")
def test_trust_remote_code_yes(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.opt_model("tiny-random-llama", attn_implementation="sdpa")
def test_attn_implementation_kwarg(opt_bench):
    opt_bench(max_new_tokens=4)
''' + STILL_RUNS

PATHS = '''
import pytest

@pytest.mark.opt_model({missing!r})
def test_missing_folder(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.opt_model({empty!r})
def test_empty_folder(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.opt_model({pickle!r})
def test_pickle_only(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.opt_model({remote!r})
def test_remote_code(opt_bench):
    opt_bench(max_new_tokens=4)
''' + STILL_RUNS

BENCH_ARGS = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_zero_new_tokens(opt_bench):
    opt_bench(max_new_tokens=0)

@pytest.mark.optimization("sdpa")
def test_no_prompts(opt_bench):
    opt_bench(prompts=[], max_new_tokens=4)

@pytest.mark.optimization("sdpa")
def test_batch_size_two(opt_bench):
    opt_bench(batch_size="two", max_new_tokens=4)
''' + STILL_RUNS

# generation.py passes its own logits_processor (the time-to-first-token timer) and no
# stopping_criteria: a stopping criterion is called inside model.generate() after every step.
RAISING_CONFTEST = '''
import torch
from transformers import StoppingCriteria
from pytest_transformers_opt.techniques import Technique


class _Raise(StoppingCriteria):
    def __init__(self, make):
        self.make = make

    def __call__(self, input_ids, scores, **kwargs):
        raise self.make()


class Boom(Technique):
    name = "boom"
    family = "generation"
    summary = "raises inside generate()"

    def configure_generation(self, gen, ctx):
        gen.kwargs["stopping_criteria"] = [_Raise(lambda: RuntimeError("kaboom"))]


class OutOfMemory(Technique):
    name = "oom"
    family = "generation"
    summary = "runs out of memory inside generate()"

    def configure_generation(self, gen, ctx):
        gen.kwargs["stopping_criteria"] = [_Raise(lambda: torch.OutOfMemoryError("CUDA out of memory (injected)"))]


def pytest_opt_register_techniques(registry):
    registry.register(Boom)
    registry.register(OutOfMemory)
'''

GENERATION = '''
import pytest

@pytest.mark.optimization("boom")
def test_raises_in_generate(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("oom")
def test_out_of_memory_in_generate(opt_bench):
    opt_bench(max_new_tokens=4)
''' + STILL_RUNS

DUPLICATE_CONFTEST = '''
from pytest_transformers_opt.techniques import Technique


class MySdpa(Technique):
    name = "sdpa"
    family = "attention"
    summary = "a project's own sdpa"


def pytest_opt_register_techniques(registry):
    registry.register(MySdpa)
'''

DUPLICATE = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_uses_the_registry(opt_bench):
    opt_bench(max_new_tokens=4)

def test_without_the_plugin():
    assert True
'''


def _model_folders(pytester: pytest.Pytester) -> dict[str, str]:
    """A missing path, an empty folder, pickle-only weights, and a config that needs remote code."""
    from transformers import LlamaConfig

    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=64)
    empty = pytester.mkdir("empty_model")
    pickle = pytester.mkdir("pickle_model")
    LlamaConfig(**small).save_pretrained(pickle)
    (pickle / "pytorch_model.bin").write_bytes(b"not really a pickle")
    remote = pytester.mkdir("remote_code_model")
    LlamaConfig(**small).save_pretrained(remote)
    config = json.loads((remote / "config.json").read_text())
    config["model_type"] = "my_custom_llama"
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig"}
    (remote / "config.json").write_text(json.dumps(config))
    (remote / "model.safetensors").write_bytes(b"")  # weights present, so only the config is in question
    return {"missing": str(pytester.path / "no_such_model"), "empty": str(empty), "pickle": str(pickle),
            "remote": str(remote)}


@dataclass(frozen=True)
class Group:
    """One user file (and conftest), its expected outcomes."""

    source: str
    outcomes: dict[str, int]
    conftest: str | None = None
    formatted: bool = False


GROUPS: dict[str, Group] = {
    "names": Group(NAMES, {"passed": 1, "errors": 3}),
    "conflicts": Group(CONFLICTS, {"passed": 1, "errors": 3}),
    "budgets": Group(BUDGETS, {"passed": 1, "errors": 6}),
    "params": Group(PARAMS, {"passed": 1, "errors": 6}),
    "opt_model": Group(OPT_MODEL, {"passed": 1, "errors": 4}),
    "paths": Group(PATHS, {"passed": 1, "errors": 4}, formatted=True),
    "bench_args": Group(BENCH_ARGS, {"passed": 1, "failed": 3}),
    "generation": Group(GENERATION, {"passed": 1, "failed": 2}, conftest=RAISING_CONFTEST),
    "duplicate": Group(DUPLICATE, {"passed": 1, "errors": 1}, conftest=DUPLICATE_CONFTEST),
}
_RUNS: dict[str, pytest.RunResult] = {}


def _run_group(pytester: pytest.Pytester, name: str) -> pytest.RunResult:
    """Run a group's file once per process; later cases of the group read the same output."""
    if name not in _RUNS:
        group = GROUPS[name]
        source = group.source.format(**_model_folders(pytester)) if group.formatted else group.source
        if group.conftest:
            pytester.makeconftest(group.conftest)
        pytester.makepyfile(**{f"test_{name}": source})
        _RUNS[name] = pytester.runpytest(*INNER)
    return _RUNS[name]


@dataclass(frozen=True)
class Case:
    group: str
    test: str
    outcome: str  # "error" (at setup) or "failed" (in the test)
    fragments: tuple[str, ...]


CASES: dict[str, Case] = {
    # technique names
    "unknown technique suggests sdpa": Case("names", "test_typo", "error", (
        "@pytest.mark.optimization", "unknown technique 'sdp'", "Did you mean 'sdpa'?", "Known: ",
        "kernels-community/flash-attn2")),
    "technique given twice": Case("names", "test_twice", "error", (
        "@pytest.mark.optimization", "technique 'sdpa' is given twice")),
    "optimization() without technique": Case("names", "test_no_technique", "error", (
        "@pytest.mark.optimization()", "name at least one technique", '@pytest.mark.optimization("sdpa")')),
    # conflicts
    "sdpa with eager": Case("conflicts", "test_two_attention_backends", "error", (
        "sdpa and eager conflict", "both set the attention implementation", "choose one")),
    "bnb_4bit with bnb_8bit": Case("conflicts", "test_two_weight_quantizations", "error", (
        "bnb_4bit and bnb_8bit conflict", "both set the weight quantization", "choose one")),
    "compile with quantized_cache": Case("conflicts", "test_compile_with_quantized_cache", "error", (
        "compile and quantized_cache(backend='quanto', nbits=4) conflict",
        "torch.compile needs a compileable (static) cache")),
    # budgets
    "unknown budget suggests max_latency": Case("budgets", "test_budget_typo", "error", (
        "unknown budget 'max_latncy'", "Did you mean 'max_latency'?", "Accepted: max_memory", "min_top1")),
    "max_memory lots": Case("budgets", "test_max_memory_lots", "error", (
        "budget max_memory", "'lots'", '"6 GiB"', '"800 MB"', "int number of bytes")),
    "max_ttft fast": Case("budgets", "test_max_ttft_fast", "error", (
        "budget max_ttft", "'fast'", '"50 ms"', '"1.5 s"', "float number of seconds")),
    "min_top1 above one": Case("budgets", "test_min_top1_above_one", "error", (
        "budget min_top1", "1.5", "from 0 to 1")),
    "max_recompiles negative": Case("budgets", "test_max_recompiles_negative", "error", (
        "budget max_recompiles", "-1", "whole number >= 0")),
    "min_speedup nan": Case("budgets", "test_min_speedup_nan", "error", (
        "budget min_speedup", "nan", "finite number > 0")),
    # technique parameters
    "quantized_cache backend foo": Case("params", "test_cache_backend_foo", "error", (
        "quantized_cache", "backend 'foo'", "accepted: 'quanto', 'hqq'")),
    "quantized_cache nbits 3": Case("params", "test_cache_nbits_3", "error", (
        "quantized_cache", "nbits=3", "backend 'quanto'", "accepted: (2, 4)")),
    "bnb_4bit quant_type int3": Case("params", "test_bnb_quant_type_int3", "error", (
        "bnb_4bit", "quant_type='int3'", "accepted: 'nf4', 'fp4'")),
    "tensor_parallel tp_size 1": Case("params", "test_tp_size_1", "error", (
        "tensor_parallel", "tp_size=1", "an int >= 2")),
    "continuous_batching max_batch_tokens 0": Case("params", "test_max_batch_tokens_0", "error", (
        "continuous_batching", "max_batch_tokens=0", "an int > 0")),
    "optimization(42)": Case("params", "test_not_a_technique", "error", (
        "@pytest.mark.optimization", "42 is not a technique", "catalogue name such as 'sdpa'", "techniques.NAME(")),
    # opt_model marker
    "opt_model without name": Case("opt_model", "test_no_model_name", "error", (
        "@pytest.mark.opt_model(name_or_path, *, revision=None, dtype=None, trust_remote_code=False",
        "missing a required argument: 'name_or_path'")),
    "opt_model dtype int7": Case("opt_model", "test_dtype_int7", "error", (
        "@pytest.mark.opt_model dtype", "'int7' is not a dtype", "float32, bfloat16, float16, auto")),
    "opt_model trust_remote_code yes": Case("opt_model", "test_trust_remote_code_yes", "error", (
        "@pytest.mark.opt_model", "trust_remote_code must be True or False", "'yes'")),
    "opt_model attn_implementation kwarg": Case("opt_model", "test_attn_implementation_kwarg", "error", (
        "@pytest.mark.opt_model", "attn_implementation is set by techniques", "remove it from the marker")),
    # model folders
    "model path missing": Case("paths", "test_missing_folder", "error", (
        "no_such_model", "does not exist", "hub id ('org/name')", "'tiny-random-llama'")),
    "model folder empty": Case("paths", "test_empty_folder", "error", (
        "empty_model", "has no config.json", "save_pretrained()")),
    "model folder with pickle weights only": Case("paths", "test_pickle_only", "error", (
        "pickle_model", "only pickle weights (pytorch_model.bin)", "safetensors only",
        "@pytest.mark.opt_model(..., use_safetensors=False)")),
    "model config with auto_map": Case("paths", "test_remote_code", "error", (
        "remote_code_model", "needs remote code", "auto_map", "trust_remote_code is off by default",
        "@pytest.mark.opt_model(..., trust_remote_code=True)")),
    # opt_bench arguments
    "opt_bench max_new_tokens 0": Case("bench_args", "test_zero_new_tokens", "failed", (
        "opt_bench(max_new_tokens=...)", "0 must be a whole number >= 1")),
    "opt_bench prompts empty": Case("bench_args", "test_no_prompts", "failed", (
        "opt_bench(prompts=...)", "non-empty list of non-empty strings", "got []")),
    "opt_bench batch_size two": Case("bench_args", "test_batch_size_two", "failed", (
        "opt_bench(batch_size=...)", "'two' must be a whole number >= 1")),
    # errors inside generate()
    "exception inside generation": Case("generation", "test_raises_in_generate", "failed", (
        "optimized generation with [eager, boom] raised RuntimeError: kaboom",)),
    "out of memory inside generation": Case("generation", "test_out_of_memory_in_generate", "failed", (
        "optimized generation with [eager, oom] raised OutOfMemoryError: CUDA out of memory (injected)",)),
    # registering a taken name
    "register a taken name": Case("duplicate", "test_uses_the_registry", "error", (
        "pytest_opt_register_techniques", "technique 'sdpa' is already registered", "replace=True")),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bad_input_is_that_tests_own_outcome(pytester: pytest.Pytester, case: Case) -> None:
    result = _run_group(pytester, case.group)
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output
    result.assert_outcomes(**GROUPS[case.group].outcomes)
    summary = "ERROR" if case.outcome == "error" else "FAILED"
    header = f"*_ ERROR at setup of {case.test} _*" if case.outcome == "error" else f"*_ {case.test} _*"
    result.stdout.fnmatch_lines([f"*::{case.test} {summary}*"])
    result.stdout.fnmatch_lines([header, f"*{_glob(case.fragments[0])}*"])
    result.stdout.fnmatch_lines([f"{summary} *::{case.test} - *"])
    section = _section(result, case.test)
    for fragment in case.fragments:
        assert fragment in section, f"{fragment!r} not in the {case.test} section:\n{section}"
    # the session ran on: the valid test of the same file passed
    if case.group == "duplicate":
        result.stdout.fnmatch_lines(["*::test_without_the_plugin PASSED*"])
    else:
        result.stdout.fnmatch_lines(["*::test_still_runs PASSED*"])


def test_setup_errors_carry_no_traceback(pytester: pytest.Pytester) -> None:
    """Bad marker input is the user's mistake, not the plugin's: the message alone, no stack into the plugin."""
    result = _run_group(pytester, "names")
    section = _section(result, "test_typo")
    assert "pytest_transformers_opt" not in section and "Traceback" not in section


def test_errors_inside_generation_fail_with_the_stack(pytester: pytest.Pytester) -> None:
    """Broken is not unsupported: an exception after the probes passed fails (never skips) the test."""
    result = _run_group(pytester, "generation")
    assert "SKIPPED" not in result.stdout.str()
    section = _section(result, "test_raises_in_generate")
    assert "conftest.py" in section and "RuntimeError: kaboom" in section  # where it came from


def test_catalogue_with_a_clashing_registration_is_a_clean_error(pytester: pytest.Pytester) -> None:
    """``pytest --opt-techniques`` under a conftest that registers a taken name: the same message, no traceback."""
    pytester.makeconftest(DUPLICATE_CONFTEST)
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-techniques")
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output and "Traceback (most recent call last)" not in output
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*technique 'sdpa' is already registered*replace=True*"])


def test_registering_with_replace_overrides_the_builtin(pytester: pytest.Pytester) -> None:
    """The way out the message names works: ``replace=True`` swaps the built-in for the project's class."""
    pytester.makeconftest(DUPLICATE_CONFTEST.replace("registry.register(MySdpa)",
                                                     "registry.register(MySdpa, replace=True)"))
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-techniques")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*sdpa *a project's own sdpa*"])
    assert set(build_registry().names()) <= set(re.findall(r"^  (\S+) ", result.stdout.str(), re.MULTILINE))
