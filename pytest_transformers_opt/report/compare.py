"""``--opt-compare`` / ``--opt-compare-fail``: this run's report against an earlier one.

The comparison works on two JSON reports (``build_report`` documents), never on live objects, so a
report written last week compares exactly like one written a minute ago. Only the optimized side's
figures (and the run's own speedup, memory ratio and similarity) are compared: they are what a
change to the code, the libraries or the configuration moves.

Thresholds follow pytest-benchmark's ``--benchmark-compare-fail`` style: ``latency:10%`` fails
on a relative worsening of more than 10%, ``kl_mean:0.01`` on an absolute worsening of more than
0.01 (absolute limits are in the report's units: seconds, bytes, tokens per second, nats).

A timed figure is a median over rounds, and two runs' medians differ by noise alone (one slow round
on a shared machine moves a median of five). Where both reports keep the figure's per-round samples,
a threshold on it is judged on them, the way ``min_speedup`` is judged within one run: regressed only
when the medians worsened past the limit **and** a one-sided Mann-Whitney test finds the new rounds
worse than the old ones moved by the limit, at ``verdict.stats.SIGNIFICANCE``. Where the two entries' rounds
were taken in turns (``Sides.paired``: an ``--opt-ab`` row's interleaved sides), round i of one against round i
of the other, the test is a one-sided Wilcoxon signed-rank test of the pairs' differences (log-ratios for a
relative limit) moved by the limit: the machine's noise both rounds of a pair share cancels. Otherwise (no
samples, or too few rounds for any test to reach significance) the medians alone judge, and the detail says so.

A folder of recorded runs (``--opt-compare=DIR``) is judged by ``report.window``, each test against a window of
its runs, with the thresholds, figures and texts defined here.
"""

from __future__ import annotations

import difflib
import math
import re
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..errors import OptConfigError
from ..units import finite_number, format_bytes, format_duration, format_ratio, shown
from ..verdict.stats import (SIGNIFICANCE, mann_whitney_greater, min_p_value, min_signed_rank_p_value,
                              wilcoxon_signed_rank_greater)
from ..verdict.budgets import memory_slack_bytes
from .schema import load_report, read_notes


@dataclass(frozen=True)
class _Metric:
    """Where a figure lives in a report test entry, which way is better, and how to print it."""

    path: tuple[str, ...]
    higher_is_better: bool
    fmt: Callable[[float], str]
    timed: bool = False  # a median over timed rounds: its threshold says which rule judged it
    samples: str | None = None  # the per-round samples beside the figure (same side), when the report keeps them
    # or: the figure is a ratio of two sides' medians, and each round's samples give one ratio (round i of
    # each side taken in turn); a machine that is slower for a whole session slows both alike, so these
    # samples do not move with it
    ratio_of: tuple[str, str] | None = None


def _fmt_throughput(value: float) -> str:
    return f"{value:.1f} tok/s"


def _fmt_kl(value: float) -> str:
    return f"{value:.3g}"


def _fmt_fraction(value: float) -> str:
    return f"{value:.3f}"


METRICS: dict[str, _Metric] = {
    "latency": _Metric(("optimized", "latency_s"), False, format_duration, timed=True, samples="latency_samples_s"),
    "ttft": _Metric(("optimized", "ttft_s"), False, format_duration, timed=True, samples="ttft_samples_s"),
    "tpot": _Metric(("optimized", "tpot_s"), False, format_duration, timed=True, samples="tpot_samples_s"),
    "peak_memory": _Metric(("optimized", "peak_memory_bytes"), False, format_bytes),
    "throughput": _Metric(("optimized", "throughput_tok_s"), True, _fmt_throughput, timed=True,
                          samples="throughput_samples_tok_s"),
    "speedup": _Metric(("speedup",), True, format_ratio, timed=True, ratio_of=("baseline", "optimized")),
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
INCONCLUSIVE = "inconclusive"
"""A window's verdict (``report.window``): it cannot vouch for the test (a worsening past the limit within its runs'
spread, or runs that vary too much for the limit), nor fail it."""

COMPARE_FAIL_FORMS = (
    "comma-separated METRIC:NUMBER% (relative worsening, e.g. latency:10%) or METRIC:NUMBER "
    "(absolute worsening in the report's units, e.g. kl_mean:0.01), with METRIC one of "
    + ", ".join(METRICS)
)

REGRESSED_TAG = ": regressed"
"""Suffix of a detail that is a regression, so ``summarise`` can show only those."""
INCONCLUSIVE_TAG = f": {INCONCLUSIVE}"
"""Suffix of a detail that could not be judged for noise (a window's), so ``summarise`` can show only those."""

SAMPLE_RULE = "mann-whitney"
PAIRED_RULE = "wilcoxon-signed-rank"
SAMPLE_RULES = (SAMPLE_RULE, PAIRED_RULE)
"""The rules that judge a timed threshold on rounds: a p-value, which must be significant."""
MEDIAN_RULE = "median"
NOT_SIGNIFICANT = "not significant"

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


def load_compare_report(path: str, source: str = "--opt-compare", remedy: str = COMPARE_REMEDY) -> dict[str, Any]:
    """The earlier report, read by ``schema.load_report``; a problem names ``source`` (the option, or the
    variable ``PYTEST_OPT_COMPARE`` when the path came from there) and ends with ``remedy``."""
    return load_report(path, source=source, remedy=remedy)


# ---------------------------------------------------------------------------------------------
# comparison


def figure_value(entry: dict[str, Any], metric: str) -> float | None:
    """The metric's value in a test entry; None when absent, null, non-numeric or not finite."""
    value: Any = entry
    for key in METRICS[metric].path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return finite_number(value)


def worsening(metric: str, old: float, new: float, relative: bool) -> float:
    """How much worse ``new`` is than ``old`` (negative: better); percent of ``|old|`` when relative."""
    delta = new - old
    if METRICS[metric].higher_is_better:
        delta = -delta
    if not relative:
        return delta
    if old == 0:
        return 0.0 if delta == 0 else math.copysign(math.inf, delta)
    return 100.0 * delta / abs(old)


def beyond_limit(amount: float, limit: float) -> bool:
    """``amount > limit``, with float rounding at the boundary counted as within."""
    return amount > limit and not math.isclose(amount, limit, rel_tol=_REL_TOL, abs_tol=1e-12)


def signed_text(metric: str, delta: float) -> str:
    """A signed difference in the metric's own format (``+1.5 ms``)."""
    sign = "-" if delta < 0 else "+"
    return sign + METRICS[metric].fmt(abs(delta))


def change_text(metric: str, old: float, new: float) -> str:
    """The change as a percentage of the old value, or as a difference when the old value is 0."""
    if old == 0:
        return "no change" if new == 0 else f"{signed_text(metric, new - old)} from 0"
    return f"{100.0 * (new - old) / abs(old):+.1f}%"


def limit_text(threshold: Threshold) -> str:
    """The limit in the direction that counts as worse: ``10%`` for lower-is-better, ``-10%`` otherwise."""
    return size_text(threshold, threshold.limit, "g")


def size_text(threshold: Threshold, amount: float, number_format: str = ".3g") -> str:
    """A worsening of ``amount`` in the threshold's terms and direction: ``12.5%``, ``-12.5%``, ``+1.50 ms``."""
    down = METRICS[threshold.metric].higher_is_better
    if threshold.relative:
        return f"{'-' if down else ''}{amount:{number_format}}%"
    return f"{'-' if down else '+'}{METRICS[threshold.metric].fmt(amount)}"


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


def _arguments_text(arguments: Any) -> str:
    """``num_hidden_layers=1, trust_remote_code=True`` from a model's ``arguments``; ``none`` when empty."""
    if not isinstance(arguments, dict) or not arguments:
        return "none"
    flat: dict[str, Any] = {}
    for key, value in arguments.items():
        if isinstance(value, dict):  # from_pretrained_kwargs: each keyword as written
            flat.update({str(k): v for k, v in value.items()})
        else:
            flat[str(key)] = value
    return ", ".join(f"{key}={value}" for key, value in sorted(flat.items()))


_WORKLOAD_KEYS = ("num_prompts", "max_new_tokens", "batch_size", "input_tokens")


def measurement_missing(entry: dict[str, Any], side: str) -> str | None:
    """``no measurement in the {side} run (skipped: ...)`` when the entry has no optimized figures, else None."""
    if isinstance(entry.get("optimized"), dict):
        return None
    why = entry.get("outcome") or "no record"
    if entry.get("skip_reason"):
        why += f": {entry['skip_reason']}"
    elif str(entry.get("error") or "").strip():
        why += f": {str(entry['error']).strip().splitlines()[-1][:120]}"
    return f"no measurement in the {side} run ({why})"


def test_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Why this one test's figures are not comparable: no measurement, another model or workload."""
    reasons = [reason for side, entry in (("old", old), ("new", new))
               if (reason := measurement_missing(entry, side)) is not None]
    if reasons:
        return reasons
    old_model, new_model = old.get("model") or {}, new.get("model") or {}
    for key in ("name_or_path", "revision", "dtype"):
        if old_model.get(key) != new_model.get(key):
            reasons.append(f"different model: {key} {shown(old_model.get(key))} -> {shown(new_model.get(key))}")
    # every other argument that changes the loaded model; none recorded is a plain model
    old_arguments, new_arguments = old_model.get("arguments") or {}, new_model.get("arguments") or {}
    if old_arguments != new_arguments:
        reasons.append(f"different model: arguments {_arguments_text(old_arguments)} -> "
                       f"{_arguments_text(new_arguments)}")
    old_work, new_work = old.get("workload") or {}, new.get("workload") or {}
    for key in _WORKLOAD_KEYS:
        if key == "input_tokens" and (key not in old_work or key not in new_work):
            continue  # only compared when both reports recorded it
        if old_work.get(key) != new_work.get(key):
            reasons.append(f"different workload: {key} {shown(old_work.get(key))} -> {shown(new_work.get(key))}")
    return reasons


def round_samples(entry: dict[str, Any], metric: str) -> list[float] | None:
    """The metric's per-round samples in a test entry; None when the report keeps none, or any is not a finite number."""
    key = METRICS[metric].samples
    side: Any = entry
    for step in METRICS[metric].path[:-1]:
        side = side.get(step) if isinstance(side, dict) else None
    return _finite(side.get(key) if key is not None and isinstance(side, dict) else None)


def _latency_samples(entry: dict[str, Any], side: str) -> list[float] | None:
    """One side's latency rounds, when they are finite and give that side's median latency (an edited report's
    do not: trust neither)."""
    part = entry.get(side)
    if not isinstance(part, dict):
        return None
    samples, median = _finite(part.get("latency_samples_s")), part.get("latency_s")
    if samples is None or isinstance(median, bool) or not isinstance(median, (int, float)):
        return None
    return samples if math.isclose(statistics.median(samples), median, rel_tol=1e-6, abs_tol=1e-12) else None


def _ratio_samples(entry: dict[str, Any], metric: str) -> tuple[list[float] | None, str | None]:
    """(per-round ratios numerator_i / denominator_i, why there are none) of a ratio metric."""
    numerator, denominator = METRICS[metric].ratio_of or ("", "")
    top, bottom = _latency_samples(entry, numerator), _latency_samples(entry, denominator)
    if top is None or bottom is None:
        return None, "keeps no per-round latency samples that give both sides' medians"
    if len(top) != len(bottom) or not all(bottom):
        return None, "has unequal or zero rounds on the two sides"
    return [t / b for t, b in zip(top, bottom)], None


def _every_round(entry: dict[str, Any], metric: str, samples: list[float]) -> bool:
    """The metric's samples hold one value for every round its side ran (``rounds``), so sample i is round i.
    TTFT, TPOT and throughput keep only the rounds that measured them: with one missing, which is unknown."""
    side: Any = entry
    for step in METRICS[metric].path[:-1]:
        side = side.get(step) if isinstance(side, dict) else None
    count = side.get("rounds") if isinstance(side, dict) else None
    return isinstance(count, int) and not isinstance(count, bool) and count == len(samples)


def _finite(values: Any) -> list[float] | None:
    """``values`` as floats: None unless a non-empty list of finite numbers."""
    if not isinstance(values, list) or not values:
        return None
    samples = [finite_number(value) for value in values]
    return None if None in samples else [s for s in samples if s is not None]


@dataclass(frozen=True)
class Sides:
    """What a verdict's details call its two entries: an earlier and this report (``--opt-compare``), or
    the reference environment and this one (``--opt-ab``): ``the {old} run``, ``the {new} {record}``.

    ``paired``: the two entries' rounds were taken in turns on one machine (round i of each next to the
    other), so a timed threshold is judged on the pairs where both keep every round, as many on each side."""

    old: str = "old"
    new: str = "new"
    record: str = "report"
    paired: bool = False


REPORTS = Sides()


@dataclass(frozen=True)
class _Rule:
    """How one timed threshold is judged: on both runs' rounds (the p-values), or on the medians alone (and why)."""

    name: str  # SAMPLE_RULE, PAIRED_RULE or MEDIAN_RULE
    why: str | None = None  # the median rule's reason
    p_worse: float = 1.0  # one-sided: the new rounds are worse than the old ones moved by the limit
    p_better: float = 1.0  # one-sided: the new rounds are better than the old ones moved by the limit
    rounds: tuple[int, int] | None = None  # (old, new)


def sample_rule_text(rule: str, p_value: float, rounds: Sequence[int] | None) -> str:
    """How a sample rule judged: ``Mann-Whitney p=0.0011 on 6+6 rounds``, ``Wilcoxon signed-rank p=0.002 on 10
    pairs``."""
    if rule == PAIRED_RULE:
        return f"Wilcoxon signed-rank p={p_value:.2g}" + (f" on {rounds[0]} pairs" if rounds else "")
    return f"Mann-Whitney p={p_value:.2g}" + (f" on {rounds[0]}+{rounds[1]} rounds" if rounds else "")


def _moved(samples: list[float], threshold: Threshold, direction: int) -> list[float]:
    """The old rounds moved by the limit, up (+1) or down (-1): what the new rounds are tested against."""
    if threshold.relative:
        return [v + direction * abs(v) * threshold.limit / 100.0 for v in samples]
    return [v + direction * threshold.limit for v in samples]


def _rule(threshold: Threshold, old_entry: dict[str, Any], new_entry: dict[str, Any], old: float, new: float,
          sides: Sides = REPORTS) -> _Rule:
    """The sample rule where both reports keep rounds that can reach significance (on their pairs where ``sides``
    are paired and the rounds are, else unpaired); else the median rule and why."""
    metric = threshold.metric
    if threshold.relative and old == 0:
        return _Rule(MEDIAN_RULE, f"the {sides.old} median is 0")
    rounds: dict[str, list[float]] = {}
    aligned = sides.paired and METRICS[metric].ratio_of is None  # a ratio's rounds are already each run's pairs
    for side, entry, figure in ((sides.old, old_entry, old), (sides.new, new_entry, new)):
        if METRICS[metric].ratio_of is not None:
            ratios, why = _ratio_samples(entry, metric)
            if ratios is None:
                return _Rule(MEDIAN_RULE, f"the {side} {sides.record} {why}")
            rounds[side] = ratios
            continue
        samples = round_samples(entry, metric)
        if samples is None:
            return _Rule(MEDIAN_RULE, f"the {side} {sides.record} keeps no per-round {metric} samples")
        # samples that do not give the figure describe something else (an edited report): trust neither
        if not math.isclose(statistics.median(samples), figure, rel_tol=1e-6, abs_tol=1e-12):
            return _Rule(MEDIAN_RULE, f"the {side} {sides.record}'s {metric} samples do not give its median")
        rounds[side] = samples
        aligned = aligned and _every_round(entry, metric, samples)
    before, after = rounds[sides.old], rounds[sides.new]
    # fewer than 5 pairs cannot reach significance on their signs; 4+4 unpaired rounds still can
    if aligned and len(before) == len(after) and min_signed_rank_p_value(len(before)) < SIGNIFICANCE:
        differences = _paired_differences(threshold, before, after)
        if differences is not None:
            up, down = (wilcoxon_signed_rank_greater(d) for d in differences)
            return _directed(PAIRED_RULE, metric, up, down, (len(before), len(after)))
    if min_p_value(len(after), len(before)) >= SIGNIFICANCE:
        return _Rule(MEDIAN_RULE, f"too few rounds ({len(before)}+{len(after)}) for a significance test")
    p_up = mann_whitney_greater(after, _moved(before, threshold, +1))
    p_down = mann_whitney_greater(_moved(before, threshold, -1), after)
    return _directed(SAMPLE_RULE, metric, p_up, p_down, (len(before), len(after)))


def _directed(name: str, metric: str, p_up: float, p_down: float, rounds: tuple[int, int]) -> _Rule:
    """A sample rule from its one-sided p-values, up (the new rounds above the old ones moved up by the limit)
    and down, worse and better in the metric's direction."""
    worse, better = (p_down, p_up) if METRICS[metric].higher_is_better else (p_up, p_down)
    return _Rule(name, p_worse=worse, p_better=better, rounds=rounds)


def _paired_differences(threshold: Threshold, before: list[float], after: list[float]
                        ) -> tuple[list[float], list[float]] | None:
    """Per pair (round i of each side), the new round above the old one moved up by the limit, and the old one
    moved down below the new one: what ``_moved`` tests unpaired. In logs for a relative limit, so that a
    slowdown of the whole machine scales a pair without moving its difference; None where a value is not
    positive (no log: the unpaired rule judges)."""
    up_moved, down_moved = _moved(before, threshold, +1), _moved(before, threshold, -1)
    if not threshold.relative:
        return [n - o for n, o in zip(after, up_moved)], [o - n for n, o in zip(after, down_moved)]
    if min(*before, *after, *down_moved) <= 0:
        return None
    return ([math.log(n) - math.log(o) for n, o in zip(after, up_moved)],
            [math.log(o) - math.log(n) for n, o in zip(after, down_moved)])


def judge_threshold(threshold: Threshold, old_entry: dict[str, Any], new_entry: dict[str, Any], sides: Sides = REPORTS
           ) -> tuple[str, str | None, dict[str, Any] | None]:
    """(``regressed`` | ``improved`` | ``ok``, detail, judged record or None) for one threshold on one test.

    The record (timed metrics only) is what the report's ``judged`` list keeps: both medians, the ratio,
    the rule, its p-value and the verdict."""
    metric, fmt = threshold.metric, METRICS[threshold.metric].fmt
    old, new = figure_value(old_entry, metric), figure_value(new_entry, metric)
    if old is not None and new is None:
        return "regressed", f"{metric} {fmt(old)} -> not measured: missing in the {sides.new} run{REGRESSED_TAG}", None
    if old is None and new is None:
        return "ok", f"{metric} not measured in either run", None
    if old is None:
        assert new is not None
        return "ok", f"{metric} not measured in the {sides.old} run ({sides.new}: {fmt(new)})", None
    assert new is not None
    amount = worsening(metric, old, new, threshold.relative)
    worse, better = beyond_limit(amount, threshold.limit), beyond_limit(-amount, threshold.limit)
    rule = _rule(threshold, old_entry, new_entry, old, new, sides) if METRICS[metric].timed else None
    slack_note = None
    if rule is not None and rule.name in SAMPLE_RULES:  # the medians must move past the limit, and significantly
        significant_worse, significant_better = rule.p_worse < SIGNIFICANCE, rule.p_better < SIGNIFICANCE
    elif metric == "peak_memory":  # one reading a side: a change counts past the memory budgets' measurement slack
        slack = memory_slack_bytes(old)
        significant_worse = significant_better = abs(new - old) > slack
        if (worse or better) and not significant_worse:
            slack_note = f"within the {format_bytes(slack)} measurement slack"
    else:
        significant_worse = significant_better = True
    verdict = ("regressed" if worse and significant_worse else "improved" if better and significant_better else "ok")
    change = change_text(metric, old, new) if threshold.relative else signed_text(metric, new - old)
    detail = f"{metric} {fmt(old)} -> {fmt(new)} ({change}, limit {limit_text(threshold)}" + \
        (f"; {slack_note}" if slack_note else "") + ")"
    record = None
    if rule is not None:
        ratio = new / old if old != 0 else None
        p_value = None
        note = rule.why
        if rule.name in SAMPLE_RULES:
            p_value = rule.p_worse if amount >= 0 else rule.p_better
            rule_text = sample_rule_text(rule.name, p_value, rule.rounds)
            if verdict == "ok" and (worse or better):
                note = NOT_SIGNIFICANT
                # only a possible regression is "within noise"; an improvement that did not reach
                # significance says so in its own words
                rule_text += f", {NOT_SIGNIFICANT}" if worse else f", {NOT_SIGNIFICANT} (an improvement)"
        else:
            rule_text = f"median rule: {rule.why}"
        detail += (f", ratio {format_ratio(ratio)}" if ratio is not None else "") + f", {rule_text}"
        record = {"metric": metric, "threshold": threshold.describe(), "old": old, "new": new, "ratio": ratio,
                  "rule": rule.name, "p_value": p_value, "rounds": list(rule.rounds) if rule.rounds else None,
                  "note": note, "verdict": verdict}
    if verdict == "regressed":
        if threshold.relative and old == 0:
            detail += f" (a relative limit cannot hold from 0; use an absolute one, e.g. {metric}:0.01)"
        detail += REGRESSED_TAG
    elif verdict == "improved":
        detail += ": improved"
    elif record is not None:
        detail += ": ok"
    return verdict, detail, record


def compare_test(old: dict[str, Any], new: dict[str, Any], thresholds: list[Threshold], sides: Sides = REPORTS
                  ) -> dict[str, Any]:
    details: list[str] = []
    judged: list[dict[str, Any]] = []
    regressed = improved = False
    for threshold in thresholds:
        verdict, detail, record = judge_threshold(threshold, old, new, sides)
        regressed |= verdict == "regressed"
        improved |= verdict == "improved"
        if detail:
            details.append(detail)
        if record is not None:
            judged.append(record)
    gated = {t.metric for t in thresholds}
    for metric in INFORMATIONAL_METRICS:
        if metric in gated:
            continue
        before, after = figure_value(old, metric), figure_value(new, metric)
        if before is not None and after is not None:
            fmt = METRICS[metric].fmt
            details.append(f"{metric} {fmt(before)} -> {fmt(after)} ({change_text(metric, before, after)})")
    if list(old.get("techniques") or []) != list(new.get("techniques") or []):
        details.append(f"techniques changed: {old.get('techniques')} -> {new.get('techniques')}")
    if list(old.get("baseline_techniques") or []) != list(new.get("baseline_techniques") or []):
        details.append(f"baseline changed: {old.get('baseline_techniques')} -> {new.get('baseline_techniques')}")
    verdict = "regressed" if regressed else "improved" if improved else "ok"
    result: dict[str, Any] = {"verdict": verdict, "details": details}
    if judged:
        result["judged"] = judged
    return result


def row_environment(report: Mapping[str, Any], test: dict[str, Any]) -> dict[str, Any]:
    """The environment a row was measured in: its shard's in a merged report, else the report's own."""
    shards, index = report.get("shards"), test.get("shard")
    if isinstance(shards, list) and isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(shards):
        environment = shards[index].get("environment") if isinstance(shards[index], dict) else None
        if isinstance(environment, dict):
            return environment
    environment = report.get("environment")
    return environment if isinstance(environment, dict) else {}


def row_hardware(test: dict[str, Any], environment: dict[str, Any]) -> str | None:
    """A row's hardware fingerprint: its own ``hardware``, else its run's ``environment.hardware``; None
    for a report written before the plugin kept either (then the run-wide device and GPU are compared)."""
    for value in (test.get("hardware"), environment.get("hardware")):
        if isinstance(value, str) and value:
            return value
    return None


def hardware_differences(old: dict[str, Any], old_env: dict[str, Any], new: dict[str, Any],
                          new_env: dict[str, Any]) -> list[str]:
    """Why two rows were measured on different hardware: by fingerprint where both rows know theirs."""
    before, after = row_hardware(old, old_env), row_hardware(new, new_env)
    if before is not None and after is not None:
        return [] if before == after else [f"measured on different hardware: {shown(before)} -> {shown(after)}"]
    return _identity_differences({"environment": old_env}, {"environment": new_env})


def verdict_keys(report: dict[str, Any]) -> list[str | None]:
    """The key of each test row's verdict, in row order (None for a row without a node id): the node id,
    or ``NODEID on HARDWARE`` where a merged report holds the node id on more than one hardware."""
    tests = [t if isinstance(t, dict) and isinstance(t.get("nodeid"), str) else None for t in report.get("tests") or []]
    counts: dict[str, int] = {}
    for test in tests:
        if test is not None:
            counts[test["nodeid"]] = counts.get(test["nodeid"], 0) + 1
    keys: list[str | None] = []
    for test in tests:
        if test is None:
            keys.append(None)
        elif counts[test["nodeid"]] > 1:
            keys.append(f"{test['nodeid']} on {row_hardware(test, row_environment(report, test))}")
        else:
            keys.append(test["nodeid"])
    return keys


def attach_verdicts(report: dict[str, Any], verdicts: dict[str, dict[str, Any]]) -> None:
    """Write each row's verdict into its ``regression`` (what ``--opt-compare`` keeps in the report)."""
    for test, key in zip(report.get("tests") or [], verdict_keys(report)):
        if key is not None:
            test["regression"] = verdicts.get(key)


def compare_reports(old: dict[str, Any], new: dict[str, Any], thresholds: list[Threshold]) -> dict[str, dict[str, Any]]:
    """A verdict per test of the ``new`` report: regressed, improved, ok, new or not comparable.

    Only a threshold can make a test regress (informational figures never do), and only figures
    measured on the same hardware, model and workload are compared at all: comparing anything
    else would make the gate fail, or pass, for reasons that have nothing to do with the change.

    Either report may be merged (``pytest-opt merge``): old rows are found by node id and, where one
    node id was measured on several hardware, by the new row's hardware fingerprint. Hardware is
    checked per row (by fingerprint where both rows carry one, else by the rows' environments).
    Verdicts are keyed as ``verdict_keys`` says: by node id, unless a node id repeats in ``new``.
    """
    old_rows: dict[str, list[dict[str, Any]]] = {}
    for test in old.get("tests") or []:
        if isinstance(test, dict) and isinstance(test.get("nodeid"), str):
            old_rows.setdefault(test["nodeid"], []).append(test)
    verdicts: dict[str, dict[str, Any]] = {}
    for test, key in zip(new.get("tests") or [], verdict_keys(new)):
        if key is None:
            continue
        candidates = old_rows.get(test["nodeid"])
        if not candidates:
            verdicts[key] = {"verdict": "new", "details": ["not in the old report"]}
            continue
        new_env = row_environment(new, test)
        hardware = row_hardware(test, new_env)
        before = candidates[0]
        if len(candidates) > 1:  # a merged old report: the row of this row's own hardware
            same = [c for c in candidates if row_hardware(c, row_environment(old, c)) == hardware]
            if not same:
                measured = ", ".join(shown(row_hardware(c, row_environment(old, c))) for c in candidates)
                verdicts[key] = {"verdict": "not comparable",
                                 "details": [f"measured on different hardware: {measured} -> {shown(hardware)}"]}
                continue
            before = same[0]
        reasons = (hardware_differences(before, row_environment(old, before), test, new_env)
                   + test_differences(before, test))
        if reasons:
            verdicts[key] = {"verdict": "not comparable", "details": reasons}
            continue
        verdicts[key] = compare_test(before, test, thresholds)
    return verdicts


def _tests(count: int) -> str:
    return f"{count} test{'s' if count != 1 else ''}"


_REASONS_SHOWN = 3  # of a gate that judged nothing: the line stays readable

JUDGED_VERDICTS: tuple[str, ...] = ("regressed", "improved", "ok", INCONCLUSIVE)
"""Verdicts that compared figures (an inconclusive one did, and says how large a change it could have seen);
``new`` and ``not comparable`` rows judged nothing."""


def nothing_judged(verdicts: dict[str, dict[str, Any]]) -> str | None:
    """Why a gate judged no test at all (every row new or not comparable, or no row), or None when one was.

    A gate that judged nothing must not pass: a run whose GPU changed, or whose measured tests all skip
    now, would otherwise pass every threshold unseen."""
    if any(result.get("verdict") in JUDGED_VERDICTS for result in verdicts.values()):
        return None
    if not verdicts:
        return "the run has no test to compare"
    reasons: dict[str, int] = {}
    for result in verdicts.values():
        if result.get("verdict") == "new":
            reasons["not in the old report"] = reasons.get("not in the old report", 0) + 1
            continue
        for reason in [str(d) for d in result.get("details") or []][:1] or ["no reason given"]:
            reasons[reason] = reasons.get(reason, 0) + 1
    shown_reasons = [f"{_tests(count)}: {reason}" for reason, count in reasons.items()]
    if len(shown_reasons) > _REASONS_SHOWN:
        shown_reasons[_REASONS_SHOWN:] = [f"{len(shown_reasons) - _REASONS_SHOWN} more reasons"]
    return f"no test could be judged ({'; '.join(shown_reasons)})"


def _tagged(details: list[str], tag: str) -> list[str]:
    """The details that end in ``tag`` (a verdict's own), without it."""
    return [d[: -len(tag)] for d in details if d.endswith(tag)]


def summarise(verdicts: dict[str, dict[str, Any]], against: str, old: dict[str, Any] | None = None,
              order: tuple[str, ...] = VERDICTS) -> list[str]:
    """Terminal lines: what the reader ignored in the ``old`` report (written by another version); each
    regressed test with what regressed; each inconclusive test (a window's) with what could not be judged;
    each timed figure whose medians moved past the limit towards worse but not significantly (``within
    noise``); the tests the median rule judged, and why; the reasons tests were not compared; the counts,
    of every verdict in ``order``."""
    lines: list[str] = [f"note: {note}" for note in read_notes(old)]
    counts = {verdict: 0 for verdict in order}
    not_comparable: dict[str, int] = {}
    median_rule: dict[str, int] = {}
    noise_tag = f", {NOT_SIGNIFICANT}: ok"
    for nodeid, result in verdicts.items():
        verdict = result.get("verdict", "ok")
        counts[verdict] = counts.get(verdict, 0) + 1
        details = [str(d) for d in result.get("details") or []]
        if verdict == "regressed":
            shown = [d[: -len(REGRESSED_TAG)] if d.endswith(REGRESSED_TAG) else d
                     for d in details if REGRESSED_TAG in d] or details
            lines.append(f"REGRESSED {nodeid}: {'; '.join(shown)}")
        elif verdict == INCONCLUSIVE:
            lines.append(f"INCONCLUSIVE {nodeid}: {'; '.join(_tagged(details, INCONCLUSIVE_TAG) or details)}")
        elif verdict == "not comparable":
            for reason in details:
                not_comparable[reason] = not_comparable.get(reason, 0) + 1
        noise = [d[: -len(": ok")] for d in details if d.endswith(noise_tag)]
        if noise:
            lines.append(f"within noise {nodeid}: {'; '.join(noise)}")
        for record in result.get("judged") or []:
            if isinstance(record, dict) and record.get("rule") == MEDIAN_RULE:
                why = f"{record.get('metric')}: {record.get('note')}"
                median_rule[why] = median_rule.get(why, 0) + 1
    for why, count in median_rule.items():
        lines.append(f"median rule ({_tests(count)}): {why}")
    for reason, count in not_comparable.items():
        lines.append(f"not comparable ({_tests(count)}): {reason}")
    counted = ", ".join(f"{counts[v]} {v}" for v in order)
    extra = ", ".join(f"{n} {v}" for v, n in counts.items() if v not in order)
    lines.append(f"compare: {counted}{', ' + extra if extra else ''} (against {against})")
    return lines
