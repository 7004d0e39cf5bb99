"""pytest-transformers-opt: make Hugging Face Transformers inference optimizations testable."""

from __future__ import annotations

from . import techniques
from .errors import OptConfigError, OptProofError, OptTechniqueConflict
from .engine.model import OptModel
from .verdict.results import OptResult, SideMetrics, Workload
from .verdict.similarity import Similarity
from .techniques import Technique, TechniqueSpec

__version__ = "0.1.0"

__all__ = ["techniques", "Technique", "TechniqueSpec", "OptModel", "OptResult", "SideMetrics", "Similarity",
           "Workload", "OptConfigError", "OptProofError", "OptTechniqueConflict", "__version__"]
