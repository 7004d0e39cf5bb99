"""benchmarks/compare_study.py: the project it writes (the injected slowdown waits its share of each forward, and
only where asked), the busy neighbours (running during a session, gone after it), what ``collect`` keeps, and what
``analyse`` counts from kept reports (the verdicts per load and effect, the simulated slowdown, the spreads); one
cheap real collect of two sessions."""

from __future__ import annotations

import ast
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import pytest

from benchmark_scripts import load_script  # tests/ is on sys.path (pytest's rootdir conftest import)

compare_study = load_script("compare_study")

NODE = "test_compare_study.py::"


def _test(name: str, samples_ms: Sequence[float], techniques: Sequence[str] = ("sdpa", "compare_slowdown")
          ) -> dict[str, Any]:
    samples = [v / 1000 for v in samples_ms]
    return {"nodeid": NODE + name, "outcome": "passed", "techniques": list(techniques),
            "model": {"name_or_path": "tiny-random-llama"}, "workload": {"num_prompts": 3, "max_new_tokens": 16},
            "hardware": "CPU test",
            "optimized": {"latency_s": statistics.median(samples), "latency_samples_s": samples,
                          "rounds": len(samples)},
            "baseline": {"latency_s": 0.01, "latency_samples_s": [0.01] * len(samples), "rounds": len(samples)},
            "speedup": 0.01 / statistics.median(samples)}


def _report(*tests: dict[str, Any]) -> dict[str, Any]:
    return {"environment": {"device": "cpu", "hardware": "CPU test", "cpu_threads": 1}, "tests": list(tests)}


def _tight(median_ms: float) -> list[float]:
    """Five rounds around ``median_ms``, their robust spread 1.4826% of it."""
    return [median_ms * f for f in (0.98, 0.99, 1.0, 1.01, 1.02)]


def _collect(folder: Path, reports: Sequence[dict[str, Any] | None], *options: str) -> list[dict[str, Any]]:
    """``collect`` into ``folder`` with a stand-in session runner that writes ``reports`` in turn (None: a session
    that wrote none); what each call of the runner was given."""
    given = iter(reports)
    calls: list[dict[str, Any]] = []

    def runner(root: Path, report: Path, threads: str, extra_args: Sequence[str]) -> tuple[int, str]:
        calls.append({"root": root, "report": report.name, "threads": threads, "extra": list(extra_args),
                      "conftest": (root / "conftest.py").read_text(encoding="utf-8"),
                      "project": (root / compare_study.TEST_FILE).read_text(encoding="utf-8")})
        data = next(given)
        if data is None:
            return 3, "INTERNALERROR> boom"
        report.write_text(json.dumps(data), encoding="utf-8")
        return 0, "1 passed"

    argv = ["collect", str(folder), "--sessions", str(len(reports)), *options]
    assert compare_study.main(argv, runner=runner) == 0
    return calls


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --------------------------------------------------------------------------- the project and the load


def test_the_project_stacks_the_slowdown_on_every_test_of_every_model() -> None:
    one = compare_study.project_source(["tiny-random-llama"], ["sdpa", "static_cache"], 16)
    ast.parse(one)
    assert "@pytest.mark.optimization('sdpa', 'compare_slowdown')\ndef test_sdpa(opt_bench):" in one
    assert "@pytest.mark.optimization('static_cache', 'compare_slowdown')\ndef test_static_cache(" in one
    assert one.count("opt_bench(max_new_tokens=16)") == 2
    models = [compare_study.model_name(m) for m in ("tiny-random-llama", "smollm2")]
    two = compare_study.project_source(models, ["sdpa"], 8)
    assert "@pytest.mark.opt_model('smollm2-135m')" in two and "def test_smollm2_135m_sdpa(" in two
    assert "def test_tiny_random_llama_sdpa(" in two


@pytest.mark.parametrize("pct", [0.0, 50.0])
def test_the_injected_technique_waits_its_share_of_each_forward_and_nothing_at_zero(pct: float) -> None:
    import torch

    from pytest_transformers_opt.techniques import Technique

    class Clock:
        """A clock that moves only when read (1 us) or told: the wait it times is exact on a busy machine too."""

        now = 0.0

        def perf_counter(self) -> float:
            self.now += 1e-6
            return self.now

    clock = Clock()
    namespace: dict[str, Any] = {}
    exec(compile(compare_study.conftest_source(pct), "conftest.py", "exec"), namespace)
    namespace["time"] = clock
    registered: list[type[Technique]] = []
    namespace["pytest_opt_register_techniques"](type("Registry", (), {"register": lambda self, c: registered.append(c)})())
    (technique_class,) = registered
    assert technique_class.name == "compare_slowdown"

    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            clock.now += 0.003  # the forward's own time
            return x

    model = Model()
    with technique_class().around_generate(model):
        hooks = len(model._forward_hooks) + len(model._forward_pre_hooks)
        started = clock.now
        model(torch.zeros(1))
        took = clock.now - started
    assert hooks == 2  # at 0% too: null and injected sessions carry the same hooks
    assert not model._forward_hooks and not model._forward_pre_hooks  # removed on the way out
    assert took == pytest.approx(0.003 * (1 + pct / 100), rel=0.01)


def test_busy_neighbours_spin_while_the_block_runs_and_are_gone_after_it_however_it_ends() -> None:
    with compare_study.busy_neighbours(2) as pids:
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        time.sleep(0.3)
        ticks = [int(Path(f"/proc/{pid}/stat").read_text().split()[13]) for pid in pids]  # user time: spinning
        assert all(tick > 0 for tick in ticks)
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(KeyboardInterrupt):
        with compare_study.busy_neighbours(1) as pids:
            raise KeyboardInterrupt
    assert not _alive(pids[0])
    with compare_study.busy_neighbours(0) as none:
        assert none == []


# --------------------------------------------------------------------------- collect


def test_collect_keeps_each_report_with_its_status_time_load_and_the_studys_parameters(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "busy"
    calls = _collect(folder, [_report(_test("test_sdpa", _tight(10))), None], "--load", "busy1", "--inject", "30",
                     "--techniques", "sdpa", "--", "--opt-rounds=5")
    assert [c["report"] for c in calls] == ["session-001.json", "session-002.json"]
    assert all(c["threads"] == "1" and c["extra"] == ["--opt-rounds=5"] for c in calls)
    assert "+ 0.3 * (time.perf_counter()" in calls[0]["conftest"] and "'sdpa', 'compare_slowdown'" in calls[0]["project"]
    assert not calls[0]["root"].exists()  # the project was a temporary folder
    params = json.loads((folder / "study.json").read_text(encoding="utf-8"))
    assert (params["load"], params["inject"], params["models"], params["techniques"], params["pytest_args"]) == \
        ("busy1", 30.0, ["tiny-random-llama"], ["sdpa"], ["--opt-rounds=5"])
    assert params["command"].endswith("benchmarks/compare_study.py collect " + str(folder) + " --sessions 2 --load "
                                      "busy1 --inject 30 --techniques sdpa -- --opt-rounds=5")
    first, second = (json.loads((folder / f"session-00{n}.session.json").read_text(encoding="utf-8")) for n in (1, 2))
    assert (first["number"], first["status"], first["report"], first["load"], first["inject"]) == \
        (1, 0, "session-001.json", "busy1", 30.0)
    assert len(first["load_average_start"]) == 3 and len(first["load_average_end"]) == 3
    assert len(first["neighbour_pids"]) == 1 and not _alive(first["neighbour_pids"][0])
    assert (second["status"], second["report"], second["tail"]) == (3, None, "INTERNALERROR> boom")
    assert json.loads((folder / "session-001.json").read_text(encoding="utf-8"))["tests"][0]["nodeid"] == \
        NODE + "test_sdpa"
    out = capsys.readouterr().err
    assert "session 1/2 (session-001, busy1, optimized side +30%) starts; load average " in out
    assert "session 1/2 (session-001, busy1, optimized side +30%) ends: exit 0, " in out and "test_sdpa 10.0 ms" in out
    assert "session 2/2 (session-002, busy1, optimized side +30%) ends: exit 3, " in out and "no report" in out

    with pytest.raises(SystemExit, match="holds an earlier collect's sessions .*: give an empty folder, or --add"):
        _collect(folder, [None], "--load", "busy1")
    with pytest.raises(SystemExit, match=r"collected with other parameters \(load 'busy1' -> 'quiet'; inject 30.0 "
                                         r"-> 0.0\): give the same, or another folder"):
        _collect(folder, [None], "--add", "--techniques", "sdpa", "--", "--opt-rounds=5")
    more = _collect(folder, [None], "--add", "--load", "busy1", "--inject", "30", "--techniques", "sdpa", "--",
                    "--opt-rounds=5")
    assert [c["report"] for c in more] == ["session-003.json"]


def test_collect_refuses_what_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in ((["collect", "x", "--load", "busy3"], "invalid choice: 'busy3'"),
                       (["collect", "x", "--sessions", "0"], "--sessions 0: give at least 1"),
                       (["collect", "x", "--inject", "-5"], "--inject -5: give a percent from 0 to 1000"),
                       (["analyse", "x", "--scale", "-100"], "--scale: give percents above -100"),
                       (["analyse", "x", "--compare-fail", "latncy:10%"],
                        "--compare-fail: 'latncy:10%' names an unknown metric 'latncy' (did you mean 'latency'?)")):
        with pytest.raises(SystemExit):
            compare_study.main(argv, runner=lambda *a: pytest.fail("ran"))
        assert says in capsys.readouterr().err


# --------------------------------------------------------------------------- analyse


def stand_in_judge(old: dict[str, Any], new: dict[str, Any], compare_fail: str) -> dict[str, dict[str, Any]]:
    """A rule for counting: past +10% regressed, past -10% improved, a new median of 13 ms inconclusive (detectable
    30%), else ok; the sessions a test is in both of."""
    assert compare_fail == "latency:10%"
    verdicts = {}
    before = {t["nodeid"]: t["optimized"]["latency_s"] for t in old["tests"]}
    for test in new["tests"]:
        ratio = test["optimized"]["latency_s"] / before[test["nodeid"]]
        word = ("inconclusive" if math.isclose(test["optimized"]["latency_s"], 0.013) else
                "regressed" if ratio > 1.1 else "improved" if ratio < 0.9 else "ok")
        detectable = 30.0 if word == "inconclusive" else 15.0
        verdicts[test["nodeid"]] = {"verdict": word, "judged": [{"metric": "latency", "detectable": detectable}]}
    return verdicts


def _null_folder(tmp_path: Path, name: str, sdpa_medians: Sequence[float], *options: str) -> Path:
    folder = tmp_path / name
    _collect(folder, [_report(_test("test_sdpa", _tight(m)), _test("test_static_cache", _tight(20.0)))
                      for m in sdpa_medians], *options)
    return folder


def _row(text: str, load: str, effect: str, test: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {load} | {effect} | {test} |"))


def test_analyse_counts_each_verdict_of_the_null_pairs_per_test_and_in_all(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # sdpa's medians: 10 -> 12 regressed, 12 -> 10 improved, 10 -> 10 ok, 10 -> 13 inconclusive
    folder = _null_folder(tmp_path, "quiet", [10, 12, 10, 10, 13])
    out = tmp_path / "table.md"
    assert compare_study.main(["analyse", str(folder), "--out", str(out)], judge=stand_in_judge) == 0
    text = capsys.readouterr().out
    assert out.read_text(encoding="utf-8") == text  # print ends the line as the file does
    assert text.startswith(f"    {compare_study.command_line(['analyse', str(folder), '--out', str(out)])}\n")
    assert "| load | effect | test | pairs | regressed | improved | ok | inconclusive | not comparable | " in text
    assert _row(text, "quiet", "null", "all tests") == \
        "| quiet | null | all tests | 4 | 1 | 1 | 5 | 1 | 0 | 1/8 (12%) | 1/4 (25%) | +0.0% (-16.7% to +30.0%) | 15% |"
    assert _row(text, "quiet", "null", "test_sdpa") == \
        "| quiet | null | test_sdpa | 4 | 1 | 1 | 1 | 1 | 0 | 1/4 (25%) |  | +10.0% (-16.7% to +30.0%) | 15% |"
    assert _row(text, "quiet", "null", "test_static_cache") == \
        "| quiet | null | test_static_cache | 4 | 0 | 0 | 4 | 0 | 0 | 0/4 (0%) |  | +0.0% (+0.0% to +0.0%) | 15% |"
    assert f"`{folder}`: 5 sessions, load `quiet` (0 busy neighbour(s)), optimized side +0%; models tiny-random-llama, " \
           "techniques sdpa, static_cache, max_new_tokens 16, pytest arguments `(none)`, CPU threads 1; " in text
    assert "; 1-minute load average at the start " in text
    loads = [json.loads((folder / f"session-00{n}.session.json").read_text(encoding="utf-8")) for n in range(1, 6)]
    assert "  - 1-minute load average per session, start -> end: " + "; ".join(
        f"{n}: {r['load_average_start'][0]:.2f} -> {r['load_average_end'][0]:.2f}" for n, r in enumerate(loads, 1)) in text


def test_a_session_without_a_report_leaves_its_pairs_out_and_says_so(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "gap"
    _collect(folder, [_report(_test("test_sdpa", _tight(10))), None, _report(_test("test_sdpa", _tight(10))),
                      _report(_test("test_sdpa", _tight(10)))])
    compare_study.main(["analyse", str(folder)], judge=stand_in_judge)
    text = capsys.readouterr().out
    assert _row(text, "quiet", "null", "all tests").startswith("| quiet | null | all tests | 1 | 0 | 0 | 1 | 0 | 0 |")
    assert "Pairs left out (a session wrote no report): quiet, null: 2" in text
    assert "; non-zero exits: 2 (exit 3)" in text


def test_the_scale_option_judges_each_pair_again_with_the_new_latency_scaled_and_labels_it_simulated(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _null_folder(tmp_path, "quiet", [10, 10, 10])
    seen: list[tuple[float, list[float]]] = []

    def judge(old: dict[str, Any], new: dict[str, Any], compare_fail: str) -> dict[str, dict[str, Any]]:
        seen.append((new["tests"][0]["optimized"]["latency_s"], new["tests"][0]["optimized"]["latency_samples_s"]))
        return stand_in_judge(old, new, compare_fail)

    compare_study.main(["analyse", str(folder), "--scale", "25", "--scale", "5"], judge=judge)
    text = capsys.readouterr().out
    assert [round(1000 * latency, 6) for latency, _ in seen] == [10.0, 10.0, 12.5, 12.5, 10.5, 10.5]
    assert [round(1000 * v, 6) for v in seen[2][1]] == [round(v * 1.25, 6) for v in _tight(10)]  # every round too
    assert _row(text, "quiet", "null", "test_sdpa").startswith("| quiet | null | test_sdpa | 2 | 0 | 0 | 2 |")
    assert _row(text, "quiet", "simulated +25%", "test_sdpa").startswith(
        "| quiet | simulated +25% | test_sdpa | 2 | 2 | 0 | 0 | 0 | 0 | 2/2 (100%) |  | +25.0% (+25.0% to +25.0%) |")
    assert _row(text, "quiet", "simulated +25%", "all tests").startswith(
        "| quiet | simulated +25% | all tests | 2 | 4 | 0 | 0 | 0 | 0 | 4/4 (100%) | 2/2 (100%) |")
    assert _row(text, "quiet", "simulated +5%", "test_sdpa").startswith("| quiet | simulated +5% | test_sdpa | 2 | 0 | 0 | 2 |")
    # the kept report itself is untouched: scaling works on a copy
    kept = json.loads((folder / "session-002.json").read_text(encoding="utf-8"))
    assert kept["tests"][0]["optimized"]["latency_s"] == pytest.approx(0.010)


def test_two_folders_pair_old_from_the_first_and_new_from_the_second(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    null = _null_folder(tmp_path, "quiet", [10, 10, 10])
    injected = _null_folder(tmp_path, "slowed", [14, 14], "--load", "busy1", "--inject", "40")
    compare_study.main(["analyse", str(null), str(injected), "--scale", "5"], judge=stand_in_judge)
    text = capsys.readouterr().out
    assert "(session i of `quiet` (old) against session i of `slowed` (new))" in text
    assert _row(text, "quiet -> busy1", "injected +40%", "test_sdpa").startswith(
        "| quiet -> busy1 | injected +40% | test_sdpa | 2 | 2 | 0 | 0 | 0 | 0 | 2/2 (100%) |  | +40.0% (+40.0% to +40.0%) |")
    assert _row(text, "quiet -> busy1", "injected +40%, simulated +5%", "all tests").startswith(
        "| quiet -> busy1 | injected +40%, simulated +5% | all tests | 2 | 2 | 0 | 2 | 0 | 0 | 2/4 (50%) | 2/2 (100%) |")
    assert f"`{injected}`: 2 sessions, load `busy1` (1 busy neighbour(s)), optimized side +40%;" in text


def test_the_spreads_between_runs_and_within_them_in_percent_of_the_median(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    folder = _null_folder(tmp_path, "quiet", [10, 11, 12, 13, 14])
    compare_study.main(["analyse", str(folder)], judge=stand_in_judge)
    text = capsys.readouterr().out
    # between: 1.4826 x MAD 1 ms of medians around 12 ms = 12.4%; within: 1.4826 x 1% = 1.5%; a median of 5 such
    # rounds: 1.5% x sqrt(pi / 10) = 0.8%; the term the rounds leave unexplained: sqrt(12.36^2 - 0.83^2) = 12.3%;
    # the speedups 10/10 .. 10/14 ms: median 0.833, MAD 0.0758, 13.5%
    assert "| quiet | quiet | 0% | test_sdpa | 5 | 5 | 12.00 ms | 12.4% | 1.5% | 0.8% | 12.3% | 13.5% |" in text
    assert "| quiet | quiet | 0% | test_static_cache | 5 | 5 | 20.00 ms | 0.0% | 1.5% | 0.8% | 0.0% | 0.0% |" in text


def test_the_package_rule_is_what_judges_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No stand-in: a null pair of identical tight rounds is not regressed, three times slower is."""
    folder = _null_folder(tmp_path, "quiet", [10, 10])
    compare_study.main(["analyse", str(folder), "--scale", "200"])
    text = capsys.readouterr().out
    assert "| quiet | null | test_sdpa | 1 | 0 |" in text
    assert _row(text, "quiet", "simulated +200%", "all tests").startswith(
        "| quiet | simulated +200% | all tests | 1 | 2 | 0 | 0 | 0 | 0 | 2/2 (100%) | 1/1 (100%) | +200.0%")


def test_analyse_names_a_folder_that_collect_did_not_fill(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="holds no study.json: analyse reads a folder that collect filled"):
        compare_study.main(["analyse", str(tmp_path)])


# --------------------------------------------------------------------------- real sessions


def test_a_real_collect_of_two_sessions_then_analyse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two real pytest sessions of the tiny model (7 to 12 s each on this project's 2-core machine)."""
    folder = tmp_path / "real"
    assert compare_study.main(["collect", str(folder), "--sessions", "2", "--techniques", "sdpa",
                               "--max-new-tokens", "4", "--", "--opt-rounds=3"]) == 0
    for number in (1, 2):
        record = json.loads((folder / f"session-00{number}.session.json").read_text(encoding="utf-8"))
        assert record["status"] == 0, record["tail"]
        report = json.loads((folder / record["report"]).read_text(encoding="utf-8"))
        (test,) = report["tests"]
        assert test["nodeid"] == NODE + "test_sdpa" and test["techniques"] == ["sdpa", "compare_slowdown"]
        assert report["environment"]["cpu_threads"] == 1 and test["optimized"]["rounds"] == 3  # what -- passed on
    capsys.readouterr()
    assert compare_study.main(["analyse", str(folder)]) == 0
    text = capsys.readouterr().out
    assert _row(text, "quiet", "null", "all tests").startswith("| quiet | null | all tests | 1 |")
    assert "| real | quiet | 0% | test_sdpa | 2 |" in text
