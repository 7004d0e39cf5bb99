"""Issue 19, the reports' items: a gate that judged nothing fails (3); the model's identity holds every
argument that changes the loaded model (4); merge outputs never overwrite each other or an input (9),
each is written on its own with the verdict kept (14), a file given twice says so (19); reports of every
earlier layout of schema_version 1 are read (12); nothing the plugin writes is refused when read back
(13); an improvement is never "within noise" (21); a merged report's tables say which hardware, and its
header which shard ran with which settings (20).

One real session (``base.json``) is run once per module and shared; the other reports are edited
copies of it, as a user's earlier or other-machine runs.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest

from pytest_transformers_opt import files
from pytest_transformers_opt.cli import main
from pytest_transformers_opt.report.schema import load_report, report_text, validate_report

from conftest import FAST_ARGS

USER_TESTS = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=2)

@pytest.mark.optimization("static_cache", max_latency="1 ns")
def test_over_budget(opt_bench):
    opt_bench(max_new_tokens=1)
'''

CHEAP = (*FAST_ARGS, "--opt-rounds=1", "--opt-warmup=0", "-p", "no:randomly")
H200 = "NVIDIA H200"
FIXTURES = Path(__file__).parent.parent / "data" / "reports"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shared report is kept: one folder for every xdist worker of the session."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.mktemp("round2-runs")
    shared = tmp_path_factory.getbasetemp().parent / "round2-runs"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture
def base(pytester: pytest.Pytester, store: Path) -> Path:
    """base.json: the user's two tests measured once (test_over_budget fails its budget)."""
    path = store / "base.json"
    with open(store / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            pytester.makepyfile(test_user=USER_TESTS)
            written = pytester.path / "base.json"
            result = pytester.runpytest(*CHEAP, f"--opt-report-json={written}")
            assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
            result.assert_outcomes(passed=1, failed=1)
            shutil.copy(written, path)
    return path


def read(path: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(path.read_text())
    validate_report(report)
    return report


def write(path: Path, report: dict[str, Any]) -> Path:
    path.write_text(json.dumps(report))
    return path


def on_h200(report: dict[str, Any]) -> dict[str, Any]:
    """A copy of a report as if its run had been on an H200 (the runner's GPU changed)."""
    report = copy.deepcopy(report)
    report["environment"].update(device="cuda:0", gpu_name=H200, hardware=H200)
    for test in report["tests"]:
        test["hardware"] = H200
    return report


def merge(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main(["merge", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def by_id(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in report["tests"] if t["nodeid"] == f"test_user.py::{name}")


# ------------------------------------------------------------------ 3: a gate that judged nothing fails


def test_opt_compare_fail_fails_when_every_row_is_not_comparable(base, pytester, tmp_path):
    old = write(tmp_path / "old-h200.json", on_h200(read(base)))
    pytester.makepyfile(test_user=USER_TESTS)
    new = pytester.path / "new.json"
    result = pytester.runpytest(*CHEAP, "-k", "test_sdpa", f"--opt-report-json={new}", f"--opt-compare={old}",
                                "--opt-compare-fail=kl_mean:1")
    result.assert_outcomes(passed=1)  # the test passed; the gate could not judge it
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"*--opt-compare-fail=kl_mean:1 against --opt-compare={old}: no test could be "
                                 f"judged (1 test: measured on different hardware: '{H200}' -> 'CPU: *'): the run "
                                 f"fails"])
    assert by_id(read(new), "test_sdpa")["regression"]["verdict"] == "not comparable"


def test_opt_compare_fail_fails_when_every_measured_test_now_skips(base, pytester):
    pytester.makepyfile(test_user='''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    pytest.skip("not on this runner")
''')
    new = pytester.path / "new.json"
    result = pytester.runpytest(*CHEAP, f"--opt-report-json={new}", f"--opt-compare={base}",
                                "--opt-compare-fail=latency:10%")
    result.assert_outcomes(skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*--opt-compare-fail=latency:10% against *: no test could be judged (1 test: no "
                                 "measurement in the new run (skipped: not on this runner)): the run fails"])


def test_merge_compare_fail_exits_1_when_nothing_was_judged(base, capsys, tmp_path):
    old = write(tmp_path / "old-h200.json", on_h200(read(base)))
    target = tmp_path / "merged.json"
    code, out, err = merge(capsys, base, "-o", target, "--compare", old, "--compare-fail", "kl_mean:1")
    assert code == 1
    assert "compare: 0 regressed, 0 inconclusive, 0 improved, 0 ok, 0 new, 2 not comparable" in out
    assert err == (f"pytest-opt merge: --compare-fail=kl_mean:1 against --compare={old}: no test could be judged "
                   f"(2 tests: measured on different hardware: '{H200}' -> "
                   f"'{read(base)['environment']['hardware']}'): exit status 1\n")
    assert {t["regression"]["verdict"] for t in read(target)["tests"]} == {"not comparable"}  # still written
    # one row judged: the gate judged something, and passes
    partly = read(base)
    partly["tests"][1] = on_h200(partly)["tests"][1]
    code, _, err = merge(capsys, base, "-o", target, "--compare", write(tmp_path / "partly.json", partly),
                         "--compare-fail", "kl_mean:1")
    assert (code, err) == (0, "")


# ------------------------------------------------------------------ 4: the model's identity


def test_a_model_loaded_with_other_arguments_is_not_comparable(base, pytester):
    pytester.makepyfile(test_user='''
import pytest

@pytest.mark.opt_model("tiny-random-llama", num_hidden_layers=1)
@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=2)
''')
    new = pytester.path / "new.json"
    result = pytester.runpytest(*CHEAP, f"--opt-report-json={new}", f"--opt-compare={base}", "--opt-report")
    assert result.ret == pytest.ExitCode.OK
    row = by_id(read(new), "test_sdpa")
    assert row["model"]["name_or_path"] == "tiny-random-llama"
    assert row["model"]["arguments"] == {"from_pretrained_kwargs": {"num_hidden_layers": "1"}}
    assert row["regression"] == {"verdict": "not comparable",
                                 "details": ["different model: arguments none -> num_hidden_layers=1"]}
    result.stdout.fnmatch_lines(["not comparable (1 test): different model: arguments none -> num_hidden_layers=1"])
    assert "arguments" not in by_id(read(base), "test_sdpa")["model"]  # a plain model's identity is as it was


# ------------------------------------------------------------------ 9, 14, 19: merge's outputs and inputs


@pytest.mark.parametrize("option", ["--md", "--html"])
def test_merge_refuses_two_outputs_on_one_file(base, capsys, tmp_path, option):
    target = tmp_path / "merged.json"
    code, out, err = merge(capsys, base, "-o", target, option, target)
    assert code == 2 and out == ""
    assert err == (f"pytest-opt merge: error: -o and {option} name the same file {str(target)!r}; each output "
                   f"needs its own path\n")
    assert not target.exists()
    # nor may a rendering replace a report it reads
    before = base.read_text()
    code, _, err = merge(capsys, base, "-o", target, option, base)
    assert code == 2 and f"{option}: {str(base)!r} is an input report" in err
    assert base.read_text() == before


def test_merge_writes_each_output_on_its_own_and_keeps_the_regression_status(base, capsys, tmp_path):
    old = read(base)
    for test in old["tests"]:  # the old run 100 times faster: a regression past latency:10%
        if test["optimized"]:
            test["optimized"]["latency_samples_s"] = [v / 100 for v in test["optimized"]["latency_samples_s"]]
            test["optimized"]["latency_s"] = statistics.median(test["optimized"]["latency_samples_s"])
    old_path = write(tmp_path / "old.json", old)
    target, html, unwritable = tmp_path / "merged.json", tmp_path / "merged.html", "/sys/opt-unwritable.md"
    code, out, err = merge(capsys, base, "-o", target, "--md", unwritable, "--html", html, "--compare", old_path,
                           "--compare-fail", "latency:10%")
    assert code == 1  # the regression's status, not the write error's
    assert "REGRESSED test_user.py::test_sdpa: latency " in out
    assert "compare: 2 regressed" in out
    assert out.splitlines()[-1] == f"wrote {target} (2 tests from 1 shard)"
    assert err.splitlines() == [
        f"pytest-opt merge: error: --md: cannot write {unwritable!r}: Permission denied",
        f"pytest-opt merge: 2 tests regressed past --compare-fail=latency:10% against --compare={old_path}: "
        f"exit status 1"]
    assert read(target)["tests"][0]["regression"]["verdict"] == "regressed"
    assert "test_over_budget" in html.read_text()
    # without a gate, the write error alone: exit status 2, the other files still written
    html.unlink()
    code, _, err = merge(capsys, base, "-o", target, "--md", unwritable, "--html", html)
    assert code == 2 and err.startswith("pytest-opt merge: error: --md: cannot write") and html.exists()


def test_merge_of_one_file_given_twice_says_so(base, capsys, tmp_path):
    target = tmp_path / "merged.json"
    code, _, err = merge(capsys, base, base, "-o", target)
    assert code == 2
    assert err == (f"pytest-opt merge: error: the report {str(base)!r} is given twice: give each report once (its "
                   f"tests would be merged with themselves)\n")
    link = tmp_path / "same.json"
    link.symlink_to(base)
    code, _, err = merge(capsys, base, link, "-o", target)
    assert code == 2 and f"{str(base)!r} and {str(link)!r} are the same report" in err
    assert not target.exists()


# ------------------------------------------------------------------ 12: earlier layouts of schema_version 1


LAYOUTS = sorted(path.name for path in FIXTURES.glob("layout-*.json"))


def test_a_fixture_is_kept_for_every_layout():
    # one per commit that changed report_schema.json (see tests/data/reports/README.md)
    assert len(LAYOUTS) >= 14, LAYOUTS


@pytest.mark.parametrize("layout", LAYOUTS)
def test_merge_and_compare_read_every_earlier_layout(base, capsys, tmp_path, layout):
    old = FIXTURES / layout
    target = tmp_path / "merged.json"
    code, out, err = merge(capsys, old, "-o", target, "--compare", old, "--compare-fail", "kl_mean:1")
    assert (code, err) == (0, ""), err
    merged = read(target)
    assert [t["regression"]["verdict"] for t in merged["tests"] if t["optimized"]] == ["ok"]
    assert "compare: 0 regressed, 0 inconclusive, 0 improved, 1 ok" in out


def test_pytest_opt_compare_reads_mains_report_of_the_sequential_layout(base, pytester):
    """The layout of the commit that introduced sequential rounds: rounds_decision had one error_rate."""
    fixture = json.loads((FIXTURES / "layout-12-65ae13e.json").read_text())
    assert "error_rate" in by_id(fixture, "test_sdpa")["rounds_decision"]
    hardware = read(base)["environment"]["hardware"]  # the fixture as if made on this machine
    fixture["environment"]["hardware"] = hardware
    for test in fixture["tests"]:
        test["hardware"] = hardware
    old = write(pytester.path / "main.json", fixture)
    pytester.makepyfile(test_user=USER_TESTS)
    new = pytester.path / "new.json"
    result = pytester.runpytest(*CHEAP, "-k", "test_sdpa", f"--opt-report-json={new}", f"--opt-compare={old}",
                                "--opt-compare-fail=kl_mean:1", "--opt-report")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines([f"note: --opt-compare: the report {str(old)!r}: read "
                                 "report.tests[].rounds_decision.error_rate (an earlier layout) as false_alarm_rate "
                                 "and miss_rate"])
    assert by_id(read(new), "test_sdpa")["regression"]["verdict"] == "ok"


def test_unknown_keys_in_a_report_are_ignored_with_a_note(base, capsys, tmp_path):
    report = read(base)
    report["tests"][0]["optimized"]["future_figure_s"] = 1.0
    report["environment"]["future_probe"] = "x"  # environment allows further keys: nothing to ignore
    report["settings"]["future_setting"] = True
    code, out, err = merge(capsys, write(tmp_path / "newer.json", report), "-o", tmp_path / "merged.json")
    assert (code, err) == (0, "")
    assert out.splitlines()[1:3] == [
        f"note: the report {str(tmp_path / 'newer.json')!r}: ignored report.settings.future_setting (unknown to "
        "this version)",
        f"note: the report {str(tmp_path / 'newer.json')!r}: ignored report.tests[].optimized.future_figure_s "
        "(unknown to this version)"]
    merged = read(tmp_path / "merged.json")
    assert "future_figure_s" not in merged["tests"][0]["optimized"]


# ------------------------------------------------------------------ 13: what is written reads back


def test_a_merged_report_past_the_reader_limit_is_refused_with_the_reason(base, capsys, tmp_path, monkeypatch):
    target = tmp_path / "merged.json"
    assert merge(capsys, base, "-o", target)[0] == 0
    size = target.stat().st_size
    monkeypatch.setattr(files, "MAX_REPORT_BYTES", size + 200)  # room for the created stamp: the limit holds it
    assert merge(capsys, base, "-o", target)[0] == 0
    load_report(target)  # what was written reads back under the same limit
    monkeypatch.setattr(files, "MAX_REPORT_BYTES", size - 200)
    target.unlink()
    code, out, err = merge(capsys, base, "-o", target)
    assert code == 2 and not target.exists()
    assert err.startswith(f"pytest-opt merge: error: -o: cannot write {str(target)!r}: the report would be ")
    assert f"bytes, over the limit of {size - 200} bytes a report reader accepts; nothing written" in err


def test_writer_and_reader_share_the_limits(base, monkeypatch, tmp_path):
    report = read(base)
    text = report_text(report)
    size = len(text.encode())
    path = tmp_path / "exact.json"
    path.write_text(text)
    monkeypatch.setattr(files, "MAX_REPORT_BYTES", size)
    assert report_text(report) == text and load_report(path)["tests"] == report["tests"]
    monkeypatch.setattr(files, "MAX_REPORT_BYTES", size - 1)
    with pytest.raises(ValueError, match="over the limit"):
        report_text(report)
    with pytest.raises(Exception, match="over the limit"):
        load_report(path)
    monkeypatch.setattr(files, "MAX_REPORT_BYTES", 2**30)
    monkeypatch.setattr(files, "MAX_REPORT_ITEMS", 50)
    with pytest.raises(ValueError, match="more than 50 values"):
        report_text(report)
    with pytest.raises(Exception, match="more than 50 values"):
        load_report(path)
    assert files.MAX_REPORT_BYTES > files.MAX_JSON_BYTES  # reports of a big merge (84 MB) read back


def test_pytest_refuses_to_write_a_report_it_could_not_read_back(pytester, monkeypatch):
    monkeypatch.setattr(files, "MAX_REPORT_BYTES", 1000)
    pytester.makepyfile(test_user='''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    pytest.skip("nothing to measure here")
''')
    report = pytester.path / "report.json"
    result = pytester.runpytest(*CHEAP, f"--opt-report-json={report}")
    result.assert_outcomes(skipped=1)
    assert result.ret != pytest.ExitCode.OK
    result.stdout.fnmatch_lines([f"*could not write --opt-report-json={report}: *the report would be * bytes, over "
                                 "the limit of 1000 bytes a report reader accepts; nothing written*"])
    assert not report.exists()


# ------------------------------------------------------------------ 21: an improvement is not "within noise"


def _rounds(report: dict[str, Any], samples: list[float]) -> dict[str, Any]:
    report = copy.deepcopy(report)
    test = by_id(report, "test_sdpa")
    test["optimized"]["latency_samples_s"] = samples
    test["optimized"]["latency_s"] = statistics.median(samples)
    return report


def test_an_improvement_that_is_not_significant_is_not_called_a_worsening(base, capsys, tmp_path):
    """Both medians 20% from the old one, the rounds split: neither is resolved by two jobs (inconclusive, listed),
    and only the slower one's detail reads as a worsening not significant."""
    old_rounds = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    faster = [0.8, 0.8, 0.8, 0.8, 1.2, 1.2, 1.2]  # median 20% better, rounds not significantly so
    slower = [1.2, 1.2, 1.2, 1.2, 0.8, 0.8, 0.8]  # median 20% worse, rounds not significantly so
    old = write(tmp_path / "old.json", _rounds(read(base), old_rounds))
    for samples, noise in ((faster, False), (slower, True)):
        new = write(tmp_path / "new.json", _rounds(read(base), samples))
        code, out, _ = merge(capsys, new, "-o", tmp_path / "merged.json", "--compare", old,
                             "--compare-fail", "latency:10%")
        assert code == 0
        assert "INCONCLUSIVE test_user.py::test_sdpa: latency" in out, out
        details = by_id(read(tmp_path / "merged.json"), "test_sdpa")["regression"]["details"]
        expected = "not significant, with" if noise else "not significant (an improvement), with"
        assert expected in details[0] and details[0].endswith(": inconclusive"), details


# ------------------------------------------------------------------ 20: merged Markdown and HTML


def test_merged_renderings_name_the_hardware_and_each_shards_settings(base, capsys, tmp_path):
    cpu = read(base)
    by_id(cpu, "test_sdpa")["estimates"] = {"decode_bandwidth_bytes_s": 1.0e9}
    h200 = on_h200(cpu)
    h200["settings"].update(budgets_mode="off", rounds=20, max_rounds=None)
    cpu_path, h200_path = write(tmp_path / "cpu.json", cpu), write(tmp_path / "h200.json", h200)
    md, html = tmp_path / "merged.md", tmp_path / "merged.html"
    code, _, err = merge(capsys, cpu_path, h200_path, "-o", tmp_path / "merged.json", "--md", md, "--html", html)
    assert (code, err) == (0, "")
    text = md.read_text()
    cpu_name = cpu["environment"]["hardware"]
    budgets = text.split("### Failed budgets")[1].split("###")[0]
    assert "| Test | Hardware | Budget |" in budgets
    rows = [line for line in budgets.splitlines() if "test\\_over\\_budget" in line or "test_over_budget" in line]
    assert len(rows) == 2 and any(H200 in row for row in rows) and any("CPU" in row for row in rows)
    estimates = text.split("### Estimated figures")[1].split("###")[0]
    assert "| Test | Hardware | Figure |" in estimates and H200 in estimates
    shards = text.split("### Shards")[1].split("###")[0]
    assert str(cpu_path) in shards and str(h200_path) in shards and "| 20 |" in shards
    assert "The shards ran with different settings: budgets enforce" in text
    assert f"rounds {cpu['settings']['rounds']}" in text and "20 (" in text
    assert "2 shards on" in text and "budgets: differ per shard" in text and H200 in text.split("\n")[2]
    assert "Budgets were not checked" not in text  # the first shard's mode is not the whole report's
    assert f"<summary>Environment of the first shard ({cpu_path}; see Shards)</summary>" in text
    page = html.read_text()
    assert '<section id="shards">' in page and "The shards ran with different settings" in page
    assert "<th>Hardware</th>" in page.split('id="failed-budgets"')[1].split("</section>")[0]
    assert "<th>Hardware</th>" in page.split('id="estimates"')[1].split("</section>")[0]
    assert cpu_name.split(":")[0] in page
