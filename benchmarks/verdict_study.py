"""Verdict study: can the plugin's gate be trusted on this machine?

Runs real pytest sessions with the plugin against the built-in model and counts verdicts:

* null A/B runs: the same configuration on both sides (a registered no-op technique), gated with
  ``min_speedup=1.0`` and ``max_memory_ratio=1.0`` ("not slower, not larger"): every failure is a
  false alarm;
* injected slowdowns of 5, 10, 20 and 50 percent (a technique that busy-waits that fraction of each
  forward pass), gated with ``min_speedup=1.0``: every failure is a detection;
* injected breakage: NaN logits, one changed token, a silent fallback (compile requested, never
  run): each must fail every time.

Usage: ``python benchmarks/verdict_study.py [--null 100] [--slow 25] [--broken 10] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CONFTEST = textwrap.dedent('''
    import contextlib
    import time

    import torch

    from pytest_transformers_opt.techniques import Technique
    from pytest_transformers_opt.techniques.catalogue import Compile


    class NullAB(Technique):
        """Changes nothing: both sides run the same configuration."""
        name = "null_ab"
        family = "study"
        summary = "no-op"


    class SlowDown(Technique):
        """Busy-waits pct percent of every forward pass, like a slower kernel would."""
        name = "slowdown"
        family = "study"
        summary = "injected slowdown"
        accepted_params = {"pct": "percent"}

        @contextlib.contextmanager
        def around_generate(self, model):
            started = []
            factor = self.params["pct"] / 100.0

            def before(module, args, kwargs):
                started.append(time.perf_counter())

            def after(module, args, kwargs, output):
                elapsed = time.perf_counter() - started.pop()
                until = time.perf_counter() + elapsed * factor
                while time.perf_counter() < until:
                    pass

            handles = [model.register_forward_pre_hook(before, with_kwargs=True),
                       model.register_forward_hook(after, with_kwargs=True)]
            try:
                yield
            finally:
                for handle in handles:
                    handle.remove()


    @contextlib.contextmanager
    def lm_head_hook(model, hook):
        handle = model.lm_head.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()


    class NanLogits(Technique):
        name = "nan_logits"
        family = "study"
        summary = "injected NaN logits"

        def around_generate(self, model):
            return lm_head_hook(model, lambda m, a, out: out * float("nan"))


    class ChangedToken(Technique):
        """At the third decoding step, the top token loses: one changed token."""
        name = "changed_token"
        family = "study"
        summary = "injected token change"

        def around_generate(self, model):
            calls = [0]

            def hook(module, args, out):
                calls[0] += 1
                if calls[0] == 3:
                    out = out.clone()
                    top = out[:, -1, :].argmax(-1)
                    out[torch.arange(out.shape[0]), -1, top] = -1e4
                return out

            return lm_head_hook(model, hook)


    class CompileFallback(Compile):
        """Asks for compile, but generation silently runs eager."""
        name = "compile_fallback"

        def configure_generation(self, gen, ctx):
            super().configure_generation(gen, ctx)
            gen.kwargs["disable_compile"] = True


    def pytest_opt_register_techniques(registry):
        for technique in (NullAB, SlowDown, NanLogits, ChangedToken, CompileFallback):
            registry.register(technique)
''')


def _tests(null: int, slow: int, broken: int) -> str:
    return textwrap.dedent(f'''
        import pytest
        from pytest_transformers_opt.techniques import TechniqueSpec

        def _cases(marker, runs, label):
            return [pytest.param(run, marks=marker, id=f"{{label}}-{{run}}") for run in range(runs)]

        NULL = _cases(pytest.mark.optimization("null_ab", min_speedup=1.0, max_memory_ratio=1.0), {null}, "null")
        SLOW = [case for pct in (5, 10, 20, 50) for case in _cases(
            pytest.mark.optimization(TechniqueSpec.of("slowdown", pct=pct), min_speedup=1.0), {slow}, f"slow{{pct}}")]
        BROKEN = [case for kind in ("nan_logits", "changed_token", "compile_fallback")
                  for case in _cases(pytest.mark.optimization(kind), {broken}, kind)]

        @pytest.mark.parametrize("run", NULL + SLOW + BROKEN)
        def test_case(opt_bench, run):
            opt_bench()
    ''')


def run_study(null: int, slow: int, broken: int, extra_args: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="verdict-study-") as folder:
        root = Path(folder)
        (root / "conftest.py").write_text(CONFTEST)
        (root / "test_study.py").write_text(_tests(null, slow, broken))
        report = root / "report.json"
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                        f"--opt-report-json={report}", *extra_args, "test_study.py"],
                       cwd=root, check=False, stdout=subprocess.DEVNULL, env=os.environ.copy())
        elapsed = time.perf_counter() - started
        data = json.loads(report.read_text())
    tally: dict[str, list[int]] = {}
    for test in data["tests"]:
        label = test["nodeid"].split("[")[1].rsplit("-", 1)[0]
        group = f"slowdown {label[4:]}%" if label.startswith("slow") else label
        failed = test["outcome"] in ("failed", "error")
        tally.setdefault(group, [0, 0])
        tally[group][0] += failed
        tally[group][1] += 1
    return {"tally": tally, "seconds": elapsed, "settings": data["settings"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--null", type=int, default=100)
    parser.add_argument("--slow", type=int, default=25, help="runs per injected slowdown")
    parser.add_argument("--broken", type=int, default=10, help="runs per injected breakage")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, e.g. --opt-rounds=7")
    args = parser.parse_args(argv)
    result = run_study(args.null, args.slow, args.broken, args.pytest_args)
    settings = result["settings"]
    lines = [f"rounds={settings['rounds']} warmup={settings['warmup']} ({result['seconds']:.0f} s)", "",
             "| scenario | failed / runs | meaning |", "| --- | --- | --- |"]
    order = ["null"] + [f"slowdown {p}%" for p in (5, 10, 20, 50)] + ["nan_logits", "changed_token", "compile_fallback"]
    meaning = {"null": "false alarms", "nan_logits": "caught", "changed_token": "caught", "compile_fallback": "caught"}
    for group in order:
        if group in result["tally"]:
            failed, total = result["tally"][group]
            lines.append(f"| {group} | {failed} / {total} | {meaning.get(group, 'caught')} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
