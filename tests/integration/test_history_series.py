"""A history's series: one per test, hardware, model, techniques and workload (red-team finding 6 of issue 40).

Runs of ``--opt-model=tiny-random-gpt2`` recorded in the same ``--opt-history`` folder as the default model's
joined its series under the one test id: ``pytest-opt history`` and Otava (through ``--format otava-csv``, which
had no model column) then reported a change point "at the model switch". Real sessions recorded as a user does,
then crafted histories (``ab_reports``' schema-valid rows) where the step each series must (not) show is known,
and the HTML report's trend of the current run's series.
"""

from __future__ import annotations

import copy
import csv
import datetime as dt
import io
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
from ab_reports import report, row

from pytest_transformers_opt.cli import main
from pytest_transformers_opt.report.history import History, HistoryRun, parse_name
from pytest_transformers_opt.report.html import history_section

START = dt.datetime(2026, 11, 2, 9, 0, tzinfo=dt.timezone.utc)
SDPA = "tests/test_x.py::test_sdpa"
USER_TESTS = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=2)
'''
KEY_COLUMNS = ["test", "hardware", "model", "revision", "dtype", "model_arguments", "techniques", "baseline",
               "workload"]


def history(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    status = main(["history", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def test_runs_of_another_model_under_the_same_test_id_are_another_series(
        pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]) -> None:
    """As the user hit it: the suite recorded with the default model, then with --opt-model=tiny-random-gpt2."""
    pytester.makepyfile(test_user=USER_TESTS)
    cheap = ("-p", "no:cacheprovider", "--opt-rounds=1", "--opt-warmup=0", "--opt-history=runs")
    pytester.runpytest(*cheap).assert_outcomes(passed=1)
    pytester.runpytest(*cheap, "--opt-model=tiny-random-gpt2").assert_outcomes(passed=1)
    capsys.readouterr()  # the sessions' own output
    folder = pytester.path / "runs"
    recorded = sorted(folder.iterdir())
    assert len(recorded) == 2
    models = [json.loads(path.read_text(encoding="utf-8"))["tests"][0]["model"]["name_or_path"] for path in recorded]
    assert models == ["tiny-random-llama", "tiny-random-gpt2"]

    status, out, err = history(capsys, folder, "--metric", "latency")
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].endswith("2 series of 1 test (a series: one hardware, model, techniques and workload)")
    headings = [line for line in lines[1:-1] if not line.startswith("  ")]
    assert len(headings) == 2
    for heading, model, path in zip(headings, models, recorded):  # each named by its model, each with its one run
        assert re.fullmatch(rf"test_user\.py::test_sdpa \[CPU: [^]]+\] {model} float32, sdpa vs eager, 3 prompts x 2 new "
                            rf"tokens, batch 3: 1 run \({path.name.removesuffix('.json')}\)", heading), heading
    assert lines[-1] == "0 change points in 2 figures of 2 series"

    status, out, err = history(capsys, folder, "--format", "otava-csv", "--test", "test_sdpa")
    assert (status, out) == (2, "") and err.count("\n") == 1
    assert "Otava reads one series per CSV file and 2 series match" in err
    assert "tiny-random-llama float32" in err and "tiny-random-gpt2 float32" in err and "--series" in err

    status, out, err = history(capsys, folder, "--format", "otava-csv", "--series", "tiny-random-gpt2",
                               "--metric", "latency")
    assert (status, err) == (0, "")
    header, *rows = list(csv.reader(io.StringIO(out)))
    assert header == ["time", "commit", *KEY_COLUMNS, "latency"]
    assert len(rows) == 1
    written = dict(zip(header, rows[0]))
    gpt2 = json.loads(recorded[1].read_text(encoding="utf-8"))["tests"][0]
    assert (written["test"], written["model"], written["dtype"], written["techniques"]) == (
        "test_user.py::test_sdpa", "tiny-random-gpt2", "float32", "sdpa")
    assert written["hardware"] == gpt2["hardware"] and float(written["latency"]) == gpt2["optimized"]["latency_s"]


def _rounds(rng: random.Random, level: float) -> list[float]:
    center = level * (1 + rng.gauss(0, 0.02))
    return [center * (1 + 0.005 * k) for k in (-2, -1, 0, 1, 2)]


def _switched_history(folder: Path, changed: dict[str, Any]) -> None:
    """16 runs of SDPA, flat at 100 ms; from run 8 on its row differs by ``changed`` and is 14% slower (what the
    other configuration costs): one series would hold a +14% step at run 8."""
    rng = random.Random(6)
    for n in range(16):
        made = report(row(SDPA, _rounds(rng, 0.100 * (1.14 if n >= 8 else 1.0)), None))
        if n >= 8:
            made["tests"][0].update(copy.deepcopy(changed))
        moment = START + dt.timedelta(hours=n)
        made["created"] = moment.isoformat()
        (folder / f"{moment:%Y%m%dT%H%M%SZ}-d{n:06d}.json").write_text(json.dumps(made), encoding="utf-8")


@pytest.mark.parametrize("changed, second", [
    ({"model": {"name_or_path": "tiny-random-gpt2", "revision": None, "dtype": "float32"}},
     "tiny-random-gpt2 float32, sdpa vs eager"),
    ({"model": {"name_or_path": "tiny-random-llama", "revision": None, "dtype": "bfloat16"}},
     "tiny-random-llama bfloat16, sdpa vs eager"),
    ({"techniques": ["static_cache"]}, "tiny-random-llama float32, static_cache vs eager"),
    ({"workload": {"num_prompts": 4, "max_new_tokens": 8, "batch_size": 4, "input_tokens": 6}},
     "tiny-random-llama float32, sdpa vs eager, 4 prompts x 8 new tokens, batch 4"),
])
def test_a_switch_of_model_dtype_technique_or_workload_is_a_new_series_not_a_change_point(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], changed: dict[str, Any], second: str) -> None:
    _switched_history(tmp_path, changed)
    status, out, err = history(capsys, tmp_path, "--metric", "latency")
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert lines[1].startswith(f"{SDPA} [CPU: Test CPU] tiny-random-llama float32, sdpa vs eager, 1 prompt x 8 new "
                               f"tokens: 8 runs (20261102T090000Z-d000000 .. 20261102T160000Z-d000007)")
    assert lines[2] == "  latency: no change point in 8 runs"
    assert lines[3].startswith(f"{SDPA} [CPU: Test CPU] {second}") and ": 8 runs (20261102T170000Z-d000008 .. " in lines[3]
    assert lines[4] == "  latency: no change point in 8 runs"
    assert lines[-1] == "0 change points in 2 figures of 2 series"
    document = json.loads(history(capsys, tmp_path, "--json", "--metric", "latency")[1])
    assert [len(series["values"]) for series in document["series"]] == [8, 8]
    assert document["series"][1]["series"].startswith(second)


def test_a_stack_change_stays_in_the_series_and_is_its_change_point(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """What a history is for: the same configuration slower since a torch upgrade is one series with a step."""
    _switched_history(tmp_path, {})
    for path in sorted(tmp_path.iterdir())[8:]:
        made = json.loads(path.read_text(encoding="utf-8"))
        made["environment"]["torch"] = "2.14.0"
        path.write_text(json.dumps(made), encoding="utf-8")
    status, out, _ = history(capsys, tmp_path, "--metric", "latency")
    lines = out.splitlines()
    assert status == 0 and lines[1].endswith("16 runs (20261102T090000Z-d000000 .. 20261103T000000Z-d000015)")
    size = float(re.match(r"  latency: ([+-][0-9.]+)%", lines[2]).group(1))
    assert size == pytest.approx(14, abs=3) and "commits d000007..d000008" in lines[2]
    assert lines[-1] == "1 change point in 1 figure of 1 series"


def test_the_csv_of_one_series_holds_only_its_runs_and_names_it(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    _switched_history(tmp_path, {"model": {"name_or_path": "tiny-random-gpt2", "revision": None, "dtype": "float32"}})
    status, out, err = history(capsys, tmp_path, "--format", "otava-csv", "--test", SDPA, "--series", "llama")
    assert (status, err) == (0, "")
    header, *rows = list(csv.reader(io.StringIO(out)))
    assert header[:11] == ["time", "commit", *KEY_COLUMNS]
    assert [r[1] for r in rows] == [f"d{n:06d}" for n in range(8)]
    assert {r[header.index("model")] for r in rows} == {"tiny-random-llama"}
    status, out, err = history(capsys, tmp_path, "--series", "tiny-random-phi3")
    assert (status, out) == (2, "")
    assert err == ("pytest-opt history: error: --series 'tiny-random-phi3': no measured test of the 16 runs read "
                   "matches\n")


def test_the_html_trend_follows_the_current_runs_series() -> None:
    """The HTML report's trend of a test draws the runs of this run's model only: no step at the model switch."""
    runs = []
    for n in range(12):
        made = report(row(SDPA, [0.100 * (1.3 if n >= 6 else 1.0)] * 5, None))
        if n >= 6:
            made["tests"][0]["model"]["name_or_path"] = "tiny-random-gpt2"
        moment = START + dt.timedelta(hours=n)
        made["created"] = moment.isoformat()
        runs.append(HistoryRun(parse_name(f"{moment:%Y%m%dT%H%M%SZ}.json"), made, current=n == 11))
    page = "".join(history_section(History("hist", runs)))
    drawn = re.findall(r'class="point latency(?: current)?" data-run="([^"]+)"', page)
    assert drawn == [f"{(START + dt.timedelta(hours=n)):%Y%m%dT%H%M%SZ}.json" for n in range(6, 12)]
    assert 'class="change-point' not in page
