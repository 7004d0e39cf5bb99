"""Moving a loaded model off its device and back, for an A/B whose device cannot hold both environments'
models (``--opt-ab-mode=blocks``): the side that waits for its next block keeps its weights in host memory.

On a CPU device there is nowhere to move to: parking is a no-op there, and the blocks only set the order
of the rounds.
"""

from __future__ import annotations

import time
from typing import Any


def why_not_parkable(model: Any) -> str | None:
    """Why ``model`` cannot be moved between its device and the CPU (``.to`` refused), or None."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None or getattr(model, "is_quantized", False):
        method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
        return (f"its weights are quantized ({getattr(method, 'value', method) or 'a quantizer'}), and a quantized "
                f"model cannot be moved to the CPU and back")
    if len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1:
        return "it is spread over several devices (a device_map), which .to() would collapse"
    return None


def park(model: Any, device: str) -> float:
    """Move ``model``'s weights and buffers to ``device`` (``"cpu"`` to park, the model's own device to bring
    it back); returns the seconds it took, synchronised. Leaving a CUDA device returns its cached blocks, so
    the other environment's process can use them."""
    import torch

    start = time.perf_counter()
    before = next(iter(model.parameters())).device
    if before == torch.device(device):
        return 0.0
    model.to(device)
    if before.type == "cuda":
        torch.cuda.synchronize(before)
        torch.cuda.empty_cache()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
