"""``pytest-opt history DIR``: change points of a history folder, dated, from the command line.

The folder holds crafted reports (``ab_reports``'s schema-valid rows) under the names ``--opt-history``
gives its runs, so each test knows the step it must find: a slower ``test_sdpa`` from run 20 on, commit by
commit. ``cli.main`` runs in this process (capsys); one run goes through ``python -m`` for the exit status.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ab_reports import report, row

from pytest_transformers_opt.cli import main
from pytest_transformers_opt.report.schema import validate_report

START = dt.datetime(2025, 6, 1, 8, 0, tzinfo=dt.timezone.utc)
RUNS, STEP_AT = 30, 20
SDPA, AGAIN = "tests/test_x.py::test_sdpa", "tests/test_x.py::test_sdpa_again"
SERIES = "tiny-random-llama float32, sdpa vs eager, 1 prompt x 8 new tokens"  # ab_reports' rows
HEADING = {test: f"{test} [CPU: Test CPU] {SERIES}: {RUNS} runs (20250601T080000Z-c000000 .. 20250601T223000Z-c000029)"
           for test in (SDPA, AGAIN)}
STEP_LINE = "  latency: +"
STEP_RUN = "at run 20250601T180000Z-c000020 (2025-06-01 18:00:00 UTC, commit c000020; commits c000019..c000020)"


def _name(n: int) -> str:
    return f"{(START + dt.timedelta(minutes=30 * n)):%Y%m%dT%H%M%SZ}-c{n:06d}.json"


def _rounds(rng: random.Random, level: float) -> list[float]:
    center = level * (1 + rng.gauss(0, 0.03))
    return [center * (1 + 0.005 * k) for k in (-2, -1, 0, 1, 2)]


def _run(n: int, rng: random.Random) -> dict[str, Any]:
    """Run ``n``: test_sdpa 10% slower from ``STEP_AT`` on, test_sdpa_again flat, both on the same CPU."""
    made = report(row(SDPA, _rounds(rng, 0.1 * (1.1 if n >= STEP_AT else 1.0)), None),
                  row(AGAIN, _rounds(rng, 0.2), None))
    made["created"] = (START + dt.timedelta(minutes=30 * n)).isoformat()
    return made


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    history = tmp_path / "history"
    history.mkdir()
    rng = random.Random(21)
    for n in range(RUNS):
        made = _run(n, rng)
        validate_report(made)  # what load_history will check: a crafted history the reader takes
        (history / _name(n)).write_text(json.dumps(made), encoding="utf-8")
    return history


def history(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    status = main(["history", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_step_is_found_and_dated_with_its_commit_range(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = history(capsys, folder)
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (f"history {folder}: {RUNS} runs read ({_name(0)} .. {_name(RUNS - 1)}), "
                        f"2 series of 2 tests (a series: one hardware, model, techniques and workload)")
    [step] = [line for line in lines if " latency: +" in line]
    assert step.startswith(STEP_LINE) and STEP_RUN in step and ", worse)" in step
    p_value = float(step.rsplit("p=", 1)[1])
    assert 0 < p_value <= 0.001
    assert lines[1:-1] == [HEADING[SDPA], step] + [
        f"  {metric}: no change point in {RUNS} runs" for metric in ("peak_memory", "kl_mean", "speedup")] + [
        HEADING[AGAIN]] + [
        f"  {metric}: no change point in {RUNS} runs" for metric in ("latency", "peak_memory", "kl_mean", "speedup")]
    assert lines[-1] == "1 change point in 8 figures of 2 series"


def test_test_and_metric_choose_the_series(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = history(capsys, folder, "--test", SDPA, "--metric", "latency", "--metric", "speedup")
    lines = out.splitlines()
    assert status == 0 and lines[0].endswith("1 series of 1 test (a series: one hardware, model, techniques and workload)")
    assert lines[1] == HEADING[SDPA] and [line.split(":")[0].strip() for line in lines[2:-1]] == ["latency", "speedup"]
    assert lines[2].startswith(STEP_LINE) and lines[3] == f"  speedup: no change point in {RUNS} runs"
    status, out, _ = history(capsys, folder, "--test", "again", "--metric", "latency")
    assert status == 0 and out.splitlines()[1:] == [
        HEADING[AGAIN], f"  latency: no change point in {RUNS} runs", "0 change points in 1 figure of 1 series"]
    status, _, err = history(capsys, folder, "--test", "test_nothing")
    assert status == 2 and err == ("pytest-opt history: error: --test 'test_nothing': no measured test of the "
                                   f"{RUNS} runs read matches\n")


def test_json_holds_every_series_and_the_change_points_fields(folder: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = history(capsys, folder, "--json", "--metric", "latency")
    assert (status, err) == (0, "")
    document = json.loads(out)
    assert (document["folder"], document["runs_read"], document["left_out"]) == (str(folder), RUNS, [])
    assert document["method"]["max_p_value"] == 0.001 and document["method"]["permutations"] == 1999
    sdpa, again = document["series"]
    assert (sdpa["nodeid"], sdpa["hardware"], sdpa["metric"], again["nodeid"]) == (SDPA, "CPU: Test CPU", "latency",
                                                                                    AGAIN)
    assert sdpa["series"] == SERIES and sdpa["keys"] == {
        "model": "tiny-random-llama", "revision": "", "dtype": "float32", "model_arguments": "", "techniques": "sdpa",
        "baseline": "eager", "workload": "prompts=1 new_tokens=8 batch=1 input_tokens=6"}
    assert sdpa["runs"] == [_name(n) for n in range(RUNS)] and len(sdpa["values"]) == RUNS
    assert again["change_points"] == [] and again["note"] is None
    [point] = sdpa["change_points"]
    assert point["index"] == STEP_AT and point["commit_range"] == "c000019..c000020"
    assert point["run"] == {"name": _name(STEP_AT), "time": "2025-06-01T18:00:00+00:00", "commit": "c000020",
                            "dirty": False, "future": False}
    assert point["previous_run"]["name"] == _name(STEP_AT - 1)
    assert (point["before_runs"], point["after_runs"]) == (STEP_AT, RUNS - STEP_AT)
    assert point["interval"][0] <= 0.1 <= point["interval"][1] and point["interval"][0] < point["change"]
    assert point["after_median"] / point["before_median"] - 1 == pytest.approx(point["change"])
    assert 0 < point["p_value"] <= document["method"]["max_p_value"] and point["worse"] is True
    assert json.loads(history(capsys, folder, "--format", "json", "--metric", "latency")[1]) == document


def test_otava_csv_is_one_row_per_run_oldest_first(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = history(capsys, folder, "--format", "otava-csv", "--test", SDPA)
    assert (status, err) == (0, "")
    rows = list(csv.reader(io.StringIO(out)))
    keys = ["test", "hardware", "model", "revision", "dtype", "model_arguments", "techniques", "baseline", "workload"]
    assert rows[0] == ["time", "commit", *keys, "latency", "peak_memory", "kl_mean", "speedup"]
    assert {tuple(r[2:11]) for r in rows[1:]} == {(SDPA, "CPU: Test CPU", "tiny-random-llama", "", "float32", "",
                                                   "sdpa", "eager", "prompts=1 new_tokens=8 batch=1 input_tokens=6")}
    assert len(rows) == RUNS + 1
    times = [dt.datetime.fromisoformat(r[0]) for r in rows[1:]]
    assert times == sorted(times) and times[0] == START and all(t.utcoffset() == dt.timedelta(0) for t in times)
    assert [r[1] for r in rows[1:]] == [f"c{n:06d}" for n in range(RUNS)]
    latency = [float(r[11]) for r in rows[1:]]
    assert statistics.median(latency[STEP_AT:]) / statistics.median(latency[:STEP_AT]) == pytest.approx(1.1, abs=0.03)
    assert [float(r[14]) for r in rows[1:]] == [1.2] * RUNS  # the crafted rows' speedup
    status, out, _ = history(capsys, folder, "--format", "otava-csv", "--test", SDPA, "--metric", "speedup")
    assert status == 0 and out.splitlines()[:2] == [
        f"time,commit,{','.join(keys)},speedup",
        f"2025-06-01T08:00:00+00:00,c000000,{SDPA},CPU: Test CPU,tiny-random-llama,,float32,,sdpa,eager,"
        f"prompts=1 new_tokens=8 batch=1 input_tokens=6,1.2"]
    status, out, err = history(capsys, folder, "--format", "otava-csv", "--test", "test_sdpa")
    assert (status, out) == (2, "") and err.count("\n") == 1
    assert "Otava reads one series per CSV file and 2 series match" in err and "--test" in err


def test_a_long_history_says_when_reading_starts_and_the_json_when_it_ends(
        folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(5)
    for n in range(RUNS, RUNS + 12):  # past the 40 runs read without a word
        (folder / _name(n)).write_text(json.dumps(_run(n, rng)), encoding="utf-8")
    status, out, err = history(capsys, folder, "--json", "--metric", "latency")
    assert status == 0 and len(json.loads(out)["series"][0]["values"]) == RUNS + 12
    started, ended = err.splitlines()
    assert started == f"reading {RUNS + 12} recorded runs in {folder} ..."
    assert ended.startswith(f"read {RUNS + 12} runs and analysed 2 series in ") and ended.endswith(" s")
    status, out, err = history(capsys, folder, "--limit", "40", "--metric", "latency")
    assert (status, err) == (0, "") and f": 40 runs read ({_name(2)} .. " in out.splitlines()[0]


def test_unreadable_files_are_left_out_one_line_each_and_the_rest_analysed(
        folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (folder / _name(5)).write_text("{not json", encoding="utf-8")
    crafted = json.loads((folder / _name(6)).read_text(encoding="utf-8"))
    crafted["tests"][0]["speedup"] = "fast"  # the wrong type: the schema refuses the whole report
    (folder / _name(6)).write_text(json.dumps(crafted), encoding="utf-8")
    (folder / "notes.txt").write_text("not a run\n", encoding="utf-8")  # no history name: not read at all
    status, out, err = history(capsys, folder, "--metric", "latency")
    assert status == 0
    left = err.splitlines()
    assert len(left) == 2 and all(line.startswith("left out: ") for line in left)
    assert left[0].startswith(f"left out: {_name(6)}: ") and "speedup" in left[0]
    assert left[1].startswith(f"left out: {_name(5)}: ") and "JSON" in left[1]
    lines = out.splitlines()
    assert f": {RUNS - 2} runs read" in lines[0]
    [step] = [line for line in lines if line.startswith(STEP_LINE)]
    assert STEP_RUN in step
    assert lines[-1] == "1 change point in 2 figures of 2 series"


@pytest.mark.parametrize("argv, needle", [
    (["history", "{missing}"], "{missing}' does not exist; give the folder pytest --opt-history=DIR"),
    (["history", "{empty}"], "holds no recorded run (files named like 20261201T131500Z-1a2b3c4.json)"),
    (["history", "{folder}", "--metric", "throughput"], "argument --metric: invalid choice: 'throughput'"),
    (["history", "{folder}", "--limit", "0"], "--limit"),
    (["history", "{folder}", "--json", "--format", "otava-csv"], "--json and --format otava-csv: choose one"),
    (["history"], "the following arguments are required: DIR"),
])
def test_bad_usage_is_one_line_and_exit_status_2(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 argv: list[str], needle: str) -> None:
    (tmp_path / "empty").mkdir()
    places = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "folder": folder}
    status = main([arg.format(**places) for arg in argv])
    out, err = capsys.readouterr()
    assert (status, out) == (2, "") and err.count("\n") == 1 and err.startswith("pytest-opt")
    assert needle.format(**places) in err


def test_every_run_unreadable_is_exit_status_2_after_naming_them(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for n in range(2):
        (tmp_path / _name(n)).write_text("[]", encoding="utf-8")
    status, out, err = history(capsys, tmp_path)
    lines = err.splitlines()
    assert (status, out, len(lines)) == (2, "", 3)
    assert lines[0].startswith(f"left out: {_name(1)}: ") and lines[1].startswith(f"left out: {_name(0)}: ")
    assert lines[2].startswith("pytest-opt history: error: none of the 2 recorded runs read in ")


def test_without_ruptures_it_names_the_extra_and_the_csv_still_works(
        folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ruptures", None)  # as if not installed
    status, out, err = history(capsys, folder)
    assert (status, out) == (2, "")
    assert err == ("pytest-opt history: error: change points need the ruptures package, which is not installed: "
                   "pip install \"pytest-transformers-opt[history]\"\n")
    status, out, _ = history(capsys, folder, "--format", "otava-csv", "--test", SDPA, "--metric", "latency")
    assert status == 0 and len(out.splitlines()) == RUNS + 1


def test_the_console_command_exits_0_and_2(folder: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "pytest_transformers_opt", "history"]
    done = subprocess.run([*command, str(folder), "--test", SDPA, "--metric", "latency"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert STEP_RUN in done.stdout and done.stdout.splitlines()[-1] == "1 change point in 1 figure of 1 series"
    done = subprocess.run([*command, str(tmp_path / "missing")], capture_output=True, text=True, timeout=120,
                          check=False)
    assert (done.returncode, done.stdout, done.stderr.count("\n")) == (2, "", 1)


def test_a_short_history_with_an_obvious_step_finds_it_at_its_run(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Red-team finding 3 (issue 40), as the user hit it: 8 runs, 27-31 ms then 44-52 ms, was "no change point in 8
    runs" (the ranks of 8 runs cannot reach p <= 0.001), where Otava reports +65.6% at the fifth run's commit."""
    for n, latency_ms in enumerate([27.1, 29.4, 30.8, 27.9, 44.2, 51.6, 47.3, 47.7]):
        made = report(row(SDPA, [latency_ms / 1000 * (1 + 0.005 * k) for k in (-2, -1, 0, 1, 2)], None))
        made["created"] = (START + dt.timedelta(minutes=30 * n)).isoformat()
        (tmp_path / _name(n)).write_text(json.dumps(made), encoding="utf-8")
    status, out, err = history(capsys, tmp_path, "--metric", "latency")
    assert (status, err) == (0, "")
    heading, step = out.splitlines()[1:3]
    assert heading.startswith(f"{SDPA} [CPU: Test CPU] {SERIES}: 8 runs")
    assert step.startswith("  latency: +65.") and "(28.6 ms -> 47.5 ms, worse)" in step
    assert ("at run 20250601T100000Z-c000004 (2025-06-01 10:00:00 UTC, commit c000004; commits c000003..c000004)"
            in step)
    assert float(step.rsplit("p=", 1)[1]) <= 0.001
    assert out.splitlines()[-1] == "1 change point in 1 figure of 1 series"
