"""The one place that asks the libraries we sit on what they offer: installed versions, importable
modules, and every access to a private attribute of transformers, torch or pytest (a name that may change in
any release, so each is reached through one function here, with the fallback it needs)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
from collections import Counter
from typing import Any, Callable, Iterator


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def module_available(module: str) -> bool:
    """True when ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------- transformers: model classes and config
def causal_lm_class(config: Any) -> Any:
    """The causal-LM class transformers would instantiate for ``config`` (None when unknown)."""
    if config is None:
        return None
    try:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM._model_mapping[type(config)]
    except Exception:  # not a causal LM, or the mapping moved: unknown
        return None


def model_class_supports(config: Any, flag: str) -> bool | None:
    """The model class's ``_supports_*`` flag (e.g. ``"_supports_sdpa"``) for ``config``; None when the class is unknown."""
    cls = causal_lm_class(config)
    return None if cls is None else bool(getattr(cls, flag, False))


# from_pretrained keyword arguments that load the model rather than configure it (some share a config attribute's name)
_LOADER_KWARGS = frozenset({"dtype", "torch_dtype", "revision", "trust_remote_code", "use_safetensors", "gguf_file",
                            "subfolder", "device_map", "attn_implementation", "quantization_config", "use_kernels",
                            "tp_plan", "tp_size", "low_cpu_mem_usage", "cache_dir", "local_files_only", "token"})


def config_as_loaded(config: Any, from_pretrained_kwargs: dict[str, Any]) -> Any:
    """``config`` as ``from_pretrained(**from_pretrained_kwargs)`` will build the model: a keyword that names
    one of its attributes (``num_hidden_layers=1``, ``layer_types=[...]``, ``sliding_window=16``) overrides
    it, as transformers does. A copy; ``config`` itself is left as read."""
    overrides = {key: value for key, value in from_pretrained_kwargs.items()
                 if key not in _LOADER_KWARGS and hasattr(config, key)}
    if config is None or not overrides:
        return config
    import copy

    changed = copy.deepcopy(config)
    for key, value in overrides.items():
        setattr(changed, key, value)
    return changed


def _decoder_config(config: Any) -> Any:
    """The decoder's part of a (possibly multimodal) config, as transformers' caches read it."""
    try:
        return config.get_text_config(decoder=True)
    except Exception:  # not a transformers config (a stand-in in a probe): read it as it is
        return config


def attention_layer_types(config: Any) -> list[str] | None:
    """The kind of each decoder layer as transformers' caches see it (``full_attention``,
    ``sliding_attention``, ``chunked_attention``, ``linear_attention``...): ``config.layer_types``, or what
    transformers infers without one (every layer ``sliding_attention`` when the config sets a
    ``sliding_window``). None when there is no config to read."""
    if config is None:
        return None
    text_config = _decoder_config(config)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        return list(get_layer_types_and_kwargs(text_config)[0])
    except Exception:  # an older transformers, or the function moved: the same inference, done here
        declared = getattr(text_config, "layer_types", None)
        if declared is not None:
            return [str(kind) for kind in declared]
        layers = int(getattr(text_config, "num_hidden_layers", 0) or 0)
        if getattr(text_config, "sliding_window", None) is not None:
            return ["sliding_attention"] * layers
        if getattr(text_config, "attention_chunk_size", None) is not None:
            return ["chunked_attention"] * layers
        return ["full_attention"] * layers


def layer_kinds_outside(config: Any, supported: set[str]) -> str | None:
    """The config's layer kinds that ``supported`` leaves out, for a reason's ``found:`` part (e.g.
    ``1 of 2 layers sliding_attention (config.layer_types)``); None when every layer is supported or the
    config is unknown."""
    kinds = attention_layer_types(config)
    if not kinds:
        return None
    outside = sorted({kind for kind in kinds if kind not in supported})
    if not outside:
        return None
    counts = ", ".join(f"{sum(kind == other for kind in kinds)} of {len(kinds)} layers {other}" for other in outside)
    text_config = _decoder_config(config)
    if getattr(text_config, "layer_types", None) is not None:
        return f"{counts} (config.layer_types)"
    setting = next((name for name in ("sliding_window", "attention_chunk_size")
                    if getattr(text_config, name, None) is not None), None)
    return f"{counts} (no layer_types; inferred from config.{setting})" if setting else counts


def continuous_batching_layer_kinds() -> set[str]:
    """The layer kinds ``generate_batch()``'s paged cache has an allocator for (it raises "Invalid layer
    type" on any other)."""
    try:
        from transformers.generation.continuous_batching.cache import ATTN_TYPE_TO_ALLOCATOR

        return {str(kind) for kind in ATTN_TYPE_TO_ALLOCATOR}
    except Exception:  # moved or renamed: the two kinds every release so far has had
        return {"full_attention", "sliding_attention"}


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a loaded model's config says it uses (``config._attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


# ---------------------------------------------------------------- transformers: attention dispatch
@contextlib.contextmanager
def attention_functions_wrapped(wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Every attention function transformers dispatches to, replaced by ``wrap(name, function)`` while the
    context is open; transformers' own mapping is restored after."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # the per-process overrides that ``ALL_ATTENTION_FUNCTIONS[key] = f`` writes; without it (a newer
    # transformers) the originals are written back through the public mapping
    local = getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", None)
    originals = dict(local) if local is not None else {key: ALL_ATTENTION_FUNCTIONS[key] for key in ALL_ATTENTION_FUNCTIONS}
    for key in list(ALL_ATTENTION_FUNCTIONS):
        ALL_ATTENTION_FUNCTIONS[key] = wrap(key, ALL_ATTENTION_FUNCTIONS[key])
    try:
        yield
    finally:
        if local is not None:
            local.clear()
            local.update(originals)
        else:
            for key, function in originals.items():
                ALL_ATTENTION_FUNCTIONS[key] = function


# ---------------------------------------------------------------- transformers: MoE experts dispatch
def experts_implementation(config: Any) -> str | None:
    """The experts implementation a loaded model's config says it uses (``config._experts_implementation``)."""
    return getattr(config, "_experts_implementation", None)


def supports_experts_implementation(config: Any) -> bool | None:
    """Whether the model class of ``config`` takes ``experts_implementation`` (transformers decides by finding
    ``@use_experts_implementation`` in its module, ``_can_set_experts_implementation``); None when the class is
    unknown, False on a transformers without the experts interface."""
    cls = causal_lm_class(config)
    if cls is None:
        return None
    check = getattr(cls, "_can_set_experts_implementation", None)
    try:
        return bool(check()) if check is not None else False
    except Exception:  # its source cannot be read: transformers itself then refuses to set one
        return False


@contextlib.contextmanager
def experts_dispatch_counted(counts: dict[str, int]) -> Iterator[None]:
    """Count, by implementation name, every experts forward transformers dispatches to while the context is open
    (``"eager"``: the model's own forward). The experts layers ask ``ALL_EXPERTS_FUNCTIONS.get_interface`` at each
    call; a counting one shadows it on that object and is removed after."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # no experts interface: nothing dispatches, nothing to count
        yield
        return
    interface = ALL_EXPERTS_FUNCTIONS
    shadowed = "get_interface" in vars(interface)
    previous = vars(interface).get("get_interface")
    original = interface.get_interface

    def get_interface(experts_implementation: Any, default: Callable[..., Any]) -> Callable[..., Any]:
        function = original(experts_implementation, default)
        key = "eager" if function is default else str(experts_implementation)

        def counting(*args: Any, **kwargs: Any) -> Any:
            counts[key] = counts.get(key, 0) + 1
            return function(*args, **kwargs)

        return counting

    interface.get_interface = get_interface
    try:
        yield
    finally:
        if shadowed:
            interface.get_interface = previous
        else:
            del interface.get_interface


GROUPED_MM_KERNEL = "torch grouped_mm kernel"  # the key grouped_mm_kernels_counted counts torch's grouped GEMM under


@contextlib.contextmanager
def grouped_mm_kernels_counted(counts: dict[str, int]) -> Iterator[None]:
    """Count calls of torch's grouped GEMM (``torch.nn.functional.grouped_mm``, ``torch._grouped_mm``) under
    ``GROUPED_MM_KERNEL``: transformers' grouped_mm experts call it by attribute at each step, or, where torch
    cannot run it (a CPU torch <= 2.8, unaligned weights, a compiled non-bf16 graph), fall back to a loop of
    their own without a word."""
    import torch

    # the one transformers calls: the public function where torch has it (it calls torch._grouped_mm itself)
    owners = [(owner, name) for owner, name in ((torch.nn.functional, "grouped_mm"), (torch, "_grouped_mm"))
              if hasattr(owner, name)][:1]
    originals = [getattr(owner, name) for owner, name in owners]

    def counted(function: Callable[..., Any]) -> Callable[..., Any]:
        def counting(*args: Any, **kwargs: Any) -> Any:
            counts[GROUPED_MM_KERNEL] = counts.get(GROUPED_MM_KERNEL, 0) + 1
            return function(*args, **kwargs)

        return counting

    for (owner, name), function in zip(owners, originals):
        setattr(owner, name, counted(function))
    try:
        yield
    finally:
        for (owner, name), function in zip(owners, originals):
            setattr(owner, name, function)


def grouped_mm_in_torch() -> bool:
    """Whether this torch has a grouped GEMM transformers' grouped_mm experts can call."""
    import torch

    return hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")


# ---------------------------------------------------------------- transformers: compiled forward
def compiled_forward(model: Any) -> Any:
    """The compiled forward ``generate`` calls for a static cache (``model._compiled_call``), None before any."""
    return getattr(model, "_compiled_call", None)


def set_compiled_forward(model: Any, forward: Callable[..., Any], compile_config: Any) -> None:
    """Make ``forward`` the compiled forward ``generate`` uses for ``compile_config``: transformers makes its
    own only when none exists or its config differs from ``model._last_compile_config``."""
    model._last_compile_config = compile_config
    model._compiled_call = forward


def drop_compiled_forward(model: Any) -> bool:
    """Remove the model's compiled forward (it holds references to the weights); True when it had one."""
    had = hasattr(model, "_compiled_call")
    for attribute in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attribute):
            delattr(model, attribute)
    return had


def compile_on_all_devices(compile_config: Any) -> None:
    """transformers compiles only on CUDA-like devices unless its ``CompileConfig`` says otherwise."""
    compile_config._compile_all_devices = True  # transformers' own switch for this


def continuous_batching_config(params: dict[str, Any]) -> tuple[Any, int]:
    """(a ``ContinuousBatchingConfig`` from ``params``, its tokens per cache block). transformers named that
    field ``block_size`` before 5.21 and ``page_size`` since; ``params`` use the new name, which this
    translates for the installed version."""
    from transformers.generation import ContinuousBatchingConfig

    field = "page_size" if hasattr(ContinuousBatchingConfig, "page_size") else "block_size"
    params = dict(params)
    if "page_size" in params and field != "page_size":
        params[field] = params.pop("page_size")
    config = ContinuousBatchingConfig(**params)
    return config, int(getattr(config, field))


def continuous_batching_page_size(params: dict[str, Any]) -> int:
    """Tokens per paged-cache block: the given ``page_size``, else the installed transformers' default."""
    if "page_size" in params:
        return int(params["page_size"])
    return continuous_batching_config({})[1]


def continuous_batching_manager(model: Any) -> Any:
    """The manager the last ``generate_batch(persistent_manager=True)`` left on the model, or None."""
    return getattr(model, "_cached_continuous_batching_manager", None)


def device_mesh(model: Any) -> Any:
    """The device mesh a tensor-parallel model was sharded over, or None."""
    return getattr(model, "_device_mesh", None)


def kernelized_functions(module: Any) -> dict[str, Any]:
    """The functions ``use_kernelized_func`` attached to a module (``module._kernel_funcs``), by name."""
    return getattr(module, "_kernel_funcs", None) or {}


# ---------------------------------------------------------------- torch: dynamo
def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process so far (0 when torch's counters are not readable)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return 0


def graph_break_counts() -> Counter[str]:
    """dynamo's process-wide graph-break reasons so far, reason -> times (empty when its counters are not readable)."""
    try:
        from torch._dynamo.utils import counters

        return Counter({str(k): int(v) for k, v in counters["graph_break"].items()})
    except Exception:
        return Counter()


def reset_compiled_graphs() -> None:
    """Drop every graph dynamo cached (they hold references to the weights they were traced with)."""
    import torch

    reset = getattr(getattr(torch, "_dynamo", None), "reset", None)
    if reset is not None:
        reset()


# ---------------------------------------------------------------- torch: compile caches
def enable_compile_caches() -> None:
    """Switch on inductor's FX graph and autotune caches and AOTAutograd's cache in this process: their
    configs read ``TORCHINDUCTOR_FX_GRAPH_CACHE`` / ``TORCHINDUCTOR_AUTOGRAD_CACHE`` once, when torch is
    imported, so setting the variables later reaches only processes started after."""
    try:
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = True
        inductor_config.autotune_local_cache = True
    except Exception:  # a torch without these settings: its caches stay as they are
        pass
    try:
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = True
    except Exception:
        pass


def set_precompiled_header_dir(folder: str) -> str | None:
    """Put inductor's precompiled C++ headers in ``folder`` (``torch._inductor.codecache._HEADER_DIR``, fixed
    when torch is imported to ``/tmp/torchinductor_<user>/precompiled_headers``, whatever
    ``TORCHINDUCTOR_CACHE_DIR`` says); returns the folder it was, or None when this torch has no such setting."""
    try:
        from torch._inductor import codecache
    except Exception:
        return None
    previous = getattr(codecache, "_HEADER_DIR", None)
    if not isinstance(previous, str):
        return None
    codecache._HEADER_DIR = folder
    codecache._HEADER_LOCK_DIR = os.path.join(folder, "locks")
    return previous


def compile_cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX graph cache and AOTAutograd's cache in this process so far (a
    bypass compiles without the cache: a miss). (0, 0) while torch has compiled nothing, without
    importing torch."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0, 0
    try:
        counters = utils.counters
        inductor, aot = counters["inductor"], counters["aot_autograd"]
        hits = inductor["fxgraph_cache_hit"] + aot["autograd_cache_hit"]
        misses = inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"] + aot["autograd_cache_miss"]
        return int(hits), int(misses)
    except Exception:  # not imported yet, or the counters moved: nothing to tell
        return 0, 0


def save_compile_artifacts() -> bytes | None:
    """``torch.compiler.save_cache_artifacts()``'s portable bytes (torch 2.7+); None without the API or
    when nothing was compiled or loaded."""
    try:
        import torch.compiler

        saved = torch.compiler.save_cache_artifacts()
    except Exception:  # no such API, or serialising failed: the inductor folder still holds the graphs
        return None
    return saved[0] if saved else None


def load_compile_artifacts(data: bytes) -> bool:
    """Hot-load what ``save_compile_artifacts`` wrote into torch's caches; False without the API or
    when torch could not read them (a file from another torch is ignored, not fatal)."""
    try:
        import torch.compiler

        return torch.compiler.load_cache_artifacts(data) is not None
    except Exception:
        return False


# ---------------------------------------------------------------- pytest-benchmark: its storage
def benchmark_storage(url: str, logger: Any, netrc: Any) -> Any:
    """The storage ``--benchmark-storage`` names, built as pytest-benchmark builds its own (``.save(output_json,
    name)`` writes one saved run). ``utils.load_storage`` and ``get_machine_id`` are not documented API: when
    a release moves them, the error says so and that ``--benchmark-json`` still works."""
    try:
        from pytest_benchmark.utils import get_machine_id, load_storage
    except ImportError as exc:
        raise RuntimeError(f"pytest-benchmark {package_version('pytest-benchmark')} has no utils.load_storage, "
                           "so --benchmark-save / --benchmark-autosave cannot be honoured here; "
                           "--benchmark-json=PATH still writes the data") from exc
    return load_storage(url, logger=logger, default_machine_id=get_machine_id(), netrc=netrc)


# ---------------------------------------------------------------- pytest: running a test once more

def run_test_again(item: Any) -> bool:
    """Run ``item`` once more (setup, call, teardown, its fixtures anew) without reporting it: pytest's own
    ``runtestprotocol(log=False)``, the one way to do that (pytest-rerunfailures reaches it too; the public
    ``pytest_runtest_protocol`` hook would report the test a second time). False where this pytest has none."""
    try:
        from _pytest.runner import runtestprotocol
    except ImportError:
        return False
    runtestprotocol(item, nextitem=None, log=False)
    return True

