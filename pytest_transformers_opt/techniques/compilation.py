"""torch.compile through transformers' static-cache compiled forward."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..compat import compile_on_all_devices, graph_break_counts, compiled_forward, set_compiled_forward
from .base import DOCS, GenerationSettings, ProbeContext, RunEvidence, Technique, census_decode_steps
from .caches import CacheTechnique


@dataclass
class CompileRecord:
    """What dynamo said while a compiled forward compiled: graph-break reasons (reason -> times) from its counters'
    deltas around the forward's calls; kept with the forward, so a later test reusing it still knows (the census)."""

    graph_break_reasons: Counter[str] = field(default_factory=Counter)


@contextlib.contextmanager
def recording_graph_breaks(record: CompileRecord) -> Iterator[None]:
    """Add to ``record`` the graph breaks dynamo counts while the block runs (a compiled forward's call)."""
    before = graph_break_counts()
    try:
        yield
    finally:
        grown = graph_break_counts() - before
        if grown:
            record.graph_break_reasons.update(grown)


class CountedForward:
    """transformers' compiled forward, wrapped to count its calls (the proof that it ran); made for one
    configuration's ``CompileConfig`` (``owner``), so another configuration on the same model compiles its own."""

    RECORDED_CALLS = 4  # dynamo compiles (and breaks) in the first calls; later ones pay nothing for the record

    def __init__(self, forward: Callable[..., Any], owner: Any) -> None:
        self.forward, self.owner, self.calls = forward, owner, 0
        self.compile_record = CompileRecord()  # the census's graph-break reasons, from when it compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > self.RECORDED_CALLS:
            return self.forward(*args, **kwargs)
        with recording_graph_breaks(self.compile_record):
            return self.forward(*args, **kwargs)


class Compile(Technique):
    name = "compile"
    family = "compilation"
    compiled = True
    summary = "a static cache and torch.compile of the forward pass, on every device"
    requirement = "a compileable cache (static); on CPU a C++ compiler for inductor"
    docs = f"{DOCS}/llm_optims#static-kv-cache-and-torchcompile"
    docs_title = "Optimizing inference > Static kv-cache and torch.compile"
    overview_section = "Compilation"
    accepted_params = {"mode": "torch.compile mode, e.g. 'reduce-overhead'", "fullgraph": "bool",
                       "dynamic": "bool or None"}

    def probe(self, ctx: ProbeContext) -> str | None:
        if not ctx.hardware.is_cuda:
            import shutil

            if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
                return "compile on cpu needs a C++ compiler for torch inductor; found: none on PATH"
        return None

    def configure_generation(self, gen: GenerationSettings, ctx: ProbeContext) -> None:
        from transformers import CompileConfig

        options = {k: v for k, v in self.params.items()}
        compile_config = CompileConfig(**options)
        compile_on_all_devices(compile_config)  # the plugin compiles on every device, CPU included
        gen.kwargs["compile_config"] = compile_config
        gen.kwargs["disable_compile"] = False
        gen.kwargs.setdefault("cache_implementation", "static")
        gen.compile = True

    def prepare_generation(self, model: Any, gen: GenerationSettings) -> str | None:
        """Pre-create transformers' compiled forward for this configuration, wrapped to count its calls;
        a new one compiles on its first call (seconds to minutes)."""
        import torch

        config = gen.kwargs["compile_config"]
        current = compiled_forward(model)
        if isinstance(current, CountedForward) and current.owner is config:
            return None
        set_compiled_forward(model, CountedForward(torch.compile(model.__call__, **config.to_dict()), config), config)
        return "compiling with torch.compile"

    @contextlib.contextmanager
    def observe(self, model: Any, evidence: RunEvidence) -> Iterator[None]:
        forward = compiled_forward(model)
        before = forward.calls if isinstance(forward, CountedForward) else 0
        try:
            yield
        finally:
            after = forward.calls if isinstance(forward, CountedForward) else 0
            evidence.compiled_calls += after - before

    def compiled_calls(self, model: Any) -> int:
        """Calls of the compiled forward this technique installed on ``model`` (0 when none is installed)."""
        forward = compiled_forward(model)
        return forward.calls if isinstance(forward, CountedForward) else 0

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if evidence.compiled_calls <= 0:
            return "compile was requested but the compiled forward was never called (transformers fell back to eager)"
        return None

    def verify_census(self, census: dict[str, Any]) -> str | None:
        """A compiled region runs in the decode steps: dynamo that gives up on the forward (a recompile limit, an
        error it suppresses) runs it eagerly, still through the counted forward, so only the census sees it."""
        steps = census_decode_steps(census)
        if not steps or census.get("compiled_calls") != 0:
            return None
        return (f"compile was requested but no compiled region ran in the census call's {steps} decode steps "
                f"(dynamo ran the forward eagerly)")

    def conflicts_with(self, other: Technique) -> str | None:
        if isinstance(other, CacheTechnique) and not other.compileable:
            return "torch.compile needs a compileable (static) cache"
        return None
