"""The settings block and the GPU gate workflow that ``pytest-opt init`` writes into a user's project.

The workflow is the repository's own ``.github/workflows/gpu-gate.yml`` (its single-runner job), adapted
to a project that installs the plugin from its package index: the same compile cache, the same history of
main's runs in the Actions cache (recorded on main only, read by pull requests) and the same judgement
against its window, the same strict mode over the techniques the starter tests use. ``.github/actionlint.yaml``
names the runner's custom label for actionlint.
"""

from __future__ import annotations

import json

STARTER_TEST = "tests/test_optimizations.py"
WORKFLOW = ".github/workflows/gpu-gate.yml"
ACTIONLINT_CONFIG = ".github/actionlint.yaml"
RUNNER_LABELS = ("gpu",)  # the custom labels of the workflow's self-hosted runner (runs-on: [self-hosted, gpu])
HISTORY_FOLDER = ".opt-history-main"  # main's recorded runs, kept in the Actions cache
REPORT_JSON = "opt-report.json"
REPORT_MD = "opt-report.md"
COMPARE_FAIL = "latency:10%,peak_memory:5%,kl_mean:0.01"
INI_HEADER = ("pytest-transformers-opt settings, written by `pytest-opt init`; every key and its command-line "
              "twin: pytest --help (section transformers-opt)")
# Settings left for the user to turn on: (key, value, what it does), the comment on a line of its own so that
# uncommenting the key takes nothing else into its value.
OPTIONAL_SETTINGS = (
    ("opt_history", ".opt-history", "Record every run's report in this folder (trends, `pytest-opt history`)"),
    ("opt_require", "all", "Strict mode: a skipped technique fails its test (the GPU gate names its own)"),
)


def _settings(model: str) -> list[tuple[str, str]]:
    """The keys set, in order: the model the tests use by default, and the report written at every run."""
    return [("opt_model", model), ("opt_report", "true"), ("opt_report_json", REPORT_JSON)]


def pytest_ini(model: str) -> str:
    """A ``pytest.ini`` holding the plugin's settings (ini values are raw text: no quoting)."""
    lines = [f"# {INI_HEADER}", "[pytest]"]
    lines += [f"{key} = {value}" for key, value in _settings(model)]
    for key, value, what in OPTIONAL_SETTINGS:
        lines += [f"# {what}:", f"# {key} = {value}"]
    return "\n".join(lines) + "\n"


def pyproject_section(model: str, table: str = "tool.pytest.ini_options") -> str:
    """A ``[tool.pytest.ini_options]`` table (or ``table``: pytest 9's ``tool.pytest`` reads the same string
    values) holding the same settings (TOML strings, JSON-escaped: the escapes TOML's basic strings share
    with JSON)."""
    lines = [f"[{table}]", f"# {INI_HEADER}"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in _settings(model)]
    for key, value, what in OPTIONAL_SETTINGS:
        lines += [f"# {what}:", f"# {key} = {json.dumps(value)}"]
    return "\n".join(lines) + "\n"


WORKFLOW_TEMPLATE = """\
# The GPU gate, written by `pytest-opt init` ({package}): runs this project's
# optimization tests (those marked `optimization`) on a self-hosted GPU runner, fails when a required
# technique is skipped (strict mode) or a budget fails, and judges each test against the window of its
# own runs on main (--opt-compare=DIR; a regression is measured twice before it fails the run). The
# report is uploaded as the artifact "opt-report" and its Markdown is appended to the run's step
# summary by the plugin itself.
#
# main's history: every run on main records its report in the folder {history} (--opt-history),
# kept between runs in the Actions cache: restored before the run by the key prefix (the newest entry;
# a pull request may read the default branch's caches), saved after it under a new key, on main only.
# A pull request reads that folder and never records into it nor saves it. The first runs on main
# build the history (the plugin says so) before it judges. Pull requests from forks do not run here.
#
# The runner: a self-hosted machine with a GPU, registered with the custom label "gpu". actionlint
# learns the label from .github/actionlint.yaml (`pytest-opt init` writes it when missing):
#   self-hosted-runner:
#     labels:
#       - gpu
# Dependencies: the plugin, then requirements.txt when the project has one (edit the install step to
# install your project the way it installs).
name: gpu-gate

on:
  push:
    branches: [main]
  pull_request:
  workflow_dispatch:

permissions:
  contents: read

# One run at a time per branch, so main's runs restore and save the history one after the other. A
# pull request's newer push cancels its older run; main's runs are never cancelled (each is recorded).
concurrency:
  group: gpu-gate-${{{{ github.ref }}}}
  cancel-in-progress: ${{{{ github.ref != 'refs/heads/main' }}}}

jobs:
  gpu-gate:
    name: GPU gate
    # Pull requests from forks never run on the self-hosted machine.
    if: github.event_name != 'pull_request' || github.event.pull_request.head.repo.full_name == github.repository
    runs-on: [self-hosted, gpu]
    timeout-minutes: 120
    steps:
      - uses: actions/checkout@v6

      - name: Install the plugin and the project's requirements
        shell: bash
        run: |
          python -m pip install "{package}"
          if [ -f requirements.txt ]; then
            python -m pip install -r requirements.txt
          fi

      # torch's compile caches, kept between runs (--opt-compile-cache, given below through its
      # variable): the plugin keys the folder by torch, transformers and GPU; the cache key adds the tests.
      - name: Read the compile cache key
        id: compile-key
        shell: bash
        run: |
          {{
            echo "torch=$(python -c 'import importlib.metadata as m; print(m.version("torch"))')"
            echo "transformers=$(python -c 'import importlib.metadata as m; print(m.version("transformers"))')"
            echo "gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr -c 'A-Za-z0-9.\\n' '-')"
          }} >> "$GITHUB_OUTPUT"

      - name: Restore the compile cache
        id: compile-cache
        uses: actions/cache/restore@v5
        with:
          path: .opt-compile-cache
          key: opt-compile-${{{{ steps.compile-key.outputs.torch }}}}-${{{{ steps.compile-key.outputs.transformers }}}}-${{{{ steps.compile-key.outputs.gpu }}}}-${{{{ hashFiles('{tests}/**') }}}}
          restore-keys: |
            opt-compile-${{{{ steps.compile-key.outputs.torch }}}}-${{{{ steps.compile-key.outputs.transformers }}}}-${{{{ steps.compile-key.outputs.gpu }}}}-

      # main's runs (a push to main, a manual run of main) record the history; every other run reads it.
      - name: Decide whether this run records main's history
        id: history
        shell: bash
        run: |
          if [ "$GITHUB_EVENT_NAME" != pull_request ] && [ "$GITHUB_REF" = refs/heads/main ]; then
            echo "record=true" >> "$GITHUB_OUTPUT"
          else
            echo "record=false" >> "$GITHUB_OUTPUT"
          fi

      # The key never exists yet (a run id): the prefix restores the newest entry main saved.
      - name: Restore main's run history
        id: history-cache
        uses: actions/cache/restore@v5
        with:
          path: {history}
          key: opt-history-main-gate-${{{{ github.run_id }}}}-${{{{ github.run_attempt }}}}
          restore-keys: opt-history-main-gate-

      - name: Run the optimization tests
        shell: bash
        env:
          PYTEST_OPT_COMPILE_CACHE: ${{{{ github.workspace }}}}/.opt-compile-cache
          OPT_HISTORY: ${{{{ github.workspace }}}}/{history}
          RECORD_HISTORY: ${{{{ steps.history.outputs.record }}}}
        run: |
          # the first run on a fresh repository finds no history: an empty folder is one not begun yet
          mkdir -p "$OPT_HISTORY"
          record=()
          if [ "$RECORD_HISTORY" = true ]; then
            record=("--opt-history=$OPT_HISTORY")
          fi
          pytest -m optimization --opt-report \\
            --opt-require={require} \\
            --opt-report-json={report_json} \\
            --opt-report-md={report_md} \\
            "--opt-compare=$OPT_HISTORY" \\
            --opt-compare-fail={compare_fail} \\
            --opt-compare-confirm=1 \\
            "${{record[@]}}"

      # Saved also when a test failed (a regression is no reason to compile again next time).
      - name: Save the compile cache
        if: always() && steps.compile-cache.outputs.cache-hit != 'true'
        uses: actions/cache/save@v5
        with:
          path: .opt-compile-cache
          key: ${{{{ steps.compile-cache.outputs.cache-primary-key }}}}

      # Saved also when a test failed, so a run that failed the gate is in the window too.
      - name: Save main's run history
        if: always() && steps.history.outputs.record == 'true'
        uses: actions/cache/save@v5
        with:
          path: {history}
          key: ${{{{ steps.history-cache.outputs.cache-primary-key }}}}

      - name: Upload the report
        if: always()
        uses: actions/upload-artifact@v6
        with:
          name: opt-report
          path: {report_json}
          if-no-files-found: warn
"""


def gpu_gate_workflow(required: list[str], version: str | None, tests: str = "tests") -> str:
    """The workflow; ``required``: the techniques strict mode requires (the starter tests'); ``version``: the
    plugin's release to install (None: the latest)."""
    package = "pytest-transformers-opt" if version is None else f"pytest-transformers-opt=={version}"
    return WORKFLOW_TEMPLATE.format(package=package, require=",".join(required), tests=tests, history=HISTORY_FOLDER,
                                    report_json=REPORT_JSON, report_md=REPORT_MD, compare_fail=COMPARE_FAIL)


def actionlint_config() -> str:
    """``.github/actionlint.yaml``: the workflow's custom runner labels, which actionlint does not know."""
    lines = ["# Written by `pytest-opt init`: the custom labels of the self-hosted runners the workflows run on",
             "# (actionlint reports any other label as unknown).", "self-hosted-runner:", "  labels:"]
    return "\n".join(lines + [f"    - {label}" for label in RUNNER_LABELS]) + "\n"
