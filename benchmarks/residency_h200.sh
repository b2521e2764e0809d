#!/usr/bin/env bash
# Dynamic residency on the H200 in one device call (~8 min): the paged-pool state's CPU tests
# run on the GPU (Pallas kernels compiled by Triton, shared-pool reads and writes), then the
# serving points at 32k, fp8 KV, SYNTHETIC 0.9 selection: HiSparse, HiSparse with
# dynamic_residency adaptive (same slots, same budget) and the baseline at c = 1, 4, 16 and at
# capacity.
#   OUT=/tmp/out bash benchmarks/residency_h200.sh
set -uo pipefail
OUT=${OUT:-outputs/residency}
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=100 PYTHONUNBUFFERED=1
mkdir -p "$OUT/ctx32k"
# JAX_PLATFORMS=cuda: without it tests/conftest.py runs the tests on the CPU backend
JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_paged_state.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
python3 benchmarks/bench_serving.py --kv_cache_dtype=fp8_e4m3 --concurrency=1,4,16,256 \
  --phases=synthetic,residency --time_budget_s=${BUDGET_32K:-420} --output_dir="$OUT/ctx32k" 2>&1 | tee "$OUT/ctx32k.log"
rm -f "$OUT"/ctx32k/*.png
