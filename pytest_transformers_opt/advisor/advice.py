"""The advisor's answer: one recommended change and everything the protocol says to report with it.

Figures carry their kind (estimate, measured, stated, probed) so that text, JSON and the
plugin's summary can never present an estimate as a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..units import format_bytes, format_duration, format_ratio
from .change import Change

UNVERIFIED = "Fit and performance remain unverified: this workload has not been run."
KINDS = ("estimate", "measured", "stated", "probed")


@dataclass(frozen=True)
class Figure:
    """One number with its unit and where it comes from."""

    label: str
    value: float | int | None
    kind: str  # one of KINDS
    unit: str = "bytes"  # bytes, s, x, tok/s, ratio, tokens, count
    where: str = ""  # the hardware a measurement was taken on

    def value_text(self) -> str:
        if self.value is None:
            return "-"
        if self.unit == "bytes":
            return format_bytes(self.value)
        if self.unit == "s":
            return format_duration(self.value)
        if self.unit == "x":
            return format_ratio(self.value)
        if self.unit == "tok/s":
            return f"{self.value:.1f} tok/s"
        if self.unit == "count":
            return f"{int(self.value):,}"
        if self.unit == "tokens":
            return f"{int(self.value)} tokens"
        return f"{self.value:.4g}"

    def text(self) -> str:
        where = f" on {self.where}" if self.where and self.kind == "measured" else ""
        return f"{self.label}: {self.value_text()} ({self.kind}{where})"

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "value": self.value, "unit": self.unit, "kind": self.kind,
                "where": self.where or None}


@dataclass(frozen=True)
class ValidationPlan:
    """What the validation test runs: the model and a workload scaled to stay practical."""

    model: str
    revision: str | None
    dtype: str
    input_tokens: int
    max_new_tokens: int
    batch_size: int
    num_prompts: int
    baseline: list[Change] = field(default_factory=list)  # empty: the plugin's default baseline
    notes: tuple[str, ...] = ()


@dataclass
class Advice:
    """One recommendation with its configuration, support, tradeoffs, open questions and validation."""

    title: str  # the recommended change in words, or why none is needed
    change: Change | None  # the one change; None when no change is proposed
    configuration: list[Change]  # the whole stack to test (previous techniques + the change)
    budgets: dict[str, Any]
    stage: str | None  # the stage that breaks first (or the goal: speed)
    why: list[str]
    figures: list[Figure]  # estimates, stated and probed figures
    measured: list[Figure] = field(default_factory=list)  # from an earlier run's report
    documentation: list[str] = field(default_factory=list)  # each "Title <https://...>" (docs.cite)
    tradeoffs: list[str] = field(default_factory=list)
    workload_tradeoffs: list[str] = field(default_factory=list)
    open_questions: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    test: ValidationPlan | None = None
    measured_source: str | None = None  # the report the measurements come from
    measured_covers_change: bool = False  # True only if the proposed configuration itself was measured

    @property
    def verified(self) -> bool:
        return self.measured_covers_change

    def marker_line(self) -> str:
        """``@pytest.mark.optimization("bnb_4bit", max_memory="20 GiB", max_kl=0.1)``."""
        args = [change.marker_arg() for change in self.configuration]
        args += [f"{key}={_literal(value)}" for key, value in self.budgets.items()]
        return f"@pytest.mark.optimization({', '.join(args)})"

    def verification_line(self) -> str:
        if self.verified:
            return "Fit and performance of this configuration were measured (see Measured)."
        if self.measured and self.change is not None:
            return ("The proposed change has not been run yet: its fit and performance remain unverified "
                    "until the validation test passes.")
        return UNVERIFIED

    def summary_lines(self) -> list[str]:
        """At most 6 short lines for the end of ``pytest --opt-report``."""
        lines = [f"Next: {self.title}" if self.change is not None else self.title]
        if self.why:
            lines.append(f"Why: {self.why[0]}")
        if self.configuration:
            lines.append(f"Configuration: {self.marker_line()}")
        if self.documentation:
            lines.append(f"Supported by: {self.documentation[0]}")
        if self.change is not None:
            lines.append("Validate: pytest-opt advise --from-report REPORT.json --write-test test_next.py; "
                         "pytest test_next.py --opt-report")
        lines.append(self.verification_line())
        return lines[:6]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "pytest-transformers-opt/advice",
            "schema_version": 1,
            "recommended_change": self.title,
            "change": self.change.label() if self.change else None,
            "configuration": [change.label() for change in self.configuration],
            "marker": self.marker_line() if self.configuration else None,
            "budgets": dict(self.budgets),
            "stage": self.stage,
            "why": list(self.why),
            "estimates": [f.to_dict() for f in self.figures],
            "measured": [f.to_dict() for f in self.measured],
            "measured_source": self.measured_source,
            "supported_by": list(self.documentation),
            "expected_tradeoffs": list(self.tradeoffs),
            "workload_tradeoffs": list(self.workload_tradeoffs),
            "open_compatibility_questions": list(self.open_questions),
            "assumptions": list(self.assumptions),
            "validation": None if self.test is None else {
                "model": self.test.model, "revision": self.test.revision, "dtype": self.test.dtype,
                "input_tokens": self.test.input_tokens, "max_new_tokens": self.test.max_new_tokens,
                "batch_size": self.test.batch_size, "num_prompts": self.test.num_prompts,
                "baseline": [change.label() for change in self.test.baseline],
                "command": "pytest PATH --opt-report",
            },
            "verified": self.verified,
            "verification": self.verification_line(),
        }


def _literal(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)
