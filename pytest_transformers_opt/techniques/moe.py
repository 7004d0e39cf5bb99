"""The MoE experts implementation: transformers' ``experts_implementation`` (eager, batched_mm, grouped_mm).

The baseline runs ``eager``, transformers' reference loop over the selected experts (the loader asks for it, as
it asks for eager attention; transformers 5.x would otherwise pick grouped_mm by itself), so the technique is
measured against the unoptimized forward. The proof counts which experts forward transformers dispatched to at
every MoE layer call, and for grouped_mm that torch's grouped GEMM ran rather than transformers' own fallback loop.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

from ..compat import (GROUPED_MM_KERNEL, experts_dispatch_counted, experts_implementation,
                      grouped_mm_kernels_counted, supports_experts_implementation)
from ..errors import OptConfigError
from .base import DOCS, LOSSLESS, LoadSettings, ProbeContext, RunEvidence, Technique, version_ok

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")  # what experts(implementation=...) accepts
BASELINE_IMPLEMENTATION = "eager"  # the reference forward every other configuration loads with
# The config fields that count a model's routed experts (Mixtral / GPT-OSS, Qwen-MoE, DeepSeek).
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
GROUPED_MM_MIN_CAPABILITY = (8, 0)  # torch >= 2.9's grouped GEMM on CUDA; torch <= 2.8's ran on Hopper (9.x) only


def expert_count(config: Any) -> int:
    """The number of routed experts a config (a transformers config or a config.json dict) declares; 0 for a
    dense model. A multimodal config is read through its decoder's part."""
    if config is None:
        return 0
    if not isinstance(config, Mapping):
        try:
            config = config.get_text_config(decoder=True)
        except Exception:  # not a transformers config (a stand-in): read it as it is
            pass
    for name in EXPERT_COUNT_FIELDS:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return 0


def _model_text(config: Any) -> str:
    model_type = getattr(config, "model_type", None) or "this model"
    architectures = getattr(config, "architectures", None) or []
    return f"{model_type} ({architectures[0]})" if architectures else str(model_type)


def grouped_mm_problem(device_type: str, compute_capability: tuple[int, int] | None, torch_version: str | None,
                       found: str) -> str | None:
    """Why torch's grouped GEMM cannot run transformers' grouped_mm experts on this device with this torch (the
    rules of transformers' ``_can_use_grouped_mm``); None when it can or when a fact it needs is unknown (None).
    ``found`` names the device for the reason."""
    what = "experts(implementation='grouped_mm')"
    if torch_version is None:
        return None
    release = torch_version.split("+")[0]
    if device_type == "cpu":
        if not version_ok(release, ">2.8"):
            return (f"{what} needs torch >= 2.9 on cpu (torch._grouped_mm has no CPU kernel before; transformers "
                    f"would loop over the experts instead); found: torch {torch_version}")
        return None
    if device_type != "cuda":
        return None
    if not version_ok(release, ">=2.8"):
        return f"{what} needs torch >= 2.8 (torch._grouped_mm); found: torch {torch_version}"
    if compute_capability is None:
        return None
    if version_ok(release, ">=2.9"):
        need = GROUPED_MM_MIN_CAPABILITY
        if tuple(compute_capability) < need:
            return (f"{what} needs a CUDA GPU of compute capability >= {need[0]}.{need[1]}; found: {found} "
                    f"with torch {torch_version}")
    elif compute_capability[0] != 9:  # torch 2.8's grouped GEMM ran on Hopper only
        return f"{what} with torch 2.8 needs a Hopper GPU (compute capability 9.x); found: {found}"
    return None


class Experts(Technique):
    """``experts(implementation="batched_mm")``: the experts forward of a mixture-of-experts model."""

    name = "experts"
    family = "experts"
    exclusive_group = "experts implementation"
    load_time = True
    summary = "the MoE experts forward (experts_implementation: eager, batched_mm or grouped_mm)"
    requirement = ("a mixture-of-experts model whose class takes experts_implementation; grouped_mm: torch >= 2.9 "
                   "(on CUDA a GPU of compute capability >= 8.0)")
    docs = f"{DOCS}/experts_interface"
    docs_title = "Experts backends"
    quality = LOSSLESS  # measured against eager on the MoE models: benchmarks/experts_study.py (RESULTS.md, issue 22)
    accepted_params = {"implementation": "one of " + ", ".join(repr(i) for i in IMPLEMENTATIONS)}
    example_params = {"implementation": "batched_mm"}

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        if "implementation" not in params:
            raise OptConfigError(f"technique experts: implementation= is required; accepted: "
                                 f"{', '.join(repr(i) for i in IMPLEMENTATIONS)}")
        if params["implementation"] not in IMPLEMENTATIONS:
            raise OptConfigError(f"technique experts: implementation={params['implementation']!r} is not an experts "
                                 f"implementation; accepted: {', '.join(repr(i) for i in IMPLEMENTATIONS)}")
        self._calls: dict[str, int] | None = None  # what the last observed run dispatched to (None: not observed)

    @property
    def impl(self) -> str:
        return str(self.params["implementation"])

    def probe(self, ctx: ProbeContext) -> str | None:
        config = ctx.model_config
        if config is not None and not expert_count(config):
            return (f"{self.label()} needs a mixture-of-experts model; found: {_model_text(config)} has no experts "
                    f"(its config sets none of {', '.join(EXPERT_COUNT_FIELDS)})")
        if supports_experts_implementation(config) is False:
            return (f"{self.label()} needs a model class that takes experts_implementation (transformers' "
                    f"@use_experts_implementation); found: {_model_text(config)} with {expert_count(config)} "
                    f"experts, whose class does not")
        if self.impl != "grouped_mm":
            return None
        hw = ctx.hardware
        return grouped_mm_problem(hw.device_type, hw.compute_capability, hw.version("torch"), hw.describe())

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        load.kwargs["experts_implementation"] = self.impl

    def conflicts_with(self, other: Technique) -> str | None:
        if other.runs_in_subprocesses:
            return "the torchrun workers load the model with transformers' own experts implementation, not this one"
        return None

    def verify_loaded(self, model: Any) -> str | None:
        actual = experts_implementation(model.config)
        if actual != self.impl:
            return f"{self.label()} was requested but the loaded model's config says experts implementation {actual!r}"
        return None

    @contextlib.contextmanager
    def observe(self, model: Any, evidence: RunEvidence) -> Iterator[None]:
        """Count every experts forward by the implementation transformers dispatched to, and torch's grouped GEMM
        calls; inside a compiled graph the counters would not run, so a compiled run is not observed."""
        self._calls = None
        if evidence.compiled:
            yield
            return
        calls: dict[str, int] = {}
        try:
            with experts_dispatch_counted(calls), grouped_mm_kernels_counted(calls):
                yield
        finally:
            self._calls = calls

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        calls = self._calls
        if calls is None:  # not observed (a compiled forward)
            return None
        ran = {name: count for name, count in calls.items() if name != GROUPED_MM_KERNEL and count}
        found = ", ".join(f"{name} x{count}" for name, count in sorted(ran.items())) or "no experts layer ran"
        if not ran.get(self.impl):
            return f"{self.label()} was requested but its experts forward never ran during generation; found: {found}"
        others = {name: count for name, count in ran.items() if name != self.impl}
        device = str(getattr(getattr(model, "device", None), "type", "cpu"))
        if self.impl == "grouped_mm" and device != "cpu" and set(others) == {"batched_mm"}:
            # transformers' documented decode switch (the Experts backends page): grouped_mm for prefill, batched_mm
            # for each decoding step on a GPU
            evidence.notes.append(f"experts: grouped_mm ran {ran['grouped_mm']} times (prefill) and batched_mm "
                                  f"{others['batched_mm']} times: transformers decodes with batched_mm on {device}")
            others = {}
        if others:
            return f"{self.label()} was requested but other experts forwards ran too; found: {found}"
        if self.impl == "grouped_mm" and not calls.get(GROUPED_MM_KERNEL):
            return (f"{self.label()}: transformers' grouped_mm experts forward ran ({ran['grouped_mm']} calls) but "
                    f"torch's grouped GEMM never did: it fell back to its own loop over the experts (as transformers "
                    f"does when torch has no grouped GEMM, on cpu with torch <= 2.10 when the weights are not 16-byte "
                    f"aligned, and compiled unless the dtype is bfloat16)")
        return None
