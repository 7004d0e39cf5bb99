"""Conftest sources of the census tests: a user's technique that changes what a generate call runs, switched on by
a Python condition evaluated in the process that runs it (an environment variable, or the A/B reference's worker)."""

from __future__ import annotations

# tiny-random-llama has two decoder layers: one more matmul each, in every decode step
MATMUL_CHANGE = "aten::matmul +2 per step (0 -> 2)"


def extra_matmul_conftest(switch: str) -> str:
    """``sdpa_plus``: sdpa attention and, where ``switch`` is true, one more ``torch.matmul`` in every decoder layer's
    forward (as a transformers release that adds an op per layer would). The identity it multiplies by is made
    before the generate call, so the census's only change is the matmul."""
    return f'''
import contextlib, os, sys
import pytest
import torch
from pytest_transformers_opt.techniques.attention import Sdpa


class SdpaPlus(Sdpa):
    name = "sdpa_plus"
    implementation = "sdpa"
    summary = "sdpa, and where switched on one more matmul per decoder layer"

    @contextlib.contextmanager
    def around_generate(self, model):
        if not ({switch}):
            yield
            return
        identity = torch.eye(model.config.hidden_size, dtype=model.dtype, device=model.device)

        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            same = torch.matmul(hidden, identity)
            return (same, *output[1:]) if isinstance(output, tuple) else same

        handles = [layer.register_forward_hook(hook) for layer in model.model.layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


@pytest.hookimpl(optionalhook=True)
def pytest_opt_register_techniques(registry):
    registry.register(SdpaPlus)
'''


def item_hook_conftest(switch: str) -> str:
    """``compile_with_hook``: the compile technique on a model whose first attention has, where ``switch`` is true, a
    forward hook calling ``.item()``: dynamo cannot trace it and breaks the compiled forward there."""
    return f'''
import os
import pytest
from pytest_transformers_opt.techniques.compilation import Compile


class CompileWithHook(Compile):
    name = "compile_with_hook"
    load_time = True  # after_load runs for a technique that is part of the loaded model

    def after_load(self, model):
        if not ({switch}):
            return

        def read_a_number(module, args, output):
            (output[0] if isinstance(output, tuple) else output).sum().item()

        model.model.layers[0].self_attn.register_forward_hook(read_a_number)


@pytest.hookimpl(optionalhook=True)
def pytest_opt_register_techniques(registry):
    registry.register(CompileWithHook)
'''
