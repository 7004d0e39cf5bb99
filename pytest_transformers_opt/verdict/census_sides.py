"""Taking a test's execution census on both sides (``engine.census`` counts; this decides what is taken, when and
why not): one untimed generate call per side, after the timed rounds, so warm-up, compilation and lazy
initialisation are over and the count is the steady state's (two runs of a test on one stack give the same census:
``tests/integration/test_census.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..compat import compiled_forward, compiled_graph_count
from ..engine.census import CensusTaking, recording_graph_breaks, CompileRecord
from ..engine.generation import GenerationRun
from ..engine.model import OptModel
from ..engine.progress import Work

if TYPE_CHECKING:
    from ..plan import TestPlan
    from ..session import OptSession

OFF = "--opt-census=off"
STORED = "the baseline's figures came from a stored baseline: no baseline model ran to be counted"
TENSOR_PARALLEL = "tensor parallelism runs the model in worker processes the census does not profile"


def _graph_break_reasons(opt: OptModel, during_call: CompileRecord) -> list[str]:
    """Why the compiled forward broke: what dynamo said while it compiled (kept with the forward), else while the
    census call ran."""
    forward = compiled_forward(opt.model)
    record = getattr(forward, "compile_record", None)
    reasons: Iterable[str] = record.graph_break_reasons if isinstance(record, CompileRecord) else ()
    return sorted(set(reasons) | set(during_call.graph_break_reasons))


def census_of(session: "OptSession", side: OptModel, run: Callable[..., GenerationRun], *, recompiles: int | None,
              trace_path: str | None = None) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """(the census of one side's generate call, why none, the trace written): ``run(census_marks=True)`` runs the
    workload once. A census that fails says why (the test goes on: the census is evidence, not the test)."""
    compiled = bool(side.generation.compile)
    taking = CensusTaking(cuda=session.hardware.is_cuda, trace_path=trace_path)
    during = CompileRecord()
    graphs_before = compiled_graph_count()
    try:
        with recording_graph_breaks(during), taking.profiling():
            run(census_marks=True)
    except Exception as exc:  # noqa: BLE001 - any failure of the profiler or the call is said, never raised
        return None, f"the census call raised {type(exc).__name__}: {exc}", None
    grown = compiled_graph_count() - graphs_before
    census = taking.census(compiled=compiled, recompiles=(recompiles or 0) + grown if compiled else None,
                           graph_break_reasons=_graph_break_reasons(side, during),
                           steps_known=side.generation.continuous_batching is None)
    return census, None, taking.trace_written


def census_sides(session: "OptSession", plan: "TestPlan", opt: OptModel, base: OptModel | None,
                 run: Callable[..., GenerationRun], recompiles: int | None, work: Work,
                 trace_path: str | None = None) -> tuple[dict[str, Any], str | None]:
    """The row's ``census`` (both sides, or why not) and the optimized side's trace file where one was asked for."""
    why_not: dict[str, str] = {}
    sides: dict[str, Any] = {"optimized": None, "baseline": None, "why_not": why_not}
    if not session.settings.census:
        why_not.update(optimized=OFF, baseline=OFF)
        return sides, None
    work.status = "census (untimed)"
    trace = None
    for name, side in (("optimized", opt), ("baseline", base)):
        if side is None:
            why_not[name] = STORED
            continue
        counted, why, written = census_of(session, side, lambda **kw: run(side, **kw),
                                          recompiles=recompiles if side is opt else None,
                                          trace_path=trace_path if side is opt else None)
        sides[name] = counted
        if why is not None:
            why_not[name] = why
        if side is opt:
            trace = written
    return sides, trace


def census_trace_path(session: "OptSession", plan: "TestPlan") -> str | None:
    """Where the census call's Chrome trace goes under ``--opt-trace`` (all or regressed): a file of the session's
    own trace folder, moved next to the JSON report when the report is written (``report.traces``); None when off."""
    if session.settings.trace == "off" or not session.settings.census:
        return None
    from ..report.traces import trace_file_for

    return trace_file_for(session, plan.nodeid)
