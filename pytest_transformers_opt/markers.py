"""The three markers: one keyword-only signature each, which both parses them and writes their help.

``pytest --markers`` text is generated from these signatures and docstrings, so help and parser
cannot disagree.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import pytest

from .errors import OptConfigError
from .units import parse_dtype

if TYPE_CHECKING:
    from .engine.loading import ModelRequest


def optimization(*techniques: Any, **budgets: Any) -> None:
    """The techniques to stack (catalogue names or techniques.NAME(**params)) and budgets such as max_kl=0.01, min_speedup=1.2. The closest marker wins."""


def opt_model(name_or_path: str, *, revision: str | None = None, dtype: str | None = None,
              trust_remote_code: bool = False, **from_pretrained_kwargs: Any) -> None:
    """The model under test (folder, hub id or built-in name such as tiny-random-llama); module, class or function level."""


def opt_baseline(*techniques: Any) -> None:
    """The reference configuration (default: ini opt_baseline, else eager with a dynamic cache, same dtype)."""


MARKERS: dict[str, Callable[..., None]] = {f.__name__: f for f in (optimization, opt_model, opt_baseline)}


def marker_help(name: str) -> str:
    """``name(signature): first docstring line`` for ``config.addinivalue_line("markers", ...)``."""
    function = MARKERS[name]
    plain = inspect.signature(function).replace(return_annotation=inspect.Signature.empty)
    plain = plain.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in plain.parameters.values()])
    signature = str(plain)
    return f"{name}{signature}: {inspect.getdoc(function).splitlines()[0]}"  # type: ignore[union-attr]  # every marker function has a docstring


def bind_marker(mark: pytest.Mark) -> inspect.BoundArguments:
    """Bind a marker's arguments to its signature; a mismatch names the marker and the signature."""
    function = MARKERS[mark.name]
    try:
        return inspect.signature(function).bind(*mark.args, **mark.kwargs)
    except TypeError as exc:
        raise OptConfigError(f"@pytest.mark.{marker_help(mark.name).split(':')[0]}: {exc}") from None


@dataclass
class MarkedTest:
    """What the markers of one test say, validated."""

    model: ModelRequest
    techniques: list[Any]
    budgets: dict[str, Any]
    baseline: list[Any]
    baseline_origin: str


def read_markers(item: pytest.Item, default_model: str, default_model_source: str,
                 default_baseline: tuple[str, ...]) -> MarkedTest:
    """Read and check the closest ``optimization``, ``opt_model`` and ``opt_baseline`` markers of ``item``."""
    from .engine.loading import ModelRequest  # on first use: the plugin's start-up loads no stage

    optimization_mark = item.get_closest_marker("optimization")
    techniques: list[Any] = []
    budgets: dict[str, Any] = {}
    if optimization_mark is not None:
        bound = bind_marker(optimization_mark)
        techniques = list(bound.arguments.get("techniques", ()))
        budgets = dict(bound.arguments.get("budgets", {}))
        if not techniques:
            raise OptConfigError("@pytest.mark.optimization(): name at least one technique, e.g. "
                                 "@pytest.mark.optimization(\"sdpa\")")
    model_mark = item.get_closest_marker("opt_model")
    if model_mark is not None:
        bound = bind_marker(model_mark)
        args = bound.arguments
        name = args["name_or_path"]
        if not isinstance(name, str) or not name:
            raise OptConfigError(f"@pytest.mark.opt_model: name_or_path must be a non-empty string; got {name!r}")
        dtype = args.get("dtype")
        if dtype is not None:
            dtype = str(parse_dtype(dtype, "@pytest.mark.opt_model dtype")).removeprefix("torch.")
        trust = args.get("trust_remote_code", False)
        if not isinstance(trust, bool):
            raise OptConfigError(f"@pytest.mark.opt_model: trust_remote_code must be True or False; got {trust!r}")
        extra = args.get("from_pretrained_kwargs", {})
        for reserved in ("attn_implementation", "quantization_config", "device_map", "torch_dtype"):
            if reserved in extra:
                raise OptConfigError(f"@pytest.mark.opt_model: {reserved} is set by techniques or dtype=; "
                                     f"remove it from the marker")
        model = ModelRequest(name, revision=args.get("revision"), dtype=dtype, trust_remote_code=trust,
                             from_pretrained_kwargs=tuple(sorted(extra.items())), origin="opt_model marker")
    else:
        model = ModelRequest(default_model, origin=default_model_source)
    baseline_mark = item.get_closest_marker("opt_baseline")
    if baseline_mark is not None:
        baseline = list(bind_marker(baseline_mark).arguments.get("techniques", ()))
        origin = "opt_baseline marker"
        if not baseline:
            baseline, origin = ["eager"], "opt_baseline marker (empty: eager)"
    else:
        baseline, origin = list(default_baseline), "default"
    return MarkedTest(model=model, techniques=techniques, budgets=budgets, baseline=baseline, baseline_origin=origin)
