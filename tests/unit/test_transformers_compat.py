"""What compat.py bridges between the transformers versions the plugin supports (5.17 to today's)."""

from __future__ import annotations

import dataclasses

import pytest

from pytest_transformers_opt import compat


@dataclasses.dataclass
class _BlockSizeConfig:  # transformers 5.17-5.20's ContinuousBatchingConfig: tokens per block are block_size
    block_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None


@dataclasses.dataclass
class _PageSizeConfig:  # 5.21 and later: page_size
    page_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None


@pytest.mark.parametrize("config_class, field", [(_BlockSizeConfig, "block_size"), (_PageSizeConfig, "page_size")])
def test_continuous_batching_config_takes_page_size_on_every_version(monkeypatch, config_class, field) -> None:
    import transformers.generation

    monkeypatch.setattr(transformers.generation, "ContinuousBatchingConfig", config_class)
    config, page_size = compat.continuous_batching_config({"page_size": 32, "num_blocks": 5})
    assert isinstance(config, config_class) and getattr(config, field) == 32 and page_size == 32
    assert config.num_blocks == 5
    assert compat.continuous_batching_page_size({}) == 256  # the installed version's default
    assert compat.continuous_batching_page_size({"page_size": 16}) == 16


def test_the_installed_transformers_accepts_the_bridged_config() -> None:
    config, page_size = compat.continuous_batching_config({"page_size": 64, "num_blocks": 3, "max_batch_tokens": 15})
    assert page_size == 64 and config.num_blocks == 3
