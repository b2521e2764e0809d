"""The shared-index layers' row gather on a CUDA stream of our own: two XLA FFI calls, start and
wait (api.py); their C++ / CUDA sources in csrc/ (built with nvcc on first use; a g++ CPU build of
the same targets for the tests). The rows it gathers equal pallas_kernels.row_copy's
gather_host_rows, its reference."""

from pallas_kernels.side_stream_gather.api import (
    BLOCKS_ENV, CSRC, DEFAULT_BLOCKS, DEFAULT_THREADS, START_TARGET, WAIT_TARGET, PendingGather, build_dir, can_build_gpu,
    default_blocks, register, side_gather_start, side_gather_wait,
)  # fmt: skip

__all__ = [
    "BLOCKS_ENV", "CSRC", "DEFAULT_BLOCKS", "DEFAULT_THREADS", "START_TARGET", "WAIT_TARGET", "PendingGather", "build_dir",
    "can_build_gpu", "default_blocks", "register", "side_gather_start", "side_gather_wait",
]  # fmt: skip
