"""pytest-transformers-opt: make Hugging Face Transformers inference optimizations testable."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import OptConfigError, OptProofError, OptTechniqueConflict

if TYPE_CHECKING:
    from . import techniques
    from .engine.model import OptModel
    from .techniques import Technique, TechniqueSpec
    from .verdict.results import OptResult, SideMetrics, Workload
    from .verdict.similarity import Similarity

__version__ = "0.1.0"

__all__ = ["techniques", "Technique", "TechniqueSpec", "OptModel", "OptResult", "SideMetrics", "Similarity",
           "Workload", "OptConfigError", "OptProofError", "OptTechniqueConflict", "__version__"]

# public name -> the module that defines it, imported on first use: pytest imports this package for the
# plugin at every start-up, also in sessions that use none of it (item 36 of issue 19)
_LAZY = {"techniques": ".techniques", "Technique": ".techniques", "TechniqueSpec": ".techniques",
         "OptModel": ".engine.model", "OptResult": ".verdict.results", "SideMetrics": ".verdict.results",
         "Workload": ".verdict.results", "Similarity": ".verdict.similarity"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name], __name__)
    value = module if name == "techniques" else getattr(module, name)
    globals()[name] = value
    return value
