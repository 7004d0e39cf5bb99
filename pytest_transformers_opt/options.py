"""Command-line options, their ini twins and environment variables: one table, one resolver.

Order: command line, then environment (``PYTEST_OPT_<NAME>``), then ini, then the default. A bad
value is a usage error that names the option (or ini key / variable) and the accepted forms. An
empty variable counts as unset; flags that act (``--opt-update-baselines``, ``--opt-techniques``)
have no variable, so none is read. Paths are made absolute once, at configure time.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import pytest

from .engine.compile_cache import check_cache_dir
from .engine.cpu_threads import parse_cpu_threads
from .engine.gpu_pinning import parse_gpus_per_worker
from .files import check_writable
from .verdict.sequential import AUTO_ROUNDS, MAX_WARMUP, ROUNDS_FORMS, RoundsRule, parse_rounds
from .verdict.budgets import BUDGET_MODES, BUDGETS, parse_budget
from .verdict.stats import DEFAULT_COMPARE_WINDOW, MAX_COMPARE_WINDOW, MIN_WINDOW_RUNS, compare_window_size
from .errors import OptConfigError
from .units import parse_non_negative_int

if TYPE_CHECKING:
    from .verdict.compare import Threshold

DEFAULT_MODEL = "tiny-random-llama"


def _device(value: str) -> str:
    value = value.strip()
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:[0-9]+", value):
        return value
    raise OptConfigError(f"{value!r} is not a device; accepted: auto, cpu, cuda, cuda:N")


def _mode(value: str) -> str:
    if value in BUDGET_MODES:
        return value
    raise OptConfigError(f"{value!r} is not a budget mode; accepted: {', '.join(BUDGET_MODES)}")


AB_MODES = ("auto", "interleaved", "blocks")


def _ab_mode(value: str) -> str:
    value = value.strip()
    if value in AB_MODES:
        return value
    raise OptConfigError(f"{value!r} is not an A/B mode; accepted: {', '.join(AB_MODES)}")


CENSUS_MODES = ("on", "off")
TRACE_MODES = ("off", "regressed", "all")


def _census(value: str) -> bool:
    value = value.strip().lower()
    if value in CENSUS_MODES:
        return value == "on"
    raise OptConfigError(f"{value!r} is not a census setting; accepted: {', '.join(CENSUS_MODES)}")


def _trace(value: str) -> str:
    value = value.strip().lower()
    if value in TRACE_MODES:
        return value
    raise OptConfigError(f"{value!r} is not a trace setting; accepted: {', '.join(TRACE_MODES)}")


def _names(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise OptConfigError(f"{value!r} names no technique; accepted: NAME[,NAME] or all")
    return names




def _rounds(value: str) -> RoundsRule:
    return parse_rounds(value, "rounds")


def _warmup(value: str) -> int:
    return parse_non_negative_int(value, "warm-up rounds", minimum=0, maximum=MAX_WARMUP)


def _text(value: str) -> str:
    return value


MAX_HISTORY_KEEP = 100_000


def _history_keep(value: str) -> int:
    return parse_non_negative_int(value, "recorded runs to keep", minimum=1, maximum=MAX_HISTORY_KEEP)


def _compare_window(value: str) -> int:
    return compare_window_size(value)


def _path(value: str) -> str:
    """A file or folder path; an empty one would silently mean the current directory."""
    if not str(value).strip():
        raise OptConfigError(f"{value!r} is an empty path; give a file or folder path")
    return value


def _bool(value: str) -> bool:
    lowered = str(value).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise OptConfigError(f"{value!r} is not a boolean; accepted: true/false, 1/0, yes/no")


@dataclass(frozen=True)
class OptionDef:
    flag: str  # --opt-xxx
    dest: str
    ini: str | None
    parse: Callable[[str], Any]
    default: Any
    help: str
    metavar: str | None = None
    is_flag: bool = False
    has_env: bool = True  # False for flags that act (rewrite files, print and exit): the command line only
    is_path: bool = False  # resolved to an absolute path once, at configure time

    @property
    def env(self) -> str | None:
        """``PYTEST_OPT_<NAME>``, or None when the option has no environment twin (then none is read)."""
        return "PYTEST_OPT_" + self.dest.removeprefix("opt_").upper() if self.has_env else None


OPTIONS: tuple[OptionDef, ...] = (
    OptionDef("--opt-report", "opt_report", "opt_report", _bool, False,
              "print the optimization report at the end of the run", is_flag=True),
    OptionDef("--opt-report-json", "opt_report_json", "opt_report_json", _path, None,
              "write the report as JSON (schema versioned, environment included)", "PATH", is_path=True),
    OptionDef("--opt-report-md", "opt_report_md", None, _path, None,
              "write the report as Markdown; also appended to $GITHUB_STEP_SUMMARY when set", "PATH", is_path=True),
    OptionDef("--opt-report-html", "opt_report_html", None, _path, None,
              "write the report as a self-contained HTML page with charts", "PATH", is_path=True),
    OptionDef("--opt-model", "opt_model", "opt_model", _text, DEFAULT_MODEL,
              "default model: a folder, a hub id or a built-in model", "NAME"),
    OptionDef("--opt-device", "opt_device", "opt_device", _device, "auto",
              "device: auto, cpu, cuda, cuda:N", "DEV"),
    OptionDef("--opt-require", "opt_require", "opt_require", _names, (),
              "strict mode: a skip of these techniques (NAME[,NAME] or all) fails the test", "NAMES"),
    OptionDef("--opt-budgets", "opt_budgets", "opt_budgets", _mode, "enforce",
              "enforce: failed budgets fail the test; warn: report only; off: measure without checking", "MODE"),
    OptionDef("--opt-baselines", "opt_baselines", "opt_baselines", _path, ".opt-baselines",
              "where stored baselines live", "DIR", is_path=True),
    OptionDef("--opt-update-baselines", "opt_update_baselines", None, _bool, False,
              "(re)write stored baselines from this run", is_flag=True, has_env=False),
    OptionDef("--opt-compare", "opt_compare", None, _path, None,
              "compare with an earlier JSON report, or with each test's recorded runs in a folder written by "
              "--opt-history (a window of runs: see --opt-compare-window)", "PATH", is_path=True),
    OptionDef("--opt-compare-window", "opt_compare_window", "opt_compare_window", _compare_window,
              DEFAULT_COMPARE_WINDOW,
              f"with --opt-compare=DIR (a folder written by --opt-history): judge each test against its last N "
              f"recorded runs on the same hardware and stack, with their run-to-run spread ({MIN_WINDOW_RUNS} to "
              f"{MAX_COMPARE_WINDOW})", "N"),
    OptionDef("--opt-compare-confirm", "opt_compare_confirm", "opt_compare_confirm", _bool, True,
              "with --opt-compare=DIR and --opt-compare-fail: measure a test that regressed once more, after the "
              "other tests, and fail it only when that regresses too (1, the default; 0: the first measurement "
              "decides)", "0|1"),
    OptionDef("--opt-compare-fail", "opt_compare_fail", "opt_compare_fail", _text, None,
              "regressions that fail the run: latency:10%,peak_memory:5%,kl_mean:0.01", "EXPR[,EXPR]"),
    OptionDef("--opt-gpus-per-worker", "opt_gpus_per_worker", "opt_gpus_per_worker", parse_gpus_per_worker, None,
              "under pytest-xdist, pin each worker to its own N GPUs", "N"),
    OptionDef("--opt-cpu-threads", "opt_cpu_threads", "opt_cpu_threads", parse_cpu_threads, None,
              "torch's intra-op threads on CPU: N, or auto (default: the cores divided among pytest-xdist "
              "workers); left alone on CUDA", "N|auto"),
    OptionDef("--opt-techniques", "opt_techniques", None, _bool, False,
              "print the technique catalogue with what this machine supports and why not, then exit", is_flag=True,
              has_env=False),
    OptionDef("--opt-rounds", "opt_rounds", "opt_rounds", _rounds, AUTO_ROUNDS,
              f"timed rounds per side: {ROUNDS_FORMS}; sequential rounds stop once every speed budget is settled",
              "N|MIN..MAX|auto"),
    OptionDef("--opt-warmup", "opt_warmup", "opt_warmup", _warmup, 1,
              f"warm-up rounds per side (0 to {MAX_WARMUP}), kept out of the figures (compiled techniques get at "
              f"least 2)", "N"),
    OptionDef("--opt-compile-cache", "opt_compile_cache", "opt_compile_cache", _path, None,
              "keep torch's compile caches (inductor, autotuning, portable artifacts) in this folder, one "
              "subfolder per torch, transformers and device, for CI to restore between runs", "DIR", is_path=True),
    OptionDef("--opt-history", "opt_history", "opt_history", _path, None,
              "record each run's JSON report in this folder (named by time and git commit); the HTML report "
              "draws each test's trend over the recorded runs", "DIR", is_path=True),
    OptionDef("--opt-history-keep", "opt_history_keep", "opt_history_keep", _history_keep, 200,
              f"recorded runs --opt-history keeps, the oldest pruned first (1 to {MAX_HISTORY_KEEP})", "N"),
    OptionDef("--opt-ab", "opt_ab", "opt_ab", _path, None,
              "a reference environment's Python interpreter (another venv: the previous torch, main's lockfile): "
              "each opt_bench test's optimized configuration also runs there, its rounds interleaved with this "
              "environment's, and every figure gets a candidate-vs-reference verdict", "PYTHON"),
    OptionDef("--opt-ab-fail", "opt_ab_fail", "opt_ab_fail", _text, None,
              "A/B regressions that fail the run, in the grammar of --opt-compare-fail: "
              "latency:5%,peak_memory:5%,kl_mean:0.01", "EXPR[,EXPR]"),
    OptionDef("--opt-census", "opt_census", "opt_census", _census, True,
              "count what each configuration's generate call runs (ATen ops, graph breaks, recompiles; on CUDA kernels "
              "and syncs) in one untimed call after the timed rounds: on (default) or off", "on|off"),
    OptionDef("--opt-trace", "opt_trace", "opt_trace", _trace, "off",
              "write a Chrome trace of one generate call next to the JSON report: regressed (the tests the gate "
              "flags: regressed or inconclusive, a failed budget), all, off (default)", "regressed|all|off"),
    OptionDef("--opt-ab-mode", "opt_ab_mode", "opt_ab_mode", _ab_mode, "auto",
              "how the two environments take turns: interleaved (round by round; both processes hold a model), "
              "blocks (alternating blocks of rounds, the idle side's model moved to the CPU: for a device that "
              "cannot hold two), auto (interleaved, blocks where the device cannot hold both)", "MODE"),
)


def _argparse_type(option: OptionDef) -> Callable[[str], Any]:
    def convert(value: str) -> Any:
        try:
            return option.parse(value)
        except OptConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = option.flag  # argparse names the type in some messages
    return convert


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("transformers-opt", "Transformers inference optimizations (pytest-transformers-opt)")
    for option in OPTIONS:
        env_ini = (f" Env: {option.env}." if option.env else "") + (f" Ini: {option.ini}." if option.ini else "")
        default = "" if option.is_flag else f" Default: {option.default!r}."
        if option.is_flag:
            group.addoption(option.flag, action="store_true", dest=option.dest, default=None,
                            help=(option.help + "." + env_ini).replace("%", "%%"))
        else:
            group.addoption(option.flag, dest=option.dest, default=None, metavar=option.metavar,
                            type=_argparse_type(option),
                            help=(option.help + "." + default + env_ini).replace("%", "%%"))
        if option.ini:
            parser.addini(option.ini, help=option.help, type="string", default=None)
    for name, budget in BUDGETS.items():
        parser.addini(f"opt_{name}", help=f"default budget {name} for every test: {budget.help}", type="string",
                      default=None)
    parser.addini("opt_baseline", help="default baseline techniques, comma-separated (default: eager)",
                  type="string", default=None)


DEFAULT_BASELINE = ("eager",)
REPORT_KEYS = ("report_json", "report_md", "report_html")


@dataclass(frozen=True)
class Settings:
    """Every option after CLI > environment > ini > default resolution, and what configure time read from
    them. One field per entry of ``OPTIONS``, named as its ``dest`` without ``opt_``; built once, by
    ``resolve_settings``, and never changed after."""

    report: bool
    report_json: str | None  # paths absolute (resolved at configure time)
    report_md: str | None
    report_html: str | None
    model: str
    device: str
    require: frozenset[str]  # technique names or labels, or "all"; empty: no strict mode
    budgets: str  # a BUDGET_MODES entry
    baselines: str
    update_baselines: bool
    compare: str | None
    compare_window: int
    compare_confirm: bool  # --opt-compare-confirm: a window regression is measured again before it fails the run
    compare_fail: str | None
    gpus_per_worker: int | None
    cpu_threads: int | None  # None: auto (each pytest-xdist worker's share of the cores)
    techniques: bool
    rounds: RoundsRule
    warmup: int
    compile_cache: str | None  # the folder, absolute; checked usable at configure time
    history: str | None  # the folder, absolute; only checked not to be a file (writing it is checked at the end)
    history_keep: int
    ab: str | None  # the reference interpreter: absolute, or as given when it is a command found on PATH
    ab_fail: str | None
    ab_mode: str  # an AB_MODES entry
    census: bool  # --opt-census: take each configuration's execution census
    trace: str  # --opt-trace: a TRACE_MODES entry
    sources: dict[str, str]  # option key -> where its value came from: the flag, the variable, "ini KEY", "default"
    ini_budgets: dict[str, str]  # budget name -> the ini value, checked
    baseline: tuple[str, ...]  # ini opt_baseline, else eager
    compare_report: dict[str, Any] | None  # the --opt-compare report, read at configure time
    compare_history: str | None  # the --opt-compare folder of recorded runs (read at the end), instead of a report
    compare_thresholds: list[Threshold]  # --opt-compare-fail, parsed
    ab_thresholds: list[Threshold]  # --opt-ab-fail, parsed
    notes: tuple[str, ...] = ()  # project-wide settings (ini, environment) this run leaves unused, and why


def resolve_settings(config: pytest.Config) -> Settings:
    """Read every option; raise ``pytest.UsageError`` naming the source of a bad value."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in OPTIONS:
        key = option.dest.removeprefix("opt_")
        values[key], sources[key] = _resolve(config, option)
    values["require"] = frozenset(values["require"])
    ini_budgets = _ini_budgets(config)
    baseline = _ini_baseline(config)
    values = _absolute_paths(config, values, sources)
    notes: list[str] = []
    compare_report, compare_history, compare_thresholds = _load_compare(values, sources, notes)
    ab_thresholds = _ab_thresholds(config, values, sources, notes)
    _check_report_paths(values, sources)
    if values["compile_cache"]:
        try:
            check_cache_dir(values["compile_cache"], sources["compile_cache"])
        except OptConfigError as exc:
            raise pytest.UsageError(str(exc)) from None
    _check_history_dir(values, sources)
    return Settings(**values, sources=sources, ini_budgets=ini_budgets, baseline=baseline,
                    compare_report=compare_report, compare_history=compare_history,
                    compare_thresholds=compare_thresholds,
                    ab_thresholds=ab_thresholds, notes=tuple(notes))


def _resolve(config: pytest.Config, option: OptionDef) -> tuple[Any, str]:
    """(value, source) of one option: command line, then environment, then ini, then the default."""
    cli = config.getoption(option.dest)
    if cli is not None and not (cli is False and option.is_flag):  # an unset flag is False; --opt-x=0 is a value
        return cli, option.flag
    raw, source = (os.environ.get(option.env), option.env) if option.env else (None, "")
    if raw is not None and not raw.strip():
        raw = None  # an empty variable counts as unset: CI templates export empty values for "not set"
    if raw is None and option.ini:
        raw, source = config.getini(option.ini), f"ini {option.ini}"
        raw = raw or None
    if raw is None:
        return option.default, "default"
    try:
        return option.parse(str(raw).strip()), source
    except OptConfigError as exc:
        raise pytest.UsageError(f"{source}: {exc}") from None


def _check_history_dir(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """A file (or a path under one) is a mistake said now; a folder that cannot be written is said at the
    end, in one line, so a read-only history never costs the run or its report."""
    folder = values.get("history")
    if not folder:
        return
    existing = Path(folder)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise pytest.UsageError(f"{sources['history']}: {str(existing)!r} is not a folder; give the folder the "
                                f"run history lives in")


def _ini_budgets(config: pytest.Config) -> dict[str, str]:
    """The ``opt_<budget>`` ini keys that are set, each checked now: a bad one is a usage error."""
    budgets = {}
    for name in BUDGETS:
        raw = config.getini(f"opt_{name}")
        if raw:
            try:
                parse_budget(name, raw, f"ini opt_{name}")
            except OptConfigError as exc:
                raise pytest.UsageError(str(exc)) from None
            budgets[name] = raw
    return budgets


def _ini_baseline(config: pytest.Config) -> tuple[str, ...]:
    baseline = config.getini("opt_baseline")
    return tuple(n.strip() for n in baseline.split(",") if n.strip()) if baseline else DEFAULT_BASELINE


def _check_report_paths(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """Each requested report file is writable, and no two formats name the same file."""
    written: dict[Path, str] = {}
    for key in REPORT_KEYS:
        path = values.get(key)
        if path:
            source = sources[key]
            check_writable(Path(path), source)
            same = Path(path).resolve()
            if same in written:
                raise pytest.UsageError(f"{written[same]} and {source} name the same file {path!r}; each report "
                                        f"format needs its own path")
            written[same] = source


def _absolute_paths(config: pytest.Config, values: Mapping[str, Any], sources: Mapping[str, str]) -> dict[str, Any]:
    """``values`` with every path option absolute, made so once, now: later a test may change directory.

    ``~`` is expanded; a relative path from the command line or the environment is relative to the
    directory pytest was started in, one from the ini file (or the default) to the ini file's folder
    (the rootdir), as pytest does for its own ini paths.
    """
    invocation = Path(config.invocation_params.dir)
    rootdir = Path(config.inipath).parent if config.inipath else Path(config.rootpath)
    absolute = dict(values)
    for option in OPTIONS:
        key = option.dest.removeprefix("opt_")
        value = values.get(key)
        if not option.is_path or not value:
            continue
        source = sources[key]
        base = rootdir if source == "default" or source.startswith("ini ") else invocation
        path = Path(value).expanduser()
        absolute[key] = os.path.normpath(path if path.is_absolute() else base / path)
    return absolute


_COMPARE_FOLDER_REMEDY = "or the folder of recorded runs that --opt-history=DIR writes"


def _compare_history(values: Mapping[str, Any], sources: Mapping[str, str]) -> str | None:
    """The --opt-compare path as a history folder, or None when it names a report file. A folder that does not
    exist yet is one when it is this run's --opt-history folder (the first run of a CI history: nothing to compare
    yet); a folder that holds JSON files but no recorded run is a mistake said now (give one of them instead)."""
    compare: str | None = values.get("compare")
    history: str | None = values.get("history")
    if not compare:
        return None
    if not os.path.isdir(compare):
        first_run = not os.path.exists(compare) and history is not None and \
            os.path.normpath(history) == os.path.normpath(compare)
        return compare if first_run else None
    from .report.history import run_names

    if not run_names(compare):
        try:
            others = sorted(entry.name for entry in os.scandir(compare) if entry.name.endswith(".json"))
        except OSError as exc:
            raise pytest.UsageError(f"{sources['compare']}: cannot read the folder {compare!r}: "
                                    f"{exc.strerror or exc}") from None
        if others:
            raise pytest.UsageError(
                f"{sources['compare']}: the folder {compare!r} holds no run recorded by --opt-history (named like "
                f"20261201T131500Z-1a2b3c4.json) but {len(others)} other JSON file{'s' if len(others) != 1 else ''} "
                f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); give one report as "
                f"--opt-compare=FILE, or the folder --opt-history=DIR writes")
    return compare


def _load_compare(values: dict[str, Any], sources: Mapping[str, str], notes: list[str]
                  ) -> tuple[dict[str, Any] | None, str | None, list[Threshold]]:
    """Parse --opt-compare-fail and read the --opt-compare report now: a bad one is a usage error (a history
    folder is read at the end, where a bad file in it is left out and named). A gate without a report to
    compare with is an error when typed on the command line; set project-wide (ini, environment) it is a note,
    and this run has no gate. So is a window size typed on the command line without a history folder."""
    from .report.compare import COMPARE_REMEDY, load_compare_report
    from .verdict.compare import parse_compare_fail

    thresholds: list[Threshold] = []
    compare = values.get("compare")
    history = _compare_history(values, sources)
    try:
        if values.get("compare_fail"):
            thresholds = parse_compare_fail(values["compare_fail"], sources["compare_fail"])
        report = None
        if compare and history is None:
            report = load_compare_report(compare, sources["compare"], f"{COMPARE_REMEDY}, {_COMPARE_FOLDER_REMEDY}")
    except OptConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    if thresholds and not compare:
        _gate_not_applied(values, sources, notes, "compare_fail", "--opt-compare=PATH", "the earlier report")
        thresholds = []
    if history is None and sources["compare_window"] == "--opt-compare-window":
        found = f"--opt-compare={compare}" if compare else "no --opt-compare"
        raise pytest.UsageError(f"--opt-compare-window: needs --opt-compare=DIR, a folder of runs recorded by "
                                f"--opt-history (found: {found})")
    return report, history, thresholds


def _gate_not_applied(values: dict[str, Any], sources: Mapping[str, str], notes: list[str], gate: str, needs: str,
                      what: str) -> None:
    """A gate without what it gates against: typed on the command line, a usage error; set project-wide (ini,
    environment), a note, and this run has no gate."""
    source = sources[gate]
    if source == "--opt-" + gate.replace("_", "-"):
        raise pytest.UsageError(f"{source}: needs {needs} ({what})")
    notes.append(f"{source}={values[gate]} is not applied: this run has no {needs} ({what} it gates against)")
    values[gate] = None


def _ab_thresholds(config: pytest.Config, values: dict[str, Any], sources: Mapping[str, str],
                   notes: list[str]) -> list[Threshold]:
    """Resolve the --opt-ab interpreter and parse --opt-ab-fail now (a bad term is a usage error). A
    bare command (``python3.10``) is looked up on PATH, a path is made absolute; one that cannot be run is
    each A/B test's one-line failure, not a usage error, so the report of the rest is still written. A gate
    without a reference is an error on the command line and a note when set project-wide."""
    import shutil

    python = values.get("ab")
    if python and os.sep not in python and not python.startswith((".", "~")):
        values["ab"] = shutil.which(python) or python
    elif python:
        base = Path(config.invocation_params.dir) if not sources["ab"].startswith(("ini ", "default")) \
            else (Path(config.inipath).parent if config.inipath else Path(config.rootpath))
        path = Path(python).expanduser()
        # not resolved through symlinks: a venv's python is a link to the base interpreter, and its
        # own path is what makes it that venv
        values["ab"] = os.path.normpath(path if path.is_absolute() else base / path)
    if not values.get("ab_fail"):
        return []
    from .verdict.compare import parse_compare_fail
    from .verdict.ab import check_ab_thresholds

    try:
        thresholds = parse_compare_fail(values["ab_fail"], sources["ab_fail"])
        check_ab_thresholds(thresholds, sources["ab_fail"])
    except OptConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    if not values.get("ab"):
        _gate_not_applied(values, sources, notes, "ab_fail", "--opt-ab=PYTHON",
                          "the reference environment's interpreter")
        thresholds = []
    return thresholds
