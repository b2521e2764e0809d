# Sourced by the *_h200.sh scripts: the GPU run's environment, and the carried wheels (.whl/,
# see benchmarks/README.md) installed into /tmp/site when there are any.
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-100} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.9}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# XLA_CACHE=DIR: XLA's GEMM autotuning results kept in DIR across processes (JAX's persistent
# cache turns them on; executables are not stored: a rank's are GBs and no two runs share one).
# XLA_CACHE_SEED=FILE.tgz: results from an earlier call, unpacked there first (benchmarks/xla_cache/).
# XLA_CACHES=all adds XLA's compiled-kernel cache: it cut a DeepSeek-V3.2 rank's compile from 161
# to < 40 s, and the cached kernels then failed with CUDA_ERROR_ILLEGAL_INSTRUCTION (2026-12-04;
# docs/PERFORMANCE.md: the cache file keys kernels by name, which an engine's programs reuse).
if [[ -n ${XLA_CACHE:-} ]]; then
  mkdir -p "$XLA_CACHE"
  if [[ -n ${XLA_CACHE_SEED:-} && -f $XLA_CACHE_SEED ]]; then tar -xzf "$XLA_CACHE_SEED" -C "$XLA_CACHE"; fi
  export JAX_COMPILATION_CACHE_DIR=$XLA_CACHE JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=${XLA_CACHES:-xla_gpu_per_fusion_autotune_cache_dir}
  export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=1000000000000000
fi
