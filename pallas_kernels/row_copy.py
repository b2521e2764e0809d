"""Row copies between the pinned host pool and the device: swap-in, plan replay, backup.

  copy_host_rows_to_buffer: host pool -> device buffer, the rows a swap-in plan names. Used by
    the swap-in of a layer and, unchanged, by shared-index layers replaying their anchor's plan.
  gather_host_rows: host pool -> a fresh device array [R, K, W], the rows a plan names. Used by
    shared-index layers' prefetch, which may run on a second stream (it aliases nothing).
  write_rows_to_host: device rows -> host pool slots, in place. Used by the eager backup of the
    newest token and by prefill's direct-to-host writes.

On GPU both kernels address the pinned host pool directly (UVA over PCIe): no staging copy of
the pool exists; benchmarks/bench_kernels.py asserts the compiled HLO holds none. Rows move as
opaque `W`-wide arrays, split into power-of-two pieces (Triton's rule): 576 = 512 + 64, fp8's
164 words = 128 + 32 + 4; every piece of a row is loaded (16-byte vector loads) before any is
stored, so a row costs one PCIe round trip, not one per piece.

The swap-in copy runs on a fixed grid (PROGRAMS_PER_SM per SM, fewer if there is less work): the
programs share the (request, `rows` misses) work items, so the launch costs the same at any
batch and does nothing past one load of num_misses when nothing missed, and a single request
with many misses still spreads over many SMs.

implementation="tpu" moves the same rows as DMAs (pallas_kernels/tpu_row_copy.py).

Shape letters: L layers, R requests, K plan entries, S host pool rows, N rows to write,
W row width, B1 = B + 1 device slots per request.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.common import check_equal, check_layer_index, check_rank

DEFAULT_ROWS_PER_PROGRAM = 16  # rows per work item of the copy (HiSparseConfig.copy_rows_per_program)
# Copy programs per SM. Measured on the H200 (bench_kernels.py --tune, 2026-12-01): 16 rows x
# 4 warps x 4 per SM copies 256 x 2048 rows from a 9.66 GB pool in 12.03 ms (50 GB/s, the
# contiguous device_put of the same bytes: 49 GB/s); 32 rows x 8 warps, 8 per SM and
# evict_first loads all came within 2% (11.80 - 11.95 ms). With no misses the launch takes
# 1.2 - 1.8 us at batch 1 - 256.
PROGRAMS_PER_SM = 4


def _check_copy_inputs(pool, device_buffer, layer, miss_host, miss_device, num_misses) -> None:
    """Static shape checks of the host -> device copy."""
    check_rank("pool", pool, 3, "[L, S, W]")
    check_rank("device_buffer", device_buffer, 4, "[L, R, B1, W]")
    check_rank("miss_host", miss_host, 2, "[R, K]")
    check_equal("device_buffer row width", device_buffer.shape[3], "pool row width (W)", pool.shape[2])
    check_equal("device_buffer layers", device_buffer.shape[0], "pool layers (L)", pool.shape[0])
    check_equal("miss_device shape", miss_device.shape, "miss_host shape", miss_host.shape)
    # A batch of b <= R requests copies into slots 0 .. b - 1 (the engine's batch buckets); a
    # device_buffer with one request slot is a pool shared by the batch (miss_device: its rows).
    if miss_host.shape[0] > device_buffer.shape[1] != 1:
        raise ValueError(
            f"miss_host batch ({miss_host.shape[0]}) must not exceed the device_buffer request slots (R = {device_buffer.shape[1]})"
        )
    check_rank("num_misses", num_misses, 1, "[R]")
    check_equal("num_misses batch", num_misses.shape[0], "miss_host batch (R)", miss_host.shape[0])
    check_layer_index(layer, pool.shape[0])


def _check_write_inputs(pool, layer, rows, host_slots) -> None:
    """Static shape checks of the device -> host write."""
    check_rank("pool", pool, 3, "[L, S, W]")
    check_rank("rows", rows, 2, "[N, W]")
    check_equal("rows width", rows.shape[1], "pool row width (W)", pool.shape[2])
    check_rank("host_slots", host_slots, 1, "[N]")
    check_equal("host_slots length", host_slots.shape[0], "rows (N)", rows.shape[0])
    check_layer_index(layer, pool.shape[0])


def _stage_on_device(x: jax.Array) -> jax.Array:
    """Reference-only: a device copy of a host array (XLA cannot gather from pinned host on GPU)."""
    return jax.device_put(x, jax.memory.Space.Device)


# --------------------------------------------------------------------------------------------
# host pool -> device buffer
# --------------------------------------------------------------------------------------------


def copy_host_rows_to_buffer_reference(pool, device_buffer, layer, miss_host, miss_device, num_misses):
    """The copy in jnp (the pool staged on the device first); shapes as copy_host_rows_to_buffer."""
    # pool: row[L, S, W]; device_buffer: row[L, R, B1, W]; miss_*: i32[R, K]; num_misses: i32[R]
    _check_copy_inputs(pool, device_buffer, layer, miss_host, miss_device, num_misses)
    R, K = miss_host.shape
    take = jnp.arange(K)[None, :] < num_misses[:, None]  # bool[R, K]
    rows = _stage_on_device(pool)[layer][jnp.where(take, miss_host, 0)]  # row[R, K, W]
    request = common.request_row(jnp.broadcast_to(jnp.arange(R)[:, None], (R, K)), device_buffer)
    slot = jnp.where(take, miss_device, device_buffer.shape[2])  # dropped where not taken
    return device_buffer.at[layer, request, slot].set(rows, mode="drop")


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


def num_sms() -> int:
    """Streaming multiprocessors of the default device (132 on an H200); 2 where unknown (CPU)."""
    return getattr(jax.devices()[0], "core_count", None) or 2


def copy_grid_size(R: int, K: int, rows: int, programs: int | None = None) -> int:
    """Programs of the copy kernel: `programs` (default PROGRAMS_PER_SM per SM), never more than
    the largest possible number of work items (R x ceil(K / rows))."""
    if programs is None:
        programs = PROGRAMS_PER_SM * num_sms()
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
    _check_copy_inputs(pool, device_buffer, layer, miss_host, miss_device, num_misses)
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
    _check_copy_inputs(pool, device_buffer, layer, miss_host, miss_device, num_misses)
    implementation = common.resolve_implementation(implementation)
    if implementation == "tpu":
        from pallas_kernels.tpu_row_copy import copy_host_rows_to_buffer_tpu

        if device_buffer.shape[1] == 1 < miss_host.shape[0]:
            raise ValueError("the TPU copy kernel does not write a shared device pool (row[L, 1, N, W]) yet")

        return copy_host_rows_to_buffer_tpu(pool, device_buffer, jnp.asarray(layer, jnp.int32), miss_host, miss_device, num_misses)
    if implementation == "pallas":
        return copy_host_rows_to_buffer_pallas(
            pool, device_buffer, jnp.asarray(layer, jnp.int32), miss_host, miss_device, num_misses, rows=rows_per_program
        )
    return copy_host_rows_to_buffer_reference(pool, device_buffer, layer, miss_host, miss_device, num_misses)


# --------------------------------------------------------------------------------------------
# host pool -> a fresh device array (shared-index prefetch)
# --------------------------------------------------------------------------------------------


def check_gather_inputs(pool, layer, host_slots, counts) -> None:
    """Static shape checks of the host -> fresh device array gather."""
    check_rank("pool", pool, 3, "[L, S, W]")
    check_rank("host_slots", host_slots, 2, "[R, K]")
    check_rank("counts", counts, 1, "[R]")
    check_equal("counts batch", counts.shape[0], "host_slots batch (R)", host_slots.shape[0])
    check_layer_index(layer, pool.shape[0])


def gather_host_rows_reference(pool, layer, host_slots, counts):
    """The gather in jnp (the pool staged on the device first); shapes as gather_host_rows."""
    check_gather_inputs(pool, layer, host_slots, counts)
    K = host_slots.shape[1]
    take = jnp.arange(K)[None, :] < counts[:, None]  # bool[R, K]
    return _stage_on_device(pool)[layer][jnp.where(take, host_slots, 0)]  # row[R, K, W]


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


# --------------------------------------------------------------------------------------------
# device rows -> host pool
# --------------------------------------------------------------------------------------------


def write_rows_to_host_reference(pool, layer, rows, host_slots):
    """The write in jnp (staged through the device); shapes as write_rows_to_host."""
    # pool: row[L, S, W]; rows: row[N, W]; host_slots: i32[N] (-1 = skip)
    _check_write_inputs(pool, layer, rows, host_slots)
    target = jnp.where(host_slots >= 0, host_slots, pool.shape[1])
    rows = _stage_on_device(rows)  # rows may come from host memory too (a PD transfer)
    updated = _stage_on_device(pool).at[layer, target].set(rows.astype(pool.dtype), mode="drop")
    return jax.device_put(updated, jax.memory.Space.Host)


def _write_rows_to_host_kernel(
    layer_ref,  # i32[1]
    host_slots_ref,  # i32[N]
    rows_ref,  # row[N, W]
    _pool_in,  # aliased to pool_ref
    pool_ref,  # row[L, S, W] pinned host, in/out
    *,
    rows: int,
    interpret: bool,
):
    N, S = host_slots_ref.shape[0], pool_ref.shape[1]
    i = pl.program_id(0) * rows + jnp.arange(rows, dtype=jnp.int32)
    in_range = i < N
    safe_i = common.safe_index(i, in_range, N)
    slot = common.gather(host_slots_ref, (safe_i,), in_range, -1)
    write = in_range & (slot >= 0)
    slot = common.safe_index(slot, write, S)
    layer = layer_ref[0]
    for offset, size in common.power_of_2_pieces(pool_ref.shape[2]):
        mask = jnp.broadcast_to(write[:, None], (rows, size))
        values = common.gather(rows_ref, common.row_block((), safe_i, offset, size, interpret), mask, 0)
        common.scatter(pool_ref, common.row_block((layer,), slot, offset, size, interpret), values, mask)


def write_rows_to_host_pallas(pool, layer, rows, host_slots, *, rows_per_program=DEFAULT_ROWS_PER_PROGRAM):
    """The Pallas write into the pinned pool in place; shapes as write_rows_to_host."""
    _check_write_inputs(pool, layer, rows, host_slots)
    N = rows.shape[0]
    return pl.pallas_call(
        functools.partial(_write_rows_to_host_kernel, rows=rows_per_program, interpret=common.interpret_mode()),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid=(pl.cdiv(N, rows_per_program),),
        in_specs=[common.any_spec()] * 4,
        out_specs=common.any_spec(),
        input_output_aliases={3: 0},
        compiler_params=common.triton_params(num_warps=4),
        interpret=common.interpret_mode(),
        name="hisparse_write_rows_to_host",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), host_slots, rows.astype(pool.dtype), pool)


def write_rows_to_host(pool, layer, rows, host_slots, *, implementation=None):
    """pool[layer, host_slots[i]] = rows[i] where host_slots[i] >= 0, in place (pool is donated).

    pool: row[L, S, W] (pinned host); layer: int or i32[]; rows: row[N, W]; host_slots: i32[N].
    Returns the updated pool. A jit returning the pool must declare it pinned_host
    (hisparse_jax.state.state_shardings). Raises ValueError on inconsistent static shapes.
    """
    _check_write_inputs(pool, layer, rows, host_slots)
    implementation = common.resolve_implementation(implementation)
    if implementation == "tpu":
        from pallas_kernels.tpu_row_copy import write_rows_to_host_tpu

        return write_rows_to_host_tpu(pool, jnp.asarray(layer, jnp.int32), rows, host_slots)
    if implementation == "pallas":
        return write_rows_to_host_pallas(pool, jnp.asarray(layer, jnp.int32), rows, host_slots)
    return write_rows_to_host_reference(pool, layer, rows, host_slots)
