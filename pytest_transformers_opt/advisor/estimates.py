"""Memory estimates from a model's config: weights, KV cache, attention scratch, activations.

Every figure here is an estimate computed from shapes, never a measurement. The formulas follow
how Transformers lays tensors out for a Llama-shaped decoder; other shapes are approximated the
same way (``ModelShape.notes`` says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from ..errors import OptConfigError
from .change import (ATTENTION, CACHING, COMPILATION, CONTINUOUS_BATCHING, PARALLELISM, QUANTIZATION, Change, find,
                     parse_technique)
from .model_config import ModelShape, load_model_shape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}
DTYPE_FORMS = "float32, bfloat16 or float16 (also fp32, bf16, fp16)"

BNB_4BIT_BLOCK = 64  # bitsandbytes 4-bit: one fp32 absmax per 64 weights (no double quantization)
QUANTO_GROUP = 64  # quanto KV quantization: one scale + one zero point per 64 values
QUANTIZED_CACHE_RESIDUAL = 128  # tokens QuantizedCache keeps in full precision (residual_length default)
OFFLOADED_LAYERS_ON_DEVICE = 2  # current layer + the one prefetched
# What estimate_peak_memory adds for the runtime, by device. On CPU the plugin measures a delta of
# peak RSS, and the runtime's fixed costs (imports, thread arenas) are paid before it: nothing is
# added. On CUDA, cuBLAS takes its workspace through torch's caching allocator, which the peak
# counters include; the CUDA context is not counted there. Fit checks add RUNTIME_RESERVE_BYTES
# instead, because the context does take room on the card.
RUNTIME_OVERHEAD_BYTES = {"cpu": 0, "cuda": 8 * 2**20}
RUNTIME_RESERVE_BYTES = {"cuda": 2**30, "cpu": 2**30}
RESERVE_LABEL = "runtime reserve"  # the part of a StageEstimate that holds RUNTIME_RESERVE_BYTES
_LEARNED_POSITIONS = ("gpt2", "gpt_neo", "opt")  # position embeddings are parameters there


def normalize_dtype(value: Any, what: str = "--dtype") -> str:
    """``"bfloat16"`` from ``"bf16"``, ``"torch.bfloat16"`` or a ``torch.dtype``."""
    text = str(value).replace("torch.", "").strip().lower()
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPE_BYTES:
        raise OptConfigError(f"{what}: {value!r} is not a supported dtype; accepted: {DTYPE_FORMS}")
    return text


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[normalize_dtype(dtype)]


# ---------------------------------------------------------------- parameters and weights

@dataclass(frozen=True)
class ParamCounts:
    """Parameters by part. ``linear`` is what bitsandbytes quantizes (not embeddings, norms, lm_head)."""

    embedding: int
    attention: int
    mlp: int
    norms: int
    lm_head: int

    @property
    def linear(self) -> int:
        return self.attention + self.mlp

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.lm_head


def linear_shapes(shape: ModelShape) -> list[tuple[int, int, int]]:
    """``(in_features, out_features, count)`` of every quantizable linear layer in the model."""
    h, layers = shape.hidden_size, shape.num_layers
    q_out = shape.num_heads * shape.head_dim
    kv_out = shape.num_kv_heads * shape.head_dim
    shapes = [(h, q_out, layers), (h, kv_out, 2 * layers), (q_out, h, layers)]  # q, k+v, o
    inter = shape.expert_intermediate_size or shape.intermediate_size
    experts = shape.num_experts * layers
    if shape.gated_mlp:
        shapes += [(h, inter, 2 * experts), (inter, h, experts)]  # gate+up, down
    else:
        shapes += [(h, inter, experts), (inter, h, experts)]  # up, down
    if shape.num_experts > 1:
        shapes.append((h, shape.num_experts, layers))  # router
    return shapes


def count_params(shape: ModelShape) -> ParamCounts:
    """Parameter count from the config: embeddings, attention, MLP, norms, lm_head unless tied."""
    h, layers = shape.hidden_size, shape.num_layers
    q_out = shape.num_heads * shape.head_dim
    kv_out = shape.num_kv_heads * shape.head_dim
    attention_linear = layers * (h * q_out + 2 * h * kv_out + q_out * h)
    mlp = sum(i * o * c for i, o, c in linear_shapes(shape)) - attention_linear
    attention = attention_linear + layers * ((q_out + 2 * kv_out) * shape.qkv_bias + h * shape.o_bias)
    attention += layers * 2 * shape.head_dim * shape.qk_norm  # Qwen3's q_norm / k_norm
    embedding = shape.vocab_size * h
    if not shape.gated_mlp:  # GPT-2 style: biases everywhere, LayerNorm with a bias
        attention += layers * (q_out + 2 * kv_out + h)
        mlp += layers * shape.num_experts * ((shape.expert_intermediate_size or shape.intermediate_size) + h)
        if shape.model_type in _LEARNED_POSITIONS and shape.max_position_embeddings:
            embedding += (shape.max_position_embeddings + 2 * (shape.model_type == "opt")) * h  # OPT offsets by 2
    norm_width = h if shape.gated_mlp else 2 * h
    norms = (2 * layers + 1) * norm_width  # two per layer and the final one
    lm_head = 0 if shape.tie_word_embeddings else shape.vocab_size * h
    return ParamCounts(embedding=embedding, attention=attention, mlp=mlp, norms=norms, lm_head=lm_head)


def weight_bytes(shape: ModelShape, dtype: str, quantization: str | None = None) -> int:
    """Bytes of the weights in ``dtype``; with ``bnb_8bit`` / ``bnb_4bit`` the linear layers shrink.

    8-bit (LLM.int8): 1 byte per weight + one fp32 scale per output row.
    4-bit (NF4/FP4): half a byte per weight + one fp32 absmax per 64-weight block.
    Embeddings, norms and lm_head stay in ``dtype`` (bitsandbytes leaves them unquantized).
    """
    counts = count_params(shape)
    size = dtype_bytes(dtype)
    if quantization is None:
        return counts.total * size
    if quantization not in ("bnb_8bit", "bnb_4bit"):
        raise OptConfigError(f"weight quantization {quantization!r}: estimates know bnb_8bit and bnb_4bit")
    quantized = 0
    for fan_in, fan_out, count in linear_shapes(shape):
        if quantization == "bnb_8bit":
            quantized += count * (fan_in * fan_out + 4 * fan_out)
        else:
            weights = fan_in * fan_out
            quantized += count * (math.ceil(weights / 2) + 4 * math.ceil(weights / BNB_4BIT_BLOCK))
    return quantized + (counts.total - sum(i * o * c for i, o, c in linear_shapes(shape))) * size


# ---------------------------------------------------------------- KV cache

def kv_cache_bytes(shape: ModelShape, tokens: int, sequences: int, dtype: str) -> int:
    """Full-precision KV cache: layers x KV heads x head dim x tokens x sequences x 2 (K and V) x bytes."""
    return shape.num_layers * shape.num_kv_heads * shape.head_dim * tokens * sequences * 2 * dtype_bytes(dtype)


@dataclass(frozen=True)
class CacheEstimate:
    """Where a cache technique keeps keys and values: on the device, and on the host (offloading)."""

    technique: str
    device_bytes: int
    host_bytes: int = 0
    note: str = ""


def cache_estimate(shape: ModelShape, technique: Change | str | None, tokens: int, sequences: int,
                   dtype: str) -> CacheEstimate:
    """KV cache bytes at ``tokens`` cached tokens per sequence under a cache technique.

    dynamic / static: the full cache (static is pre-allocated to the maximum length up front).
    quantized_cache(nbits): nbits per value plus group scales, and up to ``residual_length`` tokens
    in full precision, plus one layer dequantized while it is re-quantized.
    offloaded*: only ~2 layers on the device; the whole cache on the host.
    sliding_window_cache: tokens capped at ``config.sliding_window``.
    """
    change = parse_technique(technique) if isinstance(technique, str) else technique
    name = change.name if change else "dynamic"
    full = kv_cache_bytes(shape, tokens, sequences, dtype)
    per_layer = full // shape.num_layers
    if name in ("dynamic", "static_cache", "compile", "continuous_batching"):
        return CacheEstimate(name, full)
    if name in ("offloaded_cache", "offloaded_static_cache"):
        on_device = per_layer * min(OFFLOADED_LAYERS_ON_DEVICE, shape.num_layers)
        return CacheEstimate(name, on_device, full, f"{OFFLOADED_LAYERS_ON_DEVICE} layers on the device")
    if name == "sliding_window_cache":
        if shape.sliding_window is None:
            return CacheEstimate(name, full, note="the config has no sliding_window: no cap")
        return CacheEstimate(name, kv_cache_bytes(shape, min(tokens, shape.sliding_window), sequences, dtype),
                             note=f"capped at sliding_window={shape.sliding_window} tokens")
    if name == "quantized_cache":
        assert change is not None
        nbits = int(change.params.get("nbits", 4))
        residual = int(change.params.get("residual_length", QUANTIZED_CACHE_RESIDUAL))
        full_tokens = min(tokens, residual)
        values = kv_cache_bytes(shape, tokens - full_tokens, sequences, dtype) // dtype_bytes(dtype)
        quantized = values * nbits // 8 + math.ceil(values / QUANTO_GROUP) * 2 * dtype_bytes(dtype)
        residual_bytes = kv_cache_bytes(shape, full_tokens, sequences, dtype)
        transient = per_layer if tokens > residual else 0  # a layer dequantized while re-quantizing
        return CacheEstimate(name, quantized + residual_bytes + transient,
                             note=f"{nbits}-bit, {residual} residual tokens in full precision")
    return CacheEstimate(name, full, note=f"{name}: full cache assumed")


# ---------------------------------------------------------------- attention and activations

def eager_score_matrix_bytes(shape: ModelShape, input_tokens: int, batch_size: int, dtype: str) -> int:
    """Eager attention's score matrix for one layer: batch x heads x input^2 x bytes."""
    return batch_size * shape.num_heads * input_tokens * input_tokens * dtype_bytes(dtype)


def attention_scratch_bytes(shape: ModelShape, backend: str, input_tokens: int, batch_size: int,
                            dtype: str) -> int:
    """Transient attention memory of one layer during prefill (layers run one at a time).

    eager: the score matrix, its fp32 softmax and the additive causal mask (O(input^2)).
    sdpa / flash / flex / kernels: tiled, so only the output and per-row statistics (O(input)).
    """
    if backend == "eager":
        scores = eager_score_matrix_bytes(shape, input_tokens, batch_size, dtype)
        softmax_fp32 = scores // dtype_bytes(dtype) * 4
        mask = batch_size * input_tokens * input_tokens * dtype_bytes(dtype)
        return scores + softmax_fp32 + mask
    output = batch_size * input_tokens * shape.num_heads * shape.head_dim * dtype_bytes(dtype)
    row_stats = batch_size * shape.num_heads * input_tokens * 4
    return output + row_stats


def activation_bytes(shape: ModelShape, tokens: int, dtype: str) -> int:
    """Transient activations of one decoder layer over ``tokens`` (batch x new tokens) positions.

    Hidden-state copies (residual, norm, attention and MLP outputs), q/k/v with rotary
    temporaries, and the gated MLP's gate, up and product tensors.
    """
    size = dtype_bytes(dtype)
    hidden = 4 * tokens * shape.hidden_size * size
    qkv = 2 * tokens * (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim * size
    inter = shape.expert_intermediate_size or shape.intermediate_size
    mlp = (3 if shape.gated_mlp else 2) * tokens * inter * size
    return hidden + qkv + mlp


def logits_bytes(shape: ModelShape, batch_size: int, dtype: str) -> int:
    """Last-position logits in ``dtype`` and their fp32 copy (generate keeps only the last position)."""
    return batch_size * shape.vocab_size * (dtype_bytes(dtype) + 4)


# ---------------------------------------------------------------- peak memory

def _stack(techniques: Iterable[Change | str] | None) -> list[Change]:
    return [parse_technique(t) if isinstance(t, str) else t for t in (techniques or [])]


@dataclass(frozen=True)
class PeakBreakdown:
    """The parts of an estimated peak, in bytes (all estimates)."""

    weights: int
    kv_cache: int
    kv_cache_host: int
    attention_scratch: int
    activations: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.attention_scratch + self.activations + self.overhead


def peak_breakdown(shape: ModelShape, dtype: str, techniques: Iterable[Change | str] | None,
                   input_tokens: int, max_new_tokens: int, batch_size: int, *,
                   attention: str | None = None, device: str = "cpu", overhead_bytes: int | None = None,
                   output_scores: bool = False) -> PeakBreakdown:
    """Estimated peak of one ``generate`` call, per device; see ``estimate_peak_memory``."""
    stack = _stack(techniques)
    dtype = normalize_dtype(dtype)
    tp = find(stack, PARALLELISM)
    tp_size = int(tp.params.get("tp_size", 1)) if tp else 1
    quant = find(stack, QUANTIZATION)
    weights = weight_bytes(shape, dtype, quant.name if quant and quant.name in ("bnb_8bit", "bnb_4bit") else None)
    cache_change = find(stack, CACHING) or find(stack, COMPILATION) or find(stack, CONTINUOUS_BATCHING)
    tokens = input_tokens + max_new_tokens
    cache = cache_estimate(shape, cache_change, tokens, batch_size, dtype)
    backend_change = find(stack, ATTENTION)
    backend = backend_change.name if backend_change else (attention or shape.attn_implementation or "eager")
    cb = find(stack, CONTINUOUS_BATCHING)
    # Continuous batching prefills in chunks of at most max_batch_tokens positions.
    prefill_tokens = batch_size * input_tokens
    if cb and cb.params.get("max_batch_tokens"):
        prefill_tokens = min(prefill_tokens, int(cb.params["max_batch_tokens"]))
    scratch = attention_scratch_bytes(shape, backend, input_tokens, batch_size, dtype)
    prefill = scratch + activation_bytes(shape, prefill_tokens, dtype)
    decode = activation_bytes(shape, batch_size, dtype)
    logits = logits_bytes(shape, batch_size, dtype)
    if output_scores:  # the scores of every generated step, kept for comparisons
        logits += batch_size * max_new_tokens * shape.vocab_size * 4
    return PeakBreakdown(
        weights=weights // tp_size,
        kv_cache=cache.device_bytes // tp_size,
        kv_cache_host=cache.host_bytes,
        attention_scratch=scratch // tp_size,
        activations=(max(prefill - scratch, decode) + logits) // tp_size,
        overhead=RUNTIME_OVERHEAD_BYTES.get(device.split(":")[0], 0) if overhead_bytes is None else overhead_bytes,
    )


def estimate_peak_memory(config: Any, dtype: str, techniques: Iterable[Change | str] | None,
                         input_tokens: int, max_new_tokens: int, batch_size: int, *,
                         attention: str | None = None, device: str = "cpu", overhead_bytes: int | None = None,
                         output_scores: bool = False) -> int:
    """Estimated peak memory (bytes) of loading ``config`` and one ``generate`` call, per device.

    = weights (dtype or bitsandbytes) + KV cache at input + max_new tokens for ``batch_size``
    sequences (per the cache technique; offloaded parts excluded) + the larger of prefill
    scratch (one layer's attention scratch and activations) and decode activations + last-position
    logits + a fixed runtime overhead (``RUNTIME_OVERHEAD_BYTES[device]``: 0 on CPU, 8 MiB of
    cuBLAS workspace on CUDA; ``overhead_bytes`` overrides it).

    ``config``: a transformers config, a config dict, a ``ModelShape``, a path or a built-in name.
    ``techniques``: catalogue names or report strings; without an attention backend in them,
    ``attention`` (default: the config's, else ``eager``, the plugin's baseline) is used.
    ``output_scores``: add the per-step fp32 scores that a caller keeps for similarity checks.

    Checked on CPU (fp32) against the plugin's measured peaks (peak-RSS deltas): tiny-random-llama,
    sdpa, 62 + 16 tokens: +18%; small-random-llama-100m, 4 x 908 + 16 tokens: sdpa +6%, eager -13%.
    """
    shape = load_model_shape(config)
    return peak_breakdown(shape, dtype, techniques, input_tokens, max_new_tokens, batch_size,
                          attention=attention, device=device, overhead_bytes=overhead_bytes,
                          output_scores=output_scores).total


# ---------------------------------------------------------------- stages of a workload

STAGES = ("load", "long-input", "long-generation", "concurrency")


@dataclass(frozen=True)
class StageEstimate:
    """Estimated device memory in use at one stage of the workload, by part."""

    stage: str
    parts: tuple[tuple[str, int], ...]
    host_bytes: int = 0  # offloaded KV cache kept in CPU RAM

    @property
    def total(self) -> int:
        return sum(value for _, value in self.parts)

    @property
    def reserve(self) -> int:
        """The runtime reserve part: kept free in the fit check, never part of a measured peak delta."""
        return sum(value for label, value in self.parts if label.startswith(RESERVE_LABEL))

    @property
    def workload(self) -> int:
        """What the workload itself needs at this stage (the total less the runtime reserve)."""
        return self.total - self.reserve


def reserve_what(device: str) -> str:
    """What the runtime reserve stands for on ``device``."""
    return "CUDA context, allocator" if device == "cuda" else "Python, torch"


def stage_estimates(shape: ModelShape, dtype: str, techniques: Iterable[Change | str] | None,
                    input_tokens: int, max_new_tokens: int, batch_size: int, concurrency: int = 1, *,
                    device: str = "cuda", attention: str | None = None,
                    reserve_bytes: int | None = None) -> list[StageEstimate]:
    """Memory at each stage, in the order a workload meets them: load, long input (prefill),
    long generation (full KV cache), concurrency (the KV cache of every concurrent request).

    Each stage adds what it needs on top of the weights and the runtime reserve, so the first
    stage over the limit is where the workload breaks first. Per device under tensor parallelism.
    """
    stack = _stack(techniques)
    dtype = normalize_dtype(dtype)
    tp = find(stack, PARALLELISM)
    tp_size = int(tp.params.get("tp_size", 1)) if tp else 1
    quant = find(stack, QUANTIZATION)
    quant_name = quant.name if quant and quant.name in ("bnb_8bit", "bnb_4bit") else None
    backend_change = find(stack, ATTENTION)
    backend = backend_change.name if backend_change else (attention or shape.attn_implementation or "eager")
    if "/" in backend or backend == "kernels":
        backend = "flash_attention_2"  # hub attention kernels tile like flash attention
    cache_change = find(stack, CACHING) or find(stack, COMPILATION) or find(stack, CONTINUOUS_BATCHING)
    cb = find(stack, CONTINUOUS_BATCHING)
    reserve = RUNTIME_RESERVE_BYTES.get(device, 0) if reserve_bytes is None else reserve_bytes

    base = (
        (f"weights ({quant_name or dtype}{f', 1/{tp_size} per GPU' if tp_size > 1 else ''})",
         weight_bytes(shape, dtype, quant_name) // tp_size),
        (f"{RESERVE_LABEL} ({reserve_what(device)})", reserve),
    )
    cache_label = cache_change.label() if cache_change else "dynamic"
    prefill_tokens = batch_size * input_tokens
    if cb and cb.params.get("max_batch_tokens"):
        prefill_tokens = min(prefill_tokens, int(cb.params["max_batch_tokens"]))
    logits = logits_bytes(shape, batch_size, dtype)

    def kv(tokens: int, sequences: int) -> CacheEstimate:
        return cache_estimate(shape, cache_change, tokens, sequences, dtype)

    kv_input = kv(input_tokens, batch_size)
    scratch = attention_scratch_bytes(shape, backend, input_tokens, batch_size, dtype) // tp_size
    stages = [
        StageEstimate("load", base),
        StageEstimate("long-input", base + (
            (f"KV cache of the input, {batch_size} x {input_tokens} tokens ({cache_label})",
             kv_input.device_bytes // tp_size),
            (f"attention scratch of one layer ({backend})", scratch),
            ("prefill activations of one layer and logits",
             (activation_bytes(shape, prefill_tokens, dtype) + logits) // tp_size),
        ), kv_input.host_bytes),
    ]
    total_tokens = input_tokens + max_new_tokens
    kv_full = kv(total_tokens, batch_size)
    decode = (activation_bytes(shape, batch_size, dtype) + logits) // tp_size
    stages.append(StageEstimate("long-generation", base + (
        (f"KV cache at {total_tokens} tokens x {batch_size} sequences ({cache_label})",
         kv_full.device_bytes // tp_size),
        ("decode activations and logits", decode),
    ), kv_full.host_bytes))
    if concurrency > 1:
        # Continuous batching queues the requests that do not fit; without it all are in flight.
        sequences = batch_size if cb else batch_size * concurrency
        kv_all = kv(total_tokens, sequences)
        label = (f"KV cache of the requests in flight ({cache_label}; the rest queue)" if cb else
                 f"KV cache of {concurrency} concurrent requests x {batch_size} sequences at {total_tokens} tokens")
        stages.append(StageEstimate("concurrency", base + (
            (label, kv_all.device_bytes // tp_size),
            ("decode activations and logits of every request", decode * (sequences // batch_size)),
        ), kv_all.host_bytes))
    return stages
