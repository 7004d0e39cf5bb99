"""Issue 19, second field round: probes that read a model's layer kinds (hybrid sliding / full attention),
one-line reasons that keep the offending value, a compile cache with a dangling link or damaged entries,
and project-wide ini keys that do not apply to a run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pytest_transformers_opt.engine import tiny_models
from pytest_transformers_opt.engine.hardware import HardwareInfo
from pytest_transformers_opt.techniques import ProbeContext, TechniqueSpec, build_registry
from pytest_transformers_opt.units import REASON_CHARS, shorten

HYBRID_LAYERS = ["sliding_attention", "full_attention"]  # Gemma 3 / GPT-OSS style, two layers


def _save_qwen3(folder: Path, layer_types: list[str]) -> str:
    """A random two-layer Qwen3 with the given layer kinds, saved with the built-in model's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=128, head_dim=32, vocab_size=512, max_position_embeddings=256, use_sliding_window=True,
        sliding_window=16, layer_types=layer_types, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer_source = tiny_models.ensure_tiny_model("tiny-random-llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_source / name, folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid-models")
    return {"hybrid": _save_qwen3(root / "hybrid", HYBRID_LAYERS),
            "full": _save_qwen3(root / "full", ["full_attention", "full_attention"])}


HYBRID_TESTS = '''
import pytest
from pytest_transformers_opt import techniques

HYBRID, FULL = {hybrid!r}, {full!r}

@pytest.mark.opt_model(HYBRID)
@pytest.mark.optimization(techniques.quantized_cache())
def test_quantized_cache_on_hybrid(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.opt_model(FULL, layer_types=["sliding_attention", "full_attention"])
@pytest.mark.optimization(techniques.quantized_cache())
def test_quantized_cache_on_hybrid_by_override(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.opt_model(HYBRID)
@pytest.mark.optimization("static_cache")
def test_static_cache_on_hybrid(opt_bench):
    opt_bench(max_new_tokens=4)
'''

QUANTIZED_ON_HYBRID = ("quantized_cache(backend='quanto', nbits=4) needs a model whose layers all use full attention "
                       "(transformers' QuantizedCache); found: 1 of 2 layers sliding_attention (config.layer_types)")


def test_quantized_cache_on_a_hybrid_model_skips_before_loading(run_user, hybrid_models):
    """Issue 19 item 7: a quantized KV cache on mixed sliding / full layers is unsupported (a skip with
    the reason, seen in the config before any load), not a failure; the other cache runs."""
    run = run_user(HYBRID_TESTS.format(**hybrid_models), "-rs")
    run.result.assert_outcomes(passed=1, skipped=2)
    for name in ("test_quantized_cache_on_hybrid", "test_quantized_cache_on_hybrid_by_override"):
        entry = run.test(name)
        assert entry["outcome"] == "skipped"
        assert entry["skip_reason"] == QUANTIZED_ON_HYBRID
        assert entry["error"] is None and entry["optimized"] is None  # nothing was loaded or measured
    run.result.stdout.fnmatch_lines(["*SKIPPED*found: 1 of 2 layers sliding_attention (config.layer_types)*"])
    static = run.test("test_static_cache_on_hybrid")
    assert static["outcome"] == "passed", static["error"]
    assert static["similarity"]["token_match"] == 1.0


def _probe(name: str, config: object, **params: object) -> str | None:
    ctx = ProbeContext(hardware=HardwareInfo(), model_config=config, dtype="float32")
    return build_registry().resolve(TechniqueSpec.of(name, **params)).probe(ctx)


def test_every_probe_reads_the_layer_kinds():
    """Each technique checked against hybrid and non-full layer kinds: only the quantized cache refuses
    sliding layers; continuous batching refuses the kinds its paged cache has no allocator for; the
    sliding-window cache needs a layer that slides."""
    from transformers import AutoConfig

    gemma3 = AutoConfig.for_model("gemma3_text")  # 5 sliding layers to 1 full
    mistral = AutoConfig.for_model("mistral", sliding_window=16)  # no layer_types: every layer slides
    llama4 = AutoConfig.for_model("llama4_text")  # chunked attention
    assert _probe("quantized_cache", gemma3).endswith(
        f"found: {sum(k == 'sliding_attention' for k in gemma3.layer_types)} of {gemma3.num_hidden_layers} "
        f"layers sliding_attention (config.layer_types)")
    assert _probe("quantized_cache", mistral).endswith(
        "found: 32 of 32 layers sliding_attention (no layer_types; inferred from config.sliding_window)")
    assert _probe("quantized_cache", AutoConfig.for_model("llama")) is None
    for name in ("static_cache", "sliding_window_cache", "continuous_batching", "sdpa", "eager",
                 "quanto_int8", "bnb_4bit"):
        assert _probe(name, gemma3) is None, name
    # flex attention on cpu: the torch releases whose inductor cannot compile a sliding-window mask skip it
    import torch

    from pytest_transformers_opt.techniques.attention import CPU_FLEX_WINDOW_BUG
    from pytest_transformers_opt.techniques.base import version_ok

    flex, torch_release = _probe("flex_attention", gemma3), torch.__version__.split("+")[0]
    if version_ok(torch_release, CPU_FLEX_WINDOW_BUG):
        assert flex is not None and flex.startswith(f"flex_attention on cpu with torch {torch.__version__} needs a "
                                                    f"model without sliding-window layers"), flex
        assert flex.endswith(f"found: gemma3_text with {sum(k == 'sliding_attention' for k in gemma3.layer_types)} of "
                             f"{gemma3.num_hidden_layers} layers sliding_attention (config.layer_types)"), flex
    else:
        assert flex is None, flex
    assert _probe("continuous_batching", llama4) == (
        "continuous_batching needs a model whose layers are full_attention or sliding_attention (its paged cache "
        "has no other); found: 36 of 48 layers chunked_attention (config.layer_types)")
    all_full = AutoConfig.for_model("gemma3_text", layer_types=["full_attention"] * 26)
    assert _probe("sliding_window_cache", all_full) == (
        "sliding_window_cache needs a model with sliding-window attention layers; found: gemma3_text with "
        "config.sliding_window=4096 but layer_types ['full_attention']")


# a team's own quantized cache, registered the README's way, with no probe of the layer kinds: transformers
# refuses it at generate time, and that failure's one-line reason must still name the offending layer kind
OWN_QUANTIZED_CACHE = '''
import pytest
from pytest_transformers_opt.techniques import Technique

class OurQuantizedCache(Technique):
    name = "our_quantized_cache"
    family = "caching"

    def configure_generation(self, gen, ctx):
        gen.kwargs["cache_implementation"] = "quantized"
        gen.kwargs["cache_config"] = {"backend": "quanto", "nbits": 4}

@pytest.hookimpl(optionalhook=True)
def pytest_opt_register_techniques(registry):
    registry.register(OurQuantizedCache)
'''

OWN_CACHE_TEST = '''
import pytest

@pytest.mark.opt_model({hybrid!r})
@pytest.mark.optimization("our_quantized_cache")
def test_our_cache(opt_bench):
    opt_bench(max_new_tokens=4)
'''


def test_a_failure_line_keeps_the_offending_value(run_user, hybrid_models, tmp_path):
    """Issue 19 item 30: the one-line reason of a long error cut `... only full attention layers. We found…`
    and lost `{'sliding_attention'}`; the middle goes instead, in the terminal and the Markdown report."""
    md = tmp_path / "report.md"
    run = run_user(OWN_CACHE_TEST.format(**hybrid_models), "--opt-report", f"--opt-report-md={md}",
                   conftest=OWN_QUANTIZED_CACHE)
    run.result.assert_outcomes(failed=1)
    error = run.test("test_our_cache")["error"]
    assert "We found the following invalid layer types: {'sliding_attention'}" in error  # the JSON keeps it all
    terminal = run.result.stdout.lines
    (line,) = [line for line in terminal if line.startswith("  test_our_cache: ")]
    reason = line.removeprefix("  test_our_cache: ")
    assert len(reason) <= REASON_CHARS and len(reason) < len(" ".join(error.split()))  # it was cut
    assert reason.startswith("RuntimeError: optimized generation with [eager, our_quantized_cache] raised ValueError: "
                             "`QuantizedCache` is only supported for")
    assert reason.endswith("… invalid layer types: {'sliding_attention'}"), reason
    assert f"(failed): {reason}" in md.read_text().replace("\\", "")


def test_a_matrix_cell_keeps_what_was_found() -> None:
    """The hardware matrix's 100-character cell keeps a skip reason's `found:` part."""
    from pytest_transformers_opt.report.view import MATRIX_REASON_CHARS, matrix_outcome_text

    cell = matrix_outcome_text({"outcome": "skipped", "skip_reason": QUANTIZED_ON_HYBRID})
    assert len(cell) <= MATRIX_REASON_CHARS
    assert cell.endswith("… found: 1 of 2 layers sliding_attention (config.layer_types)"), cell
    assert cell.startswith("skipped: quantized_cache(")


def test_shorten_keeps_the_last_value_or_what_was_found() -> None:
    long_words = "ValueError: " + " ".join(f"word{n}" for n in range(80))
    assert shorten(long_words, 100) == long_words[:long_words.rfind(" ", 0, 99)] + "…"  # no value: the plain cut
    message = "RuntimeError: stack [a, b] raised ValueError: " + "long words " * 20 + "We found bad kinds: {'x'}"
    assert shorten(message, 100).endswith("… We found bad kinds: {'x'}")
    # an apostrophe inside a word is no quote: nothing to keep
    prose = "the model's weights " * 10
    assert shorten(prose, 60) == prose[:prose.rfind(" ", 0, 59)] + "…"


# --- start-up checks: options and project-wide ini keys ------------------------------------------------------
PLAIN_TESTS = '''
def test_one():
    pass

def test_two():
    pass
'''


def test_a_dangling_symlink_as_the_compile_cache_is_a_usage_error(pytester: pytest.Pytester) -> None:
    """Issue 19 item 15: a link to a folder that is gone passed the start-up check, then the first test
    raised a raw FileExistsError and the rest ran without the cache."""
    pytester.makepyfile(test_user=PLAIN_TESTS)
    link = pytester.path / "compile-cache"
    link.symlink_to(pytester.path / "restored-elsewhere")  # the CI cache step restored nothing there
    result = pytester.runpytest("-p", "no:cacheprovider", f"--opt-compile-cache={link}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines([f"*--opt-compile-cache: '{link}' is a symbolic link to "
                                 f"'{pytester.path / 'restored-elsewhere'}', which does not exist (a dangling link); "
                                 f"create its target folder, remove the link, or give another folder*"])
    assert "FileExistsError" not in result.stdout.str() + result.stderr.str()
    assert "passed" not in result.stdout.str()
    # set project-wide, the ini key is named, and a link below a dangling one is caught as well
    pytester.makeini(f"[pytest]\nopt_compile_cache = {link}/cpu\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*ini opt_compile_cache: '{link}' is a symbolic link to *(a dangling link)*"])
    (pytester.path / "restored-elsewhere").mkdir()  # the link's target is back: the run goes on
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_an_ini_compare_fail_without_a_compare_is_a_note(pytester: pytest.Pytester) -> None:
    """Issue 19 item 33: `opt_compare_fail` in the project's ini blocked every run that did not compare
    (exit 4); it is a header note and the run goes on. Typed on the command line it stays an error."""
    pytester.makeini("[pytest]\nopt_compare_fail = latency:10%\n")
    pytester.makepyfile(test_user=PLAIN_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["transformers-opt: note: ini opt_compare_fail=latency:10% is not applied: this run "
                                 "has no --opt-compare=PATH (the earlier report it gates against)"])

    typed = pytester.runpytest("-p", "no:cacheprovider", "--opt-compare-fail=latency:10%")
    assert typed.ret == pytest.ExitCode.USAGE_ERROR
    typed.stderr.fnmatch_lines(["*--opt-compare-fail: needs --opt-compare=PATH (the earlier report)*"])


def _xdist_env(monkeypatch: pytest.MonkeyPatch, visible: str) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")


def test_an_ini_gpus_per_worker_on_a_machine_without_gpus_is_a_note(pytester: pytest.Pytester,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19 item 33: `opt_gpus_per_worker` in the project's ini made `-n 2` on a CPU machine a usage
    error; it is a header note and the workers run unpinned. On the command line it stays an error."""
    pytester.makeini("[pytest]\nopt_gpus_per_worker = 1\n")
    pytester.makepyfile(test_user=PLAIN_TESTS)
    _xdist_env(monkeypatch, "")  # no GPU visible, as on a CPU runner
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", timeout=240)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["transformers-opt: GPU pinning: ini opt_gpus_per_worker=1 is not applied to this run "
                                 "(-n 2 needs 2 GPUs; found: 0 (CUDA_VISIBLE_DEVICES='')); the workers share the "
                                 "device as without it"])

    typed = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "--opt-gpus-per-worker=1", timeout=240)
    assert typed.ret == pytest.ExitCode.USAGE_ERROR
    typed.stderr.fnmatch_lines(["*--opt-gpus-per-worker=1 with -n 2 needs 2 GPUs; found: 0*"])


# a user's session that reaches the plugin (the hardware probe installs the compile cache) and looks at
# where inductor will put its precompiled headers
HEADERS_TEST = '''
import json, os
from torch._inductor import codecache

def test_uses_the_plugin(opt_hardware):
    with open("seen.json", "w") as file:
        json.dump({"headers": codecache._HEADER_DIR, "inductor": os.environ["TORCHINDUCTOR_CACHE_DIR"]}, file)
'''


def _elf_library() -> Path:
    """A real ELF shared object (torch's smallest library) to stand for a compiled inductor entry."""
    import torch

    return min(Path(torch.__file__).parent.glob("lib/*.so"), key=lambda path: path.stat().st_size)


def test_a_truncated_compiled_entry_in_the_compile_cache_is_a_miss(pytester: pytest.Pytester) -> None:
    """Issue 19 item 16: truncated inductor `.so` files (a cache restore cut short) failed the test with a
    C++ error naming the compiler. Each is removed with its source when the session opens the cache (so it
    compiles again), whole ones stay, and inductor's precompiled headers live in the cache folder too."""
    import torch._inductor.codecache as codecache

    default_headers = codecache._HEADER_DIR
    pytester.makepyfile(test_user=HEADERS_TEST)
    cache = pytester.path / "compile-cache"
    pytester.runpytest("-p", "no:cacheprovider", f"--opt-compile-cache={cache}").assert_outcomes(passed=1)
    (key_folder,) = [path for path in cache.iterdir() if path.is_dir()]
    entries = key_folder / "inductor" / "ab"
    entries.mkdir()
    library = _elf_library().read_bytes()
    (entries / "cwhole.so").write_bytes(library)
    (entries / "cwhole.cpp").write_text("// source\n")
    (entries / "ccut.main.so").write_bytes(library[: len(library) // 2])  # the restore stopped half-way
    (entries / "ccut.main.cpp").write_text("// source, maybe cut too\n")
    (entries / "ccut.optimized.o").write_bytes(library[:100])  # an object file linked into it, cut too

    result = pytester.runpytest("-p", "no:cacheprovider", f"--opt-compile-cache={cache}")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"transformers-opt: compile cache {key_folder}: removed 2 damaged compiled entries "
                                 f"(truncated: ab/ccut.main.so, ab/ccut.optimized.o); they compile again"])
    assert sorted(path.name for path in entries.iterdir()) == ["cwhole.cpp", "cwhole.so"]
    seen = json.loads((pytester.path / "seen.json").read_text())
    assert seen == {"headers": str(key_folder / "inductor" / "precompiled_headers"),
                    "inductor": str(key_folder / "inductor")}
    assert codecache._HEADER_DIR == default_headers  # put back when the session ended


def test_hqq_weights_on_cpu_skip_before_loading(run_user, hybrid_models):
    """Found checking every probe on the hybrid model: hqq_4bit on CPU errored at load with transformers'
    "HQQ model with a device_map that contains a CPU" (it never runs there): a skip with the reason."""
    run = run_user(f'''
import pytest

@pytest.mark.opt_model({hybrid_models["hybrid"]!r})
@pytest.mark.optimization("hqq_4bit")
def test_hqq(opt_bench):
    opt_bench(max_new_tokens=4)
''', "--opt-device=cpu")
    run.result.assert_outcomes(skipped=1)
    entry = run.test("test_hqq")
    assert entry["skip_reason"] == ("hqq_4bit needs a CUDA GPU (transformers' HQQ integration refuses a cpu or disk "
                                    "device_map); found: cpu")
    assert entry["error"] is None and entry["optimized"] is None


def test_a_project_wide_gpus_per_worker_never_blocks_auto_or_a_worker() -> None:
    """The same rule for `-n auto` and for each worker: set in the ini or the environment, too few GPUs
    leave the run unpinned; given as the flag, they stay a usage error."""
    from types import SimpleNamespace

    from pytest_transformers_opt.engine.gpu_pinning import ENV_VAR, auto_num_workers, pin_worker, plan_description

    def config(option: object = None, ini: str = "", worker: str | None = None) -> SimpleNamespace:
        options = {"opt_gpus_per_worker": option, "dist": "load", "tx": ["popen", "popen"]}
        made = SimpleNamespace(getoption=lambda name, default=None: options.get(name, default),
                               getini=lambda name: ini if name == "opt_gpus_per_worker" else "")
        if worker:
            made.workerinput = {"workerid": worker, "workercount": 2}
        return made

    no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
    assert auto_num_workers(config(ini="1"), env=no_gpu) is None  # xdist sizes -n auto itself
    env = dict(no_gpu)
    assert pin_worker(config(ini="1", worker="gw1"), env=env) is None and env == no_gpu  # left as it was
    assert plan_description(config(), env={**no_gpu, ENV_VAR: "2"}) == (
        f"GPU pinning: {ENV_VAR}=2 is not applied to this run (-n 2 needs 4 GPUs; found: 0 "
        "(CUDA_VISIBLE_DEVICES='')); the workers share the device as without it")
    with pytest.raises(pytest.UsageError, match="with -n auto needs at least 1 GPU; found: 0"):
        auto_num_workers(config(1), env=no_gpu)
