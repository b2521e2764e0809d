"""TPU swap-in plan (implementation="tpu"): one program per request, its comparison matrices
tiled so the kernel fits a TensorCore's scoped VMEM at production sizes.

The same contract, signature and results as pallas_kernels.swap_in.swap_in_plan_pallas, bit for
bit (tests/test_tpu_kernels.py holds it to the plain-Python oracle and the jnp reference).

The GPU kernel resolves positions through a per-request hash row in global memory (`scratch`)
with masked scatters and CTA barriers. A TPU core has no scatter to VMEM with vector lanes and
no cheap per-lane random access, so this kernel is scatter-free: the request's top-k row
(i32[1, K]), its buffer_tokens and lru_slots rows of the layer (i32[1, B]) and its page-table
row are brought into VMEM by the BlockSpec pipeline (the layer index and the lengths are
scalar-prefetched into SMEM; the layer picks the block), and every decision is a comparison
matrix reduced along one axis:
  * first occurrence:   [K, K] "same position, earlier index";
  * hits:               [K, B] "top-k entry == buffer token";
  * ranks (prefix sums): [K, K] / [B, B] "earlier and marked", summed;
  * victims, the new buffer tokens, the slot of every entry, the new LRU order and the
    compacted miss plan: [K, B], [B, B], [K, P] and [K, K] one-hot selections, summed.
Every reduction is an int32 sum/max over a lane or sublane axis: ops the Mosaic lowering has.
`scratch` is not needed and is returned unchanged (SCRATCH_EMPTY stays SCRATCH_EMPTY).

Tiling: whole, the matrices are O(B^2 + K*B) int32 per request, 151 MiB for [B, B] alone at
B = 6144, beyond any TensorCore's VMEM. Here no matrix is ever built whole: each is computed
tile by tile, ROWS rows (one 128-row chunk of the reduced-over-rows axis) x COLS columns
(1024), in two nested loops, and its reductions accumulate across tiles (sum and max are exact
on int32, so the result is bit-identical to the whole-matrix version). A [128, 1024] int32 tile
is 512 KiB. The per-element vectors the steps pass on (first occurrence, hits, ranks, slots,
...) live as rows of two VMEM scratch arrays, i32[8, K] and i32[8, B] (sublane q holds vector
q), read and written a tile at a time at lane-aligned offsets. A tile is the whole axis where
ROWS / COLS do not divide it (the tests' small shapes; they also run with tiny tiles).
tests/test_tpu_kernels.py lowers the kernel to Mosaic at top_k 2048, device_buffer_size 6144
and bounds what it holds in VMEM (docs/tpu.md has the figures).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common
from pallas_kernels.swap_in.base import SwapInPlan

ROWS = 128  # rows of a comparison tile: a multiple of 128, so row-vector tiles start lane-aligned
COLS = 1024  # columns of a comparison tile (a multiple of 128 as well)

# Rows of the scratch vectors: i32[8, K] per top-k entry, i32[8, B] per LRU position / slot.
FIRST, HIT, MISS, MISS_RANK, MISS_SLOT = range(5)  # [8, K]
SLOT_HIT, HIT_IN_LRU, NONHIT_RANK, HIT_RANK, FILLED, FILL_TOKEN, NEW_BT, NEW_LRU = range(8)  # [8, B]


def _tile(size: int, tile: int) -> int:
    """A tile of an axis of `size`: `tile` where it divides the axis, else the whole axis."""
    return tile if size % tile == 0 else size


def _iota(shape, axis, offset=0):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis) + offset


def _as_int(x):
    return x.astype(jnp.int32)


def _to_col(row):
    """i32[1, X] -> i32[X, 1] (sum with the identity mask)."""
    X = row.shape[1]
    eye = _iota((X, X), 0) == _iota((X, X), 1)
    return jnp.sum(jnp.where(eye, row, 0), axis=1, keepdims=True)


def _to_row(col):
    """i32[X, 1] -> i32[1, X]."""
    X = col.shape[0]
    eye = _iota((X, X), 0) == _iota((X, X), 1)
    return jnp.sum(jnp.where(eye, col, 0), axis=0, keepdims=True)


def _loop(size: int, tile: int, body, carry=None):
    """body(start, carry) -> carry over the tiles [start, start + tile) of an axis of `size`."""
    return jax.lax.fori_loop(0, size // tile, lambda i, c: body(pl.multiple_of(i * tile, tile), c), carry)


def _cols(ref, q: int, start, width):
    """i32[1, width]: vector q of a scratch ref (or the one row of an input block), from `start`."""
    return ref[pl.ds(q, 1), pl.ds(start, width)]


def _plan_kernel(
    layer_ref,  # SMEM i32[1]
    lengths_ref,  # SMEM i32[R]
    topk_ref,  # VMEM i32[1, K]: this request's row
    buffer_tokens_in,  # VMEM i32[1, B]: this request's row of the layer
    lru_in,  # VMEM i32[1, B]
    page_table_ref,  # VMEM i32[1, P]
    slots_ref,  # VMEM i32[1, K] out
    counts_ref,  # VMEM i32[1, 2] out: (hits, misses)
    miss_host_ref,  # VMEM i32[1, K] out
    miss_device_ref,  # VMEM i32[1, K] out
    buffer_tokens_out,  # VMEM i32[1, B] out (aliased to the stacked input)
    lru_out,  # VMEM i32[1, B] out (aliased)
    kv,  # VMEM scratch i32[8, K]: per top-k entry vectors (FIRST, HIT, ...)
    bv,  # VMEM scratch i32[8, B]: per LRU position / slot vectors (SLOT_HIT, HIT_IN_LRU, ...)
    *,
    page_size: int,
    rows: int,
    cols: int,
):
    r = pl.program_id(0)
    K, B, P = topk_ref.shape[1], buffer_tokens_in.shape[1], page_table_ref.shape[1]
    rk, rb = _tile(K, rows), _tile(B, rows)  # row tiles over top-k entries, LRU positions / slots
    ck, cb, cp = _tile(K, cols), _tile(B, cols), _tile(P, cols)  # column tiles
    n = lengths_ref[r]
    newest = n - 1
    kv[...] = jnp.zeros(kv.shape, jnp.int32)
    bv[...] = jnp.zeros(bv.shape, jnp.int32)

    def entries(start):
        """The top-k entries [start, start + rk) as a column, with their masks."""
        t_c = _to_col(_cols(topk_ref, 0, start, rk))  # [rk, 1]
        valid_c = t_c >= 0
        newest_c = valid_c & (t_c == newest)
        return t_c, valid_c, newest_c, valid_c & ~newest_c

    def need_cols(start, width):
        """need[start : start + width] as a row: valid entries other than the newest token."""
        t = _cols(topk_ref, 0, start, width)
        return (t >= 0) & (t != newest)

    # ---- first occurrences and hits, per entry; slots holding a needed entry ----------------------
    def first_and_hits(i0, _):
        t_c, _, _, need_c = entries(i0)

        def repeats(j0, acc):  # an equal entry at an earlier index: [i, j] with j < i
            t_r = _cols(topk_ref, 0, j0, ck)
            earlier = _iota((rk, ck), 1, j0) < _iota((rk, ck), 0, i0)
            hit = (t_c == t_r) & earlier & need_cols(j0, ck)
            return jnp.maximum(acc, jnp.max(_as_int(hit), axis=1, keepdims=True))

        def held(s0, acc):  # [entry, slot]: the slot holds the entry (a request's buffer tokens are distinct)
            tile = _as_int((t_c == _cols(buffer_tokens_in, 0, s0, cb)) & need_c)  # [rk, cb]
            bv[pl.ds(SLOT_HIT, 1), pl.ds(s0, cb)] = jnp.maximum(_cols(bv, SLOT_HIT, s0, cb), jnp.max(tile, axis=0, keepdims=True))
            return jnp.maximum(acc, jnp.max(tile, axis=1, keepdims=True))

        zeros = jnp.zeros((rk, 1), jnp.int32)
        repeat = _loop(K, ck, repeats, zeros)
        is_hit = _loop(B, cb, held, zeros)
        kv[pl.ds(FIRST, 1), pl.ds(i0, rk)] = _to_row(_as_int(need_c) * (1 - repeat))
        kv[pl.ds(HIT, 1), pl.ds(i0, rk)] = _to_row(is_hit)

    _loop(K, rk, first_and_hits)
    is_first_r = kv[pl.ds(FIRST, 1), :] > 0  # [1, K]
    is_miss_r = is_first_r & ~(kv[pl.ds(HIT, 1), :] > 0)
    num_distinct = jnp.sum(_as_int(is_first_r))
    num_misses = jnp.sum(_as_int(is_miss_r))
    kv[pl.ds(MISS, 1), :] = _as_int(is_miss_r)

    # ---- misses in order of first occurrence: rank = misses at earlier indices --------------------
    def miss_ranks(i0, _):
        def earlier_misses(j0, acc):
            earlier = _iota((rk, ck), 1, j0) < _iota((rk, ck), 0, i0)
            return acc + jnp.sum(_as_int(earlier & (_cols(kv, MISS, j0, ck) > 0)), axis=1, keepdims=True)

        kv[pl.ds(MISS_RANK, 1), pl.ds(i0, rk)] = _to_row(_loop(K, ck, earlier_misses, jnp.zeros((rk, 1), jnp.int32)))

    _loop(K, rk, miss_ranks)

    # ---- the LRU walk: which LRU positions hold a hit slot, ranks among hits / non-hits ------------
    def hit_positions(p0, _):
        lru_c = _to_col(_cols(lru_in, 0, p0, rb))  # [rb, 1]

        def holds_hit(s0, acc):  # [position, slot]: lru[position] == slot, a hit slot
            tile = (lru_c == _iota((rb, cb), 1, s0)) & (_cols(bv, SLOT_HIT, s0, cb) > 0)
            return jnp.maximum(acc, jnp.max(_as_int(tile), axis=1, keepdims=True))

        bv[pl.ds(HIT_IN_LRU, 1), pl.ds(p0, rb)] = _to_row(_loop(B, cb, holds_hit, jnp.zeros((rb, 1), jnp.int32)))

    _loop(B, rb, hit_positions)

    def lru_ranks(p0, _):
        def earlier(q0, acc):  # [p, q]: q < p, among non-hits and among hits
            before = _iota((rb, cb), 1, q0) < _iota((rb, cb), 0, p0)
            hit = _cols(bv, HIT_IN_LRU, q0, cb) > 0
            nonhits = jnp.sum(_as_int(before & ~hit), axis=1, keepdims=True)
            return acc[0] + nonhits, acc[1] + jnp.sum(_as_int(before & hit), axis=1, keepdims=True)

        zeros = jnp.zeros((rb, 1), jnp.int32)
        nonhit_rank, hit_rank = _loop(B, cb, earlier, (zeros, zeros))
        bv[pl.ds(NONHIT_RANK, 1), pl.ds(p0, rb)] = _to_row(nonhit_rank)
        bv[pl.ds(HIT_RANK, 1), pl.ds(p0, rb)] = _to_row(hit_rank)

    _loop(B, rb, lru_ranks)

    # ---- victims: the i-th miss takes the i-th least recently used non-hit slot -------------------
    def victims(i0, _):
        t_c, _, _, _ = entries(i0)
        miss_c = _to_col(_cols(kv, MISS, i0, rk)) > 0
        rank_c = _to_col(_cols(kv, MISS_RANK, i0, rk))

        def take(p0, acc):  # [miss, LRU position]
            pick = miss_c & ~(_cols(bv, HIT_IN_LRU, p0, cb) > 0) & (_cols(bv, NONHIT_RANK, p0, cb) == rank_c)
            return acc + jnp.sum(jnp.where(pick, _cols(lru_in, 0, p0, cb), 0), axis=1, keepdims=True)

        slot_c = _loop(B, cb, take, jnp.zeros((rk, 1), jnp.int32))  # [rk, 1]
        kv[pl.ds(MISS_SLOT, 1), pl.ds(i0, rk)] = _to_row(slot_c)

        def fill(s0, _):  # [miss, slot]: the slot now holds the missed entry
            filled = miss_c & (slot_c == _iota((rk, cb), 1, s0))
            bv[pl.ds(FILLED, 1), pl.ds(s0, cb)] = jnp.maximum(_cols(bv, FILLED, s0, cb), jnp.max(_as_int(filled), axis=0, keepdims=True))
            bv[pl.ds(FILL_TOKEN, 1), pl.ds(s0, cb)] = _cols(bv, FILL_TOKEN, s0, cb) + jnp.sum(jnp.where(filled, t_c, 0), axis=0, keepdims=True)

        _loop(B, cb, fill)

    _loop(K, rk, victims)
    bt_r, lru_r = buffer_tokens_in[...], lru_in[...]  # [1, B]
    new_bt_r = jnp.where(bv[pl.ds(FILLED, 1), :] > 0, bv[pl.ds(FILL_TOKEN, 1), :], bt_r)
    bv[pl.ds(NEW_BT, 1), :] = new_bt_r

    # ---- every entry (repeats too) resolves through the updated table; the compacted miss plan ----
    def resolve(i0, _):
        t_c, valid_c, newest_c, _ = entries(i0)

        def find(s0, acc):  # [entry, slot]
            found = (t_c == _cols(bv, NEW_BT, s0, cb)) & valid_c
            return acc + jnp.sum(jnp.where(found, _iota((rk, cb), 1, s0), 0), axis=1, keepdims=True)

        slot_c = _loop(B, cb, find, jnp.zeros((rk, 1), jnp.int32))
        slots_ref[:, pl.ds(i0, rk)] = _to_row(jnp.where(newest_c, B, jnp.where(valid_c, slot_c, -1)))

        position_c = jnp.maximum(t_c, 0)
        page_index_c = jnp.clip(position_c // page_size, 0, P - 1)

        def page(p0, acc):  # [entry, page table index]
            at = page_index_c == _iota((rk, cp), 1, p0)
            return acc + jnp.sum(jnp.where(at, _cols(page_table_ref, 0, p0, cp), 0), axis=1, keepdims=True)

        host_c = _loop(P, cp, page, jnp.zeros((rk, 1), jnp.int32)) * page_size + position_c % page_size  # [rk, 1]
        miss_c = _to_col(_cols(kv, MISS, i0, rk)) > 0
        rank_c = _to_col(_cols(kv, MISS_RANK, i0, rk))
        miss_slot_c = _to_col(_cols(kv, MISS_SLOT, i0, rk))

        def plan(m0, _):  # [miss entry, plan index]: entry m of the plan is the miss of rank m
            at = miss_c & (rank_c == _iota((rk, ck), 1, m0))
            miss_host_ref[:, pl.ds(m0, ck)] += jnp.sum(jnp.where(at, host_c, 0), axis=0, keepdims=True)
            miss_device_ref[:, pl.ds(m0, ck)] += jnp.sum(jnp.where(at, miss_slot_c, 0), axis=0, keepdims=True)

        _loop(K, ck, plan)

    miss_host_ref[...] = jnp.zeros(miss_host_ref.shape, jnp.int32)  # accumulated by the plan tiles
    miss_device_ref[...] = jnp.zeros(miss_device_ref.shape, jnp.int32)
    _loop(K, rk, resolve)

    # ---- new LRU order: untouched non-hits, then the victims (miss order), then the hits ----------
    hit_in_lru_r = bv[pl.ds(HIT_IN_LRU, 1), :] > 0
    nonhit_rank_r, hit_rank_r = bv[pl.ds(NONHIT_RANK, 1), :], bv[pl.ds(HIT_RANK, 1), :]
    num_nonhit = B - jnp.sum(bv[pl.ds(SLOT_HIT, 1), :])
    bv[pl.ds(NONHIT_RANK, 1), :] = jnp.where(  # the new index of each LRU position (the rank is used up)
        hit_in_lru_r,
        num_nonhit + hit_rank_r,
        jnp.where(nonhit_rank_r >= num_misses, nonhit_rank_r - num_misses, num_nonhit - num_misses + nonhit_rank_r),
    )  # fmt: skip

    def reorder(p0, _):
        index_c = _to_col(_cols(bv, NONHIT_RANK, p0, rb))  # [rb, 1]
        lru_c = _to_col(_cols(lru_in, 0, p0, rb))

        def put(s0, _):  # [old position, new position]
            at = index_c == _iota((rb, cb), 1, s0)
            bv[pl.ds(NEW_LRU, 1), pl.ds(s0, cb)] = _cols(bv, NEW_LRU, s0, cb) + jnp.sum(jnp.where(at, lru_c, 0), axis=0, keepdims=True)

        _loop(B, cb, put)

    _loop(B, rb, reorder)

    long = n > B
    misses = jnp.where(long, num_misses, 0)
    plan_used_r = _iota((1, K), 1) < num_misses
    t_r = topk_ref[...]
    slots_ref[...] = jnp.where(long, slots_ref[...], t_r)
    buffer_tokens_out[...] = jnp.where(long, new_bt_r, bt_r)
    lru_out[...] = jnp.where(long, bv[pl.ds(NEW_LRU, 1), :], lru_r)
    miss_host_ref[...] = jnp.where(long & plan_used_r, miss_host_ref[...], -1)
    miss_device_ref[...] = jnp.where(long & plan_used_r, miss_device_ref[...], -1)
    newest_selected = jnp.max(_as_int((t_r >= 0) & (t_r == newest)))
    counts_ref[...] = jnp.where(_iota((1, 2), 1) == 0, num_distinct - misses + newest_selected, misses)


def swap_in_plan_tpu(buffer_tokens, lru_slots, scratch, layer, topk, lengths, page_table, *, page_size: int, tiles=None):
    """The TPU plan kernel for `layer`; buffer_tokens / lru_slots updated in place (aliased).

    Shapes as pallas_kernels.swap_in.swap_in_plan (checked by its caller). tiles: (rows, cols)
    of a comparison tile (None: ROWS, COLS; the tests pass tiny ones). Returns (plan,
    buffer_tokens, lru_slots, scratch), scratch unchanged."""
    rows, cols = tiles or (ROWS, COLS)

    L, R, B = buffer_tokens.shape
    K, P = topk.shape[1], page_table.shape[1]
    i32 = jnp.int32
    # A [1, X] block of a [R, 1, X] array: its last two dims equal the array's (Mosaic's rule).
    request_row = lambda width: pl.BlockSpec((None, 1, width), lambda r, layer, lengths: (r, 0, 0))  # noqa: E731
    layer_row = pl.BlockSpec((None, None, 1, B), lambda r, layer, lengths: (layer[0], r, 0, 0))
    out_shape = (
        jax.ShapeDtypeStruct((R, 1, K), i32),  # slots
        jax.ShapeDtypeStruct((R, 1, 2), i32),  # counts
        jax.ShapeDtypeStruct((R, 1, K), i32),  # miss_host
        jax.ShapeDtypeStruct((R, 1, K), i32),  # miss_device
        jax.ShapeDtypeStruct((L, R, 1, B), i32),  # buffer_tokens
        jax.ShapeDtypeStruct((L, R, 1, B), i32),  # lru_slots
    )
    slots, counts, miss_host, miss_device, tokens, lru = pl.pallas_call(
        functools.partial(_plan_kernel, page_size=page_size, rows=rows, cols=cols),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(R,),
            in_specs=[request_row(K), layer_row, layer_row, request_row(P)],
            out_specs=[request_row(K), request_row(2), request_row(K), request_row(K), layer_row, layer_row],
            scratch_shapes=[pltpu.VMEM((8, K), i32), pltpu.VMEM((8, B), i32)],
        ),
        input_output_aliases={3: 4, 4: 5},  # buffer_tokens, lru_slots (operand indices count the 2 prefetched)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=common.tpu_interpret(),
        name="hisparse_swap_in_plan_tpu",
    )(
        jnp.reshape(layer, (1,)).astype(i32),
        lengths.astype(i32),
        topk.astype(i32).reshape(R, 1, K),
        buffer_tokens.astype(i32).reshape(L, R, 1, B),
        lru_slots.astype(i32).reshape(L, R, 1, B),
        page_table.astype(i32).reshape(R, 1, P),
    )
    plan = SwapInPlan(slots[:, 0], counts[:, 0, 0], counts[:, 0, 1], miss_host[:, 0], miss_device[:, 0])
    return plan, tokens.reshape(L, R, B), lru.reshape(L, R, B), scratch
