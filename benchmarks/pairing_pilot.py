"""How much of one round's noise two interleaved sides share on this machine (issue 20's next step).

`--opt-ab` interleaves the candidate's and the reference's rounds, and its regression rule ranks the two sides'
rounds as unpaired samples (Mann-Whitney). Where the machine's noise is common to a round's two sides (drift,
a neighbour's burst), the difference within each pair varies less than the difference of two independent
rounds, and a paired rule would need fewer rounds for the same sensitivity. This measures that in one process:
two copies of one model, generate alternately (ABBA order), the log-times' correlation between the two sides of
a pair and the spread of their paired against their unpaired difference.

    python benchmarks/pairing_pilot.py --pairs 30 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any


def _generate_seconds(model: Any, encoded: Any, pad_token_id: int, tokens: int) -> float:
    import torch

    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(**encoded, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       pad_token_id=pad_token_id)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random-llama", help="a built-in model (tiny or real)")
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3, help="pairs run first and not counted")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pytest_transformers_opt.engine.real_models import ensure_real_model, is_real_model
    from pytest_transformers_opt.engine.tiny_models import ensure_tiny_model
    from pytest_transformers_opt.verdict.results import DEFAULT_PROMPTS

    torch.set_num_threads(1)  # as the plugin runs CPU rounds under pytest-xdist and in the A/B studies
    path = str(ensure_real_model(args.model) if is_real_model(args.model) else ensure_tiny_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    encoded = tokenizer(list(DEFAULT_PROMPTS), return_tensors="pt", padding=True)
    sides = [AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
             for _ in range(2)]

    def pair(index: int) -> tuple[float, float]:
        order = (0, 1) if index % 2 == 0 else (1, 0)  # ABBA: neither side always goes first
        seconds = {side: _generate_seconds(sides[side], encoded, tokenizer.pad_token_id, args.max_new_tokens)
                   for side in order}
        return seconds[0], seconds[1]

    print(f"pairing pilot: {args.model}, {args.max_new_tokens} new tokens, {args.pairs} pairs after "
          f"{args.warmup} warm-up pairs ...", flush=True)
    for index in range(args.warmup):
        pair(index)
    started = time.perf_counter()
    pairs = [pair(index) for index in range(args.pairs)]
    a = [math.log(first) for first, _ in pairs]
    b = [math.log(second) for _, second in pairs]
    paired = statistics.stdev([x - y for x, y in zip(a, b)])
    unpaired = math.sqrt(statistics.variance(a) + statistics.variance(b))
    print(f"pairing pilot: done in {time.perf_counter() - started:.0f} s")
    print("| model | new tokens | pairs | round, median | sd of log time (A, B) | correlation within a pair "
          "| sd of the difference, unpaired | paired | rounds a paired rule saves |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    median_ms = 1000 * statistics.median([x for p in pairs for x in p])
    print(f"| {args.model} | {args.max_new_tokens} | {args.pairs} | {median_ms:.0f} ms | "
          f"{statistics.stdev(a):.3f}, {statistics.stdev(b):.3f} | {statistics.correlation(a, b):.2f} | "
          f"{unpaired:.3f} | {paired:.3f} | {1 - (paired / unpaired) ** 2:.0%} |")


if __name__ == "__main__":
    main()
