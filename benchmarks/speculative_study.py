"""Speculative decoding on the real model ``smollm2-135m`` (issue 22, item 3): speedup with its interval and
acceptance rate of ``prompt_lookup`` and ``assisted_decoding``, measured by the plugin itself.

The draft for ``assisted_decoding`` is built offline from the installed model: a layer-truncated copy of
SmolLM2-135M (the layers named by ``--draft-layers``, then the model's own final norm and tied lm_head), so
it shares the tokenizer exactly; it is saved once under the plugin's model cache. No network.

Each technique runs in a real pytest session (``--opt-model=smollm2-135m``, budgets in warn mode so every
figure is reported), on a prompt whose continuation repeats its input (code that is to be copied again, the
case prompt lookup is made for) and, for prompt lookup, on plain questions; the rows are read from the JSON report.

``python benchmarks/speculative_study.py [--rounds 5] [--max-new-tokens 24] [--draft-layers 0-5] [-k EXPR]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPEATING = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n"
             "# the same three functions again, unchanged:\n\ndef add(a, b):")
QUESTIONS = ("Explain gravity in one sentence.", "Name the capital of France.")


def parse_layers(text: str) -> list[int]:
    """``0-5`` or ``0-2,27-29`` -> layer indexes."""
    layers: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        layers.extend(range(int(low), int(high or low) + 1))
    return layers


def build_draft(source: str, layers: list[int]) -> str:
    """A layer-truncated copy of the model in ``source`` (same tokenizer, embeddings, final norm and lm_head),
    saved once in the plugin's cache; returns its folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pytest_transformers_opt.engine.tiny_models import cache_root

    name = "smollm2-135m-draft-layers-" + "_".join(str(i) for i in layers)
    folder = cache_root() / name
    if (folder / "config.json").is_file():
        return str(folder)
    print(f"building the draft {name} from {source}", flush=True)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in layers])
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = index  # the cache is indexed by position in the new stack
    model.config.num_hidden_layers = len(layers)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in layers]
    staging = Path(tempfile.mkdtemp(prefix=name, dir=cache_root()))
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(source).save_pretrained(staging)
    staging.rename(folder)
    return str(folder)


def user_tests(draft: str, max_new_tokens: int) -> str:
    return textwrap.dedent(f'''
        import pytest
        from pytest_transformers_opt import techniques

        pytestmark = pytest.mark.opt_model("smollm2-135m")
        WORKLOADS = {{"repeating": [{REPEATING!r}], "questions": {list(QUESTIONS)!r}}}

        @pytest.mark.parametrize("workload", list(WORKLOADS))
        @pytest.mark.optimization(techniques.prompt_lookup())
        def test_prompt_lookup(opt_bench, workload):
            opt_bench(WORKLOADS[workload], max_new_tokens={max_new_tokens})

        @pytest.mark.optimization(techniques.assisted_decoding({draft!r}))
        def test_assisted_decoding(opt_bench):
            opt_bench(WORKLOADS["repeating"], max_new_tokens={max_new_tokens})
    ''')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--draft-layers", default="0-5", help="the layers of smollm2-135m the draft keeps")
    parser.add_argument("-k", dest="select", default="", help="only the tests pytest -k selects (e.g. assisted)")
    args = parser.parse_args()
    from pytest_transformers_opt.engine.real_models import RealModelUnavailable, ensure_real_model

    try:
        source = str(ensure_real_model("smollm2-135m"))
    except RealModelUnavailable as exc:
        raise SystemExit(exc.reason) from exc
    draft = build_draft(source, parse_layers(args.draft_layers))
    with tempfile.TemporaryDirectory(prefix="speculative-study-") as folder:
        (Path(folder) / "test_speculative_study.py").write_text(user_tests(draft, args.max_new_tokens))
        report = Path(folder) / "report.json"
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                        "-W", "ignore::DeprecationWarning", "--opt-budgets=warn", f"--opt-rounds={args.rounds}",
                        "--opt-warmup=1", f"--opt-report-json={report}", "test_speculative_study.py",
                        *(["-k", args.select] if args.select else [])],
                       cwd=folder, check=False)
        data = json.loads(report.read_text())
    print(f"\n{time.perf_counter() - started:.0f} s; draft: {args.draft_layers} of smollm2-135m's 30 layers ({draft})\n")
    print("| test | token match | KL mean | speedup [95% interval] | verdict | acceptance rate | accepted per step | "
          "steps | load s opt / base | peak MiB opt / base |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for test in data["tests"]:
        opt, base, sim = test.get("optimized") or {}, test.get("baseline") or {}, test.get("similarity") or {}
        interval = test.get("speedup_interval") or [None, None]
        rate = opt.get("acceptance_rate")
        mib = [round(side.get("peak_memory_bytes") / 2**20) if side.get("peak_memory_bytes") else None
               for side in (opt, base)]
        print(f"| {test['nodeid'].split('::')[-1]} | {sim.get('token_match')} | {sim.get('kl_mean') or 0:.2g} | "
              f"{test.get('speedup') or 0:.2f}x [{interval[0] or 0:.2f}, {interval[1] or 0:.2f}] | "
              f"{test.get('speedup_verdict')} | {'-' if rate is None else f'{rate:.1%}'} | "
              f"{opt.get('mean_accepted_tokens_per_step') or 0:.2f} | {opt.get('draft_steps')} | "
              f"{opt.get('load_time_s') or 0:.2f} / {base.get('load_time_s') or 0:.2f} | {mib[0]} / {mib[1]} |")


if __name__ == "__main__":
    main()
