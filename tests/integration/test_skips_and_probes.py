"""GPU-only techniques skip on CPU with their reason; strict mode fails instead; probes on faked hardware."""

from __future__ import annotations

import pytest

from pytest_transformers_opt.engine.hardware import HardwareInfo
from pytest_transformers_opt.techniques import ProbeContext, TechniqueSpec, build_registry
from pytest_transformers_opt.techniques import attention, caches, layer_kernels, quantization

GPU_TESTS = '''
import pytest
from pytest_transformers_opt import techniques

@pytest.mark.optimization("flash_attention_2")
def test_fa2(opt_bench):
    opt_bench()

@pytest.mark.optimization("flash_attention_3")
def test_fa3(opt_bench):
    opt_bench()

@pytest.mark.optimization("kernels-community/flash-attn2")
def test_hub_kernel(opt_bench):
    opt_bench()

@pytest.mark.optimization("kernels")
def test_kernels(opt_bench):
    opt_bench()

@pytest.mark.optimization("offloaded_cache")
def test_offloaded(opt_bench):
    opt_bench()

@pytest.mark.optimization("offloaded_static_cache")
def test_offloaded_static(opt_bench):
    opt_bench()

@pytest.mark.optimization("sliding_window_cache")
def test_sliding_window_on_llama(opt_bench):
    opt_bench()
'''


def _kernels_installed() -> bool:
    """Read apart from the plugin's own check: is a ``kernels`` distribution installed?"""
    import importlib.metadata

    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_gpu_techniques_skip_on_cpu_with_their_reason(run_user):
    run = run_user(GPU_TESTS, "-rs", "--opt-device=cpu")
    run.result.assert_outcomes(skipped=7)
    reasons = {t["nodeid"].split("::")[-1]: t["skip_reason"] for t in run.report["tests"]}
    assert reasons["test_fa2"] == "flash_attention_2 needs a CUDA GPU of compute capability >= 8.0; found: cpu"
    assert reasons["test_fa3"] == "flash_attention_3 needs a CUDA GPU of compute capability >= 9.0; found: cpu"
    # the first unmet requirement is named: the kernels package (transformers 5.25+ installs it), then the GPU
    if _kernels_installed():
        assert reasons["test_hub_kernel"] == "kernels-community/flash-attn2 needs a CUDA GPU; found: cpu"
    else:
        assert "needs the kernels package (>=" in reasons["test_hub_kernel"]
        assert "for transformers " in reasons["test_hub_kernel"] and "found: not installed" in reasons["test_hub_kernel"]
    assert reasons["test_kernels"].startswith("kernels needs the kernels package") or "CUDA" in reasons["test_kernels"]
    assert "needs a CUDA GPU to offload the cache from; found: cpu" in reasons["test_offloaded"]
    assert "needs a CUDA GPU to offload" in reasons["test_offloaded_static"]
    assert "config.sliding_window" in reasons["test_sliding_window_on_llama"]
    run.result.stdout.fnmatch_lines(["*SKIPPED*flash_attention_2 needs a CUDA GPU*"])
    # skipped before any model was loaded: nothing was measured
    assert all(t["optimized"] is None for t in run.report["tests"])
    # a skip is a finished outcome: no "did not finish" error beside its reason
    assert [t["error"] for t in run.report["tests"]] == [None] * 7


def test_strict_mode_turns_a_skip_into_a_failure(run_user):
    run = run_user(GPU_TESTS, "--opt-require=flash_attention_2,offloaded_cache")
    run.result.assert_outcomes(skipped=5, errors=2)
    run.result.stdout.fnmatch_lines([
        "*required technique flash_attention_2 cannot run here (--opt-require): flash_attention_2 needs a CUDA GPU*",
    ])


def test_strict_mode_all(run_user):
    run = run_user(GPU_TESTS, "--opt-require=all")
    run.result.assert_outcomes(errors=7)


def _ctx(**hardware: object) -> ProbeContext:
    dtype = str(hardware.pop("dtype", "bfloat16"))
    info = HardwareInfo(**hardware)  # type: ignore[arg-type]
    return ProbeContext(hardware=info, model_config=None, dtype=dtype)


def _probe(name: str, ctx: ProbeContext, **params: object) -> str | None:
    return build_registry().resolve(TechniqueSpec.of(name, **params)).probe(ctx)


CUDA = dict(device="cuda:0", device_type="cuda", name="NVIDIA T4", device_count=1, bf16_supported=True)


def test_flash_attention_2_probe_on_faked_gpus(monkeypatch):
    monkeypatch.setattr(attention, "module_available", lambda module: False)
    old = _probe("flash_attention_2", _ctx(**CUDA, compute_capability=(7, 5)))
    assert old == ("flash_attention_2 needs a CUDA GPU of compute capability >= 8.0; "
                   "found: cuda:0 (NVIDIA T4, compute capability 7.5)")
    ampere = dict(CUDA, name="NVIDIA A100", compute_capability=(8, 0))
    assert _probe("flash_attention_2", _ctx(**ampere)) == "flash_attention_2 needs the flash-attn package; found: not installed"
    monkeypatch.setattr(attention, "module_available", lambda module: True)
    assert _probe("flash_attention_2", _ctx(**ampere, dtype="float32")) == \
        "flash_attention_2 needs dtype float16 or bfloat16; found: float32"
    assert _probe("flash_attention_2", _ctx(**ampere)) is None
    assert "compute capability >= 9.0" in _probe("flash_attention_3", _ctx(**ampere))
    assert _probe("flash_attention_3", _ctx(**dict(ampere, name="NVIDIA H200", compute_capability=(9, 0)))) is None


def test_kernels_probe_names_the_version_window(monkeypatch):
    monkeypatch.setattr(layer_kernels, "kernels_window", lambda: ">=0.18.2,<0.19")
    versions = {"kernels": "0.17.2", "transformers": "5.24.0"}
    monkeypatch.setattr(layer_kernels, "package_version", lambda name: versions.get(name))
    reason = _probe("kernels", _ctx(**CUDA, compute_capability=(9, 0)))
    assert reason == "kernels needs kernels >=0.18.2,<0.19 (demanded by transformers 5.24.0); found: kernels 0.17.2"
    versions["kernels"] = "0.18.3"
    assert _probe("kernels", _ctx(**CUDA, compute_capability=(9, 0))) is None
    assert "needs a CUDA GPU" in _probe("kernels-community/flash-attn2", _ctx())
    del versions["kernels"]  # not installed: named before the GPU, with the window transformers demands
    assert _probe("kernels-community/flash-attn2", _ctx()) == (
        "kernels-community/flash-attn2 needs the kernels package (>=0.18.2,<0.19 for transformers 5.24.0); "
        "found: not installed")


def test_hub_kernel_probe_needs_the_kernel_in_the_local_cache(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(layer_kernels, "kernels_problem", lambda: None)  # the package window is tested above
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    hopper = _ctx(**CUDA, compute_capability=(9, 0))
    assert _probe("kernels-community/flash-attn2", hopper) == (
        f"kernels-community/flash-attn2 needs the kernel kernels-community/flash-attn2 in the local Hugging Face "
        f"cache (runners are often offline); found: not in {tmp_path} (fetch it once with "
        f"`hf download kernels-community/flash-attn2`)")
    snapshot = tmp_path / "models--kernels-community--flash-attn2" / "snapshots"
    snapshot.mkdir(parents=True)
    assert "not in" in _probe("kernels-community/flash-attn2", hopper)  # an empty download is not a kernel
    (snapshot / "0123abc").mkdir()
    assert _probe("kernels-community/flash-attn2", hopper) is None


def test_offload_tp_and_bnb_probes_on_faked_hardware():
    assert _probe("offloaded_cache", _ctx(**CUDA)) is None
    one_gpu = _probe("tensor_parallel", _ctx(**CUDA), tp_size=2)
    assert one_gpu == "tensor_parallel(tp_size=2) needs 2 CUDA devices; found: 1"
    old_bnb = _ctx(versions={"bitsandbytes": "0.43.1"})
    assert _probe("bnb_4bit", old_bnb) == "bnb_4bit on cpu needs bitsandbytes >= 0.48 (CPU backend); found: bitsandbytes 0.43.1"
    assert _probe("bnb_8bit", _ctx(**CUDA, versions={"bitsandbytes": "0.43.1"})) is None


def test_sdpa_probe_reads_the_model_class():
    from transformers import GPT2Config, LlamaConfig

    ctx = ProbeContext(hardware=HardwareInfo(), model_config=LlamaConfig(), dtype="float32")
    assert _probe("sdpa", ctx) is None
    assert _probe("sliding_window_cache", ctx).startswith("sliding_window_cache needs a model with sliding-window")
    gpt2 = ProbeContext(hardware=HardwareInfo(), model_config=GPT2Config(), dtype="float32")
    assert _probe("sdpa", gpt2) is None


@pytest.mark.parametrize("name", ["quantized_cache", "hqq_4bit", "quanto_int8", "torchao_int8"])
def test_missing_packages_are_named(monkeypatch, name):
    for family in (caches, quantization):
        monkeypatch.setattr(family, "module_available", lambda module: False)
    reason = _probe(name, _ctx())
    assert reason is not None and "package; found: not installed" in reason
