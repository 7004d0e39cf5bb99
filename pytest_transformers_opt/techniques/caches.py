"""KV caches: static, sliding window, offloaded, offloaded static and quantized."""

from __future__ import annotations

from typing import Any, ClassVar

from ..compat import attention_layer_types, layer_kinds_outside, module_available
from ..errors import OptConfigError
from .base import (
    DOCS,
    LOSSY_4BIT,
    WEIGHTS_8BIT,
    GenerationSettings,
    ProbeContext,
    RunEvidence,
    Technique,
    census_compiled,
    census_decode_steps,
    census_ops,
)

STATIC_WRITES = ("aten::index_copy_", "aten::roll")
"""How a static cache layer takes a decode step's keys and values, in place (transformers' StaticLayer and
StaticSlidingWindowLayer): ``index_copy_`` at the step's position, or, once a sliding window is full, ``roll`` and
a copy. A dynamic cache runs neither (measured on the eight built-in models: none in any decode step of theirs):
it grows by ``aten::cat``."""


def static_writes_problem(census: dict[str, Any], label: str) -> str | None:
    """Why the census shows no static cache in the decode steps (a fallback to a dynamic cache), or None. Not read
    for a compiled configuration (inductor fuses the write into its own code) or without marked decode steps."""
    steps = census_decode_steps(census)
    if not steps or census_compiled(census):
        return None
    if census_ops(census, STATIC_WRITES, per_step=True):
        return None
    cats = (census.get("ops_per_step") or {}).get("aten::cat", 0)
    return (f"{label} was requested but the census's {steps} decode steps wrote no static cache in place (no "
            f"aten::index_copy_ or aten::roll; aten::cat x{cats:g} per step): the cache grew as a dynamic one")


class CacheTechnique(Technique):
    family = "caching"
    exclusive_group = "KV cache"
    cache_implementation: ClassVar[str] = ""
    compileable: ClassVar[bool] = True  # False: a cache whose shapes change, which torch.compile cannot take
    docs = f"{DOCS}/kv_cache"
    docs_title = "Cache strategies"
    overview_section = "Caching"

    def configure_generation(self, gen: GenerationSettings, ctx: ProbeContext) -> None:
        gen.kwargs["cache_implementation"] = self.cache_implementation
        if self.compileable:
            # On CUDA transformers compiles the forward by itself when the cache is compileable (static,
            # sliding window, offloaded static); keep the two effects apart so that a cache technique measures
            # the cache and `compile` (which sets disable_compile=False) measures compilation. Seen on an H200
            # (torch 2.11, transformers 5.17): offloaded_static_cache, compiled unasked, crashed the interpreter.
            gen.kwargs.setdefault("disable_compile", True)

    def cache_layers(self, evidence: RunEvidence) -> list[str]:
        layers = getattr(evidence.cache, "layers", None) or []
        return [type(layer).__name__ for layer in layers]


class StaticCacheTechnique(CacheTechnique):
    name = "static_cache"
    cache_implementation = "static"
    summary = "a pre-allocated, fixed-size KV cache (cache_implementation='static'), not compiled"

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        layers = self.cache_layers(evidence)
        if not layers or not all(name.startswith("Static") for name in layers):
            return f"static_cache was requested but generation used {type(evidence.cache).__name__} with layers {sorted(set(layers))}"
        return None

    def verify_census(self, census: dict[str, Any]) -> str | None:
        return static_writes_problem(census, self.label())


class SlidingWindowCache(CacheTechnique):
    name = "sliding_window_cache"
    cache_implementation = "static"
    summary = "a static cache whose sliding-window layers keep only the last window of tokens"
    requirement = "a model config with sliding_window set (e.g. Mistral, Qwen3 with use_sliding_window)"

    def probe(self, ctx: ProbeContext) -> str | None:
        if ctx.model_config is None:  # catalogue listing: depends on the model
            return None
        window = getattr(ctx.model_config, "sliding_window", None)
        arch = getattr(ctx.model_config, "model_type", "unknown")
        if not window:
            return f"sliding_window_cache needs a model with sliding-window attention (config.sliding_window); found: {arch} without one"
        kinds = attention_layer_types(ctx.model_config) or []
        if kinds and "sliding_attention" not in kinds:  # a window set, but layer_types gives it to no layer
            return (f"sliding_window_cache needs a model with sliding-window attention layers; found: {arch} "
                    f"with config.sliding_window={window} but layer_types {sorted(set(kinds))}")
        return None

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        layers = self.cache_layers(evidence)
        if not any("SlidingWindow" in name for name in layers):
            return f"sliding_window_cache was requested but no sliding-window cache layer was used; found: {sorted(set(layers))}"
        return None

    def verify_census(self, census: dict[str, Any]) -> str | None:
        return static_writes_problem(census, self.label())


class OffloadedCacheTechnique(CacheTechnique):
    name = "offloaded_cache"
    cache_implementation = "offloaded"
    compileable = False
    summary = "a dynamic KV cache offloaded to CPU memory, one layer on the GPU at a time"
    requirement = "a CUDA GPU (the cache is offloaded from GPU to CPU memory)"

    def probe(self, ctx: ProbeContext) -> str | None:
        if not ctx.hardware.is_cuda:
            return f"{self.name} needs a CUDA GPU to offload the cache from; found: {ctx.hardware.describe()}"
        return None

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if not getattr(evidence.cache, "offloading", False):
            return f"{self.name} was requested but the cache used ({type(evidence.cache).__name__}) is not offloading"
        return None


class OffloadedStaticCache(OffloadedCacheTechnique):
    name = "offloaded_static_cache"
    cache_implementation = "offloaded_static"
    compileable = True
    summary = "a static KV cache offloaded to CPU memory, not compiled"


class QuantizedCacheTechnique(CacheTechnique):
    name = "quantized_cache"
    cache_implementation = "quantized"
    compileable = False
    quality = WEIGHTS_8BIT  # at nbits >= 4; fewer bits are set to LOSSY_4BIT below
    summary = "a KV cache quantized to nbits (quanto or hqq backend)"
    requirement = "optimum-quanto (backend='quanto') or hqq (backend='hqq')"
    accepted_params = {"backend": "'quanto' or 'hqq'", "nbits": "2 or 4 (quanto), 1-8 (hqq)",
                       "residual_length": "recent tokens kept unquantized (int)"}
    backends: ClassVar[dict[str, tuple[str, str]]] = {"quanto": ("optimum.quanto", "optimum-quanto"),
                                                      "hqq": ("hqq", "hqq")}

    def __init__(self, **params: Any) -> None:
        params.setdefault("backend", "quanto")
        params.setdefault("nbits", 4)
        super().__init__(**params)
        backend, nbits = params["backend"], params["nbits"]
        if backend not in self.backends:
            raise OptConfigError(f"quantized_cache: backend {backend!r} is not supported; accepted: 'quanto', 'hqq'")
        allowed = (2, 4) if backend == "quanto" else tuple(range(1, 9))
        if isinstance(nbits, bool) or not isinstance(nbits, int) or nbits not in allowed:
            raise OptConfigError(f"quantized_cache: nbits={nbits!r} is not accepted for backend {backend!r}; accepted: {allowed}")
        if nbits < 4:  # quanto 2-bit on smollm2-135m: KL 0.72-0.95, top-1 0.60-0.68 (benchmarks/RESULTS.md)
            self.quality = LOSSY_4BIT

    def probe(self, ctx: ProbeContext) -> str | None:
        module, package = self.backends[self.params["backend"]]
        if not module_available(module):
            return f"{self.label()} needs the {package} package; found: not installed"
        # transformers' QuantizedCache refuses every layer kind but full attention (Gemma 3, GPT-OSS and
        # Mistral's sliding windows): unsupported here, known from the config before anything loads
        others = layer_kinds_outside(ctx.model_config, {"full_attention"})
        if others:
            return f"{self.label()} needs a model whose layers all use full attention (transformers' QuantizedCache); found: {others}"
        return None

    def configure_generation(self, gen: GenerationSettings, ctx: ProbeContext) -> None:
        gen.kwargs["cache_implementation"] = "quantized"
        gen.kwargs["cache_config"] = {"backend": self.params["backend"], "nbits": self.params["nbits"],
                                      **({"residual_length": self.params["residual_length"]}
                                         if "residual_length" in self.params else {})}

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        layers = self.cache_layers(evidence)
        expected = "Quanto" if self.params["backend"] == "quanto" else "HQQ"
        if not layers or not all(expected in name for name in layers):
            return f"{self.label()} was requested but the cache layers were {sorted(set(layers))}"
        return None
