"""Errors the plugin raises for bad user input.

Each one carries a message that names what was wrong, where it came from and what is accepted,
so that the test it belongs to ends as that test's own error and the session runs on.
"""

from __future__ import annotations


class OptConfigError(ValueError):
    """A marker, budget, option or model argument that cannot be used as given."""


class OptTechniqueConflict(OptConfigError):
    """Two techniques that cannot be stacked, or one technique given twice."""


class OptProofError(AssertionError):
    """A technique was requested, the probes passed, but it did not take effect (a silent fallback)."""


class OptLoadError(RuntimeError):
    """Loading a configuration failed after its probes passed (out of memory, a broken checkpoint ...)."""
