import pytest

@pytest.mark.optimization("compile")
def test_compile_tiny(opt_bench):
    opt_bench(max_new_tokens=8)
