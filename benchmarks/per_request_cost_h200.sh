#!/usr/bin/env bash
# What a request adds to a rank's step at capacity, kernel by kernel, in one call (~8 min):
#   OUT=/tmp/out bash benchmarks/per_request_cost_h200.sh
# 1. benchmarks/probes/copy_row_rate.py: the miss copy from the pinned pool by row kind, pool size,
#    launch shape and an HBM sweep between calls (the rank's copy moved fp8 rows at 24-31 GB/s
#    where the probes had seen ~45; PERFORMANCE.md, fourteenth session).
# 2. benchmarks/probes/dense_fp8_linear.py: every block-FP8 projection outside the routed experts,
#    w8a8 by rows (1, 12, 50), and the f32 MLA value lift.
# Each probe checks its outputs (the copy bit for bit, each tile against the current one) and
# exits 1 when a check fails. COPY_BUDGET / DENSE_BUDGET: seconds after which a probe starts no
# new case (200 each). Extra arguments go to neither.
set -uo pipefail
OUT=${OUT:-outputs/per_request_cost}
mkdir -p "$OUT"
MEM_FRACTION=${MEM_FRACTION:-0.9} source benchmarks/gpu_wheels/env.sh
timeout $(( ${COPY_BUDGET:-200} + 80 )) python3 benchmarks/probes/copy_row_rate.py --time_budget_s=${COPY_BUDGET:-200} \
  --out="$OUT/copy_row_rate.json" 2>&1 | grep -v "^WARNING\|^I1\|^W1" | tail -40
echo "copy_row_rate exit: ${PIPESTATUS[0]}"
timeout $(( ${DENSE_BUDGET:-200} + 60 )) python3 benchmarks/probes/dense_fp8_linear.py --time_budget_s=${DENSE_BUDGET:-200} \
  --out="$OUT/dense_fp8_linear.json" 2>&1 | grep -v "^WARNING\|^I1\|^W1" | tail -40
echo "dense_fp8_linear exit: ${PIPESTATUS[0]}"
