"""One technique of a configuration, as the advisor proposes it and as reports name it.

The names are the plugin's fixed catalogue names (SPEC.md, Techniques). ``marker_arg`` writes the
form a user puts in ``@pytest.mark.optimization(...)``; ``parse_technique`` reads the form the JSON
report stores (``"quantized_cache(backend='quanto', nbits=4)"``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

ATTENTION_BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
CACHE_TECHNIQUES = ("static_cache", "offloaded_cache", "offloaded_static_cache", "quantized_cache",
                    "sliding_window_cache")
WEIGHT_QUANTIZATION = ("bnb_8bit", "bnb_4bit", "torchao_int8", "quanto_int8", "hqq_4bit")
LOSSY = {"bnb_8bit", "bnb_4bit", "torchao_int8", "quanto_int8", "hqq_4bit", "quantized_cache"}


@dataclass(frozen=True)
class Change:
    """A technique name and its parameters, e.g. ``Change("quantized_cache", {"backend": "quanto", "nbits": 4})``."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.params.items()))))

    @property
    def family(self) -> str:
        if self.name in ATTENTION_BACKENDS or "/" in self.name:
            return "attention"
        if self.name in CACHE_TECHNIQUES:
            return "cache"
        if self.name in WEIGHT_QUANTIZATION:
            return "weights"
        return self.name  # compile, kernels, continuous_batching, tensor_parallel: their own family

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
