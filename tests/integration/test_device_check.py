"""scripts/device_check.py: its table from a real report (the GPU run itself needs a GPU machine)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import load_module_file  # tests/ is on sys.path (pytest's rootdir conftest import)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_check.py"


@pytest.fixture(scope="module")
def device_check() -> ModuleType:
    return load_module_file("device_check", SCRIPT)


def test_the_table_has_a_row_per_gpu_technique_with_figures_skip_reasons_and_gaps(run_user, device_check):
    run = run_user('''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=4)

@pytest.mark.optimization("flash_attention_2")
def test_flash_attention_2(opt_bench):
    opt_bench(max_new_tokens=4)
''')
    run.result.assert_outcomes(passed=1, skipped=1)
    report = run.report
    rows, notes = device_check.table(report, width=40)
    header, body = rows[0], {row[0]: row for row in rows[1:]}
    assert header[:2] == ["technique", "outcome / skip reason"] and header[7] == "decode GB/s (estimate)"
    assert header[8:] == ["kernels/step opt/base", "syncs/step opt/base"]
    assert list(body) == [device_check.LABELS.get(name, name) for name, _ in device_check.TECHNIQUES]
    sdpa = body["sdpa"]
    entry = run.test("test_sdpa")
    assert sdpa[1] == "passed"
    assert sdpa[2] == f"{entry['optimized']['ttft_s'] * 1e3:.1f} / {entry['baseline']['ttft_s'] * 1e3:.1f}"
    assert sdpa[5] == f"{entry['speedup']:.2f}x"
    assert sdpa[7] == f"{entry['estimates']['decode_bandwidth_bytes_s'] / 1e9:.3g}"  # no peak on CPU
    # the census was taken on both sides, and a CPU counts no kernels and no syncs: said, never a zero
    assert entry["census"]["optimized"]["ops_total"] > 0 and entry["census"]["optimized"]["kernels_per_step"] is None
    assert sdpa[8:] == ["n/a / n/a", "n/a / n/a"]
    flash = body["flash_attention_2"]
    assert flash[1].startswith("skipped: flash_attention_2 needs") and flash[1].endswith("...") and len(flash[1]) == 40
    assert any(n.endswith("compute capability >= 8.0; found: cpu") for n in notes)  # the full reason
    assert body["compile"][1] == "not run (time limit or crash)"
    lines = device_check.render(rows)
    # aligned columns: every row's separators sit where the rule's crossings are
    crossings = [i for i, c in enumerate(lines[1]) if c == "+"]
    assert len(crossings) == len(header) - 1
    for line in lines[:1] + lines[2:]:
        assert [i for i, c in enumerate(line) if c == "|"][:len(crossings)] == crossings, line
    assert "cpu" in device_check.environment_line(report)


def _census(kernels_per_step, syncs_per_step):
    return {"kernels_per_step": kernels_per_step, "syncs_per_step": syncs_per_step, "kernels": {}, "syncs": 0}


def test_census_columns_read_kernels_and_syncs_per_step_of_each_side_with_n_a_where_null(device_check):
    """On a GPU (a report of the shape a CUDA run writes): kernels per step summed over the kernel names, syncs per
    step as counted; a side without a census, or a null figure, is n/a, not 0."""
    rows = {
        "sdpa": {"census": {"optimized": _census({"ampere_sgemm": 60, "fmha_fwd": 30, "elementwise": 181.5}, 1),
                            "baseline": _census({"ampere_sgemm": 60, "softmax": 30, "elementwise": 300}, 2.25),
                            "why_not": {}}},
        "static_cache": {"census": {"optimized": _census({"ampere_sgemm": 60}, 0),
                                    "baseline": None, "why_not": {"baseline": "a stored baseline"}}},
        "compile": {"census": {"optimized": _census(None, None), "baseline": _census({}, 0), "why_not": {}}},
        "bnb_8bit": {"census": None},  # a report from before the census
    }
    report = {"tests": [{"nodeid": f"t.py::test_{name}", "outcome": "passed", "error": None, "optimized": {},
                         "baseline": {}, **row} for name, row in rows.items()]}
    table, _ = device_check.table(report)
    body = {row[0]: row[8:] for row in table[1:]}
    assert body["sdpa"] == ["271.5 / 390", "1 / 2.25"]
    assert body["static_cache"] == ["60 / n/a", "0 / n/a"]
    assert body["compile"] == ["n/a / 0", "n/a / 0"]
    assert body["bnb_8bit"] == ["n/a / n/a", "n/a / n/a"]
    assert body["offloaded_cache"] == ["-", "-"]  # not in the report: not run
    assert "| 271.5 / 390 | 1 / 2.25 |" in device_check.markdown(table, [], "device check")


def test_the_trained_model_is_named_in_the_test_file_and_built_by_the_plugin(device_check, tmp_path):
    """``--model smollm2-135m``: the tests mark the built-in name (the plugin loads its converted copy), bfloat16 on
    the GPU, float32 with --cpu; the Qwen3 shape stays the default."""
    args = device_check.parse_args(["--model", "smollm2-135m"])
    shape, dtype, device, tokens, model = device_check.settings(args)
    assert (shape, dtype, device, tokens, model) == (None, "bfloat16", "cuda", 32, "smollm2-135m")
    assert device_check.settings(device_check.parse_args(["--model", "smollm2-135m", "--cpu"]))[1:3] == ("float32", "cpu")
    assert "pytest.mark.opt_model('smollm2-135m', dtype='bfloat16')" in device_check.test_source(model, dtype, tokens)
    assert device_check.settings(device_check.parse_args([]))[0] is device_check.QWEN3_06B
    with pytest.raises(SystemExit):
        device_check.parse_args(["--model", "smollm2"])


def test_decode_column_shows_the_share_of_peak_on_a_gpu(device_check):
    assert device_check._decode({"decode_bandwidth_bytes_s": 2.4e12, "decode_bandwidth_fraction_of_peak": 0.5}) \
        == "2.4e+03 (50% of peak)"
    assert device_check._decode({}) == "-"



@pytest.mark.parametrize("installed", [True, False], ids=["entry point visible", "bare checkout"])
def test_the_pytest_child_gets_the_checkout_and_one_xdist_worker(device_check, monkeypatch, tmp_path, installed):
    """The child always gets the checkout on its path; the plugin is named only where no entry point is visible;
    where pytest-xdist is installed the tests run in one worker, so a technique that crashes the interpreter
    fails alone (on the H200 offloaded_static_cache's segfault had ended the session, report and all)."""
    monkeypatch.setattr(device_check, "plugin_installed", lambda: installed)
    command, env = device_check.pytest_command(tmp_path / "test_x.py", tmp_path / "r.json", "cpu", 2, 1)
    assert env["PYTHONPATH"].split(":")[0] == str(device_check.REPO)
    assert ("pytest_transformers_opt.plugin" in command) is not installed
    assert command[command.index("-n") + 1] == "1"  # xdist is installed here (the suite runs on it)


def test_the_pytest_child_as_composed_here_has_the_plugin_once(device_check, tmp_path):
    """The command as this machine composes it (an editable install: an entry point, and an *.egg-info in the
    checkout that once made the script leave the child without the plugin): the child knows --opt-* options,
    and does not load the plugin twice (pluggy refuses that)."""
    import subprocess

    command, env = device_check.pytest_command(tmp_path / "test_x.py", tmp_path / "r.json", "cpu", 2, 1)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    options = [a for a in command[4:] if a in ("-p", "pytest_transformers_opt.plugin", "no:cacheprovider")]
    done = subprocess.run(command[:3] + options + ["--help"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--opt-report-json" in done.stdout


def test_ab_mode_runs_the_three_techniques_against_this_python_behind_a_wrapper(device_check, tmp_path):
    """``--ab``: the child gets --opt-ab (a wrapper that execs this interpreter) and --opt-ab-fail; the
    wrapper is a working interpreter; --only picks techniques by test name and refuses an unknown one."""
    import subprocess
    import sys

    wrapper = device_check.write_ab_wrapper(tmp_path)
    done = subprocess.run([str(wrapper), "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == sys.executable
    command, _ = device_check.pytest_command(tmp_path / "test_x.py", tmp_path / "r.json", "cuda", "auto", 2, wrapper)
    assert f"--opt-ab={wrapper}" in command and f"--opt-ab-fail={device_check.AB_FAIL}" in command
    assert "--opt-rounds=auto" in command
    plain, _ = device_check.pytest_command(tmp_path / "test_x.py", tmp_path / "r.json", "cuda", 5, 2)
    assert not [a for a in plain if a.startswith("--opt-ab")]
    args = device_check.parse_args(["--ab", "--only", "sdpa, compile"])
    assert args.only == ["sdpa", "compile"] and args.rounds == "auto"
    source = device_check.test_source(tmp_path, "float32", 8, [t for t in device_check.AB_TECHNIQUES
                                                               if t[0] in args.only])
    assert "def test_sdpa(" in source and "def test_compile(" in source and "def test_static_cache(" not in source
    with pytest.raises(SystemExit):
        device_check.parse_args(["--ab", "--only", "bnb_4bit"])  # not one of --ab's techniques


def test_ab_table_shows_each_figures_change_and_interval_and_the_verdict(device_check):
    figure = {"candidate": 0.85, "reference": 0.81, "change_pct": 4.8, "interval_pct": [-11.5, 14.0], "p_value": 0.75,
              "word": "no significant difference", "note": None}
    report = {"tests": [
        {"nodeid": "t.py::test_sdpa", "outcome": "passed", "error": None,
         "ab": {"verdict": "ok", "optimized": {"latency_samples_s": [0.8] * 10},
                "figures": {"latency": figure, "peak_memory": {**figure, "change_pct": -0.01, "interval_pct": None}}}},
        {"nodeid": "t.py::test_static_cache", "outcome": "error", "error": "worker died\n--opt-ab: the worker died",
         "ab": None},
    ]}
    rows, notes = device_check.ab_table(report)
    body = {row[0]: row for row in rows[1:]}
    assert list(body) == [name for name, _ in device_check.AB_TECHNIQUES]
    assert body["sdpa"][:4] == ["sdpa", "passed", "ok", "10"]
    assert body["sdpa"][4] == "+4.8% [-11.5, +14.0] no significant difference"  # latency
    assert body["sdpa"][5:7] == ["-", "-"]  # ttft, tpot: not in this record
    assert body["sdpa"][7] == "-0.0% no significant difference"  # peak memory: one reading, no interval
    assert body["static_cache"][1:4] == ["error", "-", "-"]
    assert notes == ["static_cache: worker died --opt-ab: the worker died"]
    assert body["compile"][1] == "not run (time limit or crash)"
    assert [r[0] for r in device_check.ab_table(report, only=["sdpa"])[0][1:]] == ["sdpa"]
