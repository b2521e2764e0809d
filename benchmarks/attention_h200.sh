#!/usr/bin/env bash
# Sparse MLA attention on the H200 in one device call: the fp8 kernel's tests with compiled kernels,
# then bench_kernels' attention section with extra launch shapes and fp8 byte orders (fp8_form),
# each checked against the f32 reference on the timed inputs.
#   OUT=/tmp/out bash benchmarks/attention_h200.sh [extra bench_kernels flags]
set -uo pipefail
OUT=${OUT:-outputs/attention}
mkdir -p "$OUT"
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
FP8_TUNINGS=${FP8_TUNINGS:-'[{"fp8_form": "planes"}, {"fp8_form": "group_planes"},
 {"fp8_form": "planes", "block_k": 64, "num_stages": 1}, {"fp8_form": "group_planes", "block_k": 64, "num_stages": 1},
 {"fp8_form": "planes", "num_warps": 4}, {"fp8_form": "group_planes", "num_warps": 4},
 {"fp8_form": "planes", "block_h": 32, "block_k": 64}, {"fp8_form": "planes", "num_stages": 3}]'}
BF16_TUNINGS=${BF16_TUNINGS:-'[{"num_warps": 4}, {"block_k": 32, "num_stages": 3}, {"block_h": 64, "block_k": 64, "num_stages": 3}]'}
timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -n 0 -p no:cacheprovider -W ignore --tb=short \
  tests/test_attention_layer.py -k "fp8" 2>&1 | tee "$OUT/attention_tests.log" | tail -8
timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/bench_kernels.py --sections=attention --notune --reps=5 --iters=8 \
  --attention_batches=50,128 --fp8_sizes=50x128,128x128 --fp8_tunings="$FP8_TUNINGS" --bf16_tunings="$BF16_TUNINGS" \
  --out="$OUT/bench_kernels_attention.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^\s*$' | cut -c1-400 | tail -60
