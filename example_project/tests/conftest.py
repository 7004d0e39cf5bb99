"""Project conftest: registers a team-specific technique next to the built-in catalogue."""

import pytest
from pytest_transformers_opt.techniques import Technique


class NoRepeatTrigrams(Technique):
    """A project technique: the decoding constraint ``no_repeat_ngram_size=3``, passed to every generate() call
    of a configuration that uses it."""

    name = "no_repeat_trigrams"
    family = "generation"
    summary = "forbid repeated trigrams (a decoding constraint the team ships in production)"

    def configure_generation(self, gen, ctx):
        gen.kwargs["no_repeat_ngram_size"] = 3


# optional: without it, `pytest -p no:transformers_opt` stops at this conftest ("unknown hook")
@pytest.hookimpl(optionalhook=True)
def pytest_opt_register_techniques(registry):
    registry.register(NoRepeatTrigrams)
