#!/usr/bin/env bash
# miss_read "copy" against "attention" (issue 22: the miss copy off the critical path) on the H200,
# in one call: the GPU tests of the host-reading attention kernel, then the same bench_serving run
# once per mode, HiSparse only unless MODES says otherwise (fp8 KV, SYNTHETIC 0.9, LAYERS-layer
# bench model, c = 1 and capacity, 3 profiled steps each for the per-kernel split).
#   OUT=/tmp/out bash benchmarks/miss_read_h200.sh                    # 12 layers, ~2 x 150 s + tests
#   OUT=/tmp/out READS="attention" MODES=hisparse,baseline bash benchmarks/miss_read_h200.sh
# Extra arguments go to bench_serving.py (e.g. --preset=glm-5.1-fp8-dp8-rank --context=40960).
set -uo pipefail
OUT=${OUT:-outputs/miss_read}
mkdir -p "$OUT"
MEM_FRACTION=${MEM_FRACTION:-0.9} source benchmarks/gpu_wheels/env.sh
if [[ ${GPU_TESTS:-1} == 1 ]]; then  # the kernel compiled for the GPU, bit for bit against the copy and no-offload runs
  JAX_PLATFORMS=cuda timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -n 0 -p no:cacheprovider -W ignore --tb=short \
    tests/test_attention_layer.py -k "misses_read or split_k_attention or fp8_attention_kernel_equals" 2>&1 | tail -6
fi
CONFIG='"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 8'
for read in ${READS:-copy attention}; do
  mkdir -p "$OUT/$read"
  timeout ${RUN_TIMEOUT:-200} python3 benchmarks/bench_serving.py \
    --num_layers=${LAYERS:-12} --kv_cache_dtype=fp8_e4m3 --phases=synthetic --concurrency=${CONCURRENCY:-1,88} --modes=${MODES:-hisparse} \
    --hisparse_config="{$CONFIG, \"miss_read\": \"$read\"}" --warm_steps=3 --steps=12 --profile_steps=${PROFILE_STEPS:-3} --profile_running=1 \
    --time_budget_s=$((${RUN_TIMEOUT:-200} - 10)) --output_dir="$OUT/$read" "$@" 2>&1 \
    | tee "$OUT/$read/run.log" | grep -v "^WARNING\|^I1\|^W1" | grep "ready\|c=\|step ~\|hisparse / baseline\|rror\|skip\|top kernels\|us/call" | sed "s/^/[$read] /"
  gzip -f "$OUT/$read/run.log"
  rm -rf "$OUT/$read"/trace_* "$OUT/$read"/hlo_dump "$OUT/$read"/*.png "$OUT/$read"/hlo_memory_reports.tar.gz  # large; the splits are in the JSON
done
