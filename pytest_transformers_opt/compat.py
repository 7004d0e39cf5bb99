"""The one place that asks the libraries we sit on what they offer: installed versions, importable
modules, and every access to a private attribute of transformers or torch (a name that may change in
any release, so each is reached through one function here, with the fallback it needs)."""

from __future__ import annotations

import importlib.metadata
import importlib.util


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def module_available(module: str) -> bool:
    """True when ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
