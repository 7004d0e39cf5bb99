"""Weight quantization: memory against quality."""

import pytest

from pytest_transformers_opt import techniques


@pytest.mark.optimization("bnb_8bit", max_kl=0.01, min_top1=0.95)
def test_8bit_weights(opt_bench):
    opt_bench(max_new_tokens=16)


@pytest.mark.optimization(techniques.bnb_4bit(quant_type="nf4"), max_memory="6 GiB", max_kl=0.1)
def test_4bit_fits_a_small_card(opt_bench):
    opt_bench(prompts=["Explain gravity in one sentence."], max_new_tokens=16)
