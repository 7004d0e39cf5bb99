"""The JSON report's schema, its validation and loading, and the Markdown and HTML renderings."""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from browser import CHROMIUM, NEEDS_CHROMIUM, NETWORK_REFERENCE
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_transformers_opt.errors import OptConfigError
from pytest_transformers_opt.report.html import render_html
from pytest_transformers_opt.report.markdown import render_markdown
from pytest_transformers_opt.report.schema import (REPORT_SCHEMA, REPORT_SCHEMA_VERSION, load_report, load_schema,
                                                   validate_report)

# --------------------------------------------------------------------------- sample reports

SDPA_ID = "tests/test_opt.py::test_static_cache_with_sdpa"
FOUR_BIT_ID = "tests/test_opt.py::test_4bit_fits_a_small_card"
COMPILE_ID = "tests/test_opt.py::test_compile"
FA2_ID = "tests/test_opt.py::test_flash_attention_2"
FA2_COMPILE_ID = "tests/test_opt.py::test_fa2_with_compile"
BNB8_ID = "tests/test_opt.py::test_bnb_8bit"
QKV_ID = "tests/test_opt.py::test_quantized_kv_cache[quanto|4<b>bit</b>]"
CONFLICT_ID = "tests/test_opt.py::test_conflict"
FA2_REASON = "flash_attention_2 needs a CUDA GPU of compute capability >= 8.0; found: cpu"
BNB_REASON = "bnb_8bit needs the bitsandbytes package; found: not installed"

GiB = 2**30


def _metrics(latency: float, memory: int | None, *, ttft: float, tokens: int = 64) -> dict[str, Any]:
    return {
        "ttft_s": ttft,
        "tpot_s": (latency - ttft) / (tokens - 1),
        "latency_s": latency,
        "throughput_tok_s": tokens / latency,
        "peak_memory_bytes": memory,
        "load_time_s": 3.2,
        "compile_time_s": None,
        "tokens_generated": tokens,
        "recompiles": None,
        "rounds": 5,
        "latency_samples_s": [latency * f for f in (0.98, 1.0, 1.01, 1.0, 1.02)],
        "warmup_s": [latency * 3.0],
        "memory_method": "cuda.max_memory_allocated",
    }


def _budget(name: str, limit: float, measured: float | None, ok: bool | None, source: str = "marker",
            note: str | None = None) -> dict[str, Any]:
    return {"name": name, "limit": limit, "measured": measured, "ok": ok, "source": source, "note": note}


def _test(nodeid: str, outcome: str, techniques: list[str], **fields: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "nodeid": nodeid, "outcome": outcome, "skip_reason": None, "error": None,
        "model": {"name_or_path": "Qwen/Qwen3-0.6B", "revision": "c1899de", "dtype": "bfloat16"},
        "techniques": techniques, "baseline_techniques": ["eager"],
        "workload": {"num_prompts": 4, "max_new_tokens": 64, "batch_size": 4, "input_tokens": 32},
        "baseline": None, "optimized": None, "speedup": None, "memory_ratio": None, "similarity": None,
        "budgets": [], "failed_budgets": [], "estimates": {}, "regression": None,
    }
    record.update(fields)
    return record


def _skipped(nodeid: str, techniques: list[str], reason: str) -> dict[str, Any]:
    return _test(nodeid, "skipped", techniques, skip_reason=reason, workload=None)


def sample_report(*, regression: bool = True) -> dict[str, Any]:
    """A run on one GPU: passes, failed budgets, skips for two reasons, an error and hostile text."""
    tests = [
        _test(
            SDPA_ID, "passed", ["static_cache", "sdpa"],
            baseline=_metrics(1.20, 3 * GiB, ttft=0.050), optimized=_metrics(0.85, int(3.1 * GiB), ttft=0.031),
            speedup=1.41, memory_ratio=1.03,
            similarity={"token_match": 1.0, "kl_mean": 2.1e-4, "kl_max": 9e-4, "top1": 0.992, "near_tie": False,
                        "compared_steps": 256, "note": None},
            workload={"num_prompts": 4, "max_new_tokens": 64, "batch_size": 4, "input_tokens": 32, "rounds": 5,
                      "warmup": 2, "prompts": ["Explain gravity in one sentence."] * 4},
            budgets=[_budget("min_speedup", 1.2, 1.41, True), _budget("max_kl", 0.01, 2.1e-4, True),
                     _budget("min_top1", 0.97, 0.992, True, "default")],
            regression={"verdict": "ok", "details": []} if regression else None,
        ),
        _test(
            COMPILE_ID, "passed", ["compile"],
            baseline=_metrics(1.20, 3 * GiB, ttft=0.050),
            optimized={**_metrics(0.55, int(3.3 * GiB), ttft=0.020), "compile_time_s": 41.0, "recompiles": 0},
            speedup=2.18, memory_ratio=1.1,
            similarity={"token_match": 0.984, "kl_mean": 3.5e-3, "kl_max": 0.02, "top1": 0.981, "near_tie": True},
            budgets=[_budget("max_kl", 0.01, 3.5e-3, True, "default"),
                     _budget("min_top1", 0.97, 0.981, True, "default"),
                     _budget("max_recompiles", 0, 0, True)],
            regression={"verdict": "regressed", "details": ["latency +12.0% (limit 10%)"]} if regression else None,
        ),
        _test(FA2_ID, "skipped", ["flash_attention_2"], skip_reason=FA2_REASON, workload=None, model=None),
        _test(
            FOUR_BIT_ID, "failed", ["bnb_4bit"],
            baseline=_metrics(1.20, 3 * GiB, ttft=0.050), optimized=_metrics(1.69, int(1.86 * GiB), ttft=0.071),
            speedup=0.71, memory_ratio=0.62,
            similarity={"token_match": 0.41, "kl_mean": 0.14, "kl_max": 0.9, "top1": 0.83, "near_tie": False},
            budgets=[_budget("max_memory", 6 * GiB, 1.86 * GiB, True), _budget("max_memory_ratio", 0.5, 0.62, False),
                     _budget("max_kl", 0.1, 0.14, False, note="a | pipe and <i>markup</i> in a note"),
                     _budget("min_top1", 0.85, 0.83, False, "default")],
            failed_budgets=["max_memory_ratio", "max_kl", "min_top1"],
            error="budgets failed: max_memory_ratio 0.62 > 0.5; max_kl 0.14 > 0.1; min_top1 0.83 < 0.85",
        ),
        _skipped(FA2_COMPILE_ID, ["flash_attention_2", "compile"], FA2_REASON),
        _skipped(BNB8_ID, ["bnb_8bit"], BNB_REASON),
        _test(
            QKV_ID, "passed", ["quantized_cache(backend=quanto, nbits=4)"],
            baseline=_metrics(1.20, 3 * GiB, ttft=0.050), optimized=_metrics(1.31, int(2.6 * GiB), ttft=0.052),
            speedup=0.92, memory_ratio=0.87,
            similarity={"token_match": 0.9, "kl_mean": 0.031, "kl_max": 0.2, "top1": 0.9, "near_tie": False},
            budgets=[_budget("max_kl", 0.1, 0.031, True), _budget("min_top1", 0.85, 0.9, True, "default")],
            estimates={"kv_cache_bytes_at_32k": 1.5 * GiB, "max_concurrency": 12},
        ),
        _test(CONFLICT_ID, "error", ["bnb_4bit", "bnb_8bit"], workload=None,
              error="OptTechniqueConflict: bnb_4bit and bnb_8bit cannot be stacked\n"
                    "Traceback (most recent call last):"),
    ]
    return {
        "schema": "pytest-transformers-opt/report",
        "schema_version": 1,
        "created": "2026-11-29T20:00:00+00:00",
        "environment": {
            "python": "3.11.9", "platform": "Linux-6.8.0-x86_64-with-glibc2.39", "torch": "2.13.0",
            "transformers": "5.24.0", "accelerate": "1.11.0", "bitsandbytes": None, "kernels": None,
            "cuda": "12.8", "driver": "570.86.15", "device": "cuda:0", "gpu_name": "NVIDIA H200",
            "compute_capability": "9.0", "gpu_memory_bytes": 141 * 10**9, "device_count": 1,
            "bf16_supported": True, "tf32": False, "hostname_hint": "runner-7",
            "versions": {"optimum-quanto": "0.2.7", "flash-attn": None},
        },
        "settings": {"budgets_mode": "enforce", "rounds": 5, "warmup": 2, "device": "auto",
                     "default_model": "tiny-random-llama"},
        "tests": tests,
        "summary": {"passed": 3, "failed": 1, "skipped": 3, "error": 1},
        "advice": {"summary": ["static_cache + sdpa is the best measured configuration on this GPU."]},
    }


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- schema and validation


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_sample_report_is_valid_in_memory_and_after_a_json_round_trip() -> None:
    report = sample_report()
    validate_report(report)
    validate_report(json.loads(json.dumps(report)))


def test_every_figure_may_be_null() -> None:
    report = sample_report()
    test = report["tests"][0]
    for which in ("baseline", "optimized"):
        for key in ("ttft_s", "tpot_s", "latency_s", "throughput_tok_s", "peak_memory_bytes", "load_time_s",
                    "compile_time_s", "recompiles"):
            test[which][key] = None
        test[which]["latency_samples_s"] = [None, 0.5]
    test["speedup"] = test["memory_ratio"] = None
    test["similarity"].update(token_match=None, kl_mean=None, kl_max=None, top1=None)
    test["budgets"][0].update(measured=None, ok=None)
    test["estimates"] = {"peak_memory_bytes": None}
    report["environment"].update(gpu_memory_bytes=None, bf16_supported=None, tf32=None, gpu_name=None)
    validate_report(report)


def test_user_fields_go_under_extra_and_environment_is_open() -> None:
    report = sample_report()
    report["tests"][0]["extra"] = {"ticket": "OPT-12", "nested": {"any": [1, 2]}}
    report["environment"]["numa_nodes"] = 2
    validate_report(report)
    report["tests"][0]["ticket"] = "OPT-12"
    with pytest.raises(ValueError, match=r"report\.tests\[0\].*'ticket'"):
        validate_report(report)


def test_broken_report_fails_with_a_readable_message() -> None:
    pytest.importorskip("jsonschema")
    report = sample_report()
    report["tests"][1]["outcome"] = "bogus"
    report["tests"][0]["speedup"] = "fast"
    report["tests"][0]["budgets"][0]["source"] = "cli"
    report["tests"][3]["baseline"]["tokens_generated"] = -3
    del report["summary"]
    with pytest.raises(ValueError) as info:
        validate_report(report)
    message = str(info.value)
    assert message.startswith("invalid pytest-transformers-opt/report (schema_version 1):")
    assert "report.tests[1].outcome: 'bogus' is not one of ['passed', 'failed', 'skipped', 'error', 'xfailed', 'xpassed']" in message
    assert "report.tests[0].speedup: 'fast' is not of type 'number', 'null'" in message
    assert "report.tests[0].budgets[0].source: 'cli' is not one of" in message
    assert "report.tests[3].baseline.tokens_generated: -3 is less than the minimum of 0" in message
    assert "report: 'summary' is a required property" in message
    # nullable objects report what was wrong inside the object, not just "not valid under any schema"
    report = sample_report()
    report["tests"][0]["similarity"]["near_tie"] = "no"
    with pytest.raises(ValueError, match=r"report\.tests\[0\]\.similarity\.near_tie: 'no' is not of type 'boolean'"):
        validate_report(report)


def test_many_problems_are_capped_with_a_count() -> None:
    pytest.importorskip("jsonschema")
    report = sample_report()
    for test in report["tests"]:
        test["outcome"] = "maybe"
        test["speedup"] = "fast"
    with pytest.raises(ValueError) as info:
        validate_report(report)
    assert str(info.value).count("\n  - ") == 8
    assert str(info.value).endswith("\n  ... and 8 more")


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda r: r.update(schema="something/else"), 'expected "schema": "pytest-transformers-opt/report"; found'),
        (lambda r: r.pop("schema"), 'no "schema" key'),
        (lambda r: r.update(schema_version=2), "schema_version 2 is not supported"),
        (lambda r: r.update(schema_version=True), "schema_version True is not supported"),
    ],
)
def test_identity_of_the_document_is_checked_first(mutate: Any, expected: str) -> None:
    report = sample_report()
    mutate(report)
    with pytest.raises(ValueError, match=re.escape(expected)):
        validate_report(report)


def test_without_jsonschema_a_builtin_check_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # makes `import jsonschema` raise ImportError
    monkeypatch.setitem(sys.modules, "jsonschema.exceptions", None)
    validate_report(sample_report())
    with pytest.raises(ValueError, match="schema_version 3 is not supported"):
        validate_report({**sample_report(), "schema_version": 3})
    broken = sample_report()
    broken["tests"][2]["outcome"] = "bogus"
    broken["summary"] = []
    with pytest.raises(ValueError) as info:
        validate_report(broken)
    assert "report.tests[2].outcome: 'bogus' is not one of" in str(info.value)
    assert "report.summary: expected an object" in str(info.value)


# --------------------------------------------------------------------------- load_report


def test_load_report_reads_a_valid_file(tmp_path: Path) -> None:
    path = write_json(tmp_path / "opt-report.json", sample_report())
    assert load_report(path) == json.loads(path.read_text())
    assert load_report(str(path))["schema_version"] == 1


def test_load_report_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "opt-report.json"
    with pytest.raises(OptConfigError, match=r"cannot read the report '.*nowhere/opt-report\.json': No such file"):
        load_report(path)


def test_load_report_directory(tmp_path: Path) -> None:
    with pytest.raises(OptConfigError, match=r"cannot read the report '.*': Is a directory"):
        load_report(tmp_path)


def test_load_report_not_json(tmp_path: Path) -> None:
    path = tmp_path / "opt-report.json"
    path.write_text('{"schema": "pytest-transformers-opt/report",\n  "tests": [1, 2,]}\n')
    with pytest.raises(OptConfigError) as info:
        load_report(path)
    assert str(path) in str(info.value)
    assert "is not JSON: Expecting value at line 2, column" in str(info.value)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(OptConfigError, match=r"binary\.json' is not JSON: it is not UTF-8 text"):
        load_report(binary)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"tests": []}, 'not a pytest-transformers-opt report: expected "schema": "pytest-transformers-opt/report"; '
                        'found no "schema" key'),
        ({"schema": "pytest-benchmark"}, "not a pytest-transformers-opt report"),
        ([1, 2, 3], "a report is a JSON object; found list"),
        ({"schema": "pytest-transformers-opt/report", "schema_version": 2},
         "report schema_version 2 is not supported; this version of pytest-transformers-opt reads schema_version 1"),
        ({"schema": "pytest-transformers-opt/report"},
         'report schema_version no "schema_version" key is not supported'),
    ],
)
def test_load_report_not_a_report_or_other_version(tmp_path: Path, data: Any, expected: str) -> None:
    path = write_json(tmp_path / "old.json", data)
    with pytest.raises(OptConfigError) as info:
        load_report(path)
    assert f"the report {str(path)!r} cannot be used: " in str(info.value)
    assert expected in str(info.value)


def test_load_report_invalid_body_names_the_file_and_the_place(tmp_path: Path) -> None:
    pytest.importorskip("jsonschema")
    report = sample_report()
    report["tests"][0]["outcome"] = "bogus"
    path = write_json(tmp_path / "opt-report.json", report)
    expected = r"(?s)opt-report\.json' cannot be used: invalid .*report\.tests\[0\]\.outcome"
    with pytest.raises(OptConfigError, match=expected):
        load_report(path)


def test_load_report_one_line_with_source_and_remedy(tmp_path: Path) -> None:
    report = sample_report()
    report["tests"][0]["outcome"] = "bogus"
    report["summary"] = []
    path = write_json(tmp_path / "opt-report.json", report)
    with pytest.raises(OptConfigError) as info:
        load_report(path, source="--opt-compare", remedy="give a report")
    message = str(info.value)
    assert message.startswith(f"--opt-compare: the report {str(path)!r} cannot be used: ")
    assert "\n" not in message and message.endswith("; give a report")
    # a reader that needs only the identity and the test records takes it
    assert load_report(path, full_schema=False) == report


def test_the_json_schema_states_the_identity_the_code_writes() -> None:
    properties = load_schema()["properties"]
    assert properties["schema"] == {"const": REPORT_SCHEMA}
    assert properties["schema_version"] == {"const": REPORT_SCHEMA_VERSION}
    assert load_schema()["$id"].endswith(f":{REPORT_SCHEMA_VERSION}")


# --------------------------------------------------------------------------- markdown

HEADER = ("| Test | Techniques | Outcome | TTFT opt / base | TPOT opt / base | Tokens/s opt / base | Speedup "
          "| Peak memory opt / base | Memory ratio | Token match | KL mean | Top-1 | Failed budgets |")


def _cells(line: str) -> list[str]:
    """A Markdown table row split on its unescaped pipes."""
    assert line.startswith("| ") and line.endswith(" |"), line
    return re.split(r"(?<!\\)\|", line[1:-1])


def _section(markdown: str, title: str) -> str:
    start = markdown.index(f"### {title}")
    end = markdown.find("\n### ", start + 1)
    details = markdown.find("\n<details>", start + 1)
    ends = [e for e in (end, details) if e != -1]
    return markdown[start: min(ends) if ends else len(markdown)]


def _table_lines(section: str) -> list[str]:
    return [line for line in section.splitlines() if line.startswith("|")]


def test_markdown_has_the_results_table_header() -> None:
    markdown = render_markdown(sample_report(regression=False))
    assert markdown.startswith("## Optimization report\n")
    assert HEADER in markdown.splitlines()
    summary = ("**3 passed, 1 failed, 3 skipped, 1 error** · 2026-11-29 20:00 UTC · cuda:0 (NVIDIA H200)"
               " · budgets: enforce")
    assert summary in markdown


def test_markdown_table_rows_keep_their_columns_whatever_the_text() -> None:
    markdown = render_markdown(sample_report())
    lines = _table_lines(_section(markdown, "Results"))
    width = len(_cells(lines[0]))
    assert width == 14  # with the Regression column
    assert all(len(_cells(line)) == width for line in lines)
    for title in ("Failed budgets", "Estimated figures (estimate)"):
        lines = _table_lines(_section(markdown, title))
        assert len({len(_cells(line)) for line in lines}) == 1


def test_markdown_puts_failed_budgets_first() -> None:
    markdown = render_markdown(sample_report())
    assert markdown.index("### Failed budgets") < markdown.index("### Results")
    failed = _table_lines(_section(markdown, "Failed budgets"))
    assert failed[0] == "| Test | Budget | Measured | Limit | Source | Note |"
    rows = [[cell.strip() for cell in _cells(line)] for line in failed[2:]]
    assert rows == [
        [f"`{FOUR_BIT_ID}`", "max_memory_ratio", "0.62x", "0.50x", "marker", "-"],
        [f"`{FOUR_BIT_ID}`", "max_kl", "0.14", "0.1", "marker", "a \\| pipe and \\<i\\>markup\\</i\\> in a note"],
        [f"`{FOUR_BIT_ID}`", "min_top1", "83.0%", "85.0%", "default", "-"],
    ]
    results = _table_lines(_section(markdown, "Results"))[2:]
    assert FOUR_BIT_ID in results[0]  # the test with failed budgets leads the table
    assert CONFLICT_ID in results[1]  # then other failures and errors
    first = [cell.strip() for cell in _cells(results[0])]
    assert first[2] == "failed"
    assert first[6] == "0.71x"
    assert first[7] == "1.86 GiB / 3.00 GiB"
    assert first[8] == "0.62x"
    assert first[12] == "max_memory_ratio, max_kl, min_top1"


def test_markdown_row_shows_optimized_vs_baseline_and_similarity() -> None:
    markdown = render_markdown(sample_report())
    row = next(line for line in _table_lines(_section(markdown, "Results")) if SDPA_ID in line)
    cells = [cell.strip() for cell in _cells(row)]
    assert cells[:3] == [f"`{SDPA_ID}`", "static_cache + sdpa vs eager", "passed"]
    assert cells[3] == "31.0 ms / 50.0 ms"
    assert cells[6] == "1.41x"
    assert cells[7] == "3.10 GiB / 3.00 GiB"
    assert cells[9:12] == ["100.0%", "0.00021", "99.2%"]
    assert cells[12] == "-"
    assert cells[13] == "ok"
    compile_row = next(line for line in _table_lines(_section(markdown, "Results")) if COMPILE_ID in line)
    assert "98.4% (near-tie)" in compile_row
    assert "regressed: latency +12.0% (limit 10%)" in compile_row


def test_markdown_skipped_rows_and_groups_by_reason() -> None:
    markdown = render_markdown(sample_report())
    row = next(line for line in _table_lines(_section(markdown, "Results")) if f"`{FA2_ID}`" in line)
    assert f"skipped: {FA2_REASON.replace('>', chr(92) + '>')}" in row
    skipped = _section(markdown, "Skipped techniques (3 tests)")
    lines = skipped.splitlines()
    fa2 = lines.index("- flash_attention_2 needs a CUDA GPU of compute capability \\>= 8.0; found: cpu (2 tests)")
    assert lines[fa2 + 1] == f"  - `{FA2_ID}` — flash_attention_2"
    assert lines[fa2 + 2] == f"  - `{FA2_COMPILE_ID}` — flash_attention_2 + compile"
    bnb = lines.index(f"- {BNB_REASON} (1 test)")
    assert bnb > fa2  # the most frequent reason first
    assert skipped.count("flash_attention_2 needs") == 1


def test_markdown_environment_is_collapsed_in_details() -> None:
    markdown = render_markdown(sample_report())
    start, end = markdown.index("<details>"), markdown.index("</details>")
    assert markdown[start:].startswith("<details>\n<summary>Environment</summary>\n\n| Item | Value |")
    details = markdown[start:end]
    for expected in ("| GPU | NVIDIA H200 |", "| Compute capability | 9.0 |", "| Driver | 570.86.15 |",
                     "| CUDA | 12.8 |", "| torch | 2.13.0 |", "| bitsandbytes | - |", "| GPU memory | 131.32 GiB |",
                     "| bf16 supported | yes |", "| hostname_hint | runner-7 |",
                     "| versions | optimum-quanto 0.2.7, flash-attn - |", "| Budgets mode | enforce |",
                     "| Model | Qwen/Qwen3-0.6B @ c1899de (bfloat16) |"):
        assert expected in details
    assert markdown.rstrip().endswith("</details>")


def test_markdown_escapes_pipes_and_markup() -> None:
    markdown = render_markdown(sample_report())
    assert "`tests/test_opt.py::test_quantized_kv_cache[quanto\\|4<b>bit</b>]`" in markdown  # inside code
    assert "<b>" not in markdown.replace("`tests/test_opt.py::test_quantized_kv_cache[quanto\\|4<b>bit</b>]`", "")
    assert "<i>" not in markdown
    report = sample_report()
    report["tests"][2]["skip_reason"] = "needs *bold* `code` [link](x) | _emph_ & <script>&amp;"
    markdown = render_markdown(report)
    assert "needs \\*bold\\* \\`code\\` \\[link\\](x) \\| \\_emph\\_ & \\<script\\>&amp;amp;" in markdown


def test_markdown_backticks_in_a_test_id_use_a_longer_fence() -> None:
    report = sample_report()
    report["tests"][0]["nodeid"] = "tests/t.py::test_x[a`b]"
    assert "``` tests/t.py::test_x[a`b] ```".replace("```", "``") in render_markdown(report)


def test_markdown_estimates_have_their_own_section() -> None:
    markdown = render_markdown(sample_report())
    section = _section(markdown, "Estimated figures (estimate)")
    assert "| Test | Figure | Value (estimate) |" in section
    assert "| kv_cache_bytes_at_32k |" in section
    assert "1.50 GiB (estimate)" in section
    assert "12 (estimate)" in section
    assert "estimate" not in _section(markdown, "Results")
    assert "1.50 GiB" not in _section(markdown, "Results")


def test_markdown_regression_column_only_when_a_test_has_a_verdict() -> None:
    assert "| Regression |" in render_markdown(sample_report())
    assert "Regression" not in render_markdown(sample_report(regression=False))


def test_markdown_failures_advice_and_budget_mode() -> None:
    report = sample_report()
    report["settings"]["budgets_mode"] = "warn"
    markdown = render_markdown(report)
    assert "> Budgets were reported, not enforced (--opt-budgets=warn)" in markdown
    problems = _section(markdown, "Failures and errors")
    assert f"- `{CONFLICT_ID}` (error): OptTechniqueConflict: bnb_4bit and bnb_8bit cannot be stacked" in problems
    assert "Traceback" not in problems
    assert FOUR_BIT_ID not in problems  # its failure is its budgets, listed above
    assert "- static_cache + sdpa is the best" in _section(markdown, "Advice")


def test_markdown_shows_nan_and_missing_figures() -> None:
    report = sample_report()
    report["tests"][0]["speedup"] = float("nan")
    report["tests"][0]["optimized"]["peak_memory_bytes"] = float("inf")
    report["tests"][0]["similarity"]["kl_mean"] = None
    row = next(line for line in render_markdown(report).splitlines() if f"`{SDPA_ID}`" in line and "|" in line)
    cells = [cell.strip() for cell in _cells(row)]
    assert cells[6] == "NaN"
    assert cells[7] == "inf / 3.00 GiB"
    assert cells[10] == "-"


def test_markdown_of_a_run_without_opt_bench_tests() -> None:
    report = {**sample_report(), "tests": [], "summary": {"passed": 0, "failed": 0, "skipped": 0, "error": 0},
              "advice": None}
    validate_report(report)
    markdown = render_markdown(report)
    assert "No test used `opt_bench` in this run." in markdown
    assert "### Failed budgets" not in markdown and "### Skipped" not in markdown
    assert "<details>" in markdown


def test_markdown_tolerates_a_sparse_report() -> None:
    markdown = render_markdown({"tests": [{"nodeid": "t.py::a", "outcome": "passed"}]})
    assert "`t.py::a`" in markdown
    assert "1 passed, 0 failed, 0 skipped, 0 error" in markdown


# --------------------------------------------------------------------------- html



def test_html_is_self_contained_and_escaped() -> None:
    page = render_html(sample_report())
    assert page.startswith("<!DOCTYPE html>")
    assert not NETWORK_REFERENCE.search(page)
    assert "http://" not in page and "https://" not in page
    for forbidden in ("<script", "<link", "<img", "<iframe", "@import", "url(", "@font-face"):
        assert forbidden not in page.lower()
    assert "<style>" in page
    css = (Path(render_html.__code__.co_filename).parent / "report.css").read_text(encoding="utf-8")
    assert "td.outcome-passed" in css and css in page  # the package-data style sheet, inlined
    assert page.count("<svg") == 4
    for chart in ("chart-speedup", "chart-memory", "chart-kl", "chart-agreement"):
        assert f'id="{chart}"' in page
    assert "quanto|4&lt;b&gt;bit&lt;/b&gt;" in page
    assert "<b>" not in page and "<i>" not in page
    assert "a | pipe and &lt;i&gt;markup&lt;/i&gt; in a note" in page


def test_html_charts_carry_the_reference_lines_and_budget_markers() -> None:
    page = render_html(sample_report())
    speedup = page[page.index('id="chart-speedup"'): page.index("</svg>", page.index('id="chart-speedup"'))]
    assert "1.0x = baseline" in speedup
    assert "<title>min_speedup 1.20x</title>" in speedup
    assert speedup.count('class="row"') == 4  # measured tests only, skipped ones have no bars
    kl = page[page.index('id="chart-kl"'): page.index("</svg>", page.index('id="chart-kl"'))]
    assert "<title>max_kl 0.01</title>" in kl and "<title>max_kl 0.1</title>" in kl
    assert kl.count('class="marker"') >= 4
    memory = page[page.index('id="chart-memory"'): page.index("</svg>", page.index('id="chart-memory"'))]
    assert "<title>baseline peak memory: 3.00 GiB</title>" in memory
    assert "1.86 GiB (0.62x)" in memory and "<title>max_memory 6.00 GiB</title>" in memory
    agreement = page[page.index('id="chart-agreement"'): page.index("</svg>", page.index('id="chart-agreement"'))]
    assert "<title>min_top1 85.0%</title>" in agreement and "83.0%" in agreement


def test_html_lists_failed_budgets_table_skips_estimates_and_environment() -> None:
    page = render_html(sample_report())
    assert page.index("Failed budgets</h2>") < page.index("At a glance") < page.index("Results</h2>")
    results = page[page.index('<table class="results">'):]
    assert results.index(FOUR_BIT_ID) < results.index(SDPA_ID)
    assert "Estimated figures (estimate)" in page and "1.50 GiB (estimate)" in page
    assert f"<strong>{FA2_REASON.replace('>', '&gt;')}</strong> (2 tests)" in page
    assert "<details><summary>Environment</summary>" in page and "NVIDIA H200" in page


def report_with_intervals() -> dict[str, Any]:
    """The sample report as this version writes it: the speedup's 95% interval and each ratio's verdict word."""
    report = sample_report()
    figures = {  # nodeid -> (speedup interval, speedup verdict, memory verdict)
        SDPA_ID: ([1.30, 1.52], "faster", "no significant difference"),
        COMPILE_ID: ([2.01, 2.35], "faster", "larger"),
        FOUR_BIT_ID: ([0.66, 0.77], "slower", "smaller"),
        QKV_ID: ([0.85, 1.04], "no significant difference", "smaller"),
    }
    for test in report["tests"]:
        if test["nodeid"] in figures:
            interval, speedup_verdict, memory_verdict = figures[test["nodeid"]]
            test.update(speedup_interval=interval, speedup_verdict=speedup_verdict, speedup_interval_note=None,
                        memory_ratio_interval=None, memory_ratio_verdict=memory_verdict,
                        memory_ratio_interval_note="peak memory is read once per side, so there is no spread to "
                                                   "bound")
    return report


def test_every_format_shows_the_interval_and_the_verdict_word() -> None:
    from pytest_transformers_opt.report.writer import terminal_lines

    report = report_with_intervals()
    validate_report(json.loads(json.dumps(report)))
    markdown = render_markdown(report)
    row = next(line for line in _table_lines(_section(markdown, "Results")) if QKV_ID.split("[")[0] in line)
    cells = [cell.strip() for cell in _cells(row)]
    assert cells[6] == "0.92x \\[0.85-1.04\\] no significant difference"  # brackets escaped for GitHub
    assert cells[8] == "0.87x smaller"
    sdpa = [cell.strip() for cell in _cells(next(line for line in _table_lines(_section(markdown, "Results"))
                                                 if SDPA_ID in line))]
    assert sdpa[6] == "1.41x \\[1.30-1.52\\] faster" and sdpa[8] == "1.03x no significant difference"
    lines = terminal_lines(report)
    sdpa_line = next(line for line in lines if line.startswith("test_static_cache_with_sdpa"))
    assert "1.41x [1.30-1.52] faster" in sdpa_line and "1.03x n.s." in sdpa_line
    assert "0.92x [0.85-1.04] n.s." in next(line for line in lines if line.startswith("test_quantized_kv_cache"))
    assert "n.s.: no significant difference" in lines[-1]
    page = render_html(report)
    results = page[page.index('<table class="results">'):]
    assert '1.41x<span class="reason">[1.30-1.52] faster</span>' in results  # the interval wraps under the ratio
    assert '0.71x<span class="reason">[0.66-0.77] slower</span>' in results
    speedup = page[page.index('id="chart-speedup"'): page.index("</svg>", page.index('id="chart-speedup"'))]
    assert speedup.count('class="whisker"') == 4 and "<title>95% interval [1.30-1.52]</title>" in speedup
    assert "1.41x [1.30-1.52]" in speedup


def _speedup_bar_fill(page: str, nodeid: str) -> str:
    speedup = page[page.index('id="chart-speedup"'): page.index("</svg>", page.index('id="chart-speedup"'))]
    row = speedup[speedup.index(f"<title>{nodeid}"):]
    return re.search(r'<rect [^>]*fill="([^"]+)"', row).group(1)


def test_html_colours_only_significant_speedups() -> None:
    from pytest_transformers_opt.report.html import FAIL_COLOR, NEUTRAL_COLOR, OK_COLOR, WARN_COLOR

    page = render_html(report_with_intervals())
    assert _speedup_bar_fill(page, SDPA_ID) == OK_COLOR  # interval above 1.0
    assert _speedup_bar_fill(page, FOUR_BIT_ID) == WARN_COLOR  # interval below 1.0 (its failed budgets are others)
    qkv = QKV_ID.replace("<", "&lt;").replace(">", "&gt;")
    assert _speedup_bar_fill(page, qkv) == NEUTRAL_COLOR  # the interval holds 1.0: no difference to colour
    report = report_with_intervals()
    failed = next(test for test in report["tests"] if test["nodeid"] == QKV_ID)
    failed["failed_budgets"] = ["min_speedup"]
    assert _speedup_bar_fill(render_html(report), qkv) == FAIL_COLOR  # a failed min_speedup stays red
    # an older report has no interval: a point estimate alone is not coloured as a difference
    assert _speedup_bar_fill(render_html(sample_report()), SDPA_ID) == NEUTRAL_COLOR


def test_the_schema_checks_the_interval_fields() -> None:
    report = report_with_intervals()
    report["tests"][0]["speedup_interval"] = [1.3, 1.4, 1.5]
    report["tests"][1]["speedup_verdict"] = "quicker"
    with pytest.raises(ValueError) as raised:
        validate_report(report)
    assert "speedup_interval" in str(raised.value) and "'quicker' is not one of" in str(raised.value)


def test_html_of_an_empty_run_still_draws_every_chart() -> None:
    report = {**sample_report(), "tests": [], "advice": None}
    page = render_html(report)
    assert page.count("<svg") == 4
    assert page.count("No measured figures for this chart.") == 4
    assert "No test used <code>opt_bench</code> in this run." in page


def test_html_nan_figures_do_not_break_the_charts() -> None:
    report = sample_report()
    report["tests"][0]["speedup"] = float("nan")
    report["tests"][0]["similarity"]["kl_mean"] = float("inf")
    report["tests"][1]["optimized"]["peak_memory_bytes"] = None
    page = render_html(report)
    assert "nan" not in re.sub(r">[^<]*<", "><", page).lower()  # no NaN leaks into SVG coordinates
    assert ">NaN<" in page and ">inf<" in page




@NEEDS_CHROMIUM
def test_html_renders_in_headless_chromium_without_network(tmp_path: Path) -> None:
    page = tmp_path / "opt-report.html"
    page.write_text(render_html(sample_report()), encoding="utf-8")
    assert not NETWORK_REFERENCE.search(page.read_text(encoding="utf-8"))
    common = [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost",  # any network request would fail
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dumped = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120,
                            check=False)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = dumped.stdout
    for nodeid in (SDPA_ID, FOUR_BIT_ID, COMPILE_ID, FA2_ID, CONFLICT_ID):
        assert nodeid in dom
    assert "quanto|4&lt;b&gt;bit&lt;/b&gt;" in dom
    assert dom.count("<svg") == 4
    for chart in ("chart-speedup", "chart-memory", "chart-kl", "chart-agreement"):
        assert f'id="{chart}"' in dom
    shot = tmp_path / "opt-report.png"
    shooting = subprocess.run([*common, f"--screenshot={shot}", "--window-size=1280,2000", page.as_uri()],
                              capture_output=True, text=True, timeout=120, check=False)
    assert shooting.returncode == 0, shooting.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 20_000  # a drawn page, not a blank one


# --------------------------------------------------------------------------- properties

_hostile_text = st.text(alphabet=st.sampled_from(list("ab_*|`<>&[]\\~#\n\t é")), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(nodeid=_hostile_text, reason=_hostile_text, technique=_hostile_text)
def test_any_text_keeps_the_markdown_table_whole_and_the_html_escaped(nodeid: str, reason: str, technique: str) -> None:
    report = sample_report()
    report["tests"][0]["nodeid"] = nodeid
    report["tests"][0]["techniques"] = [technique]
    report["tests"][2]["skip_reason"] = reason
    report["tests"][3]["budgets"][1]["note"] = reason
    markdown = render_markdown(report)
    for title in ("Results", "Failed budgets"):
        lines = _table_lines(_section(markdown, title))
        assert len({len(_cells(line)) for line in lines}) == 1
    page = render_html(report)
    assert "<" not in re.sub(r"<(/?)(!DOCTYPE|html|head|meta|title|style|body|header|h1|h2|p|div|span|section|figure|"
                             r"figcaption|strong|svg|rect|line|text|g|table|thead|tbody|tr|th|td|code|ul|li|details|"
                             r"summary|footer)\b[^<>]*>", "", page.split("</style>", 1)[1])


def test_numbers_in_chart_coordinates_are_finite() -> None:
    page = render_html(sample_report())
    for number in re.findall(r'\s(?:x|y|x1|x2|y1|y2|width|height)="([^"]+)"', page):
        assert math.isfinite(float(number))


def test_report_dicts_are_not_modified_by_rendering() -> None:
    report = sample_report()
    before = copy.deepcopy(report)
    render_markdown(report)
    render_html(report)
    assert report == before


@NEEDS_CHROMIUM
def test_html_results_table_fits_a_laptop_screen_with_long_unbroken_labels(tmp_path: Path) -> None:
    """A vendored kernel's absolute path is one long word: it must wrap, not push Top-1 off the screen."""
    report = report_with_intervals()  # the widest speedup cells: ratio, interval and verdict word
    path = "/home/ci/work/" + "deep-folder-name/" * 6 + "vendor/rms-norm"
    report["tests"][0]["techniques"] = [f"kernels(layers={{'RMSNorm': 'RMSNorm'}}, local='{path}')"]
    report["tests"][2]["skip_reason"] = f"kernels(local='{path}') needs the kernels package; found: not installed"
    # test-side probe: after layout, record whether any table scrolls sideways
    probe = ("<script>window.addEventListener('load', () => { document.body.setAttribute('data-overflow', "
             "[...document.querySelectorAll('.table-wrap')].some(w => w.scrollWidth > w.clientWidth + 1)); });"
             "</script>")
    page = tmp_path / "opt-report.html"
    page.write_text(render_html(report).replace("</body>", probe + "</body>"), encoding="utf-8")
    dumped = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,2000",
                             f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                            capture_output=True, text=True, timeout=120, check=False)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    assert 'data-overflow="false"' in dumped.stdout
