"""The rounds ``opt_bench`` timed, in pytest-benchmark's output: two benchmarks per test.

Each test that measured becomes ``<test>[baseline]`` and ``<test>[optimized]`` in one group, with
one datum per measured round (whole ``generate`` call, synchronised, interleaved with the other
side) and the plugin's figures in ``extra_info``. So ``--benchmark-json``, ``--benchmark-save``,
``--benchmark-autosave`` and ``pytest-benchmark compare`` show them next to a project's own
benchmarks.

pytest-benchmark's documented surface is used: its hooks, its command-line options and its ``Stats``
class (the statistics are computed exactly as its own); its storage, which it does not document, is
built through ``compat.benchmark_storage`` alone. Two
paths, because pytest-benchmark saves nothing at all when no ``benchmark`` fixture ran, or when
pytest-xdist disabled it:

- it saves: our ``pytest_benchmark_update_json`` adds our entries to each document it writes;
- it does not: at session end we build the document through the same hooks and write the files
  it would have written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..compat import benchmark_storage
from ..files import check_writable, write_atomic

if TYPE_CHECKING:
    from ..session import OptSession

PLUGIN_NAME = "transformers-opt-benchmark-export"
SIDES = ("baseline", "optimized")
# figures of one side that travel in extra_info (the side's own measurement, not the pair's)
SIDE_FIGURES = ("ttft_s", "tpot_s", "throughput_tok_s", "peak_memory_bytes", "load_time_s", "compile_time_s",
                "tokens_generated", "recompiles", "memory_method")


def benchmark_available(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("benchmark")


def side_name(nodeid: str, side: str) -> str:
    """``test_x`` -> ``test_x[baseline]``; a parametrised ``test_x[a]`` -> ``test_x[a-baseline]``."""
    return f"{nodeid[:-1]}-{side}]" if nodeid.endswith("]") else f"{nodeid}[{side}]"


def benchmark_entries(tests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """pytest-benchmark entries (its JSON layout) for every report entry whose rounds were timed."""
    from pytest_benchmark.stats import Stats

    entries = []
    for test in tests:
        for side in SIDES:
            metrics = test.get(side) or {}
            samples = [s for s in metrics.get("latency_samples_s") or [] if s is not None and math.isfinite(s)]
            if not samples:
                continue
            stats = Stats()
            for sample in samples:
                stats.update(sample)
            stats_dict = stats.as_dict()
            stats_dict.update(data=samples, iterations=1)
            workload = test.get("workload") or {}
            techniques = test["techniques"] if side == "optimized" else test["baseline_techniques"]
            extra_info: dict[str, Any] = {
                "opt_side": side, "techniques": techniques, "outcome": test["outcome"], "model": test.get("model"),
                **{key: metrics.get(key) for key in SIDE_FIGURES},
                "speedup": test.get("speedup"), "memory_ratio": test.get("memory_ratio"),
                "failed_budgets": test.get("failed_budgets", []),
                "workload": {k: workload.get(k) for k in ("num_prompts", "max_new_tokens", "batch_size")},
                "notes": test.get("notes", []),
            }
            if side == "optimized":
                extra_info["similarity"] = test.get("similarity")
            full_name = side_name(test["nodeid"], side)
            entries.append({
                "group": f"transformers-opt: {test['nodeid']}",
                "name": full_name.rpartition("::")[2],
                "fullname": full_name,
                "params": {"opt_side": side},
                "param": side,
                "extra_info": extra_info,
                "options": {"timer": "perf_counter", "rounds": len(samples), "warmup": workload.get("warmup"),
                            "interleaved": True, "disable_gc": False},
                "stats": stats_dict,
            })
    return entries


class _StorageLog:
    """What pytest-benchmark's storage expects of a logger, printed on the terminal."""

    def __init__(self, config: pytest.Config) -> None:
        self.reporter = config.pluginmanager.get_plugin("terminalreporter")

    def info(self, text: str, **_: Any) -> None:
        if self.reporter is not None:
            self.reporter.write_line(f"transformers-opt: {text}")

    warning = debug = error = info


class BenchmarkExport:
    """Registered when pytest-benchmark is installed; see the module's docstring."""

    def __init__(self, session: "OptSession") -> None:
        self.session = session
        self.config = session.config
        self.added_to_its_output = False
        self._entries: list[dict[str, Any]] | None = None
        json_path = self.config.getoption("benchmark_json", None)
        if json_path is not None:
            check_writable(Path(json_path), "--benchmark-json")

    def entries(self) -> list[dict[str, Any]]:
        """Built once, at session end (every test, xdist workers' included, has reported by then)."""
        if self._entries is None:
            from .writer import all_entries  # on use: the plugin's start-up loads no report stage

            self._entries = benchmark_entries(all_entries(self.session))
        return self._entries

    @pytest.hookimpl(optionalhook=True)
    def pytest_benchmark_update_json(self, config: pytest.Config, benchmarks: Any, output_json: dict[str, Any]) -> None:
        if self.session.is_xdist_worker:
            return
        output_json.setdefault("benchmarks", []).extend(self.entries())
        self.added_to_its_output = True

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Runs after pytest-benchmark saved (its hook wrapper saves before any plain implementation). Data
        that cannot be written is one line in the terminal summary and fails the run, like any requested
        report (``report.REPORT_NOT_WRITTEN_STATUS``); the other reports stand."""
        try:
            self._write_where_it_wrote_none()
        except Exception as exc:
            from .writer import REPORT_NOT_WRITTEN_STATUS, describe_error, note_problem

            note_problem(self.config, f"could not write the pytest-benchmark data: {describe_error(exc)}", True)
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = REPORT_NOT_WRITTEN_STATUS

    def _write_where_it_wrote_none(self) -> None:
        config = self.config
        json_path = config.getoption("benchmark_json", None)
        save_name = config.getoption("benchmark_save", None) or config.getoption("benchmark_autosave", None)
        explicitly_disabled = config.getoption("benchmark_disable", False) and not config.getoption("benchmark_enable", False)
        if (self.added_to_its_output or self.session.is_xdist_worker or explicitly_disabled
                or not (json_path or save_name)):
            return
        if not self.entries():
            return
        hook = config.hook
        machine_info = hook.pytest_benchmark_generate_machine_info(config=config)
        hook.pytest_benchmark_update_machine_info(config=config, machine_info=machine_info)
        commit_info = hook.pytest_benchmark_generate_commit_info(config=config)
        hook.pytest_benchmark_update_commit_info(config=config, commit_info=commit_info)
        output_json = hook.pytest_benchmark_generate_json(config=config, benchmarks=[], include_data=True,
                                                          machine_info=machine_info, commit_info=commit_info)
        # our own hook implementation adds the entries; a project's implementations run too
        hook.pytest_benchmark_update_json(config=config, benchmarks=[], output_json=output_json)
        log = _StorageLog(config)
        if json_path:
            write_atomic(Path(json_path), json.dumps(output_json, indent=4, default=str) + "\n")
            log.info(f"Wrote benchmark data in: {json_path}")
        if save_name:
            storage = benchmark_storage(config.getoption("benchmark_storage"), log, config.getoption("benchmark_netrc"))
            storage.save(output_json, save_name)
