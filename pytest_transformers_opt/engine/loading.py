"""Loading models the way users load theirs, once per distinct configuration per session.

A ``LoadedModel`` is the expensive thing (weights in memory), cached by (model, revision, dtype,
load-time techniques, device). An ``OptModel`` is a cheap view on one: the loaded model plus the
generation-time techniques (cache, compile, continuous batching) of one configuration, so the
baseline and a ``static_cache`` test share one set of weights.
"""

from __future__ import annotations

import copy
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from ..compat import drop_compiled_forward, reset_compiled_graphs, supports_experts_implementation
from ..errors import OptConfigError, OptLoadError, OptProofError
from ..units import parse_dtype
from .measure import mapped_files, release_file_pages, release_memory, track_peak_memory
from .model import LoadedModel, weights_fingerprint
from .progress import long_work
from ..techniques import LoadSettings, ProbeContext, Technique
from ..techniques.moe import BASELINE_IMPLEMENTATION
from ..techniques.speculative import AssistedDecoding
from .real_models import (check_gguf_folder, converted_gguf_copy, detach_gguf_quantizer, ensure_real_model, gguf_hint,
                          gguf_kwargs, gguf_load_route, is_real_model)
from .tiny_models import ensure_tiny_model, is_tiny_model, tiny_model_config

@dataclass(frozen=True)
class ModelRequest:
    """The model under test, as the ``opt_model`` marker (or ini / option) names it."""

    name_or_path: str
    revision: str | None = None
    dtype: str | None = None
    trust_remote_code: bool = False
    from_pretrained_kwargs: tuple[tuple[str, Any], ...] = ()
    origin: str = "default"

    @property
    def allows_pickle(self) -> bool:
        """Weights come from safetensors unless the user passed ``use_safetensors=False``."""
        return dict(self.from_pretrained_kwargs).get("use_safetensors") is False

    def identity(self) -> tuple[Any, ...]:
        return (self.name_or_path, self.revision, self.dtype, self.trust_remote_code,
                tuple((k, repr(v)) for k, v in self.from_pretrained_kwargs))


def resolve_model_path(request: ModelRequest) -> str:
    """A local folder for built-in names and folders; hub ids are passed through to transformers."""
    import_quietly()  # the plugin's first use of transformers in a test comes after this (it imports hqq, inductor)
    name = request.name_or_path
    where = f"opt_model {name!r} (from {request.origin})"
    if is_tiny_model(name):
        return str(ensure_tiny_model(name))
    if is_real_model(name):  # RealModelUnavailable (a skip) when its wheel is not installed
        return str(ensure_real_model(name))
    path = Path(name).expanduser()
    looks_like_path = name.startswith((".", "/", "~")) or path.exists() or name.count("/") != 1
    if looks_like_path:
        if not path.exists():
            raise OptConfigError(f"{where}: the path {str(path)!r} does not exist; give a model folder, a hub id "
                                 f"('org/name') or a built-in model such as 'tiny-random-llama'")
        if path.is_file() and path.name == "config.json":
            path = path.parent
        if not path.is_dir():
            gguf = (f"; for a GGUF file name its folder and the file: @pytest.mark.opt_model({str(path.parent)!r}, "
                    f"gguf_file={path.name!r})") if path.suffix == ".gguf" else ""
            raise OptConfigError(f"{where}: {str(path)!r} is not a folder; a model folder holds config.json and "
                                 f"weights{gguf}")
        # a GGUF file carries config, tokenizer and weights: no config.json or safetensors needed
        gguf_checkpoint = check_gguf_folder(path, gguf_kwargs(request.from_pretrained_kwargs).get("gguf_file"), where)
        if not gguf_checkpoint and not (path / "config.json").is_file():
            raise OptConfigError(f"{where}: the folder {str(path)!r} has no config.json (is it empty?); "
                                 f"save a model with save_pretrained() there{gguf_hint(path)}")
        if not gguf_checkpoint:
            _check_weights(path, request, where)
        return str(path)
    return name


def _check_weights(path: Path, request: ModelRequest, where: str) -> None:
    safetensors = list(path.glob("*.safetensors"))
    pickles = [p for p in path.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    if safetensors:
        return
    if pickles and not request.allows_pickle:
        raise OptConfigError(
            f"{where}: the folder holds only pickle weights ({', '.join(sorted(p.name for p in pickles))}); "
            f"the plugin loads safetensors only, since pickle can run code. Convert them, or opt in with "
            f"@pytest.mark.opt_model(..., use_safetensors=False)"
        )
    if not pickles:
        raise OptConfigError(f"{where}: the folder {str(path)!r} has config.json but no weights (*.safetensors)")


def read_model_config(request: ModelRequest, path: str) -> Any:
    """The model's config (no weights), for probes; raises a clear error on remote code or a bad folder."""
    if is_tiny_model(request.name_or_path) and not (Path(path) / "config.json").is_file():
        # not built yet: its spec (the built one's vocabulary is what its tokenizer learned, 511 for 512)
        return tiny_model_config(request.name_or_path)
    from transformers import AutoConfig

    where = f"opt_model {request.name_or_path!r}"
    try:
        return parsed_once("config", path, request,
                           lambda source, kwargs: AutoConfig.from_pretrained(
                               source, trust_remote_code=request.trust_remote_code, **kwargs))
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise OptConfigError(
                f"{where}: the model needs remote code (its config has an auto_map); trust_remote_code is off "
                f"by default. Turn it on for this model only with @pytest.mark.opt_model(..., trust_remote_code=True)"
            ) from exc
        raise OptConfigError(f"{where}: cannot read its config: {exc}") from exc
    except OSError as exc:
        raise OptConfigError(f"{where}: cannot read its config (offline, or not a model): {exc}") from exc


# A GGUF file holds its config and tokenizer as metadata that transformers parses on every read (for a
# 262k vocabulary, 70-140 s on a busy 2-core machine): each is read from the file's converted copy where an
# earlier load made one, else parsed once per file version and process; every load gets its own copy (a test
# may change its tokenizer or config).
_GGUF_PARSED: dict[tuple[Any, ...], Any] = {}
GGUF_PARSE_ANNOUNCE_AFTER_S = 5.0


def parsed_once(kind: str, path: str, request: ModelRequest, read: Callable[[str, dict[str, Any]], Any]) -> Any:
    """``read(source, kwargs)``: the ``kind`` of a model, read by transformers from ``source`` with ``kwargs``. For
    a GGUF checkpoint, once per file version and process (a copy each call): from the file's converted copy
    where one exists (the same metadata as files: milliseconds), else parsed from the file. Read each time for
    other models, whose files read quickly."""
    gguf_file = gguf_kwargs(request.from_pretrained_kwargs).get("gguf_file")
    if not gguf_file:
        return read(path, {"revision": request.revision})
    file = Path(path) / gguf_file
    # a local file by its version; a hub file (transformers downloads it) by repository, name and revision
    version = (str(file.resolve()), file.stat().st_size, file.stat().st_mtime_ns) if file.is_file() else (path, gguf_file)
    key = (kind, *version, request.revision, request.trust_remote_code)
    if key not in _GGUF_PARSED:
        converted = converted_gguf_copy(path, gguf_file)
        if converted is not None:
            _GGUF_PARSED[key] = read(str(converted), {})
        else:
            with long_work(f"reading the {kind} of {gguf_file}", after_s=GGUF_PARSE_ANNOUNCE_AFTER_S,
                           detail="GGUF metadata; once per session, kept for every later load"):
                _GGUF_PARSED[key] = read(path, {"revision": request.revision, "gguf_file": gguf_file})
    return copy.deepcopy(_GGUF_PARSED[key])


def load_tokenizer(path: str, request: ModelRequest) -> Any:
    from transformers import AutoTokenizer

    tokenizer = parsed_once("tokenizer", path, request,
                            lambda source, kwargs: AutoTokenizer.from_pretrained(
                                source, trust_remote_code=request.trust_remote_code, **kwargs))
    tokenizer.padding_side = "left"  # decoder-only generation pads on the left
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


_PRIMED: set[str] = set()


def import_quietly() -> None:
    """Import torch modules whose first import only warns that the plugin imported them.

    ``torch.utils.mkldnn`` (imported by inductor: ``torch.compile``, flex attention, optimum-quanto)
    decorates 14 methods with the deprecated ``torch.jit.script_method``, one DeprecationWarning each,
    which would land in the user's warnings summary (or fail ``-W error::DeprecationWarning``).
    Once imported, it never warns again; other DeprecationWarnings are untouched.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is", category=DeprecationWarning)
        import torch.utils.mkldnn  # noqa: F401


def prime_loader(device: str) -> None:
    """Pay one-time costs (lazy imports, kernel selection, allocator pools) before the first measured load.

    Without this the first model loaded in a session is charged megabytes that every later load
    gets for free, and the baseline (usually first) looks larger than it is.
    """
    import_quietly()
    if device in _PRIMED:
        return
    import torch
    from transformers import AutoModelForCausalLM

    import tempfile

    config = tiny_model_config("tiny-random-llama")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    models: Iterable[Any]  # a generator on one process: each model is freed before the next loads
    with tempfile.TemporaryDirectory(prefix="opt-prime-") as folder, torch.inference_mode():
        if distributed:  # torchrun ranks: save_pretrained writes on rank 0 only, so prime in memory
            models = [AutoModelForCausalLM.from_config(config).to(device).eval()]
        else:  # the same path a measured load takes: save_pretrained -> from_pretrained (safetensors)
            AutoModelForCausalLM.from_config(config).save_pretrained(folder)
            models = (AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention,
                                                          device_map={"": device}).eval()
                      for attention in ("eager", "sdpa"))
        for model in models:
            ids = torch.ones((1, 4), dtype=torch.long, device=device)
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                           pad_token_id=0)
            del model
    release_memory(device)
    _PRIMED.add(device)


LOAD_ANNOUNCE_AFTER_S = 5.0


def load_model(request: ModelRequest, path: str, load_techniques: list[Technique], ctx: ProbeContext,
               device: str, key: tuple[Any, ...]) -> LoadedModel:
    """``from_pretrained`` with the load-time techniques, timed, with peak memory over load + first forward."""
    import torch
    from transformers import AutoModelForCausalLM

    settings = LoadSettings(kwargs=dict(request.from_pretrained_kwargs))
    settings.kwargs.setdefault("use_safetensors", True)
    settings.kwargs["trust_remote_code"] = request.trust_remote_code
    if request.revision:
        settings.kwargs["revision"] = request.revision
    if request.dtype:
        settings.kwargs["dtype"] = parse_dtype(request.dtype, f"opt_model dtype for {request.name_or_path!r}")
    settings.kwargs.setdefault("attn_implementation", "eager")
    if supports_experts_implementation(ctx.model_config):  # the reference experts loop, not transformers' pick
        settings.kwargs.setdefault("experts_implementation", BASELINE_IMPLEMENTATION)
    for technique in load_techniques:
        technique.configure_load(settings, ctx)
    settings.kwargs["device_map"] = {"": device}
    weights_path = gguf_load_route(path, settings.kwargs)  # a GGUF: its converted copy, for every configuration
    labels = ", ".join(t.label() for t in load_techniques) or "as saved"
    drafts = [(t, _draft_path(t)) for t in load_techniques if isinstance(t, AssistedDecoding)]
    # a tiny model loads in a second; a line only when this one takes long (big weights, a first
    # use of a quantization backend)
    with long_work(f"loading {request.name_or_path} [{labels}] on {device}", after_s=LOAD_ANNOUNCE_AFTER_S):
        tokenizer = load_tokenizer(path, request)
        prime_loader(device)
        start = time.perf_counter()
        mapped_before = mapped_files() if device == "cpu" else set()
        with track_peak_memory(device) as reading:
            model = AutoModelForCausalLM.from_pretrained(weights_path, **settings.kwargs)
            detach_gguf_quantizer(model)  # before techniques see it: a plain dense model, not a quantized one
            model.eval()
            for technique in load_techniques:
                technique.after_load(model)
            # a draft model is part of the configuration's load time and memory
            draft_models = [_load_draft(technique, draft_path, model, tokenizer, settings.kwargs)
                            for technique, draft_path in drafts]
            if device == "cpu":  # the checkpoint pages the load read (to quantize them) but the model does not use
                release_file_pages(mapped_before)
            # Weights whose dtype matches the checkpoint stay memory-mapped until touched: one forward
            # pass makes them resident, so the peak covers what generation will really hold.
            with torch.inference_mode():
                sample = tokenizer(["Hello"], return_tensors="pt").to(device)
                model(**sample)
                for draft in draft_models:
                    draft(**sample)
        load_time = time.perf_counter() - start
    for technique in load_techniques:
        problem = technique.verify_loaded(model)
        if problem:
            raise OptProofError(f"silent fallback at load: {problem}")
    return LoadedModel(key=key, model=model, tokenizer=tokenizer, path=path, load_time_s=load_time,
                       load_peak_bytes=reading.peak_delta_bytes, resident_bytes=reading.resident_delta_bytes,
                       memory_method=reading.method, load_techniques=tuple(t.label() for t in load_techniques))


def _draft_path(technique: AssistedDecoding) -> str:
    """The folder of ``assisted_decoding``'s draft; a built-in one is built here, before the load's clock starts."""
    try:
        return resolve_model_path(ModelRequest(technique.assistant, origin=f"{technique.name}(assistant=...)"))
    except OptConfigError as exc:
        raise OptConfigError(f"{technique.name}: assistant={technique.assistant!r}: {exc}") from exc


def _load_draft(technique: AssistedDecoding, path: str, model: Any, tokenizer: Any, model_kwargs: dict[str, Any]) -> Any:
    """``assisted_decoding``'s draft, loaded like the model (its dtype, attention, device), checked and attached
    to it; the caller runs it once with the model, so that its weights are resident in the load's reading."""
    from transformers import AutoModelForCausalLM

    request = ModelRequest(technique.assistant, origin=f"{technique.name}(assistant=...)")
    kwargs = {k: model_kwargs[k] for k in ("dtype", "attn_implementation", "device_map") if k in model_kwargs}
    draft_tokenizer = load_tokenizer(path, request)
    draft = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, **kwargs).eval()
    technique.attach(model, draft, draft_tokenizer, tokenizer)
    return draft


def tokenizer_only(request: ModelRequest, path: str, key: tuple[Any, ...]) -> LoadedModel:
    """For configurations whose weights live in other processes (tensor parallelism)."""
    return LoadedModel(key=key, model=None, tokenizer=load_tokenizer(path, request), path=path, load_time_s=0.0,
                       load_peak_bytes=None, resident_bytes=None, memory_method="", load_techniques=())


class OptModelChanged(OptLoadError):
    """A test changed the weights of a shared cached model in place."""

    def __init__(self, key: tuple[Any, ...], holder: str, parameter: str) -> None:
        self.holder = holder
        identity, load_techniques = key[0], key[1]
        name = identity[0] if isinstance(identity, tuple) and identity else identity
        which = f"{name} [{', '.join(load_techniques) or 'as loaded'}]"
        super().__init__(
            f"{holder} changed the weights of the shared cached model {which} in place "
            f"({parameter} differs from the weights loaded), so later tests would measure another model. "
            f"Change a copy (copy.deepcopy(opt_model.model)) instead; the plugin drops the changed model "
            f"and loads it afresh for the next test")


class ModelCache:
    """Loaded models by configuration, least recently used dropped first; counts loads for tests."""

    def __init__(self, device: str, max_models: int = 3) -> None:
        self.device = device
        self.max_models = max_models
        self._models: OrderedDict[tuple[Any, ...], LoadedModel] = OrderedDict()
        self.loads: list[tuple[Any, ...]] = []

    def get(self, key: tuple[Any, ...], loader: Callable[[], LoadedModel]) -> LoadedModel:
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        while len(self._models) >= self.max_models:
            self.evict(next(iter(self._models)))
        loaded = loader()
        # after load_model's first forward pass: bitsandbytes 4-bit on CPU repacks its weights in the first
        # one (measured: a uint8 [8192, 1] weight becomes [128, 64]) and leaves them as they are from then on
        loaded.fingerprint = weights_fingerprint(loaded.model)
        self.loads.append(key)
        self._models[key] = loaded
        return loaded

    def check(self, key: tuple[Any, ...], holder: str) -> None:
        """After a test that was handed this model: raise ``OptModelChanged`` (and drop the model, so the
        next test loads it afresh) when the test ``holder`` changed its weights in place."""
        loaded = self._models.get(key)
        changed = loaded.changed_parameter() if loaded is not None else None
        if changed is not None:
            self.evict(key)
            raise OptModelChanged(key, holder, changed)

    def evict(self, key: tuple[Any, ...]) -> None:
        """Free a model: its weights, its compiled forward and the graphs dynamo cached for it."""
        loaded = self._models.pop(key, None)
        if loaded is None:
            return
        # a model is freed by its reference count; one that is still alive after this, or compiled graphs that
        # held its weights, may be garbage the process froze alive (engine/measure.py): collected with a thaw
        outlived = weakref.ref(loaded.model) if loaded.model is not None else None  # an nn.Module: weakly referable
        compiled = loaded.model is not None and drop_compiled_forward(loaded.model)
        loaded.model = None
        del loaded
        if compiled:
            reset_compiled_graphs()  # compiled graphs hold references to the old weights
        release_memory(self.device, thaw=compiled or (outlived is not None and outlived() is not None))

    def clear(self) -> None:
        for key in list(self._models):
            self.evict(key)

    def keys(self) -> list[tuple[Any, ...]]:
        return list(self._models)
