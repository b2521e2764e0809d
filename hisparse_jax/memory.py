"""Memory kinds: where each array lives.

The host pool lives in `pinned_host` memory, which the GPU reads and writes directly over PCIe
(UVA), so swap-in kernels gather from it with no staging copy. The CPU backend has the same
memory kind, so CPU tests run the very same code path (except the TPU kernels in TPU interpret
mode: host_pool_kind).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

PINNED_HOST = "pinned_host"
DEVICE = "device"

# XLA's GPU rematerialisation counts a program's pinned_host arguments as device memory: a
# full-depth rank (102.6 GB of weights, a 65.6 GB host pool) was estimated at 207.8 GiB against a
# 188 GiB limit, and the pass then spent minutes per decode-step compile trying to shrink a
# program that fits (H200, 2026-12-03). A decode step has nothing worth rematerialising (its
# temporaries are ~0.1 GB), so the limit is lifted out of its way.
HOST_POOL_XLA_FLAGS = ("--xla_gpu_memory_limit_slop_factor=10000",)


def add_host_pool_xla_flags() -> None:
    """Appends HOST_POOL_XLA_FLAGS to XLA_FLAGS (those not already set there). Call before JAX
    starts its backend: the serving entry points and the benchmarks do."""
    current = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in HOST_POOL_XLA_FLAGS if f.split("=")[0] not in current]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()


def host_pool_kind(implementation: str | None = None) -> str:
    """Where a HiSparse host pool lives for kernels of `implementation` (pallas_kernels'
    "reference" / "pallas" / "tpu", None: the backend's default): pinned_host, except for the TPU
    kernels off a TPU. There they run in TPU interpret mode, and JAX 0.11.2 cannot lower a jit
    that holds a pinned_host array and an interpret-mode TPU kernel on the CPU (docs/tpu.md), so
    the pool lives in device memory: on the CPU the same host RAM, without the pinned kind. On a
    TPU the pool is pinned_host, as on a GPU."""
    from pallas_kernels.common import on_tpu, resolve_implementation

    if resolve_implementation(implementation) == "tpu" and not on_tpu():
        return DEVICE
    return PINNED_HOST


def default_device() -> jax.Device:
    """The first local device: where single-device state is placed by default."""
    return jax.local_devices()[0]


def sharding(memory_kind: str, device: jax.Device | None = None) -> SingleDeviceSharding:
    """A single-device sharding in `memory_kind` (DEVICE or PINNED_HOST) on `device` (default_device)."""
    return SingleDeviceSharding(device or default_device(), memory_kind=memory_kind)


def memory_kind_of(x: jax.Array) -> str | None:
    """The memory kind `x` lives in ("device", "pinned_host", ...), None where unknown."""
    return getattr(x.sharding, "memory_kind", None)


def allocate(shape, dtype, fill_value, memory_kind: str, device: jax.Device | None = None, *, placement=None) -> jax.Array:
    """dtype[*shape] filled with fill_value, created directly in `memory_kind` on `device`, or
    with the sharding `placement` (which then also carries the memory kind).

    Never goes through a numpy array first: that needs twice the RAM for a large host pool
    (measured: 64 GiB pinned took 35 s this way, and would need 128 GiB via numpy).
    """
    out = placement if placement is not None else sharding(memory_kind, device)
    if getattr(out, "memory_kind", memory_kind) != DEVICE and _is_zero(fill_value):
        # A jit of jnp.full into host memory computes the array on the device first and copies
        # it out (jax-ml/jax#25396): a host pool larger than the device's free memory fails, and
        # measured on the H200 a 16 GiB pool raised the device's peak by 16 GiB and took 8.9 s.
        # numpy's zeros are untouched pages until read, so this costs only the pinned buffer
        # and one copy (1.2 s, no device memory: benchmarks/probes/rank_memory.py, 2026-12-03).
        return jax.device_put(np.zeros(shape, dtype), out)

    @functools.partial(jax.jit, out_shardings=out)
    def make():
        return jnp.full(shape, fill_value, dtype)

    return make()


def _is_zero(fill_value) -> bool:
    value = np.asarray(fill_value)
    return value.size == 1 and not np.isnan(value.astype(np.float64)) and value == 0


def hlo_copy_lines(compiled_hlo_text: str, shape: str) -> list[str]:
    """Lines of optimised HLO that copy an array of `shape` (e.g. "bf16[1,524288,576]").

    The swap-in must read the pinned pool in place; a `copy` of the pool's shape would mean XLA
    staged it on the device (9.7 GB per layer at batch 256), which tests and benchmarks forbid.
    """
    return [line.strip() for line in compiled_hlo_text.splitlines() if shape in line and " copy" in line]
