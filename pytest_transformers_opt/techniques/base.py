"""The technique protocol, the spec users write in markers, and the registry that resolves one into the other.

A ``TechniqueSpec`` is inert (a name and parameters), so writing ``techniques.quantized_cache(nbits=3)``
in a marker never breaks collection: parameters are validated when the registry resolves the spec at
the test's setup, and a bad one becomes that test's error.
"""

from __future__ import annotations

import contextlib
import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ..errors import OptConfigError

if TYPE_CHECKING:
    from ..engine.hardware import HardwareInfo

# Similarity classes, from strictest to loosest (budgets.default_similarity maps them to budgets).
# "8bit" holds 8-bit weights and KV caches quantized to 4 bits or more (their error was measured alike);
# "4bit" holds 4-bit weights and KV caches under 4 bits.
LOSSLESS, WEIGHTS_8BIT, LOSSY_4BIT = "lossless", "8bit", "4bit"
QUALITY_ORDER = (LOSSLESS, WEIGHTS_8BIT, LOSSY_4BIT)


@dataclass(frozen=True)
class TechniqueSpec:
    """What a marker names: a catalogue name (or hub kernel id) and its parameters."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, name: str, **params: Any) -> "TechniqueSpec":
        return cls(name, tuple(sorted(params.items())))

    def __str__(self) -> str:
        if not self.params:
            return self.name
        args = ", ".join(f"{k}={v!r}" for k, v in self.params)
        return f"{self.name}({args})"


@dataclass
class ProbeContext:
    """What a probe may look at: hardware facts and the model's config (never its weights)."""

    hardware: "HardwareInfo"
    model_config: Any = None  # a transformers PretrainedConfig, read from config.json
    dtype: str = "float32"


@dataclass
class LoadSettings:
    """Keyword arguments for ``from_pretrained``, built up by the load-time techniques."""

    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerationSettings:
    """How to generate: ``generate()`` keyword arguments, or ``generate_batch()`` for continuous batching."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    continuous_batching: dict[str, Any] | None = None  # ContinuousBatchingConfig kwargs when set
    compile: bool = False


@dataclass
class RunEvidence:
    """What one verified generation left behind, for the proof that each technique took effect."""

    cache: Any = None  # the cache object generate() used
    compiled: bool = False  # the forward ran under torch.compile: hooks inside its graph observe nothing
    attention_module_calls: int = 0
    attention_backend_calls: dict[str, int] | None = None  # None: not observed (e.g. compiled)
    compiled_calls: int = 0
    kernel_forward_calls: int = 0  # calls of a local kernel's layer forwards (kernels(local=...))
    used_generate_batch: bool = False
    finished_requests: int = 0
    requested: int = 0
    paged_cache_bytes: int | None = None  # continuous batching: bytes its paged KV cache preallocated
    # speculative decoding: verification steps, draft tokens proposed and accepted, the longest draft, the draft
    # model's forward calls (None: no speculative technique observed)
    draft: dict[str, int] | None = None
    notes: list[str] = field(default_factory=list)  # how this run was set up, for the result's notes


class Technique:
    """One optimization: what it needs, what it sets, how to prove it ran, how lossy it is."""

    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    requirement: ClassVar[str] = "nothing beyond transformers and torch"
    docs: ClassVar[str] = "https://huggingface.co/docs/transformers/main/en/optimization_overview"
    docs_title: ClassVar[str | None] = None  # the title of the ``docs`` page, for citing it
    overview_section: ClassVar[str | None] = None  # the section of the optimization overview that covers it
    min_capability: ClassVar[tuple[int, int] | None] = None  # the lowest CUDA compute capability it runs on
    package: ClassVar[str | None] = None  # the distribution it needs beyond transformers and torch
    quality: str = LOSSLESS  # a similarity class; an instance may set its own from its parameters
    exclusive_group: ClassVar[str | None] = None  # at most one technique of a group per configuration
    load_time: ClassVar[bool] = False  # part of the loaded model's identity (attention, quantization)
    compiled: ClassVar[bool] = False  # generation runs a torch.compile'd forward
    runs_in_subprocesses: ClassVar[bool] = False  # generation runs in torchrun workers, not in the test's process
    max_batch_size: ClassVar[int | None] = None  # the most sequences one generate call takes (None: any)
    compares_tokens_only: ClassVar[bool] = False  # generation returns tokens, no distributions (no KL budgets)
    example_params: ClassVar[dict[str, Any]] = {}  # parameters to probe the class with when no test names any
    accepted_params: ClassVar[dict[str, str]] = {}  # name -> description, for errors and --opt-techniques

    def __init__(self, **params: Any) -> None:
        unknown = sorted(set(params) - set(self.accepted_params))
        if unknown:
            accepted = ", ".join(f"{k} ({v})" for k, v in self.accepted_params.items()) or "none"
            raise OptConfigError(f"technique {self.name}: unknown parameter(s) {', '.join(unknown)}; accepted: {accepted}")
        self.params = params

    # -- identity ---------------------------------------------------------------------------------
    def label(self) -> str:
        return str(TechniqueSpec.of(self.name, **self.params))

    def __repr__(self) -> str:
        return f"<technique {self.label()}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Technique) and other.label() == self.label()

    def __hash__(self) -> int:
        return hash(self.label())

    # -- contract ---------------------------------------------------------------------------------
    def probe(self, ctx: ProbeContext) -> str | None:
        """Why this machine, its packages or the model cannot run the technique; None when it can."""
        return None

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        """Add ``from_pretrained`` arguments."""

    def configure_generation(self, gen: GenerationSettings, ctx: ProbeContext) -> None:
        """Add ``generate`` arguments."""

    def after_load(self, model: Any) -> None:
        """Change the model right after ``from_pretrained``, inside the load's time and memory (e.g. swap
        in kernels); raise to fail the test."""

    def prepare_generation(self, model: Any, gen: GenerationSettings) -> str | None:
        """Ready ``model`` for a run of this configuration, before its clock starts (e.g. install a compiled
        forward); returns the long one-time work its first generate call will do (a phrase for the terminal,
        e.g. "compiling with torch.compile"), or None."""
        return None

    def around_generate(self, model: Any) -> ContextManager[Any]:
        """A context entered around every generate (or ``generate_batch``) call of this configuration: warm-up,
        timed rounds, verified and forced runs (flags, hooks, profilers). The method is looked up after it is
        entered, so a ``generate``, ``forward`` or hook it installs on ``model`` is what runs; the clock spans
        it, enter and exit included. Undo on exit what it installed (the baseline may share the model)."""
        return contextlib.nullcontext()

    def observe(self, model: Any, evidence: RunEvidence) -> ContextManager[Any]:
        """A context entered around each generate call of a verified run (never a timed one): record into
        ``evidence`` what ``verify_run`` needs to see that the technique ran (counters, spies)."""
        return contextlib.nullcontext()

    def verify_loaded(self, model: Any) -> str | None:
        """A reason the loaded model shows no sign of the technique; None when it does."""
        return None

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        """A reason the generation did not use the technique (a silent fallback); None when it did."""
        return None

    def verify_census(self, census: dict[str, Any]) -> str | None:
        """A reason the execution census (``engine.census``: the ops, graphs and, on CUDA, kernels of one untimed
        generate call) shows the technique did not run, a silent fallback caught by counts; None when it did or
        the census cannot tell."""
        return None

    def conflicts_with(self, other: "Technique") -> str | None:
        """Why the two cannot be stacked (beyond sharing an exclusive group)."""
        return None


class TechniqueRegistry:
    """Catalogue name -> technique class; projects add theirs through ``pytest_opt_register_techniques``."""

    def __init__(self) -> None:
        self._classes: dict[str, type[Technique]] = {}
        self._origin: dict[str, str] = {}

    def register(self, technique_class: type[Technique], *, replace: bool = False, origin: str = "") -> None:
        """Add a technique class under its ``name``; a clash with an existing name is an error unless ``replace``."""
        name = getattr(technique_class, "name", "")
        if not isinstance(technique_class, type) or not issubclass(technique_class, Technique) or not name:
            raise OptConfigError(
                f"pytest_opt_register_techniques: {technique_class!r} is not a Technique subclass with a `name`"
            )
        if name in self._classes and not replace:
            raise OptConfigError(
                f"pytest_opt_register_techniques: technique {name!r} is already registered "
                f"(by {self._origin.get(name) or 'the built-in catalogue'}); pass replace=True to override it"
            )
        self._classes[name] = technique_class
        self._origin[name] = origin

    def names(self) -> list[str]:
        return sorted(self._classes)

    def classes(self) -> list[type[Technique]]:
        return [self._classes[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def resolve(self, spec: "str | TechniqueSpec | Technique", where: str = "optimization marker") -> Technique:
        """A ready technique from a name, a hub kernel id, a ``TechniqueSpec`` or a technique instance."""
        if isinstance(spec, Technique):
            return spec
        if isinstance(spec, str):
            spec = TechniqueSpec.of(spec)
        if not isinstance(spec, TechniqueSpec):
            raise OptConfigError(
                f"{where}: {spec!r} is not a technique; give a catalogue name such as 'sdpa' or "
                f"techniques.NAME(...) from pytest_transformers_opt"
            )
        params = dict(spec.params)
        if spec.name in self._classes:
            return self._classes[spec.name](**params)
        if "/" in spec.name and "hub_kernel" in self._classes:
            return self._classes["hub_kernel"](repo_id=spec.name, **params)
        close = difflib.get_close_matches(spec.name, self.names(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise OptConfigError(
            f"{where}: unknown technique {spec.name!r}.{hint} Known: {', '.join(self.names())}, "
            f"or a hub kernel id such as 'kernels-community/flash-attn2'."
        )


def check_stack(stack: list[Technique], where: str = "optimization marker") -> None:
    """Raise on a technique given twice or two that cannot be stacked."""
    from ..errors import OptTechniqueConflict

    seen: dict[str, Technique] = {}
    for technique in stack:
        if technique.name in seen:
            raise OptTechniqueConflict(f"{where}: technique {technique.name!r} is given twice")
        seen[technique.name] = technique
    for i, first in enumerate(stack):
        for second in stack[i + 1 :]:
            if first.exclusive_group and first.exclusive_group == second.exclusive_group:
                raise OptTechniqueConflict(
                    f"{where}: {first.label()} and {second.label()} conflict: both set the {first.exclusive_group}; "
                    f"choose one"
                )
            reason = first.conflicts_with(second) or second.conflicts_with(first)
            if reason:
                raise OptTechniqueConflict(f"{where}: {first.label()} and {second.label()} conflict: {reason}")


# ---------------------------------------------------------------- shared by the technique families
DOCS = "https://huggingface.co/docs/transformers/main/en"
HALF_DTYPES = ("float16", "bfloat16")


def checked_probe(technique: Technique, ctx: ProbeContext) -> str | None:
    """``technique.probe(ctx)``, checked: a custom technique's probe that returns anything but None or a
    reason is a bug in that technique, named as one (not a skip with a reason of ``42``)."""
    reason = technique.probe(ctx)
    if reason is None or (isinstance(reason, str) and reason.strip()):
        return reason
    raise OptConfigError(f"technique {technique.label()}: probe() returned {reason!r} ({type(reason).__name__}); "
                         f"it must return None when the technique can run here, or a non-empty str saying why not")


def version_ok(installed: str | None, spec: str) -> bool:
    if installed is None:
        return False
    try:
        return Version(installed) in SpecifierSet(spec)
    except (InvalidVersion, InvalidSpecifier):
        return False


# ---------------------------------------------------------------- reading a census (engine.census) in a proof
def census_decode_steps(census: dict[str, Any]) -> int | None:
    """The census call's decode steps; None where it cannot mark them (generate_batch: continuous batching's
    forwards run in its own thread, outside what the census counts, so no proof reads its ops)."""
    steps = census.get("decode_steps")
    return steps if isinstance(steps, int) else None


def census_compiled(census: dict[str, Any]) -> bool:
    """The census is a compiled configuration's: its decode steps' ops are the ATen ops inductor's code calls, not
    the eager ones (inductor fuses an in-place cache write, and may lower attention to another op)."""
    return "compiled_calls" in census


def census_ops(census: dict[str, Any], prefixes: tuple[str, ...], per_step: bool) -> dict[str, float]:
    """The census's ops whose names start with one of ``prefixes`` (per decode step, or in the whole call), with
    their counts; none that ran zero times."""
    ops = (census.get("ops_per_step") if per_step else census.get("ops")) or {}
    return {name: count for name, count in ops.items() if name.startswith(prefixes) and count}
