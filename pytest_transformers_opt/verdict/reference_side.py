"""``--opt-ab``: the test's optimized configuration once more, in the reference environment.

The reference is another interpreter (another venv: the previous torch, main's lockfile); a worker
process runs there (``engine.ab_client``), with this checkout's measurement code, so only the stack
differs. ``run_bench`` drives it as a third side: it warms up with the others, runs its verification
run after the candidate's (the memory reading, the proof that each technique ran there too, the
distributions at the baseline's tokens), then takes its turn in every timed round, alternating with
the candidate's optimized side, so both environments are measured on the same machine minutes apart,
never jobs apart. Once its timed rounds are over, its execution census is taken there (one untimed call, as the
candidate's own: ``verdict.census_sides``), so the report shows what the two stacks run differently whatever the
timing says.
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

# Each request to the reference's worker has a time limit, from the candidate's own time for the same work: a
# reference that stops answering is killed and its test's A/B is not comparable, where it would hang the session.
TIMEOUT_FACTOR = 20.0  # a reference 20x slower than the candidate at the same request is taken for hung
REQUEST_FLOOR_S = 60.0  # never less, for a round: a 50 ms round may stall for seconds on a busy machine
LOAD_FLOOR_S = 300.0  # never less, for a load: the reference may convert or quantize what the candidate had cached
STOPPED_WARMUP_S = 1.0  # a side that runs nothing says this for each warm-up round: the same figure each time


def request_timeout(candidate_seconds: list[float], floor_s: float) -> float:
    """``max(floor_s, TIMEOUT_FACTOR x the slowest of candidate_seconds)``: a request's time limit in the
    reference from the candidate's own time for the same request."""
    return max(floor_s, TIMEOUT_FACTOR * max((s for s in candidate_seconds if s and s > 0), default=0.0))


def reference_stack(worker: "ReferenceWorker") -> dict[str, Any]:
    """The reference's stack as a row's A/B record holds it: its interpreter, its Python, every distribution."""
    return {"python": worker.python, "python_version": worker.python_version, "versions": dict(worker.versions),
            "complete": True}


class ReferenceSide:
    """The optimized configuration in the reference environment, for one ``opt_bench`` call.

    A side whose reference cannot run the configuration (a technique it lacks) or stopped answering holds
    ``not_comparable`` (why): from then on it runs nothing, the candidate's rounds go on without it, and its
    record says ``not comparable`` with the reason. The candidate's own verdict stands either way."""

    def __init__(self, worker: "ReferenceWorker | None", key: str, opt: "OptModel", workload: "Workload",
                 check_length: Callable[..., None], candidate: Timings | None, stack: dict[str, Any],
                 nodeid: str) -> None:
        self.worker = worker
        self.key = key
        self.labels = opt.labels
        self.workload = workload
        self.timings = Timings()
        self.loaded: dict[str, Any] = {}  # the worker's load figures: load_time_s, load_peak_bytes, resident_bytes ...
        self.candidate = candidate if candidate is not None else Timings()  # its times set each request's limit
        self.stack = stack
        self.nodeid = nodeid
        self.not_comparable: str | None = None
        self._check_length = check_length
        self.verification: "ReferenceRun | None" = None
        self.logprobs_at_target: list[Any] | None = None
        self.similarity: Similarity | None = None
        self.load_averages = [_load_average()]  # the machine's load when the A/B began, and when recorded
        self.mode = "interleaved"
        self.blocks: list[list[Any]] | None = None  # blocks mode: [environment, rounds] in the order they ran
        self.blocks_of: AlternatingBlocks | None = None
        self.session: "OptSession | None" = None  # set by ``start``: the census is taken at record time
        self.census: dict[str, Any] | None = None  # the reference's census of the configuration, once taken
        self.census_why_not: str | None = None
        self._census_asked = False

    @classmethod
    def start(cls, session: "OptSession", plan: "TestPlan", opt: "OptModel", workload: "Workload",
              check_length: Callable[..., None], candidate: Timings | None = None) -> "ReferenceSide":
        """Load the configuration in the reference (its worker started on first use); a technique the reference
        cannot run, or a reference that stopped answering (now or in an earlier test), makes the side not
        comparable; a reference that cannot be used fails the test. ``candidate``: the candidate's optimized
        timings, read as they grow (each request's time limit)."""
        key = repr(opt.loaded.key)
        gone = session.reference_gone
        if gone is not None:  # killed in an earlier test: not started again, each later test says why
            side = cls(None, key, opt, workload, check_length, candidate, gone[1], plan.nodeid)
            side.not_comparable = gone[0]
            return side
        worker = session.reference_worker()
        side = cls(worker, key, opt, workload, check_length, candidate, reference_stack(worker), plan.nodeid)
        side.session = session
        timeout = request_timeout([opt.loaded.load_time_s or 0.0], LOAD_FLOOR_S)
        loaded = side._request(session, lambda: worker.load(key, plan.optimized.request, plan.model_path,
                                                            opt.techniques, session.device,
                                                            session.conftests_registering_techniques(),
                                                            timeout_s=timeout))
        if loaded is not None and loaded.get("skip"):
            side.not_comparable = str(loaded["skip"])  # the reference cannot run it: the candidate's verdict stands
        elif loaded is not None:
            side.loaded = loaded
        return side

    def _request(self, session: "OptSession", action: Callable[[], Any]) -> Any:
        """One request to the worker; None once the side is not comparable (already, or now: the worker stopped
        answering, was killed, and the session starts no other). A dead worker or a failed request fails the test."""
        from ..engine.ab_client import ReferenceStoppedAnswering

        if self.not_comparable is not None:
            return None
        try:
            return _call(session, action)
        except ReferenceStoppedAnswering as exc:
            self.not_comparable = f"the reference stopped answering after {exc.seconds:.0f} s: {exc}"
            session.reference_stopped_answering(
                f"the reference stopped answering in {self.nodeid} (after {exc.seconds:.0f} s, killed); this session "
                f"starts no other: no A/B for the tests after it", self.stack)
            return None

    def _round_timeout(self) -> float:
        """A round's time limit: from the candidate's slowest round of this test so far (warm-up ones included,
        so a first call's compilation counts)."""
        candidate = self.candidate
        return request_timeout([*candidate.warmup_s, *(r.total_s for r in candidate.rounds)], REQUEST_FLOOR_S)

    def _generate(self, session: "OptSession", **kwargs: Any) -> "ReferenceRun | None":
        workload, worker, timeout = self.workload, self.worker, self._round_timeout()
        if worker is None:
            return None
        run: "ReferenceRun | None" = self._request(session, lambda: worker.generate(
            self.key, workload.prompts, workload.max_new_tokens, workload.batch_size, timeout_s=timeout, **kwargs))
        if run is not None:
            self._check_length(run, f"reference-environment ({self.stack['python']})", self.labels, workload)
        return run

    def warm(self, session: "OptSession") -> float:
        """One warm-up round; its seconds. A side that runs nothing says ``STOPPED_WARMUP_S`` every time, so it
        never holds the others' warm-up open."""
        run = self._generate(session)
        if run is None:
            return STOPPED_WARMUP_S
        self.timings.warmup_s.append(run.timing.total_s)
        return run.timing.total_s

    def timed_round(self, session: "OptSession") -> None:
        run = self._generate(session, timed=True)
        if run is not None:
            self.timings.rounds.append(run.timing)

    def take_census(self, session: "OptSession") -> None:
        """The reference's execution census of the configuration, once per test: one untimed call after its
        timed rounds (``census_of`` in the worker). A census that cannot be taken is None with why
        (``census_why_not``); a request the worker refused is said there too, never the test's failure; one the
        worker stopped answering makes the side not comparable, as any request's. Not asked under
        ``--opt-census=off``."""
        from ..engine.ab_client import ReferenceError as RequestFailed
        from .census_sides import OFF

        if self._census_asked:
            return
        self._census_asked = True
        worker, workload = self.worker, self.workload
        if not session.settings.census:
            self.census_why_not = OFF
            return
        if worker is None or self.not_comparable is not None:  # the record says why: not comparable
            return
        timeout = self._round_timeout()  # a census call is one generate call, under the profiler

        def ask() -> tuple[dict[str, Any] | None, str | None]:
            try:
                return worker.census(self.key, workload.prompts, workload.max_new_tokens, workload.batch_size,
                                     timeout_s=timeout)
            except RequestFailed as exc:
                return None, f"the census request failed {WHERE}: {exc}"

        answer = self._request(session, ask)
        if answer is not None:
            self.census, self.census_why_not = answer

    def verify(self, session: "OptSession", target: list[list[int]] | None) -> None:
        """The reference's verification run: memory, the proof that each technique ran there too, and its
        distributions at ``target`` (the baseline's tokens), forced when its own tokens went elsewhere."""
        run = self._generate(session, keep_logits=True, observe=True, memory=True)
        if run is None:
            return
        if run.problems:
            raise OptProofError(f"silent fallback {WHERE} ({self.stack['python']}): {'; '.join(run.problems)}")
        self.verification = run
        if target is None or run.logprobs is None:
            self.logprobs_at_target = run.logprobs
        elif diverged(target, run.tokens):
            forced = self._generate(session, force_tokens=target)
            self.logprobs_at_target = forced.logprobs if forced is not None else None
        else:
            self.logprobs_at_target = run.logprobs

    def compare(self, candidate_tokens: list[list[int]], candidate_logprobs_at_target: list[Any] | None,
                dtype: str | None = None) -> None:
        """KL(reference || candidate) and top-1 agreement at identical contexts (the baseline's tokens), and
        how far the two environments' free-running greedy tokens agree; near-ties by ``dtype``'s gap."""
        if self.verification is None or self.not_comparable is not None:
            return
        if candidate_logprobs_at_target is None or self.logprobs_at_target is None:
            self.similarity = compare_runs(self.verification.tokens, candidate_tokens, self.workload.max_new_tokens,
                                           dtype=dtype)
            return
        self.similarity = compare_runs(self.verification.tokens, candidate_tokens, self.workload.max_new_tokens,
                                       self.logprobs_at_target, candidate_logprobs_at_target,
                                       forced_logprobs=candidate_logprobs_at_target, dtype=dtype)

    def record(self, side_metrics: Callable[..., Any]) -> dict[str, Any]:
        """The row's ``ab`` record: the reference stack, its optimized side, the cross-environment similarity.
        Verdicts are computed from it when the report is built (``verdict.ab``); a side that is not comparable
        records no figures, its verdict and why (``not_comparable``, which the report keeps as it is).

        ``census``: the reference's census (``take_census``: after the timed rounds of an interleaved A/B, as the
        candidate's own, ``verdict.bench``; blocks take it in their first block) or null with ``why_not``; the report
        adds the change from it to the candidate's (``report.ab.complete_ab``)."""
        self.load_averages = self.load_averages[:1] + [_load_average()]
        common: dict[str, Any] = {
            "mode": self.mode,
            **({"blocks": [list(block) for block in self.blocks],
                "swap_s": self.blocks_of.swap_s if self.blocks_of is not None else None}
               if self.blocks is not None else {}),
            "load_average": [value for value in self.load_averages if value is not None] or None,
            "cores": _cores(),
            "reference": dict(self.stack),
        }
        if self.not_comparable is not None:
            from .judge import NOT_COMPARABLE

            return {**common, "optimized": None, "similarity": None, "not_comparable": self.not_comparable,
                    "verdict": NOT_COMPARABLE, "details": [self.not_comparable],
                    "census": {"reference": None, "why_not": self.not_comparable}}
        assert self.verification is not None
        optimized = side_metrics(self.timings, self.loaded, self.verification)
        why_not = None if self.census is not None else self.census_why_not or "the reference's census was not taken"
        return {**common, "optimized": optimized.to_dict(),
                "similarity": self.similarity.to_dict() if self.similarity is not None else None,
                "census": {"reference": self.census, "why_not": why_not}}



BLOCK_ROUNDS = 5  # the candidate's rounds per block; the reference runs its blocks in pairs between them


class AlternatingBlocks:
    """``--opt-ab-mode=blocks``: the two environments' rounds in alternating blocks, for a device that cannot
    hold both models. The order is candidate, reference, reference, candidate, candidate, reference, ... (ABBA),
    so a drift that grows steadily falls alike on both; the waiting side's model is moved to the CPU
    (``engine.parking``), and each side warms up again after its model comes back. Drift within a block is
    not cancelled, so the A/B's rounds count as unpaired (``verdict.ab``).

    The reference side is loaded at its first block, with the candidate's models off the device."""

    def __init__(self, session: "OptSession", plan: "TestPlan", candidates: list["OptModel"], workload: "Workload",
                 check_length: Callable[..., None], why: str, candidate: Timings | None = None) -> None:
        self.session, self.plan, self.workload, self.check_length = session, plan, workload, check_length
        self.candidate = candidate  # the candidate's optimized timings: each reference request's time limit
        self.candidates = candidates  # the optimized model, and the baseline's where it was loaded
        self.why = why
        self.side: ReferenceSide | None = None
        self.log: list[list[Any]] = []  # [environment, rounds], consecutive rounds of one merged
        self.swap_s = 0.0
        self.verify_with: Callable[[ReferenceSide], None] | None = None  # set once the candidate's run is verified
        self.candidate_cold = False  # the candidate's models came back from the CPU since its last round
        self.warmup_rounds = 1  # the reference's warm-up before its first block: as many as the candidate needed

    def note(self) -> str:
        return (f"--opt-ab: rounds in alternating blocks of {BLOCK_ROUNDS} (candidate, reference, reference, "
                f"candidate, ...), because {self.why}; the waiting side's model was moved to the CPU between its "
                f"blocks, and drift within a block is not cancelled (the environments' rounds count as unpaired)")

    def _logged(self, environment: str, rounds: int) -> None:
        if self.log and self.log[-1][0] == environment:
            self.log[-1][1] += rounds
        else:
            self.log.append([environment, rounds])

    def candidate_round(self, index: int, warm_candidate: Callable[[], None]) -> None:
        """Before the candidate's timed round ``index``: the reference's blocks owed by now (two after every
        second candidate block), then the round is counted."""
        block = index // BLOCK_ROUNDS
        if index and index % BLOCK_ROUNDS == 0:
            self._reference_rounds(2 * ((block + 1) // 2) * BLOCK_ROUNDS)
        if self.candidate_cold:  # its first round after the move is not a timed one
            warm_candidate()
            self.candidate_cold = False
        self._logged("candidate", 1)

    def finish(self, candidate_rounds: int) -> None:
        """After the candidate's rounds: the reference runs as many (a confirmation's rounds later may add a
        candidate block, which warms up first)."""
        self._reference_rounds(candidate_rounds)

    def _reference_rounds(self, target: int) -> None:
        from ..engine.parking import park

        done = len(self.side.timings.rounds) if self.side is not None else 0
        if target <= done or (self.side is not None and self.side.not_comparable is not None):
            return
        homes = [str(next(iter(model.model.parameters())).device) for model in self.candidates]
        try:
            self.swap_s += sum(park(model.model, "cpu") for model in self.candidates)
            side = self.side
            if side is None:
                side = self.side = ReferenceSide.start(self.session, self.plan, self.candidates[0], self.workload,
                                                       self.check_length, self.candidate)
                side.mode, side.blocks, side.blocks_of = "blocks", self.log, self
                for _ in range(max(1, self.warmup_rounds)):
                    side.warm(self.session)
                if self.verify_with is not None:
                    self.verify_with(side)
            else:
                self.swap_s += self._park(side, "device")
                side.warm(self.session)  # its first round after the move is not a timed one
            for _ in range(target - done):
                side.timed_round(self.session)
            if side.not_comparable is None:
                self._logged("reference", target - done)
            side.take_census(self.session)  # in its first block, after its timed rounds, its model on the device
            self.swap_s += self._park(side, "host")
        finally:  # also when the reference skipped or failed the test: the session's cached models go back
            self.swap_s += sum(park(model.model, home) for model, home in zip(self.candidates, homes))
            self.candidate_cold = True


    def _park(self, side: ReferenceSide, to: str) -> float:
        """Move the reference's model (``host`` or ``device``); the seconds it took (0 where the side runs nothing)."""
        worker, timeout = side.worker, side._round_timeout()
        if worker is None:
            return 0.0
        seconds = side._request(self.session, lambda: worker.park(side.key, to, timeout_s=timeout))
        return float(seconds or 0.0)


def ab_mode(session: "OptSession", opt: "OptModel", base: "OptModel | None") -> tuple[str | None, str | None]:
    """How this test's A/B runs under ``--opt-ab-mode``: ``("interleaved", None)``, ``("blocks", why)``, or
    ``(None, why not)`` where it cannot run (the test then runs without its A/B and says so)."""
    from ..engine.parking import why_not_parkable

    requested = session.settings.ab_mode
    too_small = device_cannot_hold_both(session, opt) if requested != "blocks" else None
    if requested == "interleaved" or (requested == "auto" and too_small is None):
        if too_small is None:
            return "interleaved", None
        return None, (f"--opt-ab: no A/B for this test: {too_small} (both processes hold a model in interleaved "
                      f"rounds); use a larger device, a smaller model, or --opt-ab-mode=blocks")
    why = too_small or "--opt-ab-mode=blocks"
    for model in [opt] + ([base] if base is not None else []):
        unmovable = why_not_parkable(model.model)
        if unmovable:
            return None, (f"--opt-ab: no A/B for this test: {why}, and blocks cannot be run: the model "
                          f"[{', '.join(model.labels)}] cannot wait on the CPU: {unmovable}")
    return "blocks", why


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
    return (f"{session.device} has {format_bytes(free)} free, and the reference's copy of the model needs about "
            f"{format_bytes(need)} beside this one")


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
        failure = f"--opt-ab: the reference environment's worker died: {exc}"
    except ReferenceError as exc:
        failure = f"--opt-ab: {WHERE}: {exc}"
    pytest.fail(failure, pytrace=False)  # outside the handler: the message once, not chained to the worker's
