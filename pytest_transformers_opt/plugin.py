"""pytest hooks of pytest-transformers-opt; each delegates to the session, the options or the report."""

from __future__ import annotations

from typing import Any, Generator

import pytest

from . import hookspecs
from .benchmark_export import PLUGIN_NAME as BENCHMARK_EXPORT, BenchmarkExport, benchmark_available
from .errors import OptConfigError
from .fixtures import opt_baseline_model, opt_bench, opt_hardware, opt_model, opt_plan  # noqa: F401 (fixtures)
from .gpu_pinning import PLUGIN_NAME as GPU_PINNING, GpuPinningPlugin
from .markers import MARKERS, marker_help
from .options import add_options, resolve_settings
from .report import ReportWriter, print_catalogue, record_entries
from .session import SESSION_KEY, OptSession

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
        config.pluginmanager.register(XdistHooks(), "transformers-opt-xdist")


class XdistHooks:
    """Under pytest-xdist, workers send their report entries to the controller, which merges them."""

    @pytest.hookimpl
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        session = node.config.stash.get(SESSION_KEY, None)
        entries = getattr(node, "workeroutput", {}).get("opt_report_entries", [])
        if session is not None:
            session.worker_entries.extend(entries)


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
    if session is not None and OPT_FIXTURES & set(getattr(item, "fixturenames", ())):
        session.note_report(item, report)
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
        if opt_session.is_xdist_worker:
            session.config.workeroutput["opt_report_entries"] = record_entries(opt_session)  # type: ignore[attr-defined]
        session.exitstatus = ReportWriter(opt_session).finish(session.exitstatus)
        opt_session.close()
