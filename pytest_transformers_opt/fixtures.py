"""The public fixtures: ``opt_bench``, ``opt_model``, ``opt_baseline_model``, ``opt_hardware``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import pytest

from .errors import OptConfigError, OptLoadError
from .session import SESSION_KEY, OptSession

# the stages are imported when a test first asks for a fixture: a session that uses none never loads them
if TYPE_CHECKING:
    from .engine.hardware import HardwareInfo
    from .engine.model import OptModel
    from .plan import TestPlan
    from .verdict.results import OptResult


T = TypeVar("T")


def _or_fail(action: Callable[[], T]) -> T:
    """Run ``action``; bad user input becomes this test's failure with the message alone (no traceback)."""
    try:
        return action()
    except (OptConfigError, OptLoadError) as exc:
        message = str(exc)
    pytest.fail(message, pytrace=False)  # outside the except block: no chained traceback


def _session(request: pytest.FixtureRequest) -> OptSession:
    return request.config.stash[SESSION_KEY]


@pytest.fixture(scope="session")
def opt_hardware(request: pytest.FixtureRequest) -> HardwareInfo:
    """What was probed: device, name, compute capability, memory, device count, bf16, package versions."""
    return _session(request).hardware


@pytest.fixture
def opt_plan(request: pytest.FixtureRequest) -> TestPlan:
    """The test's markers resolved and probed; bad input errors here, unsupported techniques skip here."""
    from .engine.heavy_imports import import_stack
    from .plan import build_plan, skip_unsupported

    import_stack()  # usually done before the first test; here when a test asked through getfixturevalue
    session = _session(request)
    # recorded from here on, however the test asked for the fixture (parameter or getfixturevalue)
    record = session.record(request.node.nodeid)
    plan = _or_fail(lambda: build_plan(request.node, session))
    record.plan = plan
    _or_fail(lambda: skip_unsupported(plan, session.settings.require))  # before any model is loaded
    return plan


def _load(request: pytest.FixtureRequest, plan: TestPlan, optimized: bool) -> OptModel:
    session = _session(request)
    side = plan.optimized if optimized else plan.baseline
    return _or_fail(lambda: session.opt_model(plan, side))


@pytest.fixture
def opt_model(request: pytest.FixtureRequest, opt_plan: TestPlan) -> OptModel:
    """``OptModel`` of the test's optimized configuration (models are cached per session)."""
    return _load(request, opt_plan, optimized=True)


@pytest.fixture
def opt_baseline_model(request: pytest.FixtureRequest, opt_plan: TestPlan) -> OptModel:
    """``OptModel`` of the baseline configuration (cached per session)."""
    return _load(request, opt_plan, optimized=False)


@pytest.fixture
def opt_bench(request: pytest.FixtureRequest, opt_plan: TestPlan, opt_model: OptModel
              ) -> Iterator[Callable[..., OptResult]]:
    """``opt_bench(prompts=None, *, max_new_tokens=None, batch_size=None, rounds=None, warmup=None) -> OptResult``."""
    from .verdict.bench import build_workload, enforce_budgets, judge_budgets, run_bench

    session = _session(request)
    record = session.record(request.node.nodeid)
    if not opt_plan.declared:
        pytest.fail("opt_bench measures an optimization against the baseline: mark the test with "
                    "@pytest.mark.optimization(\"TECHNIQUE\", ...) naming what to measure", pytrace=False)

    def bench(prompts: Any = None, *, max_new_tokens: Any = None, batch_size: Any = None, rounds: Any = None,
              warmup: Any = None) -> OptResult:
        workload = _or_fail(lambda: build_workload(session, opt_model, prompts, max_new_tokens, batch_size, rounds,
                                                   warmup))
        def baseline() -> OptModel:  # loaded only when no usable stored baseline replaces it
            return _load(request, opt_plan, optimized=False)

        # no local keeps the measurement: its remeasure closure holds models and runs
        result = judge_budgets(session, opt_plan, _or_fail(lambda: run_bench(session, opt_plan, baseline, opt_model,
                                                                             workload)))
        record.results.append(result)  # every call is a row of the report
        enforce_budgets(session, opt_plan, result)
        return result

    yield bench
