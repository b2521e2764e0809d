#!/usr/bin/env bash
# The serving headline on the H200 (~10 min): fp8 KV (rows + indexer keys), SYNTHETIC 0.9-overlap
# selection at capacity and at c = 1, 4, 16, 64, the same points with dynamic residency
# (adaptive), the model's selection at capacity, ITL under arrivals at 32k; the synthetic and
# residency phases again at 64k contexts. One device call runs up to 10 min: run it as two,
#   OUT=/tmp/out CONTEXTS=32k bash benchmarks/headline_h200.sh
#   OUT=/tmp/out CONTEXTS=64k bash benchmarks/headline_h200.sh
# The engines' settings are the rank runs' (benchmarks/rank_h200.sh): HiSparse keeps graphs at
# c = 1 alone, compiled twice (HISPARSE_CUDA_GRAPH_MAX_BS=1, HISPARSE_DECODE_PROGRAM_COPIES=2; set
# either to "" for the baseline's setting), decode programs compiled side by side (--compile_threads=0).
set -uo pipefail
OUT=${OUT:-outputs/headline}
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=100 PYTHONUNBUFFERED=1
mkdir -p "$OUT/ctx32k" "$OUT/ctx64k"
CONTEXTS=${CONTEXTS:-32k,64k}
HISPARSE_CUDA_GRAPH_MAX_BS=${HISPARSE_CUDA_GRAPH_MAX_BS-1} HISPARSE_DECODE_PROGRAM_COPIES=${HISPARSE_DECODE_PROGRAM_COPIES-2}
ENGINE_ARGS=(--compile_threads=0)
[[ -n $HISPARSE_CUDA_GRAPH_MAX_BS ]] && ENGINE_ARGS+=(--hisparse_cuda_graph_max_bs="$HISPARSE_CUDA_GRAPH_MAX_BS")
[[ -n $HISPARSE_DECODE_PROGRAM_COPIES ]] && ENGINE_ARGS+=(--hisparse_decode_program_copies="$HISPARSE_DECODE_PROGRAM_COPIES")
if [[ $CONTEXTS == *32k* ]]; then
python3 benchmarks/bench_serving.py --kv_cache_dtype=fp8_e4m3 --concurrency=1,4,16,64,256 --steps=24 "${ENGINE_ARGS[@]}" \
  --phases=synthetic,residency,model,arrivals --time_budget_s=${BUDGET_32K:-400} --output_dir="$OUT/ctx32k" 2>&1 | tee "$OUT/ctx32k.log"
fi
if [[ $CONTEXTS == *64k* ]]; then
python3 benchmarks/bench_serving.py --kv_cache_dtype=fp8_e4m3 --concurrency=1,4,16,256 --context=65536 --steps=24 "${ENGINE_ARGS[@]}" \
  --hisparse_config='{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 16}' \
  --phases=synthetic,residency --time_budget_s=${BUDGET_64K:-260} --output_dir="$OUT/ctx64k" 2>&1 | tee "$OUT/ctx64k.log"
fi
# The device tool brings back at most 8 files: keep the JSONs and logs, redraw the plots here
# with `python benchmarks/bench_serving.py --replot=.../bench_serving.json --output_dir=...`.
rm -f "$OUT"/ctx32k/*.png "$OUT"/ctx64k/*.png
