"""A cache technique measures the cache, `compile` measures compilation: on CUDA transformers compiles the
forward by itself when the cache is compileable, so every compileable cache switches that off unless
`compile` is stacked. Found on an H200 (torch 2.11, transformers 5.17): offloaded_static_cache, compiled
unasked, crashed the interpreter (benchmarks/RESULTS.md, device check of 2026-12-04)."""

from __future__ import annotations

import itertools

import pytest

from pytest_transformers_opt.engine.hardware import HardwareInfo
from pytest_transformers_opt.techniques import ProbeContext, TechniqueSpec, build_registry
from pytest_transformers_opt.techniques.base import GenerationSettings
from pytest_transformers_opt.techniques.caches import CacheTechnique

REGISTRY = build_registry()
CACHES = [cls.name for cls in REGISTRY.classes() if issubclass(cls, CacheTechnique)]
COMPILEABLE = [cls.name for cls in REGISTRY.classes() if issubclass(cls, CacheTechnique) and cls.compileable]


def configure(*names: str) -> dict[str, object]:
    """generate()'s keyword arguments of a stack, configured in the given order, as the session does."""
    ctx = ProbeContext(hardware=HardwareInfo(), model_config=None, dtype="bfloat16")
    generation = GenerationSettings()
    for name in names:
        REGISTRY.resolve(TechniqueSpec.of(name)).configure_generation(generation, ctx)
    return generation.kwargs


def test_the_catalogue_has_the_static_caches_that_transformers_compiles():
    assert {"static_cache", "offloaded_static_cache", "sliding_window_cache"} <= set(COMPILEABLE)
    assert {"offloaded_cache", "quantized_cache"} <= set(CACHES) - set(COMPILEABLE)


@pytest.mark.parametrize("name", COMPILEABLE)
def test_a_compileable_cache_alone_is_not_compiled(name):
    kwargs = configure(name)
    assert kwargs["disable_compile"] is True
    assert "compile_config" not in kwargs


@pytest.mark.parametrize("order", [list(p) for name in COMPILEABLE for p in itertools.permutations([name, "compile"])],
                         ids=lambda order: "+".join(order))
def test_compile_stacked_on_a_cache_compiles_it_in_either_order(order):
    cache = next(name for name in order if name != "compile")
    kwargs = configure(*order)
    assert kwargs["disable_compile"] is False
    assert kwargs["cache_implementation"] == REGISTRY.resolve(TechniqueSpec.of(cache)).cache_implementation
