"""``--opt-compare`` / ``--opt-compare-fail``: this run's report against an earlier one.

The comparison works on two JSON reports (``build_report`` documents), never on live objects, so a
report written last week compares exactly like one written a minute ago. Only the optimized side's
figures (and the run's own speedup, memory ratio and similarity) are compared: they are what a
change to the code, the libraries or the configuration moves.

Thresholds follow pytest-benchmark's ``--benchmark-compare-fail`` style: ``latency:10%`` fails
on a relative worsening of more than 10%, ``kl_mean:0.01`` on an absolute worsening of more than
0.01 (absolute limits are in the report's units: seconds, bytes, tokens per second, nats).
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import OptConfigError
from .schema import load_report
from ..units import format_bytes, format_duration, format_ratio, shown


@dataclass(frozen=True)
class _Metric:
    """Where a figure lives in a report test entry, which way is better, and how to print it."""

    path: tuple[str, ...]
    higher_is_better: bool
    fmt: Callable[[float], str]


def _fmt_throughput(value: float) -> str:
    return f"{value:.1f} tok/s"


def _fmt_kl(value: float) -> str:
    return f"{value:.3g}"


def _fmt_fraction(value: float) -> str:
    return f"{value:.3f}"


METRICS: dict[str, _Metric] = {
    "latency": _Metric(("optimized", "latency_s"), False, format_duration),
    "ttft": _Metric(("optimized", "ttft_s"), False, format_duration),
    "tpot": _Metric(("optimized", "tpot_s"), False, format_duration),
    "peak_memory": _Metric(("optimized", "peak_memory_bytes"), False, format_bytes),
    "throughput": _Metric(("optimized", "throughput_tok_s"), True, _fmt_throughput),
    "speedup": _Metric(("speedup",), True, format_ratio),
    "kl_mean": _Metric(("similarity", "kl_mean"), False, _fmt_kl),
    "kl_max": _Metric(("similarity", "kl_max"), False, _fmt_kl),
    "top1": _Metric(("similarity", "top1"), True, _fmt_fraction),
    "token_match": _Metric(("similarity", "token_match"), True, _fmt_fraction),
    "memory_ratio": _Metric(("memory_ratio",), False, format_ratio),
}
"""Every metric a threshold may name (lower is better unless ``higher_is_better``)."""

INFORMATIONAL_METRICS: tuple[str, ...] = ("latency", "peak_memory", "throughput", "kl_mean", "top1")
"""Metrics listed in the details even without a threshold (kept short on purpose)."""

VERDICTS: tuple[str, ...] = ("regressed", "improved", "ok", "new", "not comparable")

COMPARE_FAIL_FORMS = (
    "comma-separated METRIC:NUMBER% (relative worsening, e.g. latency:10%) or METRIC:NUMBER "
    "(absolute worsening in the report's units, e.g. kl_mean:0.01), with METRIC one of "
    + ", ".join(METRICS)
)

REGRESSED_TAG = ": regressed"
"""Suffix of a detail that is a regression, so ``summarise`` can show only those."""

_NUMBER = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?", re.ASCII)
_REL_TOL = 1e-9  # a change equal to the limit (up to float rounding) is within it


@dataclass(frozen=True)
class Threshold:
    """One ``--opt-compare-fail`` term: a metric may worsen by at most ``limit`` (percent if ``relative``)."""

    metric: str
    limit: float
    relative: bool

    def __post_init__(self) -> None:
        # Built by hand (not only by the parser): refuse what compare_reports could not honour.
        if self.metric not in METRICS:
            raise OptConfigError(f"Threshold: unknown metric {self.metric!r}; accepted: {', '.join(METRICS)}")
        number = isinstance(self.limit, (int, float)) and not isinstance(self.limit, bool)
        if not number or not math.isfinite(self.limit) or self.limit < 0:
            raise OptConfigError(f"Threshold: limit {self.limit!r} for {self.metric} must be a finite number >= 0")

    def describe(self) -> str:
        """The term as the user would write it, e.g. ``latency:10%``."""
        return f"{self.metric}:{self.limit:g}{'%' if self.relative else ''}"


def _bad(where: str, piece: str, why: str) -> OptConfigError:
    return OptConfigError(f"{where}: {piece!r} {why}; accepted: {COMPARE_FAIL_FORMS}")


def parse_compare_fail(text: str, where: str = "--opt-compare-fail") -> list[Threshold]:
    """Parse ``latency:10%,kl_mean:0.01`` into thresholds; every mistake is an OptConfigError naming ``where``.

    Strict on purpose: a gate that silently ignores a mistyped term lets regressions through.
    """
    if not isinstance(text, str):
        raise OptConfigError(f"{where}: expected text such as 'latency:10%', found {type(text).__name__} "
                             f"{text!r}; accepted: {COMPARE_FAIL_FORMS}")
    if not text.strip():
        raise _bad(where, text, "is empty")
    thresholds: list[Threshold] = []
    seen: set[tuple[str, bool]] = set()
    for raw in text.split(","):
        piece = raw.strip()
        if not piece:
            raise _bad(where, text, "has an empty term (a stray comma)")
        if ":" not in piece:
            raise _bad(where, piece, "has no ':' between the metric and the number")
        name, _, number_text = piece.partition(":")
        metric = name.strip().lower().replace("-", "_")
        if metric not in METRICS:
            close = difflib.get_close_matches(metric, list(METRICS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _bad(where, piece, f"names an unknown metric {name.strip()!r}{hint}")
        number_text = number_text.strip()
        relative = number_text.endswith("%")
        if relative:
            number_text = number_text[:-1].strip()
        if number_text.startswith("-"):
            raise _bad(where, piece, "has a negative limit (a limit is how much worse is still accepted)")
        if not _NUMBER.fullmatch(number_text):
            raise _bad(where, piece, f"needs a plain number after the ':', found {number_text!r}")
        limit = float(number_text)
        if not math.isfinite(limit):
            raise _bad(where, piece, "has a limit that is not a finite number")
        if (metric, relative) in seen:
            raise _bad(where, piece, f"gives a {'relative' if relative else 'absolute'} limit for {metric} twice")
        seen.add((metric, relative))
        thresholds.append(Threshold(metric, limit, relative))
    return thresholds


COMPARE_REMEDY = "give a JSON report written by this plugin (pytest --opt-report-json=PATH)"


def load_compare_report(path: str, source: str = "--opt-compare") -> dict[str, Any]:
    """The earlier report, read by ``schema.load_report``; a problem names ``source`` (the option, or the
    variable ``PYTEST_OPT_COMPARE`` when the path came from there) and ends with ``COMPARE_REMEDY``."""
    return load_report(path, source=source, remedy=COMPARE_REMEDY)


# ---------------------------------------------------------------------------------------------
# comparison


def _figure(entry: dict[str, Any], metric: str) -> float | None:
    """The metric's value in a test entry; None when absent, null, non-numeric or not finite."""
    value: Any = entry
    for key in METRICS[metric].path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an integer past any float: as unmeasurable as infinity
        return None
    return value if math.isfinite(value) else None


def _worsening(metric: str, old: float, new: float, relative: bool) -> float:
    """How much worse ``new`` is than ``old`` (negative: better); percent of ``|old|`` when relative."""
    delta = new - old
    if METRICS[metric].higher_is_better:
        delta = -delta
    if not relative:
        return delta
    if old == 0:
        return 0.0 if delta == 0 else math.copysign(math.inf, delta)
    return 100.0 * delta / abs(old)


def _beyond(amount: float, limit: float) -> bool:
    """``amount > limit``, with float rounding at the boundary counted as within."""
    return amount > limit and not math.isclose(amount, limit, rel_tol=_REL_TOL, abs_tol=1e-12)


def _signed(metric: str, delta: float) -> str:
    """A signed difference in the metric's own format (``+1.5 ms``)."""
    sign = "-" if delta < 0 else "+"
    return sign + METRICS[metric].fmt(abs(delta))


def _change(metric: str, old: float, new: float) -> str:
    """The change as a percentage of the old value, or as a difference when the old value is 0."""
    if old == 0:
        return "no change" if new == 0 else f"{_signed(metric, new - old)} from 0"
    return f"{100.0 * (new - old) / abs(old):+.1f}%"


def _limit_text(threshold: Threshold) -> str:
    """The limit in the direction that counts as worse: ``10%`` for lower-is-better, ``-10%`` otherwise."""
    down = METRICS[threshold.metric].higher_is_better
    if threshold.relative:
        return f"{'-' if down else ''}{threshold.limit:g}%"
    return f"{'-' if down else '+'}{METRICS[threshold.metric].fmt(threshold.limit)}"


def _identity_differences(old_report: dict[str, Any], new_report: dict[str, Any]) -> list[str]:
    """Why no test of the two reports can be compared: measured on different hardware."""
    old_env = old_report.get("environment") or {}
    new_env = new_report.get("environment") or {}
    reasons = []
    old_dev = str(old_env.get("device") or "").split(":")[0]  # cuda:0 vs cuda:1 is the same kind of device
    new_dev = str(new_env.get("device") or "").split(":")[0]
    if old_dev != new_dev:
        reasons.append(f"measured on different hardware: device {shown(old_env.get('device'))} -> {shown(new_env.get('device'))}")
    if old_env.get("gpu_name") != new_env.get("gpu_name"):
        reasons.append(f"measured on different hardware: GPU {shown(old_env.get('gpu_name'))} -> {shown(new_env.get('gpu_name'))}")
    return reasons


_WORKLOAD_KEYS = ("num_prompts", "max_new_tokens", "batch_size", "input_tokens")


def _test_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Why this one test's figures are not comparable: no measurement, another model or workload."""
    reasons = []
    for side, entry in (("old", old), ("new", new)):
        if not isinstance(entry.get("optimized"), dict):
            why = entry.get("outcome") or "no record"
            if entry.get("skip_reason"):
                why += f": {entry['skip_reason']}"
            elif str(entry.get("error") or "").strip():
                why += f": {str(entry['error']).strip().splitlines()[-1][:120]}"
            reasons.append(f"no measurement in the {side} run ({why})")
    if reasons:
        return reasons
    old_model, new_model = old.get("model") or {}, new.get("model") or {}
    for key in ("name_or_path", "revision", "dtype"):
        if old_model.get(key) != new_model.get(key):
            reasons.append(f"different model: {key} {shown(old_model.get(key))} -> {shown(new_model.get(key))}")
    old_work, new_work = old.get("workload") or {}, new.get("workload") or {}
    for key in _WORKLOAD_KEYS:
        if key == "input_tokens" and (key not in old_work or key not in new_work):
            continue  # only compared when both reports recorded it
        if old_work.get(key) != new_work.get(key):
            reasons.append(f"different workload: {key} {shown(old_work.get(key))} -> {shown(new_work.get(key))}")
    return reasons


def _judge(threshold: Threshold, old: float | None, new: float | None) -> tuple[str, str | None]:
    """(``regressed`` | ``improved`` | ``ok``, detail) for one threshold on one test."""
    metric, fmt = threshold.metric, METRICS[threshold.metric].fmt
    if old is not None and new is None:
        return "regressed", f"{metric} {fmt(old)} -> not measured: missing in the new run{REGRESSED_TAG}"
    if old is None and new is None:
        return "ok", f"{metric} not measured in either run"
    if old is None:
        assert new is not None
        return "ok", f"{metric} not measured in the old run (new: {fmt(new)})"
    assert new is not None
    amount = _worsening(metric, old, new, threshold.relative)
    if _beyond(amount, threshold.limit):
        verdict = "regressed"
    elif _beyond(-amount, threshold.limit):
        verdict = "improved"
    else:
        verdict = "ok"
    change = _change(metric, old, new) if threshold.relative else _signed(metric, new - old)
    detail = f"{metric} {fmt(old)} -> {fmt(new)} ({change}, limit {_limit_text(threshold)})"
    if verdict == "regressed":
        if threshold.relative and old == 0:
            detail += f" (a relative limit cannot hold from 0; use an absolute one, e.g. {metric}:0.01)"
        detail += REGRESSED_TAG
    elif verdict == "improved":
        detail += ": improved"
    return verdict, detail


def _compare_test(old: dict[str, Any], new: dict[str, Any], thresholds: list[Threshold]) -> dict[str, Any]:
    details: list[str] = []
    regressed = improved = False
    for threshold in thresholds:
        verdict, detail = _judge(threshold, _figure(old, threshold.metric), _figure(new, threshold.metric))
        regressed |= verdict == "regressed"
        improved |= verdict == "improved"
        if detail:
            details.append(detail)
    gated = {t.metric for t in thresholds}
    for metric in INFORMATIONAL_METRICS:
        if metric in gated:
            continue
        before, after = _figure(old, metric), _figure(new, metric)
        if before is not None and after is not None:
            fmt = METRICS[metric].fmt
            details.append(f"{metric} {fmt(before)} -> {fmt(after)} ({_change(metric, before, after)})")
    if list(old.get("techniques") or []) != list(new.get("techniques") or []):
        details.append(f"techniques changed: {old.get('techniques')} -> {new.get('techniques')}")
    if list(old.get("baseline_techniques") or []) != list(new.get("baseline_techniques") or []):
        details.append(f"baseline changed: {old.get('baseline_techniques')} -> {new.get('baseline_techniques')}")
    verdict = "regressed" if regressed else "improved" if improved else "ok"
    return {"verdict": verdict, "details": details}


def compare_reports(old: dict[str, Any], new: dict[str, Any], thresholds: list[Threshold]) -> dict[str, dict[str, Any]]:
    """A verdict per test of the ``new`` report: regressed, improved, ok, new or not comparable.

    Only a threshold can make a test regress (informational figures never do), and only figures
    measured on the same hardware, model and workload are compared at all: comparing anything
    else would make the gate fail, or pass, for reasons that have nothing to do with the change.
    """
    old_tests = {t["nodeid"]: t for t in old.get("tests") or [] if isinstance(t, dict) and "nodeid" in t}
    run_reasons = _identity_differences(old, new)
    verdicts: dict[str, dict[str, Any]] = {}
    for test in new.get("tests") or []:
        if not isinstance(test, dict) or "nodeid" not in test:
            continue
        nodeid = test["nodeid"]
        before = old_tests.get(nodeid)
        if before is None:
            verdicts[nodeid] = {"verdict": "new", "details": ["not in the old report"]}
            continue
        reasons = run_reasons + _test_differences(before, test)
        if reasons:
            verdicts[nodeid] = {"verdict": "not comparable", "details": reasons}
            continue
        verdicts[nodeid] = _compare_test(before, test, thresholds)
    return verdicts


def summarise(verdicts: dict[str, dict[str, Any]], against: str) -> list[str]:
    """Terminal lines: each regressed test with what regressed, the reasons tests were not compared, the counts."""
    lines: list[str] = []
    counts = {verdict: 0 for verdict in VERDICTS}
    not_comparable: dict[str, int] = {}
    for nodeid, result in verdicts.items():
        verdict = result.get("verdict", "ok")
        counts[verdict] = counts.get(verdict, 0) + 1
        details = [str(d) for d in result.get("details") or []]
        if verdict == "regressed":
            shown = [d[: -len(REGRESSED_TAG)] if d.endswith(REGRESSED_TAG) else d
                     for d in details if REGRESSED_TAG in d] or details
            lines.append(f"REGRESSED {nodeid}: {'; '.join(shown)}")
        elif verdict == "not comparable":
            for reason in details:
                not_comparable[reason] = not_comparable.get(reason, 0) + 1
    for reason, count in not_comparable.items():
        lines.append(f"not comparable ({count} test{'s' if count != 1 else ''}): {reason}")
    counted = ", ".join(f"{counts[v]} {v}" for v in VERDICTS)
    extra = ", ".join(f"{n} {v}" for v, n in counts.items() if v not in VERDICTS)
    lines.append(f"compare: {counted}{', ' + extra if extra else ''} (against {against})")
    return lines
