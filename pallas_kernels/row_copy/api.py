"""Row copies between the pinned host pool and the device: swap-in, plan replay, backup.

  copy_host_rows_to_buffer: host pool -> device buffer, the rows a swap-in plan names. Used by
    the swap-in of a layer and, unchanged, by shared-index layers replaying their anchor's plan.
  gather_host_rows: host pool -> a fresh device array [R, K, W], the rows a plan names. Used by
    shared-index layers' prefetch, which may run on a second stream (it aliases nothing).
  write_rows_to_host: device rows -> host pool slots, in place. Used by the eager backup of the
    newest token and by prefill's direct-to-host writes.
  write_all_layer_rows_to_host: every layer's rows -> the same host slots of each layer, in
    place, one launch. Used by the backup of a decode step's newest rows after its last layer.

On GPU both kernels address the pinned host pool directly (UVA over PCIe): no staging copy of
the pool exists; benchmarks/bench_kernels.py asserts the compiled HLO holds none. Rows move as
opaque `W`-wide arrays, split into power-of-two pieces (Triton's rule): 576 = 512 + 64, fp8's
164 words = 128 + 32 + 4; every piece of a row is loaded (16-byte vector loads) before any is
stored, so a row costs one PCIe round trip, not one per piece.

The swap-in copy runs on a fixed grid (PROGRAMS_PER_SM per SM, fewer if there is less work): the
programs share the (request, `rows` misses) work items, so the launch costs the same at any
batch and does nothing past one load of num_misses when nothing missed, and a single request
with many misses still spreads over many SMs.

implementation="tpu" moves the same rows as DMAs (pallas_kernels/row_copy/pallas_tpu.py).

Shape letters: L layers, R requests, K plan entries, S host pool rows, N rows to write,
W row width, B1 = B + 1 device slots per request.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.common import check_gather_inputs
from pallas_kernels.row_copy.base import DEFAULT_ROWS_PER_PROGRAM, check_copy_inputs, check_write_all_layers_inputs, check_write_inputs
from pallas_kernels.row_copy.pallas_triton import (
    copy_host_rows_to_buffer_pallas,
    gather_host_rows_pallas,
    write_all_layer_rows_to_host_pallas,
    write_rows_to_host_pallas,
)
from pallas_kernels.row_copy.reference import (
    copy_host_rows_to_buffer_reference,
    gather_host_rows_reference,
    write_all_layer_rows_to_host_reference,
    write_rows_to_host_reference,
)


def copy_host_rows_to_buffer(
    pool, device_buffer, layer, miss_host, miss_device, num_misses, *, implementation=None, rows_per_program=DEFAULT_ROWS_PER_PROGRAM
):
    """device_buffer[layer, r, miss_device[r, i]] = pool[layer, miss_host[r, i]] for i < num_misses[r].

    pool: row[L, S, W] (pinned host); device_buffer: row[L, R, B1, W] (updated in place), or
    row[L, 1, N, W] a device pool shared by the batch (miss_device then holds its rows);
    layer: int or i32[]; miss_host, miss_device: i32[R, K]; num_misses: i32[R].
    rows_per_program: the Pallas launch shape (HiSparseConfig.copy_rows_per_program).
    Returns the updated device_buffer; raises ValueError on inconsistent static shapes.
    """
    check_copy_inputs(pool, device_buffer, layer, miss_host, miss_device, num_misses)
    implementation = common.resolve_implementation(implementation)
    if implementation == "tpu":
        from pallas_kernels.row_copy.pallas_tpu import copy_host_rows_to_buffer_tpu

        if device_buffer.shape[1] == 1 < miss_host.shape[0]:
            raise ValueError("the TPU copy kernel does not write a shared device pool (row[L, 1, N, W]) yet")

        return copy_host_rows_to_buffer_tpu(pool, device_buffer, jnp.asarray(layer, jnp.int32), miss_host, miss_device, num_misses)
    if implementation == "pallas":
        return copy_host_rows_to_buffer_pallas(
            pool, device_buffer, jnp.asarray(layer, jnp.int32), miss_host, miss_device, num_misses, rows=rows_per_program
        )
    return copy_host_rows_to_buffer_reference(pool, device_buffer, layer, miss_host, miss_device, num_misses)


def gather_host_rows(pool, layer, host_slots, counts, *, implementation=None, rows_per_program=DEFAULT_ROWS_PER_PROGRAM):
    """out[r, i] = pool[layer, host_slots[r, i]] for i < counts[r]: row[R, K, W], a new device array.

    pool: row[L, S, W] (pinned host, read only); layer: int or i32[]; host_slots: i32[R, K];
    counts: i32[R]. Rows of out past counts[r] are undefined: callers read only the first
    counts[r]. What a shared-index layer's prefetch uses (HiSparseState.prefetch_misses): the
    output aliases nothing, so XLA may run it on another stream while other kernels use the
    device buffer. No TPU version yet: implementation="tpu" raises NotImplementedError.
    """
    check_gather_inputs(pool, layer, host_slots, counts)
    implementation = common.resolve_implementation(implementation)
    if implementation == "tpu":
        raise NotImplementedError("gather_host_rows has no TPU implementation; replay shared layers in line (prefetch 'off')")
    if implementation == "pallas":
        return gather_host_rows_pallas(pool, jnp.asarray(layer, jnp.int32), host_slots, counts, rows=rows_per_program)
    return gather_host_rows_reference(pool, layer, host_slots, counts)


def write_rows_to_host(pool, layer, rows, host_slots, *, implementation=None):
    """pool[layer, host_slots[i]] = rows[i] where host_slots[i] >= 0, in place (pool is donated).

    pool: row[L, S, W] (pinned host); layer: int or i32[]; rows: row[N, W]; host_slots: i32[N].
    Returns the updated pool. A jit returning the pool must declare it pinned_host
    (hisparse_jax.state.state_shardings). Raises ValueError on inconsistent static shapes.
    """
    check_write_inputs(pool, layer, rows, host_slots)
    implementation = common.resolve_implementation(implementation)
    if implementation == "tpu":
        from pallas_kernels.row_copy.pallas_tpu import write_rows_to_host_tpu

        return write_rows_to_host_tpu(pool, jnp.asarray(layer, jnp.int32), rows, host_slots)
    if implementation == "pallas":
        return write_rows_to_host_pallas(pool, jnp.asarray(layer, jnp.int32), rows, host_slots)
    return write_rows_to_host_reference(pool, layer, rows, host_slots)


def write_all_layer_rows_to_host(pool, rows, host_slots, *, implementation=None):
    """pool[l, host_slots[i]] = rows[l, i] for every layer l where host_slots[i] >= 0, in place
    (pool is donated): write_rows_to_host of all layers in one launch (one kernel, not L).

    pool: row[L, S, W] (pinned host); rows: row[L, N, W]; host_slots: i32[N] (the same slots in
    every layer: a request's position is at the same host slot in each). Returns the updated
    pool. Raises ValueError on inconsistent static shapes.
    """
    check_write_all_layers_inputs(pool, rows, host_slots)
    implementation = common.resolve_implementation(implementation)
    if implementation == "pallas":
        return write_all_layer_rows_to_host_pallas(pool, rows, host_slots)
    if implementation == "tpu":  # one DMA kernel per layer
        for layer in range(pool.shape[0]):
            pool = write_rows_to_host(pool, layer, rows[layer], host_slots, implementation=implementation)
        return pool
    return write_all_layer_rows_to_host_reference(pool, rows, host_slots)
