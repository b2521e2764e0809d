#!/usr/bin/env bash
# Is the per-step host time XLA's command-buffer (CUDA graph) update? The same bench_serving run
# once per VARIANT, each a set of XLA flags:
#   default        XLA's command buffers, updated whenever an allocation their commands use moved
#                  (ALWAYS_UPDATE: a decode step's fresh inputs and outputs move every step)
#   off            --xla_gpu_enable_command_buffer= (op by op)
#   skip_temp      --xla_gpu_command_buffer_update_mode=SKIP_TEMP (temp buffers at fixed addresses)
#   skip_profiled  --xla_gpu_command_buffer_update_mode=SKIP_PROFILED (parameters, outputs and temps
#                  whose addresses held over the first executions: no update, a VA remap instead)
#   skip_temp_decode, skip_profiled_decode   those modes for the decode step's compile alone
#                  (bench_serving --decode_xla_options), every other program as default
#   no_cublas      --xla_gpu_enable_command_buffer=-CUBLAS,-CUBLASLT: cuBLAS calls outside the graphs
#                  (a graph holds them as stream-captured nodes, which an update captures again)
#   no_cublas_decode   the same for the decode step's compile alone
#   off_decode     no command buffers in the decode step's compile alone (op by op: no re-record)
#   copies2        two compiles of each decode program, run on alternate steps (bench_serving
#                  --decode_program_copies=2): does each copy's graph stop being re-recorded?
# (skip_temp and skip_profiled segfault in jaxlib 0.11.2 on the H200: docs/PERFORMANCE.md, 2026-12-03.)
# LAYERS (12) keeps two variants' engines in one call (~140 s each at 12 layers); RUN_TIMEOUT (250 s)
# bounds each variant, and its bench_serving budget follows it (at 200 s the baseline's segment was
# skipped: bench_serving skips a segment unless 1.2 x the longest one so far still fits). Each variant also
# splits PROFILE_STEPS (3) steps at c = 1 and at capacity under the profiler, command buffers kept on,
# with the host threads' busiest events (bench_serving.json: step_split[].host_events).
#   OUT=/tmp/out VARIANTS="default off" bash benchmarks/command_buffer_h200.sh   (default: "default";
#   two variants at RUN_TIMEOUT 250 plus the 150 s of GPU tests can pass one call's 600 s: set it lower)
set -uo pipefail
OUT=${OUT:-outputs/command_buffer}
mkdir -p "$OUT"
source benchmarks/gpu_wheels/env.sh
# The kernels this session changed, compiled on the GPU against their references: the plan of a
# batch below the slot count on the whole tables (the c = 1 points below run it) and the backup
# of every layer's newest rows in one launch.
[[ ${GPU_TESTS:-1} == 1 ]] && JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -n 0 -p no:cacheprovider -W ignore --tb=short tests/test_swap_in.py \
  "tests/test_attention_layer.py::test_prefetched_shared_layer_and_deferred_backup_equal_no_offload" \
  -k "(whole_tables or SGLang or one_call or deferred_backup) and not tpu" 2>&1 | tail -5  # tpu: interpret mode, CPU only
declare -A FLAGS_OF=(
  [default]="" [off]="--xla_gpu_enable_command_buffer="
  [skip_temp]="--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
  [skip_profiled]="--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"
  [no_cublas]="--xla_gpu_enable_command_buffer=-CUBLAS,-CUBLASLT"
)
declare -A DECODE_OPTIONS_OF=(
  [skip_temp_decode]='{"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"}'
  [skip_profiled_decode]='{"xla_gpu_command_buffer_update_mode": "SKIP_PROFILED"}'
  [no_cublas_decode]='{"xla_gpu_enable_command_buffer": "-CUBLAS,-CUBLASLT"}'
  [off_decode]='{"xla_gpu_enable_command_buffer": ""}'
)
declare -A ARGS_OF=([copies2]="--decode_program_copies=2")
# CB_VLOG=1: XLA's command_buffer_thunk logs every re-record with its command count and how many
# allocations moved; command_buffer_updates.txt counts them per command buffer (by size).
[[ ${CB_VLOG:-0} == 1 ]] && export TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0
for variant in ${VARIANTS:-default}; do
  mkdir -p "$OUT/$variant"
  XLA_FLAGS="${XLA_FLAGS:-} ${FLAGS_OF[$variant]:-}" timeout ${RUN_TIMEOUT:-250} python3 benchmarks/bench_serving.py \
    --num_layers=${LAYERS:-12} --kv_cache_dtype=fp8_e4m3 --phases=synthetic --concurrency=${CONCURRENCY:-1} \
    --warm_steps=3 --steps=12 --profile_steps=${PROFILE_STEPS:-3} --profile_running=1 --time_budget_s=$((${RUN_TIMEOUT:-250} - 10)) --output_dir="$OUT/$variant" --decode_xla_options="${DECODE_OPTIONS_OF[$variant]:-}" ${ARGS_OF[$variant]:-} "$@" 2>&1 \
    | tee "$OUT/$variant/run.log" | grep -v "^WARNING\|^I1\|^W1" | grep "ready\|c=\|step ~\|hisparse / baseline\|error\|Error\|skip" | sed "s/^/[$variant] /"
  if [[ ${CB_VLOG:-0} == 1 ]]; then
    python3 benchmarks/probes/command_buffer_updates.py "$OUT/$variant/run.log" | tee "$OUT/$variant/command_buffer_updates.txt"
  fi
  gzip -f "$OUT/$variant/run.log"
  rm -rf "$OUT/$variant"/trace_* "$OUT/$variant"/hlo_dump "$OUT/$variant"/*.png  # large; the splits are in the JSON
done
