"""Change points of a recorded history (``pytest-opt history DIR``): where a test's figure moved, dated.

A series is one test on one hardware with one model (name, revision, dtype, arguments), techniques and
workload (``history.same_series``, the window's rule of what may be pooled): runs of another model under the
same node id are another series, never a step of this one. Each series gives one sequence per figure
(``METRICS``), oldest run first.

A change point is proposed by ``ruptures`` (binary segmentation of the mean, in units of the run-to-run noise:
the robust spread of successive differences, which a step does not inflate) and kept when one of two tests of
its split is sure, at ``p <= MAX_P_VALUE`` (Otava's default: a history is tested again at every run):

- Student's t-test between the segments either side (pooled variance, as Apache Otava's), its p-value times
  the positions the split could have taken in its segment (Bonferroni). It resolves a step within 3 runs a
  side: a +60% step among 2-3% noise from 6 runs on (among 5%, from 8).
- A permutation test of the segment's ranks, as E-divisive does: the segment between the neighbouring change
  points is shuffled ``PERMUTATIONS`` times, the best split of each scored by the same statistic (the largest
  fall in squared error one split gives). On ranks, one run slowed by a busy machine moves a rank by one,
  not a mean by its whole excess: it neither hides a step from this test nor makes one. Ranks cannot be sure
  in a short history (the smallest p-value of a split of ``2k`` runs is ``2 / C(2k, k)``: 0.029 at 8 runs,
  under 0.001 from 14), so this test finds what noisy outliers hide from the t-test in longer ones.

The weakest change point is dropped, and its neighbours tested again, until every one left passes. The
generator is seeded from the values, so the same history always gives the same answer.
``benchmarks/changepoint_study.py`` measures power by length and step size, the false rate of null histories
and the agreement with Otava (``benchmarks/RESULTS.md``).

How large a change is: the ratio of the medians of the segments before and after it, with the 95%
bootstrap interval of ``verdict.stats`` (the speedup's). ruptures and scipy (the ``history`` extra) and
numpy are imported on use: the plugin imports nothing heavy at start-up.
"""

from __future__ import annotations

import csv
import datetime as _dt
import hashlib
import importlib
import io
import math
import statistics
import struct
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from ..errors import OptConfigError
from ..units import finite_number
from ..verdict.stats import median_ratio_interval, student_t_sf
from .history import History, MeasuredRow, RunName, measured_rows, same_series, series_keys, series_name

if TYPE_CHECKING:
    import numpy

METRICS = ("latency", "peak_memory", "kl_mean", "speedup")
"""The figures a series can follow (``figures_of`` says where each is read), in the order they are shown."""
HIGHER_IS_WORSE = {"latency": True, "peak_memory": True, "kl_mean": True, "speedup": False}
MIN_SEGMENT = 3  # runs on each side of a change point: fewer and one slow run looks like a step
MIN_RUNS = 2 * MIN_SEGMENT
MAX_P_VALUE = 0.001  # Otava's default: a history is tested again at every run, so a change point must be sure
PERMUTATIONS = 1999  # the smallest p-value it can show is 1 / 2000, under MAX_P_VALUE
PENALTY_PER_LOG_RUN = 2.0  # ruptures' penalty, times log(runs): BIC for a mean shift in units of the scale
EXTRA = 'pip install "pytest-transformers-opt[history]"'
_MAD_TO_SD = 1.4826  # the MAD of a normal sample times this is its standard deviation


def _ruptures() -> ModuleType:
    try:
        return importlib.import_module("ruptures")
    except ImportError:
        raise OptConfigError(f"change points need the ruptures package, which is not installed: {EXTRA}") from None


def require_ruptures() -> None:
    """Raise ``OptConfigError`` naming the extra to install when ruptures is missing (before any work)."""
    _ruptures()


# ------------------------------------------------------------------------------------------ series


def series_label(nodeid: str, hardware: str | None) -> str:
    """``tests/test_x.py::test_sdpa [CPU: ...]``: how a line names a test on its hardware."""
    return f"{nodeid} [{hardware if hardware is not None else 'hardware unknown'}]"


@dataclass
class TrackedTest:
    """One series of a test over the history: its runs on one hardware with one model, techniques and workload
    (``history.same_series``), and each run's figures. ``measured`` is its newest row, which names it."""

    nodeid: str
    hardware: str | None
    runs: list[RunName] = field(default_factory=list)
    figures: list[dict[str, float]] = field(default_factory=list)  # per run: metric -> finite value
    measured: MeasuredRow | None = None

    @property
    def label(self) -> str:
        """``tests/test_x.py::test_sdpa [CPU: ...]``, then the series' name where its newest row is known."""
        label = series_label(self.nodeid, self.hardware)
        return f"{label} {series_name(self.measured.row)}" if self.measured is not None else label

    @property
    def keys(self) -> dict[str, str]:
        """What makes the series (``history.series_keys`` of its newest row); empty where it is not known."""
        return series_keys(self.measured.row) if self.measured is not None else {}

    def series(self, metric: str) -> Series:
        """The runs that recorded ``metric``, and its values."""
        runs, values = [], []
        for run, figures in zip(self.runs, self.figures):
            if metric in figures:
                runs.append(run)
                values.append(figures[metric])
        name = series_name(self.measured.row) if self.measured is not None else ""
        return Series(self.nodeid, self.hardware, metric, tuple(runs), tuple(values), name, self.keys)


@dataclass(frozen=True)
class Series:
    """One figure of one series of a test (``keys``: what makes the series), oldest run first."""

    nodeid: str
    hardware: str | None
    metric: str
    runs: tuple[RunName, ...]
    values: tuple[float, ...]
    name: str = ""  # the series' model, techniques and workload (``history.series_name``)
    keys: Mapping[str, str] = field(default_factory=dict)


def figures_of(test: Mapping[str, Any]) -> dict[str, float]:
    """The finite figures of one report row, by metric name (a missing, non-numeric or infinite one is left out)."""
    optimized = test.get("optimized")
    optimized = optimized if isinstance(optimized, dict) else {}
    similarity = test.get("similarity")
    similarity = similarity if isinstance(similarity, dict) else {}
    found = {"latency": finite_number(optimized.get("latency_s")),
             "peak_memory": finite_number(optimized.get("peak_memory_bytes")),
             "kl_mean": finite_number(similarity.get("kl_mean")),
             "speedup": finite_number(test.get("speedup"))}
    return {metric: value for metric, value in found.items() if value is not None}


def tracked_tests(history: History) -> list[TrackedTest]:
    """Every series measured in the history's runs (``history.same_series``: one per hardware, model,
    techniques and workload of a node id), by node id, hardware, then first run. A run without a name (not
    recorded) is skipped: a change point needs its date."""
    found: dict[str, list[TrackedTest]] = {}
    for run in history.runs:
        if run.name is None:
            continue
        joined: set[int] = set()
        for measured in measured_rows(run.report):
            figures = figures_of(measured.row)
            if not figures:
                continue
            tracks = found.setdefault(measured.row["nodeid"], [])
            # the newest row of each series stands for it: comparability is judged between neighbouring runs
            track = next((t for t in reversed(tracks) if t.measured is not None and same_series(t.measured, measured)),
                         None)
            if track is None:
                hardware = measured.hardware
                track = TrackedTest(measured.row["nodeid"], hardware if isinstance(hardware, str) else None)
                tracks.append(track)
            elif id(track) in joined:
                continue  # a report holds a test once per series; a crafted one twice: the first wins, as trends do
            joined.add(id(track))
            track.runs.append(run.name)
            track.figures.append(figures)
            track.measured = measured
    ordered = [track for nodeid in sorted(found) for track in found[nodeid]]
    return sorted(ordered, key=lambda track: (track.nodeid, track.hardware or ""))  # stable: first run within


def select_tracks(tracks: Sequence[TrackedTest], *, test: str | None = None, hardware: str | None = None,
                  series: str | None = None) -> list[TrackedTest]:
    """The tracks whose node id contains ``test`` (only the test itself when a node id equals it: the node
    id of ``test_sdpa`` then does not also pick ``test_sdpa_again``), whose hardware contains ``hardware`` and
    whose name (``history.series_name``: model, techniques, workload) contains ``series``."""
    chosen = [t for t in tracks if hardware is None or (t.hardware is not None and hardware in t.hardware)]
    if series is not None:
        chosen = [t for t in chosen if t.measured is not None and series in series_name(t.measured.row)]
    if test is None:
        return chosen
    exact = [t for t in chosen if t.nodeid == test]
    return exact or [t for t in chosen if test in t.nodeid]


# ------------------------------------------------------------------------------------------ detection


@dataclass(frozen=True)
class Split:
    """A change point of a series of values: ``index`` is the first value after the change."""

    index: int
    p_value: float


def _seed(values: Sequence[float], start: int, stop: int) -> int:
    """A seed from the values and the segment, so that a series gives the same p-values whatever else runs."""
    digest = hashlib.sha256(struct.pack(f"<II{len(values)}d", start, stop, *values)).digest()
    return int.from_bytes(digest[:8], "little")


def _best_split_gain(rows: numpy.ndarray) -> numpy.ndarray:
    """For each row, the largest fall in squared error that splitting it in two (``MIN_SEGMENT`` values a
    side at least) gives: ``k (m - k) / m * (mean_left - mean_right)^2`` at its best ``k``, ruptures' l2
    cost reduction."""
    import numpy as np

    width = rows.shape[1]
    sums = np.cumsum(rows, axis=1)
    sizes = np.arange(MIN_SEGMENT, width - MIN_SEGMENT + 1)
    left = sums[:, sizes - 1]
    right = sums[:, -1:] - left
    gaps = left / sizes - right / (width - sizes)
    return (gaps * gaps * sizes * (width - sizes) / width).max(axis=1)  # type: ignore[no-any-return]  # numpy's stubs: Any


def _segment_p_value(values: Sequence[float], start: int, stop: int, permutations: int) -> float:
    """Permutation p-value of "the values in ``[start, stop)`` hold a change": how often a shuffle of them
    splits as well as they do (the best split of each, so choosing where to split is paid for)."""
    import numpy as np

    segment = np.asarray(values[start:stop], dtype=float)
    observed = float(_best_split_gain(segment[None, :])[0])
    rng = np.random.default_rng(_seed(values, start, stop))
    shuffled = rng.permuted(np.broadcast_to(segment, (permutations, len(segment))), axis=1)
    # a relative tolerance: the same split of a shuffle that changed nothing must count as "as good"
    as_good = int(np.count_nonzero(_best_split_gain(shuffled) >= observed * (1 - 1e-9)))
    return (1 + as_good) / (1 + permutations)


def robust_scale(values: Sequence[float]) -> float:
    """The spread of the values: the MAD (as a standard deviation), else the standard deviation where more than
    half the values are equal (a peak memory that moves rarely); 0 for a constant series."""
    center = statistics.median(values)
    mad = _MAD_TO_SD * statistics.median(abs(v - center) for v in values)
    return mad if mad > 0 else statistics.pstdev(values)


def noise_scale(values: Sequence[float]) -> float:
    """The run-to-run noise the search measures a step against: the robust scale of the successive differences
    over sqrt(2). A step moves one difference only, so it is not counted as noise (the spread of the values
    themselves is half a step in a short history that holds one, and hid it). A series that moves by the same
    amount every run (a steady trend): the spread of the values; 0 for a constant series."""
    differences = [after - before for before, after in zip(values, values[1:])]
    scale = robust_scale(differences) / math.sqrt(2) if len(differences) > 1 else 0.0
    return scale if scale > 0 else robust_scale(values)


def _t_test_p_value(values: Sequence[float], start: int, index: int, stop: int) -> float:
    """Two-sided p-value of Student's t-test (pooled variance, as Otava's) between ``values[start:index]`` and
    ``values[index:stop]``, times the positions a split of ``[start, stop)`` could take (Bonferroni: the search
    chose this one). It resolves a step within a few runs, where ranks cannot. Two constant segments: 0 when
    they differ, 1 when not."""
    left, right = values[start:index], values[index:stop]
    gap = statistics.fmean(right) - statistics.fmean(left)
    df = len(left) + len(right) - 2
    pooled = ((len(left) - 1) * statistics.variance(left) + (len(right) - 1) * statistics.variance(right)) / df
    if not pooled > 0:
        return 0.0 if gap != 0 else 1.0
    t = abs(gap) / math.sqrt(pooled * (1 / len(left) + 1 / len(right)))
    positions = stop - start - 2 * MIN_SEGMENT + 1
    return min(1.0, 2.0 * student_t_sf(t, df) * positions)


def detect(values: Sequence[float], *, max_p_value: float = MAX_P_VALUE,
           permutations: int = PERMUTATIONS) -> list[Split]:
    """The change points of ``values`` (oldest first) that pass the tests, in order; none for fewer than
    ``MIN_RUNS`` values or a constant series. Raises ``OptConfigError`` when ruptures is missing."""
    rpt = _ruptures()
    if len(values) < MIN_RUNS:
        return []
    scale = noise_scale(values)
    if not scale > 0:
        return []
    import numpy as np
    from scipy.stats import rankdata  # ruptures' own dependency

    normalised = (np.asarray(values, dtype=float) - statistics.median(values)) / scale
    ranks = [float(rank) for rank in rankdata(values)]  # what the permutation test judges; ties share a mean rank
    search = rpt.Binseg(model="l2", min_size=MIN_SEGMENT, jump=1).fit(normalised)
    candidates: list[int] = [int(i) for i in search.predict(pen=PENALTY_PER_LOG_RUN * math.log(len(values)))[:-1]]
    tested: dict[tuple[int, int, int], float] = {}  # (start, index, stop) -> p-value: a split's tests do not change

    def p_value(start: int, index: int, stop: int) -> float:
        if (start, index, stop) not in tested:
            # the smaller of the two tests' p-values: the ranks' where a slow run would hide a step from the
            # t-test, the t-test's where the segment is too short for ranks to reach MAX_P_VALUE
            tested[(start, index, stop)] = min(_segment_p_value(ranks, start, stop, permutations),
                                               _t_test_p_value(values, start, index, stop))
        return tested[(start, index, stop)]

    while candidates:
        bounds = [0, *candidates, len(values)]
        p_values = [p_value(bounds[n], bounds[n + 1], bounds[n + 2]) for n in range(len(candidates))]
        weakest = max(range(len(candidates)), key=lambda n: p_values[n])
        if p_values[weakest] <= max_p_value:
            return [Split(index, p) for index, p in zip(candidates, p_values)]
        del candidates[weakest]  # its neighbours now share its segment: tested again on the next pass
    return []


# ------------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class ChangePoint:
    """Where a series moved: the first run after the change and the run before it (the commit range
    ``previous_commit..commit`` holds the cause), how large the move is and how sure."""

    index: int  # position of the first run after the change in the series
    run: RunName
    previous: RunName  # the last run before the change
    before_median: float  # median of the segment before (since the previous change point)
    after_median: float  # median of the segment after (until the next change point)
    before_runs: int
    after_runs: int
    change: float | None  # after / before - 1; None when the median before is not positive
    interval: tuple[float, float] | None  # 95% interval of ``change``; None with under 5 runs a side
    p_value: float
    worse: bool | None  # the figure moved the bad way (slower, more memory, further from the baseline)

    @property
    def commit_range(self) -> str | None:
        """``9f8e7d6..1a2b3c4`` when both runs have a commit and they differ."""
        if self.run.commit and self.previous.commit and self.run.commit != self.previous.commit:
            return f"{self.previous.commit}..{self.run.commit}"
        return None


@dataclass(frozen=True)
class SeriesAnalysis:
    """A series and its change points; ``note`` says why none was looked for (too few runs)."""

    series: Series
    change_points: tuple[ChangePoint, ...]
    note: str | None = None


def step_size(before: Sequence[float], after: Sequence[float]) -> tuple[float | None, tuple[float, float] | None]:
    """(after / before - 1 of the two segments' medians, its 95% bootstrap interval); None where the median
    before is not positive, no interval with under 5 values a side."""
    before_median = statistics.median(before)
    if not before_median > 0:
        return None, None
    ratio = median_ratio_interval(after, before, paired=False)
    return statistics.median(after) / before_median - 1, (ratio[0] - 1, ratio[1] - 1) if ratio is not None else None


def steps(values: Sequence[float]) -> list[tuple[Split, float | None, tuple[float, float] | None]]:
    """Each change point of ``values`` (oldest first) with its size and interval (``step_size`` of the segments
    on either side): what a chart marks. Raises ``OptConfigError`` when ruptures is missing."""
    splits = detect(values)
    bounds = [0, *(split.index for split in splits), len(values)]
    return [(split, *step_size(values[bounds[n]:split.index], values[split.index:bounds[n + 2]]))
            for n, split in enumerate(splits)]


def _change_point(series: Series, split: Split, start: int, stop: int) -> ChangePoint:
    before, after = series.values[start:split.index], series.values[split.index:stop]
    before_median, after_median = statistics.median(before), statistics.median(after)
    change, interval = step_size(before, after)
    moved = after_median - before_median
    worse = None if moved == 0 else (moved > 0) == HIGHER_IS_WORSE[series.metric]
    return ChangePoint(split.index, series.runs[split.index], series.runs[split.index - 1], before_median,
                       after_median, len(before), len(after), change, interval, split.p_value, worse)


def analyse(series: Series) -> SeriesAnalysis:
    """The change points of one series, each dated and sized (see the module's docstring)."""
    if len(series.values) < MIN_RUNS:
        count = len(series.values)
        return SeriesAnalysis(series, (), f"too few runs ({count}) to look for a change point: needs {MIN_RUNS}")
    splits = detect(series.values)
    bounds = [0, *(split.index for split in splits), len(series.values)]
    points = tuple(_change_point(series, split, bounds[n], bounds[n + 2]) for n, split in enumerate(splits))
    return SeriesAnalysis(series, points)


def analyse_track(track: TrackedTest, metrics: Iterable[str] = METRICS) -> list[SeriesAnalysis]:
    """The series of one (test, hardware): each of ``metrics`` it recorded at least once."""
    return [analyse(track.series(metric)) for metric in metrics
            if any(metric in figures for figures in track.figures)]


# ------------------------------------------------------------------------------------------ rendering


def format_value(metric: str, value: float) -> str:
    from ..units import format_bytes, format_duration, format_ratio

    if metric == "latency":
        return format_duration(value)
    if metric == "peak_memory":
        return format_bytes(value)
    if metric == "speedup":
        return format_ratio(value)
    return f"{value:.3g}"


def _percent(value: float) -> str:
    return f"{value * 100:+.1f}%"


def _when(run: RunName) -> str:
    """``2026-12-01 13:15:00 UTC, commit 1a2b3c4``: the run's time and commit."""
    text = run.moment.strftime("%Y-%m-%d %H:%M:%S UTC") + (" (dated in the future)" if run.future else "")
    if run.commit:
        text += f", commit {run.commit}" + (" with uncommitted changes" if run.dirty else "")
    return text


def _commits(point: ChangePoint) -> str:
    if point.commit_range is not None:
        return f"commits {point.commit_range}"
    if point.run.commit and point.run.commit == point.previous.commit:
        return f"same commit as the run before ({point.previous.name.removesuffix('.json')})"
    if point.run.commit:
        return "the run before has no commit"
    return "no commit recorded"


def heading(track: TrackedTest) -> str:
    """The line that names a series before its figures' lines: the test, its hardware, model, techniques and
    workload, and its runs."""
    first, last = track.runs[0].name.removesuffix(".json"), track.runs[-1].name.removesuffix(".json")
    span = first if first == last else f"{first} .. {last}"
    return f"{track.label}: {len(track.runs)} run{'s' if len(track.runs) != 1 else ''} ({span})"


def describe(analysis: SeriesAnalysis) -> list[str]:
    """The text lines of one figure of a series (under its ``heading``): one per change point, else one that says
    why there is none."""
    series = analysis.series
    head = f"{series.metric}:"
    if analysis.note is not None:
        return [f"{head} {analysis.note}"]
    if not analysis.change_points:
        return [f"{head} no change point in {len(series.values)} runs"]
    lines = []
    for point in analysis.change_points:
        size = _percent(point.change) if point.change is not None else "change"
        if point.change is not None:
            size += (f" [{_percent(point.interval[0])}, {_percent(point.interval[1])}]" if point.interval
                     else " (too few runs a side for an interval)")
        way = "" if point.worse is None else (", worse" if point.worse else ", better")
        lines.append(f"{head} {size} ({format_value(series.metric, point.before_median)} -> "
                     f"{format_value(series.metric, point.after_median)}{way}) at run "
                     f"{point.run.name.removesuffix('.json')} ({_when(point.run)}; {_commits(point)}), "
                     f"p={point.p_value:.2g}")
    return lines


def _run_json(run: RunName) -> dict[str, Any]:
    return {"name": run.name, "time": run.moment.isoformat(), "commit": run.commit, "dirty": run.dirty,
            "future": run.future}


def to_json(analysis: SeriesAnalysis) -> dict[str, Any]:
    """One series with every field of its change points (the ``--json`` output's ``series`` entries)."""
    series = analysis.series
    return {
        "nodeid": series.nodeid, "hardware": series.hardware, "series": series.name, "keys": dict(series.keys),
        "metric": series.metric, "runs": [run.name for run in series.runs], "values": list(series.values), "note": analysis.note,
        "change_points": [{
            "index": point.index, "run": _run_json(point.run), "previous_run": _run_json(point.previous),
            "commit_range": point.commit_range, "before_median": point.before_median,
            "after_median": point.after_median, "before_runs": point.before_runs, "after_runs": point.after_runs,
            "change": point.change, "interval": list(point.interval) if point.interval else None,
            "p_value": point.p_value, "worse": point.worse,
        } for point in analysis.change_points],
    }


def method_json() -> dict[str, Any]:
    """How the change points were found, for the ``--json`` output."""
    return {"series": "one per test, hardware, model (name, revision, dtype, arguments), techniques and workload",
            "search": f"ruptures Binseg, l2 cost, min_size {MIN_SEGMENT}, penalty {PENALTY_PER_LOG_RUN} log(runs) "
                      f"on the series over the robust spread of its successive differences",
            "test": f"kept at p <= {MAX_P_VALUE} by either Student's t-test of the split (pooled variance, times "
                    f"the positions the split could take) or a permutation test of its segment's ranks "
                    f"({PERMUTATIONS} shuffles, seeded from the values); p is the smaller",
            "interval": "95% bootstrap interval of the ratio of the medians after and before, minus 1",
            "min_runs": MIN_RUNS, "max_p_value": MAX_P_VALUE, "permutations": PERMUTATIONS}


OTAVA_KEY_COLUMNS = ("test", "hardware", "model", "revision", "dtype", "model_arguments", "techniques", "baseline",
                     "workload")
"""The columns of ``--format otava-csv`` that name the series (Otava's ``attributes``), after ``time,commit``."""


def otava_csv(track: TrackedTest, metrics: Iterable[str] = METRICS) -> str:
    """The runs of one series as Otava's CSV importer reads them: ``time,commit``, the series' keys
    (``OTAVA_KEY_COLUMNS``: the same on every row, since a series is one test on one hardware with one model,
    techniques and workload), then ``<metric>...``, one row per run, times in ISO 8601 with their zone,
    ascending. Otava converts every metric cell to a number, so a column is written for each of ``metrics`` the
    series recorded at least once, and a run without one of them is left out. Raises ``OptConfigError`` when no
    run has them all."""
    chosen = list(metrics)
    columns = [metric for metric in chosen if any(metric in figures for figures in track.figures)]
    if not columns:
        raise OptConfigError(f"--format otava-csv: {track.label} recorded none of the figures {', '.join(chosen)}")
    keys = {"test": track.nodeid, "hardware": track.hardware or "", **track.keys}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["time", "commit", *OTAVA_KEY_COLUMNS, *columns])
    rows = 0
    for run, figures in zip(track.runs, track.figures):
        if all(metric in figures for metric in columns):
            # the time the run is ordered at: a name dated in the future sits at the time it was written
            moment: _dt.datetime = run.order[0]
            commit = (run.commit or "") + ("-dirty" if run.commit and run.dirty else "")
            writer.writerow([moment.isoformat(), commit, *(keys.get(column, "") for column in OTAVA_KEY_COLUMNS),
                             *(repr(figures[metric]) for metric in columns)])
            rows += 1
    if not rows:
        raise OptConfigError(f"--format otava-csv: no run of {track.label} recorded all of {', '.join(columns)}; "
                             f"choose fewer with --metric")
    return out.getvalue()
