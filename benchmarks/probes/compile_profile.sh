#!/bin/bash
# Where does the HiSparse decode step's compile time go on the GPU? Runs the rank memory probe
# (benchmarks/probes/rank_memory.py, which times lowering and compiling apart) with XLA's per-pass
# times logged and, where the machine allows ptrace, under py-spy's native sampler (a static
# binary carried as .whl/py-spy). Writes $OUT/{stdout.txt,log.txt.gz,spy.txt} and prints the
# passes that took longest and the hottest native frames.
#   bash benchmarks/probes/compile_profile.sh --layers=8      # H200, ~4 min
set -u
source benchmarks/gpu_wheels/env.sh
OUT=${OUT:-/tmp}
export TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1
probe=(python3 benchmarks/probes/rank_memory.py "$@")
if [ -x .whl/py-spy ] && .whl/py-spy record --native -r 20 -f raw -o "$OUT/spy.txt" -- "${probe[@]}" >"$OUT/stdout.txt" 2>"$OUT/log.txt"; then
  echo "profiled with py-spy"
else
  echo "py-spy unavailable or failed; running without it"; tail -3 "$OUT/log.txt"
  "${probe[@]}" >"$OUT/stdout.txt" 2>"$OUT/log.txt"
fi
python3 benchmarks/probes/pass_times.py "$OUT/log.txt" --top=25
grep -E "lower_s|weights" "$OUT/stdout.txt" | cut -c1-220
[ -s "$OUT/spy.txt" ] && python3 benchmarks/probes/spy_top.py "$OUT/spy.txt"
gzip -f "$OUT/log.txt"
