#!/usr/bin/env bash
# fp8 x fp8 dots on the fp8 tensor cores (pallas_kernels.common.FP8_TENSOR_CORE_DOTS, default on
# since 2026-12-04, sixteenth session) against Pallas' own lowering of them (f16 mma.sync after
# widening both operands), in one device call (at most ~9.5 min with the default budgets):
#   OUT=/tmp/out bash benchmarks/fp8_dots_h200.sh
# 0. The fp8 kernels' CPU tests, run on the GPU with compiled kernels: w8a8 grouped / dense matmuls
#    and the indexer's fp8-query scoring and selection against their references (tolerances for
#    the fp8 tensor cores' accumulation where they apply).
# 1. The indexer's scoring at the ranks' capacity shapes, bf16 queries (the baseline) and fp8 ones,
#    on the fp8 tensor cores; then fp8 queries through Pallas' f16 path (HISPARSE_FP8_TENSOR_CORE_DOTS=0).
# 2. Every block-FP8 projection outside the routed experts (DeepSeek-V3.2's rank), w8a8 at 1, 12 and
#    50 rows with the swap-AB tiles (weights on the MMA's M side, where a 16-row tile reaches wgmma),
#    both ways.
# 3. The routed experts (bench_step's MoE rows, DeepSeek-V3.2's rank, fp8 weights) at 8, 50, 88 and
#    128 tokens: the default w8a8 tile and the swap-AB ones on the fp8 tensor cores, beside
#    tokamax's kernel in the same run (MOE_BOTH=1 adds Pallas' f16 path, ~95 s more).
# Each probe checks its outputs and says so in its JSON; BUDGET_* (s) stop a probe starting new cases.
set -uo pipefail
OUT=${OUT:-outputs/fp8_dots}
mkdir -p "$OUT"
MEM_FRACTION=${MEM_FRACTION:-0.9} source benchmarks/gpu_wheels/env.sh
quiet() { grep -v "^WARNING\|^I1\|^W1\|DeprecationWarning\|return rule(ctx"; }

JAX_PLATFORMS=cuda timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -n 0 -p no:cacheprovider -W ignore --tb=short \
  tests/test_grouped_matmul.py tests/test_indexer_kernels.py -k "w8a8 or fp8_activations or scores_kernel or decode_topk or histograms" \
  2>&1 | tee "$OUT/fp8_tests.log" | tail -15
echo "fp8 tests exit: ${PIPESTATUS[0]}"

for dots in 1 0; do
  queries=$([ $dots = 1 ] && echo bfloat16,fp8 || echo fp8)
  HISPARSE_FP8_TENSOR_CORE_DOTS=$dots timeout ${INDEXER_TIMEOUT:-90} python3 benchmarks/probes/indexer_fp8_tiling.py --variants=default \
    --queries=$queries --calls=10 --sizes=50x40960x64,9x131072x32 --out="$OUT/indexer_fp8_dots$dots.json" 2>&1 | quiet | tail -12
  echo "indexer (fp8 tensor-core dots $dots) exit: ${PIPESTATUS[0]}"
done

for dots in 1 0; do
  HISPARSE_FP8_TENSOR_CORE_DOTS=$dots timeout $(( ${BUDGET_DENSE:-55} + 35 )) python3 benchmarks/probes/dense_fp8_linear.py \
    --models=deepseek_v32 --rows=1,12,50 --tune_above=0 --time_budget_s=${BUDGET_DENSE:-55} --out="$OUT/dense_fp8_dots$dots.json" \
    2>&1 | quiet | tail -6
  echo "dense_fp8_linear (fp8 tensor-core dots $dots) exit: ${PIPESTATUS[0]}"
done

export W8A8_TUNINGS='[{"name": "swap16", "swap_ab": true, "block_m": 16, "m_subtiles": 1, "num_warps": 4, "num_stages": 4},
 {"name": "swap32", "swap_ab": true, "block_m": 32, "m_subtiles": 1, "num_warps": 4, "num_stages": 4},
 {"name": "swap64", "swap_ab": true, "block_m": 64, "m_subtiles": 1, "num_warps": 4, "num_stages": 4}]'
for dots in 1 $([ "${MOE_BOTH:-0}" = 1 ] && echo 0); do
  mkdir -p "$OUT/moe_dots$dots"
  impls=$([ $dots = 1 ] && echo pallas_w8a8,tokamax || echo pallas_w8a8)
  HISPARSE_FP8_TENSOR_CORE_DOTS=$dots timeout $(( ${BUDGET_MOE:-60} + 35 )) python3 benchmarks/bench_step.py --sections=moe \
    --moe_models=deepseek_v32 --moe_weights=fp8_e4m3 --tokens=${TOKENS:-8,50,88,128} --moe_impls=$impls --calls=8 \
    --out="$OUT/moe_dots$dots" --time_budget_s=${BUDGET_MOE:-60} 2>&1 | quiet | grep -v "Autotuning cache miss" | tail -16
  echo "bench_step moe (fp8 tensor-core dots $dots) exit: ${PIPESTATUS[0]}"
done
