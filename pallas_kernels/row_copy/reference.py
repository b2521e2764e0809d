"""Row copies in jnp (gathers and scatters through device staging): what the kernels are tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.common import check_gather_inputs
from pallas_kernels.row_copy.base import check_copy_inputs, check_write_all_layers_inputs, check_write_inputs


def _stage_on_device(x: jax.Array) -> jax.Array:
    """Reference-only: a device copy of a host array (XLA cannot gather from pinned host on GPU)."""
    return jax.device_put(x, jax.memory.Space.Device)


def copy_host_rows_to_buffer_reference(pool, device_buffer, layer, miss_host, miss_device, num_misses):
    """The copy in jnp (the pool staged on the device first); shapes as copy_host_rows_to_buffer."""
    # pool: row[L, S, W]; device_buffer: row[L, R, B1, W]; miss_*: i32[R, K]; num_misses: i32[R]
    check_copy_inputs(pool, device_buffer, layer, miss_host, miss_device, num_misses)
    R, K = miss_host.shape
    take = jnp.arange(K)[None, :] < num_misses[:, None]  # bool[R, K]
    rows = _stage_on_device(pool)[layer][jnp.where(take, miss_host, 0)]  # row[R, K, W]
    request = common.request_row(jnp.broadcast_to(jnp.arange(R)[:, None], (R, K)), device_buffer)
    slot = jnp.where(take, miss_device, device_buffer.shape[2])  # dropped where not taken
    return device_buffer.at[layer, request, slot].set(rows, mode="drop")


def gather_host_rows_reference(pool, layer, host_slots, counts):
    """The gather in jnp (the pool staged on the device first); shapes as gather_host_rows."""
    check_gather_inputs(pool, layer, host_slots, counts)
    K = host_slots.shape[1]
    take = jnp.arange(K)[None, :] < counts[:, None]  # bool[R, K]
    return _stage_on_device(pool)[layer][jnp.where(take, host_slots, 0)]  # row[R, K, W]


def write_rows_to_host_reference(pool, layer, rows, host_slots):
    """The write in jnp (staged through the device); shapes as write_rows_to_host."""
    # pool: row[L, S, W]; rows: row[N, W]; host_slots: i32[N] (-1 = skip)
    check_write_inputs(pool, layer, rows, host_slots)
    target = jnp.where(host_slots >= 0, host_slots, pool.shape[1])
    rows = _stage_on_device(rows)  # rows may come from host memory too (a PD transfer)
    updated = _stage_on_device(pool).at[layer, target].set(rows.astype(pool.dtype), mode="drop")
    return jax.device_put(updated, jax.memory.Space.Host)


def write_all_layer_rows_to_host_reference(pool, rows, host_slots):
    """Every layer's write in jnp: pool[l, host_slots[i]] = rows[l, i] (-1 skipped); shapes as
    write_all_layer_rows_to_host."""
    check_write_all_layers_inputs(pool, rows, host_slots)
    target = jnp.where(host_slots >= 0, host_slots, pool.shape[1])  # i32[N]: past the end = dropped
    rows = _stage_on_device(rows)
    layers = jnp.arange(pool.shape[0])[:, None]  # i32[L, 1]
    updated = _stage_on_device(pool).at[layers, target[None, :]].set(rows.astype(pool.dtype), mode="drop")
    return jax.device_put(updated, jax.memory.Space.Host)
