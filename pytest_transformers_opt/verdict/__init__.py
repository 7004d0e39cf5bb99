"""The verdict: the opt_bench measurement (bench.py), results, similarity to the baseline, budgets, statistics,
stored baselines."""
