"""Estimates from a config, checked against figures computed by hand (8B Llama shape)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_transformers_opt.advisor.estimates import (
    QUANTIZED_CACHE_RESIDUAL,
    attention_scratch_bytes,
    cache_estimate,
    count_params,
    eager_score_matrix_bytes,
    estimate_peak_memory,
    kv_cache_bytes,
    peak_breakdown,
    stage_estimates,
    weight_bytes,
)
from pytest_transformers_opt.advisor.model_config import ModelShape, load_model_shape
from pytest_transformers_opt.errors import OptConfigError

from model_shapes import LLAMA_8B

# By hand: embeddings 128256*4096 = 525,336,576 (and the same again for the untied lm_head);
# per layer q 4096*4096 + k,v 2*4096*1024 + o 4096*4096 = 41,943,040, MLP 3*4096*14336 =
# 176,160,768, two norms 8,192; 32 layers + the final norm (4,096).
PER_LAYER = 41_943_040 + 176_160_768 + 8_192
PARAMS_8B = 2 * 525_336_576 + 32 * PER_LAYER + 4_096
LINEAR_8B = 32 * (41_943_040 + 176_160_768)  # what bitsandbytes quantizes
OUT_ROWS_8B = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)


@pytest.fixture()
def shape(model_dir) -> ModelShape:
    return load_model_shape(model_dir)


def test_parameter_count_matches_hand_count(shape):
    assert PARAMS_8B == 8_030_261_248
    assert count_params(shape).total == PARAMS_8B
    assert count_params(shape).linear == LINEAR_8B


def test_weight_bytes_per_dtype(shape):
    assert weight_bytes(shape, "bfloat16") == PARAMS_8B * 2
    assert weight_bytes(shape, "float16") == PARAMS_8B * 2
    assert weight_bytes(shape, "float32") == PARAMS_8B * 4
    assert weight_bytes(shape, "bf16") == PARAMS_8B * 2  # aliases are accepted


def test_weight_bytes_quantized(shape):
    unquantized = (PARAMS_8B - LINEAR_8B) * 2  # embeddings, lm_head and norms stay in bf16
    # 8-bit: one byte per weight plus an fp32 scale per output row.
    assert weight_bytes(shape, "bfloat16", "bnb_8bit") == LINEAR_8B + 4 * OUT_ROWS_8B + unquantized
    # 4-bit: half a byte per weight plus an fp32 absmax per 64 weights.
    assert weight_bytes(shape, "bfloat16", "bnb_4bit") == LINEAR_8B // 2 + LINEAR_8B // 64 * 4 + unquantized


def test_kv_cache_one_sequence_8192_tokens_bf16(shape):
    expected = 32 * 8 * 128 * 8192 * 2 * 2
    assert expected == 1_073_741_824
    assert kv_cache_bytes(shape, tokens=8192, sequences=1, dtype="bfloat16") == expected
    assert cache_estimate(shape, None, 8192, 1, "bfloat16").device_bytes == expected
    assert cache_estimate(shape, "static_cache", 8192, 1, "bfloat16").device_bytes == expected
    assert kv_cache_bytes(shape, 8192, 4, "float32") == expected * 4 * 2


def test_cache_techniques(shape):
    full = kv_cache_bytes(shape, 8192, 1, "bfloat16")
    per_layer = full // 32
    offloaded = cache_estimate(shape, "offloaded_cache", 8192, 1, "bfloat16")
    assert offloaded.device_bytes == 2 * per_layer and offloaded.host_bytes == full

    q4 = cache_estimate(shape, "quantized_cache(backend='quanto', nbits=4)", 8192, 1, "bfloat16")
    values = kv_cache_bytes(shape, 8192 - QUANTIZED_CACHE_RESIDUAL, 1, "bfloat16") // 2
    residual = kv_cache_bytes(shape, QUANTIZED_CACHE_RESIDUAL, 1, "bfloat16")
    assert q4.device_bytes == values // 2 + values // 64 * 2 * 2 + residual + per_layer
    q2 = cache_estimate(shape, "quantized_cache(backend='quanto', nbits=2)", 8192, 1, "bfloat16")
    assert q2.device_bytes < q4.device_bytes < full
    # Below the residual length nothing is quantized yet.
    short = cache_estimate(shape, "quantized_cache(backend='quanto', nbits=4)", 100, 1, "bfloat16")
    assert short.device_bytes == kv_cache_bytes(shape, 100, 1, "bfloat16")


def test_sliding_window_cache_caps_tokens(model_dir):
    windowed = load_model_shape({**LLAMA_8B, "sliding_window": 4096})
    assert cache_estimate(windowed, "sliding_window_cache", 8192, 1, "bfloat16").device_bytes == \
        kv_cache_bytes(windowed, 4096, 1, "bfloat16")
    no_window = load_model_shape(model_dir)
    assert cache_estimate(no_window, "sliding_window_cache", 8192, 1, "bfloat16").device_bytes == \
        kv_cache_bytes(no_window, 8192, 1, "bfloat16")


def test_eager_score_matrix_versus_memory_efficient_backends(shape):
    assert eager_score_matrix_bytes(shape, 8192, 1, "bfloat16") == 32 * 8192 * 8192 * 2
    eager_1, eager_2 = (attention_scratch_bytes(shape, "eager", n, 1, "bfloat16") for n in (4096, 8192))
    sdpa_1, sdpa_2 = (attention_scratch_bytes(shape, "sdpa", n, 1, "bfloat16") for n in (4096, 8192))
    assert eager_2 == 4 * eager_1  # quadratic in the input length
    assert sdpa_2 == 2 * sdpa_1  # linear in the input length
    assert attention_scratch_bytes(shape, "flash_attention_2", 8192, 1, "bfloat16") == sdpa_2
    assert eager_2 > eager_score_matrix_bytes(shape, 8192, 1, "bfloat16")  # plus fp32 softmax and mask


def test_peak_memory_is_the_sum_of_its_parts(shape):
    parts = peak_breakdown(shape, "bfloat16", ["sdpa"], 1024, 256, 2)
    assert parts.weights == PARAMS_8B * 2
    assert parts.kv_cache == kv_cache_bytes(shape, 1024 + 256, 2, "bfloat16")
    total = estimate_peak_memory(shape, "bfloat16", ["sdpa"], 1024, 256, 2)
    assert total == parts.weights + parts.kv_cache + parts.attention_scratch + parts.activations + parts.overhead


def test_peak_memory_accepts_configs_and_report_strings(model_dir, shape):
    from transformers import LlamaConfig

    config = LlamaConfig(**{k: v for k, v in LLAMA_8B.items() if k != "model_type"})
    by_config = estimate_peak_memory(config, "bfloat16", ["sdpa"], 512, 128, 1)
    assert by_config == estimate_peak_memory(LLAMA_8B, "bfloat16", ["sdpa"], 512, 128, 1)
    assert by_config == estimate_peak_memory(model_dir, "bfloat16", ["sdpa"], 512, 128, 1)
    four = estimate_peak_memory(shape, "bfloat16", ["sdpa", "bnb_4bit"], 512, 128, 1)
    eight = estimate_peak_memory(shape, "bfloat16", ["sdpa", "bnb_8bit"], 512, 128, 1)
    quant_kv = estimate_peak_memory(shape, "bfloat16", ["sdpa", "quantized_cache(backend='quanto', nbits=4)"],
                                    512, 30000, 1)
    assert four < eight < by_config
    assert quant_kv < estimate_peak_memory(shape, "bfloat16", ["sdpa"], 512, 30000, 1)


def test_stages_add_up_in_order(shape):
    stages = stage_estimates(shape, "bfloat16", [], 8192, 8192, 1, concurrency=4)
    assert [s.stage for s in stages] == ["load", "long-input", "long-generation", "concurrency"]
    load, long_input, generation, concurrency = (s.total for s in stages)
    assert load < generation < concurrency and load < long_input
    assert stage_estimates(shape, "bfloat16", [], 8192, 8192, 1)[-1].stage == "long-generation"
    # Tensor parallelism splits weights and cache over the GPUs.
    split = stage_estimates(shape, "bfloat16", ["tensor_parallel(tp_size=2)"], 8192, 8192, 1)
    assert split[0].parts[0][1] == PARAMS_8B * 2 // 2


@pytest.mark.parametrize("model_type, extra", [
    ("llama", {}),
    ("qwen3", {"head_dim": 32}),
    ("qwen2", {}),
    ("mistral", {"sliding_window": 16}),
    ("gpt2", {}),
])
def test_parameter_count_matches_transformers(model_type, extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type == "gpt2":
        config = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, n_inner=256, vocab_size=300,
                                      n_positions=128)
    else:
        config = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                                      tie_word_embeddings=False, **extra)
    model = AutoModelForCausalLM.from_config(config)
    assert count_params(load_model_shape(config)).total == sum(p.numel() for p in model.parameters())


def test_head_dim_defaults_to_hidden_over_heads():
    raw = {k: v for k, v in LLAMA_8B.items() if k != "head_dim"}
    assert load_model_shape(raw).head_dim == 4096 // 32


@pytest.mark.parametrize("field", ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size",
                                   "intermediate_size"])
def test_config_without_a_needed_field_is_a_clear_error(tmp_path, field):
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in LLAMA_8B.items() if k != field}))
    with pytest.raises(OptConfigError, match=rf"--model: .*missing {field}"):
        load_model_shape(str(tmp_path))


@pytest.mark.parametrize("content, message", [
    ("not json", "is not JSON"),
    ("[1, 2]", "not a config object"),
    (json.dumps({**LLAMA_8B, "num_hidden_layers": -3}), "not a positive whole number"),
])
def test_bad_config_files(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(OptConfigError, match=message):
        load_model_shape(str(path))


def test_missing_paths_are_clear_errors(tmp_path):
    with pytest.raises(OptConfigError, match="--model: .*nothing is downloaded"):
        load_model_shape(str(tmp_path / "nope"))
    with pytest.raises(OptConfigError, match="has no config.json"):
        load_model_shape(str(tmp_path))


def test_multimodal_config_reads_the_text_config():
    shape = load_model_shape({"model_type": "llava", "text_config": LLAMA_8B})
    assert count_params(shape).total == PARAMS_8B
    assert any("text_config" in note for note in shape.notes)


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 96), kv_heads=st.integers(1, 64), head_dim=st.sampled_from([32, 64, 128, 256]),
       tokens=st.integers(1, 200_000), sequences=st.integers(1, 64))
def test_kv_cache_is_linear_in_tokens_and_sequences(layers, kv_heads, head_dim, tokens, sequences):
    shape = load_model_shape({**LLAMA_8B, "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
                              "head_dim": head_dim})
    one = kv_cache_bytes(shape, 1, 1, "bfloat16")
    assert one == layers * kv_heads * head_dim * 2 * 2
    assert kv_cache_bytes(shape, tokens, sequences, "bfloat16") == one * tokens * sequences


@settings(max_examples=60, deadline=None)
@given(hidden=st.sampled_from([256, 512, 1024, 2048]), layers=st.integers(1, 48),
       inter=st.sampled_from([512, 1024, 4096]), vocab=st.integers(1000, 200_000))
def test_weight_formats_are_ordered(hidden, layers, inter, vocab):
    shape = load_model_shape({**LLAMA_8B, "hidden_size": hidden, "num_hidden_layers": layers, "head_dim": 64,
                              "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 64,
                              "intermediate_size": inter, "vocab_size": vocab})
    four, eight = weight_bytes(shape, "bfloat16", "bnb_4bit"), weight_bytes(shape, "bfloat16", "bnb_8bit")
    assert four < eight < weight_bytes(shape, "bfloat16") < weight_bytes(shape, "float32")
