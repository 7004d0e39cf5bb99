"""Issue 19, items 8, 10, 24 and 26: progress lines that never touch capture from a thread nor glue to pytest's
progress dots, a history that prunes by recording order and flags future-dated names, estimates that say what
they assume, and the first long work of a session announced. Each as a user meets it: a real pytest session."""

from __future__ import annotations

import json
import re

import pytest

from conftest import FAST_ARGS

# -- item 8: heartbeats never switch capture off from their thread ------------------------------------------
CHATTY_CONFTEST = """
import contextlib, itertools, time

import pytest

from pytest_transformers_opt.engine import progress
from pytest_transformers_opt.techniques import Technique
from pytest_transformers_opt.verdict import bench

progress.HEARTBEAT_S = 0.02  # many heartbeats while lines are printed, the first one by the heartbeat thread
bench.MEASURE_ANNOUNCE_AFTER_S = 0.02
_counter = itertools.count()
PRINTED = []


class Chatty(Technique):
    '''A project technique that prints a numbered line per step while generate runs (a user's streamer).'''

    name = "chatty"
    family = "generation"
    summary = "prints numbered lines"

    @contextlib.contextmanager
    def around_generate(self, model):
        end = time.perf_counter() + PRINT_S
        while time.perf_counter() < end:
            number = next(_counter)
            print(f"chatty {number}")
            PRINTED.append(number)
            time.sleep(0)  # lets the heartbeat thread run between two lines, as real work does
        yield


PRINT_S = 0.3


def pytest_opt_register_techniques(registry):
    registry.register(Chatty)


@pytest.fixture
def printed():
    return PRINTED
"""

CHATTY_TEST = """
import pytest


def test_first():
    pass


@pytest.mark.optimization("chatty")
def test_every_line_is_captured(opt_bench, printed, capsys):
    opt_bench(max_new_tokens=2)
    captured = [int(line.split()[1]) for line in capsys.readouterr().out.splitlines() if line.startswith("chatty ")]
    assert len(printed) > 1000
    assert captured == printed, f"capsys lost {len(printed) - len(captured)} of {len(printed)} lines"
"""


def test_heartbeats_leave_capsys_whole_and_start_on_a_fresh_line(pytester: pytest.Pytester) -> None:
    """A fresh process (the terminal is a pipe, capture by file descriptor) under -q: the first test's dot is
    still on the line when the second test's heartbeats start."""
    pytester.makeconftest(CHATTY_CONFTEST)
    pytester.makepyfile(test_user=CHATTY_TEST)
    result = pytester.runpytest_subprocess(*FAST_ARGS, "-q", "-p", "no:randomly", "--opt-rounds=1", "--opt-warmup=0")
    out = result.stdout.str()
    result.assert_outcomes(passed=2)
    heartbeats = [line for line in result.outlines if "still measuring [chatty]" in line]
    assert heartbeats, out  # the heartbeat thread did write
    assert "chatty 1" not in out and not re.search(r"^chatty \d", out, re.M), out  # nothing leaked to the terminal
    # every progress line starts a line of its own: never glued to the first test's dot
    assert all(line.startswith("transformers-opt: ") for line in result.outlines if "transformers-opt:" in line), out
    assert re.search(r"^\.\.?\s+\[100%\]$|^\.$", out, re.M), out


# -- item 10: pruning by recording order, future-dated names flagged --------------------------------------
ONE_TEST = """
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=2)
"""
CHEAP = (*FAST_ARGS, "-p", "no:randomly", "--opt-rounds=1", "--opt-warmup=0")
HISTORY_NAME = re.compile(r"\d{8}T\d{6}Z(?:_\d+)?\.json")

# A session that started later records its run while this one is between writing its own and pruning
# (the race of two CI jobs sharing a history folder), made certain instead of left to timing.
CONCURRENT_CONFTEST = """
import datetime as dt
import importlib

from pytest_transformers_opt.files import write_atomic

# the module the plugin will use (sys.modules'), not an attribute a previous in-process run left behind
history = importlib.import_module("pytest_transformers_opt.report.history")


def write_then_a_newer_session_records(path, text):
    write_atomic(path, text)
    if path.parent.name == "runs":
        later = dt.datetime.strptime(path.name[:16], "%Y%m%dT%H%M%SZ") + dt.timedelta(seconds=1)
        write_atomic(path.parent / later.strftime("%Y%m%dT%H%M%SZ.json"), text)


def pytest_configure(config):
    history.write_atomic = write_then_a_newer_session_records


def pytest_unconfigure(config):
    history.write_atomic = write_atomic
"""


def _history_files(folder):
    return sorted(p.name for p in folder.iterdir() if HISTORY_NAME.fullmatch(p.name))


def test_a_small_keep_never_deletes_a_newer_sessions_just_recorded_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=ONE_TEST)
    folder = pytester.path / "runs"
    first = pytester.runpytest(*CHEAP, "--opt-history=runs", "--opt-history-keep=1")
    first.assert_outcomes(passed=1)
    [older] = _history_files(folder)
    pytester.makeconftest(CONCURRENT_CONFTEST)
    result = pytester.runpytest(*CHEAP, "--opt-history=runs", "--opt-history-keep=1")
    result.assert_outcomes(passed=1)
    held = _history_files(folder)
    assert older not in held, held  # recorded before this run: pruned to keep 1
    assert len(held) == 2, held  # this run and the newer session's, which its own pruning counts
    ours, newer = held
    assert json.loads((folder / newer).read_text())["tests"][0]["nodeid"] == "test_user.py::test_sdpa"
    line = next(line for line in result.outlines if "run recorded in" in line)
    assert f"run recorded in {folder / ours}; the history holds 2 runs (keeps the last 1, 1 older pruned)" in line, line


def test_a_future_dated_name_is_flagged_ordered_by_when_written_and_never_pins_the_newest_slot(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=ONE_TEST)
    folder = pytester.path / "runs"
    args = (*CHEAP, "--opt-history=runs", "--opt-history-keep=3")
    pytester.runpytest(*args).assert_outcomes(passed=1)
    [first] = _history_files(folder)
    # a runner whose clock was ahead recorded into the shared folder after the first run
    future = "20300105T100000Z.json"
    (folder / future).write_text((folder / first).read_text())
    second_run = pytester.runpytest(*args)
    second_run.assert_outcomes(passed=1)
    line = next(line for line in second_run.outlines if "run recorded in" in line)
    assert f"1 run dated in the future (a runner's clock was ahead: {future}) is ordered by when written, not as " \
           "the newest" in line, line
    second = (set(_history_files(folder)) - {future, first}).pop()
    page = pytester.path / "report.html"
    third_run = pytester.runpytest(*args, f"--opt-report-html={page}")
    third_run.assert_outcomes(passed=1)
    third = (set(_history_files(folder)) - {future, first, second}).pop()
    assert _history_files(folder) == sorted([future, second, third])  # the first run was the oldest recorded
    # the chart: the runs in recording order, each label with its year, the future-dated one flagged
    html = page.read_text(encoding="utf-8")
    assert re.findall(r'class="point latency[^"]*" data-run="([^"]+)"', html) == [future, second, third]
    assert "2030-01-05 10:00:00 (future)" in html
    assert f"{second[:4]}-{second[4:6]}-{second[6:8]} {second[9:11]}:{second[11:13]}:{second[13:15]}" in html
    assert "clock was ahead" in html  # the point's tooltip says why it is flagged

    pytester.runpytest(*args).assert_outcomes(passed=1)
    held = _history_files(folder)
    assert future not in held and second in held and third in held and len(held) == 3, held  # real runs stay


def test_a_name_another_session_claimed_but_has_not_written_is_never_pruned(tmp_path) -> None:
    from pytest_transformers_opt.report import history

    claimed, older, ours = "20261201T100000Z.json", "20261201T100001Z.json", "20261201T100002Z.json"
    (tmp_path / claimed).write_text("")  # created empty (O_EXCL), its report not written yet
    (tmp_path / older).write_text("{}")
    (tmp_path / ours).write_text("{}")
    assert history.prune(tmp_path, 1, spare=tmp_path / ours) == (2, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [claimed, ours]


# -- item 26: the first long work of a session says so ------------------------------------------------------
SLOW_PROBE_CONFTEST = """
import importlib

# the module the plugin will use (sys.modules'), not an attribute a previous in-process run left behind
hardware = importlib.import_module("pytest_transformers_opt.engine.hardware")

THRESHOLD = hardware.PROBE_ANNOUNCE_AFTER_S


def pytest_configure(config):
    hardware.PROBE_ANNOUNCE_AFTER_S = 0.0  # a busy machine: the probe takes longer than the threshold


def pytest_unconfigure(config):
    hardware.PROBE_ANNOUNCE_AFTER_S = THRESHOLD
"""


def test_the_hardware_probe_before_the_first_test_is_announced_when_it_starts_and_ends(
        pytester: pytest.Pytester) -> None:
    pytester.makeconftest(SLOW_PROBE_CONFTEST)
    pytester.makepyfile(test_user=ONE_TEST)
    result = pytester.runpytest(*CHEAP)
    result.assert_outcomes(passed=1)
    lines = [line for line in result.outlines if line.startswith("transformers-opt: ")]
    start = lines.index("transformers-opt: probing the hardware (device auto, once per session) ...")
    end = next(n for n, line in enumerate(lines) if re.fullmatch(
        r"transformers-opt: probing the hardware: done in \d+(\.\d+)? (s|ms)", line))
    assert start < end, lines
    collected = result.outlines.index("collected 1 item")
    assert collected < result.outlines.index(lines[start]), result.outlines  # after collection, before the test


# -- item 24: estimates that say what they assume, and a pace measured as the work goes ---------------------
BUSY_BUILD_CONFTEST = """
import dataclasses
import importlib

progress = importlib.import_module("pytest_transformers_opt.engine.progress")
tiny_models = importlib.import_module("pytest_transformers_opt.engine.tiny_models")

NAME = "tiny-random-llama"
SAVED = (tiny_models.TINY_MODELS[NAME], progress.HEARTBEAT_S, progress.load_average, progress.cpu_cores)


def pytest_configure(config):
    # 6 training steps (a new fingerprint: really built, in seconds), on the machine the build met:
    # 9 runnable processes on 2 cores
    tiny_models.TINY_MODELS[NAME] = dataclasses.replace(SAVED[0], train_steps=6)
    progress.HEARTBEAT_S = 0.01
    progress.load_average = lambda: 9.1
    progress.cpu_cores = lambda: 2


def pytest_unconfigure(config):
    tiny_models.TINY_MODELS[NAME], progress.HEARTBEAT_S, progress.load_average, progress.cpu_cores = SAVED
"""


def test_the_build_estimate_names_its_assumption_and_the_busy_machine_and_the_heartbeat_projects_the_pace(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_transformers_opt.engine import tiny_models

    monkeypatch.setenv(tiny_models.CACHE_ENV, str(pytester.path / "empty-model-cache"))  # never built here
    pytester.makeconftest(BUSY_BUILD_CONFTEST)
    pytester.makepyfile(test_user=ONE_TEST)
    result = pytester.runpytest(*CHEAP)
    result.assert_outcomes(passed=1)
    text = "\n".join(line for line in result.outlines if line.startswith("transformers-opt: "))
    assert re.search(r"^transformers-opt: building built-in model tiny-random-llama \(first use on this machine, "
                     r"about \d+ (s|min) on an idle machine, longer here: load 9\.1 on 2 cores; cached in ", text,
                     re.M), text
    # after the first steps the heartbeat says what is left at the pace measured on this machine
    assert re.search(r"^transformers-opt: still building built-in model tiny-random-llama: training step [1-5]/6, "
                     r"about \d+ s left at the pace so far \(\d+ s so far\)$", text, re.M), text


def test_estimates_read_as_estimates() -> None:
    from pytest_transformers_opt.engine import progress

    assert [progress.rough_duration(s) for s in (3.2, 14, 42, 89, 918)] == [
        "about 3 s", "about 10 s", "about 40 s", "about 90 s", "about 15 min"]
    assert progress.projected_left(30, 300, 60.0) == "about 9 min left at the pace so far"  # 270 steps at 2 s
    assert progress.projected_left(3, 3, 1.0) == "about 0 s left at the pace so far"
