"""The execution census: what one untimed generate call of a configuration runs, counted exactly.

Wall time moves with the machine; what is executed does not. The census runs one generate call of the workload
under ``torch.profiler`` (outside every timed round, after them: at steady state) and counts, from the profiler's
events:

- ``ops``: every ATen op the call ran that no other ATen op called (what Python code, or compiled code, asked the
  dispatcher for: ``aten::linear``, not the ``aten::t`` and ``aten::addmm`` it is made of), name -> count;
- per decode step (``ops_per_step``): the ops between the first and the last call of the logits processors, per
  step; a decode step is one forward and the choice of its token;
- for a compiled configuration: ``graph_breaks`` (a compiled forward that runs as N graphs has N - 1 breaks, read
  from the graphs each compiled call ran; their reasons from dynamo's counters while the forward compiled),
  ``unique_graphs`` (distinct compiled graphs run) and ``recompiles`` (graphs compiled after the warm-up: the
  timed rounds' and this call's);
- on CUDA: ``kernels`` (kernel name -> launches), ``syncs`` (the CUDA runtime calls that block the host:
  ``cudaDeviceSynchronize``, ``cudaStreamSynchronize``, ``cudaEventSynchronize``, a synchronous ``cudaMemcpy``)
  and ``cuda_graph_replays`` (``cudaGraphLaunch``).

A TorchDispatchMode would count the same eager ops a little more cheaply, but dynamo runs a compiled forward
eagerly while one is active (measured: no compiled region runs), so it would count what the configuration does
not run: the profiler sees the compiled code as it runs. Ops inside a compiled region are the ATen ops the compiled
code calls (on CPU inductor's extern kernels, e.g. ``aten::mm``; its fused C++ kernels are not ATen ops and are not
counted; on CUDA they are ``kernels``). A figure the device cannot give is null, with the reason in ``unavailable``;
never a made-up zero.

The counting (``census_from_events``) is a pure function of event records, so CUDA's figures are tested with
recorded-shape events on a machine without a GPU (``tests/unit/test_census.py``); they are unverified on a GPU
until a device check runs them.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from ..compat import compiled_forward, compiled_graph_count
from ..techniques.compilation import CompileRecord, recording_graph_breaks

if TYPE_CHECKING:
    from .model import OptModel

STEP_MARK = "pytest_opt::step"
"""The record a census call's logits processor leaves at each decode step."""
CALL_MARK = "pytest_opt::generate"
"""The record around each generate call of a census: events outside it (tokenizing, decoding) are not counted."""

SYNC_CALLS = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cudaMemcpy2D"})
"""CUDA runtime calls that block the host until the device is done (``cudaMemcpy`` without ``Async``)."""
GRAPH_REPLAY_CALLS = frozenset({"cudaGraphLaunch"})
_COMPILED_REGION = "Torch-Compiled Region"
_COMPILED_GRAPH = "## Call CompiledFxGraph"

OP, KERNEL, RUNTIME, REGION, GRAPH, MARK = "op", "kernel", "runtime", "region", "graph", "mark"


@dataclass(frozen=True)
class CensusEvent:
    """One profiler event as the census reads it: ``kind`` one of op (a top-level ATen op), kernel (a device
    kernel, timed by its launch), runtime (a CUDA runtime call), region (a compiled region entered at top level),
    graph (a compiled graph called), mark (``STEP_MARK`` or ``CALL_MARK``); ``start`` in the profiler's
    microseconds (a kernel's: its launch's, so it falls in the step that launched it)."""

    name: str
    kind: str
    start: float
    end: float | None = None  # a CALL_MARK's end


def _first_line(reason: str) -> str:
    """A dynamo graph-break reason's first line (its text goes on with an explanation, hints and a link)."""
    return reason.strip().splitlines()[0].strip() if reason.strip() else reason


def _per_step(counts: Counter[str], steps: int) -> dict[str, float]:
    return {name: round(count / steps, 3) for name, count in sorted(counts.items())}


def census_from_events(events: Iterable[CensusEvent], *, cuda: bool, compiled: bool, recompiles: int | None = None,
                       graph_break_reasons: Iterable[str] = (), steps_known: bool = True) -> dict[str, Any]:
    """The census of one configuration's generate call(s) from their profiler events (see the module's text).

    Only events inside a ``CALL_MARK`` are counted; decode steps are the intervals between a call's first and last
    ``STEP_MARK`` (``steps_known``: False where no logits processor runs, e.g. ``generate_batch``)."""
    ordered = sorted(events, key=lambda e: e.start)
    calls = [(e.start, e.end if e.end is not None else e.start) for e in ordered if e.kind == MARK and e.name == CALL_MARK]
    ops: Counter[str] = Counter()
    step_ops: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    step_kernels: Counter[str] = Counter()
    syncs = step_syncs = replays = 0
    regions = graphs = 0
    graph_names: set[str] = set()
    decode_steps = 0
    for start, end in calls:
        inside = [e for e in ordered if start <= e.start <= end and not (e.kind == MARK and e.name == CALL_MARK)]
        marks = [e.start for e in inside if e.kind == MARK and e.name == STEP_MARK]
        first, last = (marks[0], marks[-1]) if len(marks) >= 2 else (None, None)
        decode_steps += max(len(marks) - 1, 0)
        for event in inside:
            in_step = first is not None and last is not None and first <= event.start < last
            if event.kind == OP:
                ops[event.name] += 1
                if in_step:
                    step_ops[event.name] += 1
            elif event.kind == KERNEL:
                kernels[event.name] += 1
                if in_step:
                    step_kernels[event.name] += 1
            elif event.kind == RUNTIME:
                if event.name in SYNC_CALLS:
                    syncs += 1
                    step_syncs += in_step
                elif event.name in GRAPH_REPLAY_CALLS:
                    replays += 1
            elif event.kind == REGION:
                regions += 1
            elif event.kind == GRAPH:
                graphs += 1
                graph_names.add(event.name)
    unavailable: dict[str, str] = {}
    census: dict[str, Any] = {
        "generate_calls": len(calls),
        "ops": dict(sorted(ops.items())),
        "ops_total": sum(ops.values()),
        "decode_steps": decode_steps if steps_known else None,
        "ops_per_step": _per_step(step_ops, decode_steps) if steps_known and decode_steps else None,
    }
    if not steps_known:
        # generate_batch runs its forwards in a scheduler thread it starts, which the profiler does not record
        # (measured: 69 ops, none a layer's, for a call whose forwards run hundreds): none counted, not a few
        census["ops"] = census["ops_total"] = None
        unavailable["ops"] = ("generate_batch runs the model in its own thread, which the profiler does not record: "
                              "its ops are not counted")
        unavailable["ops_per_step"] = "no decode steps to mark: generate_batch runs no logits processor"
    elif not decode_steps:
        unavailable["ops_per_step"] = "fewer than two tokens generated per call: no decode step between two marks"
    if compiled:
        census["graph_breaks"] = (max(round(graphs / regions) - 1, 0) if regions else None)
        census["graph_break_reasons"] = sorted({_first_line(r) for r in graph_break_reasons}) \
            if census["graph_breaks"] else []
        census["unique_graphs"] = len(graph_names)
        census["compiled_calls"] = regions
        census["recompiles"] = recompiles
        if not regions:
            unavailable["graph_breaks"] = "no compiled region ran in the counted call (the forward ran eagerly)"
        if recompiles is None:
            unavailable["recompiles"] = "dynamo's counters are not readable"
    else:
        for name in ("graph_breaks", "unique_graphs", "recompiles"):
            census[name] = None
            unavailable[name] = "not a compiled configuration"
        census["graph_break_reasons"] = []
    if cuda:
        census["kernels"] = dict(sorted(kernels.items()))
        census["kernels_total"] = sum(kernels.values())
        census["kernels_per_step"] = _per_step(step_kernels, decode_steps) if steps_known and decode_steps else None
        census["syncs"] = syncs
        census["syncs_per_step"] = round(step_syncs / decode_steps, 3) if steps_known and decode_steps else None
        census["cuda_graph_replays"] = replays
    else:
        for name in ("kernels", "kernels_total", "kernels_per_step", "syncs", "syncs_per_step", "cuda_graph_replays"):
            census[name] = None
        unavailable["kernels"] = "CPU: the ATen ops are what runs (ops); kernels are counted on CUDA"
        unavailable["syncs"] = "CPU: no device for the host to wait on"
    census["unavailable"] = unavailable
    return census


# ---------------------------------------------------------------------------------------------------------------
# reading the profiler


def _is_aten(name: str) -> bool:
    return name.startswith("aten::")


def events_from_profiler(profile: Any) -> list[CensusEvent]:
    """The census's events from a finished ``torch.profiler.profile``, read from the profiler's raw (Kineto) events:
    building its Python event tree (``profile.events()``) cost 27 times as much on a 135M model's call, most of a
    census's time (benchmarks/RESULTS.md, issue 41). Which op called which is read from how a thread's events nest
    (an op runs within its caller's span, on its thread); a device kernel is timed by its launch, found through its
    correlation id."""
    from torch.autograd import DeviceType

    raw = profile.profiler.kineto_results.events()
    launches: dict[int, float] = {}  # a CPU event's correlation id -> its start (a kernel's launch)
    threads: dict[int, list[Any]] = {}
    device: list[Any] = []
    for event in raw:
        if event.device_type() == DeviceType.CPU:
            threads.setdefault(int(event.start_thread_id()), []).append(event)
            launches[int(event.correlation_id())] = float(event.start_ns()) / 1000.0
        else:
            device.append(event)
    events: list[CensusEvent] = []
    for thread_events in threads.values():
        thread_events.sort(key=lambda e: (e.start_ns(), -e.end_ns()))
        open_spans: list[tuple[int, bool, bool]] = []  # (end, an aten op, a compiled region), innermost last
        for event in thread_events:
            start, end = int(event.start_ns()), int(event.end_ns())
            while open_spans and open_spans[-1][0] <= start:
                open_spans.pop()
            name = str(event.name())
            start_us = start / 1000.0
            within_aten = any(span[1] for span in open_spans)
            within_region = any(span[2] for span in open_spans)
            if name in (STEP_MARK, CALL_MARK):
                events.append(CensusEvent(name, MARK, start_us, end / 1000.0))
            elif _is_aten(name):
                if not within_aten:
                    events.append(CensusEvent(name, OP, start_us))
            elif name in SYNC_CALLS or name in GRAPH_REPLAY_CALLS:
                events.append(CensusEvent(name, RUNTIME, start_us))
            elif name.startswith(_COMPILED_REGION):
                if not within_region:
                    events.append(CensusEvent(name, REGION, start_us))
            elif name.startswith(_COMPILED_GRAPH):
                events.append(CensusEvent(name, GRAPH, start_us))
            open_spans.append((end, _is_aten(name), name.startswith(_COMPILED_REGION)))
    for event in device:
        name = str(event.name())
        if name in (STEP_MARK, CALL_MARK) or event.is_user_annotation():
            continue
        launch = launches.get(int(event.linked_correlation_id()))
        events.append(CensusEvent(name, KERNEL, launch if launch is not None else float(event.start_ns()) / 1000.0))
    return events


class StepMark:
    """A no-op logits processor that leaves a ``STEP_MARK`` record each time generate chooses a token."""

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        with torch.profiler.record_function(STEP_MARK):
            pass
        return scores


@contextlib.contextmanager
def marked_call() -> Iterator[None]:
    """Around one generate call of a census: the ``CALL_MARK`` record its events are counted inside."""
    import torch

    with torch.profiler.record_function(CALL_MARK):
        yield


@dataclass
class CensusTaking:
    """One census being taken: the profiler's session around a generate call, and what it found."""

    cuda: bool
    trace_path: str | None = None  # --opt-trace: the Chrome trace of this call, written here
    profile: Any = None
    trace_written: str | None = None

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
            yield
        self.profile = prof
        if self.trace_path:
            prof.export_chrome_trace(self.trace_path)
            self.trace_written = self.trace_path

    def census(self, *, compiled: bool, recompiles: int | None, graph_break_reasons: Iterable[str],
               steps_known: bool) -> dict[str, Any]:
        assert self.profile is not None, "census() after profiling()"
        return census_from_events(events_from_profiler(self.profile), cuda=self.cuda, compiled=compiled,
                                  recompiles=recompiles, graph_break_reasons=graph_break_reasons,
                                  steps_known=steps_known)


def _graph_break_reasons(opt: "OptModel", during_call: CompileRecord) -> list[str]:
    """Why the compiled forward broke: what dynamo said while it compiled (kept with the forward), else while the
    census call ran."""
    forward = compiled_forward(opt.model)
    record = getattr(forward, "compile_record", None)
    reasons: Iterable[str] = record.graph_break_reasons if isinstance(record, CompileRecord) else ()
    return sorted(set(reasons) | set(during_call.graph_break_reasons))


def census_of(side: "OptModel", run: Callable[..., Any], *, cuda: bool, recompiles: int | None,
              trace_path: str | None = None) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """(the census of one side's generate call, why none, the trace written): ``run(census_marks=True)`` runs the
    workload once. A census that fails says why (the test goes on: the census is evidence, not the test)."""
    compiled = bool(side.generation.compile)
    taking = CensusTaking(cuda=cuda, trace_path=trace_path)
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
