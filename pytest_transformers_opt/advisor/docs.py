"""What supports each recommendation: documentation, expected tradeoffs, default budgets.

References cite the sections of the Transformers page "Inference optimization overview" (the
advice protocol this advisor implements) and the APIs and guides that page names.
"""

from __future__ import annotations

from typing import Any

from ..verdict.budgets import default_similarity as plugin_default_similarity
from ..verdict.budgets import worst_quality
from ..techniques.base import LOSSLESS
from ..techniques.catalogue import BUILTIN_TECHNIQUES
from ..techniques.serving import CB_BLOCK_MARGIN
from .change import Change, find

OVERVIEW = "Transformers docs: Inference optimization overview"
PROTOCOL = f"{OVERVIEW} (how to choose an optimization: find the stage, one change at a time)"
HARDWARE = "Transformers docs: Hardware guides (check which techniques your hardware supports)"

_DOCS: dict[str, list[str]] = {
    "weights": [f"{OVERVIEW} > Quantization",
                "Transformers docs: Quantization > bitsandbytes "
                "(BitsAndBytesConfig, quantization_config in from_pretrained())"],
    "cache": [f"{OVERVIEW} > Caching",
              "Transformers docs: Caching / KV cache strategies (cache_implementation in generate())"],
    "attention": [f"{OVERVIEW} > Attention backends",
                  "Transformers docs: Attention backends (attn_implementation in from_pretrained())"],
    "kernels": [f"{OVERVIEW} > Kernels", "Kernels library (use_kernels=True, hub kernels)"],
    "compile": [f"{OVERVIEW} > Compilation",
                "Transformers docs: torch.compile (a static cache in generate() triggers compilation)"],
    "continuous_batching": [f"{OVERVIEW} > Continuous batching",
                            "Transformers docs: Continuous batching (generate_batch(), ContinuousBatchingConfig)"],
    "tensor_parallel": [f"{OVERVIEW} > Parallelism",
                        "Transformers docs: Tensor parallelism (DistributedConfig(tp_size=N), launched with torchrun)"],
}


def documentation_for(change: Change | None) -> list[str]:
    """The documentation that supports ``change``, then the protocol and the hardware guides."""
    refs = list(_DOCS.get(change.family, [OVERVIEW])) if change else []
    return refs + [PROTOCOL, HARDWARE]


_TRADEOFFS: dict[str, list[str]] = {
    "bnb_8bit": [
        "Output quality: small drift from the bf16/fp16 model ({defaults}).",
        "Speed: LLM.int8 matmuls decompose outliers and are often slower than half precision; "
        "latency may rise.",
        "Weight quantization is separate from KV-cache quantization: the KV cache stays as it is.",
    ],
    "bnb_4bit": [
        "Output quality: larger drift than 8-bit ({defaults}).",
        "Speed: weights are dequantized at every matmul; memory-bound decoding can gain, "
        "compute-bound prefill usually loses.",
        "Weight quantization is separate from KV-cache quantization: the KV cache stays as it is.",
    ],
    "quantized_cache": [
        "Output quality: keys and values lose precision, so long generations drift "
        "({defaults}).",
        "Speed: every decoding step quantizes and dequantizes the cache, so it is slower than "
        "a full-precision cache.",
        "Needs the quantization backend package (optimum-quanto for backend=\"quanto\").",
        "KV-cache quantization is separate from weight quantization: the weights stay as they are.",
    ],
    "offloaded_cache": [
        "Output: unchanged (lossless); the whole cache moves to CPU RAM instead.",
        "Speed: each layer's keys and values cross the CPU-GPU link at every step, so decoding slows.",
    ],
    "offloaded_static_cache": [
        "Output: unchanged (lossless); the pre-allocated cache lives in CPU RAM.",
        "Speed: transfers at every step slow decoding; the static shape still allows compilation.",
    ],
    "static_cache": [
        "Memory: the cache is allocated for the maximum length up front, even for short requests.",
    ],
    "sliding_window_cache": [
        "Output: exact only for models trained with that sliding window; tokens older than the "
        "window are no longer attended.",
    ],
    "sdpa": [
        "Output: lossless up to floating-point differences between kernels.",
        "Memory: no input x input score matrix; speed: usually faster than eager.",
        "With padded batches some devices fall back to a kernel that materializes the scores.",
    ],
    "flash_attention_2": [
        "Output: lossless up to floating-point differences; needs fp16 or bf16.",
        "Needs the flash-attn package and a GPU of compute capability >= 8.0.",
    ],
    "flash_attention_3": ["Output: lossless up to floating-point differences; needs a Hopper GPU (>= 9.0)."],
    "compile": [
        "Warm-up: the first call compiles (seconds to minutes; reported as compile_time_s).",
        "Memory: the static cache is allocated for input + max_new_tokens up front.",
        "Shapes that change (other input lengths, batch sizes) trigger recompilation; pad to fixed lengths.",
    ],
    "continuous_batching": [
        "Throughput rises under concurrent load; a single request's latency may rise while others share the GPU.",
        "Memory: the paged KV cache is preallocated up front, sized for the workload's requests and lengths (with a "
        f"{CB_BLOCK_MARGIN - 1:.0%} margin) unless you give num_blocks; in production size it for your peak concurrency.",
        "Code change: requests go through generate_batch() instead of generate().",
    ],
    "tensor_parallel": [
        "Needs N GPUs and a launch with torchrun; communication between them costs time.",
        "Total memory across GPUs rises (sharding overhead), while each GPU holds 1/N of the weights.",
    ],
    "kernels": ["Output: lossless up to floating-point differences; needs the kernels library and Hub access "
                "(or a local kernel cache)."],
}


def tradeoffs_for(change: Change | None) -> list[str]:
    if change is None:
        return []
    defaults = ", ".join(f"{name}={limit:g}" for name, limit in default_similarity([change], "bfloat16").items())
    lines = _TRADEOFFS.get(change.name, [f"{change.name}: measure quality, memory and speed."])
    return [line.replace("{defaults}", f"default budgets {defaults}") for line in lines]


# Budgets read from per-step distributions (similarity.kl_mean / top1): continuous batching returns tokens
# only, so a test of it that asks for one of these fails "not measured in this run".
DISTRIBUTION_BUDGETS = ("max_kl", "min_top1")
_TECHNIQUES = {technique.name: technique for technique in BUILTIN_TECHNIQUES}


def _quality(change: Change) -> str:
    """The catalogue's similarity class of ``change``, with its parameters (a quantized cache's nbits)."""
    technique = _TECHNIQUES.get(change.name)
    if technique is None:
        return LOSSLESS
    try:
        return technique(**change.params).quality
    except Exception:  # parameters the catalogue refuses: the class's own
        return technique.quality


def measures_distributions(stack: list[Change]) -> bool:
    """Whether the plugin compares next-token distributions for ``stack`` (as its session's plan decides)."""
    return find(stack, "continuous_batching") is None


def measurable(stack: list[Change], budgets: dict[str, Any]) -> dict[str, Any]:
    """``budgets`` less those a test of ``stack`` cannot measure."""
    if measures_distributions(stack):
        return dict(budgets)
    return {name: value for name, value in budgets.items() if name not in DISTRIBUTION_BUDGETS}


def default_similarity(stack: list[Change], dtype: str) -> dict[str, float]:
    """The plugin's own default similarity budgets for a stack (budgets.default_similarity, from the
    catalogue's quality of each technique): what the plugin would check with no budget given."""
    quality = worst_quality([_quality(change) for change in stack])
    return plugin_default_similarity(quality, dtype, measures_distributions(stack))
