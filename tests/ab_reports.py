"""Crafted report rows with an ``--opt-ab`` record (test fixture): the candidate's optimized side, and the
reference's in the row's ``ab``, as the session writes them before ``report.ab.complete_ab`` completes them."""

from __future__ import annotations

import copy
import statistics
from typing import Any

# Ten rounds of a reference, spread about 100 ms (a little noise, no trend).
REFERENCE_ROUNDS = [0.100, 0.101, 0.099, 0.102, 0.098, 0.1005, 0.0995, 0.1015, 0.0985, 0.1002]
CANDIDATE_VERSIONS = {"torch": "2.13.0", "transformers": "5.24.0", "accelerate": "1.10.0", "bitsandbytes": None,
                      "kernels": "0.10.0", "safetensors": "0.6.2", "tokenizers": "0.22.1"}
CANDIDATE = {"python": "/venv/candidate/bin/python", "versions": CANDIDATE_VERSIONS}
ENV: dict[str, Any] = {
    "python": "3.12.0", "platform": "Linux-6.8-x86_64", "torch": "2.13.0", "transformers": "5.24.0",
    "accelerate": "1.10.0", "bitsandbytes": None, "kernels": None, "cuda": None, "driver": None, "device": "cpu",
    "gpu_name": None, "compute_capability": None, "gpu_memory_bytes": None, "device_count": 0,
    "bf16_supported": None, "tf32": None, "hardware": "CPU: Test CPU",
}


def side(rounds: list[float], *, memory: int = 100 * 2**20, tokens: int = 8) -> dict[str, Any]:
    """An optimized side's figures (the metrics a report row keeps) from its latency rounds."""
    latency = statistics.median(rounds)
    return {"ttft_s": latency / 4, "tpot_s": latency / 10, "latency_s": latency, "throughput_tok_s": tokens / latency,
            "peak_memory_bytes": memory, "load_time_s": 0.5, "compile_time_s": None, "tokens_generated": tokens,
            "recompiles": None, "rounds": len(rounds), "latency_samples_s": list(rounds), "warmup_s": [latency],
            "memory_method": "VmHWM"}


def reference_versions(**changed: str | None) -> dict[str, str | None]:
    return {**CANDIDATE_VERSIONS, **changed}


def ab_record(rounds: list[float], *, versions: dict[str, str | None] | None = None, kl_mean: float = 0.0005,
              top1: float = 1.0, mode: str = "interleaved", memory: int = 100 * 2**20,
              python: str = "/venv/reference/bin/python") -> dict[str, Any]:
    """A row's ``ab`` as the session writes it: the reference's stack, side and the cross-environment similarity."""
    reference_side = side(rounds, memory=memory)
    reference_side["texts"] = ["The cat sees a dog."]
    return {"mode": mode, "reference": {"python": python, "versions": versions or reference_versions()},
            "optimized": reference_side,
            "similarity": {"kl_mean": kl_mean, "kl_max": kl_mean * 4, "top1": top1, "token_match": 1.0,
                           "compared_steps": 8, "note": None}}


def row(nodeid: str, candidate_rounds: list[float], ab: dict[str, Any] | None, *, memory: int = 100 * 2**20
        ) -> dict[str, Any]:
    """A measured test row of a report (schema-valid), with ``ab`` when given."""
    made: dict[str, Any] = {
        "nodeid": nodeid, "outcome": "passed", "skip_reason": None, "error": None,
        "model": {"name_or_path": "tiny-random-llama", "revision": None, "dtype": "float32"},
        "techniques": ["sdpa"], "baseline_techniques": ["eager"],
        "workload": {"num_prompts": 1, "max_new_tokens": 8, "batch_size": 1, "input_tokens": 6},
        "baseline": side([r * 1.2 for r in candidate_rounds]), "optimized": side(candidate_rounds, memory=memory),
        "speedup": 1.2, "memory_ratio": 1.0,
        "similarity": {"token_match": 1.0, "kl_mean": 0.0, "kl_max": 0.0, "top1": 1.0, "near_tie": False},
        "budgets": [], "failed_budgets": [], "estimates": {}, "regression": None, "hardware": "CPU: Test CPU",
    }
    if ab is not None:
        made["ab"] = copy.deepcopy(ab)
    return made


def report(*tests: dict[str, Any]) -> dict[str, Any]:
    return {"schema": "pytest-transformers-opt/report", "schema_version": 1, "created": "2026-01-01T00:00:00+00:00",
            "environment": copy.deepcopy(ENV),
            "settings": {"budgets_mode": "enforce", "rounds": 10, "warmup": 1, "device": "cpu",
                         "default_model": "tiny-random-llama"},
            "tests": list(tests), "summary": {"passed": len(tests), "failed": 0, "skipped": 0, "error": 0},
            "advice": None}
