import os
import sys

# Tests run on the CPU: Pallas kernels in interpret mode, memory kinds as on the GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))
