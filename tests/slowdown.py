"""A user's technique that makes every forward pass slower by a known factor, as source for a test's conftest.

It busy-waits after each forward for ``factor`` times the forward's own time: a slower kernel, as the
verdict tests and the verdict study inject one.
"""

from __future__ import annotations


def slowdown_technique(class_name: str, name: str, factor: float) -> str:
    """The source of a ``Technique`` subclass ``class_name`` (catalogue name ``name``) that makes each
    forward pass ``factor + 1`` times as long; the conftest imports ``contextlib``, ``time`` and ``Technique``."""
    return f'''
class {class_name}(Technique):
    """Busy-waits {factor} times each forward pass: a slower kernel."""
    name = "{name}"
    family = "test"
    summary = "injected slowdown"

    @contextlib.contextmanager
    def around_generate(self, model):
        started = []

        def before(module, args, kwargs):
            started.append(time.perf_counter())

        def after(module, args, kwargs, output):
            until = time.perf_counter() + {factor} * (time.perf_counter() - started.pop())
            while time.perf_counter() < until:
                pass

        handles = [model.register_forward_pre_hook(before, with_kwargs=True),
                   model.register_forward_hook(after, with_kwargs=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
'''


def sleepy_technique(pause: str = "0.02") -> str:
    """The source of a ``Technique`` subclass ``Sleepy`` (catalogue name ``sleepy``) whose every generate lasts
    ``pause`` seconds (a Python expression, read at each generate) per forward pass: it pads the call with a sleep to
    that length, so rounds are of a steady length whatever else the machine does (the work itself, a few ms per
    forward, slows down on a busy machine; a pause added to it would carry that noise). The conftest imports
    ``contextlib``, ``time`` and ``Technique``."""
    return f'''
class Sleepy(Technique):
    """Pads every generate to a steady length: a fixed pause per forward pass, on a busy machine too."""
    name = "sleepy"
    family = "test"
    summary = "pads every generate to a fixed pause per forward pass"

    @contextlib.contextmanager
    def around_generate(self, model):
        pause = {pause}
        calls = []
        handle = model.register_forward_pre_hook(lambda module, args: calls.append(None))
        started = time.perf_counter()
        try:
            yield
        finally:
            handle.remove()
            remaining = started + pause * len(calls) - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
'''


def sleepy_conftest(prelude: str = "", pause: str = "0.02") -> str:
    """A whole conftest registering ``sleepy_technique(pause)``; ``prelude`` (module-level lines after the
    imports) may define what ``pause`` reads."""
    return ("import contextlib\nimport sys\nimport time\n\nfrom pytest_transformers_opt.techniques import Technique\n"
            + prelude + sleepy_technique(pause)
            + "\n\ndef pytest_opt_register_techniques(registry):\n    registry.register(Sleepy)\n")
