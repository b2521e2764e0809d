#!/usr/bin/env bash
# The decode-step roofline run on the H200 (one device call, ~8 min): tokamax + qwix come as
# wheels (carry .whl: see benchmarks/README.md), then bench_step.py's MoE table and step sweep.
#   OUT=/tmp/out bash benchmarks/step_h200.sh
set -uo pipefail
OUT=${OUT:-outputs/bench_step}
mkdir -p "$OUT"
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=100 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.9}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
timeout ${STEP_TIMEOUT:-540} python3 benchmarks/bench_step.py --out="$OUT" --time_budget_s=${BUDGET:-420} "$@" 2>&1 | tee "$OUT/bench_step.log" | grep -v "^WARNING:absl:Autotuning cache miss"
