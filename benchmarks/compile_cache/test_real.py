import pytest

PROMPTS = ["The capital of France is", "Water boils at a temperature of"]

@pytest.mark.opt_model("smollm2-135m")
@pytest.mark.optimization("compile")
def test_compile_smollm2(opt_bench):
    opt_bench(PROMPTS, max_new_tokens=8)
