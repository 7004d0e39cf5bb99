"""``pytest-opt advise``: text, --json, --write-test, --from-report, and bad input (exit 2, one line)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_transformers_opt.advisor import UNVERIFIED
from pytest_transformers_opt.cli import main

REPO = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["advise", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_report(capsys, model_dir):
    code, out, err = run(capsys, "--model", model_dir, "--gpu-memory", "12 GiB", "--input-tokens", "2048",
                         "--max-new-tokens", "512", "--batch-size", "1", "--concurrency", "1", "--problem", "load")
    assert code == 0 and err == ""
    assert out.startswith("Recommended change\n")
    assert '@pytest.mark.optimization("bnb_8bit", max_memory="12 GiB"' in out
    assert "(estimate)" in out and "12.00 GiB of GPU memory (stated)" in out
    assert out.rstrip().endswith(UNVERIFIED)


def test_json_output(capsys, model_dir):
    code, out, _ = run(capsys, "--model", str(Path(model_dir) / "config.json"), "--gpu-memory", "8GiB", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["schema"] == "pytest-transformers-opt/advice"
    assert data["change"] == "bnb_4bit"
    assert data["marker"].startswith('@pytest.mark.optimization("bnb_4bit"')
    assert data["supported_by"] and data["expected_tradeoffs"] and data["open_compatibility_questions"]
    assert data["assumptions"] and data["verified"] is False and data["verification"] == UNVERIFIED
    assert {e["kind"] for e in data["estimates"]} <= {"estimate", "stated", "probed"}
    assert data["measured"] == []
    assert data["validation"]["command"] == "pytest PATH --opt-report"


def test_write_test(capsys, model_dir, tmp_path):
    target = tmp_path / "out" / "test_next.py"
    target.parent.mkdir()
    code, out, _ = run(capsys, "--model", model_dir, "--gpu-memory", "24 GiB", "--input-tokens", "2048",
                       "--max-new-tokens", "100000", "--write-test", str(target))
    assert code == 0
    source = target.read_text()
    tree = ast.parse(source)
    assert '@pytest.mark.optimization(techniques.quantized_cache(backend="quanto", nbits=4), max_memory="24 GiB"' \
        in source
    assert f"pytest.mark.opt_model({json.dumps(model_dir)}, dtype=\"bfloat16\")" in source
    assert "opt_bench(prompts=PROMPTS, max_new_tokens=100000, batch_size=1)" in source
    assert [n.name for n in tree.body if isinstance(n, ast.FunctionDef)] == ["test_recommended_change"]
    assert os.listdir(target.parent) == ["test_next.py"]  # atomic write leaves no temporary file
    assert f"Test written to {target}." in out and f"pytest {target} --opt-report" in out


def test_write_test_keeps_the_current_attention_as_baseline(capsys, model_dir, tmp_path):
    target = tmp_path / "test_sdpa_user.py"
    code, _, _ = run(capsys, "--model", model_dir, "--gpu-memory", "8 GiB", "--attention", "sdpa",
                     "--write-test", str(target))
    source = target.read_text()
    assert code == 0
    assert '@pytest.mark.opt_baseline("sdpa")' in source
    assert '@pytest.mark.optimization("sdpa", "bnb_4bit"' in source
    ast.parse(source)


def test_tiny_model_end_to_end(capsys, tmp_path):
    """The one test that relies on the plugin's built-in tiny model config."""
    target = tmp_path / "test_tiny.py"
    code, out, _ = run(capsys, "--model", "tiny-random-llama", "--max-new-tokens", "4096", "--input-tokens", "2000",
                       "--write-test", str(target))
    assert code == 0
    source = target.read_text()
    ast.parse(source)
    assert 'pytest.mark.opt_model("tiny-random-llama", dtype="float32")' in source
    assert "max_new_tokens=16," in source  # kept small: seconds on CPU
    assert "@pytest.mark.optimization(" in source
    assert "built-in tiny model: lengths capped" in out


def test_from_report(capsys, model_dir, tmp_path):
    report = {
        "schema": "pytest-transformers-opt/report", "schema_version": 1, "created": "2025-06-01",
        "environment": {"device": "cuda:0", "gpu_name": "NVIDIA A10G", "compute_capability": "8.6",
                        "gpu_memory_bytes": 24 * 2**30, "bf16_supported": True, "torch": "2.6.0",
                        "transformers": "5.24.0", "bitsandbytes": "0.45.0"},
        "tests": [{
            "nodeid": "t.py::test_recommended_change", "outcome": "failed", "skip_reason": None, "error": None,
            "model": {"name_or_path": model_dir, "revision": None, "dtype": "bfloat16"},
            "techniques": ["bnb_4bit"], "baseline_techniques": [],
            "workload": {"num_prompts": 1, "max_new_tokens": 128, "batch_size": 1, "input_tokens": 256},
            "baseline": None,
            "optimized": {"ttft_s": 0.1, "tpot_s": 0.02, "latency_s": 2.6, "throughput_tok_s": 49.0,
                          "peak_memory_bytes": 6 * 2**30, "load_time_s": 12.0, "compile_time_s": None,
                          "tokens_generated": 128},
            "speedup": None, "memory_ratio": None,
            "similarity": {"token_match": 0.5, "kl_mean": 0.3, "kl_max": 2.0, "top1": 0.7},
            "budgets": [{"name": "max_memory", "limit": 12 * 2**30, "measured": 6 * 2**30, "ok": True},
                        {"name": "max_kl", "limit": 0.1, "measured": 0.3, "ok": False}],
            "failed_budgets": ["max_kl"]}],
        "summary": {"passed": 0, "failed": 1, "skipped": 0, "error": 0},
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    code, out, err = run(capsys, "--from-report", str(path), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["change"] == "bnb_8bit"
    assert data["measured_source"] == str(path)
    kl = next(m for m in data["measured"] if m["label"].startswith("budget max_kl"))
    assert kl["kind"] == "measured" and kl["where"] == "NVIDIA A10G, compute capability 8.6" and kl["value"] == 0.3
    code, out, _ = run(capsys, "--from-report", str(path))
    assert "optimized peak memory: 6.00 GiB (measured on NVIDIA A10G, compute capability 8.6)" in out
    assert UNVERIFIED not in out


@pytest.mark.parametrize("argv, needle", [
    (["--gpu-memory", "lots"], '--gpu-memory: cannot read \'lots\' as a memory size; accepted: "6 GiB"'),
    (["--cpu-memory", "-4 GiB"], "--cpu-memory: cannot read"),
    (["--input-tokens", "-5"], "--input-tokens: -5 must be a whole number >= 1"),
    (["--max-new-tokens", "many"], "--max-new-tokens: 'many' must be a whole number >= 1"),
    (["--batch-size", "0"], "--batch-size: 0 must be a whole number >= 1"),
    (["--concurrency", "1.5"], "--concurrency: '1.5' must be a whole number >= 1"),
    (["--problem", "slow"], "argument --problem: invalid choice: 'slow'"),
    (["--dtype", "int3"], "--dtype: 'int3' is not a supported dtype; accepted: float32, bfloat16 or float16"),
    (["--attention", "fast"], "--attention: 'fast' is not an attention implementation; accepted: eager, sdpa"),
    (["--compute-capability", "new"], "--compute-capability: 'new' is not a compute capability"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
])
def test_bad_input_exits_2_with_one_line(capsys, model_dir, argv, needle):
    code, out, err = run(capsys, "--model", model_dir, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and needle in err, err
    assert "Traceback" not in err


def test_bad_models_and_paths(capsys, tmp_path):
    code, _, err = run(capsys, "--model", str(tmp_path / "missing"))
    assert code == 2 and "--model:" in err and err.count("\n") == 1
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    code, _, err = run(capsys, "--model", str(tmp_path))
    assert code == 2 and "missing num_hidden_layers" in err
    code, _, err = run(capsys)
    assert code == 2 and "--model: required" in err
    code, _, err = run(capsys, "--from-report", str(tmp_path / "config.json"))
    assert code == 2 and "--from-report: the report " in err and "not a pytest-transformers-opt report" in err
    code, _, err = run(capsys, "--from-report", str(tmp_path / "nope.json"))
    assert code == 2 and "--from-report: cannot read" in err
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"schema": "pytest-transformers-opt/report", "schema_version": 1, "tests": []}))
    code, _, err = run(capsys, "--from-report", str(report))
    assert code == 2 and "--from-report: the report holds no test records" in err
    code, _, err = run(capsys, "--from-report", str(report), "--model", str(tmp_path / "missing"))
    assert code == 2 and "--model:" in err


def test_write_test_to_a_missing_folder(capsys, model_dir, tmp_path):
    code, _, err = run(capsys, "--model", model_dir, "--write-test", str(tmp_path / "no" / "t.py"))
    assert code == 2 and err.startswith("pytest-opt advise: error: --write-test: cannot write")


def test_help_documents_the_problems(capsys):
    assert main(["advise", "--help"]) == 0
    out = capsys.readouterr().out
    for name in ("load", "long-input", "long-generation", "concurrency", "speed"):
        assert f"  {name} " in out
    assert "--write-test" in out and "--from-report" in out and "--json" in out
    assert main([]) == 2  # no subcommand: help on stderr, status 2


def test_python_dash_m(model_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest_transformers_opt", "advise", "--model", model_dir,
                           "--gpu-memory", "80 GiB", "--problem", "speed"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert '@pytest.mark.optimization("compile"' in done.stdout
