"""One technique of a configuration, as the advisor proposes it and as reports name it.

Names and families are the catalogue's (``techniques.catalogue``). ``marker_arg`` writes the
form a user puts in ``@pytest.mark.optimization(...)``; ``parse_technique`` reads the form the JSON
report stores (``"quantized_cache(backend='quanto', nbits=4)"``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

from ..techniques.attention import AttentionBackend, HubKernelAttention
from ..techniques.base import Technique
from ..techniques.caches import CacheTechnique
from ..techniques.catalogue import BUILTIN_TECHNIQUES
from ..techniques.compilation import Compile
from ..techniques.layer_kernels import Kernels
from ..techniques.parallel import TensorParallel
from ..techniques.quantization import WeightQuantization
from ..techniques.moe import Experts
from ..techniques.serving import ContinuousBatching
from ..techniques.speculative import SpeculativeDecoding

# The catalogue's families, under the names the advisor's stages use.
ATTENTION = AttentionBackend.family
CACHING = CacheTechnique.family
COMPILATION = Compile.family
KERNELS = Kernels.family
QUANTIZATION = WeightQuantization.family
PARALLELISM = TensorParallel.family
CONTINUOUS_BATCHING = ContinuousBatching.family
EXPERTS = Experts.family
SPECULATIVE_DECODING = SpeculativeDecoding.family

_CATALOGUE: dict[str, type[Technique]] = {technique.name: technique for technique in BUILTIN_TECHNIQUES}
# What --attention accepts by name; a hub attention kernel is given by its repo id instead.
ATTENTION_BACKENDS = tuple(technique.name for technique in BUILTIN_TECHNIQUES
                           if technique.family == ATTENTION and technique is not HubKernelAttention)


def technique_class(name: str) -> type[Technique] | None:
    """The catalogue class of a technique name; a hub kernel id (``org/name``) is a hub attention kernel."""
    if "/" in name:
        return HubKernelAttention
    return _CATALOGUE.get(name)


@dataclass(frozen=True)
class Change:
    """A technique name and its parameters, e.g. ``Change("quantized_cache", {"backend": "quanto", "nbits": 4})``."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.params.items()))))

    @property
    def technique(self) -> type[Technique] | None:
        """The catalogue class of this change (None for a name the catalogue does not know)."""
        return technique_class(self.name)

    @property
    def family(self) -> str:
        """The catalogue's family; a name the catalogue does not know is its own family."""
        technique = self.technique
        return technique.family if technique is not None else self.name

    def marker_arg(self) -> str:
        """``"bnb_4bit"`` or ``techniques.quantized_cache(backend="quanto", nbits=4)``."""
        if not self.params:
            return f'"{self.name}"'
        args = ", ".join(f"{key}={_py(value)}" for key, value in self.params.items())
        return f"techniques.{self.name}({args})"

    def label(self) -> str:
        """The report's spelling: ``quantized_cache(backend='quanto', nbits=4)``."""
        if not self.params:
            return self.name
        return f"{self.name}(" + ", ".join(f"{key}={value!r}" for key, value in self.params.items()) + ")"


def _py(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def parse_technique(text: str) -> Change:
    """Read ``"bnb_4bit"``, ``"quantized_cache(backend='quanto', nbits=4)"`` or a hub kernel id."""
    text = text.strip()
    if text.startswith("techniques."):
        text = text[len("techniques."):]
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return Change(text)  # e.g. "kernels-community/flash-attn2": a name that is not an identifier
    if isinstance(node, ast.Name):
        return Change(node.id)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
        try:
            return Change(node.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg})
        except ValueError:
            pass
    return Change(text)


def find(stack: list[Change], family: str) -> Change | None:
    """The technique of ``family`` in ``stack`` (the last one when there are several)."""
    found = [change for change in stack if change.family == family]
    return found[-1] if found else None


def replace_family(stack: list[Change], change: Change, also_drop: tuple[str, ...] = ()) -> list[Change]:
    """``stack`` with ``change`` in place of the technique of its family (one change at a time)."""
    drop = {change.family, *also_drop}
    return [item for item in stack if item.family not in drop] + [change]
