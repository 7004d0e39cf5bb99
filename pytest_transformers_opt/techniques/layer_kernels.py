"""Hub and local layer kernels (the ``kernels`` package), and the version window transformers accepts."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from ..compat import package_version
from ..errors import OptConfigError
from .base import DOCS, LoadSettings, ProbeContext, RunEvidence, Technique, version_ok


def kernels_window() -> str:
    """The ``kernels`` versions the installed transformers accepts (from its dependency table)."""
    try:
        from transformers.dependency_versions_table import deps

        return deps.get("kernels", "kernels").removeprefix("kernels") or "any"
    except Exception:
        return "unknown"


def kernels_problem() -> str | None:
    installed = package_version("kernels")
    window = kernels_window()
    transformers_version = package_version("transformers")
    if installed is None:
        return f"the kernels package ({window} for transformers {transformers_version}); found: not installed"
    if window not in ("any", "unknown") and not version_ok(installed, window):
        return f"kernels {window} (demanded by transformers {transformers_version}); found: kernels {installed}"
    return None


def hub_cache_problem(repo_id: str) -> str | None:
    """Hub kernels load from the Hugging Face cache, and GPU CI runners are often offline: a kernel that
    is not cached is a skip that says how to fetch it, not a failed download mid-test."""
    try:
        from huggingface_hub import constants

        cache = Path(constants.HF_HUB_CACHE)
    except Exception:  # huggingface_hub comes with transformers; this is only a fallback
        cache = Path(os.environ.get("HF_HUB_CACHE") or Path.home() / ".cache" / "huggingface" / "hub")
    repo = repo_id.split("@")[0].split(":")[0]  # "org/name@rev" or "org/name:layer" name the same repo
    snapshots = cache / f"models--{repo.replace('/', '--')}" / "snapshots"
    if snapshots.is_dir() and any(snapshots.iterdir()):
        return None
    return (f"the kernel {repo} in the local Hugging Face cache (runners are often offline); found: not in "
            f"{cache} (fetch it once with `hf download {repo}`)")


# --- attention backends -------------------------------------------------------------------------


class Kernels(Technique):
    """Hub layer kernels (``use_kernels=True``), or with ``local=`` the layers of a kernel build in a folder.

    ``techniques.kernels(local="vendor/rms-norm", layers={"RMSNorm": "RMSNorm"})`` replaces the forward of every
    layer registered as ``RMSNorm`` (``use_kernel_forward_from_hub("RMSNorm")``, e.g. LlamaRMSNorm) by the class
    ``RMSNorm`` of the kernel's ``layers`` module, on the model's device; see ``local_kernels`` for why through
    ``kernels.kernelize`` right after load.
    """

    name = "kernels"
    family = "kernels"
    load_time = True
    summary = "hub kernels for layers (use_kernels=True), or a local kernel build (local=, layers=)"
    requirement = ("the kernels package in the version window transformers demands; hub kernels: a CUDA GPU and "
                   "the kernels cached locally; local=: a build of the kernel for this device (torch-cpu on cpu)")
    docs = f"{DOCS}/kernel_doc/overview"
    docs_title = "Kernels"
    overview_section = "Kernels"
    package = "kernels"
    accepted_params = {"local": "path of a local kernel repository (build/<variant>/metadata.json + package), "
                                "absolute or relative to the current directory",
                       "layers": "{transformers layer name: layer class in the kernel's `layers` module}, "
                                 "e.g. {'RMSNorm': 'RMSNorm'}; with local="}

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        from . import local_kernels

        self._root: Path | None = None
        self._layers: dict[str, str] = {}
        if "layers" in params and "local" not in params:
            raise OptConfigError("technique kernels: layers= names layers of a local kernel; give local= too "
                                 "(hub kernels use transformers' own mapping)")
        if "local" in params:
            if "layers" not in params:
                raise OptConfigError("technique kernels: local= needs layers={transformers layer name: layer class "
                                     "in the kernel's `layers` module}, e.g. layers={'RMSNorm': 'RMSNorm'}")
            self._layers = local_kernels.normalise_layers(params["layers"])
            self._root = local_kernels.check_local_folder(params["local"])  # config error: missing / no build

    def _what(self) -> str:
        return f"kernels(local={str(self.params['local'])!r})" if self._root else "kernels"

    def probe(self, ctx: ProbeContext) -> str | None:
        problem = kernels_problem()
        if problem:
            return f"{self._what()} needs {problem}"
        if self._root is not None:  # no CUDA requirement: a build for this device will do
            from .local_kernels import build_problem

            return build_problem(self._root, ctx.hardware.device_type, self._what())
        if not ctx.hardware.is_cuda:
            return f"kernels needs a CUDA GPU for the hub's layer kernels; found: {ctx.hardware.describe()}"
        return None

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        if self._root is None:
            load.kwargs["use_kernels"] = True

    def after_load(self, model: Any) -> None:
        if self._root is not None:
            from .local_kernels import kernelize_local

            kernelize_local(model, self._root, self._layers)

    def verify_loaded(self, model: Any) -> str | None:
        if self._root is None:
            if not getattr(model, "use_kernels", False):
                return "kernels was requested but the model reports use_kernels=False"
            return None
        from .local_kernels import fallback_layers, kernel_forwards

        forwards = kernel_forwards(model)
        if not forwards:
            return f"{self._what()}: the loaded model was not kernelized"
        missing = fallback_layers(model, forwards)
        if missing:
            return f"{self._what()}: these layers kept a forward other than the kernel's: {', '.join(missing)}"
        return None

    @contextlib.contextmanager
    def observe(self, model: Any, evidence: RunEvidence) -> Iterator[None]:
        from .local_kernels import count_kernel_calls, kernel_forwards

        forwards = kernel_forwards(model)
        if self._root is None or forwards is None:
            yield
            return
        calls = [0]
        try:
            with count_kernel_calls(model, forwards, calls):
                yield
        finally:
            evidence.kernel_forward_calls += calls[0]

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if self._root is None:
            return None
        from .local_kernels import fallback_layers, kernel_forwards

        forwards = kernel_forwards(model) or {}
        missing = fallback_layers(model, forwards)
        if not forwards or missing:
            return f"{self._what()}: these layers do not run the kernel's forward: {', '.join(missing) or 'all'}"
        if not evidence.kernel_forward_calls and not evidence.compiled_calls:  # inside a compiled graph calls are not seen
            return (f"{self._what()}: the kernel's layers ({', '.join(sorted(self._layers.values()))}) never ran "
                    f"during generation")
        return None
