"""Read the shape of a model from its config alone: no weights, nothing downloaded.

Accepted sources: a folder holding ``config.json``, a path to a ``config.json``, a dict, a
``transformers`` config object, the built-in name ``tiny-random-llama`` (and the other built-in
models), or a hub id already present in the local Hugging Face cache (read offline).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import OptConfigError
from ..files import read_json
from ..techniques.moe import EXPERT_COUNT_FIELDS

# Architectures whose MLP is a plain up/down projection (2 matrices), not Llama's gated gate/up/down.
_NON_GATED = {"gpt2", "gpt_neo", "gpt_neox", "gptj", "opt", "phi", "falcon", "bloom", "codegen", "starcoder2"}
# Older or non-Llama spellings of the fields the estimates need.
_ALIASES = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab_size": ("vocab_size",),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim"),
}
_LLAMA_SHAPED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
BUILTIN_DEFAULT = "tiny-random-llama"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MAX_CONFIG_INT = 2**40


@dataclass(frozen=True)
class ModelShape:
    """The figures of a decoder-only model that memory estimates depend on."""

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    gated_mlp: bool = True
    num_experts: int = 1  # MoE: every expert is resident in memory, so all are counted
    expert_intermediate_size: int | None = None
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v only
    o_bias: bool = False  # Llama's attention_bias=True adds one on o_proj too
    qk_norm: bool = False
    sliding_window: int | None = None
    max_position_embeddings: int | None = None
    config_dtype: str | None = None
    attn_implementation: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def is_builtin_tiny(self) -> bool:
        return is_builtin_model(self.name)


def builtin_model_names() -> list[str]:
    """Every built-in model name, tiny ones first."""
    from ..engine.real_models import REAL_MODELS
    from ..engine.tiny_models import TINY_MODELS

    return [*TINY_MODELS, *REAL_MODELS]


def is_builtin_model(name: str) -> bool:
    """True for the plugin's built-in offline models (``tiny-random-llama``, ...)."""
    try:
        from ..engine.tiny_models import is_tiny_model  # lazy: tiny_models belongs to the plugin core
    except ImportError:
        return name == BUILTIN_DEFAULT
    return bool(is_tiny_model(name))


def is_builtin_real_model(name: str) -> bool:
    """True for the plugin's built-in pretrained models (``smollm2-135m``): real weights, not tiny."""
    from ..engine.real_models import is_real_model  # lazy: the advisor's start-up reads no engine module

    return is_real_model(name)


def builtin_real_model_folder(name: str) -> Path:
    """The converted folder of a built-in pretrained model: the one the plugin's tests load, converted from
    the installed wheel's GGUF on first use (nothing downloaded); an uninstalled wheel is an error saying
    how to install it."""
    from ..engine.real_models import RealModelUnavailable, ensure_real_model

    try:
        return ensure_real_model(name)
    except RealModelUnavailable as exc:
        raise OptConfigError(f"--model: built-in model {name!r} is not installed here: {exc.reason}") from None


def _config_error(where: str, detail: str) -> OptConfigError:
    return OptConfigError(
        f"--model: {where}: {detail}; the advisor needs a decoder-only text model's config with "
        f"num_hidden_layers, hidden_size, num_attention_heads, vocab_size (and intermediate_size)"
    )


def _positive_int(raw: dict[str, Any], key: str, where: str) -> int | None:
    for alias in _ALIASES.get(key, (key,)):
        value = raw.get(alias)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise _config_error(where, f"{alias}={value!r} is not a positive whole number")
        if value > MAX_CONFIG_INT:  # a crafted config: no real model has a dimension past 2**40
            raise _config_error(where, f"{alias}={value!r} is beyond any model (at most {MAX_CONFIG_INT})")
        return value
    return None


def shape_from_dict(raw: dict[str, Any], name: str, where: str | None = None) -> ModelShape:
    """A ``ModelShape`` from a config dict (as in ``config.json``); ``OptConfigError`` names the missing field."""
    where = where or name
    notes: list[str] = []
    if _positive_int(raw, "num_hidden_layers", where) is None and isinstance(raw.get("text_config"), dict):
        # Multimodal configs nest the language model; its decoder is what generates.
        notes.append("read the nested text_config (the language model of a multimodal config)")
        outer_dtype = raw.get("dtype") or raw.get("torch_dtype")
        raw = {**raw["text_config"]}
        raw.setdefault("dtype", outer_dtype)
    missing = [key for key in _REQUIRED if _positive_int(raw, key, where) is None]
    if missing:
        raise _config_error(where, f"missing {', '.join(missing)}")
    layers = _positive_int(raw, "num_hidden_layers", where)
    hidden = _positive_int(raw, "hidden_size", where)
    heads = _positive_int(raw, "num_attention_heads", where)
    vocab = _positive_int(raw, "vocab_size", where)
    assert layers and hidden and heads and vocab  # checked just above
    model_type = str(raw.get("model_type") or "unknown")
    intermediate = _positive_int(raw, "intermediate_size", where)
    if intermediate is None:
        if model_type not in _NON_GATED:
            raise _config_error(where, "missing intermediate_size")
        intermediate = 4 * hidden  # GPT-2 style configs leave n_inner as None meaning 4 x hidden
    kv_heads = _positive_int(raw, "num_key_value_heads", where) or heads
    head_dim = _positive_int(raw, "head_dim", where) or hidden // heads
    experts = next((count for count in (_positive_int(raw, name, where) for name in EXPERT_COUNT_FIELDS) if count), 1)
    if experts > 1:
        notes.append(f"mixture of experts: all {experts} experts counted as resident in memory")
    window = raw.get("sliding_window")
    valid_window = isinstance(window, int) and not isinstance(window, bool) and window > 0
    if not valid_window or raw.get("use_sliding_window") is False:
        window = None
    if model_type not in _NON_GATED and model_type not in _LLAMA_SHAPED:
        notes.append(f"parameters counted with Llama-shaped layers for model_type {model_type!r}")
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    tie = raw.get("tie_word_embeddings")
    return ModelShape(
        name=name,
        model_type=model_type,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=bool(tie) if tie is not None else model_type in _NON_GATED,
        gated_mlp=model_type not in _NON_GATED,
        num_experts=experts,
        expert_intermediate_size=_positive_int(raw, "moe_intermediate_size", where),
        qkv_bias=bool(raw.get("attention_bias")) or model_type in ("qwen2", "qwen2_moe"),
        o_bias=bool(raw.get("attention_bias")),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "olmo2"),
        sliding_window=window,
        max_position_embeddings=_positive_int(raw, "max_position_embeddings", where)
        or _positive_int(raw, "n_positions", where),
        config_dtype=str(dtype).replace("torch.", "") if dtype and dtype != "auto" else None,
        attn_implementation=raw.get("_attn_implementation") or raw.get("attn_implementation"),
        notes=tuple(notes),
    )


def _read_json(path: Path) -> dict[str, Any]:
    # the guarded reader: a FIFO, a huge file, deep nesting or a 5000-digit number is one clear error
    raw = read_json(path, what="the config", source="--model",
                    remedy="accepted: a model's config.json (as written by save_pretrained)")
    if not isinstance(raw, dict):
        raise OptConfigError(f"--model: {path} holds a JSON {type(raw).__name__}, not a config object")
    return raw


def _cached_hub_config(repo_id: str, revision: str | None) -> Path | None:
    """The config.json of a hub model already in the local cache; never touches the network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception:  # malformed id or cache: treat as absent
        return None
    return Path(found) if isinstance(found, str) else None


def load_model_shape(source: Any, revision: str | None = None) -> ModelShape:
    """The ``ModelShape`` of ``source`` (see the module docstring); raises ``OptConfigError`` naming --model."""
    if isinstance(source, ModelShape):
        return source
    if isinstance(source, dict):
        return shape_from_dict(source, str(source.get("_name_or_path") or "model"), "config")
    if hasattr(source, "to_dict") and not isinstance(source, (str, Path)):
        raw = source.to_dict()
        return shape_from_dict(raw, str(raw.get("_name_or_path") or getattr(source, "name_or_path", "") or "model"),
                               "config")
    text = str(source)
    path = Path(text).expanduser()
    if not path.exists() and is_builtin_model(text):
        from ..engine.tiny_models import tiny_model_config  # lazy: it imports transformers

        return shape_from_dict(tiny_model_config(text).to_dict(), text, f"built-in model {text}")
    if not path.exists() and is_builtin_real_model(text):
        return shape_from_dict(_read_json(builtin_real_model_folder(text) / "config.json"), text,
                               f"built-in model {text}")
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.exists():  # a FIFO or folder there is the guarded reader's clear error
            raise OptConfigError(f"--model: folder {text} has no config.json; accepted: a model folder, "
                                 f"a config.json path, a hub id in the local cache, or tiny-random-llama")
        return shape_from_dict(_read_json(config_path), text, str(config_path))
    if path.exists():  # a file, or a FIFO / device the guarded reader refuses without blocking
        return shape_from_dict(_read_json(path), str(path.parent) if path.name == "config.json" else text, text)
    if _HUB_ID.match(text):
        cached = _cached_hub_config(text, revision)
        if cached is not None:
            return shape_from_dict(_read_json(cached), text, f"{text} (local hub cache)")
    raise OptConfigError(f"--model: {text!r} is not a folder, a config.json file, a hub id in the local cache "
                         f"or a built-in model ({', '.join(builtin_model_names())}); nothing is downloaded")
