"""The advisor against the plugin: its validation test runs green, its memory estimate meets a measurement."""

from __future__ import annotations

import shutil

from pytest_transformers_opt.advisor import estimate_peak_memory
from pytest_transformers_opt.cli import main as cli_main
from pytest_transformers_opt.engine.tiny_models import ensure_tiny_model, tiny_model_config

from test_advisor_validation import LONG  # tests/integration is on sys.path (rootdir-relative imports)


def test_the_written_validation_test_runs_green_on_cpu(run_user, pytester, capsys):
    written = pytester.path / "test_recommended.py"
    # test_advisor_validation's compile scenario, on a machine that states its memory: the written test compiles the
    # same graph, so the suite compiles it once (tests/conftest.py)
    code = cli_main(["advise", "--model", "tiny-random-llama", "--cpu-memory", "8 GiB", *LONG, "--problem", "speed",
                     "--write-test", str(written)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "unverified" in printed  # nothing has been measured yet
    source = written.read_text()
    assert "@pytest.mark.optimization(" in source
    shutil.move(str(written), str(pytester.path / "test_user.py"))
    report = pytester.path / "r.json"
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-rounds=2", f"--opt-report-json={report}")
    result.assert_outcomes(passed=1)


def test_estimated_peak_memory_is_within_25_percent_of_the_measured_one(run_user):
    """~100M-parameter random Llama on CPU, fp32, sdpa: weights dominate, so the estimate must hold."""
    ensure_tiny_model("small-random-llama-100m")
    prompts = ["The cat sees the red apple every morning " * 40] * 2
    run = run_user(f'''
import pytest

@pytest.mark.opt_model("small-random-llama-100m", dtype="float32")
@pytest.mark.optimization("sdpa", min_token_match=0.0, max_kl=100.0)
def test_memory(opt_bench):
    opt_bench(prompts={prompts!r}, max_new_tokens=4, rounds=1, warmup=0)
''')
    run.result.assert_outcomes(passed=1)
    entry = run.test("test_memory")
    measured = entry["optimized"]["peak_memory_bytes"]
    estimated = estimate_peak_memory(tiny_model_config("small-random-llama-100m"), "float32", ["sdpa"],
                                     entry["workload"]["input_tokens"], 4, 2)
    assert abs(estimated - measured) / measured < 0.25, (estimated, measured)
