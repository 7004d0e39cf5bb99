"""benchmarks/ab_study.py's pieces, without a pytest session of --opt-ab: the reference wrapper execs the right
interpreter, the slow-down sitecustomize slows each top-level model forward by its share and acts only where its folder
is on the path, and the study counts verdicts from the JSON reports as issue 20's goals read them."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmark_scripts import ab_study  # tests/ is on sys.path (pytest's rootdir conftest import)

# Times one top-level model call around a forward that busy-waits 3 ms and calls an inner model (as a
# ...ForCausalLM calls its ...Model) and a plain torch layer: what the caller waited against what the forward itself
# took, and the inner calls against their own time (nested calls are not slowed again; torch's layers not at all).
PROBE = '''
import json, statistics, sys, time
transformers_at_start = "transformers.modeling_utils" in sys.modules
import torch
from transformers import PretrainedConfig, PreTrainedModel

def busy(seconds):
    started = time.perf_counter()
    while time.perf_counter() < started + seconds:
        pass
    return time.perf_counter() - started

class Layer(torch.nn.Module):
    def forward(self, x):
        self.took = busy(0.001)
        return x

class Inner(PreTrainedModel):
    config_class = PretrainedConfig

    def forward(self, x):
        self.took = busy(0.002)
        return x

class Model(PreTrainedModel):
    config_class = PretrainedConfig

    def __init__(self, config):
        super().__init__(config)
        self.inner, self.layer = Inner(config), Layer()

    def forward(self, x):
        started = time.perf_counter()
        busy(0.003)
        called = time.perf_counter()
        x = self.inner(x)
        self.inner_call = time.perf_counter() - called
        called = time.perf_counter()
        x = self.layer(x)
        self.layer_call = time.perf_counter() - called
        self.took = time.perf_counter() - started
        return x

model, x, outer, nested, layer = Model(PretrainedConfig()), torch.zeros(1), [], [], []
for _ in range(21):
    started = time.perf_counter()
    model(x)
    outer.append((time.perf_counter() - started) / model.took)
    nested.append(model.inner_call / model.inner.took)
    layer.append(model.layer_call / model.layer.took)
print(json.dumps({"outer": statistics.median(outer), "nested": statistics.median(nested),
                  "layer": statistics.median(layer), "transformers_at_start": transformers_at_start,
                  "module_call": torch.nn.Module.__call__.__name__}))
'''


def _run(command: list[str], env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return done


def _probe(python: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(_run([str(python), "-c", PROBE]).stdout)
    return result


# --------------------------------------------------------------------------- the wrapper and the slow-down


def test_the_wrapper_execs_this_interpreter_with_its_arguments_and_standard_input(tmp_path: Path) -> None:
    wrapper = ab_study.write_wrapper(tmp_path / "reference python", sys.executable)
    code = ("import json, sys; print(json.dumps({'executable': sys.executable, 'prefix': sys.prefix, "
            "'argv': sys.argv[1:], 'stdin': sys.stdin.read()}))")
    seen = json.loads(_run([str(wrapper), "-c", code, "two words", "--opt"], stdin="a request\n").stdout)
    assert seen == {"executable": sys.executable, "prefix": sys.prefix, "argv": ["two words", "--opt"],
                    "stdin": "a request\n"}  # the same environment: the null A/B's reference


def test_the_slowed_wrapper_puts_its_folder_first_and_keeps_the_worker_s_pythonpath(tmp_path: Path) -> None:
    slow = ab_study.write_slowdown(tmp_path / "slow", 10)
    wrapper = ab_study.write_wrapper(tmp_path / "python", sys.executable, pythonpath=slow)
    code = "import json, sys, sitecustomize; print(json.dumps([sys.path, sitecustomize.__file__]))"
    worker_package = str(tmp_path / "worker-package")  # the A/B worker's own PYTHONPATH entry
    path, sitecustomize = json.loads(_run([str(wrapper), "-c", code], env={"PYTHONPATH": worker_package}).stdout)
    assert path.index(str(slow)) < path.index(worker_package)
    assert sitecustomize == str(slow / "sitecustomize.py")
    plain = ab_study.write_wrapper(tmp_path / "plain", sys.executable)
    path = json.loads(_run([str(plain), "-c", "import json, sys; print(json.dumps(sys.path))"],
                           env={"PYTHONPATH": worker_package}).stdout)
    assert str(slow) not in path and worker_package in path


def test_the_slowdown_busy_waits_its_share_of_each_top_level_forward_only_where_it_is_on_the_path(
        tmp_path: Path) -> None:
    slow = ab_study.write_slowdown(tmp_path / "slow", 10)
    slowed = _probe(ab_study.write_wrapper(tmp_path / "slowed", sys.executable, pythonpath=slow))
    plain = _probe(ab_study.write_wrapper(tmp_path / "plain", sys.executable))
    # the wait is 10% of the call's own measured time, so the machine's noise scales both alike
    assert 1.08 <= slowed["outer"] <= 1.16, slowed
    assert plain["outer"] < 1.04, plain
    # the models and layers inside are not slowed once more (that would add 0.1; the call's own overhead is there
    # in both), and torch's Module call is left alone: wrapping every layer's call cost more than the slow-down
    assert slowed["nested"] < plain["nested"] + 0.05, (slowed, plain)
    assert slowed["layer"] < plain["layer"] + 0.05, (slowed, plain)
    assert slowed["module_call"] == plain["module_call"] == "_wrapped_call_impl"
    assert slowed["transformers_at_start"] is False  # the sitecustomize imports nothing until the process does


def test_the_slowdown_costs_a_process_without_torch_nothing(tmp_path: Path) -> None:
    slowed = ab_study.write_wrapper(tmp_path / "slowed", sys.executable, pythonpath=ab_study.write_slowdown(
        tmp_path / "slow", 10))
    assert _run([str(slowed), "-c", "import sys; print('torch' in sys.modules)"]).stdout.strip() == "False"


def test_the_slowdown_folder_holds_only_its_sitecustomize_with_the_share_asked_for(tmp_path: Path) -> None:
    slow = ab_study.write_slowdown(tmp_path / "slow", 12.5)
    assert [p.name for p in slow.iterdir()] == ["sitecustomize.py"]
    source = (slow / "sitecustomize.py").read_text(encoding="utf-8")
    assert "FACTOR = 0.125\n" in source and "12.5% slower" in source
    compile(source, "sitecustomize.py", "exec")


# --------------------------------------------------------------------------- the sessions


def test_the_user_project_has_one_test_per_technique_on_the_model() -> None:
    source = ab_study.project_source("smollm2-135m", ["sdpa", "static_cache"], 16)
    compile(source, ab_study.TEST_FILE, "exec")
    assert "pytestmark = pytest.mark.opt_model('smollm2-135m')" in source
    assert "@pytest.mark.optimization('static_cache')\ndef test_static_cache(opt_bench):\n" \
           "    opt_bench(max_new_tokens=16)\n" in source
    assert source.count("def test_") == 2


def test_a_session_runs_pytest_with_the_ab_options_and_only_the_candidate_gets_the_slowdown(tmp_path: Path,
                                                                                          monkeypatch: pytest.MonkeyPatch
                                                                                          ) -> None:
    report = tmp_path / "r.json"
    command = ab_study.session_command("/ref/python", "latency:5%", report, ["--opt-rounds=7"])
    assert command[:3] == [sys.executable, "-m", "pytest"]
    assert command[-4:] == ["--opt-ab-fail=latency:5%", f"--opt-report-json={report}", "--opt-rounds=7",
                            ab_study.TEST_FILE]
    assert "--opt-ab=/ref/python" in command and "--opt-budgets=off" in command
    monkeypatch.setenv("PYTHONPATH", "/already")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path / "summary.md"))
    env = ab_study.session_env(tmp_path / "slow")
    assert env["PYTHONPATH"] == f"{tmp_path / 'slow'}{os.pathsep}/already"
    assert "GITHUB_STEP_SUMMARY" not in env
    assert ab_study.session_env(None)["PYTHONPATH"] == "/already"


# --------------------------------------------------------------------------- counting the verdicts


def _test(name: str, verdict: str | None, change: float | None = None, p: float | None = 0.01,
          note: str | None = None, outcome: str = "passed", details: list[str] | None = None,
          **extra: Any) -> dict[str, Any]:
    """A report's test row as the plugin writes it (``extra``: skip_reason, error), with its ``ab`` record."""
    row: dict[str, Any] = {"nodeid": f"{ab_study.TEST_FILE}::{name}", "outcome": outcome, **extra}
    if verdict is not None or change is not None:
        figures = {} if change is None else {"latency": {
            "candidate": 0.011, "reference": 0.010, "change_pct": change, "interval_pct": [change - 3, change + 3],
            "p_value": p, "word": "slower" if change > 0 else "faster"}}
        row["ab"] = {"mode": "interleaved", "verdict": verdict, "figures": figures, "note": note,
                     "similarity": {"kl_mean": 1e-9, "top1": 1.0, "note": None}, "details": details or []}
    return row


def _report(*tests: dict[str, Any]) -> dict[str, Any]:
    return {"tests": list(tests), "ab": {"candidate": {"python": "/c", "versions": {"transformers": "5.24.0"}},
                                         "reference": {"python": "/r", "versions": {"transformers": "5.22.2"}},
                                         "differs": {"transformers": ["5.24.0 (candidate)", "5.22.2 (reference)"]}}}


def test_ab_rows_read_each_test_s_verdict_and_figures_from_the_report() -> None:
    rows = ab_study.ab_rows(_report(
        _test("test_sdpa", "regressed", 11.0, note=None),
        _test("test_static_cache", None, outcome="skipped",
              skip_reason="static_cache: in the reference environment: needs transformers >= 5.23"),
        _test("test_compile", None, outcome="error", error="ReferenceWorkerDied: exit -9\nlast lines ...")))
    assert [(r.test, r.outcome, r.verdict, r.change(), r.p_value()) for r in rows] == [
        ("test_sdpa", "passed", "regressed", 11.0, 0.01), ("test_static_cache", "skipped", None, None, None),
        ("test_compile", "error", None, None, None)]
    assert rows[1].why.startswith("static_cache: in the reference environment")
    assert rows[2].why == "ReferenceWorkerDied: exit -9"


def _measured(name: str, reference_rounds: list[float], factor: float) -> dict[str, Any]:
    """A row the gate judged (the plugin's record: both sides' rounds, taken in turns), its candidate ``factor``
    times each reference round, so each pair moves by it while the machine's noise moves both."""
    from pytest_transformers_opt.report.ab import complete_ab
    from pytest_transformers_opt.verdict.compare import parse_compare_fail

    def side(rounds: list[float]) -> dict[str, Any]:
        return {"latency_s": statistics.median(rounds), "latency_samples_s": rounds, "rounds": len(rounds)}

    row = {"nodeid": f"{ab_study.TEST_FILE}::{name}", "outcome": "passed",
           "optimized": side([r * factor for r in reference_rounds]),
           "ab": {"mode": "interleaved", "reference": {"python": "/r", "versions": {}},
                  "optimized": side(reference_rounds), "similarity": {"kl_mean": 0.0, "top1": 1.0}}}
    complete_ab({"tests": [row]}, parse_compare_fail(ab_study.STUDY_AB_FAIL), candidate={"python": "/c", "versions": {}})
    return row


# the machine's noise, shared by both rounds of a pair: far wider than the 5% limit
SHARED_NOISE = [1.0, 1.3, 0.8, 1.5, 0.9, 1.2, 1.1, 0.7, 1.4, 1.05]


def test_the_study_judges_each_record_again_unpaired_and_shows_both_rules() -> None:
    report = _report(_measured("test_sdpa", SHARED_NOISE, 1.12), _measured("test_static_cache", SHARED_NOISE, 1.0))
    rows = ab_study.ab_rows(report, ab_study.STUDY_AB_FAIL)
    assert [(r.verdict, r.gate["rule"], r.unpaired_verdict) for r in rows] == [
        ("regressed", "wilcoxon-signed-rank", "inconclusive"),  # every pair 12% slower: the pairs see it, ranks alone
        # cannot tell it from the limit (and say so)
        ("ok", "wilcoxon-signed-rank", "inconclusive")]  # a null: the pairs vouch for it, the ranks cannot
    assert rows[0].gate["p_value"] < 0.01
    session = ab_study.Session("slowed candidate", 1, rows, 10.0)
    table = ab_study.study_table([session], command="ab_study.py", model="tiny-random-llama",
                                 techniques=ab_study.STUDY_TECHNIQUES, slowdown=10, ab_fail=ab_study.STUDY_AB_FAIL)
    paired_line, unpaired_line = [line for line in table.splitlines() if line.startswith("| slowed candidate |")]
    assert paired_line.startswith("| slowed candidate | 1 | 0 (`regressed`) | 1 | 0 |")
    assert paired_line.endswith("| wilcoxon-signed-rank | 10 (10 to 10) | 0 |")  # rounds per test, none open at the cap
    assert unpaired_line == "| slowed candidate | 1 | 0 (`regressed`) | 0 | 0 |"
    assert "judged again by the rule before pairs" in table


def _session(scenario: str, status: int, *tests: dict[str, Any]) -> Any:
    return ab_study.Session(scenario, status, ab_study.ab_rows(_report(*tests)), 10.0)


def test_a_null_session_counts_as_a_false_regression_when_any_test_regressed() -> None:
    sessions = [
        _session("null", 0, _test("test_sdpa", "ok", 1.0, 0.6, note="identical stacks"),
                 _test("test_static_cache", "ok", -2.0, 0.4, note="identical stacks")),
        _session("null", 1, _test("test_sdpa", "regressed", 6.0, 0.03, note="identical stacks"),
                 _test("test_static_cache", "ok", 0.5, 0.9, note="identical stacks")),
        _session("null", 0, _test("test_sdpa", "improved", -7.0, 0.02, note="identical stacks"),
                 _test("test_static_cache", "ok", 0.0, 1.0, note="identical stacks")),
        _session("slowed candidate", 1, _test("test_sdpa", "regressed", 9.0)),  # another scenario: not counted
    ]
    t = ab_study.tally(sessions, "null")
    assert (t.sessions, t.as_expected, t.any_regressed, t.any_improved, t.exit_1, t.other_exit) == (3, 1, 1, 1, 1, 0)
    assert t.identical_stacks == 3 and t.not_judged == 0
    assert sorted(t.changes) == [-7.0, -2.0, 0.0, 0.5, 1.0, 6.0]


def test_a_slowed_session_counts_as_detected_only_when_every_test_got_the_verdict() -> None:
    sessions = [
        _session("slowed candidate", 1, _test("test_sdpa", "regressed", 9.0), _test("test_static_cache", "regressed", 8.0)),
        _session("slowed candidate", 1, _test("test_sdpa", "regressed", 9.5), _test("test_static_cache", "ok", 4.0, 0.2)),
        _session("slowed candidate", 0, _test("test_sdpa", "regressed", 9.0),
                 _test("test_static_cache", None, outcome="error", error="worker died")),
        _session("slowed candidate", 3),  # no report at all
        _session("slowed candidate", 0, _test("test_sdpa", "not judged", details=["no measurement on the reference side"])),
        _session("slowed reference", 0, _test("test_sdpa", "improved", -8.5), _test("test_static_cache", "improved", -8.0)),
    ]
    candidate = ab_study.tally(sessions, "slowed candidate")
    assert (candidate.sessions, candidate.as_expected, candidate.any_regressed, candidate.exit_1,
            candidate.other_exit, candidate.not_judged) == (5, 1, 3, 2, 1, 2)
    assert "test_static_cache: error: worker died" in candidate.problems
    assert "test_sdpa: not judged: no measurement on the reference side" in candidate.problems
    assert any(p.startswith("session without a report (exit 3)") for p in candidate.problems)
    reference = ab_study.tally(sessions, "slowed reference")
    assert (reference.sessions, reference.as_expected, reference.any_improved, reference.any_regressed) == (1, 1, 1, 0)


def test_the_study_takes_the_scenarios_in_turn_and_wires_each_side_s_slowdown(tmp_path: Path) -> None:
    """run_study with a stand-in session runner: which reference and which candidate PYTHONPATH each scenario
    gets, and the table it all comes to."""
    calls: list[dict[str, Any]] = []
    verdict = {"null": "ok", "slowed candidate": "regressed", "slowed reference": "improved"}

    def runner(root: Path, *, reference: str, ab_fail: str, report: Path, extra_args: list[str],
               candidate_pythonpath: Path | None = None) -> tuple[int, dict[str, Any], str]:
        wrapper = Path(reference).read_text(encoding="utf-8")
        slowed_reference = "PYTHONPATH=" in wrapper
        scenario = ("slowed candidate" if candidate_pythonpath else "slowed reference" if slowed_reference else "null")
        calls.append({"scenario": scenario, "ab_fail": ab_fail, "extra": extra_args, "report": report.name,
                      "project": (root / ab_study.TEST_FILE).read_text(encoding="utf-8"),
                      "slow": (candidate_pythonpath / "sitecustomize.py").exists() if candidate_pythonpath else None,
                      "execs": wrapper.splitlines()[-1]})
        change = {"null": 0.4, "slowed candidate": 9.0, "slowed reference": -8.0}[scenario]
        report_data = _report(*(_test(name, verdict[scenario], change) for name in ("test_sdpa", "test_static_cache")))
        report.write_text(json.dumps(report_data), encoding="utf-8")  # as pytest's --opt-report-json does
        return (1 if scenario == "slowed candidate" else 0), report_data, ""

    sessions = ab_study.run_study(runs=2, scenarios=list(ab_study.SCENARIOS), model="tiny-random-llama",
                                  techniques=["sdpa", "static_cache"], slowdown=10, ab_fail="latency:5%",
                                  max_new_tokens=8, extra_args=["--opt-rounds=5"], keep=tmp_path / "kept",
                                  runner=runner)
    assert [c["scenario"] for c in calls] == ["null", "slowed candidate", "slowed reference"] * 2
    assert [c["report"] for c in calls[:3]] == ["null-01.json", "slowed-candidate-01.json", "slowed-reference-01.json"]
    assert all(c["execs"] == f'exec {sys.executable} "$@"' for c in calls)
    assert [c["slow"] for c in calls[:3]] == [None, True, None]
    assert all(c["ab_fail"] == "latency:5%" and c["extra"] == ["--opt-rounds=5"] for c in calls)
    assert "opt_model('tiny-random-llama')" in calls[0]["project"]
    kept = sorted(path.name for path in (tmp_path / "kept").iterdir())  # --keep: every session's report and record
    assert [name for name in kept if not name.endswith(ab_study.KEPT_SESSION)] == sorted(c["report"] for c in calls)
    assert len(kept) == 12
    table = ab_study.study_table(sessions, command="python benchmarks/ab_study.py --runs 2", model="tiny-random-llama",
                                 techniques=["sdpa", "static_cache"], slowdown=10, ab_fail="latency:5%")
    assert "    python benchmarks/ab_study.py --runs 2" in table
    assert "| null | 2 | 2 (`ok`) | 0 | 0 | 0 | 0 | 0 | 0 | +0.4% (+0.4% to +0.4%) |" in table
    assert "| slowed candidate | 2 | 2 (`regressed`) | 2 | 0 | 2 | 0 | 0 | 0 | +9.0% (+9.0% to +9.0%) |" in table
    assert "| slowed reference | 2 | 2 (`improved`) | 0 | 2 | 0 | 0 | 0 | 0 | -8.0% (-8.0% to -8.0%) |" in table


def test_the_pair_table_shows_each_figure_with_its_interval_and_the_stacks(tmp_path: Path) -> None:
    sessions = [ab_study.Session("pair", 1, ab_study.ab_rows(_report(
        _test("test_sdpa", "regressed", 12.0, 0.004),
        _test("test_compile", None, outcome="skipped", skip_reason="compile: in the reference environment: ..."))),
        30.0, _report()["ab"])]
    table = ab_study.pair_table(sessions, command="python benchmarks/ab_study.py --pair", model="smollm2-135m")
    assert "candidate: /c (transformers 5.24.0)" in table and "reference: /r (transformers 5.22.2)" in table
    assert "differs: transformers 5.24.0 (candidate) vs 5.22.2 (reference)" in table
    assert "| 1 | test_sdpa | regressed | latency | 11.0 ms | 10.0 ms | +12.0% [+9.0%, +15.0%] | 0.004 | slower |" in table
    assert "| 1 | test_compile | skipped | - | - | - | - | - | compile: in the reference environment: ... |" in table


def test_the_pair_refuses_a_reference_that_is_not_there(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="scripts/kernels_env.sh"):
        ab_study.main(["--pair", "--reference", str(tmp_path / "no-python")], runner=lambda *a, **k: pytest.fail())


def test_main_prints_and_writes_the_table_with_the_exact_command(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    def runner(root: Path, **kwargs: Any) -> tuple[int, dict[str, Any], str]:
        return 0, _report(_test("test_sdpa", "ok", 0.2, 0.7, note="identical stacks")), ""

    out = tmp_path / "ab.md"
    argv = ["--runs", "1", "--scenarios", "null", "--techniques", "sdpa", "--out", str(out), "--", "--opt-rounds=5"]
    assert ab_study.main(argv, runner=runner) == 0
    printed = capsys.readouterr().out
    assert out.read_text(encoding="utf-8") == printed
    assert f"benchmarks/ab_study.py --runs 1 --scenarios null --techniques sdpa --out {out} -- --opt-rounds=5" in printed
    assert "| null | 1 | 1 (`ok`) | 0 | 0 | 0 | 0 | 0 | 1 |" in printed


@pytest.mark.parametrize("mode", ["study", "pair"])
def test_kept_sessions_are_tabulated_again_without_running_any(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               mode: str) -> None:
    verdicts = iter(["ok", "regressed", "improved", "ok", "regressed", "improved"])

    def runner(root: Path, *, report: Path, **kwargs: Any) -> tuple[int, dict[str, Any] | None, str]:
        verdict = next(verdicts)
        if report.name.startswith("slowed-reference-02"):
            return 2, None, "a session that wrote no report\nINTERNALERROR> boom"
        data = _report(_test("test_sdpa", verdict, {"ok": 0.3, "regressed": 9.0, "improved": -7.5}[verdict]))
        report.write_text(json.dumps(data), encoding="utf-8")
        return int(verdict == "regressed"), data, ""

    kept = tmp_path / "kept"
    argv = (["--pair", "--reference", sys.executable, "--runs", "2"] if mode == "pair" else
            ["--runs", "2", "--techniques", "sdpa", "--slowdown", "8"]) + ["--keep", str(kept), "--", "--opt-rounds=5"]
    assert ab_study.main(argv, runner=runner) == 0
    first = capsys.readouterr().out

    out = tmp_path / "again.md"
    assert ab_study.main(["--reanalyse", "--keep", str(kept), "--out", str(out)],
                         runner=lambda *a, **k: pytest.fail("ran")) == 0
    again = capsys.readouterr().out
    assert out.read_text(encoding="utf-8") == again
    head, table = again.split("\n\n", 1)
    assert head.startswith("Tabulated again from the kept sessions (`")
    assert head.endswith(f"benchmarks/ab_study.py --reanalyse --keep {kept} --out {out}`):")
    assert table == first  # the same sessions, the same table: statuses, wall times, the session without a report
    if mode == "study":
        assert "+8% of each forward" in table and "session without a report (exit 2): INTERNALERROR> boom" in table
    else:
        assert "| 2 | test_sdpa | regressed | latency |" in table

    with pytest.raises(SystemExit, match="holds an earlier study's sessions .*: give an empty --keep folder, or "):
        ab_study.main(argv, runner=lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit, match="holds no study.json: --reanalyse reads a folder that --keep filled"):
        ab_study.main(["--reanalyse", "--keep", str(tmp_path)])
    with pytest.raises(SystemExit):  # argparse's usage error, naming what it needs
        ab_study.main(["--reanalyse"])
    assert "--reanalyse needs --keep DIR" in capsys.readouterr().err


def test_the_cost_mode_reads_each_tests_wall_time_from_pytests_durations() -> None:
    output = """
============================= slowest durations ==============================
3.10s call     test_ab_study.py::test_sdpa
0.50s setup    test_ab_study.py::test_sdpa
1.00s call     test_ab_study.py::test_static_cache
0.01s teardown test_ab_study.py::test_static_cache
2 passed in 9.0s
"""
    assert ab_study.seconds_per_test(output) == {"test_sdpa": 3.6, "test_static_cache": 1.01}
    table = ab_study.cost_table([("without", {"test_sdpa": 2.0}), ("with", {"test_sdpa": 3.0}),
                                 ("without", {"test_sdpa": 2.2}), ("with", {"test_sdpa": 3.2})],
                                command="python benchmarks/ab_study.py --cost", model="tiny-random-llama")
    assert "| test_sdpa | 2.1 s | 3.1 s | 1.48x |" in table
