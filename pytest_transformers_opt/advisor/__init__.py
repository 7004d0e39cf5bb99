"""The advisor: which inference optimization to try next for a workload, and how to validate it.

It implements the advice protocol of the Transformers page "Inference optimization overview":
find the stage where memory or speed breaks, recommend one change for that stage, report the
configuration, its documentation, tradeoffs, open compatibility questions and a validation test,
and keep estimates apart from measurements. It reads a model's config only (no weights, offline).
"""

from __future__ import annotations

from .advice import UNVERIFIED, Advice, Figure, ValidationPlan
from .change import Change, parse_technique
from .compat import compatibility_questions, flash_attention_capable
from .estimates import (attention_scratch_bytes, cache_estimate, count_params, eager_score_matrix_bytes,
                        estimate_peak_memory, kv_cache_bytes, peak_breakdown, stage_estimates, weight_bytes)
from .from_report import advise_from_report, load_report, validate_report
from .model_config import ModelShape, load_model_shape
from .recommend import advise
from .render import render_json, render_text, validation_test_source, write_test
from .workload import PROBLEMS, ServingScenario

__all__ = [
    "PROBLEMS", "UNVERIFIED", "Advice", "Change", "Figure", "ModelShape", "ServingScenario", "ValidationPlan",
    "advise", "advise_from_report", "attention_scratch_bytes", "cache_estimate", "compatibility_questions",
    "count_params", "eager_score_matrix_bytes", "estimate_peak_memory", "flash_attention_capable",
    "kv_cache_bytes", "load_model_shape", "load_report", "parse_technique", "peak_breakdown", "render_json",
    "render_text", "stage_estimates", "validate_report", "validation_test_source", "weight_bytes", "write_test",
]
