"""Two censuses compared exactly: the census thresholds (``ops:0``, ``graph_breaks:0`` ...) and the cause a timing
verdict names.

A census (``engine.census``) is read without sampling noise, so its thresholds are judged by
``verdict.judge.decide_exact``: a change past the limit is real. A count map (``ops``, ``kernels``) changes by
the sum of its counts' differences (an op replaced by another is two changes, whatever the totals), in percent of
the old total for a relative limit: any change past the limit is ``regressed``, whichever way it goes (as PyTorch's
expected-count files fail until they are updated: a change of what runs is for a person to accept). A scalar
(``graph_breaks``, ``recompiles``, ``syncs``) worsens when it grows: fewer is ``improved``.
"""

from __future__ import annotations

from typing import Any, Mapping

CENSUS_MAPS: dict[str, tuple[str, str, str]] = {
    # metric: (the map per call, the map per decode step, its total per call)
    "ops": ("ops", "ops_per_step", "ops_total"),
    "kernels": ("kernels", "kernels_per_step", "kernels_total"),
}
CENSUS_SCALARS: dict[str, str] = {"graph_breaks": "graph breaks", "recompiles": "recompiles", "syncs": "syncs"}
CENSUS_METRICS: tuple[str, ...] = (*CENSUS_MAPS, *CENSUS_SCALARS)
"""The census's metrics in the compare grammar (SPEC, fourth phase)."""

NOT_COMPILED = "not a compiled configuration"
"""An eager configuration's reason for no graph figures: it has no graphs, so none broke or recompiled (0)."""
UNCHANGED = "the census did not change: the same ops ran, so a timing difference is the arithmetic's or the machine's"
LINES_SHOWN = 6  # changes named in one line; the rest are counted


def side_census(entry: Mapping[str, Any], side: str = "optimized") -> tuple[dict[str, Any] | None, str | None]:
    """(a row's census of ``side``, or None with why) from a report row or an A/B record's ``census``."""
    census = entry.get("census")
    if not isinstance(census, dict):
        return None, "an earlier report, or --opt-census=off"
    counted = census.get(side)
    if isinstance(counted, dict):
        return counted, None
    why = (census.get("why_not") or {}).get(side) if isinstance(census.get("why_not"), dict) else None
    return None, str(why or f"no census of the {side} side")


def _count(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def census_value(census: Mapping[str, Any], metric: str) -> tuple[Any, str | None]:
    """(the census's value of ``metric``: a count map or a number, or None with why)."""
    given = census.get("unavailable")
    unavailable: Mapping[str, Any] = given if isinstance(given, dict) else {}
    if metric in CENSUS_MAPS:
        counts = census.get(CENSUS_MAPS[metric][0])
        if isinstance(counts, dict) and all(_count(v) is not None for v in counts.values()):
            return counts, None
        return None, str(unavailable.get(metric) or f"no {metric} counted")
    value = _count(census.get(metric))
    if value is not None:
        return value, None
    why = str(unavailable.get(metric) or f"no {CENSUS_SCALARS[metric]} counted")
    return (0.0, None) if why == NOT_COMPILED else (None, why)


def _number(value: float) -> str:
    return f"{value:g}"


def map_changes(old: Mapping[str, Any], new: Mapping[str, Any], metric: str = "ops") -> list[str]:
    """What appeared, vanished or changed count between two censuses' ``metric`` maps, largest first: per decode
    step where both censuses count steps and the step's count changed ("aten::mm +2 per step (48 -> 50)"), else
    per call ("aten::cat -1 per call (12 -> 11)")."""
    whole, per_step_key, _ = CENSUS_MAPS[metric]
    old_calls, new_calls = old.get(whole) or {}, new.get(whole) or {}
    old_steps, new_steps = old.get(per_step_key), new.get(per_step_key)
    stepped = isinstance(old_steps, dict) and isinstance(new_steps, dict)
    changes: list[tuple[float, str]] = []
    for name in sorted(set(old_calls) | set(new_calls)):
        before, after = float(old_calls.get(name, 0)), float(new_calls.get(name, 0))
        if before == after:
            continue
        if stepped:
            assert isinstance(old_steps, dict) and isinstance(new_steps, dict)
            step_before, step_after = float(old_steps.get(name, 0)), float(new_steps.get(name, 0))
            if step_before != step_after:
                delta = step_after - step_before
                changes.append((abs(delta) * 1e6, f"{name} {'+' if delta > 0 else '-'}{_number(abs(delta))} per step "
                                                  f"({_number(step_before)} -> {_number(step_after)})"))
                continue
        delta = after - before
        changes.append((abs(delta), f"{name} {'+' if delta > 0 else '-'}{_number(abs(delta))} per call "
                                    f"({_number(before)} -> {_number(after)})"))
    return [text for _, text in sorted(changes, key=lambda item: -item[0])]


def scalar_change(old: Mapping[str, Any], new: Mapping[str, Any], metric: str) -> str | None:
    """``graph breaks 0 -> 9: <reason>``, ``syncs 16 -> 32 per call``; None when unchanged or not counted."""
    before, _ = census_value(old, metric)
    after, _ = census_value(new, metric)
    if before is None or after is None or before == after:
        return None
    text = f"{CENSUS_SCALARS[metric]} {_number(before)} -> {_number(after)}"
    if metric == "syncs":
        text += " per call"
        step_before, step_after = _count(old.get("syncs_per_step")), _count(new.get("syncs_per_step"))
        if step_before is not None and step_after is not None and step_before != step_after:
            text += f" ({_number(step_before)} -> {_number(step_after)} per step)"
    if metric == "graph_breaks" and after > before:
        reasons = [str(r) for r in new.get("graph_break_reasons") or [] if str(r) not in
                   set(map(str, old.get("graph_break_reasons") or []))] or [str(r) for r in new.get("graph_break_reasons") or []]
        text += f": {'; '.join(reasons)}" if reasons else ": the reason was not recorded (compiled before it was counted)"
    return text


def census_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Every change between two censuses of one side, as lines a person can act on."""
    lines = [text for metric in CENSUS_SCALARS if (text := scalar_change(old, new, metric))]
    for metric in CENSUS_MAPS:
        if isinstance(old.get(CENSUS_MAPS[metric][0]), dict) and isinstance(new.get(CENSUS_MAPS[metric][0]), dict):
            lines.extend(map_changes(old, new, metric))
    return lines


def shortened(lines: list[str], shown: int = LINES_SHOWN) -> str:
    """Lines joined with '; ', the first ``shown`` of them and a count of the rest."""
    head = "; ".join(lines[:shown])
    return head + (f"; and {len(lines) - shown} more" if len(lines) > shown else "")


def census_cause(old_entry: Mapping[str, Any], new_entry: Mapping[str, Any], *, old_label: str = "old",
                 new_label: str = "new", sides: tuple[str, ...] = ("optimized", "baseline")) -> dict[str, Any]:
    """What the census says of a timing verdict between two rows: ``changed`` (True / False / None: no census on
    a side), the change ``lines`` (prefixed with the side where the baseline's changed too) and one ``text``."""
    lines: list[str] = []
    for side in sides:
        old_census, old_why = side_census(old_entry, side)
        new_census, new_why = side_census(new_entry, side)
        if old_census is None or new_census is None:
            if side == sides[0]:
                label, why = (old_label, old_why) if old_census is None else (new_label, new_why)
                return {"changed": None, "lines": [], "text": f"no census in the {label} run ({why})"}
            continue
        changes = census_changes(old_census, new_census)
        lines.extend(changes if side == sides[0] else [f"{side}: {line}" for line in changes])
    if not lines:
        return {"changed": False, "lines": [], "text": UNCHANGED}
    return {"changed": True, "lines": lines, "text": f"the census changed: {shortened(lines)}"}


def census_amount(metric: str, old: Any, new: Any, relative: bool) -> float:
    """How much a census figure worsened, in the threshold's terms: a map's summed count differences (percent of
    the old total when relative), a scalar's growth."""
    if metric in CENSUS_MAPS:
        distance = sum(abs(float(new.get(k, 0)) - float(old.get(k, 0))) for k in set(old) | set(new))
        total = sum(float(v) for v in old.values())
        if not relative:
            return distance
        return 0.0 if distance == 0 else (100.0 * distance / total if total else float("inf"))
    delta = float(new) - float(old)
    if not relative:
        return delta
    return 0.0 if delta == 0 else (100.0 * delta / abs(float(old)) if old else float("inf") if delta > 0 else -float("inf"))
