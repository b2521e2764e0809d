"""TPU row copies between the host pool and the device buffer, as DMAs (implementation="tpu").

The same two operations as pallas_kernels.row_copy, with the same signatures and results:
  copy_host_rows_to_buffer_tpu: pool[layer, miss_host[r, i]] -> device_buffer[layer, r,
    miss_device[r, i]] for i < num_misses[r];
  write_rows_to_host_tpu: rows[i] -> pool[layer, host_slots[i]] where host_slots[i] >= 0, in
    place (the pool is an aliased input/output).

A TPU core does not load from host memory with vector instructions the way a GPU thread loads
through UVA: every row moves as one DMA descriptor (`pltpu.make_async_copy`) between refs left
where they are (`memory_space=pl.ANY`: the pinned_host pool, the HBM buffer). The plan (miss
slots, host slots) is scalar-prefetched into SMEM, where the scalar core reads it to build the
descriptors. Up to `num_semaphores` DMAs are in flight at once, each on its own DMA semaphore:
copy i signals semaphore i mod N, and before copy i starts the kernel waits for copy i - N on
the same semaphore, so the DMA engines always have N rows queued and no semaphore ever counts
two copies. A row is moved whole (W elements, e.g. 576 bf16 = 1152 B or 164 u32 words for fp8),
so the 576 = 4.5 x 128 lane width never meets the vector unit here.

Shape letters as in pallas_kernels.row_copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common

DEFAULT_SEMAPHORES = 8  # DMAs in flight per program


def _pipelined_dmas(count, make_copy, wanted, num_semaphores: int) -> None:
    """Starts make_copy(i, sem_slot) for i in [0, count) where wanted(i), keeping at most
    num_semaphores in flight (copy i waits for copy i - num_semaphores first), then waits for
    the tail. make_copy(i, s) -> an AsyncCopyDescriptor signalling semaphore s."""

    def start(i, _):
        s = i % num_semaphores

        @pl.when((i >= num_semaphores) & wanted(jnp.maximum(i - num_semaphores, 0)))
        def _():
            make_copy(i - num_semaphores, s).wait()

        @pl.when(wanted(i))
        def _():
            make_copy(i, s).start()

        return 0

    jax.lax.fori_loop(0, count, start, 0)

    def drain(i, _):
        @pl.when(wanted(i))
        def _():
            make_copy(i, i % num_semaphores).wait()

        return 0

    jax.lax.fori_loop(jnp.maximum(count - num_semaphores, 0), count, drain, 0)


def _copy_host_rows_kernel(
    layer_ref,  # SMEM i32[1]
    num_misses_ref,  # SMEM i32[R]
    miss_host_ref,  # SMEM i32[R, K]
    miss_device_ref,  # SMEM i32[R, K]
    pool_ref,  # ANY row[L, S, W] (pinned host on a TPU)
    _buffer_in,  # aliased to buffer_ref
    buffer_ref,  # ANY row[L, R, B1, W]
    sems,  # DMA semaphores [N]
    *,
    num_semaphores: int,
):
    r = pl.program_id(0)
    layer = layer_ref[0]

    def make_copy(i, s):
        return pltpu.make_async_copy(
            pool_ref.at[layer, pl.ds(miss_host_ref[r, i], 1)],
            buffer_ref.at[layer, r, pl.ds(miss_device_ref[r, i], 1)],
            sems.at[s],
        )

    _pipelined_dmas(num_misses_ref[r], make_copy, lambda i: True, num_semaphores)


def copy_host_rows_to_buffer_tpu(pool, device_buffer, layer, miss_host, miss_device, num_misses, *, num_semaphores=DEFAULT_SEMAPHORES):
    """The TPU copy: one program per request, one DMA per missed row, the pool read in place.

    Shapes as pallas_kernels.row_copy.copy_host_rows_to_buffer (shape-checked by its caller);
    returns the updated row[L, R, B1, W]. num_misses[r] must not exceed K (the plan's rule)."""
    R, K = miss_host.shape
    num_misses = jnp.clip(num_misses.astype(jnp.int32), 0, K)
    return pl.pallas_call(
        functools.partial(_copy_host_rows_kernel, num_semaphores=num_semaphores),
        out_shape=jax.ShapeDtypeStruct(device_buffer.shape, device_buffer.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(R,),
            in_specs=[common.any_spec()] * 2,
            out_specs=common.any_spec(),
            scratch_shapes=[pltpu.SemaphoreType.DMA((num_semaphores,))],
        ),
        input_output_aliases={5: 0},  # device_buffer (operand 5, counting the 4 prefetched)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=common.tpu_interpret(),
        name="hisparse_copy_host_rows_tpu",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        num_misses,
        miss_host.astype(jnp.int32),
        miss_device.astype(jnp.int32),
        pool,
        device_buffer,
    )


def _write_rows_to_host_kernel(
    layer_ref,  # SMEM i32[1]
    host_slots_ref,  # SMEM i32[N]
    rows_ref,  # ANY row[N, W]
    _pool_in,  # aliased to pool_ref
    pool_ref,  # ANY row[L, S, W] (pinned host on a TPU)
    sems,  # DMA semaphores [N]
    *,
    num_semaphores: int,
):
    layer = layer_ref[0]

    def make_copy(i, s):
        return pltpu.make_async_copy(
            rows_ref.at[pl.ds(i, 1)],
            pool_ref.at[layer, pl.ds(jnp.maximum(host_slots_ref[i], 0), 1)],
            sems.at[s],
        )

    _pipelined_dmas(rows_ref.shape[0], make_copy, lambda i: host_slots_ref[i] >= 0, num_semaphores)


def write_rows_to_host_tpu(pool, layer, rows, host_slots, *, num_semaphores=DEFAULT_SEMAPHORES):
    """The TPU write: one DMA per row into the pool, in place (pool aliased to the output).

    Shapes as pallas_kernels.row_copy.write_rows_to_host (shape-checked by its caller)."""
    return pl.pallas_call(
        functools.partial(_write_rows_to_host_kernel, num_semaphores=num_semaphores),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(1,),
            in_specs=[common.any_spec()] * 2,
            out_specs=common.any_spec(),
            scratch_shapes=[pltpu.SemaphoreType.DMA((num_semaphores,))],
        ),
        input_output_aliases={3: 0},  # pool (operand 3, counting the 2 prefetched)
        interpret=common.tpu_interpret(),
        name="hisparse_write_rows_to_host_tpu",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), host_slots.astype(jnp.int32), rows.astype(pool.dtype), pool)
