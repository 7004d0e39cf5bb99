"""``pytest-opt init``: plan the files, refuse when any target exists, else write them all or none.

What is written into the project's folder:

- ``tests/test_optimizations.py``: the starter tests (``starter.py``);
- the settings: a ``[tool.pytest.ini_options]`` table appended to ``pyproject.toml`` when there is one
  without pytest settings (in the file's own line endings), else a new ``pytest.ini``. Any pytest settings
  already there (``pytest.ini``, ``.pytest.ini``, pytest 9's ``[tool.pytest]`` or the
  ``[tool.pytest.ini_options]`` table in ``pyproject.toml``, ``[pytest]`` in ``tox.ini``, ``[tool:pytest]``
  in ``setup.cfg``) are a refusal: a new file would take precedence over them and silently change how pytest
  runs, so the user adds the keys there (``--dry-run`` prints them). So is a ``pyproject.toml`` that is not
  valid TOML: appending to it would hide the error behind a success;
- ``.github/workflows/gpu-gate.yml``: the GPU gate (``templates.py``);
- ``.github/actionlint.yaml``: the runner's custom label, for actionlint, only when the project has no
  actionlint configuration (one there is left as it is, with a note when it lacks the label).

All or nothing: every target is checked before anything is written; a new file is created without ever
replacing one (``files.create_atomic``), the appended ``pyproject.toml`` is replaced atomically only if it
still holds what was read, and a failure part-way undoes what this run wrote.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..advisor import ServingScenario
from ..advisor.model_config import BUILTIN_DEFAULT
from ..errors import OptConfigError
from ..files import create_atomic, write_atomic
from .starter import picks, starter_source
from .templates import (ACTIONLINT_CONFIG, REPORT_JSON, RUNNER_LABELS, STARTER_TEST, WORKFLOW, actionlint_config,
                        gpu_gate_workflow, pyproject_section, pytest_ini)

PROG = "pytest-opt init"
# Files whose pytest settings a new pytest.ini or pyproject table would override: (name, section pattern).
_OTHER_CONFIGS = (("tox.ini", r"^\s*\[pytest\]\s*$"), ("setup.cfg", r"^\s*\[tool:pytest\]\s*$"))
INI_OPTIONS_TABLE = "tool.pytest.ini_options"
NATIVE_TABLE = "tool.pytest"  # pytest 9's own settings table (TOML values)
# The names actionlint reads its configuration from.
_ACTIONLINT_CONFIGS = (ACTIONLINT_CONFIG, ACTIONLINT_CONFIG.removesuffix(".yaml") + ".yml")


@dataclass(frozen=True)
class Planned:
    """One file of the plan: created whole, or ``text`` appended to the ``original`` it holds now."""

    path: str  # relative to the project folder, with "/"
    text: str
    original: str | None = None  # None: a new file

    @property
    def action(self) -> str:
        return "create" if self.original is None else "append"


class InitRefused(Exception):
    """Targets that exist (or settings already there): nothing was written. One line per reason."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


def _read(path: Path) -> str:
    """The file's text with its line endings as they are (no newline translation: the appended file keeps them)."""
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InitRefused([f"{path.name}: cannot be read ({exc})"]) from None


def _parse_toml(text: str) -> dict[str, Any]:
    """``text`` read by tomllib (Python 3.11+) or tomli, its twin, on 3.10 (pytest depends on it there);
    ``ValueError`` (their ``TOMLDecodeError``) when it is not valid TOML."""
    toml = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")
    parsed: dict[str, Any] = toml.loads(text)
    return parsed


def pyproject_pytest_table(data: dict[str, Any]) -> str | None:
    """The table holding pytest's settings in a parsed ``pyproject.toml``, as its header names it: pytest 9's
    ``tool.pytest`` (any key of its own, or an empty table: pytest reads it as the configuration), else
    ``tool.pytest.ini_options``; None when there is neither."""
    tool = data.get("tool")
    pytest_table = tool.get("pytest") if isinstance(tool, dict) else None
    if not isinstance(pytest_table, dict):
        return None
    return INI_OPTIONS_TABLE if set(pytest_table) == {"ini_options"} else NATIVE_TABLE


def appended(original: str, text: str) -> str:
    """``original`` with ``text`` (LF line endings) after one blank line, both in ``original``'s line ending
    (that of its first line break: CRLF stays CRLF)."""
    first_break = re.search(r"\r?\n", original)
    newline = first_break.group() if first_break else "\n"
    separator = ("" if original.endswith("\n") or not original else newline) + (newline if original else "")
    return original + separator + text.replace("\n", newline)


def plan_settings(root: Path, model: str) -> tuple[Planned, list[str]]:
    """Where the settings go, and the reasons (if any) they cannot go anywhere without overriding others."""
    conflicts = [f"{name}: exists and holds pytest's settings; add the keys there yourself (--dry-run prints them)"
                 for name in ("pytest.ini", ".pytest.ini") if (root / name).exists()]
    for name, pattern in _OTHER_CONFIGS:
        if (root / name).is_file() and re.search(pattern, _read(root / name), re.MULTILINE):
            conflicts.append(f"{name}: holds pytest's settings; a new file would override them: add the keys there "
                             f"yourself (--dry-run prints them)")
    pyproject = root / "pyproject.toml"
    if pyproject.exists():
        original = _read(pyproject)
        try:
            table = pyproject_pytest_table(_parse_toml(original))
        except ValueError as exc:
            conflicts.append(f"pyproject.toml: is not valid TOML ({exc}); fix it, then run init again (the settings "
                             f"go into it)")
            table = None
        if table is not None:
            what = " (pytest 9's settings table)" if table == NATIVE_TABLE else ""
            conflicts.append(f"pyproject.toml: already has [{table}]{what}; add the keys there yourself "
                             f"(--dry-run prints them)")
        return Planned("pyproject.toml", pyproject_section(model, table or INI_OPTIONS_TABLE), original), conflicts
    return Planned("pytest.ini", pytest_ini(model)), conflicts


def plan_actionlint_config(root: Path) -> tuple[list[Planned], list[str]]:
    """``.github/actionlint.yaml`` to create when the project has no actionlint configuration, or a note when
    the one it has does not name the runner's labels (it is never changed)."""
    existing = [name for name in _ACTIONLINT_CONFIGS if (root / name).exists() or (root / name).is_symlink()]
    if not existing:
        return [Planned(ACTIONLINT_CONFIG, actionlint_config())], []
    try:
        text = _read(root / existing[0])
    except InitRefused:
        text = ""
    missing = [label for label in RUNNER_LABELS if not re.search(rf"(?<![\w.-]){re.escape(label)}(?![\w.-])", text)]
    if not missing:
        return [], []
    return [], [f"{existing[0]}: exists and is left as it is; actionlint reports the runner label"
                f"{'s' if len(missing) > 1 else ''} {', '.join(missing)} as unknown until it is listed under "
                f"self-hosted-runner: labels:"]


def model_as_written(model: str, root: Path) -> str:
    """The model as the files name it: a built-in name or hub id as given; a local folder (or its
    config.json) relative to the project folder when inside it, else absolute."""
    path = Path(model).expanduser()
    if not path.exists():
        return model
    folder = (path.parent if path.is_file() else path).resolve()
    try:
        return folder.relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(folder)


def _version() -> str | None:
    try:
        return importlib.metadata.version("pytest-transformers-opt")
    except importlib.metadata.PackageNotFoundError:
        return None


def plan_project(root: Path, model: str, gpu_memory_bytes: int | None,
                 out: TextIO) -> tuple[list[Planned], list[str], list[str], list[str]]:
    """The files to write, the reasons not to, the techniques picked and notes for the user
    (``OptConfigError``: bad --model)."""
    written = model_as_written(model, root)
    out.write(f"{PROG}: reading the config of {model} and asking the advisor ...\n")
    out.flush()
    chosen = picks(ServingScenario(model=model, gpu_memory_bytes=gpu_memory_bytes))
    if not chosen:
        raise OptConfigError(f"--model: the advisor proposes no change for {model}; nothing to write")
    names = [pick.name for pick in chosen]
    out.write(f"{PROG}: the advisor picks {', '.join(names)}\n")
    settings, conflicts = plan_settings(root, written)
    where = settings.path if settings.original is None else f"pyproject.toml's [{INI_OPTIONS_TABLE}]"
    starter = Planned(STARTER_TEST, starter_source(written, chosen, gpu_memory_bytes,
                                                   f"the settings in {where} print the report and write "
                                                   f"{REPORT_JSON}"))
    workflow = Planned(WORKFLOW, gpu_gate_workflow(names, _version(), STARTER_TEST.split("/")[0]))
    lint_config, notes = plan_actionlint_config(root)
    planned = [starter, settings, workflow, *lint_config]
    conflicts = [f"{item.path}: exists; it is not overwritten" for item in (starter, workflow)
                 if (root / item.path).exists() or (root / item.path).is_symlink()] + conflicts
    for item in planned:  # a file where a folder must be (tests, .github) blocks the writing too
        for parent in Path(item.path).parents:
            if str(parent) != "." and (root / parent).exists() and not (root / parent).is_dir():
                conflicts.append(f"{parent.as_posix()}: exists and is not a folder")
    return planned, list(dict.fromkeys(conflicts)), names, notes


def _undo(root: Path, done: list[Planned], made: list[Path]) -> None:
    for item in reversed(done):
        target = root / item.path
        if item.original is None:
            target.unlink(missing_ok=True)
        else:
            write_atomic(target, item.original)
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            pass


def write_planned(root: Path, planned: list[Planned]) -> None:
    """Write every planned file, or none (``InitRefused`` or ``OSError`` after undoing this run's writes)."""
    done: list[Planned] = []
    made: list[Path] = []
    try:
        for item in planned:
            target = root / item.path
            for folder in reversed([target.parent, *target.parent.parents]):
                if not folder.exists():
                    folder.mkdir()
                    made.append(folder)
            if item.original is None:
                try:
                    create_atomic(target, item.text)
                except FileExistsError:
                    raise InitRefused([f"{item.path}: appeared while writing; it is not overwritten"]) from None
            else:
                if _read(target) != item.original:
                    raise InitRefused([f"{item.path}: changed while writing; it is left as it is"])
                write_atomic(target, appended(item.original, item.text))
            done.append(item)
    except BaseException:
        _undo(root, done, made)
        raise


def show(planned: list[Planned], out: TextIO) -> None:
    """--dry-run: every path and what would be written there."""
    for item in planned:
        what = "new file" if item.action == "create" else "appended to the end"
        out.write(f"\n=== {item.path} ({what}) ===\n{item.text}")


def init_project(model: str | None, gpu_memory_bytes: int | None, directory: str, dry_run: bool,
                 out: TextIO | None = None, err: TextIO | None = None) -> int:
    """``pytest-opt init``; returns the exit status: 0 written (or shown), 1 refused (nothing written).
    Bad options raise ``OptConfigError`` naming the option (the command line's exit status 2). ``out`` and
    ``err``: the streams (default: ``sys.stdout`` and ``sys.stderr`` at the call)."""
    out = out or sys.stdout
    err = err or sys.stderr
    root = Path(directory).expanduser()
    if root.exists() and not root.is_dir():
        raise OptConfigError(f"--directory: {directory!r} is not a folder; give the project's folder (created when "
                             f"missing)")
    model = model or BUILTIN_DEFAULT
    planned, conflicts, names, notes = plan_project(root, model, gpu_memory_bytes, out)
    if dry_run:
        out.write(f"{PROG}: --dry-run: what would be written into {root.resolve()} (nothing is written)\n")
        show(planned, out)
        out.write("".join(f"note: {note}\n" for note in notes))
    if conflicts:
        err.write(f"{PROG}: refused, nothing {'would be ' if dry_run else ''}written in {root.resolve()}:\n")
        err.write("".join(f"  {reason}\n" for reason in conflicts))
        return 1
    if dry_run:
        return 0
    try:
        write_planned(root, planned)
    except InitRefused as exc:
        err.write(f"{PROG}: refused, nothing written in {root.resolve()}:\n")
        err.write("".join(f"  {reason}\n" for reason in exc.reasons))
        return 1
    except OSError as exc:
        raise OptConfigError(f"--directory: cannot write into {str(root)!r}: {exc.strerror or exc} (nothing was "
                             f"written)") from None
    for item in planned:
        verb = "wrote" if item.original is None else f"added [{INI_OPTIONS_TABLE}] to"
        out.write(f"{verb} {item.path}\n")
    out.write("".join(f"note: {note}\n" for note in notes))
    out.write(f"Next: run pytest in {root} (it runs the {len(names)} tests, prints the report and writes "
              f"{REPORT_JSON}); commit the files, and give the GPU gate a self-hosted runner labelled gpu.\n")
    return 0
