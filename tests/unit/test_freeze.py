"""What the garbage collector scans: the process freezes what it imported before each test, freezes nothing
where nothing was imported, and a model that a freeze found cached is still collected when the cache evicts it
(engine/measure.py, engine/loading.py)."""

from __future__ import annotations

import gc
import sys
import types
import weakref

import pytest
import torch

from pytest_transformers_opt.engine import measure
from pytest_transformers_opt.engine.loading import ModelCache
from pytest_transformers_opt.engine.model import LoadedModel


def _unfrozen(obj: object) -> bool:
    """The collector still scans ``obj`` (gc.get_objects lists the generations, never the frozen ones)."""
    return any(other is obj for other in gc.get_objects())


def test_what_a_test_imported_is_frozen_before_the_next_and_nothing_when_nothing_was(
        monkeypatch: pytest.MonkeyPatch) -> None:
    measure.freeze_long_lived_objects()
    frozen = gc.get_freeze_count()
    made_later = [object() for _ in range(3)]  # a test's own objects: nothing imported since, nothing frozen
    measure.freeze_long_lived_objects()
    assert gc.get_freeze_count() == frozen and _unfrozen(made_later)

    module = types.ModuleType("opt_freeze_probe")
    exec("def forward(x):\n    return x\n", module.__dict__)  # a module's function, as an import makes it
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert _unfrozen(module.forward)
    measure.freeze_long_lived_objects()
    assert not _unfrozen(module.forward) and gc.get_freeze_count() > frozen


class _CycleModel(torch.nn.Module):
    """A model its reference count cannot free (it refers to itself), as compiled graphs or hooks can make one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)
        self.__dict__["itself"] = self


def _loaded(model: torch.nn.Module, key: tuple[str, ...]) -> LoadedModel:
    return LoadedModel(key=key, model=model, tokenizer=None, path="", load_time_s=0.0, load_peak_bytes=None,
                       resident_bytes=None, memory_method="test", load_techniques=())


@pytest.mark.parametrize("cycle", [True, False], ids=["in-a-reference-cycle", "freed-by-its-count"])
def test_a_model_frozen_while_cached_is_collected_when_evicted(monkeypatch: pytest.MonkeyPatch, cycle: bool) -> None:
    thaws = []
    monkeypatch.setattr(gc, "unfreeze", lambda _real=gc.unfreeze: (thaws.append(1), _real())[1])
    cache = ModelCache("cpu", max_models=1)
    model = _CycleModel() if cycle else torch.nn.Linear(64, 64)
    alive = weakref.ref(model)
    cache.get(("m",), lambda: _loaded(model, ("m",)))
    del model
    # a later test imported a module: the next test's setup freezes everything alive, the cached model too
    name = f"opt_freeze_probe_{cycle}"
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    measure.freeze_long_lived_objects()
    assert alive() is not None and not _unfrozen(alive())

    cache.get(("other",), lambda: _loaded(torch.nn.Linear(2, 2), ("other",)))  # evicts the first
    assert alive() is None  # collected: not kept by the freeze
    assert len(thaws) == (1 if cycle else 0)  # a model its count freed costs no full collection
