"""The test plan: what one test's markers resolve to, checked, before any model loads.

Markers name techniques; the registry resolves them and each side's stack is checked; the plan holds
both sides (baseline and optimized), the model and the budgets. A technique this machine cannot run
skips the test here (fails it under ``--opt-require``), before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import pytest

from .compat import config_as_loaded
from .engine.hardware import HardwareInfo
from .engine.loading import ModelRequest, resolve_model_path
from .engine.real_models import RealModelUnavailable
from .errors import OptConfigError
from .markers import MarkedTest, read_markers
from .options import Settings
from .techniques import ProbeContext, Technique, TechniqueRegistry, check_stack
from .techniques.base import checked_probe
from .verdict.budgets import Budget, drop_inapplicable, resolve_budgets, worst_quality


@dataclass
class Configuration:
    """One side of a comparison: a model and the technique stack it runs with."""

    request: ModelRequest
    techniques: list[Technique]

    @property
    def labels(self) -> list[str]:
        return [t.label() for t in self.techniques]


@dataclass
class TestPlan:
    """Everything the markers of one test resolve to, checked, before any model loads."""

    nodeid: str
    marked: MarkedTest
    model_path: str
    probe_context: ProbeContext
    baseline: Configuration
    optimized: Configuration
    declared: list[str]  # the techniques the optimization marker names
    budgets: dict[str, Budget]


class PlanSources(Protocol):
    """What planning reads from the session (which builds each piece on first use)."""

    settings: Settings

    @property
    def registry(self) -> TechniqueRegistry: ...

    @property
    def hardware(self) -> HardwareInfo: ...

    def model_config(self, request: ModelRequest, path: str) -> Any: ...


def build_plan(item: pytest.Item, sources: PlanSources) -> TestPlan:
    """Resolve and check the markers of ``item``; raises ``OptConfigError`` for bad input."""
    settings = sources.settings
    default_source = settings.sources.get("model", "default")
    marked = read_markers(item, settings.model, f"{default_source} default model", settings.baseline)
    registry = sources.registry
    declared = [registry.resolve(spec, "@pytest.mark.optimization") for spec in marked.techniques]
    check_stack(declared, "@pytest.mark.optimization")
    baseline = [registry.resolve(spec, f"baseline ({marked.baseline_origin})") for spec in marked.baseline]
    check_stack(baseline, f"baseline ({marked.baseline_origin})")
    optimized = _stack_with_inheritance(baseline, declared)
    try:
        path = resolve_model_path(marked.model)
    except RealModelUnavailable as exc:  # a package not installed here: a skip, with the install command
        pytest.skip(exc.reason)
    ctx = probe_context(sources.hardware, marked.model, sources.model_config(marked.model, path))
    dtype = ctx.dtype
    distributions = not any(t.compares_tokens_only for t in optimized)
    budgets = resolve_budgets(marked.budgets, settings.ini_budgets,
                              worst_quality([t.quality for t in optimized + baseline]), dtype, distributions,
                              "@pytest.mark.optimization")
    budgets = drop_inapplicable(budgets, {t.family for t in optimized}, "@pytest.mark.optimization")
    return TestPlan(nodeid=item.nodeid, marked=marked, model_path=path, probe_context=ctx,
                    baseline=Configuration(marked.model, baseline),
                    optimized=Configuration(marked.model, optimized),
                    declared=[t.label() for t in declared], budgets=budgets)


def probe_context(hardware: HardwareInfo, request: ModelRequest, config: Any) -> ProbeContext:
    """What the probes see of ``request``'s model: the config it will load with (``opt_model(...,
    layer_types=[...])`` included) and its dtype (the request's, else the config's, else float32)."""
    model_config = config_as_loaded(config, dict(request.from_pretrained_kwargs))
    dtype = request.dtype or str(getattr(model_config, "dtype", None) or "float32").removeprefix("torch.")
    return ProbeContext(hardware=hardware, model_config=model_config, dtype=dtype)


def _stack_with_inheritance(baseline: list[Technique], declared: list[Technique]) -> list[Technique]:
    """The optimized stack: the baseline's techniques, overridden by the declared ones where they clash.

    So ``optimization("static_cache")`` measures the cache alone, on the baseline's attention and dtype.
    """
    kept = []
    for inherited in baseline:
        clashes = any(
            d.name == inherited.name
            or (d.exclusive_group and d.exclusive_group == inherited.exclusive_group)
            or d.conflicts_with(inherited) or inherited.conflicts_with(d)
            for d in declared
        )
        if not clashes:
            kept.append(inherited)
    return kept + declared


def skip_unsupported(plan: TestPlan, required: frozenset[str]) -> None:
    """Skip (or, in strict mode, fail) when a technique of either side cannot run here."""
    for technique in plan.baseline.techniques + plan.optimized.techniques:
        reason = checked_probe(technique, plan.probe_context)
        if reason is None:
            continue
        if required and ("all" in required or technique.name in required or technique.label() in required):
            pytest.fail(f"required technique {technique.label()} cannot run here (--opt-require): {reason}",
                        pytrace=False)
        pytest.skip(reason)
