"""benchmarks/suite_cost.py: each test's CPU seconds, its own and its subprocesses', as a plugin and a summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmark_scripts import ROOT, load_module_file

suite_cost = load_module_file("suite_cost", ROOT / "benchmarks" / "suite_cost.py")

USER_TESTS = '''
import subprocess
import sys
import time


def _burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_burns_here():
    _burn(0.4)


def test_burns_in_a_subprocess():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.4\\n"
                    "while time.process_time() < end: pass"], check=True)


def test_sleeps():
    time.sleep(0.3)
'''


def test_each_test_is_a_row_with_its_own_and_its_subprocesses_cpu(pytester: pytest.Pytester, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    pytester.runpytest("-p", "no:cacheprovider", plugins=[suite_cost]).assert_outcomes(passed=3)
    assert not list(tmp_path.iterdir())  # nothing recorded without the folder

    monkeypatch.setenv(suite_cost.DIR_ENV, str(tmp_path))
    pytester.runpytest("-p", "no:cacheprovider", plugins=[suite_cost]).assert_outcomes(passed=3)
    rows = {row["id"].split("::")[1]: row for row in suite_cost.read_rows(tmp_path)}
    assert set(rows) == {"test_burns_here", "test_burns_in_a_subprocess", "test_sleeps"}
    here, there, sleeps = rows["test_burns_here"], rows["test_burns_in_a_subprocess"], rows["test_sleeps"]
    assert here["self"] >= 0.35 and here["children"] < 0.05, here
    assert there["children"] >= 0.35 and there["self"] < 0.3, there
    assert sleeps["wall"] >= 0.3 and sleeps["cpu"] < 0.1, sleeps  # waiting costs wall time, not CPU
    assert all(row["worker"] == "main" for row in rows.values())

    text = suite_cost.summary(list(rows.values()), top=2)
    assert text.startswith("3 tests: ")
    tests = text.split("CPU-s   wall  test\n")[1].splitlines()
    assert len(tests) == 2 and {line.rsplit("::", 1)[1] for line in tests} == {"test_burns_here",
                                                                              "test_burns_in_a_subprocess"}
    assert suite_cost.main([str(tmp_path), "--against", str(tmp_path), "--top", "1"]) == 0
    assert "(other run: 3 tests" in capsys.readouterr().out


def test_a_folder_with_no_rows_says_how_to_make_them(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no cost-\\*.jsonl in .*: run pytest with -p suite_cost and SUITE_COST_DIR="):
        suite_cost.read_rows(tmp_path)
