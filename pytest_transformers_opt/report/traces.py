"""--opt-trace: the census call's Chrome trace of each test, kept in the session's folder until the report is
written, then moved next to the JSON report for the tests asked for (all, or the ones the gate flagged)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..session import OptSession

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def trace_file_for(session: "OptSession", nodeid: str) -> str:
    """A file in the session's trace folder (made on first use) for ``nodeid``'s census trace."""
    folder = getattr(session, "trace_folder", None)
    if folder is None:
        folder = tempfile.mkdtemp(prefix="pytest-opt-traces-")
        session.trace_folder = folder
    name = _UNSAFE.sub("_", nodeid).strip("_")[:150] or "test"
    return str(Path(folder) / f"{name}.trace.json")
