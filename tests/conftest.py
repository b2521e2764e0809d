import os
import sys

# Tests run on the CPU: Pallas kernels in interpret mode, memory kinds as on the GPU. Four host
# devices let the sharded (data-parallel x tensor-parallel) tests build a 2 x 2 mesh; everything
# else runs on the default device as before.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
sys.path.insert(0, os.path.dirname(__file__))
