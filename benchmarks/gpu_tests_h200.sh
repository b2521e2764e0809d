#!/usr/bin/env bash
# The CPU test modules whose kernels matter most, run on the GPU with compiled kernels (one device
# call, ~3-4 min): the side-stream gather (CUDA build) and its layer harness, the paged pool's
# shared-pool kernels, the attention layer's prefetch and backup paths. tests/conftest.py picks the
# CPU unless JAX_PLATFORMS is set, so it is set here.
#   OUT=/tmp/out bash benchmarks/gpu_tests_h200.sh
set -uo pipefail
OUT=${OUT:-outputs/gpu_tests}
mkdir -p "$OUT"
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=100
export HISPARSE_JAX_BUILD_DIR=${HISPARSE_JAX_BUILD_DIR:-/tmp/hisparse_jax_build}
python3 -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())"
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -n 0 -p no:cacheprovider -W ignore --tb=short -m "slow or not slow" \
  tests/test_gpu.py tests/test_side_stream_gather.py tests/test_paged_state.py \
  "tests/test_attention_layer.py::test_prefetched_shared_layer_and_deferred_backup_equal_no_offload" \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -40
