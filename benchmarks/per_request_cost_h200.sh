#!/usr/bin/env bash
# What a request adds to a rank's step at capacity, beyond the fp8 dots (benchmarks/fp8_dots_h200.sh
# times those), in one call (~6 min):
#   OUT=/tmp/out bash benchmarks/per_request_cost_h200.sh
# 0. benchmarks/probes/indexer_fp8_tiling.py at the ranks' capacity shapes with fp8 queries (what
#    w8a8 models score with): the whole selection with the top-k's histograms counted by the
#    scoring kernel (--fused, decode_topk(fused_histogram=True), opt-in until this times it)
#    against the two passes, each checked against the reference.
# 0b. benchmarks/probes/host_row_gather.cu (CUDA alone, built here with nvcc): random 656 B rows
#    gathered from a 40 GB pinned pool made three ways (cudaHostAlloc as XLA's; transparent huge
#    pages + cudaHostRegister; 2 MB hugetlb pages) and from a 1 GB one: whether the pool's page
#    size sets the copy's rate.
# 1. benchmarks/probes/copy_row_rate.py: the miss copy from the pinned pool by row kind, pool size,
#    launch shape and an HBM sweep between calls (the rank's copy moved fp8 rows at 24-31 GB/s
#    where the probes had seen ~45; PERFORMANCE.md, fourteenth session).
# Each probe checks its outputs (the copy bit for bit) and exits 1 when a check fails.
# COPY_BUDGET: seconds after which the copy probe starts no new case (120); INDEXER_TIMEOUT /
# GATHER_TIMEOUT end the indexer and gather probes (130 / 90 s). Extra arguments go to none.
set -uo pipefail
OUT=${OUT:-outputs/per_request_cost}
mkdir -p "$OUT"
MEM_FRACTION=${MEM_FRACTION:-0.9} source benchmarks/gpu_wheels/env.sh
timeout ${INDEXER_TIMEOUT:-130} python3 benchmarks/probes/indexer_fp8_tiling.py --variants=default --queries=fp8 --fused --calls=10 \
  --sizes=50x40960x64,9x131072x32,37x61440x64 --out="$OUT/indexer_fp8_queries.json" 2>&1 | grep -v "^WARNING\|^I1\|^W1" | tail -30
echo "indexer_fp8_tiling exit: ${PIPESTATUS[0]}"
NVCC=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
if "$NVCC" -O3 -arch=sm_90 -std=c++17 -o /tmp/host_row_gather benchmarks/probes/host_row_gather.cu; then
  timeout ${GATHER_TIMEOUT:-90} /tmp/host_row_gather --pool_gb=40 > "$OUT/host_row_gather.jsonl"
  echo "host_row_gather exit: $?"; cat "$OUT/host_row_gather.jsonl" | cut -c1-400
fi
timeout $(( ${COPY_BUDGET:-120} + 70 )) python3 benchmarks/probes/copy_row_rate.py --time_budget_s=${COPY_BUDGET:-120} \
  --out="$OUT/copy_row_rate.json" 2>&1 | grep -v "^WARNING\|^I1\|^W1" | tail -40
echo "copy_row_rate exit: ${PIPESTATUS[0]}"
