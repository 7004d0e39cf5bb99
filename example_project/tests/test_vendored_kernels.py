"""A kernel the team vendors in vendor/ (no network at test time), checked against the baseline."""

from pathlib import Path

import pytest

from pytest_transformers_opt import techniques

RMS_NORM_KERNEL = Path(__file__).resolve().parent.parent / "vendor" / "rms-norm"


@pytest.mark.optimization(techniques.kernels(local=RMS_NORM_KERNEL, layers={"RMSNorm": "RMSNorm"}), max_kl=1e-5)
def test_vendored_rms_norm_kernel(opt_bench):
    """Skips with the reason where the installed transformers and kernels disagree (transformers 5.23-5.24
    want kernels >= 0.18.2); runs with transformers 5.25+ (which installs kernels 0.19), and with transformers
    5.20-5.22 and kernels 0.17 (scripts/kernels_env.sh)."""
    result = opt_bench()
    assert result.similarity.token_match == 1.0
