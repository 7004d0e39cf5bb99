"""The built-in technique catalogue (the README's Techniques section describes each).

Each class states what it needs (``probe``), what it sets (``configure_*``), how it proves that it
ran (``verify_*``), how lossy it is (``quality``) and where it is documented (``docs``).
"""

from __future__ import annotations

from .attention import (
                        AttentionBackend,
                        Eager,
                        FlashAttention2,
                        FlashAttention3,
                        FlexAttention,
                        HubKernelAttention,
                        Sdpa,
)
from .base import Technique
from .caches import (
                        CacheTechnique,
                        OffloadedCacheTechnique,
                        OffloadedStaticCache,
                        QuantizedCacheTechnique,
                        SlidingWindowCache,
                        StaticCacheTechnique,
)
from .compilation import Compile
from .moe import Experts
from .layer_kernels import Kernels
from .parallel import TensorParallel
from .quantization import (
                        Bnb4bit,
                        Bnb8bit,
                        HqqFourBit,
                        QuantoInt8,
                        TorchaoInt8,
                        WeightQuantization,
)
from .serving import ContinuousBatching
from .speculative import AssistedDecoding, PromptLookup, SpeculativeDecoding

__all__ = ["BUILTIN_TECHNIQUES", "AttentionBackend", "Eager", "Sdpa", "FlexAttention", "FlashAttention2",
           "FlashAttention3", "HubKernelAttention", "Kernels", "Compile", "CacheTechnique", "StaticCacheTechnique",
           "SlidingWindowCache", "OffloadedCacheTechnique", "OffloadedStaticCache", "QuantizedCacheTechnique",
           "WeightQuantization", "Bnb8bit", "Bnb4bit", "QuantoInt8", "HqqFourBit", "TorchaoInt8", "TensorParallel",
           "ContinuousBatching", "Experts", "SpeculativeDecoding", "AssistedDecoding", "PromptLookup"]

BUILTIN_TECHNIQUES: tuple[type[Technique], ...] = (
    Eager, Sdpa, FlexAttention, FlashAttention2, FlashAttention3, HubKernelAttention, Kernels, Compile,
    StaticCacheTechnique, OffloadedCacheTechnique, OffloadedStaticCache, QuantizedCacheTechnique,
    SlidingWindowCache, Bnb8bit, Bnb4bit, QuantoInt8, HqqFourBit, TorchaoInt8, TensorParallel, ContinuousBatching,
    Experts, AssistedDecoding, PromptLookup,
)
