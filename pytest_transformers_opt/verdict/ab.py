"""``--opt-ab``: this environment (the candidate) against a reference environment, figure by figure.

Both environments ran a test's optimized configuration on the same machine, their timed rounds taken in
turns (``mode: interleaved``) or, where the device could not hold both models, as alternating blocks
(``mode: blocks``). A figure's change is the candidate's median against the reference's, in percent; where
both sides keep their rounds (latency), its 95% interval is the bootstrap of ``verdict.stats`` (whole
rounds resampled when they were taken in turns, so a slow spell of the machine shared by both sides
cancels) and its p-value the one-sided Mann-Whitney test the speed budgets use, in the direction of the
change. The word is the plugin's own: faster / slower where the interval excludes no change (without an
interval, where the rank test is significant), larger / smaller for peak memory past the memory budgets'
slack, otherwise no significant difference.

The gate (``--opt-ab-fail``) is judged here (``judge_ab``) by ``--opt-compare-fail``'s rules and the one judge
(``verdict.judge``); it may name every figure but speedup and memory_ratio, which need a baseline the reference
does not run. The census's metrics (``ops:0``, ``graph_breaks:0`` ...) compare the reference's census of the
optimized configuration with the candidate's, exactly (``verdict.census_diff``); a timed verdict that is
regressed or inconclusive carries that difference as its ``cause``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import OptConfigError
from ..units import finite_number, format_bytes
from .budgets import memory_slack_bytes
from .census_diff import CENSUS_METRICS, census_changes
from .results import FASTER, LARGER, NO_DIFFERENCE, SLOWER, SMALLER
from .stats import MIN_BOOTSTRAP_SAMPLES, SIGNIFICANCE, mann_whitney_greater, median_ratio_interval

if TYPE_CHECKING:
    from .compare import Sides, Threshold

# metric -> (key on a side, per-round samples key or None, higher is better), in the order the reports show them
FIGURES: dict[str, tuple[str, str | None, bool]] = {
    "latency": ("latency_s", "latency_samples_s", False),
    "ttft": ("ttft_s", "ttft_samples_s", False),
    "tpot": ("tpot_s", "tpot_samples_s", False),
    "throughput": ("throughput_tok_s", "throughput_samples_tok_s", True),
    "peak_memory": ("peak_memory_bytes", None, False),
}
AB_METRICS: tuple[str, ...] = (*FIGURES, "kl_mean", "kl_max", "top1", "token_match", *CENSUS_METRICS)
"""What ``--opt-ab-fail`` may name (``verdict.compare.METRICS`` less ``REFUSED_METRICS``)."""
REFUSED_METRICS: tuple[str, ...] = ("speedup", "memory_ratio")
IDENTICAL_STACKS = "identical stacks"
BLOCKS = "blocks"
NOT_INSTALLED = "not installed"


def check_ab_thresholds(thresholds: Sequence["Threshold"], where: str = "--opt-ab-fail") -> list["Threshold"]:
    """``thresholds`` (parsed by ``verdict.compare.parse_compare_fail``) when each names a figure both environments
    measure; else an OptConfigError naming ``where`` and what it accepts."""
    for threshold in thresholds:
        if threshold.metric in REFUSED_METRICS:
            raise OptConfigError(
                f"{where}: {threshold.describe()!r} cannot be judged across environments: {threshold.metric} is a "
                f"ratio to the baseline, which the reference environment does not run; accepted: "
                f"{', '.join(AB_METRICS)}")
    return list(thresholds)




def _samples(side: Mapping[str, Any], key: str | None, median: float) -> list[float] | None:
    """A side's per-round samples, when they are finite numbers that give its median (an edited record's do not)."""
    values = side.get(key) if key is not None else None
    if not isinstance(values, list) or not values:
        return None
    samples = [finite_number(value) for value in values]
    clean = [value for value in samples if value is not None]
    if len(clean) != len(samples) or not math.isclose(statistics.median(clean), median, rel_tol=1e-6, abs_tol=1e-12):
        return None
    return clean


def _speed_word(low: float, high: float, higher_is_better: bool) -> str:
    """The word of a candidate / reference ratio's interval: a change only where the interval excludes 1."""
    if low > 1.0:
        return FASTER if higher_is_better else SLOWER
    if high < 1.0:
        return SLOWER if higher_is_better else FASTER
    return NO_DIFFERENCE


def figure(metric: str, candidate: Mapping[str, Any], reference: Mapping[str, Any], *, paired: bool
           ) -> dict[str, Any] | None:
    """One figure's candidate-vs-reference record (see ``ab_figures``); None when either side lacks it."""
    key, samples_key, higher_is_better = FIGURES[metric]
    cand, ref = finite_number(candidate.get(key)), finite_number(reference.get(key))
    if cand is None or ref is None:
        return None
    record: dict[str, Any] = {"candidate": cand, "reference": ref,
                              "change_pct": 100.0 * (cand - ref) / abs(ref) if ref else None,
                              "interval_pct": None, "p_value": None, "word": None, "note": None}
    if metric == "peak_memory":  # read once per side: no spread to bound, the memory budgets' slack instead
        slack = memory_slack_bytes(ref)
        record["word"] = LARGER if cand - ref > slack else SMALLER if ref - cand > slack else NO_DIFFERENCE
        record["note"] = (f"peak memory is read once per side; the word allows {format_bytes(slack)} of "
                          f"measurement slack, as the memory budgets do")
        return record
    cand_rounds, ref_rounds = _samples(candidate, samples_key, cand), _samples(reference, samples_key, ref)
    if cand_rounds is None or ref_rounds is None:
        record["note"] = f"no per-round {metric} samples on both sides: the medians' change only"
        return record
    greater, lesser = (cand_rounds, ref_rounds) if cand >= ref else (ref_rounds, cand_rounds)
    record["p_value"] = mann_whitney_greater(greater, lesser)  # one-sided, in the direction of the change
    interval = median_ratio_interval(cand_rounds, ref_rounds, paired=paired and len(cand_rounds) == len(ref_rounds))
    if interval is not None:
        low, high = interval
        record["interval_pct"] = [100.0 * (low - 1.0), 100.0 * (high - 1.0)]
        record["word"] = _speed_word(low, high, higher_is_better)
        return record
    record["note"] = (f"{min(len(cand_rounds), len(ref_rounds))} timed rounds on the smaller side: a 95% interval "
                      f"needs at least {MIN_BOOTSTRAP_SAMPLES}; the word is the rank test's")
    ratio = cand / ref if ref else math.inf
    record["word"] = _speed_word(ratio, ratio, higher_is_better) if record["p_value"] < SIGNIFICANCE else NO_DIFFERENCE
    return record


def ab_figures(row: Mapping[str, Any], ab: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each figure both environments measured: ``{metric: {candidate, reference, change_pct, interval_pct,
    p_value, word, note}}`` from the test row's ``optimized`` side (the candidate) and its ``ab`` record's
    (the reference). The rounds are paired (taken in turns) unless the record's ``mode`` is ``blocks``."""
    candidate, reference = row.get("optimized"), ab.get("optimized")
    if not isinstance(candidate, Mapping) or not isinstance(reference, Mapping):
        return {}
    paired = ab.get("mode") != BLOCKS
    figures = {}
    for metric in FIGURES:
        record = figure(metric, candidate, reference, paired=paired)
        if record is not None:
            figures[metric] = record
    return figures


# --------------------------------------------------------------------------- what differs


class StackVersions(dict[str, "str | None"]):
    """A stack's versions by package; ``complete``: the stack lists every distribution its interpreter has
    (``engine.ab_worker.installed_distributions``), so a package it lacks is not installed there, where an
    older record's fixed list says nothing of packages it did not name."""

    complete: bool = False


def stack_versions(stack: Any) -> StackVersions:
    """A stack's (``{"python", "python_version"?, "versions", "complete"?}``) package versions, with ``python`` for
    the interpreter's version where the stack records it."""
    found = StackVersions()
    if not isinstance(stack, Mapping):
        return found
    if isinstance(stack.get("python_version"), str):
        found["python"] = stack["python_version"]
    versions = stack.get("versions")
    if isinstance(versions, Mapping):
        found.update({str(name): None if version is None else str(version) for name, version in versions.items()})
    found.complete = stack.get("complete") is True
    return found


def _known(versions: Mapping[str, str | None], name: str) -> bool:
    """The stack says whether ``name`` is installed: it names it, or it lists everything (the interpreter's own
    version excepted: an older record may lack it)."""
    return name in versions or (getattr(versions, "complete", False) and name != "python")


def differing_versions(candidate: Mapping[str, str | None], reference: Mapping[str, str | None]
                       ) -> list[tuple[str, str | None, str | None]]:
    """(package, candidate version, reference version) of each package whose versions differ (None: not
    installed), compared over every package both stacks can speak for: each name either lists, where both are
    complete, else the names both list; in the reference's order, then the candidate's."""
    names = dict.fromkeys([*reference, *candidate])
    return [(name, candidate.get(name), reference.get(name)) for name in names
            if _known(candidate, name) and _known(reference, name) and candidate.get(name) != reference.get(name)]


def version_text(version: str | None) -> str:
    return NOT_INSTALLED if version is None else version


def what_differs(candidate: Mapping[str, str | None], reference: Mapping[str, str | None]) -> dict[str, list[str]]:
    """Only the packages whose versions differ: ``{"transformers": ["5.24.0 (candidate)", "5.22.0 (reference)"]}``;
    {} for identical stacks."""
    return {name: [f"{version_text(cand)} (candidate)", f"{version_text(ref)} (reference)"]
            for name, cand, ref in differing_versions(candidate, reference)}


def stack_note(candidate: Mapping[str, str | None], reference: Mapping[str, str | None]) -> str | None:
    """``identical stacks`` when no package differs (``differing_versions``: with two complete stacks, every
    distribution, its version and whether it is installed at all): an A/B of an environment against itself, a
    null comparison, and the report says so. None otherwise, or when no package is reported by both."""
    if not set(candidate) & set(reference) or differing_versions(candidate, reference):
        return None
    return IDENTICAL_STACKS


# How the reference's distributions compare with themselves: what the candidate's similarity is judged against.
_SELF_SIMILARITY = {"kl_mean": 0.0, "kl_max": 0.0, "top1": 1.0, "token_match": 1.0}


def judge_ab(row: Mapping[str, Any], ab: Mapping[str, Any], thresholds: Sequence["Threshold"], *,
             paired: bool | None = None) -> dict[str, Any]:
    """``{"verdict", "details", "judged"?, "cause"?}`` of one test against ``thresholds`` (``--opt-ab-fail``), judged
    as ``--opt-compare-fail`` judges two reports (``judged`` records: ``old`` is the reference, ``new`` the
    candidate) but within one job, so with no between-run term: interleaved rounds on their pairs, ``blocks``
    unpaired, or as ``paired`` says (the A/B study judges the same sessions both ways); ``not judged`` when a
    side has no measurement. A census threshold compares the two environments' censuses of the optimized
    configuration exactly; a timed one that is regressed or inconclusive has their difference as ``cause``."""
    from .compare import compare_test
    from .judge import NOT_JUDGED

    missing = [side for side, part in (("candidate", row.get("optimized")), ("reference", ab.get("optimized")))
               if not isinstance(part, dict)]
    if missing:
        return {"verdict": NOT_JUDGED, "details": [f"no measurement on the {' and '.join(missing)} side"]}
    # each side's census of the optimized configuration, where ``census_diff.side_census`` reads a row's
    (reference_census, why_reference), (candidate_census, why_candidate) = _reference_census(ab), _candidate_census(row)
    reference = {"optimized": ab["optimized"], "similarity": dict(_SELF_SIMILARITY),
                 "census": {"optimized": reference_census, "why_not": {"optimized": why_reference}}}
    candidate = {"optimized": row["optimized"], "similarity": ab.get("similarity"),
                 "census": {"optimized": candidate_census, "why_not": {"optimized": why_candidate}}}
    if paired is None:
        paired = ab.get("mode") != BLOCKS
    result = compare_test(reference, candidate, list(thresholds), ab_sides(paired))
    if "census" not in ab:  # a record from before the census: it asked nothing, so it has no cause to give
        result.pop("cause", None)
    return result


def ab_sides(paired: bool) -> "Sides":
    """The A/B's two sides as the judge names them: one job, so no between-run term; ``paired``: rounds in turns."""
    from .compare import Sides

    return Sides(old="reference", new="candidate", record="side", paired=paired)


# --------------------------------------------------------------------------- the census of both environments


def _reference_census(ab: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(the reference's census of the optimized configuration, or None; why not) from an A/B record."""
    census = ab.get("census")
    if not isinstance(census, Mapping):
        return None, "no census in the A/B record (an earlier report)"
    if isinstance(census.get("reference"), dict):
        return census["reference"], ""
    return None, str(census.get("why_not") or "no census of the reference")


def _candidate_census(row: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(the candidate's census of the optimized configuration, or None; why not) from its test row."""
    census = row.get("census")
    if not isinstance(census, Mapping):
        return None, "no census in the candidate's row (--opt-census=off, or an earlier report)"
    if isinstance(census.get("optimized"), dict):
        return census["optimized"], ""
    why = census.get("why_not")
    return None, str((why.get("optimized") if isinstance(why, Mapping) else None) or "no census of the candidate")


def ab_census_changes(row: Mapping[str, Any], ab: Mapping[str, Any]) -> tuple[list[str] | None, str | None]:
    """(what the candidate runs differently from the reference, as ``census_diff.census_changes`` lines: [] when
    the two censuses are equal; why not, None where both were counted), whatever the timing verdict."""
    reference, why_reference = _reference_census(ab)
    candidate, why_candidate = _candidate_census(row)
    if reference is None:
        return None, f"no census of the reference: {why_reference}"
    if candidate is None:
        return None, f"no census of the candidate: {why_candidate}"
    return census_changes(reference, candidate), None
