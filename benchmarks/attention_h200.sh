#!/usr/bin/env bash
# Sparse MLA attention on the H200 in one device call: the fp8 kernel's tests with compiled kernels,
# then bench_kernels' attention section with extra launch shapes and fp8 byte orders (fp8_form),
# each checked against the f32 reference on the timed inputs.
#   OUT=/tmp/out bash benchmarks/attention_h200.sh [extra bench_kernels flags]
set -uo pipefail
OUT=${OUT:-outputs/attention}
mkdir -p "$OUT"
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# keys_major (KEYS_MAJOR in pallas_kernels/sparse_mla_attention/pallas_triton.py): q . k as keys x
# heads over 128-key blocks, so that the two warpgroups no longer both compute the whole scores;
# transposed_acc: the values' product as [columns, heads] too.
FP8_TUNINGS=${FP8_TUNINGS:-'[{"fp8_form": "planes"}, {"fp8_form": "interleave"}, {"fp8_form": "dequantize_first", "block_h": 64, "block_k": 64, "num_stages": 4}, {"fp8_form": "dequantize_kernel"},
 {"fp8_form": "dequantize_first", "keys_major": true, "block_k": 128, "num_stages": 1},
 {"fp8_form": "dequantize_first", "keys_major": true, "transposed_acc": true, "block_k": 128, "num_stages": 1}]'}
BF16_TUNINGS=${BF16_TUNINGS:-'[{"num_stages": 2}, {"num_stages": 4}, {"keys_major": true, "block_k": 128, "num_stages": 1},
 {"keys_major": true, "transposed_acc": true, "block_k": 128, "num_stages": 1}]'}
timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -n 0 -p no:cacheprovider -W ignore --tb=short \
  tests/test_attention_layer.py -k "fp8" 2>&1 | tee "$OUT/attention_tests.log" | tail -8
timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/bench_kernels.py --sections=attention --notune --reps=5 --iters=8 \
  --attention_batches=50,128 --fp8_sizes=50x128,128x128 --fp8_tunings="$FP8_TUNINGS" --bf16_tunings="$BF16_TUNINGS" \
  --out="$OUT/bench_kernels_attention.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^\s*$' | cut -c1-400 | tail -60
