"""Continuous batching (``generate_batch``), with its paged cache sized by the workload."""

from __future__ import annotations

import math
from typing import Any

from ..compat import continuous_batching_layer_kinds, layer_kinds_outside
from ..errors import OptConfigError
from .base import DOCS, GenerationSettings, ProbeContext, RunEvidence, Technique
from .caches import CacheTechnique

CB_BLOCK_MARGIN = 1.25  # headroom over the exact need: a scheduler that rounds up, a request that spills a block
CB_MAX_DERIVED_BATCH_TOKENS = 2048  # past it chunked prefill splits the prompts; the attention mask grows as its square


def size_continuous_batching(params: dict[str, Any], input_lengths: list[int], max_new_tokens: int,
                             page_size: int) -> tuple[dict[str, Any], dict[str, str]]:
    """``ContinuousBatchingConfig`` kwargs for this workload, and how each figure derived here was found.

    Rule: ``num_blocks = ceil(requests x ceil((max input tokens + max_new_tokens) / page_size) x 1.25)``
    (every request resident at once, as ``generate_batch()`` submits them all, plus a 25% margin), and
    ``max_batch_tokens = sum of the input lengths`` (every prompt prefills in one forward pass), at most
    2048. A value the user gives wins; ``max_memory_percent`` given without ``num_blocks`` keeps
    transformers' share-of-free-memory sizing. Without this, the paged cache takes a share of free
    memory (GiB for a 135M model), not what the workload needs.
    """
    config = dict(params)
    how: dict[str, str] = {}
    if input_lengths and "num_blocks" not in config and "max_memory_percent" not in config:
        longest, requests = max(input_lengths), len(input_lengths)
        per_request = math.ceil((longest + max_new_tokens) / page_size)
        config["num_blocks"] = math.ceil(requests * per_request * CB_BLOCK_MARGIN)
        how["num_blocks"] = (f"{requests} requests x {per_request} block(s) of {page_size} tokens for {longest} input + "
                             f"{max_new_tokens} new tokens x {CB_BLOCK_MARGIN} margin, rounded up")
    if input_lengths and "max_batch_tokens" not in config:
        config["max_batch_tokens"] = max(1, min(sum(input_lengths), CB_MAX_DERIVED_BATCH_TOKENS))
        how["max_batch_tokens"] = (f"the prompts' {sum(input_lengths)} input tokens, at most "
                                   f"{CB_MAX_DERIVED_BATCH_TOKENS}")
    return config, how


class ContinuousBatching(Technique):
    """``generate_batch()``. Unless given, ``num_blocks`` and ``max_batch_tokens`` are derived from the
    workload when it runs (:func:`size_continuous_batching`), and the report states them and the paged
    cache's preallocated bytes."""

    name = "continuous_batching"
    family = "continuous_batching"
    compares_tokens_only = True  # generate_batch() returns tokens, not the logits KL needs
    summary = "generate_batch() with dynamic scheduling and chunked prefill"
    requirement = "transformers with generate_batch and ContinuousBatchingConfig"
    accepted_params = {"max_batch_tokens": "tokens per forward pass, int > 0 (default: from the prompts)",
                       "num_blocks": "KV-cache blocks to allocate (bounds its memory), int > 0 (default: from the workload)",
                       "page_size": "tokens per cache block, int > 0",
                       "max_memory_percent": "share of free memory the cache may take, 0..1",
                       "max_requests_per_batch": "int > 0"}
    docs = f"{DOCS}/continuous_batching"
    docs_title = "Continuous batching"
    overview_section = "Continuous batching"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        for name in ("max_batch_tokens", "num_blocks", "page_size", "max_requests_per_batch"):
            value = self.params.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise OptConfigError(f"continuous_batching: {name}={value!r}; accepted: an int > 0")
        share = self.params.get("max_memory_percent", 0.5)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise OptConfigError(f"continuous_batching: max_memory_percent={share!r}; accepted: a number in (0, 1]")

    def probe(self, ctx: ProbeContext) -> str | None:
        try:
            from transformers.generation import ContinuousBatchingConfig  # noqa: F401
        except ImportError:
            return f"continuous_batching needs transformers with ContinuousBatchingConfig; found: transformers {ctx.hardware.version('transformers')}"
        supported = continuous_batching_layer_kinds()
        others = layer_kinds_outside(ctx.model_config, supported)
        if others:  # e.g. chunked or linear attention: its paged cache has no allocator for them
            return (f"continuous_batching needs a model whose layers are {' or '.join(sorted(supported))} (its paged "
                    f"cache has no other); found: {others}")
        return None

    def configure_generation(self, gen: GenerationSettings, ctx: ProbeContext) -> None:
        gen.continuous_batching = dict(self.params)

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if not evidence.used_generate_batch:
            return "continuous_batching was requested but generate_batch() was not used"
        if evidence.finished_requests != evidence.requested:
            return f"continuous_batching finished {evidence.finished_requests} of {evidence.requested} requests"
        return None

    def conflicts_with(self, other: Technique) -> str | None:
        if other.compiled:
            return "generate_batch() does not take the compile technique's static cache"
        if isinstance(other, CacheTechnique):
            return "continuous batching manages its own paged cache"
        return None
