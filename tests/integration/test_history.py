"""``--opt-history=DIR``: every run's report kept in a folder, pruned to the last N, drawn as trends in the HTML.

Real pytest sessions over a user's test file (the built-in tiny model, one round, no warm-up), with the
folder checked file by file, and the HTML trend charts checked in headless Chromium.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from browser import CHROMIUM, NEEDS_CHROMIUM, NETWORK_REFERENCE
from conftest import XdistRun

from pytest_transformers_opt.report import history
from pytest_transformers_opt.report.schema import validate_report

CHEAP = ("-p", "no:cacheprovider", "-p", "no:randomly", "--opt-rounds=1", "--opt-warmup=0")
USER_TESTS = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=2)

@pytest.mark.optimization("sdpa")
def test_sdpa_again(opt_bench):
    opt_bench(max_new_tokens=2)
'''
NAME = re.compile(r"\d{8}T\d{6}Z(?:_\d+)?(?:-(?P<commit>[0-9a-f]{7,40}))?\.json")
GIT_ENV = {"GIT_AUTHOR_NAME": "Test", "GIT_AUTHOR_EMAIL": "test@example.com", "GIT_COMMITTER_NAME": "Test",
           "GIT_COMMITTER_EMAIL": "test@example.com", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
NEEDS_GIT = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    result = pytester.runpytest(*CHEAP, *args)
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    return result


def _recorded(folder: Path) -> list[Path]:
    """The history files, in name order (which is time order)."""
    return sorted((p for p in folder.iterdir() if NAME.fullmatch(p.name)), key=lambda p: p.name)


def _report(path: Path) -> dict:
    report = json.loads(path.read_text(encoding="utf-8"))
    validate_report(report)
    return report


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True,
                          timeout=60).stdout.strip()


def _make_checkout(path: Path) -> str:
    """``path`` as a git checkout with everything in it committed; the short commit."""
    _git(path, "init", "-q")
    _git(path, "add", "-A")
    _git(path, "commit", "-q", "-m", "user tests")
    return _git(path, "rev-parse", "--short=7", "HEAD")


# --------------------------------------------------------------------------- recording


def test_runs_outside_a_checkout_are_named_by_time_and_pruned_to_keep(pytester: pytest.Pytester,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable and the ini key configure it; keep=2 leaves the newest two and never a foreign file."""
    pytester.makepyfile(test_user=USER_TESTS)
    pytester.makeini("[pytest]\nopt_history_keep = 2\n")
    if shutil.which("git"):  # the test's premise: pytester's folder is in no checkout
        assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=pytester.path, capture_output=True,
                              check=False).returncode != 0
    folder = pytester.path / "runs"
    folder.mkdir()
    foreign = {"notes.txt": "kept by hand\n", "20200101T000000Z-backup.json": "{}", "20200101T000000Z.json.bak": ""}
    for name, text in foreign.items():
        (folder / name).write_text(text)
    monkeypatch.setenv("PYTEST_OPT_HISTORY", "runs")
    held = []
    for _ in range(3):
        result = _run(pytester, "-q")
        result.assert_outcomes(passed=2)
        held.append(_recorded(folder))
        line = next(line for line in result.outlines if "run recorded in" in line)
        assert line.startswith(f"transformers-opt: run recorded in {folder}{os.sep}")
        assert f"the history holds {len(held[-1])} run" in line and "keeps the last 2" in line
    assert [len(files) for files in held] == [1, 2, 2]
    assert "1 older pruned" in line
    first, second, third = held[0][0], held[1][1], held[2][1]
    assert [p.name for p in held[2]] == [second.name, third.name]  # the oldest went
    assert not first.exists()
    for path in held[2]:
        match = NAME.fullmatch(path.name)
        assert match and match["commit"] is None, path.name  # no checkout: no commit part
    reports = [_report(path) for path in held[2]]
    assert [r["created"] for r in reports] == sorted(r["created"] for r in reports)
    assert [sorted(t["nodeid"] for t in r["tests"]) for r in reports] == [
        ["test_user.py::test_sdpa", "test_user.py::test_sdpa_again"]] * 2
    assert {name: (folder / name).read_text() for name in foreign} == foreign
    assert sorted(p.name for p in folder.iterdir()) == sorted([*foreign, second.name, third.name])


@NEEDS_GIT
def test_git_commit_names_the_checkout_and_its_changes(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text("def test_x():\n    pass\n")
    commit = _make_checkout(tmp_path)
    assert history.git_commit(tmp_path) == (commit, False)
    (tmp_path / "untracked.json").write_text("{}")  # reports and the history itself: not a change
    assert history.git_commit(tmp_path) == (commit, False)
    (tmp_path / "test_user.py").write_text("def test_x():\n    assert True\n")
    assert history.git_commit(tmp_path) == (commit, True)
    assert history.git_commit(tmp_path.parent) == (None, False)


def test_names_are_parsed_by_their_time_and_foreign_names_are_not() -> None:
    names = ["20261201T131500Z_2-1a2b3c4-dirty.json", "20261201T131500Z-1a2b3c4.json", "20251231T235959Z.json"]
    parsed = [history.parse_name(name) for name in names]
    assert all(parsed)
    assert [p.name for p in sorted(parsed, key=lambda p: p.order)] == [names[2], names[1], names[0]]
    assert (parsed[0].commit, parsed[0].dirty, parsed[0].seq) == ("1a2b3c4", True, 2)
    for foreign in ("20261399T000000Z.json", "20261201T131500Z-backup.json", "notes.json", "20261201T131500Z.json~"):
        assert history.parse_name(foreign) is None, foreign


def _row(nodeid: str, hardware: str | None, latency: float | None, samples: list[float] | None = None) -> dict:
    optimized = None if latency is None else {"latency_s": latency, "peak_memory_bytes": 1000,
                                              "latency_samples_s": samples or [latency]}
    return {"nodeid": nodeid, "hardware": hardware, "optimized": optimized}


def test_trends_are_per_test_and_hardware_with_the_interval_or_the_rounds_range() -> None:
    runs = [history.HistoryRun(None, {"tests": tests}) for tests in (
        [_row("t::a", "NVIDIA H200", 0.010, [0.009, 0.010, 0.011, 0.010, 0.012]), _row("t::a", "NVIDIA L4", 0.05),
         _row("t::b", "NVIDIA H200", 0.02)],
        [_row("t::a", "NVIDIA H200", 0.011, [0.010, 0.012]), _row("t::b", "NVIDIA H200", None)],
        [_row("t::a", "NVIDIA H200", 0.012), _row("t::b", "NVIDIA H200", 0.03)],
        [_row("t::a", "NVIDIA H200", 0.013), _row("t::b", "NVIDIA H200", 0.03), _row("t::c", "NVIDIA H200", 0.1)],
    )]
    runs[-1].current = True
    trends = {(t.nodeid, t.hardware): t for t in history.trends(history.History("h", runs))}
    assert sorted(trends) == [("t::a", "NVIDIA H200"), ("t::b", "NVIDIA H200"), ("t::c", "NVIDIA H200")]  # this run's
    a = trends[("t::a", "NVIDIA H200")].points
    assert [p.run for p in a] == [0, 1, 2, 3] and [p.latency_s for p in a] == [0.010, 0.011, 0.012, 0.013]
    low, high = a[0].latency_range
    assert low <= 0.010 <= high and a[0].range_kind.startswith("95% interval of the median (bootstrap over 5")
    assert a[1].latency_range == (0.010, 0.012) and a[1].range_kind.startswith("min-max of 2 rounds")
    assert a[2].latency_range is None  # one round: nothing to draw
    assert [p.run for p in trends[("t::b", "NVIDIA H200")].points] == [0, 2, 3]  # no figure in run 1 (skipped)
    assert len(trends[("t::c", "NVIDIA H200")].points) == 1


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("where", ["full disk", "folder that cannot be created"])
def test_a_history_that_cannot_be_written_is_one_line_and_the_report_is_still_written(
        pytester: pytest.Pytester, where: str) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    folder = pytester.path / "runs"
    if where == "full disk":
        pytester.makeconftest('''
import errno, os
import pytest_transformers_opt.report.history as history

real_write = history.write_atomic

def full_disk(path, text):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

def pytest_configure(config):
    history.write_atomic = full_disk

def pytest_unconfigure(config):
    history.write_atomic = real_write
''')
        option, why = f"--opt-history={folder}", f"[[]Errno {errno.ENOSPC}[]] No space left on device"
    else:
        # /proc takes no new folder, not even from root (which a read-only mode would not stop)
        option, why = "--opt-history=/proc/opt-history", "[[]Errno 2[]] No such file or directory"
    report = pytester.path / "report.json"
    result = _run(pytester, option, f"--opt-report-json={report}", f"--opt-report-html={pytester.path / 'r.html'}")
    result.assert_outcomes(passed=2)
    # a requested output that was not written fails a run whose tests passed, as a report file does
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    problems = [line for line in result.outlines if "could not record the run" in line]
    assert len(problems) == 1
    result.stdout.fnmatch_lines([f"transformers-opt: could not record the run in {option}: {why}"])
    assert "run recorded in" not in result.stdout.str()
    assert [t["outcome"] for t in _report(report)["tests"]] == ["passed", "passed"]
    page = (pytester.path / "r.html").read_text()
    assert page.rstrip().endswith("</html>")
    # this run alone, unrecorded, is each test's only run: said instead of a chart
    assert page.count("1 run of this test on this hardware with figures: a trend needs 2.") == 2
    assert "trend-svg" not in page
    if where == "full disk":
        assert list(folder.iterdir()) == []  # no empty claimed name left behind


def test_collect_only_and_bad_values_write_no_history(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = _run(pytester, "--collect-only", "--opt-history=runs")
    assert result.ret == pytest.ExitCode.OK
    assert not (pytester.path / "runs").exists()
    (pytester.path / "a-file").write_text("")
    for args, message in [
        (["--opt-history-keep=0"], "*--opt-history-keep*recorded runs to keep: 0 must be a whole number >= 1 and "
                                   "<= 100000*"),
        (["--opt-history=a-file/runs"], "*--opt-history: '*a-file' is not a folder; give the folder the run "
                                        "history lives in*"),
    ]:
        result = _run(pytester, "--opt-history=runs", *args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([message])
    assert not (pytester.path / "runs").exists()


def test_xdist_writes_one_history_file_with_every_row(xdist_run: XdistRun) -> None:
    """The shared ``-n 2`` session of tests/conftest.py (``--opt-history=runs``): one file, both workers' rows."""
    xdist_run.result.assert_outcomes(passed=3, skipped=1)
    files = _recorded(xdist_run.folder / "runs")
    assert len(files) == 1
    assert sorted(t["nodeid"] for t in _report(files[0])["tests"]) == [
        "test_user.py::test_8bit", "test_user.py::test_sdpa", "test_user.py::test_skipped_on_cpu",
        "test_user.py::test_static[3]"]
    assert xdist_run.result.stdout.str().count("run recorded in") == 1


# --------------------------------------------------------------------------- the trend charts


TREND_SVG = re.compile(r'<svg [^>]*class="chart-svg trend-svg"[^>]*data-nodeid="([^"]+)"[^>]*>(.*?)</svg>', re.S)


@NEEDS_GIT
@NEEDS_CHROMIUM
def test_three_recorded_runs_in_a_checkout_draw_a_trend_per_test_in_chromium(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    commit = _make_checkout(pytester.path)
    folder = pytester.path / "runs"
    folder.mkdir()
    # crafted files with history names: left out of the chart and named once, never a broken page
    (folder / "20000101T000000Z.json").write_text("{not json")
    (folder / "20000101T000001Z.json").write_text("[" * 100_000 + "]" * 100_000)
    page, report = pytester.path / "r.html", pytester.path / "report.json"
    for n in range(3):
        last = n == 2
        extra = [f"--opt-report-html={page}", f"--opt-report-json={report}"] if last else []
        result = _run(pytester, "--opt-history=runs", *extra)
        result.assert_outcomes(passed=2)
        result.stdout.fnmatch_lines([f"transformers-opt: run recorded in {folder}{os.sep}*-{commit}.json; the history "
                                     f"holds {n + 3} runs (keeps the last 200)"])
    ours = [p for p in _recorded(folder) if not p.name.startswith("2000")]
    assert len(ours) == 3
    for path in ours:
        assert NAME.fullmatch(path.name)["commit"] == commit, path.name  # type: ignore[index]
    assert json.loads(ours[-1].read_text()) == _report(report)  # the run's full report, as --opt-report-json wrote it
    reports = [_report(path) for path in ours]
    assert [r["created"] for r in reports] == sorted(r["created"] for r in reports)
    left_out = [line for line in result.outlines if "left out of the trends" in line]
    assert len(left_out) == 1 and "2 files" in left_out[0]
    assert "20000101T000000Z.json: " in left_out[0] and "20000101T000001Z.json: " in left_out[0]

    text = page.read_text(encoding="utf-8")
    assert not NETWORK_REFERENCE.search(text)
    common = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost", "--enable-logging=stderr", "--v=0",
              f"--user-data-dir={pytester.path / 'profile'}"]
    dumped = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120,
                            check=False)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    assert ":CONSOLE" not in dumped.stderr, dumped.stderr  # no console message, no script error
    dom = dumped.stdout
    assert 'id="history"' in dom and "20000101T000000Z.json" in dom  # the left-out files named on the page
    charts = {nodeid: body for nodeid, body in TREND_SVG.findall(dom)}
    assert sorted(charts) == ["test_user.py::test_sdpa", "test_user.py::test_sdpa_again"]
    created = [r["created"] for r in reports]
    for nodeid, body in charts.items():
        latency = re.findall(r'<circle [^>]*class="point latency( current)?"[^>]*data-run="([^"]+)"', body)
        memory = re.findall(r'<circle [^>]*class="point memory( current)?"[^>]*data-run="([^"]+)"', body)
        assert [run for _, run in latency] == [run for _, run in memory] == [p.name for p in ours], nodeid
        assert [bool(c) for c, _ in latency] == [bool(c) for c, _ in memory] == [False, False, True]
        xs = [float(x) for x in re.findall(r'<circle cx="([0-9.]+)"[^>]*class="point latency', body)]
        assert xs == sorted(xs) and len(set(xs)) == 3  # one slot per run, in time order
        assert body.count(commit) >= 3  # each run's commit under the axis
        assert 'class="current-run"' in body
    for value in created:  # each run's date and time on the axis (YYYY-MM-DD HH:MM:SS, UTC)
        assert value[:10] + " " + value[11:19] in dom
    shot = pytester.path / "history.png"
    shooting = subprocess.run([*common, f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri()],
                              capture_output=True, text=True, timeout=120, check=False)
    assert shooting.returncode == 0, shooting.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
