"""The run history (``--opt-history=DIR``): each run's JSON report kept as one file, and the trends read back.

A recorded run is ``DIR/<UTC time>[_<n>][-<commit>[-dirty]].json``: ``20261201T131500Z-1a2b3c4.json``.
The time is the report's ``created`` (a second run in the same second gets ``_2``, ``_3``), the commit
``git rev-parse --short=7 HEAD`` of the checkout pytest ran in (none outside a checkout), ``-dirty`` when
tracked files had changes. Names sort by time, so the folder lists oldest first.

Recording order is the names' order, with one exception: a name dated in the future (more than
``FUTURE_TOLERANCE`` ahead of this machine's clock: a runner whose clock was ahead wrote it) is flagged and
placed at the time its file was written, never after the runs recorded since. After each write the folder
is pruned to ``keep`` runs by deleting only runs recorded before this one, oldest first: never a newer run
(a concurrent session's, just written), never a name still being written, never a file without a history name.

Reading goes through the one report reader (``schema.load_report``: the size, depth and count limits of
``files.read_json`` and the schema), so a crafted or broken file in the folder is left out and named,
never a broken report.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import OptConfigError
from ..files import JsonProblem, read_limited, write_atomic
from ..units import finite_number, clip
from ..verdict.compare import hardware_differences, measurement_missing, row_environment, row_hardware, test_differences
from ..verdict.stats import MIN_BOOTSTRAP_SAMPLES, median_ratio_interval
from .schema import load_report

DEFAULT_TREND_RUNS = 20
"""Recorded runs the HTML report's trend charts show."""
GIT_TIMEOUT_S = 5.0
GIT_FILE_BYTES = 4096  # .git/HEAD, a ref, a gitdir pointer: one line each (packed-refs: the JSON limit)
_STAMP = "%Y%m%dT%H%M%SZ"
_LABEL_TIME = "%Y-%m-%d %H:%M:%S"  # with the year: a history spans New Year, and a clock set years ahead shows
FUTURE_TOLERANCE = _dt.timedelta(minutes=5)  # runners' clocks disagree by seconds; further ahead is a wrong clock
CLAIM_IN_PROGRESS = _dt.timedelta(minutes=10)  # an empty history file younger than this is a run being written
NAME_PATTERN = re.compile(r"(?P<stamp>\d{8}T\d{6}Z)(?:_(?P<seq>[0-9]{1,6}))?"
                          r"(?:-(?P<commit>[0-9a-f]{7,40})(?P<dirty>-dirty)?)?\.json")
_MAX_SEQ = 999
_EXTRA_READS = 20  # files past the limit tried when some of the newest cannot be read
_REASON_CHARS = 160


@dataclass(frozen=True)
class RunName:
    """What a recorded run's file name says: when, which commit, whether the tree had changes."""

    name: str
    moment: _dt.datetime
    seq: int = 1
    commit: str | None = None
    dirty: bool = False
    future: bool = False  # dated after the folder was read (plus ``FUTURE_TOLERANCE``): the writer's clock was ahead
    written: _dt.datetime | None = None  # the file's modification time (recording order within a second)

    @property
    def order(self) -> tuple[_dt.datetime, _dt.datetime, int, str]:
        """Recording order: the name's time (to the second), or for a future-dated name the second its file was
        written; within one second, when each file was written (names cannot tell), then ``seq``."""
        written = self.written or (_dt.datetime.min.replace(tzinfo=_dt.timezone.utc) if self.future else self.moment)
        return (written.replace(microsecond=0) if self.future else self.moment), written, self.seq, self.name

    def label(self) -> tuple[str, str]:
        """The two lines under a chart's point: ``2026-12-01 13:15:00`` and the commit (or ``no commit``)."""
        commit = (self.commit or "no commit") + ("+" if self.dirty else "")
        return self.moment.strftime(_LABEL_TIME) + (" (future)" if self.future else ""), commit

    def describe(self) -> str:
        """``2026-12-01 13:15:00 UTC, commit 1a2b3c4 (uncommitted changes)``."""
        text = self.moment.strftime("%Y-%m-%d %H:%M:%S UTC")
        if self.future:
            text += " (a date in the future: the recording machine's clock was ahead)"
        if self.commit:
            text += f", commit {self.commit}" + (" (uncommitted changes)" if self.dirty else "")
        return text


def parse_name(name: str) -> RunName | None:
    """The run a history file name describes, or None for a name this feature never writes."""
    match = NAME_PATTERN.fullmatch(name)
    if match is None:
        return None
    try:
        moment = _dt.datetime.strptime(match["stamp"], _STAMP).replace(tzinfo=_dt.timezone.utc)
    except ValueError:  # 20261399T...: digits, but no time
        return None
    return RunName(name, moment, int(match["seq"] or 1), match["commit"], bool(match["dirty"]))


def run_names(folder: str | os.PathLike[str]) -> list[RunName]:
    """The recorded runs in ``folder`` in recording order, oldest first (files with a history name only; none
    when it is missing). Names dated in the future are flagged and placed at the time they were written."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    now = _dt.datetime.now(_dt.timezone.utc)
    names = []
    for entry in entries:
        name = parse_name(entry.name) if not entry.is_dir(follow_symlinks=False) else None
        if name is None:
            continue
        written = _written(entry.path)
        if name.moment > now + FUTURE_TOLERANCE:
            name = dataclasses.replace(name, future=True, written=min(written or now, now))
        else:
            name = dataclasses.replace(name, written=written)
        names.append(name)
    return sorted(names, key=lambda name: name.order)


def _written(path: str | os.PathLike[str]) -> _dt.datetime | None:
    try:
        return _dt.datetime.fromtimestamp(os.stat(path, follow_symlinks=False).st_mtime, _dt.timezone.utc)
    except OSError:  # pruned by another session meanwhile
        return None


# ------------------------------------------------------------------------------------------ commit


def _git(args: Sequence[str], cwd: str | os.PathLike[str]) -> str | None:
    """``git ARGS`` in ``cwd``: its output, or None when it failed or took longer than ``GIT_TIMEOUT_S``.
    Raises ``FileNotFoundError`` when there is no git."""
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S,
                              check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None
    return done.stdout if done.returncode == 0 else None


def _head_from_files(cwd: Path) -> str | None:
    """The commit ``.git/HEAD`` names, read without git (a machine without it): a detached head or a branch
    in ``refs/heads`` or ``packed-refs``."""
    for folder in (cwd, *cwd.parents):
        git_dir = folder / ".git"
        if git_dir.is_file():  # a worktree or submodule: "gitdir: PATH"
            text = read_limited(git_dir, GIT_FILE_BYTES).strip()
            git_dir = (folder / text.removeprefix("gitdir:").strip()).resolve()
        if not (git_dir / "HEAD").is_file():
            continue
        head = read_limited(git_dir / "HEAD", GIT_FILE_BYTES).strip()
        if not head.startswith("ref:"):
            return head if re.fullmatch(r"[0-9a-f]{40,64}", head) else None
        ref = head.removeprefix("ref:").strip()
        if (git_dir / ref).is_file():
            commit = read_limited(git_dir / ref, GIT_FILE_BYTES).strip()
            return commit if re.fullmatch(r"[0-9a-f]{40,64}", commit) else None
        packed = git_dir / "packed-refs"
        if packed.is_file():
            for line in read_limited(packed).splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref and re.fullmatch(r"[0-9a-f]{40,64}", parts[0]):
                    return parts[0]
        return None  # a branch with no commit yet
    return None


def git_commit(cwd: str | os.PathLike[str]) -> tuple[str | None, bool]:
    """(the short commit of the checkout ``cwd`` is in, whether tracked files have changes); (None, False)
    outside a checkout, or when git does not answer within ``GIT_TIMEOUT_S``."""
    try:
        head = _git(["rev-parse", "--short=7", "HEAD"], cwd)
        if head is None or not re.fullmatch(r"[0-9a-f]{7,40}", head.strip()):
            return None, False
        status = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
        return head.strip(), bool(status and status.strip())
    except FileNotFoundError:  # no git on this machine: the commit from the files, changes unknown
        try:
            commit = _head_from_files(Path(cwd).resolve())
        except (OSError, JsonProblem):  # unreadable, too large or not text: no commit part
            return None, False
        return (commit[:7] if commit else None), False
    except OSError:
        return None, False


# ------------------------------------------------------------------------------------------ writing


@dataclass(frozen=True)
class Recorded:
    """One run written to the history."""

    path: Path
    held: int  # recorded runs in the folder after pruning
    pruned: int  # older runs deleted to stay within ``keep``
    future: tuple[str, ...] = ()  # names in the folder dated in the future (a runner's clock was ahead)

    @property
    def note(self) -> str:
        """What the terminal says about future-dated names (nothing when there are none)."""
        if not self.future:
            return ""
        count = len(self.future)
        return (f"; {count} run{'s' if count != 1 else ''} dated in the future (a runner's clock was ahead: "
                f"{', '.join(self.future[:3])}{', ...' if count > 3 else ''}) "
                f"{'are' if count != 1 else 'is'} ordered by when written, not as the newest")


def _created(report: Mapping[str, Any]) -> _dt.datetime:
    try:
        moment = _dt.datetime.fromisoformat(str(report.get("created")))
    except ValueError:
        moment = _dt.datetime.now(_dt.timezone.utc)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=_dt.timezone.utc)
    return moment.astimezone(_dt.timezone.utc)


def _claim(folder: Path, moment: _dt.datetime, commit: str | None, dirty: bool) -> Path:
    """A new file name for this run, created empty (``O_EXCL``) so two sessions never take the same one."""
    tail = (f"-{commit}" + ("-dirty" if dirty else "")) if commit else ""
    for seq in range(1, _MAX_SEQ + 1):
        path = folder / f"{moment.strftime(_STAMP)}{f'_{seq}' if seq > 1 else ''}{tail}.json"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{_MAX_SEQ} runs recorded in the same second already")


def prune(folder: str | os.PathLike[str], keep: int, *, spare: Path | None = None) -> tuple[int, int]:
    """Delete the oldest recorded runs past ``keep``, only among those recorded before ``spare`` (the run
    just written; every run without one), never a run still being written nor a file without a history
    name; (runs left, runs deleted). A run recorded after ``spare`` is a concurrent session's: its own
    pruning counts it."""
    names = run_names(folder)
    position = next((n for n, name in enumerate(names) if spare is not None and name.name == spare.name), len(names))
    now = _dt.datetime.now(_dt.timezone.utc)
    older = [name for name in names[:position] if not _being_written(Path(folder) / name.name, now)]
    deleted = 0
    for name in older[:max(0, len(names) - keep)]:
        try:
            os.unlink(Path(folder) / name.name)
            deleted += 1
        except FileNotFoundError:  # another session pruned it first
            deleted += 1
    return len(names) - deleted, deleted


def _being_written(path: Path, now: _dt.datetime) -> bool:
    """A name claimed (created empty) by a concurrent session that has not written its report yet."""
    try:
        stat = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return stat.st_size == 0 and now - _dt.datetime.fromtimestamp(stat.st_mtime, _dt.timezone.utc) < CLAIM_IN_PROGRESS


def record_run(folder: str | os.PathLike[str], report: Mapping[str, Any], keep: int,
               cwd: str | os.PathLike[str]) -> Recorded:
    """Write ``report`` into the history ``folder`` (created when missing), then prune it to ``keep`` runs.

    ``cwd`` is where the commit is read (the project's root). Raises ``OSError`` when the folder cannot be
    written; a claimed name is removed again then, so no empty file is left.
    """
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    commit, dirty = git_commit(cwd)
    path = _claim(target, _created(report), commit, dirty)
    try:
        write_atomic(path, json.dumps(report, indent=1, allow_nan=False) + "\n")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    held, pruned = prune(target, keep, spare=path)
    return Recorded(path, held, pruned, tuple(name.name for name in run_names(target) if name.future))


# ------------------------------------------------------------------------------------------ reading


@dataclass
class HistoryRun:
    """One run of the trend: its name (None for this run when it could not be recorded) and its report."""

    name: RunName | None
    report: Mapping[str, Any]
    current: bool = False

    def label(self) -> tuple[str, str]:
        """The two lines under the run's point: time, and commit (``not recorded`` for an unwritten run)."""
        if self.name is not None:
            return self.name.label()
        return _created(self.report).strftime(_LABEL_TIME), "not recorded"

    def describe(self) -> str:
        text = self.name.describe() if self.name is not None else _created(self.report).strftime(
            "%Y-%m-%d %H:%M:%S UTC") + ", not recorded"
        return text + (" (this run)" if self.current else "")


@dataclass
class History:
    """The runs a trend is drawn from, oldest first, and the files left out (``name: why``)."""

    folder: str
    runs: list[HistoryRun] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)


def load_history(folder: str | os.PathLike[str], limit: int = DEFAULT_TREND_RUNS) -> History:
    """The newest ``limit`` recorded runs that read and validate, oldest first; the others are named in
    ``left_out``. A missing folder is an empty history."""
    history = History(os.fspath(folder))
    loaded: list[HistoryRun] = []
    for name in reversed(run_names(folder)[-(limit + _EXTRA_READS):]):
        if len(loaded) >= limit:
            break
        path = Path(folder) / name.name
        try:
            report = load_report(path)
        except OptConfigError as exc:  # "is not JSON: ...", "cannot be used: ...", "cannot read: ...": the name says which
            why = str(exc).replace(f" the report {str(path)!r}", "").replace(f"the report {str(path)!r} ", "")
            history.left_out.append(f"{name.name}: {clip(why, _REASON_CHARS)}")
            continue
        loaded.append(HistoryRun(name, report))
    history.runs = loaded[::-1]
    return history


def trend_history(folder: str | os.PathLike[str], report: Mapping[str, Any], recorded: Path | None,
                  limit: int = DEFAULT_TREND_RUNS) -> History:
    """The history with this run (``report``) last and marked current: the recorded file when it was
    written (``recorded``), else the report itself, so the chart shows this run either way."""
    history = load_history(folder, limit)
    runs = [run for run in history.runs if recorded is None or run.name is None or run.name.name != recorded.name]
    name = parse_name(recorded.name) if recorded is not None else None
    runs.append(HistoryRun(name, report, current=True))
    history.runs = runs[-limit:]
    return history


# ------------------------------------------------------------------------------------------ series


@dataclass(frozen=True)
class MeasuredRow:
    """One measured test row of a recorded run, with the environment it was measured in."""

    row: dict[str, Any]
    environment: dict[str, Any]

    @property
    def hardware(self) -> str | None:
        """The row's hardware fingerprint (``compare.row_hardware``); None for a report older than it."""
        return row_hardware(self.row, self.environment)


def measured_rows(report: Mapping[str, Any]) -> list[MeasuredRow]:
    """The rows of ``report`` that hold a measurement, each with its environment (a shard's in a merged report)."""
    return [MeasuredRow(row, row_environment(report, row)) for row in _tests(report)
            if measurement_missing(row, "recorded") is None]


def same_series(first: MeasuredRow, second: MeasuredRow) -> bool:
    """Whether two measured rows of one node id are points of one series: the same hardware, model (name,
    revision, dtype, arguments), techniques and workload, judged as the window judges what it may pool
    (``compare.hardware_differences`` and ``compare.test_differences``). A stack change (torch, transformers)
    stays within a series: it is what a change point finds."""
    return not hardware_differences(first.row, first.environment, second.row, second.environment) \
        and not test_differences(first.row, second.row)


def _plural(count: Any, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


def _part(row: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``row[key]`` when it is an object (``model``, ``workload``), else empty."""
    part = row.get(key)
    return part if isinstance(part, dict) else {}


def series_keys(row: Mapping[str, Any]) -> dict[str, str]:
    """What makes a row's series, as text (the ``--format otava-csv`` columns and the JSON's ``keys``): ``model``,
    ``revision``, ``dtype``, ``model_arguments`` (JSON, sorted), ``techniques`` and ``baseline`` (joined by
    `` + ``), ``workload`` (``prompts=1 new_tokens=8 batch=1 input_tokens=6``); an unrecorded part is empty."""
    model, workload = _part(row, "model"), _part(row, "workload")
    arguments = model.get("arguments")
    parts = (("prompts", "num_prompts"), ("new_tokens", "max_new_tokens"), ("batch", "batch_size"),
             ("input_tokens", "input_tokens"))
    return {
        "model": str(model.get("name_or_path") or ""), "revision": str(model.get("revision") or ""),
        "dtype": str(model.get("dtype") or ""),
        "model_arguments": json.dumps(arguments, sort_keys=True, default=str) if arguments else "",
        "techniques": " + ".join(map(str, row.get("techniques") or [])),
        "baseline": " + ".join(map(str, row.get("baseline_techniques") or [])),
        "workload": " ".join(f"{label}={workload[key]}" for label, key in parts if workload.get(key) is not None),
    }


def series_name(row: Mapping[str, Any]) -> str:
    """``tiny-random-llama float32, sdpa vs eager, 1 prompt x 8 new tokens``: a series named by its model (with
    its revision and arguments when set), techniques against the baseline, and workload."""
    keys = series_keys(row)
    model = keys["model"] or "model unknown"
    model += f"@{keys['revision']}" if keys["revision"] else ""
    model += f" {keys['dtype']}" if keys["dtype"] else ""
    model += f" {keys['model_arguments']}" if keys["model_arguments"] else ""
    techniques = (keys["techniques"] or "no technique") + (f" vs {keys['baseline']}" if keys["baseline"] else "")
    workload = _part(row, "workload")
    work = []
    if workload.get("num_prompts") is not None and workload.get("max_new_tokens") is not None:
        work.append(f"{_plural(workload['num_prompts'], 'prompt')} x {workload['max_new_tokens']} new tokens")
    if workload.get("batch_size") not in (None, 1):
        work.append(f"batch {workload['batch_size']}")
    return ", ".join([model, techniques, *work])


# ------------------------------------------------------------------------------------------ trends


@dataclass(frozen=True)
class TrendPoint:
    """One run's figures for one test; ``run`` indexes ``History.runs``."""

    run: int
    latency_s: float | None
    latency_range: tuple[float, float] | None  # the whisker
    range_kind: str | None  # what the whisker is: "95% interval ..." or "min-max ..."
    peak_memory_bytes: float | None


@dataclass
class Trend:
    nodeid: str
    hardware: str | None
    points: list[TrendPoint] = field(default_factory=list)


def latency_range(samples: Any) -> tuple[tuple[float, float], str] | None:
    """The whisker of one run's optimized latency: the 95% bootstrap interval of the median of its rounds
    (``verdict.stats``, the one the speedup uses) from ``MIN_BOOTSTRAP_SAMPLES`` rounds up, else the rounds'
    min-max, said so; None for fewer than 2 rounds."""
    if not isinstance(samples, list):
        return None
    values = [v for v in (finite_number(s) for s in samples) if v is not None and v > 0]
    if len(values) >= MIN_BOOTSTRAP_SAMPLES:
        # the median over a denominator of ones, resampled in pairs: the interval of the median itself
        interval = median_ratio_interval(values, [1.0] * len(values), paired=True)
        if interval is not None:
            return interval, f"95% interval of the median (bootstrap over {len(values)} rounds)"
    if len(values) >= 2:
        return (min(values), max(values)), f"min-max of {len(values)} rounds (too few for an interval)"
    return None


def _point(run: int, test: Mapping[str, Any]) -> TrendPoint | None:
    optimized = test.get("optimized")
    if not isinstance(optimized, dict):
        return None
    latency = finite_number(optimized.get("latency_s"))
    memory = finite_number(optimized.get("peak_memory_bytes"))
    if latency is None and memory is None:
        return None
    whisker = latency_range(optimized.get("latency_samples_s")) if latency is not None else None
    return TrendPoint(run, latency, whisker[0] if whisker else None, whisker[1] if whisker else None, memory)


def trends(history: History) -> list[Trend]:
    """One trend per test of the current run (the last), keyed by node id and hardware, with a point for
    each run in which that test on that hardware has an optimized figure in the same series (``same_series``)
    as its newest measured row."""
    if not history.runs:
        return []
    keys: dict[tuple[str, Any], Trend] = {}
    for test in _tests(history.runs[-1].report):
        keys.setdefault((test["nodeid"], test.get("hardware")), Trend(test["nodeid"], test.get("hardware")))
    # each trend follows one series: the newest measured row's model, techniques and workload (a run of another
    # model under the same node id is not a point of it)
    series: dict[tuple[str, Any], MeasuredRow] = {}
    for run in reversed(history.runs):
        for measured in measured_rows(run.report):
            series.setdefault((measured.row["nodeid"], measured.row.get("hardware")), measured)
    for index, run in enumerate(history.runs):
        seen: set[tuple[str, Any]] = set()
        for measured in measured_rows(run.report):
            test = measured.row
            key = (test["nodeid"], test.get("hardware"))
            if key in keys and key not in seen and same_series(series[key], measured):
                seen.add(key)  # a report holds a (test, hardware) once; a crafted one, first wins
                point = _point(index, test)
                if point is not None:
                    keys[key].points.append(point)
    return list(keys.values())


def _tests(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    tests = report.get("tests")
    return [t for t in tests if isinstance(t, dict) and isinstance(t.get("nodeid"), str)] \
        if isinstance(tests, list) else []
