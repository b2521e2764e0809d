"""Row copies as Pallas GPU kernels (Triton lowering): 16-byte vector loads from the pinned pool over
UVA, a fixed grid of programs looping over (request, rows) work items."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.common import check_gather_inputs
from pallas_kernels.row_copy.base import DEFAULT_ROWS_PER_PROGRAM, check_copy_inputs, check_write_all_layers_inputs, check_write_inputs

# Copy programs per SM. Measured on the H200 (bench_kernels.py --tune, 2026-12-01): 16 rows x
# 4 warps x 4 per SM copies 256 x 2048 rows from a 9.66 GB pool in 12.03 ms (50 GB/s, the
# contiguous device_put of the same bytes: 49 GB/s); 32 rows x 8 warps, 8 per SM and
# evict_first loads all came within 2% (11.80 - 11.95 ms). With no misses the launch takes
# 1.2 - 1.8 us at batch 1 - 256.
PROGRAMS_PER_SM = 4


def _request_of_item(item, items_end, num_misses, requests):
    """(request, its first item, its miss count) of work item `item` (a scalar).

    items_end: i32[Rb] work items of requests 0..r together (inclusive cumsum); num_misses,
    requests: i32[Rb]. Register-only: a compare and three reductions, no memory round trip."""
    before = items_end <= item  # bool[Rb]: requests whose items all come before `item`
    r = jnp.sum(before.astype(jnp.int32))
    first = jnp.max(jnp.where(before, items_end, 0))  # items_end is non-decreasing
    return r, first, jnp.sum(jnp.where(requests == r, num_misses, 0))


def _load_rows(pool_ref, layer, src, take, interpret, eviction_policy):
    """All pieces of the rows pool[layer, src[i]] (row[rows, size] each), loaded before any store
    so that every piece of every row is in flight at once (a store in between would have to wait:
    the compiler cannot tell the pool from the buffer)."""
    pieces = []
    for offset, size in common.power_of_2_pieces(pool_ref.shape[2]):
        mask = jnp.broadcast_to(take[:, None], (take.shape[0], size))
        index = common.row_block((layer,), src, offset, size, interpret)
        values = plgpu.load(pool_ref.at[index], mask=mask, other=0, eviction_policy=eviction_policy)
        pieces.append((offset, size, mask, values))
    return pieces


def _copy_host_rows_kernel(
    layer_ref,  # i32[1]
    num_misses_ref,  # i32[R]
    miss_host_ref,  # i32[R, K]
    miss_device_ref,  # i32[R, K]
    pool_ref,  # row[L, S, W], pinned host
    *buffer_refs,  # (aliased input, output) row[L, R, B1, W] in/out; or the output alone (gather_host_rows)
    rows: int,
    request_block: int,
    interpret: bool,
    eviction_policy: str | None,
    buffer_layer: int | None = None,  # the output's layer index when it is not `layer` (gather: 0)
):
    # Work item = `rows` consecutive plan entries of one request; items are numbered request by
    # request, and program p takes items p, p + G, p + 2G, ... (G programs). With no misses
    # anywhere every program exits after one load of num_misses.
    buffer_ref = buffer_refs[-1]
    program, num_programs = pl.program_id(0), pl.num_programs(0)
    R, K = miss_host_ref.shape
    S, B1 = pool_ref.shape[1], buffer_ref.shape[2]
    layer = layer_ref[0]
    out_layer = layer if buffer_layer is None else buffer_layer
    requests = jnp.arange(request_block, dtype=jnp.int32)  # i32[Rb]
    is_request = requests < R
    num = common.gather(num_misses_ref, (common.safe_index(requests, is_request, R),), is_request, 0)  # i32[Rb]
    items_end = jnp.cumsum((num + rows - 1) // rows)  # i32[Rb], inclusive
    total = jnp.max(items_end)
    my_items = (total - program + num_programs - 1) // num_programs  # >= 0: program < num_programs

    def copy_item(t, carry):
        item = program + t * num_programs
        r, first, n_r = _request_of_item(item, items_end, num, requests)
        i = (item - first) * rows + jnp.arange(rows, dtype=jnp.int32)  # i32[rows]: plan entries
        take = i < n_r
        safe_i = common.safe_index(i, take, K)
        src = common.safe_index(common.gather(miss_host_ref, (r, safe_i), take, 0), take, S)  # i32[rows]
        dst = common.safe_index(common.gather(miss_device_ref, (r, safe_i), take, 0), take, B1)  # i32[rows]
        for offset, size, mask, values in _load_rows(pool_ref, layer, src, take, interpret, eviction_policy):
            out_r = common.request_row(r, buffer_ref)
            common.scatter(buffer_ref, common.row_block((out_layer, out_r), dst, offset, size, interpret), values, mask)
        return carry

    jax.lax.fori_loop(0, my_items, copy_item, 0)


def copy_grid_size(R: int, K: int, rows: int, programs: int | None = None) -> int:
    """Programs of the copy kernel: `programs` (default PROGRAMS_PER_SM per SM), never more than
    the largest possible number of work items (R x ceil(K / rows))."""
    if programs is None:
        programs = PROGRAMS_PER_SM * common.num_sms()
    return max(1, min(programs, R * pl.cdiv(K, rows)))


def copy_host_rows_to_buffer_pallas(
    pool,
    device_buffer,
    layer,
    miss_host,
    miss_device,
    num_misses,
    *,
    rows=DEFAULT_ROWS_PER_PROGRAM,
    num_warps=4,
    programs=None,
    eviction_policy=None,
):
    """The Pallas copy, reading the pinned pool in place; shapes as copy_host_rows_to_buffer.

    A fixed grid of `copy_grid_size(R, K, rows, programs)` programs shares the (request, `rows`
    plan entries) work items; returns the updated row[L, R, B1, W]."""
    check_copy_inputs(pool, device_buffer, layer, miss_host, miss_device, num_misses)
    R, K = miss_host.shape
    kernel = functools.partial(
        _copy_host_rows_kernel,
        rows=rows,
        request_block=common.next_power_of_2(R),
        interpret=common.interpret_mode(),
        eviction_policy=eviction_policy,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(device_buffer.shape, device_buffer.dtype),
        grid=(copy_grid_size(R, K, rows, programs),),
        in_specs=[common.any_spec()] * 6,
        out_specs=common.any_spec(),
        input_output_aliases={5: 0},
        compiler_params=common.triton_params(num_warps=num_warps),
        interpret=common.interpret_mode(),
        name="hisparse_copy_host_rows",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), num_misses.astype(jnp.int32), miss_host, miss_device, pool, device_buffer)


def gather_host_rows_pallas(pool, layer, host_slots, counts, *, rows=DEFAULT_ROWS_PER_PROGRAM, num_warps=4, programs=None):
    """The copy kernel reading the pinned pool in place, writing entry i of request r to [r, i]
    of a fresh (unaliased, never zeroed) output; shapes as gather_host_rows."""
    check_gather_inputs(pool, layer, host_slots, counts)
    R, K = host_slots.shape
    kernel = functools.partial(
        _copy_host_rows_kernel,
        rows=rows,
        request_block=common.next_power_of_2(R),
        interpret=common.interpret_mode(),
        eviction_policy=None,
        buffer_layer=0,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((1, R, K, pool.shape[2]), pool.dtype),
        grid=(copy_grid_size(R, K, rows, programs),),
        in_specs=[common.any_spec()] * 5,
        out_specs=common.any_spec(),
        compiler_params=common.triton_params(num_warps=num_warps),
        interpret=common.interpret_mode(),
        name="hisparse_prefetch_host_rows",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        counts.astype(jnp.int32),
        host_slots,
        jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (R, K)),  # i32[R, K]: entry i -> row i
        pool,
    )
    return out[0]


def _write_rows_to_host_kernel(
    layer_ref,  # i32[1] (unused with all_layers)
    host_slots_ref,  # i32[N]
    rows_ref,  # row[N, W], or row[L, N, W] with all_layers
    _pool_in,  # aliased to pool_ref
    pool_ref,  # row[L, S, W] pinned host, in/out
    *,
    rows: int,
    all_layers: bool,
    interpret: bool,
):
    N, S = host_slots_ref.shape[0], pool_ref.shape[1]
    i = pl.program_id(0) * rows + jnp.arange(rows, dtype=jnp.int32)
    in_range = i < N
    safe_i = common.safe_index(i, in_range, N)
    slot = common.gather(host_slots_ref, (safe_i,), in_range, -1)
    write = in_range & (slot >= 0)
    slot = common.safe_index(slot, write, S)
    layer = pl.program_id(1) if all_layers else layer_ref[0]
    source = (layer,) if all_layers else ()  # the rows' leading index
    for offset, size in common.power_of_2_pieces(pool_ref.shape[2]):
        mask = jnp.broadcast_to(write[:, None], (rows, size))
        values = common.gather(rows_ref, common.row_block(source, safe_i, offset, size, interpret), mask, 0)
        common.scatter(pool_ref, common.row_block((layer,), slot, offset, size, interpret), values, mask)


def write_rows_to_host_pallas(pool, layer, rows, host_slots, *, rows_per_program=DEFAULT_ROWS_PER_PROGRAM):
    """The Pallas write into the pinned pool in place; shapes as write_rows_to_host."""
    check_write_inputs(pool, layer, rows, host_slots)
    return _write_pallas(pool, layer, rows, host_slots, rows_per_program, all_layers=False)


def write_all_layer_rows_to_host_pallas(pool, rows, host_slots, *, rows_per_program=DEFAULT_ROWS_PER_PROGRAM):
    """The Pallas write of every layer's rows (row[L, N, W]) in one launch: grid (N blocks, L),
    each program one layer's block of rows; shapes as write_all_layer_rows_to_host."""
    check_write_all_layers_inputs(pool, rows, host_slots)
    return _write_pallas(pool, 0, rows, host_slots, rows_per_program, all_layers=True)  # layer unused: the grid's second axis


def _write_pallas(pool, layer, rows, host_slots, rows_per_program, *, all_layers):
    """One write launch: rows row[N, W] into `layer` (int or i32[]), or with all_layers row[L, N, W] into every layer."""
    N = host_slots.shape[0]
    return pl.pallas_call(
        functools.partial(_write_rows_to_host_kernel, rows=rows_per_program, all_layers=all_layers, interpret=common.interpret_mode()),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid=(pl.cdiv(N, rows_per_program), rows.shape[0]) if all_layers else (pl.cdiv(N, rows_per_program),),
        in_specs=[common.any_spec()] * 4,
        out_specs=common.any_spec(),
        input_output_aliases={3: 0},
        compiler_params=common.triton_params(num_warps=4),
        interpret=common.interpret_mode(),
        name="hisparse_write_rows_to_host",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), host_slots, rows.astype(pool.dtype), pool)
