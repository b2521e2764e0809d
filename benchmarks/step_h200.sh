#!/usr/bin/env bash
# The decode-step roofline run on the H200 (one device call, ~8 min): tokamax + qwix come as
# wheels (carry .whl: see benchmarks/README.md), then bench_step.py's MoE table and step sweep.
#   OUT=/tmp/out bash benchmarks/step_h200.sh
set -uo pipefail
OUT=${OUT:-outputs/bench_step}
mkdir -p "$OUT"
source benchmarks/gpu_wheels/env.sh
timeout ${STEP_TIMEOUT:-540} python3 benchmarks/bench_step.py --out="$OUT" --time_budget_s=${BUDGET:-420} "$@" 2>&1 | tee "$OUT/bench_step.log" | grep -v "^WARNING:absl:Autotuning cache miss"
