"""Hooks that projects implement in a conftest.py to extend the plugin."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec
def pytest_opt_register_techniques(registry: Any) -> None:
    """Register project techniques in the catalogue, before the first test sets up.

    ``registry.register(MyTechnique)`` adds a ``Technique`` subclass under its ``name``; markers can
    then name it like a built-in one. Example (conftest.py)::

        from pytest_transformers_opt.techniques import Technique

        class GreedyStop(Technique):
            name = "greedy_stop"
            family = "generation"
            summary = "stop on the first EOS"

            def configure_generation(self, gen, ctx):
                gen.kwargs["min_new_tokens"] = 0

        def pytest_opt_register_techniques(registry):
            registry.register(GreedyStop)
    """


@pytest.hookspec
def pytest_opt_report_extra(config: pytest.Config, report: dict[str, Any]) -> None:
    """Add fields to the JSON report before it is written: put them under ``report["extra"]``."""
