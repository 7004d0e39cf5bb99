"""``--opt-ab``: the test's optimized configuration once more, in the reference environment.

The reference is another interpreter (another venv: the previous torch, main's lockfile); a worker
process runs there (``engine.ab_client``), with this checkout's measurement code, so only the stack
differs. ``run_bench`` drives it as a third side: it warms up with the others, runs its verification
run after the candidate's (the memory reading, the proof that each technique ran there too, the
distributions at the baseline's tokens), then takes its turn in every timed round, alternating with
the candidate's optimized side, so both environments are measured on the same machine minutes apart,
never jobs apart.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

import pytest

from ..engine.measure import Timings
from ..errors import OptProofError
from .similarity import Similarity, compare_runs, diverged

if TYPE_CHECKING:
    from ..engine.ab_client import ReferenceRun, ReferenceWorker
    from ..engine.model import OptModel
    from ..plan import TestPlan
    from ..session import OptSession
    from .results import Workload

WHERE = "in the reference environment"


class ReferenceSide:
    """The optimized configuration in the reference environment, for one ``opt_bench`` call."""

    def __init__(self, worker: "ReferenceWorker", key: str, opt: "OptModel", workload: "Workload",
                 check_length: Callable[..., None], loaded: dict[str, Any]) -> None:
        self.worker = worker
        self.key = key
        self.labels = opt.labels
        self.workload = workload
        self.timings = Timings()
        self.loaded = loaded  # the worker's load figures: load_time_s, load_peak_bytes, resident_bytes ...
        self._check_length = check_length
        self.verification: "ReferenceRun | None" = None
        self.logprobs_at_target: list[Any] | None = None
        self.similarity: Similarity | None = None
        self.load_averages = [_load_average()]  # the machine's load when the A/B began, and when recorded

    @classmethod
    def start(cls, session: "OptSession", plan: "TestPlan", opt: "OptModel", workload: "Workload",
              check_length: Callable[..., None]) -> "ReferenceSide":
        """Load the configuration in the reference (its worker started on first use); a technique the
        reference cannot run skips the test, saying so; a reference that cannot be used fails it."""
        worker = session.reference_worker()
        key = repr(opt.loaded.key)
        loaded = _call(session, lambda: worker.load(key, plan.optimized.request, plan.model_path, opt.techniques,
                                                    session.device, session.conftests_registering_techniques()))
        if loaded.get("skip"):
            pytest.skip(f"--opt-ab: {loaded['skip']}")
        return cls(worker, key, opt, workload, check_length, loaded)

    def _generate(self, session: "OptSession", **kwargs: Any) -> "ReferenceRun":
        workload = self.workload
        run: "ReferenceRun" = _call(session, lambda: self.worker.generate(self.key, workload.prompts, workload.max_new_tokens,
                                                          workload.batch_size, **kwargs))
        self._check_length(run, f"reference-environment ({self.worker.python})", self.labels, workload)
        return run

    def warm(self, session: "OptSession") -> float:
        seconds = self._generate(session).timing.total_s
        self.timings.warmup_s.append(seconds)
        return seconds

    def timed_round(self, session: "OptSession") -> None:
        self.timings.rounds.append(self._generate(session).timing)

    def verify(self, session: "OptSession", target: list[list[int]] | None) -> None:
        """The reference's verification run: memory, the proof that each technique ran there too, and its
        distributions at ``target`` (the baseline's tokens), forced when its own tokens went elsewhere."""
        run = self._generate(session, keep_logits=True, observe=True, memory=True)
        if run.problems:
            raise OptProofError(f"silent fallback {WHERE} ({self.worker.python}): {'; '.join(run.problems)}")
        self.verification = run
        if target is None or run.logprobs is None:
            self.logprobs_at_target = run.logprobs
        elif diverged(target, run.tokens):
            self.logprobs_at_target = self._generate(session, force_tokens=target).logprobs
        else:
            self.logprobs_at_target = run.logprobs

    def compare(self, candidate_tokens: list[list[int]], candidate_logprobs_at_target: list[Any] | None) -> None:
        """KL(reference || candidate) and top-1 agreement at identical contexts (the baseline's tokens), and
        how far the two environments' free-running greedy tokens agree."""
        assert self.verification is not None
        if candidate_logprobs_at_target is None or self.logprobs_at_target is None:
            self.similarity = compare_runs(self.verification.tokens, candidate_tokens, self.workload.max_new_tokens)
            return
        self.similarity = compare_runs(self.verification.tokens, candidate_tokens, self.workload.max_new_tokens,
                                       self.logprobs_at_target, candidate_logprobs_at_target,
                                       forced_logprobs=candidate_logprobs_at_target)

    def record(self, side_metrics: Callable[..., Any]) -> dict[str, Any]:
        """The row's ``ab`` record: the reference stack, its optimized side, the cross-environment similarity.
        Verdicts are computed from it when the report is built (``verdict.ab``)."""
        assert self.verification is not None
        optimized = side_metrics(self.timings, self.loaded, self.verification)
        self.load_averages = self.load_averages[:1] + [_load_average()]
        return {
            "mode": "interleaved",
            "load_average": [value for value in self.load_averages if value is not None] or None,
            "cores": _cores(),
            "reference": {"python": self.worker.python, "python_version": self.worker.python_version,
                          "versions": dict(self.worker.versions)},
            "optimized": optimized.to_dict(),
            "similarity": self.similarity.to_dict() if self.similarity is not None else None,
        }


DEVICE_HEADROOM = 1.2  # the reference's copy of the model, and some room for its generation


def device_cannot_hold_both(session: "OptSession", opt: "OptModel") -> str | None:
    """On CUDA, why the device cannot hold the reference's copy of the model beside the candidate's (free
    memory now against the candidate's resident bytes), or None. Then the test runs without its A/B and
    says so: the two processes would fight for the card, and an out-of-memory in either fails the test."""
    if not session.hardware.is_cuda or not opt.loaded.resident_bytes:
        return None
    import torch

    from ..units import format_bytes

    free, _total = torch.cuda.mem_get_info(torch.device(session.device))
    need = int(opt.loaded.resident_bytes * DEVICE_HEADROOM)
    if free >= need:
        return None
    return (f"--opt-ab: no A/B for this test: {session.device} has {format_bytes(free)} free, the reference's copy "
            f"of the model needs about {format_bytes(need)} beside this one (both processes hold a model); use a "
            f"larger device or a smaller model for the A/B job")


def oversubscribed_note(record: dict[str, Any] | None) -> str | None:
    """A line for the test's notes when the machine ran more than it has cores while the A/B was measured:
    then the scheduler favours the process that ran least, the reference's worker (idle between its
    turns), and the reference looks faster than it is."""
    if not record or not record.get("load_average") or not record.get("cores"):
        return None
    load, cores = max(record["load_average"]), record["cores"]
    if load <= cores:
        return None
    return (f"--opt-ab: the machine was oversubscribed while this A/B was measured (load average {load:.1f} on "
            f"{cores} cores): the scheduler favours the reference's worker, idle between its turns, so the "
            f"reference's figures may look faster than they are; run A/B jobs on a runner with idle cores")


def _load_average() -> float | None:
    """The machine's one-minute load average (runnable processes), where the system says it."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _cores() -> int | None:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _call(session: "OptSession", action: Callable[[], Any]) -> Any:
    """Run one request to the worker; a dead worker or a failed request fails this test in one line (with
    the worker's last lines), and the next test starts a new worker."""
    from ..engine.ab_client import ReferenceError, ReferenceWorkerDied

    try:
        return action()
    except ReferenceWorkerDied as exc:
        session.forget_reference_worker()
        pytest.fail(f"--opt-ab: the reference environment's worker died: {exc}", pytrace=False)
    except ReferenceError as exc:
        pytest.fail(f"--opt-ab: {WHERE}: {exc}", pytrace=False)
