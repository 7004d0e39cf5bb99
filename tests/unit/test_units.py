"""Unit and property tests for every parser of user input.

Sizes, durations, throughputs, fractions and counts (``units``), budgets (``budgets.parse_budget``),
dtypes (``loading.parse_dtype``), option values (``options``) and technique parameters (the
registry). Every parser accepts the forms the README documents and rejects everything else with an
``OptConfigError`` that names what was wrong and where it came from: never another exception, never
a silently wrong value (NaN, infinity, zero, a bool taken for a number).
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pytest_transformers_opt import techniques
from pytest_transformers_opt.verdict.budgets import BUDGETS, parse_budget
from pytest_transformers_opt.errors import OptConfigError, OptTechniqueConflict
from pytest_transformers_opt.units import parse_dtype
from pytest_transformers_opt.options import OPTIONS, _device, _mode, _names, _rounds, _warmup
from pytest_transformers_opt.verdict.bench import MAX_WARMUP
from pytest_transformers_opt.verdict.sequential import MAX_ROUNDS, RoundsRule
from pytest_transformers_opt.techniques import Technique, TechniqueSpec, build_registry, check_stack
from pytest_transformers_opt.units import (parse_duration, parse_fraction, parse_non_negative_int,
                                           parse_positive_float, parse_size, parse_throughput)

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Values that are never a number of anything: bools are ints to Python, but not to a budget.
NOT_NUMBERS: list[Any] = [True, False, None, [], {}, [1], object(), b"5", float("nan"), float("inf"),
                          float("-inf")]
finite_positive = st.floats(min_value=1e-6, max_value=1e12, allow_nan=False, allow_infinity=False)
# Whatever a user may pass: numbers of every size, text, bools, None, containers.
anything = st.one_of(
    st.text(max_size=20), st.integers(), st.floats(), st.booleans(), st.none(),
    st.lists(st.integers(), max_size=2), st.binary(max_size=4),
    st.from_regex(r"\A\s?-?[0-9]{0,400}(\.[0-9]{1,3})?([eE][-+]?[0-9]{1,3})?\s?[a-zA-Zµ/]{0,6}\Z"),
)


def _rejects(parse: Any, value: Any, *fragments: str, **kwargs: Any) -> str:
    """``parse(value)`` raises OptConfigError whose message holds every fragment; returns the message."""
    with pytest.raises(OptConfigError) as info:
        parse(value, **kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def _only_opt_config_errors(parse: Any, value: Any, **kwargs: Any) -> Any:
    """Call ``parse``; anything but a value or an OptConfigError is a bug (it would surface as a traceback)."""
    try:
        return parse(value, **kwargs)
    except OptConfigError:
        return None


# --- parse_size ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "expected"), [
    ("6 GiB", 6 * 2**30), ("800 MB", 800 * 10**6), ("512MiB", 512 * 2**20), (1024, 1024), ("1.5 GiB", 3 * 2**29),
    ("2 kb", 2000), ("2 KiB", 2048), ("10", 10), ("10 B", 10), ("1 TiB", 2**40), ("3 G", 3 * 10**9),
    ("  7 gib  ", 7 * 2**30), ("1e3 MB", 10**9), (2.5e9, 2_500_000_000),
])
def test_parse_size_accepts_documented_forms(value: Any, expected: int) -> None:
    result = parse_size(value, "budget max_memory")
    assert result == expected and isinstance(result, int)


@pytest.mark.parametrize("value", ["lots", "", "GiB", "5 parsecs", "-5 GiB", "0 GiB", 0, -1, -2.5, "1,5 GiB",
                                   "5 GiB extra", *NOT_NUMBERS])
def test_parse_size_rejects_with_accepted_forms(value: Any) -> None:
    _rejects(parse_size, value, "budget max_memory", '"6 GiB"', "int number of bytes", what="budget max_memory")


@pytest.mark.parametrize("value", ["1e300 TiB", "1e400 GiB", "1e309", 1e309])
def test_parse_size_rejects_sizes_too_large_to_represent(value: Any) -> None:
    _rejects(parse_size, value, "budget max_memory", what="budget max_memory")


@pytest.mark.parametrize("value", ["0.5", "0.4 B", 0.5, "1e-9 KB"])
def test_parse_size_rejects_less_than_one_byte(value: Any) -> None:
    """A positive figure that rounds to 0 bytes would be a budget no run can meet; say so up front."""
    _rejects(parse_size, value, "budget max_memory", what="budget max_memory")


@PROPERTY
@given(st.integers(min_value=1, max_value=10**6))
def test_parse_size_binary_and_decimal_units(n: int) -> None:
    assert parse_size(f"{n} GiB") == n * 2**30
    assert parse_size(f"{n}GiB") == n * 2**30
    assert parse_size(f"{n} gib") == n * 2**30
    assert parse_size(f"{n} MiB") == n * 2**20
    assert parse_size(f"{n} GB") == n * 10**9
    assert parse_size(f"{n} kb") == n * 10**3


@PROPERTY
@given(st.integers(min_value=1, max_value=2**50))
def test_parse_size_int_bytes_round_trip(n: int) -> None:
    assert parse_size(n) == n
    assert parse_size(str(n)) == n


@PROPERTY
@given(anything)
@example(2**1100)
@example("1e300 TiB")
@example("0.1")
def test_parse_size_only_ever_raises_opt_config_error(value: Any) -> None:
    result = _only_opt_config_errors(parse_size, value)
    if result is not None:
        assert isinstance(result, int) and not isinstance(result, bool) and result >= 1


# --- parse_duration --------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "expected"), [
    ("50 ms", 0.05), ("1.5 s", 1.5), ("200us", 2e-4), ("200 µs", 2e-4), ("2 min", 120.0), ("100 ns", 1e-7),
    ("3 sec", 3.0), ("1.5", 1.5), (0.25, 0.25), (2, 2.0), ("50 MS", 0.05), (" 7s ", 7.0),
])
def test_parse_duration_accepts_documented_forms(value: Any, expected: float) -> None:
    assert parse_duration(value, "budget max_ttft") == pytest.approx(expected)


@pytest.mark.parametrize("value", ["fast", "", "5 hours", "-5 ms", "0 ms", "ms", "5 m s", 0, -0.1, *NOT_NUMBERS])
def test_parse_duration_rejects_with_accepted_forms(value: Any) -> None:
    _rejects(parse_duration, value, "budget max_ttft", '"50 ms"', "float number of seconds", what="budget max_ttft")


@pytest.mark.parametrize("value", ["1e308 min", "1e-320 ns", 2**1100], ids=["1e308 min", "1e-320 ns", "2**1100"])
def test_parse_duration_rejects_values_that_overflow_or_vanish(value: Any) -> None:
    """A limit of 0 s or infinity seconds is never what the user meant."""
    _rejects(parse_duration, value, "budget max_latency", what="budget max_latency")


@PROPERTY
@given(finite_positive)
def test_parse_duration_round_trips_milliseconds_and_seconds(x: float) -> None:
    assert parse_duration(f"{x} ms") == pytest.approx(x / 1000, rel=1e-9)
    assert parse_duration(f"{x}ms") == pytest.approx(x / 1000, rel=1e-9)
    assert parse_duration(f"{x} s") == pytest.approx(x, rel=1e-9)
    assert parse_duration(x) == x
    assert parse_duration(repr(x)) == x


@PROPERTY
@given(st.floats(min_value=1e-300, max_value=1e300, allow_nan=False, allow_infinity=False))
def test_parse_duration_any_finite_positive_float_in_ms(x: float) -> None:
    result = _only_opt_config_errors(parse_duration, f"{x} ms")
    if result is not None:
        assert math.isfinite(result) and result > 0
        assert result == pytest.approx(x / 1000, rel=1e-9)


@PROPERTY
@given(st.one_of(st.floats(max_value=0), st.integers(max_value=0), st.just(float("nan")), st.just(float("inf")),
                 st.booleans()))
def test_parse_duration_rejects_nan_inf_non_positive_and_bool(value: Any) -> None:
    _rejects(parse_duration, value, "duration")
    if not isinstance(value, bool):
        _rejects(parse_duration, f"{value} ms", "duration")


@PROPERTY
@given(anything)
@example(2**1100)
@example("1e308 min")
def test_parse_duration_only_ever_raises_opt_config_error(value: Any) -> None:
    result = _only_opt_config_errors(parse_duration, value)
    if result is not None:
        assert isinstance(result, float) and math.isfinite(result) and result > 0


# --- parse_throughput ------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "expected"), [
    (800, 800.0), (12.5, 12.5), ("800 tok/s", 800.0), ("800tok/s", 800.0), ("12.5 tokens/s", 12.5),
    ("30 t/s", 30.0), ("800", 800.0), ("800 TOK/S", 800.0),
])
def test_parse_throughput_accepts_documented_forms(value: Any, expected: float) -> None:
    assert parse_throughput(value, "budget min_throughput") == expected


@pytest.mark.parametrize("value", ["fast", "", "800 tok/min", "800 GiB", "-800 tok/s", "0 tok/s", 0, -3,
                                   *NOT_NUMBERS])
def test_parse_throughput_rejects_with_accepted_forms(value: Any) -> None:
    _rejects(parse_throughput, value, "budget min_throughput", '"800 tok/s"', what="budget min_throughput")


@PROPERTY
@given(finite_positive)
def test_parse_throughput_round_trips(x: float) -> None:
    assert parse_throughput(x) == x
    assert parse_throughput(f"{x} tok/s") == x


@PROPERTY
@given(anything)
@example(2**1100)
def test_parse_throughput_only_ever_raises_opt_config_error(value: Any) -> None:
    result = _only_opt_config_errors(parse_throughput, value)
    if result is not None:
        assert math.isfinite(result) and result > 0


# --- parse_fraction --------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "expected"), [(0, 0.0), (1, 1.0), (0.95, 0.95), ("0.5", 0.5), (" 1 ", 1.0),
                                                 ("0", 0.0), (1.0, 1.0)])
def test_parse_fraction_accepts_zero_to_one(value: Any, expected: float) -> None:
    assert parse_fraction(value, "budget min_top1") == expected


@pytest.mark.parametrize("value", [1.5, -0.01, "1.0001", "most", "", "95%", 2, *NOT_NUMBERS])
def test_parse_fraction_rejects_outside_zero_to_one(value: Any) -> None:
    _rejects(parse_fraction, value, "budget min_top1", "from 0 to 1", what="budget min_top1")


@PROPERTY
@given(st.floats(min_value=0.0, max_value=1.0))
def test_parse_fraction_round_trips_unit_interval(x: float) -> None:
    assert parse_fraction(x) == x
    assert parse_fraction(repr(x)) == x


@PROPERTY
@given(st.one_of(st.floats(min_value=1.0, exclude_min=True), st.floats(max_value=0.0, exclude_max=True),
                 st.just(float("nan")), st.booleans()))
def test_parse_fraction_rejects_everything_else(value: Any) -> None:
    _rejects(parse_fraction, value, "from 0 to 1")


@PROPERTY
@given(anything)
@example(2**1100)
def test_parse_fraction_only_ever_raises_opt_config_error(value: Any) -> None:
    result = _only_opt_config_errors(parse_fraction, value)
    if result is not None:
        assert 0.0 <= result <= 1.0


# --- parse_positive_float --------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "allow_zero", "expected"), [
    (1.2, False, 1.2), ("1.2", False, 1.2), (3, False, 3.0), (" 2 ", False, 2.0), (0, True, 0.0), ("0", True, 0.0),
    (1e-3, True, 1e-3),
])
def test_parse_positive_float_accepts(value: Any, allow_zero: bool, expected: float) -> None:
    assert parse_positive_float(value, "budget min_speedup", allow_zero=allow_zero) == expected


@pytest.mark.parametrize(("value", "allow_zero", "bound"), [
    (0, False, "> 0"), ("0", False, "> 0"), (-1, False, "> 0"), (-1, True, ">= 0"), ("fast", False, "> 0"),
    ("", True, ">= 0"), *[(v, False, "> 0") for v in NOT_NUMBERS], *[(v, True, ">= 0") for v in NOT_NUMBERS],
])
def test_parse_positive_float_rejects(value: Any, allow_zero: bool, bound: str) -> None:
    _rejects(parse_positive_float, value, "budget min_speedup", bound, what="budget min_speedup",
             allow_zero=allow_zero)


@PROPERTY
@given(finite_positive, st.booleans())
def test_parse_positive_float_round_trips(x: float, allow_zero: bool) -> None:
    assert parse_positive_float(x, allow_zero=allow_zero) == x
    assert parse_positive_float(repr(x), allow_zero=allow_zero) == x


@PROPERTY
@given(anything, st.booleans())
@example(2**1100, False)
def test_parse_positive_float_only_ever_raises_opt_config_error(value: Any, allow_zero: bool) -> None:
    result = _only_opt_config_errors(parse_positive_float, value, allow_zero=allow_zero)
    if result is not None:
        assert math.isfinite(result) and (result > 0 or (allow_zero and result == 0))


# --- parse_non_negative_int ------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "minimum", "expected"), [(0, 0, 0), ("0", 0, 0), (" 5 ", 1, 5), (3, 1, 3),
                                                            ("12", 2, 12)])
def test_parse_non_negative_int_accepts(value: Any, minimum: int, expected: int) -> None:
    assert parse_non_negative_int(value, "rounds", minimum=minimum) == expected


@pytest.mark.parametrize(("value", "minimum"), [(0, 1), ("0", 1), (-1, 0), ("-1", 0), ("x", 0), ("1.5", 0), (1.0, 0),
                                                (2.5, 0), ("", 0), (True, 0), (False, 0), (None, 0), ("--1", 0),
                                                ("²", 0), ("1 2", 0)])
def test_parse_non_negative_int_rejects(value: Any, minimum: int) -> None:
    _rejects(parse_non_negative_int, value, "rounds", f">= {minimum}", what="rounds", minimum=minimum)


@PROPERTY
@given(st.integers(min_value=0, max_value=10**12), st.integers(min_value=0, max_value=3))
def test_parse_non_negative_int_round_trips(n: int, minimum: int) -> None:
    if n >= minimum:
        assert parse_non_negative_int(n, minimum=minimum) == n
        assert parse_non_negative_int(str(n), minimum=minimum) == n
    else:
        _rejects(parse_non_negative_int, n, f">= {minimum}", minimum=minimum)


@PROPERTY
@given(st.one_of(anything, st.text(alphabet="-0123456789²³¹٣ \t", max_size=6)))
@example("--1")
@example("²")
@example("-0")
def test_parse_non_negative_int_only_ever_raises_opt_config_error(value: Any) -> None:
    result = _only_opt_config_errors(parse_non_negative_int, value)
    if result is not None:
        assert isinstance(result, int) and not isinstance(result, bool) and result >= 0


# --- budgets.parse_budget --------------------------------------------------------------------------
VALID_BUDGETS: dict[str, list[tuple[Any, float]]] = {
    "max_memory": [("6 GiB", 6 * 2**30), ("800 MB", 8e8), (1024, 1024.0), ("1024", 1024.0)],
    "max_memory_ratio": [(0.5, 0.5), ("0.5", 0.5), (2, 2.0)],
    "max_ttft": [("50 ms", 0.05), ("1.5 s", 1.5), (0.2, 0.2)],
    "max_tpot": [("5 ms", 0.005), (0.01, 0.01)],
    "max_latency": [("2 s", 2.0), ("250ms", 0.25), (3, 3.0)],
    "min_throughput": [(800, 800.0), ("800 tok/s", 800.0), ("12.5", 12.5)],
    "min_speedup": [(1.2, 1.2), ("1.2", 1.2), (2, 2.0)],
    "min_token_match": [(1.0, 1.0), (0, 0.0), ("0.9", 0.9)],
    "max_kl": [(0.01, 0.01), (0, 0.0), ("1e-3", 1e-3)],
    "min_top1": [(0.97, 0.97), (1, 1.0), ("0.85", 0.85)],
    "max_recompiles": [(0, 0.0), (3, 3.0), ("2", 2.0)],
    "max_graph_breaks": [(0, 0.0), (2, 2.0), ("1", 1.0)],
    "max_syncs_per_step": [(0, 0.0), (1, 1.0), ("0.5", 0.5)],
    "min_acceptance_rate": [(0.5, 0.5), (0, 0.0), ("0.25", 0.25), (1, 1.0)],
}
INVALID_BUDGETS: dict[str, list[Any]] = {
    "max_memory": ["lots", 0, -1, "6 GB/s", True, float("nan")],
    "max_memory_ratio": [0, -0.5, "half", float("inf"), True],
    "max_ttft": ["fast", 0, "-1 ms", "5 hours", float("nan"), False],
    "max_tpot": ["quick", -1, float("inf")],
    "max_latency": ["soon", 0, "1 light-year"],
    "min_throughput": ["many", 0, "800 tok/min", float("nan")],
    "min_speedup": [0, -1.2, "faster", float("nan"), float("inf"), True],
    "min_token_match": [1.5, -0.1, "all", float("nan")],
    "max_kl": [-0.01, "small", float("nan"), float("inf")],
    "min_top1": [1.5, -1, "most", float("nan")],
    "max_recompiles": [-1, 1.5, "a few", True, 2.0],
    "max_graph_breaks": [-1, 0.5, "none", True],
    "max_syncs_per_step": [-1, "few", float("nan"), float("inf"), True],
    "min_acceptance_rate": [1.5, -0.1, "most", float("nan"), "50%"],
}


def test_every_budget_has_valid_and_invalid_examples() -> None:
    assert set(VALID_BUDGETS) == set(BUDGETS) == set(INVALID_BUDGETS)


@pytest.mark.parametrize(("name", "value", "expected"),
                         [(n, v, e) for n, cases in VALID_BUDGETS.items() for v, e in cases])
def test_parse_budget_accepts(name: str, value: Any, expected: float) -> None:
    assert parse_budget(name, value, "@pytest.mark.optimization") == pytest.approx(expected)


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, values in INVALID_BUDGETS.items() for v in values])
def test_parse_budget_rejects_naming_budget_and_origin(name: str, value: Any) -> None:
    with pytest.raises(OptConfigError) as info:
        parse_budget(name, value, "ini opt_" + name)
    message = str(info.value)
    assert f"budget {name}" in message and f"ini opt_{name}" in message


@pytest.mark.parametrize(("typo", "suggestion"), [("max_latncy", "max_latency"), ("min_speed_up", "min_speedup"),
                                                  ("maxkl", "max_kl"), ("max_mem", "max_memory")])
def test_parse_budget_unknown_name_suggests_the_closest(typo: str, suggestion: str) -> None:
    with pytest.raises(OptConfigError) as info:
        parse_budget(typo, 1, "@pytest.mark.optimization")
    message = str(info.value)
    assert f"unknown budget {typo!r}" in message and f"Did you mean {suggestion!r}" in message
    assert all(name in message for name in BUDGETS)  # the accepted names


@PROPERTY
@given(st.sampled_from(sorted(BUDGETS)), anything)
def test_parse_budget_only_ever_raises_opt_config_error(name: str, value: Any) -> None:
    try:
        result = parse_budget(name, value, "marker")
    except OptConfigError as exc:
        assert f"budget {name}" in str(exc)
        return
    assert isinstance(result, float) and math.isfinite(result) and result >= 0


# --- loading.parse_dtype ---------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "expected"), [
    ("float32", torch.float32), ("fp32", torch.float32), ("float", torch.float32), ("bfloat16", torch.bfloat16),
    ("bf16", torch.bfloat16), ("BF16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
    ("float16", torch.float16), ("fp16", torch.float16), ("half", torch.float16), ("auto", "auto"),
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
])
def test_parse_dtype_accepts(value: Any, expected: Any) -> None:
    assert parse_dtype(value, "opt_model dtype") == expected


@pytest.mark.parametrize("value", ["int7", "", "float8", "float64x", 7, None, True, 16.0, ["bf16"]])
def test_parse_dtype_rejects_naming_accepted(value: Any) -> None:
    _rejects(parse_dtype, value, "opt_model dtype", "float32", "bfloat16", "float16", "auto", what="opt_model dtype")


@pytest.mark.parametrize("value", [torch.int8, torch.bool, torch.int64])
def test_parse_dtype_rejects_non_float_torch_dtypes(value: Any) -> None:
    """A model cannot be loaded in an integer dtype; torch dtypes get the same check as names."""
    _rejects(parse_dtype, value, "opt_model dtype", what="opt_model dtype")


@PROPERTY
@given(st.text(max_size=12))
def test_parse_dtype_random_text(value: str) -> None:
    try:
        result = parse_dtype(value)
    except OptConfigError as exc:
        assert "accepted" in str(exc)
        return
    assert result in (torch.float32, torch.bfloat16, torch.float16, "auto")


# --- options parsers -------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", " cpu "])
def test_device_accepts(value: str) -> None:
    assert _device(value) == value.strip()


@pytest.mark.parametrize("value", ["tpu", "", "cuda:", "cuda:x", "cuda:-1", "gpu", "cuda:0:1", "mps:0", "cuda:٣"])
def test_device_rejects_naming_accepted(value: str) -> None:
    _rejects(_device, value, "auto, cpu, cuda, cuda:N")


@PROPERTY
@given(st.one_of(st.text(max_size=10), st.builds(lambda s: "cuda:" + s, st.text(max_size=4))))
@example("cuda:٣")
def test_device_accepts_exactly_the_documented_forms(value: str) -> None:
    try:
        result = _device(value)
    except OptConfigError:
        assert not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value.strip())
        return
    assert re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", result)


@pytest.mark.parametrize("value", ["enforce", "warn", "off"])
def test_mode_accepts(value: str) -> None:
    assert _mode(value) == value


@PROPERTY
@given(st.text(max_size=10).filter(lambda s: s not in ("enforce", "warn", "off")))
@example("sometimes")
@example("Enforce")
def test_mode_rejects_everything_else(value: str) -> None:
    _rejects(_mode, value, "enforce, warn, off")


@pytest.mark.parametrize(("value", "expected"), [("sdpa", ("sdpa",)), ("sdpa,bnb_4bit", ("sdpa", "bnb_4bit")),
                                                 (" sdpa , ,bnb_4bit ", ("sdpa", "bnb_4bit")), ("all", ("all",))])
def test_names_accepts(value: str, expected: tuple[str, ...]) -> None:
    assert _names(value) == expected


@pytest.mark.parametrize("value", ["", " ", ",", " , ,"])
def test_names_rejects_empty(value: str) -> None:
    _rejects(_names, value, "NAME[,NAME] or all")


@PROPERTY
@given(st.lists(st.from_regex(r"\A[a-z_][a-z0-9_]{0,12}\Z"), min_size=1, max_size=5))
def test_names_round_trip(names: list[str]) -> None:
    assert _names(",".join(names)) == tuple(names)
    assert _names(" , ".join(names) + ",") == tuple(names)


@PROPERTY
@given(st.integers(min_value=-5, max_value=10**6))
def test_rounds_and_warmup(n: int) -> None:
    if 1 <= n <= MAX_ROUNDS:
        assert _rounds(str(n)) == RoundsRule(n)  # a fixed count
    else:
        _rejects(_rounds, str(n), "rounds", f">= 1 and <= {MAX_ROUNDS}")
    if 0 <= n <= MAX_WARMUP:
        assert _warmup(str(n)) == n
    else:
        _rejects(_warmup, str(n), "warm-up rounds", f">= 0 and <= {MAX_WARMUP}")


@pytest.mark.parametrize("value", ["x", "1.5", "", "one", "--1", "²"])
def test_rounds_rejects_non_integers(value: str) -> None:
    _rejects(_rounds, value, "rounds", ">= 1")


def test_every_option_has_help_env_and_the_documented_flags() -> None:
    documented = {"--opt-report", "--opt-report-json", "--opt-report-md", "--opt-report-html", "--opt-model",
                  "--opt-device", "--opt-require", "--opt-budgets", "--opt-baselines", "--opt-update-baselines",
                  "--opt-compare", "--opt-compare-fail", "--opt-gpus-per-worker", "--opt-techniques", "--opt-rounds",
                  "--opt-warmup"}
    assert documented <= {o.flag for o in OPTIONS}
    for option in OPTIONS:
        assert option.help.strip(), option.flag
        # flags that act (rewrite baselines, print and exit) have no environment twin
        if option.flag in ("--opt-update-baselines", "--opt-techniques"):
            assert option.env is None, option.flag
        else:
            assert re.fullmatch(r"PYTEST_OPT_[A-Z_]+", option.env or ""), option.env


# --- technique parameters --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def registry() -> Any:
    return build_registry()


def _resolve_rejects(registry: Any, spec: Any, *fragments: str) -> str:
    with pytest.raises(OptConfigError) as info:
        registry.resolve(spec, "@pytest.mark.optimization")
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


@pytest.mark.parametrize("spec", [
    "sdpa", "eager", techniques.static_cache(), techniques.compile(), techniques.compile(mode="reduce-overhead"),
    techniques.quantized_cache(), techniques.quantized_cache(backend="hqq", nbits=8),
    techniques.quantized_cache(backend="quanto", nbits=2, residual_length=64), techniques.bnb_4bit(),
    techniques.bnb_4bit(quant_type="fp4", compute_dtype=torch.bfloat16), techniques.bnb_8bit(),
    techniques.tensor_parallel(tp_size=4), techniques.continuous_batching(max_batch_tokens=1),
    techniques.hub_kernel("kernels-community/flash-attn2"), "kernels-community/flash-attn2",
])
def test_resolve_accepts_documented_specs(registry: Any, spec: Any) -> None:
    technique = registry.resolve(spec)
    assert isinstance(technique, Technique)
    expected = spec if isinstance(spec, str) else str(spec)
    assert technique.label() == expected or technique.name == expected


@pytest.mark.parametrize(("spec", "fragments"), [
    (techniques.quantized_cache(backend="foo"), ["quantized_cache", "'foo'", "'quanto', 'hqq'"]),
    (techniques.quantized_cache(nbits=3), ["quantized_cache", "nbits=3", "(2, 4)"]),
    (techniques.quantized_cache(backend="hqq", nbits=9), ["nbits=9", "'hqq'"]),
    (techniques.quantized_cache(nbits=True), ["nbits=True"]),
    (techniques.bnb_4bit(quant_type="int3"), ["bnb_4bit", "'int3'", "'nf4', 'fp4'"]),
    (techniques.tensor_parallel(tp_size=1), ["tensor_parallel", "tp_size=1", "int >= 2"]),
    (techniques.tensor_parallel(tp_size=True), ["tp_size=True"]),
    (techniques.tensor_parallel(tp_size=2.0), ["tp_size=2.0"]),
    (techniques.continuous_batching(max_batch_tokens=0), ["continuous_batching", "max_batch_tokens=0", "int > 0"]),
    (techniques.continuous_batching(max_batch_tokens="many"), ["max_batch_tokens='many'"]),
    (TechniqueSpec.of("sdpa", window=4), ["technique sdpa", "unknown parameter(s) window", "accepted: none"]),
    (techniques.bnb_4bit(bits=4), ["unknown parameter(s) bits", "quant_type", "compute_dtype"]),
    (TechniqueSpec.of("hub_kernel"), ["repo_id", "'org/name'"]),
    (42, ["@pytest.mark.optimization", "42 is not a technique", "'sdpa'"]),
    (None, ["None is not a technique"]),
    ("sdp", ["unknown technique 'sdp'", "Did you mean 'sdpa'?", "kernels-community/flash-attn2"]),
    ("static-cache", ["Did you mean 'static_cache'?"]),
])
def test_resolve_rejects_bad_specs(registry: Any, spec: Any, fragments: list[str]) -> None:
    _resolve_rejects(registry, spec, *fragments)


@PROPERTY
@given(st.sampled_from(["quanto", "hqq"]), st.one_of(st.integers(min_value=-2, max_value=12), st.booleans(),
                                                       st.sampled_from([4.0, 2.0, "4", None])))
def test_quantized_cache_nbits_accepted_exactly_per_backend(backend: str, nbits: Any) -> None:
    allowed = (2, 4) if backend == "quanto" else tuple(range(1, 9))
    spec = techniques.quantized_cache(backend=backend, nbits=nbits)
    ok = isinstance(nbits, int) and not isinstance(nbits, bool) and nbits in allowed
    if ok:
        assert build_registry().resolve(spec).params["nbits"] == nbits
    else:
        _resolve_rejects(build_registry(), spec, "nbits", repr(backend))


@PROPERTY
@given(st.one_of(st.integers(min_value=-3, max_value=64), st.booleans(), st.floats(), st.text(max_size=3)))
def test_tensor_parallel_and_continuous_batching_sizes(value: Any) -> None:
    registry = build_registry()
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if is_int and value >= 2:
        assert registry.resolve(techniques.tensor_parallel(tp_size=value)).params["tp_size"] == value
    else:
        _resolve_rejects(registry, techniques.tensor_parallel(tp_size=value), "tp_size")
    if is_int and value > 0:
        batching = registry.resolve(techniques.continuous_batching(max_batch_tokens=value))
        assert batching.params["max_batch_tokens"] == value
    else:
        _resolve_rejects(registry, techniques.continuous_batching(max_batch_tokens=value), "max_batch_tokens")


@PROPERTY
@given(st.text(max_size=20))
def test_resolve_random_names_only_raise_opt_config_error(name: str) -> None:
    registry = build_registry()
    try:
        technique = registry.resolve(name)
    except OptConfigError as exc:
        assert "technique" in str(exc)
        return
    assert name in registry or "/" in name
    assert isinstance(technique, Technique)


@pytest.mark.parametrize(("names", "fragments"), [
    (["sdpa", "eager"], ["sdpa and eager conflict", "attention implementation"]),
    (["bnb_4bit", "bnb_8bit"], ["bnb_4bit and bnb_8bit conflict", "weight quantization"]),
    (["static_cache", "offloaded_cache"], ["static_cache and offloaded_cache conflict", "KV cache"]),
    (["compile", techniques.quantized_cache()], ["compile and quantized_cache", "compileable (static) cache"]),
    (["continuous_batching", "compile"], ["continuous_batching and compile conflict",
                                         "generate_batch()"]),
    (["sdpa", "sdpa"], ["technique 'sdpa' is given twice"]),
])
def test_check_stack_conflicts(registry: Any, names: list[Any], fragments: list[str]) -> None:
    stack = [registry.resolve(n) for n in names]
    with pytest.raises(OptTechniqueConflict) as info:
        check_stack(stack, "@pytest.mark.optimization")
    for fragment in ["@pytest.mark.optimization", *fragments]:
        assert fragment in str(info.value)


@pytest.mark.parametrize("names", [["sdpa", "static_cache"], ["compile"], ["bnb_4bit", "sdpa", "static_cache"],
                                   ["eager", techniques.quantized_cache()]])
def test_check_stack_accepts_compatible_techniques(registry: Any, names: list[Any]) -> None:
    check_stack([registry.resolve(n) for n in names])


def test_register_rejects_a_taken_name_unless_replace() -> None:
    class MySdpa(Technique):
        name = "sdpa"
        summary = "a project's own sdpa"

    registry = build_registry()
    with pytest.raises(OptConfigError) as info:
        registry.register(MySdpa)
    assert "'sdpa' is already registered" in str(info.value) and "replace=True" in str(info.value)
    registry.register(MySdpa, replace=True)
    assert isinstance(registry.resolve("sdpa"), MySdpa)


@pytest.mark.parametrize("candidate", [object, int, "sdpa", None, type("Nameless", (Technique,), {})])
def test_register_rejects_what_is_not_a_named_technique(candidate: Any) -> None:
    with pytest.raises(OptConfigError) as info:
        build_registry().register(candidate)
    assert "is not a Technique subclass with a `name`" in str(info.value)


def test_register_new_technique_resolves_by_name() -> None:
    class NoRepeatTrigrams(Technique):
        name = "no_repeat_trigrams"
        family = "generation"
        summary = "forbid repeated trigrams"

    registry = build_registry()
    registry.register(NoRepeatTrigrams)
    assert "no_repeat_trigrams" in registry.names()
    assert isinstance(registry.resolve("no_repeat_trigrams"), NoRepeatTrigrams)
    _resolve_rejects(registry, TechniqueSpec.of("no_repeat_trigrams", n=3), "unknown parameter(s) n")
