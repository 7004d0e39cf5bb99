"""The report as Markdown: the text of ``--opt-report-md`` and of ``$GITHUB_STEP_SUMMARY``.

Layout, top to bottom: a one-line summary; the failed budgets (test, budget, measured, limit);
the results table, one row per test, tests with failed budgets first; estimated figures in a
section of their own (never in a column of measured ones); the skipped techniques grouped by
reason; failures and errors; the advisor's summary; the environment in a collapsed
``<details>`` block.

The formatting helpers and ``table_rows`` are shared with :mod:`render_html`, so both
renderings show the same figures in the same words.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from ..units import failure_reason
from ..units import format_bytes, format_duration

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
    ("warmup", "Warm-up rounds"),
    ("device", "Device option"),
    ("default_model", "Default model"),
)

_DURATION_BUDGETS = {"max_ttft", "max_tpot", "max_latency"}
_TIMES_BUDGETS = {"min_speedup", "max_memory_ratio"}
_FRACTION_BUDGETS = {"min_token_match", "min_top1"}


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


def format_times(value: Any) -> str:
    """A ratio such as a speedup: ``1.23x``."""
    number = _number(value)
    if number is None:
        return MISSING
    return _non_finite(number) or f"{number:.2f}x"


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
        return format_times(value)
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
        return format_times(value)
    return format_plain(value)


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
    if moment.utcoffset() is not None and moment.utcoffset().total_seconds() == 0:  # type: ignore[union-attr]
        return moment.strftime("%Y-%m-%d %H:%M UTC")
    return moment.isoformat(sep=" ", timespec="minutes")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# --------------------------------------------------------------------------- report model


def _part(report: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A top-level object of the report (``environment``, ``settings``), or an empty dict."""
    value = report.get(key)
    return value if isinstance(value, dict) else {}


def _tests(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    tests = report.get("tests") or []
    return [test for test in tests if isinstance(test, dict)]


def _metric(test: Mapping[str, Any], which: str, key: str) -> Any:
    metrics = test.get(which)
    return metrics.get(key) if isinstance(metrics, dict) else None


def _similarity(test: Mapping[str, Any], key: str) -> Any:
    similarity = test.get("similarity")
    return similarity.get(key) if isinstance(similarity, dict) else None


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
        return f"{outcome}: {_one_line(reason)}" if reason else outcome
    if test.get("error") and (outcome == "error" or outcome == "failed" and not failed_budget_names(test)):
        return f"{outcome}: {failure_reason(test.get('error'))}"  # a budget failure has its own column
    return outcome


def techniques_text(test: Mapping[str, Any]) -> str:
    techniques = " + ".join(str(name) for name in test.get("techniques") or []) or MISSING
    baseline = " + ".join(str(name) for name in test.get("baseline_techniques") or [])
    return f"{techniques} vs {baseline}" if baseline else techniques


def regression_text(test: Mapping[str, Any]) -> str:
    regression = test.get("regression")
    if not isinstance(regression, dict) or not regression.get("verdict"):
        return MISSING
    details = "; ".join(_one_line(detail) for detail in regression.get("details") or [])
    verdict = str(regression["verdict"])
    return f"{verdict}: {details}" if details else verdict


def has_regressions(report: Mapping[str, Any]) -> bool:
    return any(isinstance(test.get("regression"), dict) for test in _tests(report))


def columns(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The results table's (key, header) pairs for this report."""
    cols = list(COLUMNS)
    if has_regressions(report):
        cols.append(REGRESSION_COLUMN)
    return cols


def table_row(test: Mapping[str, Any]) -> dict[str, str]:
    """One test's cells as plain text (not escaped), keyed as in :data:`COLUMNS`."""

    def pair(key: str, fmt: Any) -> str:
        return format_pair(fmt(_metric(test, "optimized", key)), fmt(_metric(test, "baseline", key)))

    token_match = format_percent(_similarity(test, "token_match"))
    if _similarity(test, "near_tie") and token_match != MISSING:
        token_match += " (near-tie)"
    return {
        "test": str(test.get("nodeid") or MISSING),
        "techniques": techniques_text(test),
        "outcome": outcome_text(test),
        "ttft": pair("ttft_s", format_seconds),
        "tpot": pair("tpot_s", format_seconds),
        "throughput": pair("throughput_tok_s", format_throughput),
        "speedup": format_times(test.get("speedup")),
        "memory": pair("peak_memory_bytes", format_memory),
        "memory_ratio": format_times(test.get("memory_ratio")),
        "token_match": token_match,
        "kl_mean": format_kl(_similarity(test, "kl_mean")),
        "top1": format_percent(_similarity(test, "top1")),
        "failed_budgets": ", ".join(failed_budget_names(test)) or MISSING,
        "regression": regression_text(test),
    }


def table_rows(report: Mapping[str, Any]) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """(test record, its cells) for every test, in report order (failed budgets first)."""
    return [(test, table_row(test)) for test in sort_tests(_tests(report))]


def failed_budget_rows(report: Mapping[str, Any]) -> list[dict[str, str]]:
    """One row per failed budget: test, budget, measured, limit, source, note."""
    rows = []
    for test in sort_tests(_tests(report)):
        budgets = {str(b.get("name")): b for b in test.get("budgets") or [] if isinstance(b, dict)}
        for name in failed_budget_names(test):
            budget = budgets.get(name, {})
            rows.append({
                "test": str(test.get("nodeid")),
                "budget": name,
                "measured": format_budget_value(name, budget.get("measured")),
                "limit": format_budget_value(name, budget.get("limit")),
                "source": str(budget.get("source") or MISSING),
                "note": _one_line(budget.get("note") or ""),
            })
    return rows


def skipped_groups(report: Mapping[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Skipped tests grouped by reason, most frequent reason first, then first seen."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for test in _tests(report):
        if test.get("outcome") == "skipped":
            reason = _one_line(test.get("skip_reason") or "") or "no reason given"
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
            rows.append({"test": str(test.get("nodeid")), "figure": ESTIMATE_LABELS.get(str(name), str(name)), "value": format_estimate(name, value)})
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
        return ", ".join(f"{k} {MISSING if v is None else _one_line(str(v))}" for k, v in value.items()) or MISSING
    if isinstance(value, (list, tuple)):
        return ", ".join(_one_line(str(v)) for v in value) or MISSING
    return _one_line(str(value))


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
COUNTED_WHEN_ANY = ("xfailed", "xpassed")  # shown when a test had that outcome


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


def context_text(report: Mapping[str, Any]) -> str:
    """``2026-11-29 20:00 UTC · cuda:0 (NVIDIA H200) · budgets: enforce``."""
    env = _part(report, "environment")
    settings = _part(report, "settings")
    parts = [format_created(report.get("created"))]
    device = str(env.get("device") or settings.get("device") or MISSING)
    if env.get("gpu_name"):
        device += f" ({env['gpu_name']})"
    parts.append(device)
    if settings.get("budgets_mode"):
        parts.append(f"budgets: {settings['budgets_mode']}")
    return " · ".join(part for part in parts if part != MISSING)


def budgets_mode_note(report: Mapping[str, Any]) -> str | None:
    settings = _part(report, "settings")
    mode = settings.get("budgets_mode")
    if mode == "warn":
        return "Budgets were reported, not enforced (--opt-budgets=warn): a failed budget did not fail its test."
    if mode == "off":
        return "Budgets were not checked (--opt-budgets=off): figures are measured only."
    return None


def advice_lines(report: Mapping[str, Any]) -> list[str]:
    advice = report.get("advice")
    if not isinstance(advice, dict):
        return []
    return [_one_line(line) for line in advice.get("summary") or [] if str(line).strip()]


# --------------------------------------------------------------------------- markdown


_MD_SPECIAL = re.compile(r"([\\`*\[\]<>|~])")
_MD_ENTITY = re.compile(r"&(?=#?[A-Za-z0-9]+;)")
_MD_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def md_text(text: Any) -> str:
    """Text safe in a Markdown table cell or list item: one line, Markdown and HTML inert.

    Backslash-escapes what GitHub would read as markup (``| * ` [ ] < > ~ \\``, and ``_`` where
    it could start emphasis; ``&`` where it would start an entity), so a ``|`` in a reason cannot
    split a table cell and a ``<tag>`` stays text.
    """
    line = _MD_ENTITY.sub("&amp;", _one_line(str(text)))
    line = _MD_SPECIAL.sub(r"\\\1", line)
    return _MD_UNDERSCORE.sub(r"\\_", line)


def md_code(text: Any, *, in_table: bool) -> str:
    """Inline code (for test ids): a fence longer than any backtick run inside; pipes escaped in tables."""
    line = _one_line(str(text))
    longest = max((len(run) for run in re.findall(r"`+", line)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if line.startswith("`") or line.endswith("`") or longest else ""
    if in_table:
        line = line.replace("|", "\\|")
    return f"{fence}{pad}{line}{pad}{fence}"


def _md_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """The report as GitHub-flavoured Markdown (a step summary or an issue's text)."""
    out: list[str] = ["## Optimization report", ""]
    out.append(f"**{summary_text(report)}**" + (f" · {md_text(context_text(report))}" if context_text(report) else ""))
    note = budgets_mode_note(report)
    if note:
        out += ["", f"> {md_text(note)}"]

    budget_rows = failed_budget_rows(report)
    if budget_rows:
        out += ["", "### Failed budgets", ""]
        with_note = any(row["note"] for row in budget_rows)
        headers = ["Test", "Budget", "Measured", "Limit", "Source"] + (["Note"] if with_note else [])
        cells = []
        for row in budget_rows:
            cell = [md_code(row["test"], in_table=True), md_text(row["budget"]), md_text(row["measured"]),
                    md_text(row["limit"]), md_text(row["source"])]
            if with_note:
                cell.append(md_text(row["note"]) or MISSING)
            cells.append(cell)
        out += _md_table(headers, cells)

    out += ["", "### Results", ""]
    rows = table_rows(report)
    if rows:
        cols = columns(report)
        cells = []
        for _test, row in rows:
            cells.append([md_code(row[key], in_table=True) if key == "test" else md_text(row[key]) for key, _ in cols])
        out += _md_table([header for _, header in cols], cells)
    else:
        out.append("No test used `opt_bench` in this run.")

    estimates = estimate_rows(report)
    if estimates:
        out += ["", "### Estimated figures (estimate)", "",
                "Not measured in this run; kept apart from the measured figures above.", ""]
        out += _md_table(
            ["Test", "Figure", "Value (estimate)"],
            ([md_code(row["test"], in_table=True), md_text(row["figure"]), md_text(row["value"]) + " (estimate)"]
             for row in estimates),
        )

    groups = skipped_groups(report)
    if groups:
        count = sum(len(tests) for _, tests in groups)
        out += ["", f"### Skipped techniques ({count} {'test' if count == 1 else 'tests'})", ""]
        for reason, tests in groups:
            out.append(f"- {md_text(reason)} ({len(tests)} {'test' if len(tests) == 1 else 'tests'})")
            for test in tests:
                techniques = " + ".join(str(name) for name in test.get("techniques") or [])
                suffix = f" — {md_text(techniques)}" if techniques else ""
                out.append(f"  - {md_code(test.get('nodeid'), in_table=False)}{suffix}")

    problems = problem_rows(report)
    if problems:
        out += ["", "### Failures and errors", ""]
        out += [f"- {md_code(row['test'], in_table=False)} ({row['outcome']}): {md_text(row['error'])}"
                for row in problems]

    advice = advice_lines(report)
    if advice:
        out += ["", "### Advice", ""] + [f"- {md_text(line)}" for line in advice]

    out += ["", "<details>", "<summary>Environment</summary>", ""]
    out += _md_table(["Item", "Value"], ([md_text(label), md_text(value)] for label, value in environment_rows(report)))
    out += ["", "</details>", ""]
    return "\n".join(out)
