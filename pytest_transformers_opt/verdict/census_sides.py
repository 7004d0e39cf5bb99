"""Taking a test's execution census on both sides (``engine.census`` counts; this decides what is taken, when and
why not): one untimed generate call per side, after the timed rounds, so warm-up, compilation and lazy
initialisation are over and the count is the steady state's (two runs of a test on one stack give the same census:
``tests/integration/test_census.py``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from ..engine.census import census_of
from ..engine.generation import GenerationRun
from ..engine.model import OptModel
from ..engine.progress import Work

if TYPE_CHECKING:
    from ..plan import TestPlan
    from ..session import OptSession

OFF = "--opt-census=off"
STORED = "the baseline's figures came from a stored baseline: no baseline model ran to be counted"
TENSOR_PARALLEL = "tensor parallelism runs the model in worker processes the census does not profile"


def census_sides(session: "OptSession", plan: "TestPlan", opt: OptModel, base: OptModel | None,
                 run: Callable[..., GenerationRun], recompiles: int | None, work: Work, workload_key: Any,
                 trace_path: str | None = None) -> tuple[dict[str, Any], str | None]:
    """The row's ``census`` (both sides, or why not) and the optimized side's trace file where one was asked for."""
    why_not: dict[str, str] = {}
    sides: dict[str, Any] = {"optimized": None, "baseline": None, "why_not": why_not}
    if not session.settings.census:
        why_not.update(optimized=OFF, baseline=OFF)
        return sides, None
    work.status = "census (untimed)"
    seconds: dict[str, float | None] = {"optimized": None, "baseline": None}  # what it cost, apart from every figure
    sides["seconds"] = seconds
    started = time.perf_counter()
    counted, why, trace = census_of(opt, lambda **kw: run(opt, **kw), cuda=session.hardware.is_cuda,
                                    recompiles=recompiles, trace_path=trace_path)
    seconds["optimized"] = round(time.perf_counter() - started, 4)
    sides["optimized"] = counted
    if why is not None:
        why_not["optimized"] = why
    if base is None:
        why_not["baseline"] = STORED
        return sides, trace
    # the baseline configuration runs the same calls in every test of its model and workload (a census is
    # deterministic): counted once a session, as its reference run is
    key = (base.loaded.key, repr(sorted(base.generation.kwargs.items())), workload_key)
    if key not in session.baseline_censuses:
        started = time.perf_counter()
        counted, why, _ = census_of(base, lambda **kw: run(base, **kw), cuda=session.hardware.is_cuda, recompiles=None)
        seconds["baseline"] = round(time.perf_counter() - started, 4)
        session.baseline_censuses[key] = (counted, why)
    sides["baseline"], why = session.baseline_censuses[key]
    if why is not None:
        why_not["baseline"] = why
    return sides, trace


def census_trace_path(session: "OptSession", plan: "TestPlan") -> str | None:
    """Where the census call's Chrome trace goes under ``--opt-trace`` (all or regressed): a file the session
    keeps until the report is written (``report.traces``); None when off."""
    if session.settings.trace == "off" or not session.settings.census:
        return None
    return session.census_trace_file(plan.nodeid)
