"""Tensor parallelism: its probe (devices, torch.distributed backends, the model's heads) and technique."""

from __future__ import annotations

from typing import Any

from ..compat import package_version
from ..errors import OptConfigError
from .base import DOCS, ProbeContext, Technique, version_ok

UNEVEN_LM_HEAD_SINCE = "5.21"


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
    vocab = getattr(text_config, "vocab_size", None)
    installed = package_version("transformers")
    # before 5.21 transformers gathers lm_head's column-sharded output whole and refuses an uneven split
    # ("The output size of `lm_head` (511) must be divisible by the tensor parallel size (2)")
    if isinstance(vocab, int) and vocab % tp_size and installed and not version_ok(installed, f">={UNEVEN_LM_HEAD_SINCE}"):
        return (f"tensor_parallel(tp_size={tp_size}) with transformers {installed} needs vocab_size divisible by "
                f"{tp_size} (transformers {UNEVEN_LM_HEAD_SINCE} and later shard an uneven lm_head); found: {model_type} "
                f"with vocab_size {vocab}")
    return None


class TensorParallel(Technique):
    name = "tensor_parallel"
    family = "parallelism"
    load_time = True
    runs_in_subprocesses = True  # the plugin launches torchrun; its workers load and generate
    summary = "tensor parallelism through torch.distributed (the plugin launches torchrun; gloo on CPU)"
    requirement = "N CUDA devices (tp_size=N) or, on CPU, torch.distributed with gloo; a model with a tp_plan"
    accepted_params = {"tp_size": "number of processes/devices, int >= 2"}
    docs = f"{DOCS}/perf_infer_gpu_multi"
    docs_title = "Tensor parallelism"
    overview_section = "Parallelism"

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
