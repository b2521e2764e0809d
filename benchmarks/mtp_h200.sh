#!/usr/bin/env bash
# MTP speculative decoding on the H200 (issue 24; one device call, ~6-8 min): decode throughput of
# the bench model (fp8 KV, SYNTHETIC 32k contexts, HiSparse then the full-KV baseline) with the MTP
# layer's drafts, with drafts copying the target's tokens (the ceiling) and without MTP, at 1 and
# at capacity running requests (benchmarks/bench_mtp.py). Wheels in .whl/ (if any) go to /tmp/site.
#   OUT=/tmp/out bash benchmarks/mtp_h200.sh [bench_mtp.py flags]
set -uo pipefail
OUT=${OUT:-outputs/bench_mtp}
mkdir -p "$OUT"
source benchmarks/gpu_wheels/env.sh
# The script stops starting modes past BUDGET s and writes its JSON after every point; timeout
# ends it before the device call's 600 s whatever a compile does.
timeout ${MTP_TIMEOUT:-550} python3 benchmarks/bench_mtp.py --output_dir="$OUT" --time_budget_s=${BUDGET:-430} "$@" 2>&1 | tee "$OUT/bench_mtp.log" | grep -v "^WARNING:absl:Autotuning cache miss"
