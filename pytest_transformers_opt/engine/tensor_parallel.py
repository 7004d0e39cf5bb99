"""``tensor_parallel(tp_size=N)``: the workload in N processes, launched by the plugin through torchrun.

Users run plain ``pytest``; :func:`run_tensor_parallel` writes the workload to a spec file, starts
``python -m torch.distributed.run --standalone --nproc-per-node=N -m pytest_transformers_opt.engine.tp_worker``
as a child process group (killed whole on timeout), and reads back what every rank wrote: tokens,
verification log-probabilities (rank 0, safetensors), timed rounds, peak memory, and the proof that
the weights were sharded (DTensor parameters holding a shard, world size N).

On CUDA each rank takes one device (nccl) and the probe wants N devices; on CPU the ranks run for
real over gloo, each with ``cpu_count // N`` threads so they do not oversubscribe the cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..techniques.parallel import distributed_reason
from .measure import RoundTiming, Timings
from .progress import long_work

WORKER_MODULE = "pytest_transformers_opt.engine.tp_worker"
_STDERR_TAIL = 3000


class TensorParallelUnavailable(RuntimeError):
    """This machine or torch build cannot run tensor parallelism; ``reason`` is the skip reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class TensorParallelRun:
    """What the ranks reported. Figures are rank 0's unless named per rank or maxed over ranks."""

    tokens: list[list[int]]
    texts: list[str]
    logprobs: list[Any] | None  # per prompt: float tensor [steps, vocab], rank 0's verification run
    rounds: list[RoundTiming]  # timed rounds, rank 0 (ranks start each round together after a barrier)
    verification: RoundTiming
    warmup_s: list[float]
    world_size: int
    tp_size: int
    sharded_params: list[int]  # per rank: parameters that hold only a shard (DTensor, Shard placement)
    peak_memory_bytes: int | None  # max over ranks of each rank's own peak (load vs resident + generation)
    load_time_s: float  # max over ranks: from_pretrained + first forward
    memory_method: str
    threads_per_rank: int | None
    wall_s: float  # the whole torchrun launch, start-up and teardown included
    per_rank: list[dict[str, Any]] = field(default_factory=list)
    # per prompt, rank 0's forced run decoding ``force_tokens``; None when not asked or the tokens matched
    forced_logprobs: list[Any] | None = None

    def timings(self) -> Timings:
        return Timings(rounds=list(self.rounds), warmup_s=list(self.warmup_s))

    @property
    def tokens_agree(self) -> bool:
        """Every rank generated the same tokens (tensor parallelism computes one result on all ranks)."""
        return all(r.get("tokens") == self.tokens for r in self.per_rank)

    def problem(self) -> str | None:
        """The proof that tensor parallelism took effect; a sentence when it did not."""
        label = f"tensor_parallel(tp_size={self.tp_size})"
        if self.world_size != self.tp_size:
            return f"{label} ran with a process group of {self.world_size}"
        if len(self.per_rank) != self.tp_size:
            return f"{label} heard from {len(self.per_rank)} ranks"
        unsharded = [r["rank"] for r in self.per_rank if not r.get("sharded_params")]
        if unsharded:
            return f"{label}: no parameter was sharded on rank(s) {unsharded} (the model loaded whole)"
        sizes = {r.get("model_tp_size") for r in self.per_rank}
        if sizes != {self.tp_size}:
            return f"{label}: the model reports tp_size {sorted(sizes, key=str)}"
        if not self.tokens_agree:
            return f"{label}: the ranks generated different tokens"
        return None


def _tail(path: Path, limit: int = _STDERR_TAIL) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:].strip()


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """Stop torchrun and its workers: the child was started in its own session (process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _child_env(device_type: str, tp_size: int) -> tuple[dict[str, str], int | None]:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)  # a pytest that itself runs under a launcher must not leak its rank into ours
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    threads = None
    if device_type == "cpu":
        threads = max(1, (os.cpu_count() or 1) // tp_size)
        env["OMP_NUM_THREADS"] = str(threads)
        env["CUDA_VISIBLE_DEVICES"] = ""  # transformers picks the mesh device from the visible accelerator
    return env, threads


def _read_ranks(out_dir: Path, tp_size: int, timed_out: bool) -> tuple[list[dict[str, Any] | None], list[str]]:
    reports: list[dict[str, Any] | None] = []
    problems: list[str] = []
    for rank in range(tp_size):
        path = out_dir / f"rank{rank}.json"
        if not path.is_file():
            reports.append(None)
            why = "stopped at the timeout" if timed_out else "killed, or stopped by torchrun after another rank failed"
            problems.append(f"rank {rank} wrote no report ({why})")
            continue
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            reports.append(None)
            problems.append(f"rank {rank} wrote an unreadable report: {exc}")
            continue
        reports.append(report)
        if "error" in report:
            problems.append(f"rank {rank} failed: {report['error']}")
    return reports, problems


def _load_logprobs(out_dir: Path, report: dict[str, Any], key: str = "logprobs_file") -> list[Any] | None:
    name = report.get(key)
    if not name:
        return None
    from safetensors.torch import load_file

    tensors = load_file(str(out_dir / name))
    return [tensors[str(i)] for i in range(len(tensors))]


def run_tensor_parallel(model_path: str, *, dtype: str | None, tp_size: int, prompts: list[str], max_new_tokens: int,
                        batch_size: int, rounds: int, warmup: int, device_type: str = "cpu",
                        attn_implementation: str = "eager", timeout_s: float = 300, revision: str | None = None,
                        trust_remote_code: bool = False, from_pretrained_kwargs: dict[str, Any] | None = None,
                        generate_kwargs: dict[str, Any] | None = None,
                        force_tokens: list[list[int]] | None = None) -> TensorParallelRun:
    """Run the workload in ``tp_size`` torchrun processes and collect what each rank measured.

    ``force_tokens`` (the baseline's, one list per prompt): when the ranks' free run diverges from
    them, they also decode them (forced decoding) and ``forced_logprobs`` holds that run's distributions.

    Raises :class:`TensorParallelUnavailable` (with ``.reason``) when torch.distributed or its backend
    is missing here, and ``RuntimeError`` naming the failing rank's error and torchrun's stderr tail
    when a rank fails or the run exceeds ``timeout_s``.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"run_tensor_parallel: tp_size={tp_size!r}; accepted: an int >= 1")
    device_type = device_type.split(":")[0]
    device_count = 0
    if device_type == "cuda":
        import torch

        device_count = torch.cuda.device_count()
    reason = distributed_reason(device_type, device_count, tp_size)
    if reason:
        raise TensorParallelUnavailable(reason)

    spec = {
        "model_path": str(model_path), "dtype": dtype, "tp_size": tp_size, "prompts": list(prompts),
        "max_new_tokens": int(max_new_tokens), "batch_size": int(batch_size), "rounds": int(rounds),
        "warmup": int(warmup), "device_type": device_type, "attn_implementation": attn_implementation,
        "timeout_s": float(timeout_s), "revision": revision, "trust_remote_code": bool(trust_remote_code),
        "from_pretrained_kwargs": dict(from_pretrained_kwargs or {}), "generate_kwargs": dict(generate_kwargs or {}),
        "force_tokens": None if force_tokens is None else [list(map(int, t)) for t in force_tokens],
    }
    label = f"tensor_parallel(tp_size={tp_size})"
    work = Path(tempfile.mkdtemp(prefix="pto-tp-"))
    try:
        spec_path, out_dir = work / "spec.json", work / "out"
        out_dir.mkdir()
        try:
            spec_path.write_text(json.dumps(spec))
        except TypeError as exc:
            raise ValueError(f"{label}: from_pretrained/generate arguments must be JSON values to reach the "
                             f"worker processes: {exc}") from exc
        env, threads = _child_env(device_type, tp_size)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                   f"--nproc-per-node={tp_size}", "--max-restarts=0", "-m", WORKER_MODULE, str(spec_path), str(out_dir)]
        stdout_path, stderr_path = work / "torchrun.out", work / "torchrun.err"
        start = time.perf_counter()
        announce = long_work(f"running {label} in {tp_size} torchrun processes",
                             detail=f"{rounds + warmup} round{'s' * (rounds + warmup != 1)}, time limit {timeout_s:g} s")
        with announce, stdout_path.open("wb") as stdout, stderr_path.open("wb") as stderr:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env,
                                    cwd=str(work), start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                code = None
            except BaseException:  # KeyboardInterrupt: leave no workers behind
                _kill_group(proc)
                raise
        wall = time.perf_counter() - start
        reports, problems = _read_ranks(out_dir, tp_size, timed_out=code is None)
        if code is None or code != 0 or problems:
            what = f"timed out after {timeout_s:g} s" if code is None else f"exited with status {code}"
            detail = "; ".join(problems) or "every rank reported success"
            tail = _tail(stderr_path) or _tail(stdout_path) or "(empty)"
            raise RuntimeError(f"{label} {what}: {detail}\n--- torchrun stderr (tail) ---\n{tail}")
        ok = [r for r in reports if r is not None]
        first = ok[0]
        peaks = [int(r["peak_memory_bytes"]) for r in ok if r.get("peak_memory_bytes") is not None]
        return TensorParallelRun(
            tokens=first["tokens"], texts=first["texts"], logprobs=_load_logprobs(out_dir, first),
            rounds=[RoundTiming(**r) for r in first["rounds"]], verification=RoundTiming(**first["verification"]),
            warmup_s=list(first["warmup_s"]), world_size=int(first["world_size"]), tp_size=tp_size,
            sharded_params=[int(r.get("sharded_params", 0)) for r in ok], peak_memory_bytes=max(peaks) if peaks else None,
            load_time_s=max(float(r["load_time_s"]) for r in ok), memory_method=str(first.get("memory_method", "")),
            threads_per_rank=threads, wall_s=wall, per_rank=ok,
            forced_logprobs=_load_logprobs(out_dir, first, "forced_logprobs_file"),
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
