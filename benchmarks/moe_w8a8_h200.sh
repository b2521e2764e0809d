#!/usr/bin/env bash
# The w8a8 MoE tilings on the H200 in one device call (issue 20: fp8 experts at 64+ rows per
# expert): bench_step's MoE rows for DeepSeek-V3.2's EP8 rank with the default w8a8 config,
# tokamax, and each tiling of $W8A8_TUNINGS, every one checked against the XLA reference and the
# default w8a8 kernel on the same inputs.
#   OUT=/tmp/out bash benchmarks/moe_w8a8_h200.sh [extra bench_step flags]
set -uo pipefail
OUT=${OUT:-outputs/moe_w8a8}
mkdir -p "$OUT"
source benchmarks/gpu_wheels/env.sh
export W8A8_TUNINGS=${W8A8_TUNINGS:-'[
 {"name": "m64", "block_m": 64, "m_subtiles": 1, "num_warps": 4, "num_stages": 4},
 {"name": "m64w8", "block_m": 64, "m_subtiles": 1, "num_warps": 8, "num_stages": 4},
 {"name": "m64bk64", "block_m": 64, "m_subtiles": 1, "block_k": 64, "num_warps": 4, "num_stages": 6},
 {"name": "m128", "block_m": 128, "m_subtiles": 1, "num_warps": 8, "num_stages": 3},
 {"name": "swap32", "swap_ab": true, "block_m": 32, "m_subtiles": 1, "num_warps": 4, "num_stages": 4},
 {"name": "swap64", "swap_ab": true, "block_m": 64, "m_subtiles": 1, "num_warps": 4, "num_stages": 4}]'}
timeout ${MOE_TIMEOUT:-330} python3 benchmarks/bench_step.py --sections=moe --moe_models=deepseek_v32 --moe_weights=fp8_e4m3 \
  --tokens=${TOKENS:-8,64,88,128,256} --moe_impls=pallas_w8a8,tokamax --calls=8 --out="$OUT" \
  --time_budget_s=${BUDGET:-300} "$@" 2>&1 | tee "$OUT/bench_step.log" | grep -v "^WARNING:absl:Autotuning cache miss" | tail -70
