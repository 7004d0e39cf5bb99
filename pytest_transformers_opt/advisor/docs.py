"""What supports each recommendation: documentation, expected tradeoffs, default budgets.

Every reference is cited by title and link, both read from the catalogue: the section of the
Transformers page "Inference optimization overview" (the advice protocol this advisor implements)
that covers the technique (``overview_section``), then the technique's own page (``docs_title``,
``docs``). Requirements come from the catalogue too, and default budgets from ``verdict.budgets``.
"""

from __future__ import annotations

from typing import Any

from ..techniques.base import LOSSLESS, Technique
from ..techniques.serving import CB_BLOCK_MARGIN
from ..verdict.budgets import default_similarity as plugin_default_similarity
from ..verdict.budgets import worst_quality
from .change import Change

OVERVIEW = "Transformers docs: Inference optimization overview"
OVERVIEW_URL = Technique.docs  # a technique without a page of its own points at the overview


def cite(title: str, url: str) -> str:
    """One reference as the user reads it: ``Title <https://...>``."""
    return f"{title} <{url}>"


def overview_section_url(section: str) -> str:
    """The overview page's anchor for ``section`` (``"Continuous batching"`` -> ``#continuous-batching``)."""
    return f"{OVERVIEW_URL}#{section.lower().replace(' ', '-')}"


PROTOCOL = cite(f"{OVERVIEW} (how to choose an optimization: find the stage, one change at a time)", OVERVIEW_URL)
HARDWARE = cite("Transformers docs: Hardware guides, linked from the overview's introduction (check which "
                "techniques your hardware supports)", OVERVIEW_URL)


def documentation_for(change: Change | None) -> list[str]:
    """The documentation that supports ``change``, then the protocol and the hardware guides."""
    if change is None:
        return [PROTOCOL, HARDWARE]
    technique = change.technique
    if technique is None:  # a name the catalogue does not know: the overview only
        return [cite(OVERVIEW, OVERVIEW_URL), PROTOCOL, HARDWARE]
    refs = []
    if technique.overview_section:
        refs.append(cite(f"{OVERVIEW} > {technique.overview_section}",
                         overview_section_url(technique.overview_section)))
    if technique.docs != OVERVIEW_URL:
        refs.append(cite(f"Transformers docs: {technique.docs_title or technique.name}", technique.docs))
    return (refs or [cite(OVERVIEW, OVERVIEW_URL)]) + [PROTOCOL, HARDWARE]


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
    "flash_attention_2": ["Output: lossless up to floating-point differences."],
    "flash_attention_3": ["Output: lossless up to floating-point differences."],
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
        "Speed: communication between the GPUs costs time at every layer.",
        "Total memory across GPUs rises (sharding overhead), while each GPU holds 1/N of the weights.",
    ],
    "kernels": ["Output: lossless up to floating-point differences."],
    "experts": [
        "Output: the same sums in another order, lossless up to floating-point differences ({defaults}); in "
        "half precision a router near a tie can send a token to another expert.",
        "Memory: batched_mm copies the selected experts' weights for every token, so it grows with batch and "
        "input length; grouped_mm and eager copy nothing.",
        "Speed (the Experts backends page): grouped_mm is the pick on CPU and for large inputs on a GPU, "
        "batched_mm for small inputs on a GPU; on CPU batched_mm is slower than eager.",
    ],
    "prompt_lookup": [
        "Output: unchanged under greedy decoding: the model keeps only proposed tokens it would have chosen "
        "itself ({defaults}).",
        "Speed: gains only where the output repeats n-grams of the prompt; rejected proposals widen each "
        "verification pass for nothing.",
        "One sequence per generate call: transformers runs speculative decoding at batch size 1 only.",
    ],
    "assisted_decoding": [
        "Output: unchanged under greedy decoding ({defaults}).",
        "Memory: the draft model's weights and KV cache sit next to the model's.",
        "Speed: set by the acceptance rate (reported); a draft that is too large or too unlike the model slows "
        "decoding down.",
        "One sequence per generate call: transformers runs speculative decoding at batch size 1 only.",
    ],
}


def tradeoffs_for(change: Change | None) -> list[str]:
    """What ``change`` costs, then what it needs (the catalogue's requirement)."""
    if change is None:
        return []
    defaults = ", ".join(f"{name}={limit:g}" for name, limit in default_similarity([change], "bfloat16").items())
    lines = _TRADEOFFS.get(change.name, [f"{change.name}: measure quality, memory and speed."])
    lines = [line.replace("{defaults}", f"default budgets {defaults}") for line in lines]
    technique = change.technique
    if technique is not None and technique.requirement != Technique.requirement:
        lines.append(f"Needs {technique.requirement}.")
    return lines


# Budgets read from per-step distributions (similarity.kl_mean / top1): a technique that compares tokens only
# (continuous batching) cannot meet one of these: its test fails "not measured in this run".
DISTRIBUTION_BUDGETS = ("max_kl", "min_top1")


def _quality(change: Change) -> str:
    """The catalogue's similarity class of ``change``, with its parameters (a quantized cache's nbits)."""
    technique = change.technique
    if technique is None:
        return LOSSLESS
    try:
        return technique(**change.params).quality
    except Exception:  # parameters the catalogue refuses: the class's own
        return technique.quality


def measures_distributions(stack: list[Change]) -> bool:
    """Whether the plugin compares next-token distributions for ``stack`` (as its test plan decides, from the
    catalogue's ``compares_tokens_only``)."""
    return not any(change.technique is not None and change.technique.compares_tokens_only for change in stack)


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
