import os
import sys

# Tests run on the CPU: Pallas kernels in interpret mode, memory kinds as on the GPU. Four host
# devices let the sharded (data-parallel x tensor-parallel) tests build a 2 x 2 mesh; everything
# else runs on the default device as before. On a GPU machine, JAX_PLATFORMS=cuda runs them on
# the GPU instead (compiled kernels): without it they run on its CPU
# (benchmarks/gpu_tests_h200.sh sets it).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
# On the CPU the suite's time is mostly XLA compiling tiny programs, and LLVM's optimisation of
# them costs more than it saves (test_models + test_speculative_layer: 133 -> 92 s). Level 0 keeps
# IEEE semantics (no fast math), so results hold; the GPU keeps XLA's default.
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
sys.path.insert(0, os.path.dirname(__file__))
# One persistent compilation cache for the run's worker processes and the scripts tests start
# (they inherit the environment): many modules compile the same tiny-model steps. A fresh
# clone starts with an empty cache under .pytest_cache (git-ignored).
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax_compilation_cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
# Every program, however quick to compile: the scripts tests start recompile the same small ones
# (test_run_decode + test_speculative: 196 -> 176 s against a 0.3 s floor).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
