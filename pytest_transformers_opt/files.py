"""Every file the plugin writes, and every JSON file it reads but did not write itself.

``write_atomic`` is the one writer: a temporary file in the target's folder, then ``os.replace``, so
no reader ever sees half a file; the result has the permissions any other new file gets (``0o666``
less the umask, or the mode of the file it replaces), not ``mkstemp``'s ``0600``.

``read_json`` is the one reader for files from elsewhere (stored baselines, ``--opt-compare`` reports,
``pytest-opt advise --from-report`` and ``--model`` configs). A crafted or broken file is an
``OptConfigError`` naming the file, never a hang or a raw ``RecursionError`` / ``ValueError``:

- regular files only (a FIFO is refused without blocking: opened with ``O_NONBLOCK``, checked with
  ``fstat`` before any read), at most ``max_bytes`` (the plugin's own reports: ``MAX_REPORT_BYTES``);
- strict JSON: no ``NaN`` / ``Infinity``, no number that overflows a float (``1e400``), no integer
  beyond 64 bits (which also refuses 5000-digit ints before Python's digit limit is hit);
- at most ``max_depth`` levels of nesting (100,000 levels are refused, not a ``RecursionError``) and
  ``max_items`` values in all.

What a value means (a token id below the vocabulary, a positive layer count) is the caller's schema.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest

from .errors import OptConfigError
from .units import clip

MAX_JSON_BYTES = 64 * 2**20
MAX_JSON_DEPTH = 64
MAX_JSON_ITEMS = 8_000_000
# The plugin's own reports (a merged one of 24,000 rows is 84 MB): readers use these limits, and the writers
# refuse to write a report past them, so nothing the plugin writes is refused when it reads it back.
MAX_REPORT_BYTES = 1024 * 2**20
MAX_REPORT_ITEMS = 128_000_000
JSON_INT_LIMIT = 2**63
_INT_DIGITS = 19  # |int| < 2**63 has at most 19 digits


class JsonProblem(ValueError):
    """Why a text is not usable JSON, phrased to follow the file's name: ``is not JSON: ...``."""


# ------------------------------------------------------------------------------------------ writing


def _umask() -> int:
    """The process umask without changing it (``/proc``), else by the set-and-restore idiom."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike[str], text: str | bytes) -> None:
    """Write ``text`` (UTF-8, or bytes as they are) via a temporary file in the same folder and rename, so
    no reader sees half a file.

    The file gets the mode of the file it replaces, or ``0o666`` less the umask when it is new.
    """
    path = Path(path).expanduser()
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent.resolve()))
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(text.encode("utf-8") if isinstance(text, str) else text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def create_atomic(path: str | os.PathLike[str], text: str | bytes) -> None:
    """Write a NEW file as ``write_atomic`` does, but never replace one: ``FileExistsError`` when ``path``
    exists, even one created a moment ago by another process (the complete temporary file is hard-linked
    to its name, which fails on an existing name)."""
    path = Path(path).expanduser()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent.resolve()))
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(text.encode("utf-8") if isinstance(text, str) else text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.link(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ reading


def read_limited(path: str | os.PathLike[str], max_bytes: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes``.

    Raises ``OSError`` (``FileNotFoundError`` when absent) or ``JsonProblem`` (not a regular file,
    too large, not UTF-8). A FIFO or device never blocks: it is refused after ``fstat``.
    """
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(21, "Is a directory; give the path of a file")
        if not stat.S_ISREG(info.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) \
                else "a device"
            raise OSError(f"not a regular file ({kind}); give the path of a file")
        if info.st_size > max_bytes:
            raise OSError(f"{info.st_size} bytes, over the limit of {max_bytes} bytes")
        handle = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(f"over the limit of {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonProblem(f"is not JSON: it is not UTF-8 text ({exc.reason})") from None


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > _INT_DIGITS:
        raise JsonProblem(f"cannot be used: an integer of {digits} digits ({text[:12]}...) does not fit in 64 bits")
    value = int(text)
    if not -JSON_INT_LIMIT <= value < JSON_INT_LIMIT:
        raise JsonProblem(f"cannot be used: the integer {text} does not fit in 64 bits")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonProblem(f"cannot be used: the number {clip(text, 24)} is out of range (not a finite float)")
    return value


def _parse_constant(text: str) -> Any:
    raise JsonProblem(f"is not JSON: {text} is not a JSON value (strict JSON has no NaN or Infinity)")


def check_shape(value: Any, max_depth: int, max_items: int) -> None:
    """Depth and size of a parsed value, walked without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    items = 0
    while stack:
        current, depth = stack.pop()
        items += 1
        if items > max_items:
            raise JsonProblem(f"cannot be used: more than {max_items} values")
        if isinstance(current, (dict, list)):
            if depth > max_depth:
                raise JsonProblem(f"cannot be used: nested deeper than {max_depth} levels")
            children = current.values() if isinstance(current, dict) else current
            stack.extend((child, depth + 1) for child in children)


def parse_json(text: str, *, max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_JSON_ITEMS) -> Any:
    """Strict, bounded ``json.loads``; every problem is a ``JsonProblem`` (see the module docstring)."""
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except JsonProblem:
        raise
    except json.JSONDecodeError as exc:
        raise JsonProblem(f"is not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except RecursionError:  # the C scanner's own guard: far past any depth limit
        raise JsonProblem(f"cannot be used: nested deeper than {max_depth} levels") from None
    except (TypeError, ValueError) as exc:  # e.g. a lone surrogate escape
        raise JsonProblem(f"is not JSON: {exc}") from None
    check_shape(value, max_depth, max_items)
    return value


def read_json(path: str | os.PathLike[str], *, what: str = "the file", source: str | None = None,
              remedy: str | None = None, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH,
              max_items: int = MAX_JSON_ITEMS) -> Any:
    """Read a JSON file the plugin did not write; ``OptConfigError`` naming ``source``, ``what`` and the path.

    Messages: ``<source>: cannot read <what> '<path>': <why>; <remedy>`` and
    ``<source>: <what> '<path>' is not JSON: <why>; <remedy>`` (``cannot be used`` for a limit).
    """
    where = os.fspath(path)
    prefix = f"{source}: " if source else ""
    suffix = f"; {remedy}" if remedy else ""
    try:
        text = read_limited(where, max_bytes)
        return parse_json(text, max_depth=max_depth, max_items=max_items)
    except JsonProblem as exc:
        raise OptConfigError(f"{prefix}{what} {where!r} {exc}{suffix}") from None
    except OSError as exc:
        reason = exc.strerror if exc.strerror and exc.errno else str(exc)
        raise OptConfigError(f"{prefix}cannot read {what} {where!r}: {reason}{suffix}") from None


def check_writable(path: Path, source: str) -> None:
    """Fail at start-up, not after an hour of measuring, when a report cannot be written."""
    path = path.expanduser()  # every check below on the path that will be written, not on "~/..."
    parent = path.resolve().parent
    if path.is_dir():
        raise pytest.UsageError(f"{source}: {str(path)!r} is a folder; give a file path")
    if not parent.is_dir():
        raise pytest.UsageError(f"{source}: the folder {str(parent)!r} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise pytest.UsageError(f"{source}: the folder {str(parent)!r} is not writable")
