"""Messages the libraries repeat on every step, kept once per session.

bitsandbytes' 8-bit matmul says ``MatMul8bitLt: inputs will be cast ...`` on every forward of every
quantized layer: 1,582 identical lines in one bnb_8bit test's captured log, 74,130 in a failing one,
burying its budget table (issue 19, items 34 and 38). transformers says that the old cache name
``past_key_values`` is deprecated wherever something still uses it. The first of each goes through, as
the library wrote it (logger, level, warning category and location); its repeats in the same session
are dropped. Any other message is left alone.

Logged records are filtered on the loggers that write them (a filter on the logger holds whatever
handlers pytest attaches later). Warnings raised inside the plugin's own generation are caught there and
raised again once (``said_once``), so warning filters, ``-W error`` included, still apply to the first.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator

# (logger that writes it, or "" for a warning; what the message starts with)
REPEATED = (
    ("bitsandbytes.autograd._functions", "MatMul8bitLt: inputs will be cast"),
    ("transformers.utils.generic", "`past_key_values`/`cache_params` are deprecated"),
    ("", "MatMul8bitLt: inputs will be cast"),  # bitsandbytes 0.48 warns instead of logging
    ("", "`past_key_values` is deprecated"),  # transformers' deprecate_kwarg (FutureWarning)
)

_said: set[tuple[str, str]] = set()  # (logger or warning category, message) said this session


def _repeating(source: str, message: str) -> bool:
    return any(message.startswith(start) for name, start in REPEATED if name == source or (name == "" and not source))


def first_time(source: str, message: str) -> bool:
    """True the first time this session that a repeating message is said (and for any other message)."""
    if not _repeating(source, message):
        return True
    key = (source, message)
    if key in _said:
        return False
    _said.add(key)
    return True


def new_session() -> None:
    """Forget what was said: each session shows each message once (pytester runs several in a process)."""
    _said.clear()


class _FirstOnly(logging.Filter):
    opt_first_only = True  # found by this name, not by class: a re-imported module has a new class

    def filter(self, record: logging.LogRecord) -> bool:
        return first_time(record.name, record.getMessage())


def install() -> None:
    """Filter the loggers that repeat. A filter left by an earlier import of this module (pytester drops
    the modules an in-process run imported; loggers live on) is replaced: it remembers another set."""
    for name in sorted({name for name, _ in REPEATED if name}):
        logger = logging.getLogger(name)
        for existing in [f for f in logger.filters if getattr(f, "opt_first_only", False)]:
            logger.removeFilter(existing)
        logger.addFilter(_FirstOnly())


@contextlib.contextmanager
def said_once() -> Iterator[None]:
    """Around the plugin's generation: warnings raised inside are raised again when it ends, the repeating
    ones only the first time in the session (outside any timed code: enter and leave outside the clock)."""
    with warnings.catch_warnings(record=True) as caught:
        yield
    for warning in caught:
        if first_time("", str(warning.message)):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno,
                                   source=warning.source)


install()
