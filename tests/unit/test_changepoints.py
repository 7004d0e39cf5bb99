"""``report.changepoints``: change points of a recorded history's series, found by ruptures, kept by a
permutation test, sized with an interval; seeded series, so every outcome here is fixed."""

from __future__ import annotations

import datetime as dt
import random
import re
import sys

import pytest

from pytest_transformers_opt import cli
from pytest_transformers_opt.errors import OptConfigError
from pytest_transformers_opt.report import changepoints
from pytest_transformers_opt.report.changepoints import (MIN_RUNS, Series, TrackedTest, analyse, describe, detect,
                                                          figures_of, select_tracks, to_json)
from pytest_transformers_opt.report.history import RunName

START = dt.datetime(2025, 3, 1, 12, 0, tzinfo=dt.timezone.utc)


def noisy(seed: int, count: int, *, cv: float = 0.03, steps: dict[int, float] | None = None) -> list[float]:
    """``count`` values around 1.0 with gaussian noise; ``steps`` multiplies from an index on (index: factor)."""
    rng = random.Random(seed)
    values = []
    for n in range(count):
        level = 1.0
        for at, factor in (steps or {}).items():
            level *= factor if n >= at else 1.0
        values.append(level * (1.0 + rng.gauss(0.0, cv)))
    return values


def series(values: list[float], metric: str = "latency") -> Series:
    runs = tuple(RunName(f"{(START + dt.timedelta(hours=n)):%Y%m%dT%H%M%SZ}-{n:07x}.json",
                         START + dt.timedelta(hours=n), commit=f"{n:07x}") for n in range(len(values)))
    return Series("tests/test_x.py::test_sdpa", "CPU: Test CPU", metric, runs, tuple(values))


def test_a_clear_step_is_found_at_its_run_with_an_interval_holding_its_size() -> None:
    analysis = analyse(series(noisy(1, 30, steps={18: 1.2})))
    assert [point.index for point in analysis.change_points] == [18]
    point = analysis.change_points[0]
    assert point.run.name == "20250302T060000Z-0000012.json" and point.previous.commit == "0000011"
    assert point.commit_range == "0000011..0000012"
    assert (point.before_runs, point.after_runs) == (18, 12)
    assert point.interval is not None and point.interval[0] <= 0.2 <= point.interval[1]
    assert point.change == pytest.approx(0.2, abs=0.04)
    assert point.p_value <= changepoints.MAX_P_VALUE and point.worse is True
    [line] = describe(analysis)
    assert line.startswith("latency: +")
    assert "at run 20250302T060000Z-0000012 (2025-03-02 06:00:00 UTC, commit 0000012; commits 0000011..0000012)" in line
    assert line.endswith(f"p={point.p_value:.2g}") and ", worse)" in line


def test_two_steps_are_both_found_and_sized_between_their_neighbours() -> None:
    analysis = analyse(series(noisy(4, 45, steps={15: 1.15, 30: 0.8}), metric="speedup"))
    assert [point.index for point in analysis.change_points] == [15, 30]
    first, second = analysis.change_points
    assert (first.before_runs, first.after_runs, second.before_runs, second.after_runs) == (15, 15, 15, 15)
    assert first.worse is False and second.worse is True  # speedup: up is better
    assert second.change == pytest.approx(-0.2, abs=0.04)


@pytest.mark.parametrize("seed", range(5))
def test_a_flat_noisy_series_has_no_change_point(seed: int) -> None:
    analysis = analyse(series(noisy(100 + seed, 60, cv=0.05)))
    assert analysis.change_points == () and analysis.note is None
    assert describe(analysis) == ["latency: no change point in 60 runs"]


def test_one_slow_run_is_not_a_change_point() -> None:
    values = noisy(7, 40)
    values[25] *= 3  # a runner that was busy once
    assert analyse(series(values)).change_points == ()


def test_a_short_series_is_not_searched_and_says_so() -> None:
    values = [1.0, 1.0, 1.0, 2.0, 2.0][: MIN_RUNS - 1]
    assert detect(values) == []
    analysis = analyse(series(values))
    assert analysis.change_points == ()
    assert analysis.note == f"too few runs ({MIN_RUNS - 1}) to look for a change point: needs {MIN_RUNS}"
    assert describe(analysis) == [f"latency: {analysis.note}"]


def test_a_constant_series_has_none_and_a_rare_memory_step_is_found() -> None:
    assert detect([5.0] * 20) == []
    # more than half the values equal: no MAD, the standard deviation is the scale
    memory = [100.0 * 2**20] * 20 + [120.0 * 2**20] * 8
    [split] = detect(memory)
    assert split.index == 20
    [line] = describe(analyse(series(memory, metric="peak_memory")))
    assert "peak_memory: +20.0% [+20.0%, +20.0%] (100.00 MiB -> 120.00 MiB, worse)" in line


def test_a_change_from_zero_has_no_relative_size_but_its_medians() -> None:
    values = [0.0] * 15 + [0.002] * 10
    [point] = analyse(series(values, metric="kl_mean")).change_points
    assert (point.change, point.interval, point.before_median, point.after_median) == (None, None, 0.0, 0.002)
    assert describe(analyse(series(values, metric="kl_mean")))[0].startswith("kl_mean: change (0 -> 0.002, worse) at run")


def test_the_same_values_give_the_same_answer() -> None:
    values = noisy(9, 40, cv=0.04, steps={20: 1.08})
    first = to_json(analyse(series(values)))
    analyse(series(noisy(10, 50)))  # other work between: the seed comes from the values
    assert to_json(analyse(series(values))) == first
    assert first["change_points"] and first["change_points"][0]["p_value"] > 0


def test_figures_of_a_row_keep_only_finite_numbers() -> None:
    row = {"optimized": {"latency_s": 0.1, "peak_memory_bytes": float("inf")}, "speedup": True,
           "similarity": {"kl_mean": 0.001}}
    assert figures_of(row) == {"latency": 0.1, "kl_mean": 0.001}
    assert figures_of({"optimized": None, "similarity": "x", "speedup": 1.5}) == {"speedup": 1.5}


def test_a_full_node_id_selects_only_its_test() -> None:
    tracks = [TrackedTest("t.py::test_sdpa", "A100"), TrackedTest("t.py::test_sdpa", "H100"),
              TrackedTest("t.py::test_sdpa_again", "H100"), TrackedTest("t.py::other", None)]
    assert [t.label for t in select_tracks(tracks, test="t.py::test_sdpa")] == ["t.py::test_sdpa [A100]",
                                                                               "t.py::test_sdpa [H100]"]
    assert len(select_tracks(tracks, test="test_sdpa")) == 3
    assert [t.label for t in select_tracks(tracks, test="test_sdpa", hardware="H1")] == [
        "t.py::test_sdpa [H100]", "t.py::test_sdpa_again [H100]"]
    assert select_tracks(tracks, hardware="CPU") == [] and len(select_tracks(tracks)) == 4
    assert tracks[3].label == "t.py::other [hardware unknown]"


def test_without_ruptures_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ruptures", None)  # as if not installed: importing it raises
    with pytest.raises(OptConfigError, match=r'ruptures .* pip install "pytest-transformers-opt\[history\]"'):
        detect(noisy(1, 20))


def test_the_command_offers_the_figures_the_module_reads() -> None:
    # the command names them without importing this module (the report stage loads on use)
    assert cli.HISTORY_METRICS == changepoints.METRICS
    assert set(figures_of({"optimized": {"latency_s": 1.0, "peak_memory_bytes": 2}, "speedup": 1.5,
                           "similarity": {"kl_mean": 0.0}})) == set(changepoints.METRICS)


def test_otava_csv_writes_only_runs_with_every_column_and_drops_a_figure_never_recorded() -> None:
    runs = [RunName(f"2025030{n + 1}T120000Z-00000{n}a.json", START + dt.timedelta(days=n), commit=f"00000{n}a",
                    dirty=n == 2) for n in range(3)]
    written = START + dt.timedelta(days=3)
    runs.append(RunName("20990101T000000Z.json", dt.datetime(2099, 1, 1, tzinfo=dt.timezone.utc), future=True,
                        written=written))  # a runner's clock was ahead: its row sits where it was recorded
    track = TrackedTest("t.py::test_x", "CPU: Test CPU", runs,
                        [{"latency": 0.1, "speedup": 1.5}, {"latency": 0.11}, {"latency": 0.12, "speedup": 1.4},
                         {"latency": 0.13, "speedup": 1.3}])
    keys = ",".join(changepoints.OTAVA_KEY_COLUMNS)
    assert keys == "test,hardware,model,revision,dtype,model_arguments,techniques,baseline,workload"
    unnamed = "t.py::test_x,CPU: Test CPU,,,,,,,"  # a track built without its rows: the model is not known
    assert changepoints.otava_csv(track).splitlines() == [
        f"time,commit,{keys},latency,speedup",
        f"2025-03-01T12:00:00+00:00,000000a,{unnamed},0.1,1.5",
        f"2025-03-03T12:00:00+00:00,000002a-dirty,{unnamed},0.12,1.4",
        f"2025-03-04T12:00:00+00:00,,{unnamed},0.13,1.3",
    ]
    assert changepoints.otava_csv(track, ["latency"]).count("\n") == 5
    with pytest.raises(OptConfigError, match="recorded none of the figures kl_mean"):
        changepoints.otava_csv(track, iter(["kl_mean"]))


def test_the_html_trend_chart_marks_each_change_point_with_its_size_and_run() -> None:
    """The HTML report's History section draws a dashed line between the last run before a change point and the
    first after it, in the panel of that figure, labelled with the step's size; a steady figure gets none."""
    import html as html_text

    from pytest_transformers_opt.report.history import History, HistoryRun
    from pytest_transformers_opt.report.html import history_section

    latencies = noisy(7, 16, cv=0.02, steps={10: 1.3})
    runs = []
    for n, latency in enumerate(latencies):
        name = series(latencies).runs[n]
        row = {"nodeid": "tests/test_x.py::test_sdpa", "hardware": "CPU: Test CPU",
               "optimized": {"latency_s": latency, "peak_memory_bytes": 2.0**20}}
        runs.append(HistoryRun(name, {"tests": [row], "created": name.moment.isoformat()}))
    page = "".join(history_section(History("hist", runs)))
    marks = re.findall(r'<g class="change-point (\w+)" data-run="([^"]+)" data-change="([^"]+)">', page)
    assert len(marks) == 1, marks
    kind, run, size = marks[0]
    assert (kind, run) == ("latency", runs[10].name.name)  # the first run after the step
    assert 20.0 < float(size.rstrip("%")) < 40.0  # the injected +30%
    title = html_text.unescape(re.search(r'class="change-point latency".*?<title>([^<]+)</title>', page).group(1))
    assert title.startswith(f"change point: latency {size} [") and "(p=" in title
    assert "A dashed line marks a change point" in page
