"""The report as one self-contained HTML page (``--opt-report-html``).

Nothing is fetched when the page is viewed: the CSS (``report.css``, package data) is inlined, the
charts are inline SVG drawn here, and there is no script, font or image from anywhere else. Every
piece of text from the report goes through :func:`html.escape`.

Charts, each readable at a glance:

- speedup per test, horizontal bars with a line at 1.0x (as fast as the baseline), the 95% interval
  as a whisker and a tick at the test's ``min_speedup`` budget; coloured only where the interval
  excludes 1.0 (faster or slower), neutral where it does not or the report has no interval;
- peak memory, baseline and optimized as paired bars, with the ratio and any ``max_memory`` tick;
- KL divergence per test on a log scale, with the ``max_kl`` budget tick;
- agreement with the baseline (top-1 and token match), with the ``min_top1`` and
  ``min_token_match`` ticks.

Under them: the failed budgets, the results table (the cells of :mod:`.view`, as in the Markdown report; a timed
verdict's census cause under the verdict), each test's execution census, the
A/B against a reference environment (``--opt-ab``),
estimated figures apart, the skipped techniques grouped by reason, and the environment.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Protocol

from ..units import finite_number, format_ratio
from ..verdict.judge import INCONCLUSIVE, REGRESSED
from ..verdict.results import FASTER, SLOWER
from ..verdict.stats import MIN_BOOTSTRAP_SAMPLES
from . import view
from .ab import census_text
from .history import History, Trend, TrendPoint, trends

OK_COLOR = "#2e8b57"
FAIL_COLOR = "#d64541"
WARN_COLOR = "#e09b2d"
BASE_COLOR = "#9aa5b1"
OPT_COLOR = "#3b6fd8"
ALT_COLOR = "#8a5cc4"
NEUTRAL_COLOR = "#b4bcc5"  # a ratio whose interval holds 1.0 (or has none): no difference to colour
WHISKER_COLOR = "#1f2933"

_WIDTH = 680
_LABEL_W = 220
_VALUE_W = 112
_PLOT_X = _LABEL_W
_PLOT_W = _WIDTH - _LABEL_W - _VALUE_W
_TOP = 44
_BOTTOM = 30
_LABEL_CHARS = 32


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


# --------------------------------------------------------------------------- chart model


@dataclass
class Bar:
    """One bar; ``value`` None draws no bar (the ``text`` still says why)."""

    value: float | None
    text: str
    color: str
    series: str = ""
    marker: float | None = None
    marker_label: str = ""
    interval: tuple[float, float] | None = None  # a 95% interval, drawn as a whisker across the bar's end


@dataclass
class Row:
    label: str
    title: str
    bars: list[Bar] = field(default_factory=list)


@dataclass
class RefLine:
    value: float
    label: str


class LinearScale:
    def __init__(self, lo: float, hi: float, fmt: Callable[[float], str]) -> None:
        self.lo, self.hi, self.fmt = lo, hi if hi > lo else lo + 1.0, fmt

    def pos(self, value: float) -> float:
        return min(1.0, max(0.0, (value - self.lo) / (self.hi - self.lo)))

    def step(self) -> float:
        """A round tick step giving about five ticks: 1, 2, 2.5 or 5 times a power of ten."""
        raw = (self.hi - self.lo) / 5
        magnitude = 10.0 ** math.floor(math.log10(raw))
        return next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)

    def ticks(self) -> list[float]:
        step = self.step()
        first = math.ceil(self.lo / step - 1e-9) * step
        count = int((self.hi - first) / step + 1e-9) + 1
        ticks = [first + i * step for i in range(count)]
        if ticks[0] - self.lo > step / 2 + 1e-9:  # label the left edge when the axis does not start at a tick
            ticks.insert(0, self.lo)
        return ticks


class LogScale:
    def __init__(self, lo: float, hi: float, fmt: Callable[[float], str]) -> None:
        self.lo_exp = math.floor(math.log10(lo))
        self.hi_exp = max(math.ceil(math.log10(hi)), self.lo_exp + 1)
        self.fmt = fmt

    def pos(self, value: float) -> float:
        if value <= 0:
            return 0.0
        return min(1.0, max(0.0, (math.log10(value) - self.lo_exp) / (self.hi_exp - self.lo_exp)))

    def ticks(self) -> list[float]:
        span = self.hi_exp - self.lo_exp
        step = 1 if span <= 6 else 2
        return [10.0**e for e in range(self.lo_exp, self.hi_exp + 1, step)]


class Scale(Protocol):
    """Where a value falls on the plot (0..1), the values to label, and how to label them."""

    fmt: Callable[[float], str]

    def pos(self, value: float) -> float: ...

    def ticks(self) -> list[float]: ...


def _x(scale: Scale, value: float) -> float:
    return _PLOT_X + scale.pos(value) * _PLOT_W


def _short_label(nodeid: str) -> str:
    label = nodeid.split("::", 1)[1] if "::" in nodeid else nodeid
    return label if len(label) <= _LABEL_CHARS else label[: _LABEL_CHARS - 1] + "…"


def _svg_chart(
    chart_id: str,
    title: str,
    rows: Sequence[Row],
    scale: Scale | None,
    *,
    legend: Sequence[tuple[str, str]] = (),
    ref_lines: Sequence[RefLine] = (),
    empty: str = "No measured figures for this chart.",
    axis_note: str = "",
) -> str:
    """An inline SVG of horizontal bars: one group per row, one bar per series."""
    if not rows or scale is None:
        return (
            f'<svg class="chart-svg" viewBox="0 0 {_WIDTH} 60" width="{_WIDTH}" height="60" role="img" '
            f'aria-label="{_e(title)}: no data"><text x="{_WIDTH / 2}" y="34" text-anchor="middle" '
            f'class="empty">{_e(empty)}</text></svg>'
        )
    bars_per_row = max(len(row.bars) for row in rows)
    bar_h = 16 if bars_per_row == 1 else 12
    gap = 2
    row_h = bars_per_row * bar_h + (bars_per_row - 1) * gap + 12
    height = _TOP + row_h * len(rows) + _BOTTOM
    plot_bottom = _TOP + row_h * len(rows)
    parts = [
        f'<svg class="chart-svg" id="{_e(chart_id)}" viewBox="0 0 {_WIDTH} {height}" width="{_WIDTH}" '
        f'height="{height}" role="img" aria-label="{_e(title)}">',
        f"<title>{_e(title)}</title>",
    ]
    # legend, top left of the plot
    x: float = _PLOT_X
    for label, color in legend:
        if color == "marker":
            parts.append(f'<line x1="{x + 5}" y1="8" x2="{x + 5}" y2="22" class="marker"/>')
        else:
            parts.append(f'<rect x="{x}" y="9" width="11" height="11" rx="2" fill="{_e(color)}"/>')
        parts.append(f'<text x="{x + 16}" y="19" class="legend">{_e(label)}</text>')
        x += 26 + 6.4 * len(label)
    # grid and axis
    for tick in scale.ticks():
        tx = _x(scale, tick)
        parts.append(f'<line x1="{tx:.1f}" y1="{_TOP - 4}" x2="{tx:.1f}" y2="{plot_bottom}" class="grid"/>')
        parts.append(f'<text x="{tx:.1f}" y="{plot_bottom + 16}" text-anchor="middle" class="tick">'
                     f"{_e(scale.fmt(tick))}</text>")
    parts.append(f'<line x1="{_PLOT_X}" y1="{_TOP - 4}" x2="{_PLOT_X}" y2="{plot_bottom}" class="axis"/>')
    if axis_note:
        parts.append(f'<text x="{_WIDTH - 4}" y="{plot_bottom + 16}" text-anchor="end" class="tick axis-note">'
                     f"{_e(axis_note)}</text>")
    # rows
    for index, row in enumerate(rows):
        y0 = _TOP + index * row_h + 6
        centre = y0 + (row_h - 12) / 2
        parts.append(f'<g class="row"><title>{_e(row.title)}</title>')
        parts.append(f'<text x="{_LABEL_W - 8}" y="{centre + 4:.1f}" text-anchor="end" class="label">'
                     f"{_e(row.label)}</text>")
        for b, bar in enumerate(row.bars):
            by = y0 + b * (bar_h + gap)
            end: float = _PLOT_X
            if bar.value is not None:
                end = _x(scale, bar.value)
                width = max(end - _PLOT_X, 1.5)
                tip = f"{bar.series}: {bar.text}" if bar.series else bar.text
                parts.append(f'<rect x="{_PLOT_X}" y="{by}" width="{width:.1f}" height="{bar_h}" rx="2" '
                             f'fill="{_e(bar.color)}"><title>{_e(tip)}</title></rect>')
                end = _PLOT_X + width
            if bar.interval is not None:
                low, high = _x(scale, bar.interval[0]), _x(scale, bar.interval[1])
                mid = by + bar_h / 2
                parts.append(f'<g class="whisker" stroke="{WHISKER_COLOR}" stroke-width="1.5"><title>'
                             f'95% interval {_e(view.format_ratio_interval(bar.interval))}</title>'
                             f'<line x1="{low:.1f}" y1="{mid:.1f}" x2="{high:.1f}" y2="{mid:.1f}"/>'
                             f'<line x1="{low:.1f}" y1="{by + 2}" x2="{low:.1f}" y2="{by + bar_h - 2}"/>'
                             f'<line x1="{high:.1f}" y1="{by + 2}" x2="{high:.1f}" y2="{by + bar_h - 2}"/></g>')
                end = max(end, high)
            text_x = end + 5
            if bar.marker is not None:
                mx = _x(scale, bar.marker)
                parts.append(f'<line x1="{mx:.1f}" y1="{by - 3}" x2="{mx:.1f}" y2="{by + bar_h + 3}" '
                             f'class="marker"><title>{_e(bar.marker_label)}</title></line>')
                if text_x - 4 <= mx <= text_x + 6.5 * len(bar.text):  # keep the figure clear of the tick
                    text_x = mx + 6
            parts.append(f'<text x="{text_x:.1f}" y="{by + bar_h - 3}" class="value">{_e(bar.text)}</text>')
        parts.append("</g>")
    for ref in ref_lines:
        rx = _x(scale, ref.value)
        parts.append(f'<line x1="{rx:.1f}" y1="{_TOP - 8}" x2="{rx:.1f}" y2="{plot_bottom}" class="ref"/>')
        parts.append(f'<text x="{rx + 4:.1f}" y="{_TOP - 10}" class="ref-label">{_e(ref.label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


# --------------------------------------------------------------------------- the four charts


def _measured_tests(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [test for test, _row in view.table_rows(report) if test.get("outcome") != "skipped"]


def _budget(test: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    for budget in test.get("budgets") or []:
        if isinstance(budget, dict) and budget.get("name") == name:
            return budget
    return None


def _limit(test: Mapping[str, Any], name: str) -> float | None:
    budget = _budget(test, name)
    return finite_number(budget.get("limit")) if budget else None


def _failed(test: Mapping[str, Any], name: str) -> bool:
    return name in view.failed_budget_names(test)


def _nice_max(values: Iterable[float], floor: float) -> float:
    top = max([floor, *values])
    return top * 1.12


def speedup_chart(report: Mapping[str, Any]) -> str:
    rows = []
    for test in _measured_tests(report):
        raw = test.get("speedup")
        if raw is None:
            continue
        value = finite_number(raw)
        limit = _limit(test, "min_speedup")
        verdict = test.get("speedup_verdict")
        if value is None or _failed(test, "min_speedup"):
            color = FAIL_COLOR
        else:  # only a difference the interval shows is coloured
            color = OK_COLOR if verdict == FASTER else WARN_COLOR if verdict == SLOWER else NEUTRAL_COLOR
        interval = view.interval_bounds(test.get("speedup_interval"))
        bar_text = " ".join(filter(None, (format_ratio(raw), view.format_ratio_interval(interval))))
        rows.append(Row(_short_label(str(test["nodeid"])),
                        f"{test['nodeid']}: speedup {view.format_ratio_verdict(test, 'speedup')}", [Bar(
            value, bar_text, color, "speedup", limit, f"min_speedup {format_ratio(limit)}" if limit is not None else "",
            interval)]))
    values = [v for row in rows for bar in row.bars for v in (bar.value, bar.marker, *(bar.interval or ()))
              if v is not None]
    scale = LinearScale(0.0, _nice_max(values, 1.0), lambda v: f"{v:g}x") if rows else None
    return _svg_chart(
        "chart-speedup", "Speedup per test", rows, scale,
        legend=[("faster", OK_COLOR), ("slower", WARN_COLOR), ("not significant", NEUTRAL_COLOR),
                ("budget failed", FAIL_COLOR), ("min_speedup", "marker")],
        ref_lines=[RefLine(1.0, "1.0x = baseline")],
    )


def memory_chart(report: Mapping[str, Any]) -> str:
    rows = []
    for test in _measured_tests(report):
        base = view.side_figure(test, "baseline", "peak_memory_bytes")
        opt = view.side_figure(test, "optimized", "peak_memory_bytes")
        if base is None and opt is None:
            continue
        limit = _limit(test, "max_memory")
        over = _failed(test, "max_memory") or _failed(test, "max_memory_ratio")
        ratio = test.get("memory_ratio")
        opt_text = view.format_memory(opt)
        if ratio is not None:
            opt_text += f" ({format_ratio(ratio)})"
        rows.append(Row(_short_label(str(test["nodeid"])), str(test["nodeid"]), [
            Bar(finite_number(base), view.format_memory(base), BASE_COLOR, "baseline peak memory"),
            Bar(finite_number(opt), opt_text, FAIL_COLOR if over else OPT_COLOR, "optimized peak memory",
                limit, f"max_memory {view.format_memory(limit)}" if limit is not None else ""),
        ]))
    values = [v for row in rows for bar in row.bars for v in (bar.value, bar.marker) if v is not None and v > 0]
    scale: Scale | None = None
    note = ""
    if rows:
        # A log axis when the figures span more than 50x (one huge figure would flatten the rest);
        # bars in the unit of the largest figure (linear) or of the smallest (log), so the axis
        # reads "0 GiB, 2 GiB, 4 GiB" or "1 MiB, 10 MiB, 100 MiB".
        top, bottom = max(values, default=1.0), min(values, default=1.0)
        log = top / bottom > 50
        unit, factor = next(((u, f) for u, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                             if (bottom if log else top) >= f), ("B", 1))
        for row in rows:
            for bar in row.bars:
                bar.value = None if bar.value is None else bar.value / factor
                bar.marker = None if bar.marker is None else bar.marker / factor
        if log:
            scale = LogScale(bottom / factor, top / factor, lambda v: f"{v:g} {unit}")
            note = "log scale"
        else:
            scale = LinearScale(0.0, _nice_max([v / factor for v in values], 1e-9), lambda v: f"{v:g} {unit}")
    return _svg_chart(
        "chart-memory", "Peak memory, baseline vs optimized", rows, scale,
        legend=[("baseline", BASE_COLOR), ("optimized", OPT_COLOR), ("over budget", FAIL_COLOR),
                ("max_memory", "marker")],
        axis_note=note,
    )


def kl_chart(report: Mapping[str, Any]) -> str:
    rows = []
    for test in _measured_tests(report):
        raw = view.similarity_figure(test, "kl_mean")
        limit = _limit(test, "max_kl")
        if raw is None and limit is None:
            continue
        value = finite_number(raw)
        over = _failed(test, "max_kl") or value is None or (limit is not None and value > limit)
        rows.append(Row(_short_label(str(test["nodeid"])), str(test["nodeid"]), [Bar(
            value, view.format_kl(raw), FAIL_COLOR if over else OPT_COLOR, "KL mean",
            limit, f"max_kl {view.format_kl(limit)}" if limit is not None else "")]))
    positive = [v for row in rows for bar in row.bars for v in (bar.value, bar.marker) if v is not None and v > 0]
    scale = None
    if rows:
        lo, hi = (min(positive), max(positive)) if positive else (1e-4, 1e-1)
        scale = LogScale(max(lo, hi * 1e-10), hi, lambda v: f"{v:.0e}".replace("e-0", "e-").replace("e+0", "e"))
    return _svg_chart(
        "chart-kl", "KL(baseline ‖ optimized), mean over every generated position (log scale)", rows, scale,
        legend=[("KL mean", OPT_COLOR), ("over budget", FAIL_COLOR), ("max_kl", "marker")],
        axis_note="log scale",
    )


def agreement_chart(report: Mapping[str, Any]) -> str:
    rows = []
    for test in _measured_tests(report):
        top1, match = view.similarity_figure(test, "top1"), view.similarity_figure(test, "token_match")
        if top1 is None and match is None:
            continue
        bars = []
        for raw, name, budget, color in ((top1, "top-1", "min_top1", OPT_COLOR),
                                         (match, "token match", "min_token_match", ALT_COLOR)):
            value, limit = finite_number(raw), _limit(test, budget)
            under = _failed(test, budget) or (raw is not None and value is None)
            label = view.format_percent(raw)
            counts = view.agreement_counts(test, "top1" if name == "top-1" else "token_match")
            if counts and raw is not None:
                label += f" ({counts})"
            bars.append(Bar(value, label, FAIL_COLOR if under else color, name, limit,
                            f"{budget} {view.format_percent(limit)}" if limit is not None else ""))
        rows.append(Row(_short_label(str(test["nodeid"])), str(test["nodeid"]), bars))
    values = [v for row in rows for bar in row.bars for v in (bar.value, bar.marker) if v is not None]
    scale = None
    if rows:
        lo = max(0.0, min(0.8, math.floor((min(values, default=0.9) - 0.02) * 5) / 5))
        scale = LinearScale(lo, 1.0, lambda v: f"{v * 100:g}%")
    title = "Agreement with the baseline: top-1 and greedy token match"
    if scale is not None and scale.lo > 0:
        title += f" (axis from {scale.lo * 100:g}%)"
    return _svg_chart(
        "chart-agreement", title, rows, scale,
        axis_note=f"axis from {scale.lo * 100:g}%" if scale is not None and scale.lo > 0 else "",
        legend=[("top-1", OPT_COLOR), ("token match", ALT_COLOR), ("below budget", FAIL_COLOR),
                ("min_top1 / min_token_match", "marker")],
    )


CHARTS: tuple[tuple[str, str, Callable[[Mapping[str, Any]], str]], ...] = (
    ("Speedup", "Baseline median latency / optimized median latency, with its 95% interval as a whisker. "
     "Right of the 1.0x line is faster; coloured only where the interval excludes 1.0.", speedup_chart),
    ("Peak memory", "Peak device memory during load and generation; the ratio is optimized / baseline.",
     memory_chart),
    ("KL divergence", "Mean KL of next-token distributions; bars must stay left of the max_kl tick.", kl_chart),
    ("Agreement", "Top-1 and greedy token match; bars must reach the min_top1 / min_token_match tick.",
     agreement_chart),
)


# --------------------------------------------------------------------------- history trends

_TREND_LEFT = 84  # room for the value axis labels
_TREND_RIGHT = 16
_TREND_PLOT_W = _WIDTH - _TREND_LEFT - _TREND_RIGHT
_TREND_TOP = 30
_PANEL_H = 104
_PANEL_GAP = 30
_TREND_LABELS_H = 40
_TREND_LABELS = 6  # run labels under the axis at most (every point keeps its own tooltip)


def _unit(top: float, units: Sequence[tuple[str, float]]) -> tuple[str, float]:
    return next(((u, f) for u, f in units if top * (1 + 1e-9) >= f), units[-1])  # 0.99999... s is 1 s


class _AxisScale(LinearScale):
    """A linear axis whose ends are ticks, ``step`` apart."""

    def __init__(self, lo: float, hi: float, step: float, fmt: Callable[[float], str]) -> None:
        super().__init__(lo, hi, fmt)
        self._step = step

    def step(self) -> float:
        return self._step

    def ticks(self) -> list[float]:
        return [self.lo + n * self._step for n in range(round((self.hi - self.lo) / self._step) + 1)]


def _nice_axis(lo: float, hi: float) -> tuple[float, float, float]:
    """(low end, high end, step) around ``lo``..``hi`` with a margin, both ends on a step: an end label that
    is not a tick would sit on top of its neighbour."""
    pad = (hi - lo) * 0.15 or abs(hi) * 0.05 or 1.0
    rough = LinearScale(max(0.0, lo - pad), hi + pad, str)
    step = rough.step()
    return max(0.0, math.floor(rough.lo / step) * step), math.ceil(rough.hi / step) * step, step


def _trend_scale(values: Sequence[float], units: Sequence[tuple[str, float]]) -> tuple[LinearScale, float]:
    """A value axis fitted to the points (a trend is about change: an axis from 0 would flatten it), counted
    in the unit of its top; (scale, factor): a value sits at ``scale.pos(value / factor)``."""
    unit, factor = _unit(_nice_axis(min(values), max(values))[1], units)
    lo, hi, step = _nice_axis(min(values) / factor, max(values) / factor)
    # the fewest decimals that show the step itself (0.025: 3), so neighbouring ticks never read the same
    decimals = next((d for d in range(4) if abs(round(step * 10**d) - step * 10**d) < 1e-6 * 10**d), 3)
    return _AxisScale(lo, hi, step, lambda v: f"{v:.{decimals}f} {unit}"), factor


_SECONDS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6))
_BYTES = (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10), ("B", 1.0))


def _trend_panel(kind: str, title: str, top: float, trend: Trend, history: History, x_of: Callable[[int], float],
                 value_of: Callable[[TrendPoint], float | None], text_of: Callable[[float], str],
                 units: Sequence[tuple[str, float]]) -> list[str]:
    """One panel of a trend chart: the value axis, a line through the runs, a point (and whisker) per run."""
    points = [(p, v) for p in trend.points if (v := value_of(p)) is not None]
    bottom = top + _PANEL_H
    parts = [f'<text x="{_TREND_LEFT}" y="{top - 8}" class="legend">{_e(title)}</text>',
             f'<line x1="{_TREND_LEFT}" y1="{top}" x2="{_TREND_LEFT}" y2="{bottom}" class="axis"/>']
    if not points:
        parts.append(f'<text x="{_TREND_LEFT + _TREND_PLOT_W / 2}" y="{top + _PANEL_H / 2}" text-anchor="middle" '
                     f'class="empty">No figure in these runs.</text>')
        return parts
    values = [v for p, v in points] + [b for p, _v in points if kind == "latency" and p.latency_range
                                       for b in p.latency_range]
    scale, factor = _trend_scale(values, units)

    def y_of(value: float) -> float:
        return bottom - scale.pos(value / factor) * _PANEL_H

    for tick in scale.ticks():
        ty = y_of(tick * factor)
        parts.append(f'<line x1="{_TREND_LEFT}" y1="{ty:.1f}" x2="{_TREND_LEFT + _TREND_PLOT_W}" y2="{ty:.1f}" '
                     f'class="grid"/><text x="{_TREND_LEFT - 6}" y="{ty + 4:.1f}" text-anchor="end" class="tick">'
                     f"{_e(scale.fmt(tick))}</text>")
    line = " ".join(f"{x_of(p.run):.1f},{y_of(v):.1f}" for p, v in points)
    parts.append(f'<polyline points="{line}" class="trend-line {kind}"/>')
    parts += _change_marks(kind, [(p.run, v) for p, v in points], history, x_of, top, bottom)
    for point, value in points:
        run = history.runs[point.run]
        x, y = x_of(point.run), y_of(value)
        tip = f"{run.describe()}: {text_of(value)}"
        if kind == "latency" and point.latency_range is not None:
            low, high = point.latency_range
            tip += f", {point.range_kind} {text_of(low)} to {text_of(high)}"
            parts.append(f'<g class="whisker" stroke="{WHISKER_COLOR}" stroke-width="1.2">'
                         f'<line x1="{x:.1f}" y1="{y_of(low):.1f}" x2="{x:.1f}" y2="{y_of(high):.1f}"/>'
                         f'<line x1="{x - 4:.1f}" y1="{y_of(low):.1f}" x2="{x + 4:.1f}" y2="{y_of(low):.1f}"/>'
                         f'<line x1="{x - 4:.1f}" y1="{y_of(high):.1f}" x2="{x + 4:.1f}" y2="{y_of(high):.1f}"/></g>')
        current = " current" if run.current else ""
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{5 if current else 3.5}" class="point {kind}{current}" '
                     f'data-run="{_e(_run_id(history, point.run))}"><title>{_e(tip)}</title></circle>')
    return parts


def _change_marks(kind: str, points: Sequence[tuple[int, float]], history: History, x_of: Callable[[int], float],
                  top: float, bottom: float) -> list[str]:
    """A dashed line between the last run before each change point of the panel's series and the first after
    it (``report.changepoints``, as ``pytest-opt history`` finds them), labelled with the step's size; none
    where ruptures (the ``history`` extra) is missing: the section's caption says so."""
    from ..errors import OptConfigError
    from .changepoints import steps

    try:
        found = steps([value for _, value in points])
    except OptConfigError:
        return []
    parts = []
    for split, change, interval in found:
        before, after = points[split.index - 1][0], points[split.index][0]
        x = (x_of(before) + x_of(after)) / 2
        size = f"{100 * change:+.1f}%" if change is not None else "changed"
        tip = (f"change point: {kind} {size}" + (f" [{100 * interval[0]:+.1f}%, {100 * interval[1]:+.1f}%]"
                                                 if interval is not None else "")
               + f" from {history.runs[after].describe()} (p={split.p_value:.2g})")
        parts.append(f'<g class="change-point {kind}" data-run="{_e(_run_id(history, after))}" data-change="{_e(size)}">'
                     f'<line x1="{x:.1f}" y1="{top:.1f}" x2="{x:.1f}" y2="{bottom:.1f}"/>'
                     f'<text x="{x + 3:.1f}" y="{top + 11:.1f}" class="change-label">{_e(size)}</text>'
                     f"<title>{_e(tip)}</title></g>")
    return parts


def _run_id(history: History, run: int) -> str:
    name = history.runs[run].name
    return name.name if name is not None else "this run"


def trend_chart(index: int, trend: Trend, history: History) -> str:
    """One test's trend over the recorded runs: optimized median latency with its whisker, and peak memory;
    one point per run in time order, this run highlighted, the runs' time and commit under the axis."""
    count = len(history.runs)
    slot = _TREND_PLOT_W / count

    def x_of(run: int) -> float:
        return _TREND_LEFT + (run + 0.5) * slot

    memory_top = _TREND_TOP + _PANEL_H + _PANEL_GAP
    axis_y = memory_top + _PANEL_H
    height = axis_y + _TREND_LABELS_H
    title = f"Trend of {trend.nodeid} over the last {count} runs"
    parts = [f'<svg class="chart-svg trend-svg" id="trend-{index}" data-nodeid="{_e(trend.nodeid)}" '
             f'data-hardware="{_e(trend.hardware or "")}" viewBox="0 0 {_WIDTH} {height}" width="{_WIDTH}" '
             f'height="{height}" role="img" aria-label="{_e(title)}"><title>{_e(title)}</title>']
    current = next((n for n, run in enumerate(history.runs) if run.current), None)
    if current is not None:
        parts.append(f'<rect x="{x_of(current) - slot / 2:.1f}" y="{_TREND_TOP - 4}" width="{slot:.1f}" '
                     f'height="{axis_y - _TREND_TOP + 4}" class="current-run"><title>this run</title></rect>')
    parts += _trend_panel("latency", "optimized latency, median of the rounds (whisker: see above)", _TREND_TOP,
                          trend, history, x_of, lambda p: p.latency_s, view.format_seconds, _SECONDS)
    parts += _trend_panel("memory", "optimized peak memory (read once per run)", memory_top, trend, history, x_of,
                          lambda p: p.peak_memory_bytes, view.format_memory, _BYTES)
    parts.append(f'<line x1="{_TREND_LEFT}" y1="{axis_y}" x2="{_TREND_LEFT + _TREND_PLOT_W}" y2="{axis_y}" '
                 f'class="axis"/>')
    every = max(1, math.ceil(count / _TREND_LABELS))
    for n, run in enumerate(history.runs):
        if n % every and n != count - 1 and n != current:
            continue
        when, commit = run.label()
        cls = "tick run-label current" if run.current else "tick run-label"
        parts.append(f'<text x="{x_of(n):.1f}" y="{axis_y + 15}" text-anchor="middle" class="{cls}">'
                     f'<tspan x="{x_of(n):.1f}">{_e(when)}</tspan><tspan x="{x_of(n):.1f}" dy="13">{_e(commit)}'
                     f"</tspan></text>")
    parts.append("</svg>")
    return "".join(parts)


def history_section(history: History | None) -> list[str]:
    """The "History" section: a trend chart per test of this run; nothing without recorded runs."""
    if history is None or not history.runs:
        return []
    out = [f'<section id="history"><h2>History</h2><p class="caption">Each test of this run over the last '
           f"{len(history.runs)} runs in <code>{_e(history.folder)}</code>, oldest left, this run highlighted; "
           "the axis names each run's time (UTC) and git commit (+: uncommitted changes). Whisker: the 95% "
           f"interval of the median latency (bootstrap over the rounds, {MIN_BOOTSTRAP_SAMPLES} rounds or more), "
           "or the min-max of the rounds below that. Peak memory is read once per run: no interval. A dashed line "
           "marks a change point of the series, with its size (as <code>pytest-opt history</code> finds them)"
           + ("" if _ruptures_installed() else ": none drawn here, since ruptures (the history extra) is not "
              "installed") + ".</p>"]
    if history.left_out:
        out.append(f'<p class="note">Left out (not a readable report): '
                   f'{_e("; ".join(history.left_out))}</p>')
    out.append('<div class="trends">')
    for index, trend in enumerate(trends(history)):
        label = f"<code>{_e(trend.nodeid)}</code>" + (
            f' <span class="hardware">{_e(trend.hardware)}</span>' if trend.hardware else "")
        if len(trend.points) < 2:
            runs = f"{len(trend.points)} run" + ("" if len(trend.points) == 1 else "s")
            body = f'<p class="trend-empty">{runs} of this test on this hardware with figures: a trend needs 2.</p>'
        else:
            body = trend_chart(index, trend, history)
        out.append(f'<figure class="chart trend"><figcaption><strong>{label}</strong></figcaption>{body}</figure>')
    out.append("</div></section>")
    return out


def _ruptures_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("ruptures") is not None


# --------------------------------------------------------------------------- page

@lru_cache(maxsize=1)
def page_css() -> str:
    """The page's style sheet, ``report.css`` (package data), inlined into every page."""
    return resources.files(__package__).joinpath("report.css").read_text(encoding="utf-8")


def _html_table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return (f'<div class="table-wrap"><table class="{cls}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>")


_PAIR_KEYS = ("ttft", "tpot", "throughput", "memory")


def _results_table(report: Mapping[str, Any]) -> str:
    cols = view.columns(report)
    head = "".join(f"<th>{_e('Test and techniques' if key == 'test' else header)}</th>"
                   for key, header in cols if key != "techniques")
    body = []
    for test, row in view.table_rows(report):
        outcome = str(test.get("outcome") or "")
        cells = []
        for key, _header in cols:
            value = row[key]
            if key == "test":
                from urllib.parse import quote  # --opt-trace: the census call's Chrome trace, linked under the id

                trace = test.get("trace")
                link = f'<a class="trace" href="{_e(quote(trace))}">trace</a>' if isinstance(trace, str) else ""
                cells.append(f'<td class="test"><code>{_e(value)}</code>'
                             f'<span class="techniques">{_e(row["techniques"])}</span>{link}</td>')
            elif key == "techniques":
                continue  # shown under the test id
            elif key == "outcome" and value.startswith("skipped: "):
                cells.append(f'<td class="outcome-skipped">skipped<span class="reason">'
                             f'{_e(value[len("skipped: "):])}</span></td>')
            elif key == "outcome" and outcome in ("failed", "error") and value.startswith(f"{outcome}: "):
                cells.append(f'<td class="outcome-{_e(outcome)}">{_e(outcome)}<span class="reason">'
                             f'{_e(value[len(outcome) + 2:])}</span></td>')  # view.outcome_text's one-line reason
            elif key == "outcome":
                cells.append(f'<td class="outcome-{_e(outcome)}">{_e(value)}</td>')
            elif key in ("failed_budgets", "regression"):
                bad = value != view.MISSING if key == "failed_budgets" else value.startswith(REGRESSED)
                warn = key == "regression" and value.startswith(INCONCLUSIVE)
                cause = view.regression_cause(test) if key == "regression" else None
                if cause:  # the census's word on the timed verdict, under it
                    value = view.regression_text(test, with_cause=False)
                shown = _e(value) + (f'<span class="reason cause">cause: {_e(cause)}</span>' if cause else "")
                cells.append(f'<td class="{key}{" bad" if bad else " warn" if warn else ""}">{shown}</td>')
            elif key in ("token_match", "top1") and value.endswith(")") and " (" in value:
                figure, counts = value[:-1].split(" (", 1)  # view.agreement_counts under the figure
                cells.append(f'<td class="num">{_e(figure)}<span class="reason">{_e(counts)}</span></td>')
            elif key in ("speedup", "memory_ratio") and " " in value:  # view.format_ratio_verdict's text
                ratio, uncertainty = value.split(" ", 1)  # the interval and word under the ratio, free to wrap
                cells.append(f'<td class="num">{_e(ratio)}<span class="reason">{_e(uncertainty)}</span></td>')
            elif key in _PAIR_KEYS and " / " in value:
                optimized, baseline = value.split(" / ", 1)
                cells.append(f'<td class="num pair"><span class="opt">{_e(optimized)}</span>'
                             f'<span class="base">{_e(baseline)}</span></td>')
            else:
                cells.append(f'<td class="num">{_e(value)}</td>')
        body.append(f'<tr class="{_e(outcome)}">' + "".join(cells) + "</tr>")
    return (f'<div class="table-wrap"><table class="results"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def census_section(report: Mapping[str, Any]) -> list[str]:
    """The "Execution census" section: per test, what each side's census call ran (``view.census_tables``),
    collapsed; none where no row has a census (an earlier report)."""
    tables = view.census_tables(report)
    if not tables:
        return []
    out = [f'<section id="census"><h2>{_e(view.CENSUS_TITLE)}</h2>', f'<p class="caption">{_e(view.CENSUS_NOTE)}</p>']
    for table in tables:
        if table.why_not is not None:
            out.append(f'<p class="census-none"><code>{_e(table.test)}</code>: not taken ({_e(table.why_not)})</p>')
            continue
        out.append(f'<details class="census"><summary><code>{_e(table.test)}</code></summary>')
        out.append(_html_table(["Figure", "Optimized", "Baseline"], table.rows, cls="census"))
        out.append("</details>")
    out.append("</section>")
    return out


def _ab_section(report: Mapping[str, Any]) -> list[str]:
    """The "A/B against another environment" section: what differs between the two stacks, then one line per
    test (``view.ab_lines``, as the Markdown report and the terminal show them), with what the census says under it
    (``report.ab.census_text``, as the Markdown report); none without --opt-ab."""
    if not view.has_ab(report):
        return []
    out = [f'<section id="ab"><h2>{_e(view.AB_TITLE)}</h2>', f"<p>{_e(view.AB_INTRO)}</p>"]
    out += [f'<p class="ab-stacks"><strong>{_e(line)}</strong></p>' for line in view.ab_header_lines(report)]
    compared = view.ab_lines(report)
    if not compared:
        return [*out, f"<p>{_e(view.AB_NO_ROWS)}</p></section>"]
    out.append('<ul class="ab">')
    for test, line in compared:
        verdict = test["ab"].get("verdict")
        bad = ' class="bad"' if verdict == REGRESSED else ' class="warn"' if verdict == INCONCLUSIVE else ""
        census = census_text(test)  # what the two stacks run differently, under its line
        below = f'<div class="ab-census">{_e(census)}</div>' if census else ""
        out.append(f"<li{bad}><code>{_e(test.get('nodeid'))}</code>: {_e(line)}{below}</li>")
    out.append("</ul></section>")
    return out


def _matrix_section(report: Mapping[str, Any]) -> list[str]:
    """The "Hardware matrix" section: the cells of ``view.hardware_matrices`` (the Markdown report lays out
    the same ones); none when the report's tests ran on one kind of hardware."""
    matrices = view.hardware_matrices(report)
    if not matrices:
        return []
    out = ['<section id="hardware-matrix"><h2>Hardware matrix</h2>', f"<p>{_e(view.MATRIX_INTRO)}</p>"]
    for matrix in matrices:
        out.append(f'<h3 class="matrix-test"><code>{_e(matrix.test)}</code></h3>')
        out.append(_html_table(matrix.headers, matrix.cells, cls="hardware-matrix"))
    out.append("</section>")
    return out


def render_html(report: dict[str, Any], *, history: History | None = None) -> str:
    """The report as one self-contained HTML page with inline CSS and inline SVG charts; with ``history``
    (``--opt-history``), a trend chart per test over the recorded runs."""
    summary = view.summary_text(report)
    counts = view.summary_counts(report)
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Optimization report: {_e(summary)}</title>",
        f"<style>\n{page_css()}</style></head><body>",
        "<header><h1>Optimization report</h1>",
        f'<p class="context">{_e(view.context_text(report))}</p>',
        '<div class="counts">' + "".join(
            f'<span class="pill {key}{" zero" if not counts[key] else ""}">{counts[key]} {key}</span>'
            for key in view.shown_counts(counts)) + "</div>",
    ]
    for note in (view.budgets_mode_note(report), view.shard_settings_note(report), view.compare_note(report)):
        if note:
            out.append(f'<p class="note">{_e(note)}</p>')
    out.append("</header>")
    by_hardware = view.spans_hardware(report)  # a merged report: each per-test table says which hardware

    shards = view.shard_rows(report)
    if len(shards) > 1:
        out.append('<section id="shards"><h2>Shards</h2>')
        out.append(_html_table([header for _, header in view.SHARD_COLUMNS],
                               ([row[key] for key, _ in view.SHARD_COLUMNS] for row in shards), cls="shards"))
        out.append("</section>")

    budget_rows = view.failed_budget_rows(report)
    if budget_rows:
        with_note = any(row["note"] for row in budget_rows)
        hardware = ["hardware"] if by_hardware else []
        keys = ["test", *hardware, "budget", "measured", "limit", "source"] + (["note"] if with_note else [])
        headers = [key.capitalize() for key in keys]
        out.append('<section id="failed-budgets"><h2>Failed budgets</h2>')
        out.append(_html_table(headers, ([row[k] or view.MISSING for k in keys] for row in budget_rows),
                               cls="failed-budgets"))
        out.append("</section>")

    out.append('<section id="charts"><h2>At a glance</h2><div class="grid">')
    for name, caption, chart in CHARTS:
        out.append(f'<figure class="chart"><figcaption><strong>{_e(name)}</strong>'
                   f"<span>{_e(caption)}</span></figcaption>{chart(report)}</figure>")
    out.append("</div></section>")
    out += history_section(history)

    out.append('<section id="results"><h2>Results</h2>')
    if view.table_rows(report):
        out.append(_results_table(report))
    else:
        out.append("<p>No test used <code>opt_bench</code> in this run.</p>")
    out.append("</section>")
    out += census_section(report)

    out += _ab_section(report)
    out += _matrix_section(report)

    estimates = view.estimate_rows(report)
    if estimates:
        out.append('<section id="estimates"><h2>Estimated figures (estimate)</h2>'
                   "<p>Not measured in this run; kept apart from the measured figures above.</p>")
        out.append(_html_table(["Test"] + (["Hardware"] if by_hardware else []) + ["Figure", "Value (estimate)"],
                               ([r["test"], *([r["hardware"]] if by_hardware else []), r["figure"],
                                 f"{r['value']} (estimate)"] for r in estimates)))
        out.append("</section>")

    compiled = view.compile_rows(report)
    if compiled:
        out.append('<section id="compile"><h2>Compile time</h2>'
                   "<p>Warm-up time of the first compiled call, not in the figures above.</p>")
        out.append(_html_table(["Test", "Compile time", "Compile cache", "Recompiles"],
                               ([r["test"], r["compile_time"], r["cache"], r["recompiles"]] for r in compiled)))
        out.append("</section>")

    drafted = view.speculative_rows(report)
    if drafted:
        out.append(f'<section id="speculative"><h2>{_e(view.SPECULATIVE_TITLE)}</h2><p>{_e(view.SPECULATIVE_NOTE)}</p>')
        out.append(_html_table(["Test", "Acceptance rate", "Accepted per step", "Accepted", "Proposed", "Steps"],
                               ([r["test"], r["acceptance_rate"], r["accepted_per_step"], r["accepted"], r["proposed"],
                                 r["steps"]] for r in drafted)))
        out.append("</section>")

    groups = view.skipped_groups(report)
    if groups:
        out.append('<section id="skipped"><h2>Skipped techniques</h2><ul class="skipped">')
        for reason, tests in groups:
            items = "".join(
                f"<li><code>{_e(t.get('nodeid'))}</code>"
                + (f" — {_e(' + '.join(str(n) for n in t.get('techniques') or []))}" if t.get("techniques") else "")
                + "</li>" for t in tests)
            out.append(f"<li><strong>{_e(reason)}</strong> ({len(tests)} {'test' if len(tests) == 1 else 'tests'})"
                       f"<ul>{items}</ul></li>")
        out.append("</ul></section>")

    problems = view.problem_rows(report)
    if problems:
        out.append('<section id="problems"><h2>Failures and errors</h2>')
        out.append(_html_table(["Test", "Outcome", "Error"], ([r["test"], r["outcome"], r["error"]] for r in problems)))
        out.append("</section>")

    advice = view.advice_lines(report)
    if advice:
        out.append('<section id="advice"><h2>Advice</h2><ul>' + "".join(f"<li>{_e(a)}</li>" for a in advice)
                   + "</ul></section>")

    out.append(f"<details><summary>{_e(view.environment_title(report))}</summary>")
    out.append(_html_table(["Item", "Value"], view.environment_rows(report), cls="environment"))
    out.append("</details>")
    out.append(f"<footer>pytest-transformers-opt report, schema {_e(report.get('schema'))} "
               f"version {_e(report.get('schema_version'))}, created {_e(report.get('created'))}</footer>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
