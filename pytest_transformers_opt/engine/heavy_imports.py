"""torch and transformers, imported once per process and never cut off halfway.

torch cannot be imported twice in a process: an import cut off midway (pytest-timeout's alarm in the
first test's setup, a Ctrl-C) leaves a half-initialised torch behind, every later use fails with
"partially initialized module 'torch'" and the interpreter may crash at exit, report unwritten. So the
session imports the stack before the first test's timer starts when a collected test uses the plugin's
fixtures, and every import of it holds SIGALRM and SIGINT back: a timeout or Ctrl-C that arrives
meanwhile takes effect the moment the import is done, failing the test it was meant for (or ending the
session) with torch whole.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

HELD_SIGNALS = ("SIGALRM", "SIGINT")  # timers (pytest-timeout's signal method) and Ctrl-C
_imported = False


@contextmanager
def signals_held() -> Iterator[None]:
    """Run the block with SIGALRM and SIGINT recorded instead of handled; once it ends, the handlers
    are back and each signal that arrived is raised again, so its handler runs as it would have."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
        yield
        return
    arrived: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        arrived.append(signum)

    previous: dict[int, Any] = {}
    for name in HELD_SIGNALS:
        signum = getattr(signal, name, None)
        # None: a handler installed outside Python, which could not be put back
        if signum is not None and signal.getsignal(signum) is not None:
            previous[signum] = signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)


def import_stack() -> None:
    """Import torch and transformers (with its auto classes, imported lazily on first use) whole."""
    global _imported
    if _imported:
        return
    with signals_held():
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401
        # its logging filters must hold before any model loads (bitsandbytes logs on its first 4-bit op)
        from . import generation  # noqa: F401

        _imported = True  # before the held signals are raised again: the import itself is complete
