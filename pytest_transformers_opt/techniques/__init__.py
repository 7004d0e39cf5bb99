"""Techniques by catalogue name: ``techniques.quantized_cache(backend="quanto", nbits=4)``.

Every function returns an inert ``TechniqueSpec``; parameters are checked when a test sets up, so a
bad one is that test's error and never breaks collection.
"""

from __future__ import annotations

import os
from typing import Any

from .base import (
    GenerationSettings,
    LoadSettings,
    ProbeContext,
    RunEvidence,
    Technique,
    TechniqueRegistry,
    TechniqueSpec,
    check_stack,
)

__all__ = [
    "Technique", "TechniqueSpec", "TechniqueRegistry", "ProbeContext", "LoadSettings", "GenerationSettings",
    "RunEvidence", "build_registry", "check_stack", "eager", "sdpa", "flex_attention", "flash_attention_2",
    "flash_attention_3", "hub_kernel", "kernels", "compile", "static_cache", "offloaded_cache",
    "offloaded_static_cache", "quantized_cache", "sliding_window_cache", "bnb_8bit", "bnb_4bit", "torchao_int8",
    "quanto_int8", "hqq_4bit", "tensor_parallel", "continuous_batching", "experts",
    "assisted_decoding", "prompt_lookup",
]


def build_registry() -> TechniqueRegistry:
    """A registry holding the built-in catalogue (the plugin then lets conftests add theirs)."""
    from .catalogue import BUILTIN_TECHNIQUES  # on first use: the plugin's start-up imports only base

    registry = TechniqueRegistry()
    for technique_class in BUILTIN_TECHNIQUES:
        registry.register(technique_class, origin="built-in")
    return registry


def eager() -> TechniqueSpec:
    return TechniqueSpec.of("eager")


def sdpa() -> TechniqueSpec:
    return TechniqueSpec.of("sdpa")


def flex_attention() -> TechniqueSpec:
    return TechniqueSpec.of("flex_attention")


def flash_attention_2() -> TechniqueSpec:
    return TechniqueSpec.of("flash_attention_2")


def flash_attention_3() -> TechniqueSpec:
    return TechniqueSpec.of("flash_attention_3")


def hub_kernel(repo_id: str) -> TechniqueSpec:
    """An attention kernel from the Hub; the same as writing the id itself in the marker."""
    return TechniqueSpec.of(repo_id)


def kernels(local: Any = None, layers: Any = None) -> TechniqueSpec:
    """Hub layer kernels (``use_kernels=True``); with ``local`` (a kernel repository folder) the layers named in
    ``layers`` ({transformers layer name: class in the kernel's ``layers`` module}) from that local build."""
    params: dict[str, Any] = {}
    if local is not None:
        params["local"] = os.fspath(local) if isinstance(local, os.PathLike) else local
    if layers is not None:
        params["layers"] = layers
    return TechniqueSpec.of("kernels", **params)


def compile(**options: Any) -> TechniqueSpec:  # noqa: A001 - the catalogue name is fixed
    """Static cache + torch.compile; ``options`` go to ``transformers.CompileConfig`` (mode, fullgraph, dynamic)."""
    return TechniqueSpec.of("compile", **options)


def static_cache() -> TechniqueSpec:
    return TechniqueSpec.of("static_cache")


def offloaded_cache() -> TechniqueSpec:
    return TechniqueSpec.of("offloaded_cache")


def offloaded_static_cache() -> TechniqueSpec:
    return TechniqueSpec.of("offloaded_static_cache")


def quantized_cache(backend: str = "quanto", nbits: int = 4, **extra: Any) -> TechniqueSpec:
    """A quantized KV cache: ``backend`` 'quanto' (nbits 2 or 4) or 'hqq' (nbits 1-8)."""
    return TechniqueSpec.of("quantized_cache", backend=backend, nbits=nbits, **extra)


def sliding_window_cache() -> TechniqueSpec:
    return TechniqueSpec.of("sliding_window_cache")


def bnb_8bit() -> TechniqueSpec:
    return TechniqueSpec.of("bnb_8bit")


def bnb_4bit(quant_type: str = "nf4", compute_dtype: Any = None, **extra: Any) -> TechniqueSpec:
    """4-bit bitsandbytes weights; ``compute_dtype`` defaults to the model's dtype."""
    params: dict[str, Any] = {"quant_type": quant_type, **extra}
    if compute_dtype is not None:
        params["compute_dtype"] = str(compute_dtype).removeprefix("torch.")
    return TechniqueSpec.of("bnb_4bit", **params)


def torchao_int8() -> TechniqueSpec:
    return TechniqueSpec.of("torchao_int8")


def quanto_int8() -> TechniqueSpec:
    return TechniqueSpec.of("quanto_int8")


def hqq_4bit() -> TechniqueSpec:
    return TechniqueSpec.of("hqq_4bit")


def tensor_parallel(tp_size: int = 2) -> TechniqueSpec:
    return TechniqueSpec.of("tensor_parallel", tp_size=tp_size)


def continuous_batching(max_batch_tokens: int | None = None, **config: Any) -> TechniqueSpec:
    """``generate_batch()``; ``config`` goes to ``ContinuousBatchingConfig`` (num_blocks, page_size,
    max_memory_percent, max_requests_per_batch). ``max_batch_tokens`` and ``num_blocks`` not given are
    derived from the workload (``size_continuous_batching``); given ones win."""
    if max_batch_tokens is not None:
        config["max_batch_tokens"] = max_batch_tokens
    return TechniqueSpec.of("continuous_batching", **config)


def experts(implementation: str) -> TechniqueSpec:
    """The MoE experts forward, transformers' ``experts_implementation``: 'eager', 'batched_mm' or 'grouped_mm'
    (the baseline runs 'eager')."""
    return TechniqueSpec.of("experts", implementation=implementation)


def assisted_decoding(assistant: Any, num_assistant_tokens: int | None = None) -> TechniqueSpec:
    """Speculative decoding with a draft model (``assistant_model``): a built-in model name or a model folder
    that shares the model's tokenizer; ``num_assistant_tokens`` draft tokens per step (default: the draft's
    generation config). Loaded with the model: its load time and memory count on the optimized side."""
    params: dict[str, Any] = {"assistant": os.fspath(assistant) if isinstance(assistant, os.PathLike) else assistant}
    if num_assistant_tokens is not None:
        params["num_assistant_tokens"] = num_assistant_tokens
    return TechniqueSpec.of("assisted_decoding", **params)


def prompt_lookup(num_tokens: int = 10, max_matching_ngram_size: int | None = None) -> TechniqueSpec:
    """Prompt lookup decoding (``prompt_lookup_num_tokens``): candidates from n-grams of the prompt, verified by
    the model; ``max_matching_ngram_size`` defaults to transformers' 2."""
    params: dict[str, Any] = {"num_tokens": num_tokens}
    if max_matching_ngram_size is not None:
        params["max_matching_ngram_size"] = max_matching_ngram_size
    return TechniqueSpec.of("prompt_lookup", **params)
