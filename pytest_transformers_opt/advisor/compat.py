"""Compatibility of a proposed configuration with the model and the hardware.

``compatibility_questions`` turns what is known (the stated workload, and the plugin's probed
hardware facts when it has them) into the questions that remain open. A fact that settles a
question removes it; a fact that rules the technique out becomes a blocker line.

``hardware`` keys (all optional): device ("cpu"/"cuda"), gpu_name, compute_capability ("9.0"),
gpu_memory_bytes, bf16_supported, versions (dict: package name -> version or None = not installed).
What each technique needs (its package, its minimum compute capability) is the catalogue's.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..techniques.attention import FlashAttention2
from ..techniques.caches import QuantizedCacheTechnique
from ..techniques.moe import GROUPED_MM_MIN_CAPABILITY, Experts, grouped_mm_problem
from ..techniques.speculative import SpeculativeDecoding
from .change import Change, parse_technique, technique_class
from .model_config import ModelShape
from .workload import ServingScenario, capability_text, merge_hardware, parse_compute_capability


def _facts(workload: ServingScenario, hardware: dict[str, Any] | None) -> tuple[str | None, tuple[int, int] | None,
                                                                         dict[str, str | None], Any]:
    merged = merge_hardware(workload, hardware)
    device = merged.device or ("cuda" if merged.gpu_memory_bytes or merged.compute_capability else None)
    cc = parse_compute_capability(merged.compute_capability) if merged.compute_capability else None
    bf16 = (hardware or {}).get("bf16_supported")
    return device, cc, dict(merged.versions), bf16


def flash_attention_capable(workload: ServingScenario, hardware: dict[str, Any] | None = None,
                            name: str = FlashAttention2.name) -> bool | None:
    """True when the GPU is known to be capable, False when known not to be, None when unknown."""
    device, cc, _, _ = _facts(workload, hardware)
    if device == "cpu":
        return False
    if cc is None:
        return None
    technique = technique_class(name)
    need = technique.min_capability if technique is not None else None
    return cc >= (need or FlashAttention2.min_capability)


def _package_question(name: str, versions: dict[str, str | None], what: str) -> str | None:
    if name in versions and versions[name] is None:
        return f"{name} is not installed ({what}): install it, or the test will be skipped."
    if versions.get(name):
        return None  # installed: settled
    return f"Is {name} installed where the model runs ({what})?"


def compatibility_questions(workload: ServingScenario, techniques: Iterable[Change | str],
                            hardware: dict[str, Any] | None = None,
                            shape: ModelShape | None = None) -> list[str]:
    """Open compatibility questions (and known blockers) for running ``techniques`` on this workload."""
    device, cc, versions, bf16 = _facts(workload, hardware)
    revision = workload.revision or "the revision you deploy"
    model = workload.model or (shape.name if shape else "the model")
    dtype = workload.dtype
    out: list[str] = []
    for item in techniques:
        change = parse_technique(item) if isinstance(item, str) else item
        name = change.name
        technique = change.technique
        package = technique.package if technique is not None else None
        # an unknown bitsandbytes install is asked below, together with its CUDA support
        if package and not (package == "bitsandbytes" and package not in versions):
            question = _package_question(package, versions, f"needed by {name}")
            if question:
                out.append(question)
        if name in ("bnb_8bit", "bnb_4bit"):
            if "bitsandbytes" in versions and versions["bitsandbytes"] is None:
                pass  # the package line above already says it is missing
            elif device == "cpu":
                out.append("Does your bitsandbytes build support CPU for this model? Its CUDA backend is the "
                           "tested path.")
            else:
                out.append("Is bitsandbytes installed with CUDA support for this GPU and driver?")
            if name == "bnb_4bit" and bf16 is False:
                out.append("The GPU lacks bf16: set compute_dtype=\"float16\" for bnb_4bit.")
        elif technique is not None and technique.min_capability is not None:
            need = technique.min_capability
            if device == "cpu":
                out.append(f"{name} needs a CUDA GPU of compute capability >= {capability_text(need)}; found: cpu.")
            elif cc is None:
                out.append(f"Is the GPU compute capability >= {capability_text(need)} (needed by {name})?")
            elif cc < need:
                out.append(f"{name} needs compute capability >= {capability_text(need)}; found {capability_text(cc)}.")
            if dtype == "float32":
                out.append(f"{name} runs in float16 or bfloat16 only; the stated dtype is float32.")
            flag = getattr(technique, "model_flag", None)
            support = f" (the model class's {flag})" if flag else ""
            out.append(f"Does {model} at {revision} support {name}{support}?")
        elif name in ("sdpa", "flex_attention"):
            out.append(f"Does {model} at {revision} support {name} (attn_implementation=\"{name}\")?")
        elif name == "quantized_cache":
            backend = str(change.params.get("backend", "quanto"))
            _, package = QuantizedCacheTechnique.backends.get(backend, (backend, backend))  # (module, package)
            question = _package_question(package, versions, f"the {backend} backend of the quantized cache")
            if question:
                out.append(question)
            out.append(f"Does {model} use a standard KV cache (no hybrid or linear-attention layers) that "
                       f"QuantizedCache can replace?")
        elif name in ("offloaded_cache", "offloaded_static_cache"):
            if device == "cpu":
                out.append(f"{name} moves the cache from a GPU to CPU RAM; on a CPU-only run it saves nothing.")
            if workload.cpu_memory_bytes is None:
                out.append("Is there enough CPU RAM to hold the whole offloaded KV cache (--cpu-memory)?")
            out.append(f"Does {model} use standard attention layers whose cache can be offloaded, and is the "
                       f"CPU-GPU link fast enough for the decoding speed you need?")
        elif name == "sliding_window_cache":
            if shape is not None and shape.sliding_window is None:
                out.append(f"The config of {model} has no sliding_window: was it trained with sliding "
                           f"window attention? Without it the cache is not capped.")
            else:
                out.append(f"Was {model} trained with sliding window attention over every layer?")
        elif name == "compile":
            if device == "cpu":
                out.append("Is a C++ compiler available for torch.compile's CPU backend (inductor)?")
            else:
                out.append("Is triton installed for this GPU (torch.compile's inductor backend)?")
            out.append(f"Does {model} compile without graph breaks on torch "
                       f"{versions.get('torch') or '(version not given)'}?")
            out.append("Do the inputs keep fixed shapes (padded lengths, fixed batch)? Each new shape recompiles.")
        elif name == "continuous_batching":
            out.append(f"Does transformers {versions.get('transformers') or '(version not given)'} provide "
                       f"generate_batch() with ContinuousBatchingConfig for {model}?")
            out.append("Can the serving code submit requests through generate_batch() instead of generate()?")
        elif name == "tensor_parallel":
            size = change.params.get("tp_size", 2)
            out.append(f"Are {size} GPUs available on one node, with torch.distributed (NCCL) and torchrun?")
            out.append(f"Does {model} define a tensor-parallel plan (base_model_tp_plan) at {revision}?")
            if shape is not None and (shape.num_kv_heads % int(size) or shape.num_heads % int(size)):
                out.append(f"The head counts ({shape.num_heads} query, {shape.num_kv_heads} KV) are not "
                           f"divisible by tp_size={size}.")
        elif name == "kernels":
            out.append("Does the hub offer a kernel for this GPU, and can the machine reach the hub or a "
                       "local kernel cache?")
        elif name == Experts.name:
            out += _experts_questions(str(change.params.get("implementation", "")), model, device, cc, versions)
        elif technique is not None and technique.family == SpeculativeDecoding.family:
            out.append(f"Does the serving code generate one sequence per call? transformers runs {name} at batch "
                       f"size {technique.max_batch_size or 1} only.")
            out.append("Is decoding greedy (do_sample=False)? Only then is the output the model's own token for "
                       "token; under sampling it matches in distribution only.")
            if name == "prompt_lookup":
                out.append("Do the outputs repeat text of the prompt (summaries, answers quoting a document, code "
                           "edits)? Prompt lookup proposes only n-grams the prompt holds; elsewhere it proposes "
                           "little and saves nothing.")
            else:
                out.append(f"Is there a draft model several times smaller than {model} that shares its tokenizer "
                           f"and vocabulary?")
    if not versions:
        out.append("Which torch and transformers versions run in production? Support for each technique "
                   "depends on them.")
    return list(dict.fromkeys(out))  # keep order, drop repeats


def _experts_questions(implementation: str, model: str, device: str | None, cc: tuple[int, int] | None,
                       versions: dict[str, str | None]) -> list[str]:
    out = [f"Does the model class of {model} take experts_implementation (transformers' @use_experts_implementation) "
           f"in transformers {versions.get('transformers') or '(version not given)'}?"]
    if implementation == "grouped_mm":
        torch_version = versions.get("torch")
        problem = grouped_mm_problem(device or "cuda", cc, torch_version, device or "the GPU")
        if problem:
            out.append(f"{problem}.")
        elif torch_version is None:
            out.append("Is torch >= 2.9 installed where the model runs (grouped_mm calls torch's grouped GEMM)?")
        elif device != "cpu" and cc is None:
            where = "Is the GPU's" if device == "cuda" else "If it runs on a GPU, is its"
            need = GROUPED_MM_MIN_CAPABILITY
            out.append(f"{where} compute capability >= {capability_text(need)} (torch's grouped GEMM needs it)?")
    elif implementation == "batched_mm":
        out.append("batched_mm copies the selected experts' weights for every token: is there memory for that at "
                   "the batch size and input length you run?")
    return out
