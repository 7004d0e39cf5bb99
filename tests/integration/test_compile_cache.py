"""``--opt-compile-cache``: a second run of a compiled test loads its graphs (warm, faster), a torch
version change misses (cold, a new key folder), and a bad path is a usage error naming the option.

The compiling runs are subprocesses: each is a fresh process, as a CI runner is, so nothing compiled
by an earlier run can help except through the folder. Sessions that compile nothing run in-process (a fresh
process importing torch costs tens of seconds on the suite's loaded cores).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from pytest_transformers_opt.engine import compile_cache
from pytest_transformers_opt.engine.compile_cache import MANIFEST, CacheKey, CompileCache, compile_cache_state
from pytest_transformers_opt.report.schema import validate_report

# one timed round: the figures read here are the warm-up's compile time and the cache lookups, not latency
INNER = ("-p", "no:cacheprovider", "-p", "no:randomly", "--opt-rounds=1", "--opt-warmup=0", "--opt-report")

COMPILED = '''
import pytest

@pytest.mark.optimization("compile")
def test_compiled(opt_bench):
    opt_bench(max_new_tokens=3)
'''

# the inner run's conftest: the key reads another torch version (inductor's own keys do not change); put back at
# the end, as the run is in-process
OTHER_TORCH = '''
from pytest_transformers_opt.engine import compile_cache

_installed = compile_cache.package_version

def pytest_configure(config):
    compile_cache.package_version = lambda name: "9.9.9" if name == "torch" else _installed(name)

def pytest_unconfigure(config):
    compile_cache.package_version = _installed
'''


def _compiled_run(pytester: pytest.Pytester, cache: Path, name: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    report = pytester.path / f"{name}.json"
    result = pytester.runpytest_subprocess(*INNER, f"--opt-compile-cache={cache}", f"--opt-report-json={report}")
    result.assert_outcomes(passed=1)
    data = json.loads(report.read_text())
    validate_report(data)
    (entry,) = data["tests"]
    return result, entry["optimized"]


def _key_folders(cache: Path) -> list[Path]:
    return sorted(path for path in cache.iterdir() if path.is_dir())


def test_second_run_is_warm_and_a_torch_change_misses(pytester: pytest.Pytester,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the tiny model gains nothing from more threads on shared cores
    pytester.makepyfile(test_user=COMPILED)
    cache = pytester.path / "compile-cache"

    first_result, first = _compiled_run(pytester, cache, "first")
    assert first["compile_cache"] == "cold"
    first_result.stdout.fnmatch_lines(["*test_compiled: * (compile cache cold), recompiles*"])
    (folder,) = _key_folders(cache)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["key"]["torch"] and manifest["key"]["device"].startswith("cpu")
    assert list((folder / "artifacts").glob("*.bin")), "the session's portable artifacts were saved"

    second_result, second = _compiled_run(pytester, cache, "second")
    assert second["compile_cache"] == "warm"
    assert second["compile_time_s"] < first["compile_time_s"], (first, second)
    second_result.stdout.fnmatch_lines(["*test_compiled: * (compile cache warm), recompiles*"])
    assert _key_folders(cache) == [folder]

    # another torch: its own key folder, made empty when the session probes the hardware (where the cache is
    # installed), so its first compilation is cold; the first folder stays as it was. (A third compilation here
    # took 40-50 s of the suite; the "cold" reading itself is the first run's.)
    entries = sorted(path.relative_to(folder) for path in folder.rglob("*"))
    pytester.makeconftest(OTHER_TORCH)
    pytester.makepyfile(test_probe="def test_probe(opt_hardware):\n    assert opt_hardware.device == 'cpu'\n")
    pytester.runpytest(*INNER, f"--opt-compile-cache={cache}", "test_probe.py").assert_outcomes(passed=1)
    folders = _key_folders(cache)
    assert len(folders) == 2 and folder in folders
    (new,) = [path for path in folders if path != folder]
    assert json.loads((new / MANIFEST).read_text())["key"]["torch"] == "9.9.9"
    assert not [path for path in (new / "inductor").rglob("*") if path.is_file()]  # nothing the other torch wrote
    assert sorted(path.relative_to(folder) for path in folder.rglob("*")) == entries


def test_a_bad_folder_is_a_usage_error_naming_the_option(pytester: pytest.Pytester,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_user="def test_nothing():\n    pass\n")
    not_a_folder = pytester.path / "a-file"
    not_a_folder.write_text("x")
    result = pytester.runpytest(f"--opt-compile-cache={not_a_folder}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--opt-compile-cache: '{not_a_folder}' is not a folder*"])

    monkeypatch.setenv("PYTEST_OPT_COMPILE_CACHE", str(not_a_folder / "below"))
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*PYTEST_OPT_COMPILE_CACHE: *a-file' is not a folder, so * cannot be created*"])

    monkeypatch.setenv("PYTEST_OPT_COMPILE_CACHE", str(pytester.path / "new" / "cache"))  # created when needed
    pytester.runpytest().assert_outcomes(passed=1)


def test_a_folder_whose_manifest_names_another_key_is_emptied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in compile_cache.CACHE_VARIABLES:  # install sets them; monkeypatch puts them back
        monkeypatch.delenv(name, raising=False)
    key = CacheKey(torch="2.0", transformers="5.0", device="cpu (x86_64)")
    cache = CompileCache(str(tmp_path), key)
    cache.folder.mkdir()
    (cache.folder / MANIFEST).write_text(json.dumps({"format": 1, "key": {**asdict(key), "torch": "1.0"}}))
    (cache.folder / "inductor").mkdir()
    (cache.folder / "inductor" / "old-entry").write_text("stale")
    cache.install()
    try:
        assert cache.stale
        assert not (cache.folder / "inductor" / "old-entry").exists()
        assert json.loads((cache.folder / MANIFEST).read_text())["key"]["torch"] == "2.0"
    finally:
        cache.uninstall()


def test_warm_and_cold_come_from_the_cache_lookups() -> None:
    assert compile_cache_state(0, 0) is None
    assert compile_cache_state(2, 0) == "warm"
    assert compile_cache_state(0, 2) == "cold"
    assert compile_cache_state(1, 1) == "partial"
    assert CacheKey("2.13", "5.24", "cpu").folder_name() != CacheKey("2.14", "5.24", "cpu").folder_name()


def test_collect_only_and_sessions_without_plugin_tests_leave_the_cache_untouched(pytester: pytest.Pytester) -> None:
    """The cache is installed with the hardware probe (a test's first use of the plugin), so neither
    ``--collect-only`` nor a session of plain tests writes a key folder, a manifest or artifacts."""
    pytester.makepyfile(test_user=COMPILED, test_plain="def test_plain():\n    pass\n")
    cache = pytester.path / "compile-cache"
    collected = pytester.runpytest("-p", "no:cacheprovider", "--collect-only", "-q", f"--opt-compile-cache={cache}")
    assert collected.ret == 0, collected.stdout.str()
    plain = pytester.runpytest("-p", "no:cacheprovider", "-q", f"--opt-compile-cache={cache}", "test_plain.py")
    plain.assert_outcomes(passed=1)
    assert not cache.exists() or _key_folders(cache) == [], sorted(p.name for p in cache.rglob("*"))
