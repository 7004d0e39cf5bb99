"""The model object: weights in memory (``LoadedModel``) and one configuration under test (``OptModel``),
with the weight fingerprint that tells whether a test changed a shared model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..techniques import GenerationSettings, ProbeContext, Technique

if TYPE_CHECKING:
    from .loading import ModelRequest

FINGERPRINT_SAMPLES = 64  # elements read per parameter, evenly spaced, compared exactly
# Summed a slice at a time: reductions to float64 cast their input first, and a float64 copy of a whole
# weight is a transient of twice its float32 size; on CPU glibc then keeps memory the process freed
# (measured: 0.1-1.2 GiB more resident after a 100M-parameter model was released; 64 KiB slices, one at
# a time: as without the fingerprint). On a GPU a slice's copy is small next to its memory.
FINGERPRINT_CHUNK = {"cpu": 2**13, "other": 2**22}


def weights_fingerprint(model: Any) -> dict[str, tuple[Any, ...]]:
    """A cheap summary of every parameter: dtype, device, shape, an evenly spaced sample of its
    elements and its float64 sum: one pass over the weights (measured on one CPU thread: 0.09 s for a
    135M-parameter model in float32 or bfloat16, under 1 ms for tiny-random-llama; memory-bound on a GPU).

    The sample catches whole-tensor changes (``mul_``, ``copy_``, ``normal_``) exactly; the sum catches
    a changed row or element anywhere. Quantized weights (bitsandbytes int8 / packed 4-bit) are plain
    integer tensors and are summed the same way; a tensor that supports neither (some quantization
    backends' tensor subclasses) is left out, so it goes unchecked rather than failing a test.
    """
    import torch

    prints: dict[str, tuple[Any, ...]] = {}
    if model is None:
        return prints
    with torch.no_grad():
        for name, param in model.named_parameters():
            try:
                if param.is_meta or param.numel() == 0:
                    continue
                flat = param.detach().reshape(-1)
                sample = flat[::max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES].to("cpu", copy=True)
                if flat.device.type == "cpu":  # one small transient at a time
                    total = sum(float(part.sum(dtype=torch.float64)) for part in flat.split(FINGERPRINT_CHUNK["cpu"]))
                else:  # one device synchronisation per parameter
                    total = float(torch.stack([part.sum(dtype=torch.float64)
                                               for part in flat.split(FINGERPRINT_CHUNK["other"])]).sum())
                # float64 sums of the same values differ in the last bits with another reduction order
                # (thread count); an edit of the weights moves them far more than this
                tolerance = 1e-9 * abs(total) + 1e-12 * flat.numel() * float(sample.abs().max().to(torch.float64))
                prints[name] = ((str(param.dtype), str(param.device), tuple(param.shape)), sample, total, tolerance)
            except Exception:  # not a plain tensor: unchecked (see above)
                continue
    return prints


def changed_parameter(model: Any, fingerprint: dict[str, tuple[Any, ...]]) -> str | None:
    """The name of the first parameter whose weights differ from ``fingerprint``; None when none does."""
    import torch

    now = weights_fingerprint(model)
    for name, (meta, sample, total, tolerance) in fingerprint.items():
        if name not in now:
            return name
        new_meta, new_sample, new_total, _ = now[name]
        if meta != new_meta or not torch.equal(sample, new_sample) or abs(total - new_total) > tolerance:
            return name
    return None


@dataclass
class LoadedModel:
    """Weights in memory and what loading them cost."""

    key: tuple[Any, ...]
    model: Any
    tokenizer: Any
    path: str
    load_time_s: float
    load_peak_bytes: int | None
    resident_bytes: int | None
    memory_method: str
    load_techniques: tuple[str, ...]
    # taken when the model enters the cache; checked at the teardown of each test it was handed to
    fingerprint: dict[str, tuple[Any, ...]] = field(default_factory=dict, repr=False)

    def changed_parameter(self) -> str | None:
        """A parameter changed in place since the model was loaded (None: unchanged, or not held here)."""
        if self.model is None or not self.fingerprint:
            return None
        return changed_parameter(self.model, self.fingerprint)


@dataclass
class OptModel:
    """One configuration under test: ``.model``, ``.tokenizer``, ``.techniques``, ``.generate(prompts)``."""

    loaded: LoadedModel
    techniques: list[Technique]
    generation: GenerationSettings
    request: ModelRequest
    device: str
    probe_context: ProbeContext

    @property
    def model(self) -> Any:
        return self.loaded.model

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def labels(self) -> list[str]:
        return [t.label() for t in self.techniques]

    @property
    def tensor_parallel_size(self) -> int | None:
        """N when this configuration runs in N torchrun processes (its weights are not loaded here)."""
        for technique in self.techniques:
            if technique.runs_in_subprocesses:
                return int(technique.params["tp_size"])
        return None

    def generate(self, prompts: list[str] | str, max_new_tokens: int = 32, **generate_kwargs: Any) -> list[str]:
        """Greedy generation with this configuration's techniques; returns the generated texts."""
        from .generation import run_generation  # on use: generation names this class for its types only

        if isinstance(prompts, str):
            prompts = [prompts]
        run = run_generation(self, list(prompts), max_new_tokens, keep_logits=False, extra=generate_kwargs)
        return run.texts
