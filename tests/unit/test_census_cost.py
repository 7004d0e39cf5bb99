"""benchmarks/census_cost.py: the sessions' order and table, with a fake session runner (the real one runs pytest)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest

from benchmark_scripts import load_script

census_cost = load_script("census_cost")


def test_pairs_alternate_which_setting_runs_first() -> None:
    assert census_cost.session_order(3) == ["on", "off", "off", "on", "on", "off"]


def test_sessions_report_the_median_call_the_census_time_its_share_and_the_ratio(
        capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[tuple[str, str]] = []
    calls = {"on": iter([2.2, 2.6, 2.4]), "off": iter([2.0, 1.9, 2.1])}

    def runner(root: Path, census: str, pytest_args: Sequence[str], threads: str) -> object:
        seen.append((census, (root / census_cost.TEST_FILE).read_text()))
        assert "census_sides.census_of = _timed_census_of" in (root / "conftest.py").read_text()
        census_s = [0.1, 0.2] if census == "on" else []
        return census_cost.Session(census, 0, 9.0, next(calls[census]), census_s)

    assert census_cost.main(["sessions", "--pairs", "3", "--cases", "smollm2-sdpa"], runner=runner) == 0
    assert [census for census, _ in seen] == census_cost.session_order(3)
    assert "@pytest.mark.opt_model('smollm2-135m')\n@pytest.mark.optimization('sdpa')" in seen[0][1]
    out = capsys.readouterr().out
    assert out.startswith("`python benchmarks/census_cost.py sessions --pairs 3 --cases smollm2-sdpa`")
    # medians: call on 2.4 s, off 2.0 s; census 0.3 s; shares 0.3/2.2, 0.3/2.6, 0.3/2.4 -> median 12.5%
    assert "| smollm2-sdpa | 3 / 3 | 2.40 s | 2.00 s | 300 ms | 12.5% (11.5%-13.6%) | 1.200 |" in out


def test_a_session_without_a_passed_call_is_counted_apart(capsys: pytest.CaptureFixture[str]) -> None:
    def runner(root: Path, census: str, pytest_args: Sequence[str], threads: str) -> object:
        return census_cost.Session(census, 4, 0.5, None, [], "ImportError")

    census_cost.main(["sessions", "--pairs", "1", "--cases", "tiny-sdpa"], runner=runner)
    out = capsys.readouterr().out
    assert "| tiny-sdpa | 0 / 0 | - | - | - | - | - |" in out and "tiny-sdpa: 2 sessions without a passed call" in out


def test_an_unknown_case_is_refused_with_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        census_cost.parse_args(["sessions", "--cases", "tiny"])
    assert "unknown tiny; known: tiny-sdpa, tiny-static, smollm2-sdpa" in capsys.readouterr().err
