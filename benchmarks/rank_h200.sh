#!/usr/bin/env bash
# One DeepSeek-V3.2 / GLM-5.1 EP8 rank on the H200 (issue 21). Each engine compiles its decode
# programs side by side (COMPILE_THREADS), so both engines fit one call (310-331 s for either preset
# at 40,960-131,072 tokens, fourteenth session; DeepSeek-V3.2 at 131,072 was killed compiling four
# programs beside its 105 GB pool, since capped by host memory and not yet re-run):
#   OUT=/tmp/out MODE=hisparse,baseline RANK_TIMEOUT=575 bash benchmarks/rank_h200.sh
# or one engine per call:
#   OUT=/tmp/out MODE=baseline bash benchmarks/rank_h200.sh                     # call 1
#   OUT=/tmp/out MODE=hisparse MERGE=docs/perf/<call 1's json> bash benchmarks/rank_h200.sh   # call 2
# Several contexts in one call, one process each (the weights are rebuilt, ~41 s each):
#   OUT=/tmp/out MODE=baseline CONTEXTS="40960 61440" bash benchmarks/rank_h200.sh   # -> $OUT/ctx<N>/
#   OUT=/tmp/out MODE=hisparse CONTEXTS="40960 61440" MERGE_DIR=docs/perf/<call 1's $OUT copy> bash ...
# At 131,072 tokens and above MEM_FRACTION defaults to 0.98 and XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB to 110
# (DeepSeek-V3.2's pool is 104.9 GB; its 20-request decode program asked for a 14.83 GiB allocation
# that 0.95 left no room for: docs/PERFORMANCE.md, 2026-12-04 tenth session).
# PRESET (deepseek-v3.2-dp8-rank), CONTEXT (40960), CONCURRENCY (1,64: c = 1 and capacity, one
# batch bucket each), FP8_ACTIVATIONS (1: w8a8, the checkpoints' activation_scheme "dynamic" as
# SGLang runs them; 0: the dequantised-weights numbers), PROFILE_RUNNING (1: the step split at c = 1
# as well as at capacity), EXTRA_XLA_FLAGS, CB_VLOG (1: XLA logs each command-buffer re-record;
# command_buffer_updates.txt counts them per buffer), HISPARSE_XLA_OPTIONS (HiSparse's decode step's
# XLA options; "" or unset: the baseline's, XLA's own unless --decode_xla_options is given),
# CUDA_GRAPH_MAX_BS (SGLang's --cuda-graph-max-bs: buckets of more slots without graphs),
# DECODE_PROGRAM_COPIES (2: two compiles of each graph-keeping decode program, run on alternate steps),
# HISPARSE_CUDA_GRAPH_MAX_BS / HISPARSE_DECODE_PROGRAM_COPIES (the same for HiSparse alone; "": as the
# baseline's). Both presets' defaults give HiSparse graphs at c = 1 alone, in two copies (1 / 2): at 61
# layers its step was fastest so at c = 1 (32.10 ms against 37.31 without graphs) and without graphs at
# capacity, while the baseline's is fastest with graphs everywhere (PERFORMANCE.md, eleventh and twelfth
# sessions); GLM-5.1 at 78 layers gave 3.59x / 0.96x with them (thirteenth session).
# COMPILE_THREADS (decode programs each engine compiles at once; 0: all, up to one per 4 cores and per 8 GiB of free host memory), SPY_AT ("200 330": py-spy's
# native stacks of every thread at those seconds, spy_<t>s.txt, and host_memory.txt).
# ADDRESSES (1: each point's buffer_moves in the JSON, which of a step's inputs and outputs moved between
# runs of the same program; set it to anything to turn it on).
# bench_serving writes state_copies.txt (the
# parameters each decode program copies: a copied state array moves every step) from the HLO it
# dumps for the step split. Extra arguments go to bench_serving.py.
set -uo pipefail
OUT=${OUT:-outputs/rank}
mkdir -p "$OUT"
LONGEST=$(tr ' ' '\n' <<< "${CONTEXTS:-${CONTEXT:-40960}}" | sort -n | tail -1)
if (( LONGEST >= 131072 )); then
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-110}
  MEM_FRACTION=${MEM_FRACTION:-0.98}
fi
MEM_FRACTION=${MEM_FRACTION:-0.95} source benchmarks/gpu_wheels/env.sh
export XLA_FLAGS="${XLA_FLAGS:-} ${EXTRA_XLA_FLAGS:-}"  # e.g. --xla_gpu_command_buffer_update_mode=SKIP_PROFILED
# CB_VMODULE: more of XLA's logs with CB_VLOG, e.g. gpu_executable_va_remap_allocator=3 (what SKIP_PROFILED remaps)
[[ ${CB_VLOG:-0} == 1 ]] && export TF_CPP_VMODULE=command_buffer_thunk=3${CB_VMODULE:+,$CB_VMODULE} TF_CPP_MIN_LOG_LEVEL=0
ACT=$([[ ${FP8_ACTIVATIONS:-1} == 1 ]] && echo --fp8_activations || echo --nofp8_activations)
HISPARSE_CUDA_GRAPH_MAX_BS=${HISPARSE_CUDA_GRAPH_MAX_BS-1} HISPARSE_DECODE_PROGRAM_COPIES=${HISPARSE_DECODE_PROGRAM_COPIES-2}
HISPARSE_ARGS=()  # each unset or "": HiSparse takes the baseline's setting (and --decode_xla_options, an extra argument)
[[ -n ${HISPARSE_XLA_OPTIONS:-} ]] && HISPARSE_ARGS+=(--hisparse_decode_xla_options="$HISPARSE_XLA_OPTIONS")
[[ -n ${HISPARSE_CUDA_GRAPH_MAX_BS:-} ]] && HISPARSE_ARGS+=(--hisparse_cuda_graph_max_bs="$HISPARSE_CUDA_GRAPH_MAX_BS")
[[ -n ${HISPARSE_DECODE_PROGRAM_COPIES:-} ]] && HISPARSE_ARGS+=(--hisparse_decode_program_copies="$HISPARSE_DECODE_PROGRAM_COPIES")

run_context() {  # $1: context, $2: output dir, $3: a bench_serving.json to merge (or ""), $4: seconds
  local merge=${3:+--merge_from=$3}
  mkdir -p "$2"
  timeout "$4" python3 benchmarks/bench_serving.py --preset=${PRESET:-deepseek-v3.2-dp8-rank} \
    --kv_cache_dtype=fp8_e4m3 --context="$1" --phases=synthetic --concurrency=${CONCURRENCY:-1,64} \
    --profile_steps=3 --profile_running=${PROFILE_RUNNING:-1} --warm_steps=3 --steps=8 --modes=${MODE:-baseline} $ACT $merge \
    "${HISPARSE_ARGS[@]}" ${CUDA_GRAPH_MAX_BS:+--cuda_graph_max_bs=$CUDA_GRAPH_MAX_BS} \
    --decode_program_copies=${DECODE_PROGRAM_COPIES:-1} ${ADDRESSES:+--log_buffer_addresses} --compile_threads=${COMPILE_THREADS:-0} \
    --time_budget_s=$(($4 - 20)) --output_dir="$2" "${EXTRA_ARGS[@]}" 2>&1 | tee "$2/rank.log" | grep -v "^WARNING\|^I1" | tail -40
  if [[ ${CB_VLOG:-0} == 1 ]]; then
    python3 benchmarks/probes/command_buffer_updates.py "$2/rank.log" | tee "$2/command_buffer_updates.txt" | head -12
    gzip -f "$2/rank.log"
  fi
  [[ -f $2/state_copies.txt ]] && head -12 "$2/state_copies.txt"
  rm -rf "$2"/trace_* "$2"/hlo_dump  # large; the split is in bench_serving.json (left behind by a run cut short)
}

EXTRA_ARGS=("$@")
if [[ -n ${SPY_AT:-} ]]; then  # SPY_AT="200 330": every thread's native stacks at those seconds of the call
  export ALLOW_PTRACE=1     # (py-spy dump, carried as .whl/py-spy; bench_serving lets it attach), host memory every 20 s
  ( for t in $SPY_AT; do sleep $(( t > SECONDS ? t - SECONDS : 0 )); pid=$(pgrep -n -f "benchmarks/bench_serving.py")
      [[ -n $pid ]] && timeout 60 .whl/py-spy dump --native --pid "$pid" > "$OUT/spy_${t}s.txt" 2>&1; done ) >/dev/null 2>&1 &
  SPIES=$!
  ( while sleep 20; do echo "$SECONDS s: $(free -g | awk '/Mem/ {print "used", $3, "free", $4, "available", $7, "GB"}')"; done >> "$OUT/host_memory.txt" ) &
  MONITOR=$!
fi
if [[ -z ${CONTEXTS:-} ]]; then
  run_context "${CONTEXT:-40960}" "$OUT" "${MERGE:-}" "${RANK_TIMEOUT:-560}"
else
  read -ra contexts <<< "$CONTEXTS"
  share=$(( ${RANK_TIMEOUT:-560} / ${#contexts[@]} ))  # the call's seconds, split evenly
  for context in "${contexts[@]}"; do
    merge=${MERGE_DIR:+$MERGE_DIR/ctx$context/bench_serving.json}
    [[ -n $merge && ! -f $merge ]] && merge=""  # no baseline at this context: HiSparse alone
    run_context "$context" "$OUT/ctx$context" "$merge" "$share"
    rm -f "$OUT/ctx$context"/*.png "$OUT/ctx$context"/hlo_memory_reports.tar.gz  # at most 8 files come back
  done
fi
[[ -n ${MONITOR:-} ]] && kill "$MONITOR" "$SPIES" 2>/dev/null
true
