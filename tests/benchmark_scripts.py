"""Scripts' pieces for the tests: benchmarks/, scripts/ and docs/hooks/ are not packages, so each script is loaded
from its file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_module_file(name: str, path: Path) -> ModuleType:
    """The script at ``path`` as the module ``name`` (once per process), leaving ``sys.path`` as it was.

    Scripts put the checkout first on ``sys.path`` so that they run without installing the package. Left there, every
    later in-process pytester run of this worker finds the checkout's ``*.egg-info`` as a second pytest11
    distribution and warns that the plugin "cannot be rewritten": two warnings in every outcome count (CI saw it)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def load_script(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` as a module (once per process)."""
    return load_module_file(name, ROOT / "benchmarks" / f"{name}.py")


ab_study = load_script("ab_study")
