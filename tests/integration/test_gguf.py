"""GGUF checkpoints as users hold them: ``opt_model(folder, gguf_file="x.gguf")``.

The checkpoint is a tiny GGUF written from the built-in ``tiny-random-llama`` (tests/gguf_files.py,
1.7 MB, read back in a fraction of a second), so this runs without the 98 MB real file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_transformers_opt.verdict.bench import model_key_extra
from pytest_transformers_opt.verdict.baselines import baseline_key
from pytest_transformers_opt.engine.loading import ModelRequest
from pytest_transformers_opt.engine import real_models, tiny_models

from gguf_files import tiny_gguf_folder

pytest.importorskip("gguf")

INNER = ("--opt-rounds=1", "--opt-warmup=0", "-v")


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder as a user downloads one: two GGUF files (the same weights), no config.json."""
    return tiny_gguf_folder(tmp_path_factory.mktemp("gguf-model"), copies=2)


TECHNIQUES = '''
import pytest

pytestmark = pytest.mark.opt_model({folder!r}, gguf_file="tiny.F32.gguf")
PROMPTS = ["The cat eats", "A dog sees the old bridge"]
MODELS = {{}}


@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(PROMPTS, max_new_tokens=8)


@pytest.mark.optimization("static_cache")
def test_static_cache(opt_bench):
    opt_bench(PROMPTS, max_new_tokens=8)


@pytest.mark.optimization("bnb_8bit", max_kl=10.0, min_top1=0.0, min_token_match=0.0)
def test_bnb_8bit(opt_bench, opt_model):
    opt_bench(PROMPTS, max_new_tokens=8)
    assert type(opt_model.model.model.layers[0].mlp.up_proj).__name__ == "Linear8bitLt"


def test_plain_dense_model(opt_baseline_model):
    model = opt_baseline_model.model
    # loaded from the converted copy: not reported as quantized, nothing left to block compile or saving
    assert getattr(model, "hf_quantizer", None) is None and getattr(model, "is_quantized", False) is False
    assert "quantization_config" not in model.config.to_dict()
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype.is_floating_point
    assert opt_baseline_model.tokenizer.decode(opt_baseline_model.tokenizer("The cat eats").input_ids) == "The cat eats"
    assert opt_baseline_model.generate(["The cat eats"], max_new_tokens=4)[0].strip()
    MODELS["tiny.F32.gguf"] = model


@pytest.mark.opt_model({folder!r}, gguf_file="tiny.F32.gguf")
def test_same_file_shares_the_loaded_model(opt_baseline_model):
    assert opt_baseline_model.model is MODELS["tiny.F32.gguf"]


@pytest.mark.opt_model({folder!r}, gguf_file="tiny-copy.F32.gguf")
def test_other_file_is_another_model(opt_baseline_model):
    assert opt_baseline_model.model is not MODELS["tiny.F32.gguf"]  # gguf_file is part of the cache key
'''


def test_gguf_checkpoint_loads_and_every_technique_runs_on_it(run_user, gguf_folder: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tiny_models.CACHE_ENV, str(tmp_path / "cache"))  # bnb's converted copy: not kept
    run = run_user(TECHNIQUES.format(folder=str(gguf_folder)), *INNER)
    run.result.assert_outcomes(passed=6)
    for name in ("test_sdpa", "test_static_cache"):  # lossless on the de-quantized weights, default budgets
        entry = run.test(name)
        assert entry["outcome"] == "passed", entry
        assert entry["model"]["name_or_path"] == str(gguf_folder)
        assert entry["similarity"]["token_match"] == 1.0
        assert entry["optimized"]["tokens_generated"] == 2 * 8
    bnb = run.test("test_bnb_8bit")
    assert bnb["outcome"] == "passed" and bnb["similarity"]["kl_mean"] > 0  # really quantized: not the same logits
    assert "converting tiny.F32.gguf" in run.result.stdout.str()  # every side loads a converted copy, said so
    assert len(list((tmp_path / "cache" / "gguf").glob("tiny.F32-*/model.safetensors"))) == 1


BAD = '''
import pytest


@pytest.mark.opt_model({folder!r})
def test_no_gguf_file(opt_model):
    pass


@pytest.mark.opt_model({folder!r}, gguf_file="missing.gguf")
def test_missing_gguf_file(opt_model):
    pass


@pytest.mark.opt_model({file!r})
def test_path_of_the_file(opt_model):
    pass
'''


def test_gguf_mistakes_name_the_files_and_the_fix(run_user, gguf_folder: Path) -> None:
    gguf = gguf_folder / "tiny.F32.gguf"
    run = run_user(BAD.format(folder=str(gguf_folder), file=str(gguf)), *INNER)
    run.result.assert_outcomes(errors=3)
    out = run.result.stdout.str()
    errors = {entry["nodeid"].split("::")[-1]: entry["error"] for entry in run.report["tests"]}
    assert "has no config.json" in errors["test_no_gguf_file"]
    assert "tiny-copy.F32.gguf, tiny.F32.gguf" in errors["test_no_gguf_file"]
    assert "gguf_file='tiny-copy.F32.gguf'" in errors["test_no_gguf_file"]
    assert "gguf_file='missing.gguf' is not in" in errors["test_missing_gguf_file"]
    assert "its GGUF files: tiny-copy.F32.gguf, tiny.F32.gguf" in errors["test_missing_gguf_file"]
    assert f"opt_model({str(gguf_folder)!r}, gguf_file='tiny.F32.gguf')" in errors["test_path_of_the_file"]
    assert "Traceback" not in out


def test_gguf_file_is_part_of_the_model_and_baseline_keys() -> None:
    one = ModelRequest("models/x", from_pretrained_kwargs=(("gguf_file", "x.Q4_K_M.gguf"),))
    other = ModelRequest("models/x", from_pretrained_kwargs=(("gguf_file", "x.Q8_0.gguf"),))
    assert one.identity() != other.identity()
    workload = {"prompts": ["a"], "max_new_tokens": 8, "batch_size": 1}
    keys = {baseline_key(r.name_or_path, None, "float32", ["eager"], workload, model_key_extra(r))
            for r in (one, other, ModelRequest("models/x"))}
    assert len(keys) == 3


def test_gguf_without_the_gguf_package_is_a_skip_saying_how_to_install_it(
        run_user, gguf_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real_models, "_gguf_problem", lambda: "the gguf package (stand-in) is not installed")
    source = f"""
import pytest


@pytest.mark.opt_model({str(gguf_folder)!r}, gguf_file="tiny.F32.gguf")
def test_gguf(opt_model):
    pass
"""
    run = run_user(source, *INNER)
    run.result.assert_outcomes(skipped=1)
    assert run.test("test_gguf")["skip_reason"].endswith("is not installed; install it with: pip install gguf")
