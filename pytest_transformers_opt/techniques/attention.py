"""Attention backends: eager, SDPA, flex attention, FlashAttention 2/3 and hub attention kernels."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, Iterator

from ..compat import (attention_functions_wrapped, attention_implementation, attention_layer_types, layer_kinds_outside,
                      model_class_supports, module_available)
from ..errors import OptConfigError
from .base import (
    DOCS,
    HALF_DTYPES,
    LoadSettings,
    ProbeContext,
    RunEvidence,
    Technique,
    census_compiled,
    census_decode_steps,
    census_ops,
    version_ok,
)
from . import layer_kernels


class AttentionBackend(Technique):
    family = "attention"
    exclusive_group = "attention implementation"
    load_time = True
    implementation: ClassVar[str] = ""
    model_flag: ClassVar[str | None] = None
    docs = f"{DOCS}/attention_interface"
    docs_title = "Attention backends"
    overview_section = "Attention backends"

    @property
    def impl(self) -> str:
        return self.implementation or self.name

    def probe(self, ctx: ProbeContext) -> str | None:
        if self.model_flag and model_class_supports(ctx.model_config, self.model_flag) is False:
            arch = getattr(ctx.model_config, "model_type", "this model")
            return f"{self.label()} needs a model class that supports it ({self.model_flag}); found: {arch} does not"
        return None

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        load.kwargs["attn_implementation"] = self.impl

    def verify_loaded(self, model: Any) -> str | None:
        actual = attention_implementation(model.config)
        if actual != self.impl:
            return f"{self.label()} was requested but the loaded model uses attention {actual!r}"
        return None

    @contextlib.contextmanager
    def observe(self, model: Any, evidence: RunEvidence) -> Iterator[None]:
        """Count the calls of every attention function transformers dispatches to, and of the attention
        modules; inside a compiled graph the counters would not run, so a compiled run is not observed."""
        if evidence.compiled:
            yield
            return
        counts = evidence.attention_backend_calls if evidence.attention_backend_calls is not None else {}
        module_calls = [0]

        def counted(key: str, function: Callable[..., Any]) -> Callable[..., Any]:
            counts.setdefault(key, 0)

            def counting(*args: Any, **kwargs: Any) -> Any:
                counts[key] += 1
                return function(*args, **kwargs)

            return counting

        def hook(*_: Any) -> None:
            module_calls[0] += 1

        handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__.endswith("Attention")]
        try:
            with attention_functions_wrapped(counted):
                yield
        finally:
            for handle in handles:
                handle.remove()
            evidence.attention_backend_calls = counts
            evidence.attention_module_calls += module_calls[0]

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if evidence.attention_backend_calls is None:  # not observed (e.g. inside a compiled graph)
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


SDPA_OPS = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_")
"""The ATen ops of fused attention: what ``F.scaled_dot_product_attention`` asks the dispatcher for, and the backend
ops inductor's compiled code calls directly (``aten::_scaled_dot_product_flash_attention_for_cpu``)."""


def _counted(ops: dict[str, float]) -> str:
    return ", ".join(f"{name} x{count:g}" for name, count in sorted(ops.items()))


class Eager(AttentionBackend):
    name = "eager"
    summary = "plain PyTorch attention (the reference implementation)"

    def verify_census(self, census: dict[str, Any]) -> str | None:
        """Eager attention runs no fused attention op in the whole call (measured on the eight built-in models).
        Not read for a compiled configuration: inductor may replace a matmul-softmax-matmul by a fused op."""
        if census_decode_steps(census) is None or census_compiled(census):
            return None
        fused = census_ops(census, SDPA_OPS, per_step=False)
        if fused:
            return f"eager attention was requested but the census counted fused attention ops: {_counted(fused)}"
        return None


class Sdpa(AttentionBackend):
    name = "sdpa"
    model_flag = "_supports_sdpa"
    summary = "torch.nn.functional.scaled_dot_product_attention"
    requirement = "a model class that supports SDPA"

    def verify_census(self, census: dict[str, Any]) -> str | None:
        """SDPA runs a fused attention op in every decode step (one per attention layer on the eight built-in
        models); in the whole call where no decode step was marked (one new token) or the configuration is compiled
        (the prefill runs eagerly; what inductor's decode steps call is unverified on CUDA)."""
        steps = census_decode_steps(census)
        if steps is None:
            return None
        per_step = bool(steps) and not census_compiled(census)
        if census_ops(census, SDPA_OPS, per_step=per_step):
            return None
        where = f"in its {steps} decode steps" if per_step else "in the whole call"
        return (f"sdpa was requested but the census counted no fused attention op (aten::scaled_dot_product_attention "
                f"or aten::_scaled_dot_product_*) {where}: attention ran another way")


# torch inductor's CPU template for flex attention generates C++ that does not compile (CppCompileError: an
# undeclared `cur_kvSplitSize0`) for a mask beyond plain causal: a sliding window (Mistral, Gemma 3, GPT-OSS; the
# same model without its window compiles) or the padding of a left-padded batch. Seen with torch 2.13.0. The
# config shows a window, so that is a skip; a padded batch shows only when it runs (the test fails, naming it).
CPU_FLEX_WINDOW_BUG = ">=2.13,<2.14"


class FlexAttention(AttentionBackend):
    name = "flex_attention"
    model_flag = "_supports_flex_attn"
    summary = "PyTorch FlexAttention (compiled block-sparse attention)"
    requirement = "torch >= 2.5 and a model class that supports flex attention; compiles on first use"

    def probe(self, ctx: ProbeContext) -> str | None:
        torch_version = ctx.hardware.version("torch")
        release = (torch_version or "0").split("+")[0]
        if not version_ok(release, ">=2.5"):
            return f"flex_attention needs torch >= 2.5; found: torch {torch_version}"
        sliding = "sliding_attention" in (attention_layer_types(ctx.model_config) or [])
        if sliding and not ctx.hardware.is_cuda and version_ok(release, CPU_FLEX_WINDOW_BUG):
            arch = getattr(ctx.model_config, "model_type", "this model")
            return (f"flex_attention on cpu with torch {torch_version} needs a model without sliding-window layers "
                    f"(torch inductor's CPU flex-attention template emits C++ that does not compile for a "
                    f"sliding-window mask: 'cur_kvSplitSize0' was not declared); found: {arch} with "
                    f"{layer_kinds_outside(ctx.model_config, {'full_attention'})}")
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
    example_params = {"repo_id": "kernels-community/flash-attn2"}
    docs = f"{DOCS}/kernel_doc/overview"
    docs_title = "Kernels"
    overview_section = "Kernels"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        repo = params.get("repo_id")
        if not isinstance(repo, str) or repo.count("/") < 1:
            raise OptConfigError(f"hub_kernel technique: repo_id must look like 'org/name' (a hub kernel id such as "
                                 f"'kernels-community/flash-attn'); got {repo!r}")

    @property
    def impl(self) -> str:
        return str(self.params["repo_id"])

    def label(self) -> str:
        return self.impl

    def probe(self, ctx: ProbeContext) -> str | None:
        problem = layer_kernels.kernels_problem()
        if problem:
            return f"{self.impl} needs {problem}"
        if not ctx.hardware.is_cuda:
            return f"{self.impl} needs a CUDA GPU; found: {ctx.hardware.describe()}"
        problem = layer_kernels.hub_cache_problem(self.impl)
        return f"{self.impl} needs {problem}" if problem else None

    def verify_loaded(self, model: Any) -> str | None:
        actual = str(attention_implementation(model.config) or "")
        if self.impl not in actual:
            return f"{self.impl} was requested but the loaded model uses attention {actual!r}"
        return None

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if evidence.attention_backend_calls is None:
            return None
        if not any(v for k, v in evidence.attention_backend_calls.items() if self.impl in k):
            return f"{self.impl} was requested but its attention function never ran"
        return None
