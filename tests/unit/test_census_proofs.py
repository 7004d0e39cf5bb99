"""The techniques' proofs read from the execution census (issue 41, item 5): each catches its silent fallback by
counts, and passes a healthy census, on censuses made by ``census_from_events`` from crafted profiler events (the
op names are those the eight built-in tiny models run: tests/integration/test_matrix.py runs every proof on them)."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_transformers_opt.engine.census import CALL_MARK, GRAPH, MARK, OP, REGION, STEP_MARK, CensusEvent, census_from_events
from pytest_transformers_opt.techniques.attention import Eager, Sdpa
from pytest_transformers_opt.techniques.caches import SlidingWindowCache, StaticCacheTechnique
from pytest_transformers_opt.techniques.compilation import Compile

# every decode step's ops of a 2-layer Llama with an eager dynamic cache (the rest of a step left out)
DYNAMIC_EAGER_STEP = ("aten::linear", "aten::matmul", "aten::softmax", "aten::matmul", "aten::cat", "aten::cat") * 2
LAYER_SDPA = ("aten::linear", "aten::scaled_dot_product_attention")


def census(step_ops: tuple[str, ...], *, steps: int = 3, prefill: tuple[str, ...] = (), compiled_regions: int | None = None,
           continuous_batching: bool = False) -> dict[str, Any]:
    """The census of one generate call: ``prefill`` before the first step mark, ``step_ops`` in each decode step;
    ``compiled_regions``: a compiled configuration whose decode steps entered that many compiled regions."""
    events = [CensusEvent(CALL_MARK, MARK, 0.0, 10_000.0)]
    events += [CensusEvent(name, OP, 1.0 + n * 0.01) for n, name in enumerate(prefill)]
    for step in range(steps + 1):
        start = 100.0 * (step + 1)
        events.append(CensusEvent(STEP_MARK, MARK, start))
        if step < steps:
            events += [CensusEvent(name, OP, start + 1 + n * 0.01) for n, name in enumerate(step_ops)]
            if compiled_regions is not None and step < compiled_regions:
                events += [CensusEvent("Torch-Compiled Region: 0/0", REGION, start + 0.5),
                           CensusEvent("## Call CompiledFxGraph f1 ##", GRAPH, start + 0.6)]
    return census_from_events(events, cuda=False, compiled=compiled_regions is not None, recompiles=0,
                              steps_known=not continuous_batching)


def test_sdpa_passes_a_fused_attention_op_per_step_and_catches_attention_that_ran_eagerly() -> None:
    assert Sdpa().verify_census(census(LAYER_SDPA * 2, prefill=LAYER_SDPA * 2)) is None
    problem = Sdpa().verify_census(census(DYNAMIC_EAGER_STEP, prefill=LAYER_SDPA * 2))
    assert problem is not None and "no fused attention op" in problem and "in its 3 decode steps" in problem
    # one new token, no decode step: the whole call is read (its prefill ran eagerly here)
    assert Sdpa().verify_census(census((), steps=0, prefill=LAYER_SDPA)) is None
    assert "in the whole call" in str(Sdpa().verify_census(census((), steps=0, prefill=DYNAMIC_EAGER_STEP)))


def test_sdpa_under_compile_reads_the_whole_call_and_continuous_batching_is_not_read() -> None:
    # inductor's decode steps call the backend op; the eager prefill the public one
    compiled = census(("aten::_scaled_dot_product_flash_attention_for_cpu",) * 2, prefill=LAYER_SDPA, compiled_regions=3)
    assert Sdpa().verify_census(compiled) is None
    assert Sdpa().verify_census(census(("aten::mm",), prefill=DYNAMIC_EAGER_STEP, compiled_regions=3)) is not None
    # generate_batch's forwards run in its own thread, which the census does not count: no verdict from it
    assert Sdpa().verify_census(census(("aten::empty",), continuous_batching=True)) is None


def test_eager_passes_plain_attention_and_catches_a_fused_op() -> None:
    assert Eager().verify_census(census(DYNAMIC_EAGER_STEP, prefill=DYNAMIC_EAGER_STEP)) is None
    problem = Eager().verify_census(census(LAYER_SDPA * 2))
    assert problem is not None and "aten::scaled_dot_product_attention x6" in problem
    # compiled: inductor may fuse an eager attention into one op, which is no fallback
    assert Eager().verify_census(census(LAYER_SDPA, compiled_regions=3)) is None


STATIC_STEP = ("aten::linear", "aten::cat", "aten::index_copy_", "aten::index_copy_") * 2  # rotary's cat stays
FULL_WINDOW_STEP = ("aten::linear", "aten::cat", "aten::roll", "aten::copy_", "aten::roll", "aten::copy_") * 2


@pytest.mark.parametrize("technique", [StaticCacheTechnique(), SlidingWindowCache()], ids=lambda t: t.name)
def test_a_static_cache_writes_in_place_every_step_and_a_dynamic_one_is_caught(technique: Any) -> None:
    assert technique.verify_census(census(STATIC_STEP)) is None
    assert technique.verify_census(census(FULL_WINDOW_STEP)) is None  # a full sliding window rolls
    problem = technique.verify_census(census(DYNAMIC_EAGER_STEP))
    assert problem is not None and technique.name in problem
    assert "wrote no static cache in place" in problem and "aten::cat x4 per step" in problem
    # no decode step, or a compiled forward (inductor fuses the write): nothing to read
    assert technique.verify_census(census((), steps=0, prefill=DYNAMIC_EAGER_STEP)) is None
    assert technique.verify_census(census(("aten::mm",), compiled_regions=3)) is None


def test_compile_passes_compiled_decode_steps_and_catches_a_forward_dynamo_ran_eagerly() -> None:
    technique = Compile()
    assert technique.verify_census(census(("aten::mm",), compiled_regions=3)) is None
    problem = technique.verify_census(census(DYNAMIC_EAGER_STEP, compiled_regions=0))
    assert problem == ("compile was requested but no compiled region ran in the census call's 3 decode steps "
                       "(dynamo ran the forward eagerly)")
    assert technique.verify_census(census((), steps=0, compiled_regions=0)) is None  # only the prefill: eager
