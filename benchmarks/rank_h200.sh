#!/usr/bin/env bash
# One DeepSeek-V3.2 / GLM-5.1 EP8 rank on the H200 (issue 21), one engine per device call: a
# 61 / 78-layer engine compiles for minutes, so both do not fit one call's 10 minutes.
#   OUT=/tmp/out MODE=baseline bash benchmarks/rank_h200.sh                     # call 1
#   OUT=/tmp/out MODE=hisparse MERGE=docs/perf/<call 1's json> bash benchmarks/rank_h200.sh   # call 2
# PRESET (deepseek-v3.2-dp8-rank), CONTEXT (40960), CONCURRENCY (1,64: c = 1 and capacity, one
# batch bucket each), FP8_ACTIVATIONS (1: w8a8, the checkpoints' activation_scheme "dynamic" as
# SGLang runs them; 0: the dequantised-weights numbers), PROFILE_RUNNING (1: the step split at c = 1
# as well as at capacity), EXTRA_XLA_FLAGS. Extra arguments go to bench_serving.py.
set -uo pipefail
OUT=${OUT:-outputs/rank}
mkdir -p "$OUT"
MEM_FRACTION=${MEM_FRACTION:-0.95} source benchmarks/gpu_wheels/env.sh
export XLA_FLAGS="${XLA_FLAGS:-} ${EXTRA_XLA_FLAGS:-}"  # e.g. --xla_gpu_command_buffer_update_mode=SKIP_PROFILED
ACT=$([[ ${FP8_ACTIVATIONS:-1} == 1 ]] && echo --fp8_activations || echo --nofp8_activations)
MERGE_FLAG=${MERGE:+--merge_from=$MERGE}
timeout ${RANK_TIMEOUT:-560} python3 benchmarks/bench_serving.py --preset=${PRESET:-deepseek-v3.2-dp8-rank} \
  --kv_cache_dtype=fp8_e4m3 --context=${CONTEXT:-40960} --phases=synthetic --concurrency=${CONCURRENCY:-1,64} \
  --profile_steps=3 --profile_running=${PROFILE_RUNNING:-1} --warm_steps=3 --steps=8 --modes=${MODE:-baseline} $ACT $MERGE_FLAG \
  --time_budget_s=${BUDGET:-540} --output_dir="$OUT" "$@" 2>&1 | tee "$OUT/rank.log" | grep -v "^WARNING" | tail -40
rm -rf "$OUT"/trace_* "$OUT"/hlo_dump  # large; the split is in bench_serving.json
