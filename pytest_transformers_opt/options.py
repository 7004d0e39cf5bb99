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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from .engine.gpu_pinning import parse_gpus_per_worker
from .files import check_writable
from .verdict.bench import MAX_ROUNDS, MAX_WARMUP
from .verdict.budgets import BUDGET_MODES, BUDGETS
from .errors import OptConfigError
from .units import parse_non_negative_int

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


def _names(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise OptConfigError(f"{value!r} names no technique; accepted: NAME[,NAME] or all")
    return names




def _rounds(value: str) -> int:
    return parse_non_negative_int(value, "rounds", minimum=1, maximum=MAX_ROUNDS)


def _warmup(value: str) -> int:
    return parse_non_negative_int(value, "warm-up rounds", minimum=0, maximum=MAX_WARMUP)


def _text(value: str) -> str:
    return value


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
    OptionDef("--opt-compare", "opt_compare", None, _path, None, "compare with an earlier JSON report", "PATH",
              is_path=True),
    OptionDef("--opt-compare-fail", "opt_compare_fail", "opt_compare_fail", _text, None,
              "regressions that fail the run: latency:10%,peak_memory:5%,kl_mean:0.01", "EXPR[,EXPR]"),
    OptionDef("--opt-gpus-per-worker", "opt_gpus_per_worker", "opt_gpus_per_worker", parse_gpus_per_worker, None,
              "under pytest-xdist, pin each worker to its own N GPUs", "N"),
    OptionDef("--opt-techniques", "opt_techniques", None, _bool, False,
              "print the technique catalogue with what this machine supports and why not, then exit", is_flag=True,
              has_env=False),
    OptionDef("--opt-rounds", "opt_rounds", "opt_rounds", _rounds, 5, f"measured rounds per side (1 to {MAX_ROUNDS})",
              "N"),
    OptionDef("--opt-warmup", "opt_warmup", "opt_warmup", _warmup, 1,
              f"warm-up rounds per side (0 to {MAX_WARMUP}), kept out of the figures (compiled techniques get at "
              f"least 2)", "N"),
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


@dataclass
class Settings:
    """Every option after CLI > environment > ini > default resolution."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    ini_budgets: dict[str, Any] = field(default_factory=dict)
    baseline: tuple[str, ...] = ("eager",)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None


def resolve_settings(config: pytest.Config) -> Settings:
    """Read every option; raise ``pytest.UsageError`` naming the source of a bad value."""
    settings = Settings()
    for option in OPTIONS:
        key = option.dest.removeprefix("opt_")
        cli = config.getoption(option.dest)
        if cli is not None and cli is not False:
            settings.values[key], settings.sources[key] = cli, option.flag
            continue
        raw, source = (os.environ.get(option.env), option.env) if option.env else (None, "")
        if raw is not None and not raw.strip():
            raw = None  # an empty variable counts as unset: CI templates export empty values for "not set"
        if raw is None and option.ini:
            raw, source = config.getini(option.ini), f"ini {option.ini}"
            raw = raw or None
        if raw is None:
            settings.values[key], settings.sources[key] = option.default, "default"
            continue
        try:
            settings.values[key] = option.parse(str(raw).strip())
        except OptConfigError as exc:
            raise pytest.UsageError(f"{source}: {exc}") from None
        settings.sources[key] = source
    if settings.values["require"]:
        settings.values["require"] = frozenset(settings.values["require"])
    for name in BUDGETS:
        raw = config.getini(f"opt_{name}")
        if raw:
            from .verdict.budgets import parse_budget

            try:
                parse_budget(name, raw, f"ini opt_{name}")
            except OptConfigError as exc:
                raise pytest.UsageError(str(exc)) from None
            settings.ini_budgets[name] = raw
    baseline = config.getini("opt_baseline")
    if baseline:
        settings.baseline = tuple(n.strip() for n in baseline.split(",") if n.strip())
    _resolve_paths(config, settings)
    _load_compare(settings)
    written: dict[Path, str] = {}
    for key in REPORT_KEYS:
        path = settings.values.get(key)
        if path:
            source = settings.sources[key]
            check_writable(Path(path), source)
            same = Path(path).resolve()
            if same in written:
                raise pytest.UsageError(f"{written[same]} and {source} name the same file {path!r}; each report "
                                        f"format needs its own path")
            written[same] = source
    return settings


REPORT_KEYS = ("report_json", "report_md", "report_html")


def _resolve_paths(config: pytest.Config, settings: Settings) -> None:
    """Make every path option absolute, once, now: later a test may change directory.

    ``~`` is expanded; a relative path from the command line or the environment is relative to the
    directory pytest was started in, one from the ini file (or the default) to the ini file's folder
    (the rootdir), as pytest does for its own ini paths.
    """
    invocation = Path(config.invocation_params.dir)
    rootdir = Path(config.inipath).parent if config.inipath else Path(config.rootpath)
    for option in OPTIONS:
        key = option.dest.removeprefix("opt_")
        value = settings.values.get(key)
        if not option.is_path or not value:
            continue
        source = settings.sources[key]
        base = rootdir if source == "default" or source.startswith("ini ") else invocation
        path = Path(value).expanduser()
        settings.values[key] = os.path.normpath(path if path.is_absolute() else base / path)


def _load_compare(settings: Settings) -> None:
    """Parse --opt-compare-fail and read the --opt-compare report now: a bad one is a usage error."""
    from .report.compare import load_compare_report, parse_compare_fail

    thresholds = []
    try:
        if settings.values.get("compare_fail"):
            thresholds = parse_compare_fail(settings.compare_fail, settings.sources["compare_fail"])
        settings.values["compare_report"] = (load_compare_report(settings.compare, settings.sources["compare"])
                                             if settings.compare else None)
    except OptConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    if thresholds and not settings.compare:
        raise pytest.UsageError(f"{settings.sources['compare_fail']}: needs --opt-compare=PATH (the earlier report)")
    settings.values["compare_thresholds"] = thresholds
