"""The view every renderer builds from: the terminal table, the Markdown report and the HTML page.

A report (the JSON document ``writer.build_report`` makes) becomes rows of plain text here: which tests,
in which order (failed budgets first), which columns, and each figure in the words and units of its
kind. The renderers only lay those cells out and escape them, so the three cannot disagree on a
figure. ``table_row`` holds the cells of the Markdown and HTML results tables; ``terminal_row`` the
same columns compact for a fixed-width terminal (the test's name without its file, units in the
header); ``table_rows`` orders the tests for both. ``hardware_matrices`` holds the cells of the Markdown
and HTML "Hardware matrix" (one table per test, a column per hardware fingerprint).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..units import failure_reason, format_bytes, format_duration, format_ratio, shorten
from ..verdict.ab import BLOCKS, FIGURES, IDENTICAL_STACKS, differing_versions, stack_note, stack_versions, version_text
from ..verdict.judge import INCONCLUSIVE, NOT_COMPARABLE, NOT_JUDGED, OK, REGRESSED
from ..verdict.results import NO_DIFFERENCE
from .ab import ab_rows, inconclusive_metrics, interval_text
from .compare import cause_text
from ..verdict.compare import METRICS, row_hardware

MISSING = "-"

# (key, header) of the results table; "regression" is added only when a test has a verdict.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("test", "Test"),
    ("techniques", "Techniques"),
    ("outcome", "Outcome"),
    ("ttft", "TTFT opt / base"),
    ("tpot", "TPOT opt / base"),
    ("throughput", "Tokens/s opt / base"),
    ("speedup", "Speedup"),
    ("memory", "Peak memory opt / base"),
    ("memory_ratio", "Memory ratio"),
    ("token_match", "Token match"),
    ("kl_mean", "KL mean"),
    ("top1", "Top-1"),
    ("failed_budgets", "Failed budgets"),
)
REGRESSION_COLUMN = ("regression", "Regression")
HARDWARE_COLUMN = ("hardware", "Hardware")  # after "test", only when the rows ran on more than one hardware

# Environment rows: (key, label); keys not listed here follow under their own name.
ENVIRONMENT_FIELDS: tuple[tuple[str, str], ...] = (
    ("device", "Device"),
    ("gpu_name", "GPU"),
    ("compute_capability", "Compute capability"),
    ("gpu_memory_bytes", "GPU memory"),
    ("device_count", "Device count"),
    ("bf16_supported", "bf16 supported"),
    ("tf32", "TF32"),
    ("gpu_clocks_mhz", "GPU clocks (MHz)"),
    ("gpu_memory_bandwidth_bytes_s", "GPU memory bandwidth (peak, NVML)"),
    ("cuda", "CUDA"),
    ("driver", "Driver"),
    ("python", "Python"),
    ("platform", "Platform"),
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("accelerate", "accelerate"),
    ("bitsandbytes", "bitsandbytes"),
    ("kernels", "kernels"),
)
SETTINGS_FIELDS: tuple[tuple[str, str], ...] = (
    ("budgets_mode", "Budgets mode"),
    ("rounds", "Measured rounds"),
    ("max_rounds", "Sequential rounds cap"),
    ("warmup", "Warm-up rounds"),
    ("device", "Device option"),
    ("default_model", "Default model"),
)

_DURATION_BUDGETS = {"max_ttft", "max_tpot", "max_latency"}
_TIMES_BUDGETS = {"min_speedup", "max_memory_ratio"}
_FRACTION_BUDGETS = {"min_token_match", "min_top1", "min_acceptance_rate"}


# --------------------------------------------------------------------------- formatting


def _number(value: Any) -> float | None:
    """``value`` as a float, or None when it is missing or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _non_finite(value: float) -> str | None:
    """``NaN`` / ``inf`` shown as such: a NaN never passes, so it must not look like a gap."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return None


def format_seconds(value: Any) -> str:
    number = _number(value)
    if number is None:
        return MISSING
    return _non_finite(number) or format_duration(number)


def format_memory(value: Any) -> str:
    number = _number(value)
    if number is None:
        return MISSING
    return _non_finite(number) or format_bytes(number)


def format_rate(value: Any) -> str:
    """Bytes per second: ``1.83 GiB/s``."""
    text = format_memory(value)
    return text if text == MISSING else f"{text}/s"


def format_percent(value: Any) -> str:
    """A fraction in 0..1 as ``97.5%``."""
    number = _number(value)
    if number is None:
        return MISSING
    return _non_finite(number) or f"{number * 100:.1f}%"


def format_kl(value: Any) -> str:
    """A KL divergence, three significant digits (``0.0123``, ``4.2e-06``)."""
    number = _number(value)
    if number is None:
        return MISSING
    if number == 0:
        return "0"
    return _non_finite(number) or f"{number:.3g}"


def format_throughput(value: Any) -> str:
    number = _number(value)
    if number is None:
        return MISSING
    return _non_finite(number) or f"{number:.1f}"


def format_plain(value: Any) -> str:
    number = _number(value)
    if number is None:
        return MISSING if value is None else str(value)
    if number.is_integer() and abs(number) < 1e15:
        return str(int(number))
    return _non_finite(number) or f"{number:.4g}"


def format_budget_value(name: str, value: Any) -> str:
    """A budget's limit or measured figure in the unit of that budget."""
    if name == "max_memory":
        return format_memory(value)
    if name in _DURATION_BUDGETS:
        return format_seconds(value)
    if name == "min_throughput":
        text = format_throughput(value)
        return text if text == MISSING else f"{text} tok/s"
    if name in _TIMES_BUDGETS:
        return format_ratio(value)
    if name in _FRACTION_BUDGETS:
        return format_percent(value)
    if name.endswith("_kl") or name.startswith("kl"):
        return format_kl(value)
    return format_plain(value)


def format_estimate(name: str, value: Any) -> str:
    """An estimated figure, formatted from its name (``*_bytes_s``, ``*bytes*``, ``*_tok_s``, ``*_s``,
    ``*fraction*``, ``*ratio*``)."""
    if name.endswith("_bytes_s"):
        return format_rate(value)
    if "fraction" in name:
        return format_percent(value)
    if "bytes" in name:
        return format_memory(value)
    if name.endswith("_tok_s"):
        text = format_throughput(value)
        return text if text == MISSING else f"{text} tok/s"
    if name.endswith("_s"):
        return format_seconds(value)
    if "ratio" in name or "speedup" in name:
        return format_ratio(value)
    return format_plain(value)


def interval_bounds(value: Any) -> tuple[float, float] | None:
    """A report's ``[low, high]`` interval as two finite numbers, or None (missing or malformed)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    low, high = _number(value[0]), _number(value[1])
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return None
    return low, high


def format_ratio_interval(value: Any) -> str:
    """A ratio's 95% interval as the reports show it after the ratio: ``[1.05-1.19]``; ``""`` when there is none."""
    bounds = interval_bounds(value)
    return "" if bounds is None else f"[{bounds[0]:.2f}-{bounds[1]:.2f}]"


# The terminal's narrow column says "no significant difference" as this (its footer explains it).
SHORT_NO_DIFFERENCE = "n.s."


def format_ratio_verdict(test: Mapping[str, Any], key: str, *, short: bool = False) -> str:
    """A ratio with its 95% interval and verdict word where the report has them: ``1.12x [1.05-1.19] faster``,
    ``0.62x smaller`` (no interval), ``1.41x`` (an older report). ``key``: ``speedup`` or ``memory_ratio``;
    ``short``: the terminal's form of "no significant difference"."""
    text = format_ratio(test.get(key))
    if text == MISSING:
        return text
    interval = format_ratio_interval(test.get(f"{key}_interval"))
    if interval:
        text += " " + interval
    verdict = test.get(f"{key}_verdict")
    if isinstance(verdict, str) and verdict:
        text += " " + (SHORT_NO_DIFFERENCE if short and verdict == NO_DIFFERENCE else one_line(verdict))
    return text


def format_pair(optimized: str, baseline: str) -> str:
    if optimized == MISSING and baseline == MISSING:
        return MISSING
    return f"{optimized} / {baseline}"


def format_created(value: Any) -> str:
    if not isinstance(value, str):
        return MISSING
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return value
    offset = moment.utcoffset()
    if offset is not None and offset.total_seconds() == 0:
        return moment.strftime("%Y-%m-%d %H:%M UTC")
    return moment.isoformat(sep=" ", timespec="minutes")


def one_line(text: str) -> str:
    return " ".join(str(text).split())


# --------------------------------------------------------------------------- report model


def _part(report: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A top-level object of the report (``environment``, ``settings``), or an empty dict."""
    value = report.get(key)
    return value if isinstance(value, dict) else {}


def _tests(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    tests = report.get("tests") or []
    return [test for test in tests if isinstance(test, dict)]


def side_figure(test: Mapping[str, Any], which: str, key: str) -> Any:
    metrics = test.get(which)
    return metrics.get(key) if isinstance(metrics, dict) else None


def similarity_figure(test: Mapping[str, Any], key: str) -> Any:
    similarity = test.get("similarity")
    return similarity.get(key) if isinstance(similarity, dict) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def agreement_counts(test: Mapping[str, Any], key: str) -> str:
    """What an agreement figure was counted over, for its cell: top-1 ``1/16 flips, 1 near-tie`` (flips in the
    compared steps), token match ``1/3 diverged, 1 near-tie`` (prompts whose tokens diverged); ``near-tie``
    alone for a report from before they were counted, empty when there is nothing to say."""
    if key == "top1":
        flips, steps = _count(similarity_figure(test, "top1_flips")), _count(similarity_figure(test, "compared_steps"))
        if flips is None or not steps:
            return ""
        ties = _count(similarity_figure(test, "near_tie_flips")) or 0
        return f"{flips}/{steps} flips" + (f", {ties} near-tie" if ties else "")
    divergences = _count(similarity_figure(test, "divergences"))
    if divergences is None:  # an earlier report: only the flag
        return "near-tie" if similarity_figure(test, "near_tie") else ""
    workload = test.get("workload")
    prompts = _count(workload.get("num_prompts")) if isinstance(workload, dict) else None
    ties = _count(similarity_figure(test, "near_tie_divergences")) or 0
    if not divergences:
        return ""
    return (f"{divergences}/{prompts} diverged" if prompts else f"{divergences} diverged") + \
        (f", {ties} near-tie" if ties else "")


def _with_counts(figure: str, test: Mapping[str, Any], key: str) -> str:
    counts = agreement_counts(test, key)
    return f"{figure} ({counts})" if counts and figure != MISSING else figure


def failed_budget_names(test: Mapping[str, Any]) -> list[str]:
    """Names of the budgets that failed: ``failed_budgets`` plus any budget whose ``ok`` is False."""
    names = [str(name) for name in test.get("failed_budgets") or []]
    for budget in test.get("budgets") or []:
        if isinstance(budget, dict) and budget.get("ok") is False and str(budget.get("name")) not in names:
            names.append(str(budget.get("name")))
    return names


def sort_tests(tests: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tests with failed budgets first, then other failures and errors, then the rest; stable."""

    def rank(test: dict[str, Any]) -> int:
        if failed_budget_names(test):
            return 0
        if test.get("outcome") in ("failed", "error"):
            return 1
        return 2

    return sorted(tests, key=rank)


def outcome_text(test: Mapping[str, Any]) -> str:
    outcome = str(test.get("outcome") or "unknown")
    if outcome in ("skipped", "xfailed", "xpassed"):  # skip_reason holds the xfail reason for the latter
        reason = test.get("skip_reason")
        return f"{outcome}: {one_line(reason)}" if reason else outcome
    if test.get("error") and (outcome == "error" or outcome == "failed" and not failed_budget_names(test)):
        return f"{outcome}: {failure_reason(test.get('error'))}"  # a budget failure has its own column
    return outcome


def techniques_text(test: Mapping[str, Any]) -> str:
    techniques = " + ".join(str(name) for name in test.get("techniques") or []) or MISSING
    baseline = " + ".join(str(name) for name in test.get("baseline_techniques") or [])
    return f"{techniques} vs {baseline}" if baseline else techniques


def regression_text(test: Mapping[str, Any], *, with_cause: bool = True) -> str:
    """A row's compare verdict and its details; ``with_cause``: and the census's cause of a timed verdict, last
    (``regression_cause``; the HTML page sets it apart)."""
    regression = test.get("regression")
    if not isinstance(regression, dict) or not regression.get("verdict"):
        return MISSING
    details = "; ".join(one_line(detail) for detail in regression.get("details") or [])
    verdict = str(regression["verdict"])
    text = f"{verdict}: {details}" if details else verdict
    cause = regression_cause(test) if with_cause else None
    return f"{text}; cause: {cause}" if cause else text


def regression_cause(test: Mapping[str, Any]) -> str | None:
    """What the census says of the row's regressed or inconclusive timed verdict (``regression.cause``)."""
    cause = cause_text(test.get("regression"))
    return one_line(cause) if cause else None


def has_regressions(report: Mapping[str, Any]) -> bool:
    return any(isinstance(test.get("regression"), dict) for test in _tests(report))


def columns(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The results table's (key, header) pairs for this report."""
    cols = list(COLUMNS)
    if len(report_hardware(report)) > 1:  # a merged report: the same test id once per hardware
        cols.insert(1, HARDWARE_COLUMN)
    if has_regressions(report):
        cols.append(REGRESSION_COLUMN)
    return cols


def table_row(test: Mapping[str, Any]) -> dict[str, str]:
    """One test's cells as plain text (not escaped), keyed as in :data:`COLUMNS`."""

    def pair(key: str, fmt: Any) -> str:
        return format_pair(fmt(side_figure(test, "optimized", key)), fmt(side_figure(test, "baseline", key)))

    return {
        "test": str(test.get("nodeid") or MISSING),
        "hardware": one_line(str(test.get("hardware") or MISSING)),
        "techniques": techniques_text(test),
        "outcome": outcome_text(test),
        "ttft": pair("ttft_s", format_seconds),
        "tpot": pair("tpot_s", format_seconds),
        "throughput": pair("throughput_tok_s", format_throughput),
        "speedup": format_ratio_verdict(test, "speedup"),
        "memory": pair("peak_memory_bytes", format_memory),
        "memory_ratio": format_ratio_verdict(test, "memory_ratio"),
        "token_match": _with_counts(format_percent(similarity_figure(test, "token_match")), test, "token_match"),
        "kl_mean": format_kl(similarity_figure(test, "kl_mean")),
        "top1": _with_counts(format_percent(similarity_figure(test, "top1")), test, "top1"),
        "failed_budgets": ", ".join(failed_budget_names(test)) or MISSING,
        "regression": regression_text(test),
    }


def table_rows(report: Mapping[str, Any], cells: Callable[[Mapping[str, Any]], dict[str, str]] = table_row,
               ) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """(test record, its cells) for every test, in report order (failed budgets first); ``cells`` is
    ``table_row`` (Markdown, HTML) or ``terminal_row``."""
    return [(test, cells(test)) for test in sort_tests(_tests(report))]


# --------------------------------------------------------------------------- hardware matrix

UNKNOWN_HARDWARE = "unknown hardware"
NOT_RUN_HERE = "not run on this hardware"
MATRIX_REASON_CHARS = 100  # a matrix cell's skip or failure reason: the results table has the full line
# (key of table_row, label) of the matrix's figure rows, then its outcome row.
MATRIX_FIGURES: tuple[tuple[str, str], ...] = (
    ("speedup", "Speedup"), ("memory_ratio", "Peak memory ratio"), ("kl_mean", "KL mean"))
MATRIX_OUTCOME_LABEL = "Outcome"
MATRIX_INTRO = ("One table per test, a column per hardware its rows ran on: the speedup and the peak memory "
                "ratio (with their 95% interval and verdict where measured), the KL mean and the outcome.")


@dataclass(frozen=True)
class HardwareMatrix:
    """One test's figures side by side on every hardware of the report, as plain text (not escaped)."""

    test: str  # the row's nodeid, with its ``[opt_bench call N]`` suffix when it has one
    hardware: tuple[str, ...]  # the columns: every fingerprint of the report, sorted
    rows: tuple[tuple[str, tuple[str, ...]], ...]  # (label, one cell per column)

    @property
    def headers(self) -> list[str]:
        return ["Figure", *self.hardware]

    @property
    def cells(self) -> list[list[str]]:
        return [[label, *cells] for label, cells in self.rows]


def hardware_of(test: dict[str, Any], report: Mapping[str, Any]) -> str:
    """The fingerprint a test row ran on, as ``--opt-compare`` reads it (a row that never probed counts as
    the run's own, ``environment.hardware``), else :data:`UNKNOWN_HARDWARE`."""
    return one_line(row_hardware(test, _part(report, "environment")) or "") or UNKNOWN_HARDWARE


def report_hardware(report: Mapping[str, Any]) -> list[str]:
    """The distinct hardware fingerprints of the report's test rows, sorted (the matrix's columns)."""
    return sorted({hardware_of(test, report) for test in _tests(report)})


def matrix_outcome_text(test: Mapping[str, Any]) -> str:
    """The outcome in a matrix cell: ``outcome_text`` with its reason clipped, and the failed budgets named."""
    text = outcome_text(test)
    budgets = failed_budget_names(test)
    if budgets and text == "failed":
        text = f"failed budgets: {', '.join(budgets)}"
    return shorten(text, MATRIX_REASON_CHARS)  # keeps the part that names the offending value


def hardware_matrices(report: Mapping[str, Any]) -> list[HardwareMatrix]:
    """One :class:`HardwareMatrix` per test (``table_rows`` order) when the report's rows ran on two or
    more hardware fingerprints; none otherwise (a single machine's report has no matrix).

    A test with no row for a hardware shows :data:`MISSING` figures and :data:`NOT_RUN_HERE` as its
    outcome; a skipped one shows its reason in the outcome row. Two rows of one test on one hardware
    (a merge refuses them) show the first.
    """
    hardware = report_hardware(report)
    if len(hardware) < 2:
        return []
    by_test: dict[str, dict[str, dict[str, Any]]] = {}
    for test in sort_tests(_tests(report)):
        by_test.setdefault(str(test.get("nodeid") or MISSING), {}).setdefault(hardware_of(test, report), test)
    matrices = []
    for nodeid, runs in by_test.items():
        cells = {name: table_row(test) for name, test in runs.items()}
        rows = [(label, tuple(cells[name][key] if name in cells else MISSING for name in hardware))
                for key, label in MATRIX_FIGURES]
        rows.append((MATRIX_OUTCOME_LABEL, tuple(matrix_outcome_text(runs[name]) if name in runs else NOT_RUN_HERE
                                                  for name in hardware)))
        matrices.append(HardwareMatrix(nodeid, tuple(hardware), tuple(rows)))
    return matrices


# The terminal table's header of each column of COLUMNS: short, with the unit where the cells leave it out.
TERMINAL_HEADERS: dict[str, str] = {
    "test": "test", "techniques": "techniques", "outcome": "outcome", "ttft": "TTFT ms opt/base",
    "tpot": "TPOT ms opt/base", "throughput": "tok/s opt/base", "speedup": "speedup", "memory": "peak mem opt/base",
    "memory_ratio": "mem ratio", "token_match": "token match", "kl_mean": "KL mean", "top1": "top-1",
    "failed_budgets": "failed budgets",
}


def _compact(value: Any, pattern: str) -> str:
    number = _number(value)
    return MISSING if number is None else _non_finite(number) or pattern.format(number)


def terminal_row(test: Mapping[str, Any]) -> dict[str, str]:
    """One test's cells for the fixed-width terminal table, keyed as in :data:`COLUMNS`: the figures of
    ``table_row``, compact (the test's name without its file, times in ms and fractions as 0..1, with
    the unit in :data:`TERMINAL_HEADERS`), and the outcome alone (its reason follows the table)."""

    def pair(key: str, fmt: Callable[[Any], str]) -> str:
        return f"{fmt(side_figure(test, 'optimized', key))} / {fmt(side_figure(test, 'baseline', key))}"

    def ms(value: Any) -> str:
        number = _number(value)
        return _compact(None if number is None else number * 1e3, "{:.1f}")

    return {
        "test": str(test.get("nodeid") or MISSING).split("::")[-1],
        "techniques": ", ".join(str(name) for name in test.get("techniques") or []) or MISSING,
        "outcome": str(test.get("outcome") or "unknown"),
        "ttft": pair("ttft_s", ms),
        "tpot": pair("tpot_s", ms),
        "throughput": pair("throughput_tok_s", lambda value: _compact(value, "{:.0f}")),
        "speedup": format_ratio_verdict(test, "speedup", short=True),
        "memory": pair("peak_memory_bytes", format_memory),
        "memory_ratio": format_ratio_verdict(test, "memory_ratio", short=True),
        "token_match": _with_counts(_compact(similarity_figure(test, "token_match"), "{:.2f}"), test, "token_match"),
        "kl_mean": _compact(similarity_figure(test, "kl_mean"), "{:.2e}"),
        "top1": _with_counts(_compact(similarity_figure(test, "top1"), "{:.2f}"), test, "top1"),
        "failed_budgets": ", ".join(str(name) for name in test.get("failed_budgets") or []) or MISSING,
    }


def terminal_table(report: Mapping[str, Any]) -> list[list[str]]:
    """The terminal table: the header row, then one row per test (``table_rows`` order)."""
    keys = [key for key, _header in COLUMNS]
    return [[TERMINAL_HEADERS[key] for key in keys],
            *([cells[key] for key in keys] for _test, cells in table_rows(report, terminal_row))]


COMPILE_CACHE_WORDS = {"warm": "warm", "cold": "cold", "partial": "partly warm"}


def compile_cache_text(state: Any) -> str:
    """A test's ``optimized.compile_cache`` in words; empty when it has none (no compile, an older report)."""
    return COMPILE_CACHE_WORDS.get(state, "") if isinstance(state, str) else ""


def compile_rows(report: Mapping[str, Any]) -> list[dict[str, str]]:
    """Tests that measured a compile time: test, compile time, the compile cache's state, recompiles."""
    rows = []
    for test in sort_tests(_tests(report)):
        seconds = side_figure(test, "optimized", "compile_time_s")
        if seconds is None:
            continue
        rows.append({"test": str(test.get("nodeid")), "compile_time": format_seconds(seconds),
                     "cache": compile_cache_text(side_figure(test, "optimized", "compile_cache")) or MISSING,
                     "recompiles": format_plain(side_figure(test, "optimized", "recompiles"))})
    return rows


SPECULATIVE_TITLE = "Speculative decoding"
SPECULATIVE_NOTE = ("Draft tokens the model accepted / proposed in the verified run, and accepted per verification "
                    "step (each step also yields one token of the model's own).")


def speculative_rows(report: Mapping[str, Any]) -> list[dict[str, str]]:
    """Tests whose optimized side drafted tokens (assisted_decoding, prompt_lookup): test, acceptance rate, mean
    accepted tokens per step, and the counts they come from."""
    rows = []
    for test in sort_tests(_tests(report)):
        steps = side_figure(test, "optimized", "draft_steps")
        if steps is None:
            continue
        rows.append({"test": str(test.get("nodeid")),
                     "acceptance_rate": format_percent(side_figure(test, "optimized", "acceptance_rate")),
                     "accepted_per_step": format_plain(side_figure(test, "optimized", "mean_accepted_tokens_per_step")),
                     "accepted": format_plain(side_figure(test, "optimized", "draft_tokens_accepted")),
                     "proposed": format_plain(side_figure(test, "optimized", "draft_tokens_proposed")),
                     "steps": format_plain(steps)})
    return rows


def spans_hardware(report: Mapping[str, Any]) -> bool:
    """The report's rows ran on more than one hardware (a merged report): every per-test table says which."""
    return len(report_hardware(report)) > 1


def failed_budget_rows(report: Mapping[str, Any]) -> list[dict[str, str]]:
    """One row per failed budget: test, hardware, budget, measured, limit, source, note."""
    rows = []
    for test in sort_tests(_tests(report)):
        budgets = {str(b.get("name")): b for b in test.get("budgets") or [] if isinstance(b, dict)}
        for name in failed_budget_names(test):
            budget = budgets.get(name, {})
            rows.append({
                "test": str(test.get("nodeid")),
                "hardware": hardware_of(test, report),
                "budget": name,
                "measured": format_budget_value(name, budget.get("measured")),
                "limit": format_budget_value(name, budget.get("limit")),
                "source": str(budget.get("source") or MISSING),
                "note": one_line(budget.get("note") or ""),
            })
    return rows


def skipped_groups(report: Mapping[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Skipped tests grouped by reason, most frequent reason first, then first seen."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for test in _tests(report):
        if test.get("outcome") == "skipped":
            reason = one_line(test.get("skip_reason") or "") or "no reason given"
            groups.setdefault(reason, []).append(test)
    order = {reason: index for index, reason in enumerate(groups)}
    return sorted(groups.items(), key=lambda item: (-len(item[1]), order[item[0]]))


# Readable names of the estimates the plugin writes; a hook's own keep their key.
ESTIMATE_LABELS = {
    "decode_bytes_per_step": "bytes one decode step reads (weights + KV cache)",
    "decode_bandwidth_bytes_s": "decode bandwidth (those bytes / TPOT)",
    "decode_bandwidth_fraction_of_peak": "decode bandwidth, share of the GPU's peak",
}


def estimate_rows(report: Mapping[str, Any]) -> list[dict[str, str]]:
    rows = []
    for test in sort_tests(_tests(report)):
        estimates = test.get("estimates")
        if not isinstance(estimates, dict):
            continue
        for name, value in estimates.items():
            rows.append({"test": str(test.get("nodeid")), "hardware": hardware_of(test, report),
                         "figure": ESTIMATE_LABELS.get(str(name), str(name)), "value": format_estimate(name, value)})
    return rows


def problem_rows(report: Mapping[str, Any]) -> list[dict[str, str]]:
    """Failed and errored tests whose failure is not (only) a budget, with the one-line reason of each."""
    rows = []
    for test in sort_tests(_tests(report)):
        if test.get("outcome") not in ("failed", "error"):
            continue
        if failed_budget_names(test) and test.get("outcome") == "failed":
            continue
        rows.append({"test": str(test.get("nodeid")), "outcome": str(test.get("outcome")),
                     "error": failure_reason(test.get("error"))})
    return rows


def _plain_value(key: str, value: Any) -> str:
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key.endswith("_bytes"):
        return format_memory(value)
    if key.endswith("_bytes_s"):
        return format_rate(value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {MISSING if v is None else one_line(str(v))}" for k, v in value.items()) or MISSING
    if isinstance(value, (list, tuple)):
        return ", ".join(one_line(str(v)) for v in value) or MISSING
    return one_line(str(value))


def environment_rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows: the environment, the run's settings and the models with revisions."""
    env = _part(report, "environment")
    settings = _part(report, "settings")
    rows = [(label, _plain_value(key, env.get(key))) for key, label in ENVIRONMENT_FIELDS]
    known = {key for key, _ in ENVIRONMENT_FIELDS}
    rows += [(str(key), _plain_value(str(key), value)) for key, value in env.items() if key not in known]
    rows += [(label, _plain_value(key, settings.get(key))) for key, label in SETTINGS_FIELDS if key in settings]
    seen: list[str] = []
    for test in _tests(report):
        model = test.get("model")
        if isinstance(model, dict) and model.get("name_or_path"):
            text = str(model["name_or_path"])
            text += f" @ {model['revision']}" if model.get("revision") else " @ (no revision pinned)"
            if model.get("dtype"):
                text += f" ({model['dtype']})"
            if text not in seen:
                seen.append(text)
    rows += [("Model" if len(seen) == 1 else f"Model {index}", text) for index, text in enumerate(seen, 1)]
    return rows


COUNTED = ("passed", "failed", "skipped", "error")  # always shown
COUNTED_WHEN_ANY = ("xfailed", "xpassed", "rerun")  # shown when a test had that outcome (rerun: pytest-rerunfailures)


def shown_counts(counts: Mapping[str, int]) -> list[str]:
    """The outcome names a summary line shows, in order."""
    return [*COUNTED, *(key for key in COUNTED_WHEN_ANY if counts.get(key))]


def summary_counts(report: Mapping[str, Any]) -> dict[str, int]:
    summary = report.get("summary")
    counts = {key: 0 for key in COUNTED + COUNTED_WHEN_ANY}
    if isinstance(summary, dict):
        for key in counts:
            value = summary.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                counts[key] = value
    else:
        for test in _tests(report):
            if test.get("outcome") in counts:
                counts[str(test["outcome"])] += 1
    return counts


def summary_text(report: Mapping[str, Any]) -> str:
    counts = summary_counts(report)
    return ", ".join(f"{counts[key]} {key}" for key in shown_counts(counts))


def _shards(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The entries of a merged report's ``shards`` (objects only); [] for one run's report."""
    shards = report.get("shards")
    return [shard for shard in shards if isinstance(shard, dict)] if isinstance(shards, list) else []


def _rounds_text(settings: Mapping[str, Any]) -> str:
    rounds, cap = settings.get("rounds"), settings.get("max_rounds")
    return MISSING if rounds is None else f"{rounds}..{cap}" if cap else str(rounds)


def _machine_text(environment: Mapping[str, Any]) -> str:
    """``cuda:0 (NVIDIA H200)``, or the fingerprint (``CPU: ...``) where the device alone says little."""
    device = str(environment.get("device") or MISSING)
    if environment.get("gpu_name"):
        return f"{device} ({one_line(str(environment['gpu_name']))})"
    hardware = environment.get("hardware") or environment.get("cpu_model")
    return f"{device} ({one_line(str(hardware))})" if hardware else device


# (label, text of a shard's settings) of what a merged report's shards may have run with differently.
SHARD_SETTINGS: tuple[tuple[str, Callable[[Mapping[str, Any]], str]], ...] = (
    ("budgets", lambda settings: str(settings.get("budgets_mode") or MISSING)),
    ("rounds", _rounds_text),
    ("warm-up", lambda settings: _plain_value("warmup", settings.get("warmup"))),
    ("device option", lambda settings: _plain_value("device", settings.get("device"))),
    ("default model", lambda settings: _plain_value("default_model", settings.get("default_model"))),
)


# (key of a shard_rows row, header) of the Shards table.
SHARD_COLUMNS: tuple[tuple[str, str], ...] = (
    ("source", "Source"), ("created", "Created"), ("machine", "Machine"), ("budgets", "Budgets"),
    ("rounds", "Rounds"), ("warm-up", "Warm-up"), ("device option", "Device option"),
    ("default model", "Default model"), ("summary", "Tests"))


def shard_rows(report: Mapping[str, Any]) -> list[dict[str, str]]:
    """A merged report's shards, one row each: source, created, machine, each of ``SHARD_SETTINGS``, outcomes."""
    rows = []
    for shard in _shards(report):
        settings, environment = _part(shard, "settings"), _part(shard, "environment")
        row = {"source": one_line(str(shard.get("source") or MISSING)), "created": format_created(shard.get("created")),
               "machine": _machine_text(environment), "summary": summary_text(shard)}
        row.update({label: text(settings) for label, text in SHARD_SETTINGS})
        rows.append(row)
    return rows


def environment_title(report: Mapping[str, Any]) -> str:
    """The environment block's title: a merged report's top-level environment is its first shard's."""
    rows = shard_rows(report)
    return f"Environment of the first shard ({rows[0]['source']}; see Shards)" if len(rows) > 1 else "Environment"


def shard_settings_note(report: Mapping[str, Any]) -> str | None:
    """A warning when a merged report's shards ran with different settings (their figures and verdicts are not
    alike: one shard's budgets off, another's 20 rounds), naming each value and the shards that used it."""
    rows = shard_rows(report)
    differing = []
    for label, _ in SHARD_SETTINGS:
        values: dict[str, list[str]] = {}
        for row in rows:
            values.setdefault(row[label], []).append(row["source"])
        if len(values) > 1:
            differing.append(f"{label} " + " / ".join(f"{value} ({', '.join(sources)})"
                                                      for value, sources in values.items()))
    if not differing:
        return None
    return ("The shards ran with different settings: " + "; ".join(differing)
            + ". Their figures and verdicts are not alike.")


def context_text(report: Mapping[str, Any]) -> str:
    """``2026-11-29 20:00 UTC · cuda:0 (NVIDIA H200) · budgets: enforce``; for a merged report, its shards'
    count and machines, and the budgets mode only when every shard had the same."""
    env = _part(report, "environment")
    settings = _part(report, "settings")
    parts = [format_created(report.get("created"))]
    rows = shard_rows(report)
    if len(rows) > 1:
        machines = list(dict.fromkeys(row["machine"] for row in rows))
        parts.append(f"{len(rows)} shards on {', '.join(machines)}")
        modes = {row["budgets"] for row in rows}
        parts.append(f"budgets: {modes.pop()}" if len(modes) == 1 else "budgets: differ per shard")
        return " · ".join(part for part in parts if part != MISSING)
    device = str(env.get("device") or settings.get("device") or MISSING)
    if env.get("gpu_name"):
        device += f" ({env['gpu_name']})"
    parts.append(device)
    if settings.get("budgets_mode"):
        parts.append(f"budgets: {settings['budgets_mode']}")
    return " · ".join(part for part in parts if part != MISSING)


def budgets_mode_note(report: Mapping[str, Any]) -> str | None:
    if len({row["budgets"] for row in shard_rows(report)}) > 1:
        return None  # the shards' modes differ: shard_settings_note names each
    settings = _part(report, "settings")
    mode = settings.get("budgets_mode")
    if mode == "warn":
        return "Budgets were reported, not enforced (--opt-budgets=warn): a failed budget did not fail its test."
    if mode == "off":
        return "Budgets were not checked (--opt-budgets=off): figures are measured only."
    return None


def compare_note(report: Mapping[str, Any]) -> str | None:
    """What --opt-compare compared this run with and how many tests got each verdict (the report's ``compare``);
    each test's own verdict, reference, spread and detectable size are in its Regression cell. None without it."""
    compare = report.get("compare")
    if not isinstance(compare, dict) or not isinstance(compare.get("counts"), dict):
        return None
    counts = ", ".join(f"{count} {verdict}" for verdict, count in compare["counts"].items()
                       if isinstance(count, int) and (count or verdict in (REGRESSED, OK)))
    against = one_line(str(compare.get("against") or MISSING))
    if compare.get("reference") == "window":
        reference = f"each test's window of up to {compare.get('window')} runs recorded by {against}"
    else:
        reference = f"the report {against}"
    gate = f" (gate {one_line(str(compare['gate']))})" if compare.get("gate") else ""
    text = f"Compared with {reference}{gate}: {counts}."
    if compare["counts"].get(INCONCLUSIVE):
        text += (" Inconclusive: the comparison cannot vouch for the test (a worsening past the limit within its "
                 "noise, or figures that vary too much for the limit); each such test says the smallest "
                 "change it could have flagged (its detectable size).")
    return text


def advice_lines(report: Mapping[str, Any]) -> list[str]:
    advice = report.get("advice")
    if not isinstance(advice, dict):
        return []
    return [one_line(line) for line in advice.get("summary") or [] if str(line).strip()]


# --------------------------------------------------------------------------- A/B against another environment

AB_TITLE = "A/B against another environment"
AB_LABELS = {"latency": "latency", "ttft": "TTFT", "tpot": "TPOT", "throughput": "throughput",
             "peak_memory": "peak memory"}
AB_INTRO = ("Each test's optimized configuration, measured in this environment (the candidate) and in the "
            "reference environment on the same machine, their rounds taken in turns: each figure's change is the "
            "candidate's median against the reference's, with its 95% interval and verdict word where the rounds "
            "give one; KL mean and top-1 compare the candidate's distributions with the reference's.")


def _ab_part(report: Mapping[str, Any]) -> dict[str, Any]:
    return _part(report, "ab")


def ab_candidate(report: Mapping[str, Any], test: Mapping[str, Any]) -> Any:
    """The candidate stack a row was measured in: its shard's in a merged report, else the report's."""
    shards, index = report.get("shards"), test.get("shard")
    if isinstance(shards, list) and isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(shards):
        shard = shards[index]
        ab = shard.get("ab") if isinstance(shard, dict) else None
        if isinstance(ab, dict) and ab.get("candidate") is not None:
            return ab["candidate"]
    return _ab_part(report).get("candidate")


def ab_stacks_text(candidate: Any, reference: Any) -> str:
    """``candidate (transformers 5.24.0) vs reference (transformers 5.22.0)``: only the packages whose versions
    differ; ``candidate vs reference (identical stacks)`` when none does."""
    cand, ref = stack_versions(candidate), stack_versions(reference)
    pairs = differing_versions(cand, ref)
    if pairs:
        return (f"candidate ({', '.join(f'{name} {version_text(c)}' for name, c, _ in pairs)}) vs reference "
                f"({', '.join(f'{name} {version_text(r)}' for name, _, r in pairs)})")
    if stack_note(cand, ref) == IDENTICAL_STACKS:
        return f"candidate vs reference ({IDENTICAL_STACKS})"
    return "candidate vs reference"


def _ab_figure_text(metric: str, figure: Mapping[str, Any]) -> str:
    """``latency +12.0% [+8.0%, +16.0%] slower``; a change from 0 as both figures."""
    change = _number(figure.get("change_pct"))
    if change is None:
        fmt = METRICS[metric].fmt
        before, after = _number(figure.get("reference")), _number(figure.get("candidate"))
        text = (f"{AB_LABELS[metric]} {MISSING if before is None else fmt(before)} -> "
                f"{MISSING if after is None else fmt(after)}")
    else:
        text = f"{AB_LABELS[metric]} {change:+.1f}%"
    interval = interval_text(figure.get("interval_pct"))
    word = figure.get("word")
    return " ".join(part for part in (text, interval, word if isinstance(word, str) else "") if part)


def ab_line(report: Mapping[str, Any], test: Mapping[str, Any]) -> str:
    """One test's A/B line: ``candidate (transformers 5.24.0) vs reference (transformers 5.22.0): latency +12.0%
    [+8.0%, +16.0%] slower, ..., KL mean 0.0012, top-1 100.0%; regressed``."""
    ab = test.get("ab")
    if not isinstance(ab, dict):
        return MISSING
    stacks = ab_stacks_text(ab_candidate(report, test), ab.get("reference"))
    if ab.get("mode") == BLOCKS:
        stacks += ", rounds in alternating blocks"
    found = ab.get("figures")
    figures: dict[str, Any] = found if isinstance(found, dict) else {}
    parts = [_ab_figure_text(metric, figures[metric]) for metric in FIGURES if isinstance(figures.get(metric), dict)]
    similarity = ab.get("similarity")
    if isinstance(similarity, dict):
        if _number(similarity.get("kl_mean")) is not None:
            parts.append(f"KL mean {format_kl(similarity['kl_mean'])}")
        if _number(similarity.get("top1")) is not None:
            parts.append(f"top-1 {format_percent(similarity['top1'])}")
    line = f"{stacks}: {', '.join(parts) or 'no figure measured on both sides'}"
    verdict = ab.get("verdict")
    if verdict in (NOT_JUDGED, NOT_COMPARABLE):  # why, from its details
        details = [one_line(str(d)) for d in ab.get("details") or []]
        line += f"; {verdict}" + (f": {details[0]}" if details else "")
    elif isinstance(verdict, str) and verdict:
        unseen = inconclusive_metrics(ab)
        line += f"; {verdict}" + (f" ({', '.join(unseen)}: not resolved by the rounds)" if unseen else "")
    return line


AB_NO_ROWS = "No test of this report was measured in the reference environment."


def has_ab(report: Mapping[str, Any]) -> bool:
    """The report has an A/B section: a row with an A/B record, or the top-level ``ab`` of a run that had one."""
    return bool(_ab_part(report)) or bool(ab_rows(report))


def ab_lines(report: Mapping[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """(test row, its A/B line) of every row with an A/B record, in the results table's order."""
    return [(test, ab_line(report, test)) for test in sort_tests(ab_rows(report))]


def ab_header_lines(report: Mapping[str, Any]) -> list[str]:
    """The A/B section's head: the two interpreters, what differs between the stacks (only the packages whose
    versions differ, or that they are identical), the gate's counts, and where a merge's shards disagree."""
    top = _ab_part(report)
    if not top and not ab_rows(report):
        return []
    candidate, reference = top.get("candidate"), top.get("reference")
    python = {role: stack.get("python") if isinstance(stack, dict) else None
              for role, stack in (("candidate", candidate), ("reference", reference))}
    lines = [f"candidate {python['candidate'] or MISSING} vs reference {python['reference'] or MISSING}"]
    differs = top.get("differs")
    if isinstance(differs, dict) and differs:
        lines.append("what differs: " + ", ".join(
            f"{name} {' / '.join(str(v) for v in values)}" if isinstance(values, list) else f"{name} {values}"
            for name, values in differs.items()))
    elif top.get("note") == IDENTICAL_STACKS:
        lines.append(f"what differs: nothing ({IDENTICAL_STACKS}): both environments report the same versions, so "
                     f"this A/B compares an environment with itself, a null comparison")
    summary = top.get("summary")
    if top.get("thresholds") and isinstance(summary, dict):
        counts = ", ".join(f"{count} {verdict}" for verdict, count in summary.items())
        lines.append(f"--opt-ab-fail={top['thresholds']}: {counts}")
    if top.get("merge_note"):
        lines.append(one_line(str(top["merge_note"])))
    return lines



# --------------------------------------------------------------------------- the execution census

CENSUS_TITLE = "Execution census"
CENSUS_NOTE = ("What one untimed generate call of each side ran, counted exactly after the timed rounds: the ATen "
               "ops (per call and per decode step), a compiled configuration's graph breaks with their reasons and "
               "its recompiles, on CUDA the kernels launched and the host-device syncs. A figure the device cannot "
               "give says why; two runs of one stack count the same, so any change is a change of what runs.")
CENSUS_NAMES_SHOWN = 6  # of an op or kernel map: the most frequent, then a count of the rest
CENSUS_SIDES = ("optimized", "baseline")


@dataclass(frozen=True)
class CensusTable:
    """One test's census: (figure, optimized, baseline) rows, or why neither side was counted (``why_not``)."""

    test: str
    rows: list[tuple[str, str, str]]
    why_not: str | None = None


def _count_map_text(counts: Any, total: Any = None, limit: int = CENSUS_NAMES_SHOWN) -> str:
    """``872 (47 kinds): aten::mul 125, aten::to 89, ... and 41 more``: a map's total, then its largest counts."""
    if not isinstance(counts, dict):
        return MISSING
    numbers = {str(name): number for name, value in counts.items() if (number := _number(value)) is not None}
    whole = _number(total)
    whole = sum(numbers.values()) if whole is None else whole
    largest = sorted(numbers.items(), key=lambda item: (-item[1], item[0]))
    named = ", ".join(f"{name} {format_plain(count)}" for name, count in largest[:limit])
    rest = f" and {len(largest) - limit} more" if len(largest) > limit else ""
    kinds = f"{len(largest)} kind{'s' if len(largest) != 1 else ''}"
    return f"{format_plain(whole)} ({kinds})" + (f": {named}{rest}" if named else "")


def _why(census: Mapping[str, Any], key: str) -> str:
    unavailable = census.get("unavailable")
    why = unavailable.get(key) if isinstance(unavailable, dict) else None
    return f"{MISSING} ({one_line(str(why))})" if why else MISSING


def _census_cells(census: Mapping[str, Any]) -> dict[str, str]:
    """One side's census figures in words, keyed by ``CENSUS_FIGURES``'s keys; a figure not counted says why."""
    steps = _number(census.get("decode_steps"))
    cells = {"ops": _count_map_text(census.get("ops"), census.get("ops_total"))}
    per_step = census.get("ops_per_step")
    cells["ops_per_step"] = (_count_map_text(per_step) + (f" (over {format_plain(steps)} steps)" if steps else "")
                             if isinstance(per_step, dict) else f"{MISSING} (no decode step counted)")
    breaks = _number(census.get("graph_breaks"))
    reasons = [one_line(str(reason)) for reason in census.get("graph_break_reasons") or []]
    cells["graph_breaks"] = (_why(census, "graph_breaks") if breaks is None
                             else format_plain(breaks) + (f": {'; '.join(reasons)}" if reasons else ""))
    for key in ("recompiles", "unique_graphs"):
        value = census.get(key)
        cells[key] = _why(census, key) if _number(value) is None else format_plain(value)
    kernels = census.get("kernels")
    cells["kernels"] = (_count_map_text(kernels, census.get("kernels_total")) if isinstance(kernels, dict)
                        else _why(census, "kernels"))
    step_kernels = census.get("kernels_per_step")
    # (where kernels are not counted, the row above says why)
    cells["kernels_per_step"] = _count_map_text(step_kernels) if isinstance(step_kernels, dict) else MISSING
    syncs, step_syncs = _number(census.get("syncs")), _number(census.get("syncs_per_step"))
    cells["syncs"] = (_why(census, "syncs") if syncs is None else format_plain(syncs) + (
        f" ({format_plain(step_syncs)} per step)" if step_syncs is not None else ""))
    replays = _number(census.get("cuda_graph_replays"))
    cells["cuda_graph_replays"] = MISSING if replays is None else format_plain(replays)
    return cells


CENSUS_FIGURES: tuple[tuple[str, str], ...] = (
    ("ops", "Ops per call"), ("ops_per_step", "Ops per decode step"), ("graph_breaks", "Graph breaks"),
    ("recompiles", "Recompiles"), ("unique_graphs", "Unique graphs"), ("kernels", "Kernels per call"),
    ("kernels_per_step", "Kernels per decode step"), ("syncs", "Host-device syncs per call"),
    ("cuda_graph_replays", "CUDA graph replays"))
"""(key, label) of a census table's rows; a row neither side counted, nor says why, is left out."""


def census_table(test: Mapping[str, Any]) -> CensusTable | None:
    """A test's census (the row's ``census``), None for a row without one (not measured, an earlier report)."""
    census = test.get("census")
    if not isinstance(census, dict):
        return None
    nodeid = str(test.get("nodeid") or MISSING)
    found = census.get("why_not")
    why_not: dict[str, Any] = found if isinstance(found, dict) else {}
    sides = {side: census.get(side) if isinstance(census.get(side), dict) else None for side in CENSUS_SIDES}
    if not any(sides.values()):
        reasons = dict.fromkeys(one_line(str(why_not.get(side) or "not taken")) for side in CENSUS_SIDES)
        return CensusTable(nodeid, [], "; ".join(reasons))
    cells = {side: _census_cells(counted) if counted is not None else {} for side, counted in sides.items()}
    rows = []
    for key, label in CENSUS_FIGURES:
        pair = [cells[side].get(key, MISSING) for side in CENSUS_SIDES]
        for index, side in enumerate(CENSUS_SIDES):
            if sides[side] is None and key == "ops":
                pair[index] = f"not taken: {one_line(str(why_not.get(side) or 'no census'))}"
        if all(text == MISSING for text in pair):
            continue
        rows.append((label, pair[0], pair[1]))
    return CensusTable(nodeid, rows)


def census_tables(report: Mapping[str, Any]) -> list[CensusTable]:
    """Every row's census, in the results table's order."""
    return [table for test in sort_tests(_tests(report)) if (table := census_table(test)) is not None]
