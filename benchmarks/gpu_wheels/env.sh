# Sourced by the *_h200.sh scripts: the GPU run's environment, and the carried wheels (.whl/,
# see benchmarks/README.md) installed into /tmp/site when there are any.
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-100} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.9}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
