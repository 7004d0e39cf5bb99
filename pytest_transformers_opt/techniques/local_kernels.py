"""Kernels from a local folder (``techniques.kernels(local=..., layers=...)``): a team pins and vendors its kernels.

A local kernel repository is what the ``kernels`` library's ``get_local_kernel`` loads: one folder per build
variant, ``build/<variant>/metadata.json`` next to the Python package (``build/torch-cpu/<name>/__init__.py``
whose ``layers`` submodule holds the layer classes). Nothing here touches the network.

Why ``kernels.kernelize`` and not transformers' ``use_kernels=True, kernel_config=KernelConfig(use_local_kernel=True)``:
transformers (5.20-5.22, the releases that accept kernels 0.17) maps local kernels only for the devices in
``KERNELS_SUPPORTED_DEVICE_TYPES``, which leaves out ``cpu`` ("Only devices in [...] are supported, got: cpu"),
and its ``kernelize`` keeps the original forward when a kernel cannot be loaded (``KernelizeFallback.ALL``).
Calling ``kernels.kernelize`` with our own mapping works on every device and falls back only for layers the
mapping does not name, so a kernel that cannot load fails the test instead of passing on the original forward.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from ..compat import kernelized_functions
from ..errors import OptConfigError

# Noarch build folders that run on any CPU (kernel-builder's names).
CPU_BUILDS = ("torch-cpu", "torch-universal")


def normalise_layers(value: Any) -> dict[str, str]:
    """``layers=`` as {transformers layer name: layer class in the kernel's ``layers`` module}.

    Accepted: a dict, one name, or a list of names (a name alone means the same name on both sides).
    """
    if isinstance(value, str):
        value = {value: value}
    elif isinstance(value, (list, tuple)):
        value = {name: name for name in value}
    if not isinstance(value, dict) or not value or not all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in value.items()):
        raise OptConfigError(
            f"technique kernels: layers={value!r} is not accepted; give {{transformers layer name: layer class in "
            f"the kernel's `layers` module}}, e.g. layers={{'RMSNorm': 'RMSNorm'}}, or a name / list of names"
        )
    return dict(value)


def _builds(root: Path) -> list[Path]:
    """Build folders holding a metadata.json, where ``get_local_kernel`` looks: ``build/*``, ``*``, the folder itself."""
    found = []
    for base in (root / "build", root):
        if base.is_dir():
            found += sorted(p for p in base.iterdir() if (p / "metadata.json").is_file())
    if (root / "metadata.json").is_file():
        found.append(root)
    return found


def check_local_folder(local: Any) -> Path:
    """The kernel repository folder ``local=`` names; a config error when it is missing or holds no build."""
    if not isinstance(local, (str, os.PathLike)) or not str(local):
        raise OptConfigError(f"technique kernels: local={local!r} is not accepted; give the path of a local kernel "
                             f"repository (the folder holding build/<variant>/metadata.json)")
    root = Path(local).expanduser().resolve()
    if not root.is_dir():
        raise OptConfigError(f"technique kernels: local={str(local)!r} does not exist or is not a folder "
                             f"(resolved to {root}); give the path of a local kernel repository")
    builds = _builds(root)
    if not builds:
        listed = sorted(p.name for p in (root / "build").iterdir()) if (root / "build").is_dir() else []
        found = f"build/ holds {', '.join(listed)} without a metadata.json" if listed else "no build/ folder"
        raise OptConfigError(f"technique kernels: local={str(local)!r} holds no kernel build: expected "
                             f"build/<variant>/metadata.json (e.g. build/torch-cpu/metadata.json); found: {found}")
    for build in builds:
        try:
            json.loads((build / "metadata.json").read_text())
        except (OSError, ValueError) as exc:
            raise OptConfigError(f"technique kernels: {build / 'metadata.json'} is not valid JSON: {exc}") from None
    return root


def _kernels_submodule(name: str) -> Any:
    """``kernels.<name>``: public up to kernels 0.18, under ``kernels._internals`` from 0.19 (which transformers 5.25
    installs). None when this kernels release has neither; callers then fall back to what loading checks."""
    import importlib

    for path in (f"kernels.{name}", f"kernels._internals.{name}"):
        try:
            return importlib.import_module(path)
        except ImportError:
            continue
    return None


def _backend(device_type: str) -> str | None:
    """The kernels backend for a device: 'cpu' by name, else the one torch was built for (kernels' default)."""
    return "cpu" if device_type == "cpu" else None


def _resolve_build(root: Path, device_type: str) -> tuple[Path | None, list[str]]:
    """The build folder ``get_local_kernel`` would pick for ``device_type``, and why the others were rejected."""
    variants = _kernels_submodule("variants")
    get_variants_local = getattr(variants, "get_variants_local", None)
    resolve_variant = getattr(variants, "resolve_variant", None)
    if get_variants_local is None or resolve_variant is None:  # another kernels release: by folder name
        for build in _builds(root):
            if device_type == "cpu" and build.name in CPU_BUILDS:
                return build, []
        return None, [p.name for p in _builds(root)]
    rejected: list[str] = []
    for base in (root / "build", root):
        variant, trace = resolve_variant(get_variants_local(base), _backend(device_type))
        if variant is not None:
            return base / variant.variant_str, []
        rejected += [f"{d.variant.variant_str} ({d.reason})" for d in trace if getattr(d, "reason", None)]
    if (root / "metadata.json").is_file():  # the folder is a build itself
        return root, []
    return None, rejected or [p.name for p in _builds(root)]


def build_problem(root: Path, device_type: str, what: str) -> str | None:
    """Why this machine cannot run the local kernel (a skip reason), before any model is loaded; None when it can."""
    flag = os.environ.get("USE_HUB_KERNELS", "YES")
    if flag.upper() not in ("1", "ON", "YES", "TRUE"):  # transformers' switch: off, no layer is marked for kernels
        return f"{what} needs transformers' kernel layers enabled (USE_HUB_KERNELS unset or 1); found: USE_HUB_KERNELS={flag}"
    build, rejected = _resolve_build(root, device_type)
    if build is None:
        need = "a torch-cpu (or torch-universal) build" if device_type == "cpu" else f"a build for {device_type}"
        return f"{what} needs {need} of the local kernel; found: {'; '.join(rejected) or 'none'}"
    try:
        from kernels import Metadata
        from kernels import __version__ as kernels_version

        metadata = Metadata.read_from_file(build / "metadata.json")
    except Exception as exc:  # a metadata format this kernels release does not read
        return f"{what} needs a build metadata.json that this kernels release reads; found: {type(exc).__name__}: {exc}"
    minver = getattr(metadata, "kernels_minver", None)
    if minver is not None:
        from packaging.version import Version

        if Version(kernels_version).release < Version(str(minver)).release:
            return f"{what} needs kernels >= {minver} (the build's kernels-minver); found: kernels {kernels_version}"
    depends = [d.repo_id for d in getattr(metadata, "kernel_depends", [])]
    if depends:  # resolving them means the Hub; a vendored kernel must stand alone
        return f"{what} needs a self-contained kernel (offline); found: kernel dependencies {', '.join(depends)}"
    validate_variant_dependencies = getattr(_kernels_submodule("python_deps"), "validate_variant_dependencies", None)
    if validate_variant_dependencies is None:  # another kernels release: loading will check
        return None
    try:
        validate_variant_dependencies(build)
    except Exception as exc:  # ImportError for a missing package, ValueError for one kernels does not know
        return f"{what} needs the kernel's Python dependencies; found: {exc}"
    return None


class LocalLayer:
    """A layer class from a local kernel build, as a ``kernels`` repository (``load()``, hashable for its cache).

    Like ``kernels.LocalLayerRepository``, but it loads the build for the model's device ('cpu' by name)
    instead of the backend torch was built for, as the probe does.
    """

    def __init__(self, root: Path, layer_name: str, device_type: str) -> None:
        self.root, self.layer_name, self.device_type = root, layer_name, device_type

    def load(self) -> Any:
        """The kernel's layer class (a ``torch.nn.Module`` subclass with the kernel's ``forward``)."""
        from kernels import get_local_kernel

        kernel = get_local_kernel(self.root, backend=_backend(self.device_type))
        layers = getattr(kernel, "layers", None)
        layer = getattr(layers, self.layer_name, None)
        if layer is None:
            import torch

            found = sorted(n for n, v in vars(layers).items() if isinstance(v, type) and issubclass(v, torch.nn.Module)
                           ) if layers is not None else []
            where = "its `layers` module" if layers is not None else "it (no `layers` module)"
            raise OptConfigError(f"technique kernels: the local kernel {self.root} has no layer {self.layer_name!r} in "
                                 f"{where}; found: {', '.join(found) or 'none'}")
        return layer

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalLayer) and (other.root, other.layer_name, other.device_type) == (
            self.root, self.layer_name, self.device_type)

    def __hash__(self) -> int:
        return hash((self.root, self.layer_name, self.device_type))

    def __str__(self) -> str:
        return f"`{self.root}` (layer `{self.layer_name}`)"


def kernel_targets(model: Any) -> Iterator[tuple[str, Any]]:
    """(layer name, module) for every layer module marked with ``use_kernel_forward_from_hub``."""
    for module in model.modules():
        name = getattr(type(module), "kernel_layer_name", None)
        if name is not None:
            yield str(name), module


def _function_kernels(model: Any) -> set[str]:
    """Names of the functions attached with ``use_kernelized_func`` (e.g. Llama's 'rotary_pos_emb')."""
    return {str(getattr(type(f), "kernel_layer_name", "")) for m in model.modules()
            for f in kernelized_functions(m).values()}


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """kernels warns once per layer it has no mapping for; here that is every layer we did not name."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# Where the kernel forwards ride on a kernelized model: a cached model serves tests whose technique
# instances never kernelized it, and they still need the forwards for their proof.
_FORWARDS = "_opt_local_kernel_forwards"


def kernel_forwards(model: Any) -> dict[str, Any] | None:
    """{layer name: kernel forward} of a model ``kernelize_local`` kernelized; None for any other model."""
    return getattr(model, _FORWARDS, None)


def kernelize_local(model: Any, root: Path, layers: dict[str, str]) -> dict[str, Any]:
    """Replace the forward of the named layers by the local kernel's; returns {layer name: kernel forward}.

    A kernel that cannot be imported, lacks a layer or fails kernels' layer checks raises (the test fails);
    only layers the mapping does not name keep their forward.
    """
    import kernels
    from kernels import Mode, kernelize, use_kernel_mapping

    device_type = model.device.type
    registered = sorted({name for name, _ in kernel_targets(model)})
    # A decorated function is one module object shared by every model in the process: kernelizing it
    # would hand the kernel to the baseline too, so only layer modules are accepted.
    functions = sorted(set(layers) & _function_kernels(model))
    if functions:
        raise OptConfigError(f"technique kernels: layers names {', '.join(map(repr, functions))}, a function kernel "
                             f"shared by every model in the process (the baseline too); local kernels replace layer "
                             f"modules only: {', '.join(registered) or 'none'}")
    unknown = sorted(set(layers) - set(registered))
    if unknown:
        hint = "" if registered else " (transformers marks layers only when it accepts the installed kernels)"
        raise OptConfigError(f"technique kernels: layers names {', '.join(map(repr, unknown))}, which no layer of "
                             f"{type(model).__name__} registers; registered: {', '.join(registered) or 'none'}{hint}")
    repos = {name: LocalLayer(root, kernel_layer, device_type) for name, kernel_layer in layers.items()}
    forwards = {name: repo.load().forward for name, repo in repos.items()}
    fallback = getattr(kernels, "KernelizeFallback", None)
    # Without the hub mapping transformers registers (inherit_mapping=False): only our layers, never the network.
    with _quiet("kernels"), use_kernel_mapping({n: {device_type: r} for n, r in repos.items()}, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE, device=device_type,
                  use_fallback=fallback.NO_LAYER if fallback is not None else True)
    setattr(model, _FORWARDS, forwards)
    return forwards


def fallback_layers(model: Any, forwards: dict[str, Any]) -> list[str]:
    """'NAME (k of n layers run Class.forward)' for each named layer whose forward is not the kernel's."""
    from collections import Counter

    total: Counter[str] = Counter()
    other: Counter[tuple[str, str]] = Counter()
    for name, module in kernel_targets(model):
        if name in forwards:
            total[name] += 1
            if getattr(module.forward, "__func__", None) is not forwards[name]:
                other[(name, str(getattr(module.forward, "__qualname__", module.forward)))] += 1
    return [f"{name} ({count} of {total[name]} layers run {forward})" for (name, forward), count in sorted(other.items())]


@contextlib.contextmanager
def count_kernel_calls(model: Any, forwards: dict[str, Any], calls: list[int]) -> Iterator[None]:
    """Count calls of the kernel forwards while the context is open (``calls[0]``); layers whose forward is
    not the kernel's are not counted, so a silent fallback shows as zero calls."""
    wrapped: list[tuple[Any, Any]] = []
    for name, module in kernel_targets(model):
        bound = module.forward
        if name not in forwards or getattr(bound, "__func__", None) is not forwards[name]:
            continue

        def counted(*args: Any, _bound: Any = bound, **kwargs: Any) -> Any:
            calls[0] += 1
            return _bound(*args, **kwargs)

        module.forward = counted
        wrapped.append((module, bound))
    try:
        yield
    finally:
        for module, bound in wrapped:
            module.forward = bound
