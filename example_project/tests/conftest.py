"""Project conftest: registers a team-specific technique next to the built-in catalogue."""

from pytest_transformers_opt.techniques import Technique


class ShortPrefillChunks(Technique):
    """Example of a project technique: generation-time option applied to every generate() call."""

    name = "no_repeat_trigrams"
    family = "generation"
    summary = "forbid repeated trigrams (a decoding constraint the team ships in production)"

    def configure_generation(self, gen, ctx):
        gen.kwargs["no_repeat_ngram_size"] = 3


def pytest_opt_register_techniques(registry):
    registry.register(ShortPrefillChunks)
