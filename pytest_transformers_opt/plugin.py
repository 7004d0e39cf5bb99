"""pytest hooks of pytest-transformers-opt; each delegates to the session, the options or the report."""

from __future__ import annotations

from typing import Any, Generator

import pytest

from . import hookspecs
from .engine import progress
from .report.benchmark_export import PLUGIN_NAME as BENCHMARK_EXPORT, BenchmarkExport, benchmark_available
from .errors import OptConfigError
from .fixtures import opt_baseline_model, opt_bench, opt_hardware, opt_model, opt_plan  # noqa: F401 (fixtures)
from .engine.gpu_pinning import PLUGIN_NAME as GPU_PINNING, GpuPinningPlugin
from .markers import MARKERS, marker_help
from .options import add_options, resolve_settings
from .report.writer import ReportWriter, entries_of, record_entries
from .session import SESSION_KEY, OptSession, crash_message, print_catalogue

OPT_FIXTURES = {"opt_bench", "opt_model", "opt_baseline_model"}


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)
    # registered this early so that it pins xdist workers before anything initialises CUDA
    pluginmanager.register(GpuPinningPlugin(), GPU_PINNING)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    if config.getoption("opt_techniques"):
        try:
            return print_catalogue(config, resolve_settings(config))
        except OptConfigError as exc:
            raise pytest.UsageError(str(exc)) from None
    return None


def pytest_configure(config: pytest.Config) -> None:
    for name in MARKERS:
        config.addinivalue_line("markers", marker_help(name))
    session = config.stash[SESSION_KEY] = OptSession(config, resolve_settings(config))
    if benchmark_available(config):
        config.pluginmanager.register(BenchmarkExport(session), BENCHMARK_EXPORT)
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistHooks(session), "transformers-opt-xdist")
    progress.install(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    progress.uninstall(config)


class XdistHooks:
    """Under pytest-xdist, workers send each test's report entries with its reports (``opt_entries``:
    pytest serialises a report's attributes), so the controller has every finished test even when a
    worker is killed; a test its worker died in is recorded as failed, as pytest counts it."""

    def __init__(self, session: OptSession) -> None:
        self.session = session

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entries = getattr(report, "opt_entries", None)
        if entries and not self.session.is_xdist_worker:
            self.session.note_worker_entries(entries)

    @pytest.hookimpl
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport, sched: Any) -> None:
        self.session.note_crash(crashitem, crash_message(report))

    @pytest.hookimpl
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        # the same entries once more, at the end of a worker that finished normally
        self.session.note_worker_entries(getattr(node, "workeroutput", {}).get("opt_report_entries", []))


def pytest_report_header(config: pytest.Config) -> str | None:
    session = config.stash.get(SESSION_KEY, None)
    if session is None:
        return None
    hw = session.hardware
    return (f"transformers-opt: device {hw.describe()}, torch {hw.versions.get('torch')}, transformers "
            f"{hw.versions.get('transformers')}, default model {session.settings.model}, budgets {session.settings.budgets}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, Any]:
    report = yield
    session = item.config.stash.get(SESSION_KEY, None)
    # a record exists once opt_plan ran, also for a test that asked for it through getfixturevalue
    if session is not None and (item.nodeid in session.records
                                or OPT_FIXTURES & set(getattr(item, "fixturenames", ()))):
        session.note_report(item, report)
        if session.is_xdist_worker:  # travels to the controller with the report
            report.opt_entries = entries_of(session.records[item.nodeid])  # type: ignore[attr-defined]
    return report


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    opt_session = config.stash.get(SESSION_KEY, None)
    if opt_session is not None:
        opt_session.count_model_uses(items)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    session = item.config.stash.get(SESSION_KEY, None)
    if session is not None:
        session.finished_with(item)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = config.stash.get(SESSION_KEY, None)
    if session is not None:
        ReportWriter(session).terminal(terminalreporter)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    opt_session = session.config.stash.get(SESSION_KEY, None)
    if opt_session is not None:
        try:
            if opt_session.is_xdist_worker:
                session.config.workeroutput["opt_report_entries"] = record_entries(opt_session)  # type: ignore[attr-defined]
            # pytest returns session.exitstatus after this hook; the terminal summary (printed next) says why
            session.exitstatus = ReportWriter(opt_session).finish(session.exitstatus)
        finally:
            opt_session.close()
