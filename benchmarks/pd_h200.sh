#!/usr/bin/env bash
# PD disaggregation on the H200 (one device call, ~4 min): a prefill and a decode instance of
# run_decode.py, two processes on the one GPU (0.4 of its memory each), the deepseek_v32_bench
# model (DeepSeek-V3.2's attention at full width: real row sizes), 8 prompts of 16k tokens. The
# decode instance (HiSparse) pulls each request's KV rows straight into its pinned host pool and
# its index keys into device memory, and reports the hand-over (results.json "handover": bytes,
# seconds of pulls, GB/s). Run once with fp8 rows (656 B) and once with bf16 rows (1152 B).
#   OUT=/tmp/out bash benchmarks/pd_h200.sh
# On a CPU, to try the script: MODEL=tiny INPUT_LEN=200 NUM_PROMPTS=3 OUT=/tmp/pd bash benchmarks/pd_h200.sh
set -uo pipefail
OUT=${OUT:-outputs/pd}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=40
WORKLOAD=(--model=${MODEL:-deepseek_v32_bench} --random_input_len=${INPUT_LEN:-16384} --random_range_ratio=1.0 --random_output_len=32
          --noprogress --disaggregation_timeout_s=300)
port=5757
for kv in ${KV_DTYPES:-fp8_e4m3 bfloat16}; do
  mkdir -p "$OUT/$kv"
  address=--disaggregation_address=127.0.0.1:$port
  port=$((port + 1))
  python3 run_decode.py --disaggregation_mode=decode "$address" --kv_cache_dtype=$kv "${WORKLOAD[@]}" \
    --max_running_requests=8 --max_concurrency=8 --output_dir="$OUT/$kv" > "$OUT/$kv/decode.log" 2>&1 &
  decode=$!
  python3 run_decode.py --disaggregation_mode=prefill "$address" --kv_cache_dtype=$kv "${WORKLOAD[@]}" \
    --num_prompts=${NUM_PROMPTS:-8} > "$OUT/$kv/prefill.log" 2>&1
  echo "prefill ($kv) exit $?"
  wait $decode
  echo "decode ($kv) exit $?"
  grep -h "hand-over\|listening\|error" "$OUT/$kv/decode.log" | grep -v "^WARNING" | tail -5
  tail -3 "$OUT/$kv/prefill.log"
done
