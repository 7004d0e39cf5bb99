"""How sequential rounds settle the A/B gate (--opt-ab-fail), on simulated pairs: verdicts and rounds per cap.

Each simulated A/B test draws interleaved pairs: a slow spell both sides of a round share (log sd ``--common``),
and each side's own noise, so that a pair's log-ratio has the sd ``--spread`` (0.19: what ab_study measured on
this 2-core machine's tiny-model rounds; 0.05: a quiet one's). The candidate is ``shift`` times the reference.
Rounds go on as the plugin runs them (``verdict.ab_rounds.ab_keep_going`` with the gate's own rule,
``session.OptSession.ab_gate_so_far``) up to a cap, and the gate judges all of them; "fixed N" judges exactly N
pairs, as ``--opt-rounds=N`` does.

    python benchmarks/ab_rounds_sim.py --runs 200
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_transformers_opt.verdict.compare import Threshold  # noqa: E402
from pytest_transformers_opt.session import OptSession  # noqa: E402
from pytest_transformers_opt.verdict.ab_rounds import ab_keep_going  # noqa: E402
from pytest_transformers_opt.verdict.sequential import AUTO_ROUNDS, RoundsDecision  # noqa: E402

LATENCY_5 = Threshold("latency", 5.0, True)
SHIFTS = {"no change": 1.0, "candidate 10% slower": 1.10, "candidate 10% faster": 1 / 1.10}


def side(latencies: list[float]) -> dict:
    """One side's figures as the report holds them: the median and every round."""
    return {"optimized": {"latency_s": statistics.median(latencies), "latency_samples_s": list(latencies),
                          "rounds": len(latencies)}}


def simulate(rng: random.Random, shift: float, spread: float, cap: int | None, fixed: int | None = None,
             common: float = 0.15, threshold: Threshold = LATENCY_5) -> tuple[str, int, bool]:
    """(the gate's verdict, pairs measured, still open at the cap) of one simulated A/B test: sequential up to
    ``cap`` (from ``AUTO_ROUNDS.minimum``), or exactly ``fixed`` pairs."""
    reference: list[float] = []
    candidate: list[float] = []
    decision = RoundsDecision(AUTO_ROUNDS, ab_max_rounds=cap)
    own = spread / math.sqrt(2)
    while True:
        slow_spell = math.exp(rng.gauss(0, common))
        reference.append(0.1 * slow_spell * math.exp(rng.gauss(0, own)))
        candidate.append(0.1 * shift * slow_spell * math.exp(rng.gauss(0, own)))
        decision.rounds = len(reference)
        if fixed is not None:
            if decision.rounds == fixed:
                break
            continue
        if decision.rounds >= AUTO_ROUNDS.minimum and not ab_keep_going(
                decision, [threshold], side(candidate), side(reference), OptSession.ab_gate_so_far):
            break
    verdict = OptSession.ab_gate_so_far(threshold, side(candidate), side(reference))[0]
    return verdict, len(reference), fixed is None and not decision.ab_settled


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="simulated A/B tests per row")
    parser.add_argument("--spreads", default="0.19,0.05", help="sd of a pair's log-ratio, comma-separated")
    parser.add_argument("--caps", default="fixed 10,100,200", help="'fixed N' or a sequential cap, comma-separated")
    parser.add_argument("--seed", type=int, default=20261203)
    args = parser.parse_args()
    print(f"    python benchmarks/ab_rounds_sim.py --runs {args.runs} --spreads {args.spreads} --caps '{args.caps}'\n")
    print("| pair spread | rounds | true change | regressed | improved | open at the cap | pairs, mean (median, max) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    started = time.perf_counter()
    for spread in (float(s) for s in args.spreads.split(",")):
        for cap_text in (c.strip() for c in args.caps.split(",")):
            fixed = int(cap_text.split()[1]) if cap_text.startswith("fixed") else None
            cap = None if fixed is not None else int(cap_text)
            for label, shift in SHIFTS.items():
                rng = random.Random(args.seed)
                found = [simulate(rng, shift, spread, cap, fixed) for _ in range(args.runs)]
                verdicts = [verdict for verdict, _, _ in found]
                pairs = [count for _, count, _ in found]
                rounds = cap_text if fixed is not None else f"sequential, cap {cap}"
                print(f"| {spread:g} | {rounds} | {label} | {verdicts.count('regressed')}/{args.runs} | "
                      f"{verdicts.count('improved')}/{args.runs} | {sum(o for _, _, o in found)} | "
                      f"{statistics.mean(pairs):.1f} ({statistics.median(pairs):g}, {max(pairs)}) |")
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
