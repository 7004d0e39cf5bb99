"""One rank of a ``tensor_parallel`` run: ``python -m pytest_transformers_opt.engine.tp_worker SPEC.json OUT_DIR``.

Started by :func:`pytest_transformers_opt.engine.tensor_parallel.run_tensor_parallel` through ``torchrun``, never by
users. Each rank reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, joins the process group (gloo on CPU,
nccl on CUDA), loads the model sharded with ``DistributedConfig(tp_size=N)``, counts the parameters
that really are shards (the proof), then runs the workload the way the in-process bench does
(:func:`generation.run_generation`: greedy, exactly ``max_new_tokens``, left padding): warm-up rounds,
the verification run (log-probabilities, generation memory), timed rounds, each started together
after a barrier; then, when the spec has ``force_tokens`` (the baseline's) and the verification run
diverged from them, a forced run decoding them (KL at every position). Every rank writes
``OUT_DIR/rank{r}.json``; rank 0 also writes the verification log-probabilities to
``OUT_DIR/logprobs.safetensors`` and the forced run's to ``OUT_DIR/forced_logprobs.safetensors``
(safetensors, never pickle). An exception is
written as ``{"error": ...}`` into the rank's file and the process exits non-zero.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..files import write_atomic

LOGPROBS_FILE = "logprobs.safetensors"
FORCED_LOGPROBS_FILE = "forced_logprobs.safetensors"  # the forced run's, when the spec has force_tokens


def rank_file(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank{rank}.json"


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(payload, indent=1, default=str))  # the parent never reads a half-written file


def _init_distributed(device_type: str, local_rank: int, timeout_s: float) -> tuple[str, str]:
    """Join the process group; returns (backend, this rank's device)."""
    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
        backend = "nccl"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=torch.device("cuda", local_rank))
    else:
        device = "cpu"
        backend = "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return backend, device


def _load_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments: the user's, then dtype/attention, then the TP config."""
    from ..units import parse_dtype

    kwargs: dict[str, Any] = dict(spec.get("from_pretrained_kwargs") or {})
    kwargs.setdefault("use_safetensors", True)
    kwargs["trust_remote_code"] = bool(spec.get("trust_remote_code", False))
    if spec.get("revision"):
        kwargs["revision"] = spec["revision"]
    if spec.get("dtype"):
        kwargs["dtype"] = parse_dtype(spec["dtype"], "tensor_parallel dtype")
    kwargs["attn_implementation"] = spec.get("attn_implementation") or "eager"
    kwargs.pop("device_map", None)  # tensor parallelism and device_map are mutually exclusive
    try:
        from transformers import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=int(spec["tp_size"]))
    except ImportError:  # transformers before DistributedConfig: the standalone arguments
        kwargs["tp_plan"] = "auto"
        kwargs["tp_size"] = int(spec["tp_size"])
    return kwargs


def shard_evidence(model: Any) -> dict[str, Any]:
    """How many parameters are DTensors, how many hold only a shard, and one example."""
    from torch.distributed.tensor import DTensor

    total = dtensors = sharded = 0
    local_bytes = full_bytes = 0
    example: dict[str, Any] | None = None
    for name, param in model.named_parameters():
        total += 1
        size = param.element_size()
        full_bytes += param.numel() * size
        if isinstance(param, DTensor):
            dtensors += 1
            local = param.to_local()
            local_bytes += local.numel() * size
            is_shard = tuple(local.shape) != tuple(param.shape) or any(p.is_shard() for p in param.placements)
            if is_shard:
                sharded += 1
                if example is None:
                    example = {"name": name, "full_shape": list(param.shape), "local_shape": list(local.shape),
                               "placements": [str(p) for p in param.placements]}
        else:
            local_bytes += param.numel() * size
    return {"total_params": total, "dtensor_params": dtensors, "sharded_params": sharded,
            "local_param_bytes": local_bytes, "full_param_bytes": full_bytes, "example_shard": example}


def _plain(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def run(spec: dict[str, Any], out_dir: Path, rank: int, world_size: int, local_rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import transformers
    from transformers import AutoModelForCausalLM

    from ..compat import device_mesh
    from .generation import run_generation
    from .hardware import HardwareInfo
    from .loading import ModelRequest, load_tokenizer, prime_loader
    from .model import LoadedModel, OptModel
    from .measure import track_peak_memory
    from ..techniques import GenerationSettings, ProbeContext

    device_type = spec.get("device_type", "cpu")
    backend, device = _init_distributed(device_type, local_rank, float(spec.get("timeout_s", 300)))
    result: dict[str, Any] = {
        "rank": rank, "local_rank": local_rank, "world_size": dist.get_world_size(), "backend": backend,
        "device": device, "threads": torch.get_num_threads(), "pid": os.getpid(), "host": platform.node(),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    path = spec["model_path"]
    request = ModelRequest(name_or_path=path, revision=spec.get("revision"), dtype=spec.get("dtype"),
                           trust_remote_code=bool(spec.get("trust_remote_code", False)), origin="tensor_parallel")
    tokenizer = load_tokenizer(path, request)
    kwargs = _load_kwargs(spec)
    result["from_pretrained_kwargs"] = {k: (repr(v) if k == "distributed_config" else str(v)) for k, v in kwargs.items()}
    prime_loader(device)  # one-time import/allocator costs stay out of the measured load, as in-process
    dist.barrier()
    start = time.perf_counter()
    with track_peak_memory(device) as load_memory:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        model.eval()
        with torch.inference_mode():  # make memory-mapped weights resident, as loading.load_model does
            model(**tokenizer(["Hello"], return_tensors="pt").to(device))
    result["load_time_s"] = time.perf_counter() - start
    result["load_peak_bytes"] = load_memory.peak_delta_bytes
    result["resident_bytes"] = load_memory.resident_delta_bytes
    result["memory_method"] = load_memory.method
    result.update(shard_evidence(model))
    result["model_tp_size"] = getattr(model, "tp_size", None)
    mesh = device_mesh(model)
    result["device_mesh"] = None if mesh is None else str(mesh)
    result["model_device"] = str(getattr(model, "device", ""))

    loaded = LoadedModel(key=("tensor_parallel", path, rank), model=model, tokenizer=tokenizer, path=path,
                         load_time_s=result["load_time_s"], load_peak_bytes=load_memory.peak_delta_bytes,
                         resident_bytes=load_memory.resident_delta_bytes, memory_method=load_memory.method,
                         load_techniques=(f"tensor_parallel(tp_size={spec['tp_size']})",))
    opt = OptModel(loaded=loaded, techniques=[], generation=GenerationSettings(kwargs=dict(spec.get("generate_kwargs") or {})),
                   request=request, device=device, probe_context=ProbeContext(hardware=HardwareInfo(device=device, device_type=device_type)))
    prompts, new_tokens, batch = list(spec["prompts"]), int(spec["max_new_tokens"]), int(spec["batch_size"])

    def once(keep_logits: bool = False) -> Any:
        dist.barrier()  # every rank starts the round together: one wall clock for all
        return run_generation(opt, prompts, new_tokens, batch_size=batch, keep_logits=keep_logits)

    result["warmup_s"] = [once().timing.total_s for _ in range(int(spec["warmup"]))]
    with track_peak_memory(device) as generation_memory:
        verification = once(keep_logits=True)
    result["generation_peak_bytes"] = generation_memory.peak_delta_bytes
    # the bench's rule: the larger of loading and (resident weights + generation peak)
    if generation_memory.peak_delta_bytes is None:
        result["peak_memory_bytes"] = load_memory.peak_delta_bytes
    else:
        result["peak_memory_bytes"] = max(load_memory.peak_delta_bytes or 0,
                                          (load_memory.resident_delta_bytes or 0) + generation_memory.peak_delta_bytes)
    result["verification"] = dataclasses.asdict(verification.timing)
    result["tokens"] = verification.tokens
    result["texts"] = verification.texts
    result["rounds"] = [dataclasses.asdict(once().timing) for _ in range(int(spec["rounds"]))]
    forced = None
    force_tokens = spec.get("force_tokens")
    if force_tokens is not None:
        # forced decoding of the baseline's tokens, after the timed rounds (outside every figure), when
        # the free run diverged; rank 0 decides for all, so every rank takes part in the same collectives
        decision = [verification.tokens != force_tokens]
        dist.broadcast_object_list(decision, src=0)
        if decision[0]:
            dist.barrier()
            forced = run_generation(opt, prompts, new_tokens, batch_size=batch, force_tokens=force_tokens).logprobs
    result["forced_run"] = forced is not None
    if rank == 0:
        from safetensors.torch import save_file

        for name, key, logprobs in ((LOGPROBS_FILE, "logprobs_file", verification.logprobs),
                                    (FORCED_LOGPROBS_FILE, "forced_logprobs_file", forced)):
            if logprobs is not None:
                tensors = {str(i): _plain(t).detach().float().cpu().contiguous() for i, t in enumerate(logprobs)}
                save_file(tensors, str(out_dir / name))
                result[key] = name
    dist.barrier()
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python -m pytest_transformers_opt.engine.tp_worker SPEC.json OUT_DIR (under torchrun)", file=sys.stderr)
        return 2
    spec_path, out_dir = Path(argv[0]), Path(argv[1])
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    out_dir.mkdir(parents=True, exist_ok=True)
    code = 0
    try:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError("tp_worker runs under torchrun (RANK/WORLD_SIZE are not set)")
        spec = json.loads(spec_path.read_text())
        payload = run(spec, out_dir, rank, world_size, local_rank)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes this rank's report
        payload = {"rank": rank, "world_size": world_size, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()[-4000:]}
        code = 1
    _write_json(rank_file(out_dir, rank), payload)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if code == 0:
                dist.destroy_process_group()
            # after a failure the peers may be stuck in a collective: leave without waiting for them
    except Exception:
        pass
    if code:
        sys.stderr.write(f"tp_worker rank {rank}: {payload['error']}\n")
        sys.stderr.flush()
        os._exit(code)  # no atexit handlers that could block on a broken process group
    return 0


if __name__ == "__main__":
    sys.exit(main())
