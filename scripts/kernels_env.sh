#!/usr/bin/env bash
# The kernels environment: a second virtual environment for the tests that load a kernel
# (tests/integration/test_local_kernels.py) on the older pairing: transformers 5.20-5.22 with kernels 0.17.x
# (public `kernels.variants`). The main environment runs them with transformers 5.25+ and kernels 0.19.
# Pinned in one pip call so that the [test] extra cannot move transformers out of that range.
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu on GitHub's runners) picks where the
# CPU build of torch comes from; here the registry's torch==2.13.0 is that build already.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-kernels
.venv-kernels/bin/pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
.venv-kernels/bin/pip install -q -e ".[test]" "transformers>=5.20,<5.23" "kernels==0.17.2"
.venv-kernels/bin/python -m pytest tests/integration/test_local_kernels.py -q "$@"
# the example project's vendored kernel, as a team's CI would run it
(cd example_project && ../.venv-kernels/bin/python -m pytest tests/test_vendored_kernels.py -q -p no:cacheprovider)
