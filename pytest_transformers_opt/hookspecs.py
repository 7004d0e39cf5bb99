"""Hooks that projects implement in a conftest.py to extend the plugin."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec
def pytest_opt_register_techniques(registry: Any) -> None:
    """Register project techniques in the catalogue, before the first test sets up.

    ``registry.register(MyTechnique)`` adds a ``Technique`` subclass under its ``name``; markers can
    then name it like a built-in one. Mark the implementation ``optionalhook=True`` so that the conftest
    still loads when the plugin is disabled (``pytest -p no:transformers_opt``). Example (conftest.py)::

        import pytest
        from pytest_transformers_opt.techniques import Technique

        class GreedyStop(Technique):
            name = "greedy_stop"
            family = "generation"
            summary = "stop on the first EOS"

            def configure_generation(self, gen, ctx):
                gen.kwargs["min_new_tokens"] = 0

        @pytest.hookimpl(optionalhook=True)
        def pytest_opt_register_techniques(registry):
            registry.register(GreedyStop)
    """


@pytest.hookspec
def pytest_opt_report_extra(config: pytest.Config, report: dict[str, Any]) -> None:
    """Add fields to the report before it is written (every format, and a later ``--opt-compare``, reads them).

    Put run-wide fields under ``report["extra"]`` and per-test ones under ``test["extra"]`` for a test of
    ``report["tests"]``; any other new key makes the report invalid, and the report is then written
    without this hook's fields. Values are made JSON-safe by one rule: NaN and infinity become null, a
    path its text, a set a sorted list; anything else JSON cannot hold is left out, named in one line.
    A hook that raises is named in one line of the terminal summary, and the report is written without
    its fields. Mark it ``optionalhook=True``, as above. Example (conftest.py)::

        import os
        import pytest

        @pytest.hookimpl(optionalhook=True)
        def pytest_opt_report_extra(config, report):
            report["extra"] = {"commit": os.environ.get("GITHUB_SHA")}
            for test in report["tests"]:
                test.setdefault("extra", {})["ticket"] = "OPT-12"
    """
