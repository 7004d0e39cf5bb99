"""The advisor's validation test passes as written for every change it recommends on the built-in models, and
its figures add up (issue 11, item 6)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_transformers_opt.advisor.docs import DISTRIBUTION_BUDGETS
from pytest_transformers_opt.advisor.estimates import RUNTIME_RESERVE_BYTES
from pytest_transformers_opt.cli import main as cli_main
from pytest_transformers_opt.units import format_bytes

LONG = ("--input-tokens", "4096", "--max-new-tokens", "4096", "--batch-size", "4")
# (file stem, the change the advisor must recommend, its arguments): one scenario per distinct recommendation
SCENARIOS = [
    ("sdpa", "sdpa", ["--model", "tiny-random-llama", *LONG, "--problem", "long-input"]),
    ("compile", "compile", ["--model", "tiny-random-llama", *LONG, "--problem", "speed"]),
    ("bnb_8bit", "bnb_8bit", ["--model", "tiny-random-llama", *LONG, "--problem", "load"]),
    # 1 MiB over the runtime reserve: the load stage breaks, and only 4-bit weights fit
    ("bnb_4bit", "bnb_4bit", ["--model", "tiny-random-llama", *LONG, "--cpu-memory", "1025 MiB"]),
    ("quantized_cache", "quantized_cache(backend='quanto', nbits=4)",
     ["--model", "tiny-random-llama", *LONG, "--problem", "long-generation"]),
    ("sliding_window", "sliding_window_cache",
     ["--model", "tiny-random-mistral", *LONG, "--problem", "long-generation"]),
    # continuous batching compares tokens only: the case whose test asked for max_kl / min_top1 (bf16, as
    # on a GPU, for concurrency; float32 after sdpa, for a long input's prefill)
    ("cb_bf16", "continuous_batching(max_batch_tokens=4096)",
     ["--model", "tiny-random-llama", *LONG, "--concurrency", "4", "--dtype", "bf16"]),
    ("cb_prefill", "continuous_batching(max_batch_tokens=1024)",
     ["--model", "tiny-random-llama", *LONG, "--problem", "long-input", "--attention", "sdpa"]),
    # a GPU-only recommendation: on a CPU-only machine its test skips with the hardware reason
    ("flash", "flash_attention_2", ["--model", "tiny-random-llama", *LONG, "--problem", "long-input", "--device",
                                    "cuda", "--compute-capability", "8.0", "--dtype", "bf16"]),
]
HARDWARE_SKIPS = ("CUDA", "GPU", "compute capability")


def _advise(capsys: pytest.CaptureFixture[str], args: list[str], test_path: Path) -> dict[str, Any]:
    assert cli_main(["advise", *args, "--json", "--write-test", str(test_path)]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_written_validation_test_passes_as_written(capsys: pytest.CaptureFixture[str],
                                                         pytester: pytest.Pytester) -> None:
    advice = {}
    for stem, change, args in SCENARIOS:
        advice[stem] = data = _advise(capsys, args, pytester.path / f"test_{stem}.py")
        assert data["change"] == change, (stem, data["change"])
        if "continuous_batching" in change:
            assert not set(data["budgets"]) & set(DISTRIBUTION_BUDGETS), data["marker"]  # unmeasurable there
    # every written test in one session: the model loads once, runs with one round and no warm-up
    report = pytester.path / "r.json"
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-rounds=1", "--opt-warmup=0",
                                f"--opt-report-json={report}")
    assert "INTERNALERROR" not in result.stdout.str()
    tests = {t["nodeid"].split("::")[0].removeprefix("test_").removesuffix(".py"): t
             for t in json.loads(report.read_text())["tests"]}
    assert set(tests) == set(advice)
    for stem, test in tests.items():
        if test["outcome"] == "skipped":
            assert any(word in test["skip_reason"] for word in HARDWARE_SKIPS), (stem, test["skip_reason"])
            continue
        assert test["outcome"] == "passed", (stem, test["outcome"], test["failed_budgets"], test["error"],
                                             advice[stem]["marker"])
        # each budget the test asked for was measured and met (none left unmeasurable)
        asked = {b["name"]: b for b in test["budgets"] if b["source"] == "marker"}
        assert set(asked) == set(advice[stem]["budgets"]), stem
        assert all(b["ok"] is True and b["measured"] is not None for b in asked.values()), (stem, asked)


def test_the_figures_state_the_runtime_reserve_apart(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["--model", "tiny-random-llama", "--dtype", "bf16", "--cpu-memory", "8 GiB", "--input-tokens", "256",
            "--max-new-tokens", "64", "--problem", "speed"]
    data = _advise(capsys, args, tmp_path / "test_speed.py")
    figures = {f["label"]: f["value"] for f in data["estimates"]}
    weights = figures["weights in bfloat16"]
    # the load stage holds the weights alone: the reserve is a figure of its own, not hidden in each peak
    assert figures["as is (eager, no optimization): peak at stage load"] == weights < 2**20
    reserve = [value for label, value in figures.items() if label.startswith("runtime reserve")]
    assert reserve == [RUNTIME_RESERVE_BYTES["cpu"]]
    assert all(value < RUNTIME_RESERVE_BYTES["cpu"] for label, value in figures.items() if "peak at stage" in label)
    assert cli_main(["advise", *args]) == 0
    text = capsys.readouterr().out
    assert f"plus the {format_bytes(RUNTIME_RESERVE_BYTES['cpu'])} runtime reserve" in text
    assert f"peak at stage load: {format_bytes(weights)} (estimate)" in text


def test_from_report_keeps_only_budgets_continuous_batching_can_measure(capsys: pytest.CaptureFixture[str],
                                                                         tmp_path: Path) -> None:
    """A report whose user set max_kl: the next step, continuous batching, cannot measure it, so its test
    does not ask for it (it would fail "not measured in this run")."""
    report = {
        "schema": "pytest-transformers-opt/report", "schema_version": 1, "created": "2026-12-01",
        "environment": {"device": "cpu", "torch": "2.13.0", "transformers": "5.24.0"},
        "tests": [{"nodeid": "t.py::test_recommended_change", "outcome": "passed", "skip_reason": None, "error": None,
                   "model": {"name_or_path": "tiny-random-llama", "revision": None, "dtype": "float32"},
                   "techniques": ["sdpa"], "baseline_techniques": [],
                   "workload": {"num_prompts": 8, "max_new_tokens": 16, "batch_size": 2, "input_tokens": 64},
                   "optimized": {"latency_s": 0.1, "peak_memory_bytes": 2**21}, "similarity": {"kl_mean": 0.0},
                   "budgets": [{"name": "max_kl", "limit": 0.05, "measured": 0.0, "ok": True, "source": "marker"}],
                   "failed_budgets": []}],
        "summary": {"passed": 1, "failed": 0, "skipped": 0, "error": 0},
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    data = _advise(capsys, ["--from-report", str(path), "--concurrency", "4"], tmp_path / "test_next.py")
    assert data["change"] and data["change"].startswith("continuous_batching"), data["change"]
    assert "max_kl" not in data["budgets"] and "max_kl" not in (tmp_path / "test_next.py").read_text()
