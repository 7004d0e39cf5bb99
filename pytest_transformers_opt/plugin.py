"""pytest hooks of pytest-transformers-opt.

Only what pytest needs before configure is module-level: hook specs, options, ``--opt-techniques``,
and ``pytest_configure``, which builds the session and registers the one ``OptPlugin`` whose methods
are the runtime hooks (reports, crashes, summary, session end, xdist merging).
"""

from __future__ import annotations

import pytest

from . import hookspecs
from .engine import progress
# its log filters are installed on import: before a conftest can import bitsandbytes, which logs as it loads
from .engine import quiet_logs  # noqa: F401
from .report.benchmark_export import PLUGIN_NAME as BENCHMARK_EXPORT, BenchmarkExport, benchmark_available
from .errors import OptConfigError
from .fixtures import opt_baseline_model, opt_bench, opt_hardware, opt_model, opt_plan  # noqa: F401 (fixtures)
from .engine.gpu_pinning import PLUGIN_NAME as GPU_PINNING, GpuPinningPlugin
from .markers import MARKERS, marker_help
from .options import add_options, resolve_settings
from .session import SESSION_KEY, OptPlugin, OptSession, print_catalogue

PLUGIN_NAME = "transformers-opt-session"


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)
    # registered this early so that it pins xdist workers before anything initialises CUDA
    pluginmanager.register(GpuPinningPlugin(), GPU_PINNING)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    if config.getoption("opt_techniques"):
        # this session's own progress sink (silent: its terminal is not configured yet), so the catalogue's probe
        # never writes through an enclosing session's (pytester) and switches that one's capture
        progress.install(config)
        try:
            return print_catalogue(config, resolve_settings(config))
        except OptConfigError as exc:
            raise pytest.UsageError(str(exc)) from None
        finally:
            progress.uninstall(config)
    return None


def pytest_configure(config: pytest.Config) -> None:
    for name in MARKERS:
        config.addinivalue_line("markers", marker_help(name))
    session = config.stash[SESSION_KEY] = OptSession(config, resolve_settings(config))
    config.pluginmanager.register(OptPlugin(session), PLUGIN_NAME)
    if benchmark_available(config):
        config.pluginmanager.register(BenchmarkExport(session), BENCHMARK_EXPORT)
    progress.install(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    progress.uninstall(config)
