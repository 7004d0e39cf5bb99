"""Parsers and formatters for the human-friendly values budgets and options accept.

Every parser takes ``what`` (where the value came from, e.g. ``"budget max_memory"``) so that its
error names the value, its origin and the accepted forms.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeGuard

from .errors import OptConfigError

_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0}
_NUMBER_WITH_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$")

SIZE_FORMS = '"6 GiB", "800 MB", "512MiB" or an int number of bytes'
DURATION_FORMS = '"50 ms", "1.5 s", "200us" or a float number of seconds'
THROUGHPUT_FORMS = '800, 12.5 or "800 tok/s"'


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ``...`` marking the cut (a value quoted in a message)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` for a message, clipped to ``limit``; an int too long for ``repr`` (Python's digit
    limit) is named as one instead of raising."""
    try:
        text = repr(value)
    except ValueError:
        return f"<{type(value).__name__} too long to print>"
    return clip(text, limit)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _to_float(value: int | float) -> float:
    """A float from an int or float; an int too large for a float becomes infinity (then rejected)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def finite_number(value: object) -> float | None:
    """``value`` as a finite float; None when it is missing, not a number (a bool is not one), infinite, NaN,
    or an integer past any float: how a figure read from a report is taken."""
    if not _is_number(value):
        return None
    number = _to_float(value)
    return number if math.isfinite(number) else None


def _finite_positive(number: float, what: str, forms: str, raw: object) -> float:
    if not math.isfinite(number) or number <= 0:
        raise OptConfigError(f"{what}: {raw!r} must be a positive, finite value; accepted: {forms}")
    return number


def parse_size(value: object, what: str = "size") -> int:
    """Bytes from ``"6 GiB"``, ``"800 MB"`` or an int; decimal (GB) and binary (GiB) units."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise OptConfigError(f"{what}: {value!r} must be a positive, finite value; accepted: {SIZE_FORMS}")
        return value
    if _is_number(value):
        return _whole_bytes(_finite_positive(_to_float(value), what, SIZE_FORMS, value), 1, what, value)
    if isinstance(value, str):
        match = _NUMBER_WITH_UNIT.match(value)
        if match:
            unit = match.group(2).lower() or "b"
            if unit in _SIZE_UNITS:
                number = _finite_positive(float(match.group(1)), what, SIZE_FORMS, value)
                return _whole_bytes(number, _SIZE_UNITS[unit], what, value)
    raise OptConfigError(f"{what}: cannot read {value!r} as a memory size; accepted: {SIZE_FORMS}")


def _whole_bytes(number: float, factor: int, what: str, raw: object) -> int:
    size = number * factor
    if not math.isfinite(size) or size < 1:
        raise OptConfigError(f"{what}: {raw!r} must be at least 1 byte and finite; accepted: {SIZE_FORMS}")
    return int(size)


def parse_duration(value: object, what: str = "duration") -> float:
    """Seconds from ``"50 ms"``, ``"1.5 s"`` or a float of seconds."""
    if _is_number(value):
        return _finite_positive(_to_float(value), what, DURATION_FORMS, value)
    if isinstance(value, str):
        match = _NUMBER_WITH_UNIT.match(value)
        if match:
            unit = match.group(2).lower() or "s"
            if unit in _TIME_UNITS:
                number = _finite_positive(float(match.group(1)), what, DURATION_FORMS, value)
                return _finite_positive(number * _TIME_UNITS[unit], what, DURATION_FORMS, value)
    raise OptConfigError(f"{what}: cannot read {value!r} as a duration; accepted: {DURATION_FORMS}")


def parse_throughput(value: object, what: str = "throughput") -> float:
    """Tokens per second from ``800`` or ``"800 tok/s"``."""
    if _is_number(value):
        return _finite_positive(_to_float(value), what, THROUGHPUT_FORMS, value)
    if isinstance(value, str):
        match = _NUMBER_WITH_UNIT.match(value)
        if match and match.group(2).lower() in ("", "tok/s", "tokens/s", "t/s"):
            return _finite_positive(float(match.group(1)), what, THROUGHPUT_FORMS, value)
    raise OptConfigError(f"{what}: cannot read {value!r} as a throughput; accepted: {THROUGHPUT_FORMS}")


def parse_fraction(value: object, what: str = "fraction") -> float:
    """A number in [0, 1]."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if _is_number(value) and math.isfinite(_to_float(value)) and 0.0 <= _to_float(value) <= 1.0:
        return _to_float(value)
    raise OptConfigError(f"{what}: {value!r} must be a number from 0 to 1, e.g. 0.95")


def parse_positive_float(value: object, what: str = "value", *, allow_zero: bool = False) -> float:
    """A finite float > 0 (or >= 0 with ``allow_zero``), from a number or a numeric string."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if _is_number(value) and math.isfinite(_to_float(value)):
        number = _to_float(value)
        if number > 0 or (allow_zero and number == 0):
            return number
    bound = ">= 0" if allow_zero else "> 0"
    raise OptConfigError(f"{what}: {value!r} must be a finite number {bound}, e.g. 1.2")


def parse_non_negative_int(value: object, what: str = "value", *, minimum: int = 0, maximum: int | None = None) -> int:
    """An int >= ``minimum`` (and <= ``maximum`` when given) from an int or a string of digits (not a bool, not a float)."""
    accepted = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
        digits = value.strip()
        if len(digits) > 30:  # past any bound; int() of thousands of digits raises ValueError
            raise OptConfigError(f"{what}: a number of {len(digits)} digits must be a whole number {accepted}")
        value = int(digits)
    if (isinstance(value, int) and not isinstance(value, bool) and value >= minimum
            and (maximum is None or value <= maximum)):
        return value
    if isinstance(value, int) and abs(value) >= 10**30:  # repr() of a 5000-digit int raises ValueError
        quoted = "a number of more than 30 digits"
    else:
        quoted = shown(value, 40)
    raise OptConfigError(f"{what}: {quoted} must be a whole number {accepted}")


def format_bytes(num: float | None) -> str:
    """``1.50 GiB``-style text; ``-`` for a missing figure."""
    if num is None or not math.isfinite(num):
        return "-"
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num) >= factor:
            return f"{num / factor:.2f} {unit}"
    return f"{int(num)} B"


def format_duration(seconds: float | None) -> str:
    """``12.3 ms``-style text; ``-`` for a missing figure."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def format_ratio(value: object) -> str:
    """A speedup or memory ratio, ``1.23x``, as the reports, the comparison and the advisor show it. ``-``
    for a missing figure (or anything not a number), ``NaN`` / ``inf`` as such (a NaN never passes a
    budget, so it must not look like a gap)."""
    if not _is_number(value):
        return "-"
    number = _to_float(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    return f"{number:.2f}x"


# ---------------------------------------------------------------- dtypes (torch imported on use)
DTYPE_NAMES = ("float32", "bfloat16", "float16", "auto")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def parse_dtype(value: Any, what: str = "dtype") -> Any:
    """A ``torch.dtype`` from a name (``"bfloat16"``, ``"bf16"``) or a dtype; ``"auto"`` stays a string."""
    import torch

    if isinstance(value, torch.dtype) and dtype_name(value) in DTYPE_NAMES:
        return value
    if isinstance(value, str):
        name = _DTYPE_ALIASES.get(value.lower().removeprefix("torch."), value.lower().removeprefix("torch."))
        if name == "auto":
            return "auto"
        if name in DTYPE_NAMES:
            return getattr(torch, name)
    raise OptConfigError(f"{what}: {value!r} is not a dtype; accepted: {', '.join(DTYPE_NAMES)} (or torch.bfloat16 ...)")


def dtype_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


# ---------------------------------------------------------------- a test's failure as one line
ERROR_CHARS = 100_000  # what the JSON keeps of a test's error: a compiler's output runs to tens of KiB
REASON_CHARS = 200  # the one-line reason every renderer shows

# a frame or location line of a traceback: `File "x.py", line 3, in f`, pytest's `x.py:3: RuntimeError`
_FRAME = re.compile(r'^(?:File "[^"]*", line \d+|\S+:\d+: \w[\w.]*$)')
_TRACEBACK = re.compile(r"^(?:Traceback \(most recent call last\):|During handling of the above exception|"
                        r"The above exception was the direct cause|\^[\^~ ]*$|[~^ ]+$)")
_PATH_ONLY = re.compile(r"^['\"]?(?:[A-Za-z]:)?[\w.~-]*[/\\]\S*$")  # a path alone on its line (no spaces)
# a compiler's diagnostic (`x.cpp:5:10: fatal error: omp.h: ...`): the line that names what broke
_DIAGNOSTIC = re.compile(r"^(?:\S+?:\d+(?::\d+)?:\s*)?((?:fatal )?error:\s*\S.*)$")
_TYPE_PREFIX = re.compile(r"^([A-Za-z_][\w.]*)(?::\s+|:?$)")  # `pkg.mod.ValueError: ...` at a line's start
_ERROR_NAME = re.compile(r"(?:Error|Exception|Failed|Failure|Interrupt|Exit|Timeout)$")


# what names the offending value in a message: the part after "found:" (the plugin's own reasons), or a
# bracketed or quoted value ({'sliding_attention'}, [3, 4], 'x', `y`); an apostrophe inside a word is not a quote
_VALUE = re.compile(r"\bfound:|\{[^{}]*\}|\[[^\[\]]*\]|(?<!\w)'[^'\n]*'(?!\w)|(?<!\w)\"[^\"\n]*\"(?!\w)|`[^`\n]*`")
_TAIL_SHARE = 0.6  # at most this share of a cut line goes to the kept value and the words that lead to it
_TAIL_LEAD_CHARS = 24  # words kept before a value so it says what it is ("invalid layer types: {...}")


def _cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters on a word boundary with an ellipsis, never inside a path."""
    if len(text) <= limit:
        return text
    space = text[: limit - 1].rfind(" ")
    head = text[:space] if space > 0 else ""
    token, _, after = text[space + 1:].partition(" ")
    if "/" in token or "\\" in token:  # the path the cut would split: its last part says which file
        short = f"{head} …/{token.replace(chr(92), '/').rstrip('/').rsplit('/', 1)[-1]}".strip()
        short += " …" if after else ""
        if len(short) <= limit:
            return short
    if len(head) < limit // 2:  # one long word (not a path): better cut than lost
        return text[: limit - 1] + "…"
    return head.rstrip(" ,;:") + "…"


def shorten(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters: cut on a word boundary (never inside a path), and when the cut
    would drop the words that name the offending value (``found: ...``, a quoted or bracketed value), the
    middle goes instead: ``... only full attention layers. … invalid layer types: {'sliding_attention'}``."""
    if len(text) <= limit:
        return text
    # the value a message ends on names what is wrong (a wrapper's own values come first); "found:" says so outright
    values = [m for m in _VALUE.finditer(text) if m.end() > limit - 1]
    lost = next((m for m in values if m[0] == "found:"), values[-1] if values else None)
    if lost is None:
        return _cut(text, limit)
    start = lost.start()
    if lost[0] != "found:":  # lead in from the clause that introduces the value, a few words at most
        clause = max((text.rfind(mark, 0, start) + len(mark) for mark in (". ", "; ") if mark in text[:start]),
                     default=0)
        if start - clause > _TAIL_LEAD_CHARS:
            lead = text.find(" ", start - _TAIL_LEAD_CHARS - 1, start)
            clause = lead + 1 if lead >= 0 else start
        start = clause
    tail = _cut(text[start:], int(limit * _TAIL_SHARE))
    room = limit - len(tail) - 1
    if room < limit // 4:  # no room left for what the message is about: the plain cut
        return _cut(text, limit)
    return f"{_cut(text[:start].rstrip(), room)} {tail}"  # the head's ellipsis marks the words left out


def failure_reason(error: str | None, limit: int = REASON_CHARS) -> str:
    """A failed or errored test's error as one readable line: the exception type and its first meaningful
    message line (no traceback frames, no path alone on its line; a compiler's ``error:`` line when there
    is one), at most ``limit`` characters. The report's JSON keeps the full ``error``."""
    lines, after_frame = [], False
    for raw in str(error or "").splitlines():
        line = re.sub(r"^E\s{2,}", "", raw).strip()
        source = after_frame and raw[:1].isspace()  # the source line a traceback prints under its frame
        after_frame = bool(_FRAME.match(line))
        if line and not after_frame and not source and not _TRACEBACK.match(line):
            lines.append(line)
    if not lines:
        return "no message recorded"
    kind, message, path = None, None, None
    if lines[0].startswith("assert "):  # pytest drops the type of a rewritten bare assert
        kind = "AssertionError"
    for n, line in enumerate(lines):
        rest = line
        while (match := _TYPE_PREFIX.match(rest)) and (n == 0 and kind is None or _ERROR_NAME.search(match[1])):
            kind, rest = match[1].rsplit(".", 1)[-1], rest[match.end():]
        if _PATH_ONLY.match(rest):
            path = path or rest  # said only when nothing else is
        # an empty rest, an introduction ("backend='inductor' raised:", "Command:") or a bare path says nothing
        elif rest and not rest.endswith(":"):
            message = rest
            break
    message = message or path
    diagnostic = next((m[1] for line in lines if (m := _DIAGNOSTIC.match(line))), None)
    message = diagnostic or message
    text = f"{kind}: {message}" if kind and message else kind or message or lines[0]
    return shorten(" ".join(text.split()), limit)
