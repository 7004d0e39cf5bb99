"""benchmarks/history_study.py's pure pieces, without a pytest session: its arguments, the mapping of
``pytest-opt history --json`` change points to the sessions that recorded them, and the counting of window
verdicts from crafted JSON reports as issue 21's goals read them, and a kept folder's sessions read again."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from benchmark_scripts import load_script  # tests/ is on sys.path (pytest's rootdir conftest import)

history_study = load_script("history_study")


def test_arguments_need_a_mode_and_a_slowed_session_inside_the_history(capsys: pytest.CaptureFixture[str]) -> None:
    args = history_study.parse_args(["--changepoint", "--", "--opt-warmup=1"])
    assert (args.sessions, args.slow_from, args.slowdown, args.rounds, args.threads) == (30, 20, 20.0, "5", "1")
    assert args.techniques == "sdpa,static_cache" and args.pytest_args == ["--opt-warmup=1"]
    window = history_study.parse_args(["--window", "--sessions-null", "2", "--sessions-slowed", "1", "--warm", "3"])
    assert (window.sessions_null, window.sessions_slowed, window.warm, window.window_size, window.confirm) == (2, 1, 3, 10, "0")
    for argv in ([], ["--changepoint", "--window"], ["--changepoint", "--sessions", "10", "--slow-from", "11"]):
        with pytest.raises(SystemExit):
            history_study.parse_args(argv)
    assert "--slow-from 11" in capsys.readouterr().err
    source = history_study.project_source("tiny-random-llama", ["sdpa", "static_cache"], 32)
    ast.parse(source)
    ast.parse(history_study.CONFTEST)
    assert 'optimization(\'static_cache\', "history_slowdown")' in source and "def test_static_cache(" in source


def _point(name: str, change: float, p: float) -> dict[str, Any]:
    return {"index": 0, "run": {"name": name}, "change": change, "interval": [change - 0.05, change + 0.05],
            "p_value": p, "worse": change > 0, "before_median": 0.04, "after_median": 0.04 * (1 + change)}


def test_change_points_map_to_the_session_that_recorded_their_first_run() -> None:
    sessions = [history_study.Session(n, "null", 0, 1.0, None, f"20261202T0400{n:02d}Z.json") for n in range(1, 31)]
    sessions[4].recorded = None  # a session that recorded nothing is not in the mapping
    session_of = history_study.session_numbers(sessions)
    assert session_of["20261202T040020Z.json"] == 20 and "20261202T040005Z.json" not in session_of
    document = {"series": [
        {"nodeid": "test_h.py::test_sdpa", "hardware": "CPU", "metric": "latency", "runs": list(session_of),
         "note": None, "change_points": [_point("20261202T040021Z.json", 0.2, 0.0005)]},
        {"nodeid": "test_h.py::test_sdpa", "hardware": "CPU", "metric": "speedup", "runs": list(session_of),
         "note": None, "change_points": [_point("20261202T040023Z.json", -0.16, 0.0005),
                                         _point("not-ours.json", 0.1, 0.001)]},
        {"nodeid": "test_h.py::test_sdpa", "hardware": "CPU", "metric": "kl_mean", "runs": [], "note": "too few runs",
         "change_points": []},
    ]}
    latency, speedup, kl = history_study.series_rows(document, session_of)
    assert (latency.test, latency.metric, latency.runs) == ("test_sdpa", "latency", 29)
    assert latency.points[0].session == 21 and latency.points[0].interval == pytest.approx((0.15, 0.25))
    assert history_study.found_at(latency, 20) and not history_study.found_at(latency, 19)
    assert [p.session for p in speedup.points] == [23, None] and not history_study.found_at(speedup, 20)
    assert not kl.points and kl.note == "too few runs" and not history_study.found_at(kl, 20)


def _report(*tests: dict[str, Any] | None) -> dict[str, Any]:
    rows = []
    for judged in tests:
        if judged is None:
            rows.append({"nodeid": "t::x", "regression": {"verdict": "new"}})
        else:
            rows.append({"nodeid": "t::x", "regression": {
                "verdict": "?", "judged": [{"metric": metric, "verdict": verdict} for metric, verdict in judged.items()]}})
    return {"tests": rows}


def test_window_verdicts_are_counted_per_threshold_and_read_against_the_goals() -> None:
    Session = history_study.Session
    ok = {"speedup": "ok", "latency": "ok"}
    sessions = [
        Session(1, "warm-up", 0, 1.0, {"tests": [{"nodeid": "t::x"}]}),  # not judged: left out
        Session(2, "null", 0, 1.0, _report(ok, ok)),
        Session(3, "null", 1, 1.0, _report(ok, {"speedup": "regressed", "latency": "inconclusive"})),
        Session(4, "null", 0, 1.0, _report(ok, None)),  # a test without judged figures: "new", counted as other
        Session(5, "slowed", 1, 1.0, _report({"speedup": "regressed", "latency": "regressed"},
                                             {"speedup": "regressed", "latency": "inconclusive"})),
        Session(6, "slowed", 0, 1.0, _report({"speedup": "ok", "latency": "ok"}, {"speedup": "inconclusive",
                                                                                 "latency": "regressed"})),
        Session(7, "slowed", 0, 1.0, None),  # no report at all
    ]
    assert history_study.threshold_verdicts(_report(ok, None)) == {"speedup": ["ok", "new"], "latency": ["ok", "new"]}
    one_off = {"tests": [{"nodeid": "t::x", "regression": {  # --opt-compare-confirm=1: not regressed again
        "verdict": "ok", "confirmed": False, "first_verdict": "regressed",
        "judged": [{"metric": "latency", "verdict": "regressed", "ratio": 1.2, "detectable": 14.0}]}}]}
    assert history_study.threshold_verdicts(one_off, ("latency",)) == {"latency": ["one-off"]}
    tallies = history_study.window_tallies(sessions)
    assert set(tallies) == {("null", "speedup"), ("null", "latency"), ("slowed", "speedup"), ("slowed", "latency")}
    null_speed, null_latency = tallies[("null", "speedup")], tallies[("null", "latency")]
    assert (null_speed.sessions, null_speed.any_regressed, null_speed.all_ok, null_speed.other) == (3, 1, 1, 1)
    assert (null_latency.any_regressed, null_latency.any_inconclusive, null_latency.all_ok) == (0, 1, 1)
    slowed_speed, slowed_latency = tallies[("slowed", "speedup")], tallies[("slowed", "latency")]
    assert (slowed_speed.sessions, slowed_speed.any_regressed, slowed_speed.any_inconclusive, slowed_speed.other) == (3, 1, 1, 1)
    assert slowed_latency.tests == {"regressed": 2, "inconclusive": 1, "ok": 1}
    null_latency.add_entries(history_study.judged_entries(one_off, "latency"))
    assert (null_latency.ratios, null_latency.detectable, null_latency.spreads) == ([1.2], [14.0], [])
    goals = history_study.window_goals(tallies, null=3, slowed=3)
    assert goals == {"null speedup: at most 1 of 3 with any regressed": True,
                     "null latency: at most 1 of 3 with any regressed": True,
                     "slowed speedup: caught in at least 3 of 3": False,
                     "slowed latency: no test ok (regressed or inconclusive)": False}
    assert "slowed speedup: caught in at least 19 of 20" in history_study.window_goals(tallies, null=20, slowed=20)


def test_a_kept_folder_is_read_again_session_by_session(tmp_path: Path) -> None:
    (tmp_path / "reports").mkdir()
    (tmp_path / "history").mkdir()
    created = ["2026-12-02T04:34:33+00:00", "2026-12-02T04:34:33+00:00", "2026-12-02T04:34:45+00:00"]
    for number, moment in enumerate(created, 1):
        (tmp_path / "reports" / f"session-{number:03d}.json").write_text(json.dumps(
            {"created": moment, "summary": {"failed": int(number == 3)}, "tests": []}))
    for name in ("20261202T043433Z.json", "20261202T043433Z_2.json", "20261202T043445Z.json", "notes.json"):
        (tmp_path / "history" / name).write_text("{}")
    sessions = history_study.kept_sessions(tmp_path, slow_from=3)
    assert [(s.number, s.scenario, s.status, s.recorded) for s in sessions] == [
        (1, "null", 0, "20261202T043433Z.json"), (2, "null", 0, "20261202T043433Z_2.json"),
        (3, "slowed", 1, "20261202T043445Z.json")]
