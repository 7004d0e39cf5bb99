"""The built-in technique catalogue (SPEC.md, section Techniques).

Each class states what it needs (``probe``), what it sets (``configure_*``), how it proves that it
ran (``verify_*``), how lossy it is (``quality``) and where it is documented (``docs``).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any, ClassVar, Iterator

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ..errors import OptConfigError
from ..compat import module_available, package_version
from .base import LOSSY_4BIT, WEIGHTS_8BIT, GenerationSettings, LoadSettings, ProbeContext, RunEvidence, Technique

DOCS = "https://huggingface.co/docs/transformers/main/en"
HALF_DTYPES = ("float16", "bfloat16")


def _model_class(config: Any) -> Any:
    """The causal-LM class transformers would instantiate for ``config`` (None when unknown)."""
    if config is None:
        return None
    try:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM._model_mapping[type(config)]
    except Exception:
        return None


def _model_flag(config: Any, flag: str) -> bool | None:
    cls = _model_class(config)
    return None if cls is None else bool(getattr(cls, flag, False))


def _version_ok(installed: str | None, spec: str) -> bool:
    if installed is None:
        return False
    try:
        return Version(installed) in SpecifierSet(spec)
    except (InvalidVersion, InvalidSpecifier):
        return False


def kernels_window() -> str:
    """The ``kernels`` versions the installed transformers accepts (from its dependency table)."""
    try:
        from transformers.dependency_versions_table import deps

        return deps.get("kernels", "kernels").removeprefix("kernels") or "any"
    except Exception:
        return "unknown"


def _kernels_problem() -> str | None:
    installed = package_version("kernels")
    window = kernels_window()
    transformers_version = package_version("transformers")
    if installed is None:
        return f"the kernels package ({window} for transformers {transformers_version}); found: not installed"
    if window not in ("any", "unknown") and not _version_ok(installed, window):
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
class AttentionBackend(Technique):
    family = "attention"
    exclusive_group = "attention implementation"
    load_time = True
    implementation: ClassVar[str] = ""
    model_flag: ClassVar[str | None] = None
    docs = f"{DOCS}/attention_interface"

    @property
    def impl(self) -> str:
        return self.implementation or self.name

    def probe(self, ctx: ProbeContext) -> str | None:
        if self.model_flag and _model_flag(ctx.model_config, self.model_flag) is False:
            arch = getattr(ctx.model_config, "model_type", "this model")
            return f"{self.label()} needs a model class that supports it ({self.model_flag}); found: {arch} does not"
        return None

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        load.kwargs["attn_implementation"] = self.impl

    def verify_loaded(self, model: Any) -> str | None:
        actual = getattr(model.config, "_attn_implementation", None)
        if actual != self.impl:
            return f"{self.label()} was requested but the loaded model uses attention {actual!r}"
        return None

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if evidence.attention_backend_calls is None:  # not observable (e.g. inside a compiled graph)
            return None
        if evidence.attention_module_calls == 0:
            return f"{self.label()}: no attention module ran during generation"
        ran = {k: v for k, v in evidence.attention_backend_calls.items() if v}
        if self.impl == "eager":
            if ran:
                return f"eager attention was requested but {', '.join(ran)} ran instead"
            return None
        if not evidence.attention_backend_calls.get(self.impl):
            found = ", ".join(ran) or "eager"
            return f"{self.label()} was requested but its attention function never ran; found: {found}"
        return None


class Eager(AttentionBackend):
    name = "eager"
    summary = "plain PyTorch attention (the reference implementation)"


class Sdpa(AttentionBackend):
    name = "sdpa"
    model_flag = "_supports_sdpa"
    summary = "torch.nn.functional.scaled_dot_product_attention"
    requirement = "a model class that supports SDPA"


class FlexAttention(AttentionBackend):
    name = "flex_attention"
    model_flag = "_supports_flex_attn"
    summary = "PyTorch FlexAttention (compiled block-sparse attention)"
    requirement = "torch >= 2.5 and a model class that supports flex attention; compiles on first use"

    def probe(self, ctx: ProbeContext) -> str | None:
        torch_version = ctx.hardware.version("torch")
        if not _version_ok((torch_version or "0").split("+")[0], ">=2.5"):
            return f"flex_attention needs torch >= 2.5; found: torch {torch_version}"
        return super().probe(ctx)


class FlashAttention2(AttentionBackend):
    name = "flash_attention_2"
    model_flag = "_supports_flash_attn"
    summary = "FlashAttention-2 kernels (flash-attn package)"
    requirement = "the flash-attn package, a CUDA GPU of compute capability >= 8.0, fp16/bf16"
    min_capability: ClassVar[tuple[int, int]] = (8, 0)
    package: ClassVar[str] = "flash-attn"
    module: ClassVar[str] = "flash_attn"

    def probe(self, ctx: ProbeContext) -> str | None:
        hw = ctx.hardware
        need = f"{self.name} needs a CUDA GPU of compute capability >= {self.min_capability[0]}.{self.min_capability[1]}"
        if not hw.is_cuda:
            return f"{need}; found: {hw.describe()}"
        if hw.compute_capability is None or tuple(hw.compute_capability) < self.min_capability:
            return f"{need}; found: {hw.describe()}"
        if not module_available(self.module):
            return f"{self.name} needs the {self.package} package; found: not installed"
        if ctx.dtype not in HALF_DTYPES:
            return f"{self.name} needs dtype float16 or bfloat16; found: {ctx.dtype}"
        return super().probe(ctx)


class FlashAttention3(FlashAttention2):
    name = "flash_attention_3"
    summary = "FlashAttention-3 kernels for Hopper GPUs"
    requirement = "the flash_attn_3 package (flash_attn_interface), a Hopper GPU (compute capability 9.x), fp16/bf16"
    min_capability = (9, 0)
    package = "flash_attn_3"
    module = "flash_attn_interface"


class HubKernelAttention(AttentionBackend):
    """An attention kernel from the Hub, e.g. ``"kernels-community/flash-attn2"``."""

    name = "hub_kernel"
    summary = "an attention kernel from the Hub through the kernels library (give its repo id)"
    requirement = "the kernels package in the version window transformers demands, a CUDA GPU, the kernel cached locally"
    accepted_params = {"repo_id": "the kernel's Hub id, e.g. 'kernels-community/flash-attn2'"}
    docs = f"{DOCS}/kernel_doc/overview"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        repo = params.get("repo_id")
        if not isinstance(repo, str) or repo.count("/") < 1:
            raise OptConfigError(f"hub kernel: repo_id must look like 'org/name'; got {repo!r}")

    @property
    def impl(self) -> str:
        return self.params["repo_id"]

    def label(self) -> str:
        return self.impl

    def probe(self, ctx: ProbeContext) -> str | None:
        problem = _kernels_problem()
        if problem:
            return f"{self.impl} needs {problem}"
        if not ctx.hardware.is_cuda:
            return f"{self.impl} needs a CUDA GPU; found: {ctx.hardware.describe()}"
        problem = hub_cache_problem(self.impl)
        return f"{self.impl} needs {problem}" if problem else None

    def verify_loaded(self, model: Any) -> str | None:
        actual = str(getattr(model.config, "_attn_implementation", ""))
        if self.impl not in actual:
            return f"{self.impl} was requested but the loaded model uses attention {actual!r}"
        return None

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if evidence.attention_backend_calls is None:
            return None
        if not any(v for k, v in evidence.attention_backend_calls.items() if self.impl in k):
            return f"{self.impl} was requested but its attention function never ran"
        return None


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
    accepted_params = {"local": "path of a local kernel repository (build/<variant>/metadata.json + package), "
                                "absolute or relative to the current directory",
                       "layers": "{transformers layer name: layer class in the kernel's `layers` module}, "
                                 "e.g. {'RMSNorm': 'RMSNorm'}; with local="}

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        from . import local_kernels

        self._root: Path | None = None
        self._layers: dict[str, str] = {}
        self._last_calls: int | None = None  # kernel forward calls in the latest generate (local=)
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
        problem = _kernels_problem()
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
    def around_generate(self, model: Any) -> Iterator[None]:
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
            self._last_calls = calls[0]

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if self._root is None:
            return None
        from .local_kernels import fallback_layers, kernel_forwards

        forwards = kernel_forwards(model) or {}
        missing = fallback_layers(model, forwards)
        if not forwards or missing:
            return f"{self._what()}: these layers do not run the kernel's forward: {', '.join(missing) or 'all'}"
        if not self._last_calls and not evidence.compiled_calls:  # inside a compiled graph calls are not seen
            return (f"{self._what()}: the kernel's layers ({', '.join(sorted(self._layers.values()))}) never ran "
                    f"during generation")
        return None


# --- compilation ----------------------------------------------------------------------------------
class Compile(Technique):
    name = "compile"
    family = "compilation"
    summary = "a static cache and torch.compile of the forward pass, on every device"
    requirement = "a compileable cache (static); on CPU a C++ compiler for inductor"
    docs = f"{DOCS}/llm_optims#static-kv-cache-and-torchcompile"
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
        # transformers compiles only on CUDA-like devices unless told; the plugin compiles everywhere.
        setattr(compile_config, "_compile_all_devices", True)  # transformers' own switch for this
        gen.kwargs["compile_config"] = compile_config
        gen.kwargs["disable_compile"] = False
        gen.kwargs.setdefault("cache_implementation", "static")
        gen.compile = True

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if evidence.compiled_calls <= 0:
            return "compile was requested but the compiled forward was never called (transformers fell back to eager)"
        return None

    def conflicts_with(self, other: Technique) -> str | None:
        if other.name in ("quantized_cache", "offloaded_cache"):
            return "torch.compile needs a compileable (static) cache"
        return None


# --- caches ---------------------------------------------------------------------------------------
class CacheTechnique(Technique):
    family = "caching"
    exclusive_group = "KV cache"
    cache_implementation: ClassVar[str] = ""
    docs = f"{DOCS}/kv_cache"

    def configure_generation(self, gen: GenerationSettings, ctx: ProbeContext) -> None:
        gen.kwargs["cache_implementation"] = self.cache_implementation

    def cache_layers(self, evidence: RunEvidence) -> list[str]:
        layers = getattr(evidence.cache, "layers", None) or []
        return [type(layer).__name__ for layer in layers]

    def conflicts_with(self, other: Technique) -> str | None:
        if other.name == "continuous_batching":
            return "continuous batching manages its own paged cache"
        return None


class StaticCacheTechnique(CacheTechnique):
    name = "static_cache"
    cache_implementation = "static"
    summary = "a pre-allocated, fixed-size KV cache (cache_implementation='static'), not compiled"

    def configure_generation(self, gen: GenerationSettings, ctx: ProbeContext) -> None:
        super().configure_generation(gen, ctx)
        # On CUDA transformers compiles a static cache by itself; keep the two effects apart so that
        # static_cache measures the cache and `compile` measures compilation.
        gen.kwargs.setdefault("disable_compile", True)

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        layers = self.cache_layers(evidence)
        if not layers or not all(name.startswith("Static") for name in layers):
            return f"static_cache was requested but generation used {type(evidence.cache).__name__} with layers {sorted(set(layers))}"
        return None


class SlidingWindowCache(CacheTechnique):
    name = "sliding_window_cache"
    cache_implementation = "static"
    summary = "a static cache whose sliding-window layers keep only the last window of tokens"
    requirement = "a model config with sliding_window set (e.g. Mistral, Qwen3 with use_sliding_window)"

    def probe(self, ctx: ProbeContext) -> str | None:
        if ctx.model_config is None:  # catalogue listing: depends on the model
            return None
        window = getattr(ctx.model_config, "sliding_window", None)
        if not window:
            arch = getattr(ctx.model_config, "model_type", "unknown")
            return f"sliding_window_cache needs a model with sliding-window attention (config.sliding_window); found: {arch} without one"
        return None

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        layers = self.cache_layers(evidence)
        if not any("SlidingWindow" in name for name in layers):
            return f"sliding_window_cache was requested but no sliding-window cache layer was used; found: {sorted(set(layers))}"
        return None


class OffloadedCacheTechnique(CacheTechnique):
    name = "offloaded_cache"
    cache_implementation = "offloaded"
    summary = "a dynamic KV cache offloaded to CPU memory, one layer on the GPU at a time"
    requirement = "a CUDA GPU (the cache is offloaded from GPU to CPU memory)"

    def probe(self, ctx: ProbeContext) -> str | None:
        if not ctx.hardware.is_cuda:
            return f"{self.name} needs a CUDA GPU to offload the cache from; found: {ctx.hardware.describe()}"
        return None

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if not getattr(evidence.cache, "offloading", False):
            return f"{self.name} was requested but the cache used ({type(evidence.cache).__name__}) is not offloading"
        return None


class OffloadedStaticCache(OffloadedCacheTechnique):
    name = "offloaded_static_cache"
    cache_implementation = "offloaded_static"
    summary = "a static KV cache offloaded to CPU memory"


class QuantizedCacheTechnique(CacheTechnique):
    name = "quantized_cache"
    cache_implementation = "quantized"
    quality = WEIGHTS_8BIT  # at nbits >= 4; fewer bits are set to LOSSY_4BIT below
    summary = "a KV cache quantized to nbits (quanto or hqq backend)"
    requirement = "optimum-quanto (backend='quanto') or hqq (backend='hqq')"
    accepted_params = {"backend": "'quanto' or 'hqq'", "nbits": "2 or 4 (quanto), 1-8 (hqq)",
                       "residual_length": "recent tokens kept unquantized (int)"}
    backends: ClassVar[dict[str, tuple[str, str]]] = {"quanto": ("optimum.quanto", "optimum-quanto"),
                                                      "hqq": ("hqq", "hqq")}

    def __init__(self, **params: Any) -> None:
        params.setdefault("backend", "quanto")
        params.setdefault("nbits", 4)
        super().__init__(**params)
        backend, nbits = params["backend"], params["nbits"]
        if backend not in self.backends:
            raise OptConfigError(f"quantized_cache: backend {backend!r} is not supported; accepted: 'quanto', 'hqq'")
        allowed = (2, 4) if backend == "quanto" else tuple(range(1, 9))
        if isinstance(nbits, bool) or not isinstance(nbits, int) or nbits not in allowed:
            raise OptConfigError(f"quantized_cache: nbits={nbits!r} is not accepted for backend {backend!r}; accepted: {allowed}")
        if nbits < 4:  # quanto 2-bit on smollm2-135m: KL 0.72-0.95, top-1 0.60-0.68 (benchmarks/RESULTS.md)
            self.quality = LOSSY_4BIT

    def probe(self, ctx: ProbeContext) -> str | None:
        module, package = self.backends[self.params["backend"]]
        if not module_available(module):
            return f"{self.label()} needs the {package} package; found: not installed"
        return None

    def configure_generation(self, gen: GenerationSettings, ctx: ProbeContext) -> None:
        gen.kwargs["cache_implementation"] = "quantized"
        gen.kwargs["cache_config"] = {"backend": self.params["backend"], "nbits": self.params["nbits"],
                                      **({"residual_length": self.params["residual_length"]}
                                         if "residual_length" in self.params else {})}

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        layers = self.cache_layers(evidence)
        expected = "Quanto" if self.params["backend"] == "quanto" else "HQQ"
        if not layers or not all(expected in name for name in layers):
            return f"{self.label()} was requested but the cache layers were {sorted(set(layers))}"
        return None


# --- weight quantization ----------------------------------------------------------------------------
class WeightQuantization(Technique):
    family = "quantization"
    exclusive_group = "weight quantization"
    load_time = True
    docs = f"{DOCS}/quantization/overview"
    layer_class_names: ClassVar[tuple[str, ...]] = ()

    def verify_loaded(self, model: Any) -> str | None:
        names = {type(m).__name__ for m in model.modules()}
        if not names & set(self.layer_class_names):
            return f"{self.label()} was requested but no {'/'.join(self.layer_class_names)} layer is in the model"
        return None


class _Bnb(WeightQuantization):
    requirement = "bitsandbytes >= 0.45 (0.50 has a CPU backend; older releases need CUDA)"
    docs = f"{DOCS}/quantization/bitsandbytes"

    def probe(self, ctx: ProbeContext) -> str | None:
        installed = ctx.hardware.version("bitsandbytes")
        if installed is None:
            return f"{self.name} needs the bitsandbytes package; found: not installed"
        if not ctx.hardware.is_cuda and not _version_ok(installed, ">=0.48"):
            return f"{self.name} on cpu needs bitsandbytes >= 0.48 (CPU backend); found: bitsandbytes {installed}"
        return None


class Bnb8bit(_Bnb):
    name = "bnb_8bit"
    quality = WEIGHTS_8BIT
    summary = "LLM.int8() 8-bit weights through bitsandbytes"
    layer_class_names = ("Linear8bitLt",)

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        from transformers import BitsAndBytesConfig

        load.kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)


class Bnb4bit(_Bnb):
    name = "bnb_4bit"
    quality = LOSSY_4BIT
    summary = "4-bit weights (nf4 or fp4) through bitsandbytes"
    layer_class_names = ("Linear4bit",)
    accepted_params = {"quant_type": "'nf4' or 'fp4'", "compute_dtype": "a torch dtype or its name",
                       "double_quant": "bool"}

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        if self.params.get("quant_type", "nf4") not in ("nf4", "fp4"):
            raise OptConfigError(f"bnb_4bit: quant_type={self.params['quant_type']!r}; accepted: 'nf4', 'fp4'")

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        from transformers import BitsAndBytesConfig

        from ..units import parse_dtype

        compute = self.params.get("compute_dtype") or ctx.dtype
        load.kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.params.get("quant_type", "nf4"),
            bnb_4bit_compute_dtype=parse_dtype(compute, "bnb_4bit compute_dtype"),
            bnb_4bit_use_double_quant=bool(self.params.get("double_quant", False)),
        )


class _ModuleQuantization(WeightQuantization):
    package: ClassVar[str] = ""
    module: ClassVar[str] = ""

    def probe(self, ctx: ProbeContext) -> str | None:
        if not module_available(self.module):
            return f"{self.name} needs the {self.package} package; found: not installed"
        return None


class QuantoInt8(_ModuleQuantization):
    name = "quanto_int8"
    quality = WEIGHTS_8BIT
    summary = "int8 weights through optimum-quanto"
    package, module = "optimum-quanto", "optimum.quanto"
    layer_class_names = ("QLinear",)
    docs = f"{DOCS}/quantization/quanto"

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        from transformers import QuantoConfig

        load.kwargs["quantization_config"] = QuantoConfig(weights="int8")


class HqqFourBit(_ModuleQuantization):
    name = "hqq_4bit"
    quality = LOSSY_4BIT
    summary = "4-bit weights through HQQ"
    package, module = "hqq", "hqq"
    layer_class_names = ("HQQLinear",)
    docs = f"{DOCS}/quantization/hqq"

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        from transformers import HqqConfig

        load.kwargs["quantization_config"] = HqqConfig(nbits=4, group_size=64)


class TorchaoInt8(_ModuleQuantization):
    name = "torchao_int8"
    quality = WEIGHTS_8BIT
    summary = "int8 weight-only quantization through torchao"
    package, module = "torchao", "torchao"
    docs = f"{DOCS}/quantization/torchao"

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        from torchao.quantization import Int8WeightOnlyConfig  # type: ignore[import-not-found]
        from transformers import TorchAoConfig

        load.kwargs["quantization_config"] = TorchAoConfig(quant_type=Int8WeightOnlyConfig())

    def verify_loaded(self, model: Any) -> str | None:
        quantized = [m for m in model.modules() if type(getattr(m, "weight", None)).__name__.endswith(("Tensor", "QuantizedTensor")) and type(m.weight).__name__ != "Parameter"]
        return None if quantized else "torchao_int8 was requested but no weight is a torchao quantized tensor"


# --- parallelism and batching ---------------------------------------------------------------------
def distributed_reason(device_type: str, device_count: int, tp_size: int) -> str | None:
    """Why torch.distributed cannot run ``tp_size`` ranks on this device type, or None."""
    import torch

    label = f"tensor_parallel(tp_size={tp_size})"
    try:
        import torch.distributed as dist

        available = dist.is_available()
    except Exception:  # pragma: no cover - torch builds without the module at all
        dist, available = None, False
    if not available:
        return f"{label} needs torch.distributed; found: torch {torch.__version__} built without it"
    if device_type == "cuda":
        if device_count < tp_size:
            return f"{label} needs {tp_size} CUDA devices; found: {device_count}"
        if not dist.is_nccl_available():
            return f"{label} on CUDA needs the nccl backend of torch.distributed; found: torch {torch.__version__} without nccl"
        return None
    if device_type == "cpu":
        if not dist.is_gloo_available():
            return f"{label} on CPU needs the gloo backend of torch.distributed; found: torch {torch.__version__} without gloo"
        return None
    return f"{label} needs {tp_size} CUDA devices or a CPU with gloo; found: {device_type}"


def tensor_parallel_probe(device_type: str, device_count: int, tp_size: int, model_config: Any) -> str | None:
    """The skip reason for ``tensor_parallel(tp_size)`` here, or None when it can run.

    Looks at the device, torch.distributed's backends and the model's config only (no weights).
    """
    reason = distributed_reason(device_type, device_count, tp_size)
    if reason or model_config is None:
        return reason
    model_type = getattr(model_config, "model_type", "?")
    if not getattr(model_config, "base_model_tp_plan", None):
        return f"tensor_parallel needs a model with a tp_plan; found: {model_type} without one"
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(text_config, "num_attention_heads", None)
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    uneven = [f"{n} {what}" for n, what in ((heads, "attention heads"), (kv_heads, "key/value heads"))
              if isinstance(n, int) and n % tp_size]
    if uneven:
        return (f"tensor_parallel(tp_size={tp_size}) needs attention heads and key/value heads divisible by "
                f"{tp_size}; found: {model_type} with {heads} attention heads and {kv_heads} key/value heads")
    return None


class TensorParallel(Technique):
    name = "tensor_parallel"
    family = "parallelism"
    load_time = True
    summary = "tensor parallelism through torch.distributed (the plugin launches torchrun; gloo on CPU)"
    requirement = "N CUDA devices (tp_size=N) or, on CPU, torch.distributed with gloo; a model with a tp_plan"
    accepted_params = {"tp_size": "number of processes/devices, int >= 2"}
    docs = f"{DOCS}/perf_infer_gpu_multi"

    def __init__(self, **params: Any) -> None:
        params.setdefault("tp_size", 2)
        super().__init__(**params)
        size = self.params["tp_size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise OptConfigError(f"tensor_parallel: tp_size={size!r}; accepted: an int >= 2")

    def probe(self, ctx: ProbeContext) -> str | None:
        return tensor_parallel_probe(ctx.hardware.device_type, ctx.hardware.device_count, self.params["tp_size"],
                                     ctx.model_config)

    def conflicts_with(self, other: Technique) -> str | None:
        if other.load_time and other.family != "attention":
            return "the torchrun workers load the model with tensor parallelism only (no other load-time technique)"
        if other.family in ("caching", "compilation", "continuous_batching"):
            return "the torchrun workers run plain greedy generate() with the attention backend only"
        return None


# Continuous batching sized by its workload (see ``size_continuous_batching``).
CB_BLOCK_MARGIN = 1.25  # headroom over the exact need: a scheduler that rounds up, a request that spills a block
CB_MAX_DERIVED_BATCH_TOKENS = 2048  # past it chunked prefill splits the prompts; the attention mask grows as its square


def size_continuous_batching(params: dict[str, Any], input_lengths: list[int], max_new_tokens: int,
                             page_size: int) -> tuple[dict[str, Any], dict[str, str]]:
    """``ContinuousBatchingConfig`` kwargs for this workload, and how each figure derived here was found.

    Rule: ``num_blocks = ceil(requests x ceil((max input tokens + max_new_tokens) / page_size) x 1.25)``
    (every request resident at once, as ``generate_batch()`` submits them all, plus a 25% margin), and
    ``max_batch_tokens = sum of the input lengths`` (every prompt prefills in one forward pass), at most
    2048. A value the user gives wins; ``max_memory_percent`` given without ``num_blocks`` keeps
    transformers' share-of-free-memory sizing. Without this, the paged cache takes a share of free
    memory (GiB for a 135M model), not what the workload needs.
    """
    config = dict(params)
    how: dict[str, str] = {}
    if input_lengths and "num_blocks" not in config and "max_memory_percent" not in config:
        longest, requests = max(input_lengths), len(input_lengths)
        per_request = math.ceil((longest + max_new_tokens) / page_size)
        config["num_blocks"] = math.ceil(requests * per_request * CB_BLOCK_MARGIN)
        how["num_blocks"] = (f"{requests} requests x {per_request} block(s) of {page_size} tokens for {longest} input + "
                             f"{max_new_tokens} new tokens x {CB_BLOCK_MARGIN} margin, rounded up")
    if input_lengths and "max_batch_tokens" not in config:
        config["max_batch_tokens"] = max(1, min(sum(input_lengths), CB_MAX_DERIVED_BATCH_TOKENS))
        how["max_batch_tokens"] = (f"the prompts' {sum(input_lengths)} input tokens, at most "
                                   f"{CB_MAX_DERIVED_BATCH_TOKENS}")
    return config, how


class ContinuousBatching(Technique):
    """``generate_batch()``. Unless given, ``num_blocks`` and ``max_batch_tokens`` are derived from the
    workload when it runs (:func:`size_continuous_batching`), and the report states them and the paged
    cache's preallocated bytes."""

    name = "continuous_batching"
    family = "continuous_batching"
    summary = "generate_batch() with dynamic scheduling and chunked prefill"
    requirement = "transformers with generate_batch and ContinuousBatchingConfig"
    accepted_params = {"max_batch_tokens": "tokens per forward pass, int > 0 (default: from the prompts)",
                       "num_blocks": "KV-cache blocks to allocate (bounds its memory), int > 0 (default: from the workload)",
                       "page_size": "tokens per cache block, int > 0",
                       "max_memory_percent": "share of free memory the cache may take, 0..1",
                       "max_requests_per_batch": "int > 0"}
    docs = f"{DOCS}/continuous_batching"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        for name in ("max_batch_tokens", "num_blocks", "page_size", "max_requests_per_batch"):
            value = self.params.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise OptConfigError(f"continuous_batching: {name}={value!r}; accepted: an int > 0")
        share = self.params.get("max_memory_percent", 0.5)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise OptConfigError(f"continuous_batching: max_memory_percent={share!r}; accepted: a number in (0, 1]")

    def probe(self, ctx: ProbeContext) -> str | None:
        try:
            from transformers.generation import ContinuousBatchingConfig  # noqa: F401
        except ImportError:
            return f"continuous_batching needs transformers with ContinuousBatchingConfig; found: transformers {ctx.hardware.version('transformers')}"
        return None

    def configure_generation(self, gen: GenerationSettings, ctx: ProbeContext) -> None:
        gen.continuous_batching = dict(self.params)

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if not evidence.used_generate_batch:
            return "continuous_batching was requested but generate_batch() was not used"
        if evidence.finished_requests != evidence.requested:
            return f"continuous_batching finished {evidence.finished_requests} of {evidence.requested} requests"
        return None

    def conflicts_with(self, other: Technique) -> str | None:
        if other.name == "compile":
            return "generate_batch() does not take the compile technique's static cache"
        return None


BUILTIN_TECHNIQUES: tuple[type[Technique], ...] = (
    Eager, Sdpa, FlexAttention, FlashAttention2, FlashAttention3, HubKernelAttention, Kernels, Compile,
    StaticCacheTechnique, OffloadedCacheTechnique, OffloadedStaticCache, QuantizedCacheTechnique,
    SlidingWindowCache, Bnb8bit, Bnb4bit, QuantoInt8, HqqFourBit, TorchaoInt8, TensorParallel, ContinuousBatching,
)
