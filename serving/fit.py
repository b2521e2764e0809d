"""Whether a model's weights and its KV fit the memory they will live in, checked once JAX knows
its devices and before anything is built: a full-size config on a small device is refused with
one line naming the sizes, instead of minutes of building and an out-of-memory traceback.

    check_fits("--model=deepseek_v32", config, jnp.bfloat16, kv_device_bytes=2e9, kv_host_bytes=8e9)
    # UsageError: --model=deepseek_v32 needs ~1.4 TB of weights in bfloat16 + 2 GB of KV; this device has 24 GB

Sizes: the weights from the family's abstract model (nnx.eval_shape: shapes only, no memory),
the KV from the runner's footprints (the caller's count). Memory: the device's `bytes_limit`
(memory_stats, GPU and TPU); on the CPU, where the device is host memory and the pinned host
pool lives there too, the host's available memory (/proc/meminfo MemAvailable, else sysconf).
The check refuses only what cannot fit (activations and compiler workspace come on top): a
config that passes may still run out.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx

from models import registry
from models.common.progress import bytes_text
from serving.errors import UsageError


def param_bytes(config, dtype) -> int:
    """Bytes of the model's params in `dtype` (the family's abstract model: shapes, no memory)."""
    model = registry.family_of_config(config).abstract_model(config, dtype)
    return int(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(nnx.state(model))))


def available_host_bytes() -> int | None:
    """Host memory available to a new allocation (Linux MemAvailable), else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory(device=None) -> tuple[int | None, bool]:
    """(bytes one device can hold, whether that is the host's memory): the device's bytes_limit,
    or on the CPU (no memory_stats) the host's available memory. None: unknown."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), False
    return available_host_bytes(), True


def check_fits(what: str, config, dtype, *, kv_device_bytes: int, kv_host_bytes: int = 0, parallel=None, device=None) -> None:
    """UsageError when the weights (split over parallel.tp_size devices) plus the device KV (split
    over dp_size groups) exceed one device's memory; on the CPU, when every device's share plus the
    host pool exceed the host's available memory (all of them live there)."""
    limit, is_host = device_memory(device)
    if limit is None:
        return
    params = param_bytes(config, dtype)
    tp = parallel.tp_size if parallel is not None else 1
    dp = parallel.dp_size if parallel is not None else 1
    devices = parallel.num_devices if parallel is not None else 1
    if is_host:  # every device of the mesh and the host pool share this memory
        weights, kv = params * devices // tp, kv_device_bytes + kv_host_bytes
        where = f"this machine has (for all {devices} CPU devices)" if devices > 1 else "this machine has"
    else:
        weights, kv = params // tp, kv_device_bytes // dp
        where = "each device has" if devices > 1 else "this device has"
    if weights + kv <= limit:
        return
    split = f" ({bytes_text(params)} split over {tp} devices)" if tp > 1 and not is_host else ""
    raise UsageError(
        f"{what} needs ~{bytes_text(weights)} of weights in {np.dtype(dtype).name}{split} + {bytes_text(kv)} of KV;"
        f" {where} {bytes_text(limit)} available"
    )
