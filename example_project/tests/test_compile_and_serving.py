"""Compilation, continuous batching, parallelism, and a project technique."""

import pytest

from pytest_transformers_opt import techniques


@pytest.mark.optimization("compile", max_recompiles=0)
def test_compiled_static_cache(opt_bench):
    result = opt_bench()
    assert result.optimized.compile_time_s is not None


# num_blocks / max_batch_tokens are derived from the prompts and max_new_tokens (the report's notes give them)
@pytest.mark.optimization("continuous_batching", min_token_match=1.0)
def test_continuous_batching(opt_bench):
    opt_bench(prompts=["The cat sees", "Name the capital of France.", "A dog eats", "Our team builds"])


@pytest.mark.optimization(techniques.tensor_parallel(tp_size=2))
def test_tensor_parallel(opt_bench):
    opt_bench()


@pytest.mark.opt_baseline("sdpa")
@pytest.mark.optimization("no_repeat_trigrams", min_token_match=0.0, max_kl=10.0)
def test_project_technique(opt_bench):
    result = opt_bench(max_new_tokens=32)
    assert result.optimized.tokens_generated == 3 * 32
