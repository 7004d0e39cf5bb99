#!/usr/bin/env bash
# Compile cache study: each pair is a fresh cache folder, then a cold run and a warm run, each a fresh
# pytest process (as a new CI runner is); prints compile_time_s and the warm/cold label from the report.
# usage: benchmarks/compile_cache/measure.sh test_tiny.py|test_real.py PAIRS   (from the repository root)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"; file=$1; pairs=${2:-3}
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
cp "$here/$file" "$work/"
cd "$work"
for p in $(seq 1 "$pairs"); do
  cache="$work/cache-$p"
  for run in cold warm; do
    python -m pytest -q -p no:randomly -p no:cacheprovider --opt-rounds=2 --opt-warmup=1 \
      --opt-compile-cache="$cache" --opt-report-json="r-$p-$run.json" "$file" > "log-$p-$run.txt" 2>&1 || true
    python -c "import json; t = json.load(open('r-$p-$run.json'))['tests'][0]; print('$file pair $p $run', t['outcome'], round(t['optimized']['compile_time_s'], 2), t['optimized']['compile_cache'])"
  done
done
