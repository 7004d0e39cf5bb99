"""``--opt-compare`` / ``--opt-compare-fail``: this run's report against an earlier one.

The comparison works on two JSON reports (``build_report`` documents), never on live objects, so a
report written last week compares exactly like one written a minute ago. Only the optimized side's
figures (and the run's own speedup, memory ratio and similarity) are compared: they are what a
change to the code, the libraries or the configuration moves.

Thresholds follow pytest-benchmark's ``--benchmark-compare-fail`` style: ``latency:10%`` fails
on a relative worsening of more than 10%, ``kl_mean:0.01`` on an absolute worsening of more than
0.01 (absolute limits are in the report's units: seconds, bytes, tokens per second, nats).

A timed figure is a median over rounds, and two runs' medians differ by more than their rounds' spread: two jobs
differ in process layout and in the machine's state that day. Where both reports keep the figure's per-round
samples, a timed threshold is judged on the evidence both give, by the one judge (``verdict.judge``):

- **two jobs** (``--opt-compare=old.json``, ``pytest-opt merge --compare``): the worsening of the medians, with the
  standard error of each median (its rounds' robust spread) and a between-run term (``Sides.between_run``: the
  device's stated default, ``default_between_run``, unless a recorded history gives this runner's), tested one-sided
  against the limit
  (``between-run``); without rounds, on the medians with the between-run term alone (``median``);
- **one job, rounds in turns** (``Sides.paired``: an ``--opt-ab`` row's interleaved sides): a one-sided Wilcoxon
  signed-rank test of the pairs' differences (log-ratios for a relative limit) moved by the limit, the error from
  the pairs' spread: the machine's noise both rounds of a pair share cancels;
- **one job, rounds in blocks**: a one-sided Mann-Whitney test of the rounds moved by the limit.

Each gives the detectable size (the smallest worsening it would have flagged); ``verdict.judge.decide`` turns the
evidence into ``regressed``, ``improved``, ``inconclusive`` or ``ok``.

A folder of recorded runs (``--opt-compare=DIR``) is judged by ``report.window``, each test against a window of
its runs, with the thresholds, figures and texts defined here.
"""

from __future__ import annotations

import difflib
import math
import re
import statistics
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Callable, Mapping, Sequence

from ..errors import OptConfigError
from ..units import finite_number, format_bytes, format_duration, format_ratio, shown
from .budgets import memory_slack_bytes
from .census_diff import (CENSUS_MAPS, census_amount, census_cause, census_changes, census_value, map_changes, shortened,
                          side_census)
from .judge import (IMPROVED, INCONCLUSIVE, NEW, NOT_COMPARABLE, OK, REGRESSED, beyond_limit,
                    decide, decide_exact, detectable_size, is_judged, new_row, not_comparable, worst)
from .stats import (SIGNIFICANCE, mann_whitney_greater, min_p_value, min_signed_rank_p_value,
                    new_run_degrees_of_freedom, robust_spread, student_t_isf, wilcoxon_signed_rank_greater)


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
    census: bool = False  # a count of the execution census (verdict.census_diff): compared exactly


def _fmt_throughput(value: float) -> str:
    return f"{value:.1f} tok/s"


def _fmt_kl(value: float) -> str:
    return f"{value:.3g}"


def _fmt_fraction(value: float) -> str:
    return f"{value:.3f}"


def _fmt_count(value: float) -> str:
    return f"{value:g}"


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
    "ops": _Metric(("census", "optimized", "ops_total"), False, _fmt_count, census=True),
    "graph_breaks": _Metric(("census", "optimized", "graph_breaks"), False, _fmt_count, census=True),
    "recompiles": _Metric(("census", "optimized", "recompiles"), False, _fmt_count, census=True),
    "kernels": _Metric(("census", "optimized", "kernels_total"), False, _fmt_count, census=True),
    "syncs": _Metric(("census", "optimized", "syncs"), False, _fmt_count, census=True),
}
"""Every metric a threshold may name (lower is better unless ``higher_is_better``)."""

INFORMATIONAL_METRICS: tuple[str, ...] = ("latency", "peak_memory", "throughput", "kl_mean", "top1")
"""Metrics listed in the details even without a threshold (kept short on purpose)."""

VERDICTS: tuple[str, ...] = (REGRESSED, INCONCLUSIVE, IMPROVED, OK, NEW, NOT_COMPARABLE)
"""The verdicts of a one-report compare, in the order its summary line counts them."""

COMPARE_FAIL_FORMS = (
    "comma-separated METRIC:NUMBER% (relative worsening, e.g. latency:10%) or METRIC:NUMBER "
    "(absolute worsening in the report's units, e.g. kl_mean:0.01; a census count: ops:0 fails on any change), "
    "with METRIC one of "
    + ", ".join(METRICS)
)

REGRESSED_TAG = f": {REGRESSED}"
"""Suffix of a detail that is a regression, so a summary can show only those."""
INCONCLUSIVE_TAG = f": {INCONCLUSIVE}"
"""Suffix of a detail that could not be judged for noise, so a summary can show only those."""
IMPROVED_TAG = f": {IMPROVED}"
OK_TAG = f": {OK}"

SAMPLE_RULE = "mann-whitney"
PAIRED_RULE = "wilcoxon-signed-rank"
BETWEEN_RUN_RULE = "between-run"
SAMPLE_RULES = (SAMPLE_RULE, PAIRED_RULE, BETWEEN_RUN_RULE)
"""The rules that judge a timed threshold on rounds: a p-value, which must be significant."""
MEDIAN_RULE = "median"
NOT_SIGNIFICANT = "not significant"

_NUMBER = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?", re.ASCII)


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


def _techniques_text(techniques: list[Any]) -> str:
    return " + ".join(str(t) for t in techniques) or "none"


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
    for key, what in (("techniques", "techniques"), ("baseline_techniques", "baseline")):
        before, after = list(old.get(key) or []), list(new.get(key) or [])
        if before != after:  # another configuration under the same test id: its figures say nothing of this one
            reasons.append(f"{what} changed ({_techniques_text(before)} -> {_techniques_text(after)})")
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
class BetweenRun:
    """How far one job's median strays from a runner's long-run level beyond what its own rounds show (percent of
    the figure: process layout, the machine's state that day), for a side's own timed figure (latency, TTFT, TPOT,
    throughput) and for a ratio of two sides timed in turns within the job (speedup: the machine's drift
    cancels), and where the figures came from."""

    figure_pct: float
    ratio_pct: float
    source: str

    def pct(self, metric: str) -> float:
        return self.ratio_pct if METRICS[metric].ratio_of is not None else self.figure_pct


CPU_BETWEEN_RUN = BetweenRun(10.0, 3.0, "the CPU default between runs (10% a figure, 3% a speedup)")
"""Measured on this project's 2-core CPU runner (benchmarks/compare_study.py, benchmarks/RESULTS.md, issue 40): a
tiny model's median latency strays 8-8.5% (robust spread) from session to session, quiet or beside a busy
neighbour, its in-session speedup 1.8-2.4%; 10% is the smallest term that kept the null false rate at 0 of 19-20
session pairs in all three conditions measured (quiet, busy, a quiet run against a busy one), where 8% failed 2 of
20 of the last."""
GPU_BETWEEN_RUN = BetweenRun(4.0, 2.0, "the GPU default between runs (4% a figure, 2% a speedup; not yet measured "
                                       "on a GPU: record a history to use your runner's own)")
"""Stated, not measured: a dedicated GPU runner's rounds vary by about 1% (the device checks), its sessions by more;
at 4% two jobs can vouch for a 10% limit (detectable 10 + 1.645 x 5.7 = 19.3%, under twice the limit)."""


def default_between_run(environment: Mapping[str, Any]) -> BetweenRun:
    """The stated between-run term for reports measured on ``environment``'s device."""
    return CPU_BETWEEN_RUN if str(environment.get("device") or "cpu").startswith("cpu") else GPU_BETWEEN_RUN


@dataclass(frozen=True)
class Sides:
    """What a verdict's details call its two entries: an earlier and this report (``--opt-compare``), or
    the reference environment and this one (``--opt-ab``): ``the {old} run``, ``the {new} {record}``.

    ``paired``: the two entries' rounds were taken in turns on one machine (round i of each next to the
    other), so a timed threshold is judged on the pairs where both keep every round, as many on each side.

    ``between_run``: the two entries come from two jobs, whose medians differ by more than their rounds show; None
    when both were measured in one job (the A/B)."""

    old: str = "old"
    new: str = "new"
    record: str = "report"
    paired: bool = False
    between_run: BetweenRun | None = None


REPORTS = Sides(between_run=CPU_BETWEEN_RUN)
"""Two reports of a CPU runner; ``compare_reports`` picks each row's default by its device."""


MIN_SPREAD_ROUNDS = 3  # a robust spread of two rounds is one difference: too little to weigh a median by
_NORMAL_CRITICAL = NormalDist().inv_cdf(1.0 - SIGNIFICANCE)


@dataclass(frozen=True)
class _Rule:
    """How one timed threshold is judged: the one-sided p-values that the new side is worse (better) than the
    limit allows, and the standard error of the worsening (``scale``, in the threshold's terms) with the
    critical value that turns it into the detectable size; ``why`` where the rounds could not be used."""

    name: str  # SAMPLE_RULE, PAIRED_RULE, BETWEEN_RUN_RULE or MEDIAN_RULE
    why: str | None = None
    p_worse: float = 1.0
    p_better: float = 1.0
    rounds: tuple[int, int] | None = None  # (old, new)
    scale: float = math.inf
    critical: float = _NORMAL_CRITICAL

    def detectable(self, limit: float) -> float:
        return detectable_size(limit, self.critical, self.scale)


def sample_rule_text(rule: str, p_value: float, rounds: Sequence[int] | None) -> str:
    """How a sample rule judged: ``Mann-Whitney p=0.0011 on 6+6 rounds``, ``Wilcoxon signed-rank p=0.002 on 10
    pairs``, ``between-run p=0.21 on 6+6 rounds``."""
    if rule == PAIRED_RULE:
        return f"Wilcoxon signed-rank p={p_value:.2g}" + (f" on {rounds[0]} pairs" if rounds else "")
    name = "between-run" if rule == BETWEEN_RUN_RULE else "Mann-Whitney"
    return f"{name} p={p_value:.2g}" + (f" on {rounds[0]}+{rounds[1]} rounds" if rounds else "")


def _moved(samples: list[float], threshold: Threshold, direction: int) -> list[float]:
    """The old rounds moved by the limit, up (+1) or down (-1): what the new rounds are tested against."""
    if threshold.relative:
        return [v + direction * abs(v) * threshold.limit / 100.0 for v in samples]
    return [v + direction * threshold.limit for v in samples]


def _median_error(samples: list[float], threshold: Threshold, base: float) -> float:
    """The standard error of the samples' median (pi / 2 / n of their robust variance), in the threshold's terms:
    percent of ``base`` (the old figure) when relative."""
    spread = robust_spread(samples)[1] * math.sqrt(math.pi / (2.0 * len(samples)))
    return 100.0 * spread / abs(base) if threshold.relative else spread


def _between_run_error(threshold: Threshold, sides: Sides, base: float) -> float:
    """The between-run term of two jobs' difference (sqrt 2 times one run's), in the threshold's terms; 0 in one job."""
    if sides.between_run is None:
        return 0.0
    pct = sides.between_run.pct(threshold.metric)
    one_run = pct if threshold.relative else pct * abs(base) / 100.0
    return math.sqrt(2.0) * one_run


def _degrees_critical(pairs: int) -> float:
    """The one-sided critical value of a median-and-MAD error from ``pairs`` values (``stats.new_run_degrees_of_
    freedom``: a MAD carries fewer degrees of freedom than a standard deviation)."""
    return student_t_isf(SIGNIFICANCE, max(new_run_degrees_of_freedom(pairs), 0.5))


def _rule(threshold: Threshold, old_entry: dict[str, Any], new_entry: dict[str, Any], old: float, new: float,
          sides: Sides = REPORTS) -> _Rule:
    """The evidence on one timed threshold: on the pairs where ``sides`` are paired and the rounds are (Wilcoxon
    signed-rank), on both jobs' rounds and the between-run term where the sides are two jobs, on the rounds alone
    (Mann-Whitney) in one job's blocks; else the median rule (the between-run term alone, or no error known)."""
    metric = threshold.metric
    between = _between_run_error(threshold, sides, old)
    if threshold.relative and old == 0:
        return _Rule(MEDIAN_RULE, f"the {sides.old} median is 0")
    rounds: dict[str, list[float]] = {}
    why = None
    aligned = sides.paired and METRICS[metric].ratio_of is None  # a ratio's rounds are already each run's pairs
    for side, entry, figure in ((sides.old, old_entry, old), (sides.new, new_entry, new)):
        if METRICS[metric].ratio_of is not None:
            ratios, missing = _ratio_samples(entry, metric)
            if ratios is None:
                why = f"the {side} {sides.record} {missing}"
                break
            rounds[side] = ratios
            continue
        samples = round_samples(entry, metric)
        if samples is None:
            why = f"the {side} {sides.record} keeps no per-round {metric} samples"
            break
        # samples that do not give the figure describe something else (an edited report): trust neither
        if not math.isclose(statistics.median(samples), figure, rel_tol=1e-6, abs_tol=1e-12):
            why = f"the {side} {sides.record}'s {metric} samples do not give its median"
            break
        rounds[side] = samples
        aligned = aligned and _every_round(entry, metric, samples)
    if why is None and sides.between_run is not None and min(len(r) for r in rounds.values()) < MIN_SPREAD_ROUNDS:
        why = f"too few rounds ({len(rounds[sides.old])}+{len(rounds[sides.new])}) for a spread"
    if why is not None:
        return _median_rule(threshold, old, new, between, why)
    before, after = rounds[sides.old], rounds[sides.new]
    counts = (len(before), len(after))
    # fewer than 5 pairs cannot reach significance on their signs
    if aligned and len(before) == len(after) and min_signed_rank_p_value(len(before)) < SIGNIFICANCE:
        differences = _paired_differences(threshold, before, after)
        if differences is not None:
            up, down = (wilcoxon_signed_rank_greater(d) for d in differences)
            spread = _paired_error(threshold, before, after)
            return _directed(PAIRED_RULE, metric, up, down, counts, spread, _degrees_critical(len(before)))
    within = math.hypot(_median_error(before, threshold, old), _median_error(after, threshold, old))
    if sides.between_run is not None:  # two jobs: their rounds' error and the runs' own
        scale = math.hypot(within, between)
        amount = worsening(metric, old, new, threshold.relative)
        return _Rule(BETWEEN_RUN_RULE, p_worse=_beyond_p(amount, threshold.limit, scale),
                     p_better=_beyond_p(-amount, threshold.limit, scale), rounds=counts, scale=scale)
    if min_p_value(len(after), len(before)) >= SIGNIFICANCE:
        return _Rule(MEDIAN_RULE, f"too few rounds ({len(before)}+{len(after)}) for a significance test")
    p_up = mann_whitney_greater(after, _moved(before, threshold, +1))
    p_down = mann_whitney_greater(_moved(before, threshold, -1), after)
    return _directed(SAMPLE_RULE, metric, p_up, p_down, counts, within, _degrees_critical(min(counts)))


def _beyond_p(amount: float, limit: float, scale: float) -> float:
    """One-sided p-value that a worsening of ``amount`` (error ``scale``, normal) is past ``limit``; exact when the
    error is 0 (every round and run alike)."""
    if scale <= 0:
        return 0.0 if beyond_limit(amount, limit) else 1.0
    return 1.0 - NormalDist().cdf((amount - limit) / scale)


def _median_rule(threshold: Threshold, old: float, new: float, between: float, why: str) -> _Rule:
    """No usable rounds: two jobs are judged on their medians with the between-run term alone; in one job nothing
    says how large a change the medians could show (the detectable size is unknown)."""
    if between <= 0:
        return _Rule(MEDIAN_RULE, why)
    amount = worsening(threshold.metric, old, new, threshold.relative)
    return _Rule(MEDIAN_RULE, why, p_worse=_beyond_p(amount, threshold.limit, between),
                 p_better=_beyond_p(-amount, threshold.limit, between), scale=between)


def _directed(name: str, metric: str, p_up: float, p_down: float, rounds: tuple[int, int], scale: float,
              critical: float) -> _Rule:
    """A sample rule from its one-sided p-values, up (the new rounds above the old ones moved up by the limit)
    and down, worse and better in the metric's direction."""
    worse, better = (p_down, p_up) if METRICS[metric].higher_is_better else (p_up, p_down)
    return _Rule(name, p_worse=worse, p_better=better, rounds=rounds, scale=scale, critical=critical)


def _paired_error(threshold: Threshold, before: list[float], after: list[float]) -> float:
    """The standard error of the pairs' median difference, in the threshold's terms (log-ratios read as percent
    for a relative limit: a slowdown of the whole machine scales a pair without moving its difference)."""
    if threshold.relative:
        differences = [100.0 * (math.log(a) - math.log(b)) for a, b in zip(after, before)]
    else:
        differences = [a - b for a, b in zip(after, before)]
    return robust_spread(differences)[1] * math.sqrt(math.pi / (2.0 * len(differences)))


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
    """(verdict, detail, judged record or None) for one threshold on one test, by the one judge
    (``verdict.judge.decide``).

    The record (timed metrics only) is what the report's ``judged`` list keeps: both medians, the ratio,
    the rule, its p-value, the detectable size and the verdict."""
    metric, fmt = threshold.metric, METRICS[threshold.metric].fmt
    if METRICS[metric].census:
        return judge_census_threshold(threshold, old_entry, new_entry, sides)
    old, new = figure_value(old_entry, metric), figure_value(new_entry, metric)
    if old is not None and new is None:
        return REGRESSED, f"{metric} {fmt(old)} -> not measured: missing in the {sides.new} run{REGRESSED_TAG}", None
    if old is None and new is None:
        return OK, f"{metric} not measured in either run", None
    if old is None:
        assert new is not None
        return OK, f"{metric} not measured in the {sides.old} run ({sides.new}: {fmt(new)})", None
    assert new is not None
    amount = worsening(metric, old, new, threshold.relative)
    worse, better = beyond_limit(amount, threshold.limit), beyond_limit(-amount, threshold.limit)
    rule = _rule(threshold, old_entry, new_entry, old, new, sides) if METRICS[metric].timed else None
    slack_note = None
    if rule is not None:
        detectable = rule.detectable(threshold.limit)
        verdict = decide(amount, threshold.limit, rule.p_worse, rule.p_better, detectable)
    elif metric == "peak_memory":  # one reading a side: a change counts past the memory budgets' measurement slack
        slack = memory_slack_bytes(old)
        verdict = decide_exact(amount, threshold.limit) if abs(new - old) > slack else OK
        if (worse or better) and verdict == OK:
            slack_note = f"within the {format_bytes(slack)} measurement slack"
    else:
        verdict = decide_exact(amount, threshold.limit)
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
            if verdict in (OK, INCONCLUSIVE) and (worse or better):
                note = NOT_SIGNIFICANT
                rule_text += f", {NOT_SIGNIFICANT}" if worse else f", {NOT_SIGNIFICANT} (an improvement)"
        else:
            rule_text = f"median rule: {rule.why}"
        between_run = sides.between_run.pct(metric) if sides.between_run and rule.name != PAIRED_RULE else None
        if sides.between_run is not None and between_run is not None:
            rule_text += f", with {sides.between_run.source}"
        detectable = rule.detectable(threshold.limit)
        rule_text += f", detectable {size_text(threshold, detectable)}" if math.isfinite(detectable) \
            else ", detectable size unknown"
        detail += (f", ratio {format_ratio(ratio)}" if ratio is not None else "") + f", {rule_text}"
        record = {"metric": metric, "threshold": threshold.describe(), "old": old, "new": new, "ratio": ratio,
                  "rule": rule.name, "p_value": p_value, "rounds": list(rule.rounds) if rule.rounds else None,
                  "note": note, "verdict": verdict,
                  "detectable": detectable if math.isfinite(detectable) else None,
                  "between_run_pct": between_run}
    if verdict == REGRESSED:
        if threshold.relative and old == 0:
            detail += f" (a relative limit cannot hold from 0; use an absolute one, e.g. {metric}:0.01)"
        detail += REGRESSED_TAG
    elif verdict == IMPROVED:
        detail += IMPROVED_TAG
    elif verdict == INCONCLUSIVE:
        detail += INCONCLUSIVE_TAG
    elif record is not None:
        detail += OK_TAG
    return verdict, detail, record


def compare_test(old: dict[str, Any], new: dict[str, Any], thresholds: list[Threshold], sides: Sides = REPORTS
                  ) -> dict[str, Any]:
    details: list[str] = []
    judged: list[dict[str, Any]] = []
    verdicts: list[str] = []
    for threshold in thresholds:
        verdict, detail, record = judge_threshold(threshold, old, new, sides)
        verdicts.append(verdict)
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
    result: dict[str, Any] = {"verdict": worst(verdicts), "details": details}
    if judged:
        result["judged"] = judged
    if any(METRICS[t.metric].timed and v in (REGRESSED, INCONCLUSIVE) for t, v in zip(thresholds, verdicts)):
        result["cause"] = census_cause(old, new, old_label=sides.old, new_label=sides.new)
    return result


def judge_census_threshold(threshold: Threshold, old_entry: dict[str, Any], new_entry: dict[str, Any],
                           sides: Sides = REPORTS, side: str = "optimized"
                           ) -> tuple[str, str, dict[str, Any] | None]:
    """(verdict, detail, judged record) of a census threshold (``ops:0``, ``graph_breaks:0`` ...): exact, by
    ``verdict.judge.decide_exact``; a side without the count is ``inconclusive`` (nothing to compare, never ok)."""
    metric = threshold.metric
    values: dict[str, Any] = {}
    for label, entry in ((sides.old, old_entry), (sides.new, new_entry)):
        census, why = side_census(entry, side)
        value, why = census_value(census, metric) if census is not None else (None, why)
        if value is None:
            return INCONCLUSIVE, (f"{metric} not counted in the {label} {sides.record if label == sides.new else 'run'}: "
                                  f"{why}; nothing to compare{INCONCLUSIVE_TAG}"), None
        values[label] = value
    before, after = values[sides.old], values[sides.new]
    amount = census_amount(metric, before, after, threshold.relative)
    verdict = decide_exact(amount, threshold.limit)
    old_census, _ = side_census(old_entry, side)
    new_census, _ = side_census(new_entry, side)
    assert old_census is not None and new_census is not None
    if metric in CENSUS_MAPS:
        total_key = CENSUS_MAPS[metric][2]
        old_total, new_total = old_census.get(total_key), new_census.get(total_key)
        changes = map_changes(old_census, new_census, metric)
        moved = f"{amount:.3g}% of the {sides.old} count" if threshold.relative else f"{amount:g} changed"
        detail = (f"{metric} {old_total} -> {new_total} per call ({moved}, limit {threshold.describe()})"
                  + (f": {shortened(changes)}" if changes else ""))
        old_figure, new_figure = old_total, new_total
    else:
        changes = [text for text in census_changes(old_census, new_census) if text.startswith(metric.replace("_", " "))]
        detail = (f"{changes[0]}" if changes else f"{metric.replace('_', ' ')} {before:g} -> {after:g}") + \
            f" (limit {threshold.describe()})"
        old_figure, new_figure = before, after
    tag = {REGRESSED: REGRESSED_TAG, IMPROVED: IMPROVED_TAG}.get(verdict, OK_TAG)
    record = {"metric": metric, "threshold": threshold.describe(), "old": old_figure, "new": new_figure,
              "ratio": None, "rule": "exact", "p_value": None, "rounds": None, "note": None, "verdict": verdict,
              "detectable": threshold.limit, "changes": changes}
    return verdict, detail + tag, record


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


def compare_reports(old: dict[str, Any], new: dict[str, Any], thresholds: list[Threshold],
                    sides: Sides | None = None) -> dict[str, dict[str, Any]]:
    """A verdict per test of the ``new`` report: regressed, inconclusive, improved, ok, new or not comparable
    (``sides``: this runner's between-run term where a recorded history gives one; by default each row's device's
    stated one).

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
            verdicts[key] = new_row("not in the old report")
            continue
        new_env = row_environment(new, test)
        hardware = row_hardware(test, new_env)
        before = candidates[0]
        if len(candidates) > 1:  # a merged old report: the row of this row's own hardware
            same = [c for c in candidates if row_hardware(c, row_environment(old, c)) == hardware]
            if not same:
                measured = ", ".join(shown(row_hardware(c, row_environment(old, c))) for c in candidates)
                verdicts[key] = not_comparable([f"measured on different hardware: {measured} -> {shown(hardware)}"])
                continue
            before = same[0]
        reasons = (hardware_differences(before, row_environment(old, before), test, new_env)
                   + test_differences(before, test))
        if reasons:
            verdicts[key] = not_comparable(reasons)
            continue
        verdicts[key] = compare_test(before, test, thresholds,
                                     sides or Sides(between_run=default_between_run(new_env)))
    return verdicts


def _tests(count: int) -> str:
    return f"{count} test{'s' if count != 1 else ''}"


_REASONS_SHOWN = 3  # of a gate that judged nothing: the line stays readable

def nothing_judged(verdicts: dict[str, dict[str, Any]]) -> str | None:
    """Why a gate judged no test at all (every row new or not comparable, or no row), or None when one was.

    A gate that judged nothing must not pass: a run whose GPU changed, or whose measured tests all skip
    now, would otherwise pass every threshold unseen."""
    if any(is_judged(result.get("verdict")) for result in verdicts.values()):
        return None
    if not verdicts:
        return "the run has no test to compare"
    reasons: dict[str, int] = {}
    for result in verdicts.values():
        if result.get("verdict") == NEW:
            reasons["not in the old report"] = reasons.get("not in the old report", 0) + 1
            continue
        for reason in [str(d) for d in result.get("details") or []][:1] or ["no reason given"]:
            reasons[reason] = reasons.get(reason, 0) + 1
    shown_reasons = [f"{_tests(count)}: {reason}" for reason, count in reasons.items()]
    if len(shown_reasons) > _REASONS_SHOWN:
        shown_reasons[_REASONS_SHOWN:] = [f"{len(shown_reasons) - _REASONS_SHOWN} more reasons"]
    return f"no test could be judged ({'; '.join(shown_reasons)})"


