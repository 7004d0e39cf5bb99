"""Decode efficiency: how close one decode step comes to the device's memory bandwidth.

At the batch sizes where decoding is memory-bound, one step reads every weight once plus the KV
cache so far; bytes read / TPOT is the bandwidth the step achieved, and that over the device's peak
bandwidth says how much headroom a faster kernel or a smaller format could still win. The byte
count is a model of the step, not a measurement, so every figure here is reported as an estimate
(the report's ``estimates``), never next to measured ones.
"""

from __future__ import annotations

from typing import Any

from .results import Workload


def weight_bytes_read_per_step(model: Any) -> int:
    """Bytes of the weights one decode step reads: every parameter in its stored format (a 4-bit
    packed tensor counts its packed bytes), except an input embedding table that is not tied to the
    output head (a step gathers only a few of its rows)."""
    total: int = sum(p.numel() * p.element_size() for p in model.parameters())
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is getattr(embeddings, "weight", object())
    if embeddings is not None and not tied:
        total -= sum(p.numel() * p.element_size() for p in embeddings.parameters())
    return total


def kv_bytes_read_per_step(config: Any, *, batch_size: int, context_tokens: float, element_bytes: float) -> int:
    """Keys and values of every layer over ``context_tokens`` positions (capped by a sliding window)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    # 0 stands for "not set" (as None would): the `or` falls through to GPT-2's name or the default
    layers: int = getattr(text_config, "num_hidden_layers", 0) or getattr(text_config, "n_layer", 0)
    heads: int = getattr(text_config, "num_attention_heads", 0) or getattr(text_config, "n_head", 1)
    kv_heads: int = getattr(text_config, "num_key_value_heads", 0) or heads
    hidden: int = getattr(text_config, "hidden_size", 0) or getattr(text_config, "n_embd", 0)
    head_dim: int = getattr(text_config, "head_dim", 0) or hidden // heads
    window = getattr(text_config, "sliding_window", None)
    if isinstance(window, int) and window > 0:
        context_tokens = min(context_tokens, window)
    return int(2 * layers * kv_heads * head_dim * element_bytes * context_tokens * batch_size)


def decode_estimates(model: Any, workload: Workload, tpot_s: float | None, peak_bandwidth_bytes_s: float | None,
                     kv_bits: int | None = None) -> dict[str, float]:
    """``decode_bytes_per_step``, ``decode_bandwidth_bytes_s`` and, with a known peak,
    ``decode_bandwidth_fraction_of_peak`` (achieved over peak). Empty when TPOT was not measured."""
    if not tpot_s or tpot_s <= 0 or not hasattr(model, "parameters"):
        return {}
    dtype = getattr(model, "dtype", None)
    element_bytes = float(dtype.itemsize) if dtype is not None and hasattr(dtype, "itemsize") else 2.0
    if kv_bits:
        element_bytes = kv_bits / 8  # a quantized cache stores nbits per value (scales are ignored)
    # the average decode step sees the prompt plus half of the tokens it generates
    context = workload.input_tokens + (workload.max_new_tokens - 1) / 2
    step_bytes = weight_bytes_read_per_step(model) + kv_bytes_read_per_step(
        model.config, batch_size=workload.batch_size, context_tokens=context, element_bytes=element_bytes)
    achieved = step_bytes / tpot_s
    estimates = {"decode_bytes_per_step": float(step_bytes), "decode_bandwidth_bytes_s": achieved}
    if peak_bandwidth_bytes_s:
        estimates["decode_bandwidth_fraction_of_peak"] = achieved / peak_bandwidth_bytes_s
    return estimates
