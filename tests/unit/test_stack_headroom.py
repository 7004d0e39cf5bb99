"""Timed calls get Python stack headroom: a deep caller (a pytest session) must not make CPython map and unmap a
frame-stack chunk at every crossing of a boundary inside the timed call (engine.measure, call_with_stack_headroom)."""

from __future__ import annotations

import resource
import sys

import pytest

from pytest_transformers_opt.engine.measure import call_with_stack_headroom

REPEATS = 200


def _nest(depth: int) -> int:
    return _nest(depth - 1) if depth else 0


def _calls_that_go_30_frames_deep() -> None:
    for _ in range(REPEATS):
        _nest(30)


def _faults_from(base_depth: int, through_headroom: bool) -> int:
    """Minor page faults of the nested calls, started ``base_depth`` frames below the caller."""
    if base_depth:
        return _faults_from(base_depth - 1, through_headroom)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    if through_headroom:
        call_with_stack_headroom(_calls_that_go_30_frames_deep)
    else:
        _calls_that_go_30_frames_deep()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's frame stack chunks")
def test_a_chunk_boundary_inside_the_timed_call_faults_at_every_crossing_unless_it_has_headroom() -> None:
    # some caller depth puts a chunk boundary inside the nested calls: each crossing maps a fresh chunk
    plain = max(_faults_from(depth, False) for depth in range(0, 400, 3))
    assert plain >= REPEATS, f"no caller depth made the nested calls cross a chunk boundary ({plain} faults)"
    # through the headroom frame no caller depth does
    through = max(_faults_from(depth, True) for depth in range(0, 400, 3))
    assert through < REPEATS // 10, f"{through} page faults with {REPEATS} calls through the headroom frame"


def test_the_call_passes_arguments_results_and_exceptions_through() -> None:
    assert call_with_stack_headroom(lambda a, b=0: (a, b), 1, b=2) == (1, 2)
    with pytest.raises(ZeroDivisionError):
        call_with_stack_headroom(lambda: 1 / 0)
