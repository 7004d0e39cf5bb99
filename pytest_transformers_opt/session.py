"""The session object behind every hook and fixture, stored in ``config.stash``, and the plugin object
whose methods are the runtime hooks.

``OptSession`` owns the settings, the hardware probe, the technique registry, the model cache, the
baseline reference runs and what each test recorded for the report. ``OptPlugin`` is registered with
it in ``pytest_configure`` and hands each hook's work to it or to the report writer.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generator

import pytest

from .compat import compile_cache_counts, package_version
from .errors import OptConfigError, OptLoadError, OptProofError
from .units import ERROR_CHARS  # the JSON keeps the whole error: its reason may come late (compiler output)
from .engine.compile_cache import CompileCache, cache_key, compile_cache_state
from .markers import read_markers
from .options import Settings

# The stages (engine, techniques, verdict, report) are imported where first used: pytest imports this module
# at every start-up, also for sessions that use none of the plugin.
if TYPE_CHECKING:
    from .engine.hardware import HardwareInfo
    from .engine.loading import ModelCache, ModelRequest
    from .engine.model import LoadedModel, OptModel
    from .plan import Configuration, TestPlan
    from .report.writer import ReportWriter
    from .techniques import ProbeContext, TechniqueRegistry
    from .engine.generation import GenerationRun
    from .engine.measure import PeakReading

SESSION_KEY = pytest.StashKey["OptSession"]()
WARM_UP_ANNOUNCE_AFTER_S = 3.0  # a few seconds on an idle machine; minutes on a busy one
# a test that uses one of these has a record, and its model counts for freeing memory
OPT_FIXTURES = frozenset({"opt_bench", "opt_model", "opt_baseline_model"})
TORCH_FIXTURES = OPT_FIXTURES | {"opt_plan", "opt_hardware"}  # a test that asks for one of these imports torch


@dataclass
class TestRecord:
    """What the report shows for one test."""

    nodeid: str
    outcome: str = "error"  # until its call phase reports: a test cut off by an interrupt never "passed"
    skip_reason: str | None = None
    error: str | None = "did not finish (interrupted, or no call phase report)"
    plan: TestPlan | None = None
    results: list[Any] = field(default_factory=list)  # OptResult of each opt_bench call, in order
    compile_cache: str | None = None  # warm / cold / partial from torch's cache lookups during the test; None: no compile
    hardware: str | None = None  # HardwareInfo.fingerprint of the process that ran it; None: never probed
    attempts: int = 1  # pytest-rerunfailures: the attempt this record holds (each rerun replaces the one before)
    # --opt-compare-confirm: the same test measured once more after the others, when its first measurement
    # regressed against the window of recorded runs (None: not measured again)
    confirmation: "TestRecord | None" = None


def crash_message(report: Any) -> str:
    """The error of a test whose pytest-xdist worker died while running it (pytest says the same)."""
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None) or "?"
    return (f"worker {worker!r} crashed while running this test: the process died (killed, out of memory, "
            f"or it exited)")


class OptSession:
    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self._hardware: HardwareInfo | None = None
        self._registry: TechniqueRegistry | None = None
        self._models: ModelCache | None = None
        self.reference_runs: dict[tuple[Any, ...], tuple[GenerationRun, PeakReading]] = {}
        self.reference_run_count = 0
        # a baseline configuration's census per (model, generate arguments, workload): the same in every test
        self.baseline_censuses: dict[tuple[Any, ...], tuple[dict[str, Any] | None, str | None]] = {}
        self.saved_baselines: set[str] = set()  # keys written by --opt-update-baselines this session
        self.records: dict[str, TestRecord] = {}
        # report entries sent by xdist workers, by entry id: each test's latest, sent with every report
        self.worker_entries: dict[str, dict[str, Any]] = {}
        self._handed: dict[str, list[LoadedModel]] = {}  # test id -> cached models it was given
        self.is_xdist_worker = hasattr(config, "workerinput")
        self._configs: dict[tuple[tuple[Any, ...], str], Any] = {}  # (model identity, path) -> its config
        self._item_model: dict[str, tuple[Any, ...]] = {}
        self._remaining_uses: dict[tuple[Any, ...], int] = {}
        self.compile_cache: CompileCache | None = None  # --opt-compile-cache, installed with the hardware probe
        self._compile_counts: dict[str, tuple[int, int]] = {}  # test id -> cache (hits, misses) at its setup
        self._reference_worker: Any = None  # --opt-ab: engine.ab_client.ReferenceWorker, started on first use
        self._reference_unusable: str | None = None  # --opt-ab: why the reference cannot be used, once found
        # --opt-ab: (why, its stack) once a worker stopped answering and was killed: no other is started
        self.reference_gone: tuple[str, dict[str, Any]] | None = None
        self._ab_candidate: dict[str, Any] | None = None
        self.trace_folder: str | None = None  # --opt-trace: the census traces kept until the report is written

    # -- lazily built pieces ------------------------------------------------------------------------
    def census_trace_file(self, nodeid: str) -> str | None:
        """--opt-trace: a new file for ``nodeid``'s census trace in this session's trace folder (``report.traces``)."""
        from .report.traces import trace_file_for

        return trace_file_for(self, nodeid)

    @property
    def hardware(self) -> HardwareInfo:
        if self._hardware is None:
            from .engine.cpu_threads import apply_cpu_threads
            from .engine.hardware import probe_hardware
            from .engine.repeated_messages import new_session
            from .engine.heavy_imports import import_stack

            import_stack()  # whole, whatever signal arrives meanwhile (see its module)
            from .engine.measure import freeze_long_lived_objects

            freeze_long_lived_objects()  # before any model loads: each memory reading's collection stays quick
            self._hardware = probe_hardware(self.settings.device)
            apply_cpu_threads(self.settings.cpu_threads, self._hardware)  # before any model runs
            new_session()  # each message that repeats on every step: once in this session
            # the key names the device, and every compile needs the device first; --opt-techniques compiles nothing
            if self.settings.compile_cache and not self.settings.techniques:
                self.compile_cache = CompileCache(self.settings.compile_cache, cache_key(self._hardware),
                                                  os.environ.get("PYTEST_XDIST_WORKER", "main"))
                self.compile_cache.install()
        return self._hardware

    @property
    def device(self) -> str:
        return self.hardware.device

    @property
    def registry(self) -> TechniqueRegistry:
        """Built on first use, after every conftest had its chance to register techniques."""
        if self._registry is None:
            from .techniques import build_registry

            registry = build_registry()
            self.config.hook.pytest_opt_register_techniques(registry=registry)
            self._registry = registry
        return self._registry

    @property
    def models(self) -> ModelCache:
        if self._models is None:
            from .engine.loading import ModelCache

            self._models = ModelCache(self.device)
        return self._models

    def record(self, nodeid: str) -> TestRecord:
        record = self.records.setdefault(nodeid, TestRecord(nodeid))
        if record.hardware is None and self._hardware is not None:  # never probes: a report must not import torch
            record.hardware = self._hardware.fingerprint
        return record

    def model_config(self, request: ModelRequest, path: str) -> Any:
        """The model's config, read once per model and path for the session."""
        key = (request.identity(), path)
        if key not in self._configs:
            from .engine.loading import read_model_config

            self._configs[key] = read_model_config(request, path)
        return self._configs[key]

    # -- models -------------------------------------------------------------------------------------
    def opt_model(self, plan: TestPlan, side: Configuration) -> OptModel:
        from .engine.loading import load_model, tokenizer_only
        from .engine.measure import release_memory
        from .engine.model import OptModel
        from .techniques import GenerationSettings

        load_time = [t for t in side.techniques if t.load_time]
        key = (side.request.identity(), tuple(sorted(t.label() for t in load_time)), self.device)
        try:
            if any(t.runs_in_subprocesses for t in side.techniques):
                loaded = tokenizer_only(side.request, plan.model_path, key)
            else:
                loaded = self.models.get(key, lambda: load_model(side.request, plan.model_path, load_time,
                                                                 plan.probe_context, self.device, key))
                handed = self._handed.setdefault(plan.nodeid, [])
                if not any(h is loaded for h in handed):
                    handed.append(loaded)
        except (OptConfigError, OptProofError):
            raise
        except Exception as exc:  # broken is not unsupported: this test fails, the session runs on
            what = "out of memory" if "out of memory" in str(exc).lower() or isinstance(exc, MemoryError) else "failed"
            release_memory(self.device)
            raise OptLoadError(f"loading {side.request.name_or_path} with [{', '.join(side.labels)}] on {self.device} "
                               f"{what}: {type(exc).__name__}: {exc}") from exc
        generation = GenerationSettings()
        for technique in side.techniques:
            technique.configure_generation(generation, plan.probe_context)
        return OptModel(loaded=loaded, techniques=side.techniques, generation=generation, request=side.request,
                        device=self.device, probe_context=plan.probe_context)

    def technique_support(self, model: ModelRequest | None = None) -> list[tuple[str, str, str | None]]:
        """(name, summary, why not) for every technique, probed on this machine: with ``model``'s config, what a
        test of that model would be skipped for (its column of the support matrix); with no model, what does
        not depend on one."""
        return self.probe_catalogue(self.catalogue_context(model))

    def probe_catalogue(self, ctx: ProbeContext) -> list[tuple[str, str, str | None]]:
        """(name, summary, why not) for every technique of the registry, probed with ``ctx``."""
        from .techniques.base import checked_probe

        rows = []
        for technique_class in self.registry.classes():
            try:
                technique = technique_class(**technique_class.example_params)
                reason = checked_probe(technique, ctx)
            except OptConfigError as exc:
                reason = str(exc)
            rows.append((technique_class.name, technique_class.summary, reason))
        return rows

    def catalogue_context(self, model: ModelRequest | None) -> ProbeContext:
        """What ``--opt-techniques`` probes with: ``model``'s config as a test's plan reads it (a built-in model is
        unpacked or built first, as for a test: its saved config is what the probes see), or no model."""
        from .techniques import ProbeContext

        if model is None:
            return ProbeContext(hardware=self.hardware, model_config=None, dtype="float32")
        from .engine.loading import resolve_model_path
        from .engine.real_models import RealModelUnavailable
        from .plan import probe_context

        try:
            config = self.model_config(model, resolve_model_path(model))
        except RealModelUnavailable as exc:  # a test would skip; the listing cannot probe without the model
            raise OptConfigError(f"{model.origin}: {model.name_or_path!r} is not available here: {exc.reason}") from None
        return probe_context(self.hardware, model, config)

    def warm_up(self, session: pytest.Session) -> None:
        """Import torch and transformers before the first test when one will use the plugin's fixtures: out
        of every test's timer (pytest-timeout times setup too), announced when it takes long."""
        if session.config.option.collectonly or not any(TORCH_FIXTURES & set(getattr(item, "fixturenames", ()))
                                                        for item in session.items):
            return
        from .engine.heavy_imports import import_stack
        from .engine.progress import long_work

        if self.settings.ab and self._reference_worker is None and self._reference_unusable is None and \
                any("opt_bench" in getattr(item, "fixturenames", ()) for item in session.items):
            self.launch_reference_worker()  # it imports its stack while this process imports its own
        with long_work("importing torch and transformers", detail="once per session, before the first test",
                       after_s=WARM_UP_ANNOUNCE_AFTER_S):
            try:
                import_stack()
            except Exception:  # a broken install: the first test that needs it fails, saying why
                pass

    # -- confirming a regression ---------------------------------------------------------------------
    def confirm_regressions(self, session: pytest.Session) -> None:
        """--opt-compare-confirm (with a window of recorded runs and --opt-compare-fail): each test whose
        measurement regressed against the window runs once more, with fresh rounds, after every other test
        of this process; the gate fails it only when the second measurement regresses too (a dashboard's
        "two consecutive violations"). Nothing is measured again after -x, Ctrl-C or --collect-only."""
        from .report.confirm import confirmation_wanted
        from .report.window import regressed_entries

        if not confirmation_wanted(self.settings) or self._hardware is None or session.shouldstop \
                or session.shouldfail or session.config.option.collectonly:
            return  # (no hardware probed: no test measured anything)
        from .report.writer import entries_of

        environment = self._hardware.as_environment()
        # each test judged alone (a family of one): a superset of what the session end, adjusting over every
        # test of the run (all xdist workers'), calls regressed
        suspects = [item for item in session.items if item.nodeid in self.records
                    and regressed_entries(self.settings, environment, entries_of(self.records[item.nodeid]))]
        if not suspects:
            return
        from .compat import run_test_again
        from .engine.progress import long_work, say

        what = f"confirming {len(suspects)} regressed test{'s' if len(suspects) != 1 else ''} with fresh rounds"
        with long_work(what, detail="--opt-compare-confirm: a regression fails the gate only when measured twice"):
            for item in suspects:
                first = self.records.pop(item.nodeid)
                try:  # its models stay cached after this (its last use was counted): freed at the session's end
                    ran = run_test_again(item)
                finally:
                    first.confirmation = self.records.pop(item.nodeid, None)
                    self.records[item.nodeid] = first
                if not ran:
                    say(f"--opt-compare-confirm: this pytest ({package_version('pytest')}) cannot run a test again "
                        f"unreported; the first measurements decide")
                    return

    # -- model lifetimes --------------------------------------------------------------------------
    def count_model_uses(self, items: list[pytest.Item]) -> None:
        """How many collected tests use each model, so its memory goes with its last test."""
        from collections import Counter

        uses: Counter[tuple[Any, ...]] = Counter()
        for item in items:
            if not OPT_FIXTURES & set(getattr(item, "fixturenames", ())):
                continue
            try:
                marked = read_markers(item, self.settings.model, "default", self.settings.baseline)
            except OptConfigError:
                continue  # reported at that test's setup
            uses[marked.model.identity()] += 1
            self._item_model[item.nodeid] = marked.model.identity()
        self._remaining_uses = uses

    def finished_with(self, item: pytest.Item) -> None:
        """After a test's teardown: check that it left the shared models' weights as loaded, and free the
        models no remaining test of this process needs. A changed model fails this test's teardown (it
        is the one that changed it) and is dropped, so the next test loads it afresh."""
        self._compile_counts.pop(item.nodeid, None)  # a test without a call phase report
        changed = self._check_handed(item.nodeid)
        self._free_unused(item)
        if changed:
            pytest.fail("\n".join(changed), pytrace=False)

    def _check_handed(self, nodeid: str) -> list[str]:
        handed = self._handed.pop(nodeid, [])
        if not handed:
            return []
        from .engine.loading import OptModelChanged

        problems = []
        for loaded in handed:
            try:
                if self._models is not None:
                    self._models.check(loaded.key, nodeid)
            except OptModelChanged as exc:
                problems.append(str(exc))
                # a baseline reference run of the changed weights must not serve the next test either
                self.reference_runs = {k: v for k, v in self.reference_runs.items() if k[0] != loaded.key}
        return problems

    def _free_unused(self, item: pytest.Item) -> None:
        identity = self._item_model.pop(item.nodeid, None)
        if identity is None or self._models is None:
            return
        self._remaining_uses[identity] -= 1
        if self._remaining_uses[identity] <= 0:
            for key in self._models.keys():
                if key[0] == identity:
                    self._models.evict(key)
            self.reference_runs = {k: v for k, v in self.reference_runs.items() if k[0][0] != identity}

    # -- outcomes -----------------------------------------------------------------------------------
    def start_compile_count(self, nodeid: str) -> None:
        self._compile_counts[nodeid] = compile_cache_counts()

    def freeze_new_imports(self) -> None:
        """Before a test, once the stack is imported: what earlier tests imported leaves the collector's sight."""
        if self._hardware is not None:
            from .engine.measure import freeze_long_lived_objects

            freeze_long_lived_objects()

    def note_compile_cache(self, nodeid: str) -> None:
        """Whether the test's compilation hit torch's caches (its lookups since its setup began)."""
        hits_before, misses_before = self._compile_counts.pop(nodeid, (0, 0))
        hits, misses = compile_cache_counts()
        self.record(nodeid).compile_cache = compile_cache_state(hits - hits_before, misses - misses_before)

    def note_report(self, item: pytest.Item, report: pytest.TestReport) -> None:
        """Keep each test's outcome (and skip reason / error) for the report."""
        record = self.record(item.nodeid)
        if hasattr(report, "wasxfail") and (report.skipped or report.passed):
            # pytest's xfail / xpass (a strict xpass is a plain failure, without wasxfail); the reason is
            # the marker's, or "reason: ..." from pytest.xfail(...)
            record.outcome = "xfailed" if report.skipped else "xpassed"
            record.skip_reason = str(report.wasxfail).removeprefix("reason: ") or None
            crash = getattr(report.longrepr, "reprcrash", None)
            record.error = (crash.message[:ERROR_CHARS]
                            if report.skipped and crash is not None and getattr(crash, "message", None) else None)
        elif report.skipped:
            record.outcome = "skipped"
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
            record.skip_reason = str(reason).removeprefix("Skipped: ")
            record.error = None  # a skip is a finished outcome: not "did not finish"
        elif report.failed:
            record.outcome = "failed" if report.when == "call" else "error"
            crash = getattr(report.longrepr, "reprcrash", None)
            if crash is not None and getattr(crash, "message", None):
                record.error = crash.message[:ERROR_CHARS]
            else:
                text = report.longreprtext.strip().splitlines()
                record.error = "\n".join(text[-12:]) if text else None
        elif report.when == "call":
            record.outcome, record.error = "passed", None

    def note_rerun(self, nodeid: str, attempt: int) -> None:
        """pytest-rerunfailures will run this test again after its failed attempt number ``attempt`` (from
        0): the next attempt replaces this one in the report, as pytest counts one test (and its reruns),
        and the row keeps how many attempts it took. A second rerun report of the same attempt (a
        teardown that failed too) changes nothing."""
        from .verdict.results import CALL_SUFFIX

        record = self.records.get(nodeid)
        if record is not None and record.attempts <= attempt + 1:
            self.records[nodeid] = TestRecord(nodeid, attempts=attempt + 2, hardware=record.hardware)
        # the controller of an xdist run: the worker's entries for the attempt it will repeat
        self.worker_entries = {entry_id: entry for entry_id, entry in self.worker_entries.items()
                               if entry_id != nodeid and not entry_id.startswith(nodeid + CALL_SUFFIX)}

    # -- pytest-xdist controller ----------------------------------------------------------------------
    def note_worker_entries(self, entries: list[dict[str, Any]]) -> None:
        """Entries a worker sent for one test (with each of its reports, so a worker that dies later
        loses nothing it finished); a later report's entries replace an earlier one's."""
        for entry in entries:
            self.worker_entries[entry["nodeid"]] = entry

    def note_crash(self, nodeid: str, message: str) -> None:
        """A test whose worker died while running it: failed (as pytest counts it), with why."""
        from .verdict.results import CALL_SUFFIX

        mine = [entry for entry_id, entry in self.worker_entries.items()
                if entry_id == nodeid or entry_id.startswith(nodeid + CALL_SUFFIX)]
        for entry in mine:
            entry["outcome"], entry["error"] = "failed", message
        if not mine:  # it died before its setup reported: it may still have been loading a model
            self.records[nodeid] = TestRecord(nodeid, outcome="failed", error=message)

    # -- the reference environment (--opt-ab) ---------------------------------------------------------
    def reference_worker(self) -> Any:
        """The reference environment's worker (``engine.ab_client.ReferenceWorker``): launched before the first
        test (``launch_reference_worker``) or on first use, again after one died; waited for here until it is
        ready. A reference that cannot be used fails each A/B test with the same line (found once: a missing
        interpreter is not tried again for every test)."""
        from .engine.ab_client import ReferenceUnavailable
        from .engine.progress import long_work

        python = self.settings.ab
        assert python is not None
        if self._reference_unusable is not None:
            pytest.fail(self._reference_unusable, pytrace=False)
        if self._reference_worker is not None and self._reference_worker.ready and not self._reference_worker.alive():
            self.forget_reference_worker()
        if self._reference_worker is None:
            self.launch_reference_worker()
        worker = self._reference_worker
        if worker is None:  # the launch failed: said once, in every A/B test
            assert self._reference_unusable is not None
            pytest.fail(self._reference_unusable, pytrace=False)
        if not worker.ready:
            try:
                # after_s: a worker launched before the first test is usually ready by now, and says nothing
                with long_work(f"starting the reference environment {python} (--opt-ab)",
                               detail="once per session: it imports its torch and transformers",
                               after_s=WARM_UP_ANNOUNCE_AFTER_S):
                    worker.wait_ready()
            except ReferenceUnavailable as exc:
                self._reference_worker = None  # wait_ready closed it
                pytest.fail(self._reference_cannot_be_used(exc), pytrace=False)
        return worker

    def launch_reference_worker(self) -> None:
        """Start the reference worker's process without waiting for it: before the first test, its torch and
        transformers import while this process imports its own (2 cores: about one import's time saved per
        session). Call from the main thread (the worker dies with the thread that started it)."""
        from .engine.ab_client import ReferenceUnavailable, ReferenceWorker
        from .engine.cpu_threads import threads_for_this_process, usable_cores, xdist_workers

        assert self.settings.ab is not None
        # this process's CPU thread count, worked out as engine.cpu_threads sets it (torch need not be imported);
        # on CUDA both sides leave torch's own
        threads = threads_for_this_process(self.settings.cpu_threads, usable_cores(), xdist_workers())
        try:
            self._reference_worker = ReferenceWorker.launch(self.settings.ab, threads=threads)
        except ReferenceUnavailable as exc:
            self._reference_cannot_be_used(exc)

    def _reference_cannot_be_used(self, exc: Any) -> str:
        """Record (once per session) and return the line every A/B test fails with from now on."""
        self._reference_unusable = f"--opt-ab: the reference environment cannot be used: {exc.reason}"
        return self._reference_unusable

    def reference_stopped_answering(self, why: str, stack: dict[str, Any]) -> None:
        """A request got no answer within its limit and the worker was killed: later tests start no other (each
        would hang as long), and their A/B is not comparable, saying ``why``."""
        self.reference_gone = (why, stack)
        self.forget_reference_worker()

    @property
    def ab_candidate(self) -> dict[str, Any]:
        """This environment's stack, as the reference's is recorded (``report.ab.complete_ab``): its interpreter,
        its Python and every distribution it can import, so any package bump between the two shows."""
        if self._ab_candidate is None:
            from .engine.ab_worker import installed_distributions

            self._ab_candidate = {"python": sys.executable, "python_version": platform.python_version(),
                                  "versions": installed_distributions(), "complete": True}
        return self._ab_candidate

    def forget_reference_worker(self) -> None:
        """Stop (if still running) and drop the worker: the next A/B test starts a new one."""
        worker, self._reference_worker = self._reference_worker, None
        if worker is not None:
            worker.close()

    @staticmethod
    def ab_gate_so_far(threshold: Any, candidate: dict[str, Any], reference: dict[str, Any]
                       ) -> tuple[str, tuple[list[float], list[float]] | None]:
        """One ``--opt-ab-fail`` threshold's verdict on the rounds so far, by the gate's own rule (``report.ab``),
        and the (reference, candidate) rounds it judged as pairs; None where it did not judge pairs. The rounds
        loop (``verdict.ab_rounds``) asks it after each round: the rule lives with the report's verdicts."""
        from .verdict.ab import ab_sides
        from .verdict.compare import PAIRED_RULE, judge_threshold, round_samples

        verdict, _, record = judge_threshold(threshold, reference, candidate, ab_sides(paired=True))
        before, after = round_samples(reference, threshold.metric), round_samples(candidate, threshold.metric)
        if record is None or record.get("rule") != PAIRED_RULE or before is None or after is None:
            return verdict, None
        return verdict, (before, after)

    def conftests_registering_techniques(self) -> list[str]:
        """The files of this session's plugins (conftests) that register techniques: the reference worker
        imports them so a project's own techniques run there too."""
        files = []
        for plugin in self.config.pluginmanager.get_plugins():
            path = getattr(plugin, "__file__", None)
            if path and callable(getattr(plugin, "pytest_opt_register_techniques", None)):
                files.append(str(path))
        return sorted(files)

    def close(self) -> None:
        """Free every cached model at the end of the session."""
        self.forget_reference_worker()
        if self._models is not None:
            self._models.clear()
        self.reference_runs.clear()
        if self.compile_cache is not None:
            try:
                self.compile_cache.save()
            finally:
                self.compile_cache.uninstall()


def print_catalogue(config: pytest.Config, settings: Settings) -> int:
    """``--opt-techniques``: every technique, whether this machine can run it, and why not; for the model chosen
    by ``--opt-model`` (or its variable or ini key), whether this machine can run it on that model."""
    from .engine.loading import ModelRequest

    session = OptSession(config, settings)
    hw = session.hardware
    source = settings.sources.get("model", "default")
    model = None if source == "default" else ModelRequest(settings.model, origin=source)
    versions = f"(torch {hw.versions.get('torch')}, transformers {hw.versions.get('transformers')})"
    ctx = session.catalogue_context(model)
    rows = session.probe_catalogue(ctx)
    if model is None:
        print(f"technique catalogue on {hw.describe()} {versions}:")
    else:
        arch = getattr(ctx.model_config, "model_type", None) or "unknown architecture"
        print(f"technique catalogue for model {model.name_or_path} ({arch}, {ctx.dtype}; from {source}) on "
              f"{hw.describe()} {versions}:")
    for name, summary, reason in rows:
        status = "supported" if reason is None else f"unsupported: {reason}"
        print(f"  {name:<24} {summary}\n  {'':<24} -> {status}")
    return 0


def next_change_lines(report: dict[str, Any]) -> list[str]:
    """The advisor's "next change to try" for the report just built: the advisor reads the report, so it
    is handed to the writer from here rather than imported by it (imported on use: a session that builds no
    report never loads the advisor)."""
    from .advisor import advise_from_report
    from .engine.loading import import_quietly

    # the advisor reads a built-in model's config through transformers: under pytest-xdist that is the controller's
    # first import of it (its workers ran the tests), whose chain would warn from torch 14 times in the summary
    import_quietly()
    return advise_from_report(report).summary_lines()


class OptPlugin:
    """The runtime hooks, on one object that ``pytest_configure`` registers with the session it serves
    (as pytest-xdist registers its ``DSession``); each hands its work to the session or the report writer.

    Under pytest-xdist, workers send each test's report entries with its reports (``opt_entries``:
    pytest serialises a report's attributes), so the controller has every finished test even when a
    worker is killed; a test its worker died in is recorded as failed, as pytest counts it. Those hooks
    are optional: without xdist nothing calls them.
    """

    def __init__(self, session: OptSession) -> None:
        self.session = session

    def _writer(self) -> ReportWriter:
        from .report.writer import ReportWriter

        return ReportWriter(self.session, advice=next_change_lines)

    def pytest_report_header(self) -> list[str]:
        settings = self.session.settings
        # versions from package metadata and the requested device, not the hardware probe: that imports torch
        # (a second or more), which a session that uses none of the plugin should not pay; the report names
        # the device measured on
        device = f"{settings.device} (probed on first use)" if settings.device == "auto" else settings.device
        return [f"transformers-opt: device {device}, torch {package_version('torch')}, transformers "
                f"{package_version('transformers')}, default model {settings.model}, budgets {settings.budgets}",
                *(f"transformers-opt: note: {note}" for note in settings.notes)]

    @pytest.hookimpl(trylast=True)  # after -k, -m, --deselect and conftests: count only the tests that will run
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.session.count_model_uses(items)

    @pytest.hookimpl(wrapper=True)  # after collection, before the first test (and its timer) starts
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, Any, Any]:
        if not (session.testsfailed and not session.config.option.continue_on_collection_errors):
            self.session.warm_up(session)
        result = yield
        # after every test of this process (an xdist worker's: after its last), before the reports
        self.session.confirm_regressions(session)
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item) -> Generator[None, Any, Any]:
        report = yield
        session = self.session
        # a record exists once opt_plan ran, also for a test that asked for it through getfixturevalue
        if item.nodeid in session.records or OPT_FIXTURES & set(getattr(item, "fixturenames", ())):
            if report.when == "call":
                session.note_compile_cache(item.nodeid)
            session.note_report(item, report)
            if session.is_xdist_worker:  # travels to the controller with the report
                from .report.writer import entries_of

                report.opt_entries = entries_of(session.records[item.nodeid])
        return report

    @pytest.hookimpl(tryfirst=True)  # before the test's fixtures exist: they are not frozen
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.session.freeze_new_imports()
        self.session.start_compile_count(item.nodeid)

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        self.session.finished_with(item)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        self._writer().terminal(terminalreporter)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        try:
            if self.session.is_xdist_worker:
                from .report.writer import record_entries

                # workeroutput: set by xdist on a worker's config, sent to the controller when the worker ends
                session.config.workeroutput["opt_report_entries"] = record_entries(self.session)  # type: ignore[attr-defined]  # xdist's attribute
            # pytest returns session.exitstatus after this hook; the terminal summary (printed next) says why
            session.exitstatus = self._writer().finish(session.exitstatus)
        finally:
            self.session.close()

    # -- pytest-xdist ---------------------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entries = getattr(report, "opt_entries", None)
        if entries and not self.session.is_xdist_worker:
            self.session.note_worker_entries(entries)
        # pytest-rerunfailures: this attempt failed and the test runs again ("rerun" is outside pytest's typed outcomes)
        if str(report.outcome) == "rerun":
            self.session.note_rerun(report.nodeid, int(getattr(report, "rerun", 0) or 0))

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport) -> None:
        self.session.note_crash(crashitem, crash_message(report))

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any) -> None:
        # the same entries once more, at the end of a worker that finished normally
        self.session.note_worker_entries(getattr(node, "workeroutput", {}).get("opt_report_entries", []))
