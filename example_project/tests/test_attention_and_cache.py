"""Attention backends and KV-cache techniques, each with budgets."""

import pytest

from pytest_transformers_opt import techniques


@pytest.mark.optimization("sdpa", max_kl=1e-3, max_memory="256 MiB")
def test_sdpa_matches_eager(opt_bench):
    result = opt_bench()
    assert result.similarity.token_match == 1.0


@pytest.mark.optimization("static_cache", "sdpa", max_kl=0.01)
def test_static_cache_with_sdpa(opt_bench):
    result = opt_bench()
    assert result.optimized.tokens_generated > 0


@pytest.mark.optimization(techniques.quantized_cache(backend="quanto", nbits=4), max_kl=0.1)
def test_quantized_kv_cache(opt_bench):
    opt_bench(max_new_tokens=48)


@pytest.mark.optimization("flash_attention_2", max_kl=0.01)
def test_flash_attention_2(opt_bench):
    """Skips with its reason on CPU; --opt-require=flash_attention_2 on the GPU runner makes that a failure."""
    opt_bench()
