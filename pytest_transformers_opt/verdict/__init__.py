"""The verdict: results, similarity to the baseline, budgets, statistics, stored baselines."""
