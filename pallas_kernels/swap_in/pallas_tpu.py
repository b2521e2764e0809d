"""TPU swap-in plan (implementation="tpu"): one program per request, everything in VMEM.

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
    compacted miss plan: [K, B], [B, B] and [K, K] one-hot selections, summed.
Row <-> column vectors are moved by a masked sum with the identity (no transposes, no gathers).
Every reduction is an int32 sum/max over a lane or sublane axis: ops the Mosaic lowering has.
`scratch` is not needed and is returned unchanged (SCRATCH_EMPTY stays SCRATCH_EMPTY).

Cost: O(B^2 + K*B) int32 element operations and VMEM per request. That is nothing for the tiny
shapes the tests use and ~16 M elements (64 MiB) at B = 4096, more than a TensorCore's VMEM:
production sizes would tile the [B, B] and [K, B] matrices in chunks of the 8 x 128 vreg grid
(the GPU kernel keeps them in registers), or sort both lists and merge. That
tiling, and whether Mosaic accepts every op here, is unmeasured without a TPU (docs/tpu.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common
from pallas_kernels.swap_in.base import SwapInPlan


def _iota(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


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
    *,
    page_size: int,
):
    r = pl.program_id(0)
    K, B, P = topk_ref.shape[1], buffer_tokens_in.shape[1], page_table_ref.shape[1]
    n = lengths_ref[r]
    newest = n - 1

    t_r = topk_ref[...]  # [1, K]
    t_c = _to_col(t_r)  # [K, 1]
    bt_r = buffer_tokens_in[...]  # [1, B]
    lru_r = lru_in[...]  # [1, B]: lru_r[p] = the p-th least recently used slot
    lru_c = _to_col(lru_r)  # [B, 1]

    valid_r, valid_c = t_r >= 0, t_c >= 0
    newest_r, newest_c = valid_r & (t_r == newest), valid_c & (t_c == newest)
    need_r, need_c = valid_r & ~newest_r, valid_c & ~newest_c
    newest_selected = jnp.max(_as_int(newest_r))

    # First occurrence of every position needing a slot: no equal entry at an earlier index.
    earlier_kk = _iota((K, K), 1) < _iota((K, K), 0)  # [i, j]: j < i
    repeat = jnp.max(_as_int((t_c == t_r) & earlier_kk & need_r), axis=1, keepdims=True) > 0  # [K, 1]
    is_first_c = need_c & ~repeat
    num_distinct = jnp.sum(_as_int(is_first_c))

    # Hits: entries some slot holds (buffer tokens of a request are distinct, -1 = empty).
    held_kb = (t_c == bt_r) & need_c  # [K, B]
    is_hit_c = jnp.max(_as_int(held_kb), axis=1, keepdims=True) > 0  # [K, 1]
    slot_is_hit_r = jnp.max(_as_int(held_kb), axis=0, keepdims=True) > 0  # [1, B], by slot

    # Misses in order of first occurrence: rank = misses at earlier indices.
    is_miss_c = is_first_c & ~is_hit_c
    is_miss_r = _to_row(_as_int(is_miss_c)) > 0
    miss_rank_c = jnp.sum(_as_int(earlier_kk & is_miss_r), axis=1, keepdims=True)  # [K, 1]
    num_misses = jnp.sum(_as_int(is_miss_c))

    # The LRU walk: which LRU positions hold a hit slot, and the ranks among hits / non-hits.
    slot_bb = _iota((B, B), 1)
    hit_in_lru_c = jnp.max(_as_int((lru_c == slot_bb) & slot_is_hit_r), axis=1, keepdims=True) > 0  # [B, 1]
    hit_in_lru_r = _to_row(_as_int(hit_in_lru_c)) > 0  # [1, B]
    earlier_bb = _iota((B, B), 1) < _iota((B, B), 0)  # [p, q]: q < p
    nonhit_rank_c = jnp.sum(_as_int(earlier_bb & ~hit_in_lru_r), axis=1, keepdims=True)  # [B, 1]
    hit_rank_c = jnp.sum(_as_int(earlier_bb & hit_in_lru_r), axis=1, keepdims=True)
    nonhit_rank_r = _to_row(nonhit_rank_c)  # [1, B]

    # The i-th miss takes the i-th least recently used non-hit slot.
    victim_kb = is_miss_c & ~hit_in_lru_r & (nonhit_rank_r == miss_rank_c)  # [K, B]: [miss, LRU position]
    miss_slot_c = jnp.sum(jnp.where(victim_kb, lru_r, 0), axis=1, keepdims=True)  # [K, 1]
    slot_kb = _iota((K, B), 1)
    filled_kb = is_miss_c & (miss_slot_c == slot_kb)  # [K, B]: [miss, slot]
    filled_r = jnp.max(_as_int(filled_kb), axis=0, keepdims=True) > 0
    new_bt_r = jnp.where(filled_r, jnp.sum(jnp.where(filled_kb, t_c, 0), axis=0, keepdims=True), bt_r)  # [1, B]

    # Every entry (repeats too) resolves through the updated table.
    found_kb = (t_c == new_bt_r) & valid_c
    slot_c = jnp.sum(jnp.where(found_kb, slot_kb, 0), axis=1, keepdims=True)
    long_slots_c = jnp.where(newest_c, B, jnp.where(valid_c, slot_c, -1))

    # New LRU order: untouched non-hits, then the victims (miss order), then the hits.
    num_nonhit = B - jnp.sum(_as_int(slot_is_hit_r))
    new_index_c = jnp.where(
        hit_in_lru_c,
        num_nonhit + hit_rank_c,
        jnp.where(nonhit_rank_c >= num_misses, nonhit_rank_c - num_misses, num_nonhit - num_misses + nonhit_rank_c),
    )  # [B, 1]
    new_lru_r = jnp.sum(jnp.where(new_index_c == slot_bb, lru_c, 0), axis=0, keepdims=True)  # [1, B]

    # The compacted miss plan: entry m is the miss of rank m.
    page_index_c = jnp.clip(jnp.maximum(t_c, 0) // page_size, 0, P - 1)
    page_c = jnp.sum(jnp.where(page_index_c == _iota((K, P), 1), page_table_ref[...], 0), axis=1, keepdims=True)
    host_c = page_c * page_size + jnp.maximum(t_c, 0) % page_size  # [K, 1]
    plan_kk = is_miss_c & (miss_rank_c == _iota((K, K), 1))  # [miss entry i, plan index m]
    plan_used_r = _iota((1, K), 1) < num_misses
    miss_host_r = jnp.where(plan_used_r, jnp.sum(jnp.where(plan_kk, host_c, 0), axis=0, keepdims=True), -1)
    miss_device_r = jnp.where(plan_used_r, jnp.sum(jnp.where(plan_kk, miss_slot_c, 0), axis=0, keepdims=True), -1)

    long = n > B
    misses = jnp.where(long, num_misses, 0)
    slots_ref[...] = jnp.where(long, _to_row(long_slots_c), t_r)
    buffer_tokens_out[...] = jnp.where(long, new_bt_r, bt_r)
    lru_out[...] = jnp.where(long, new_lru_r, lru_r)
    miss_host_ref[...] = jnp.where(long, miss_host_r, -1)
    miss_device_ref[...] = jnp.where(long, miss_device_r, -1)
    counts_ref[...] = jnp.where(_iota((1, 2), 1) == 0, num_distinct - misses + newest_selected, misses)


def swap_in_plan_tpu(buffer_tokens, lru_slots, scratch, layer, topk, lengths, page_table, *, page_size: int):
    """The TPU plan kernel for `layer`; buffer_tokens / lru_slots updated in place (aliased).

    Shapes as pallas_kernels.swap_in.swap_in_plan (checked by its caller). Returns (plan,
    buffer_tokens, lru_slots, scratch), scratch unchanged."""

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
        functools.partial(_plan_kernel, page_size=page_size),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(R,),
            in_specs=[request_row(K), layer_row, layer_row, request_row(P)],
            out_specs=[request_row(K), request_row(2), request_row(K), request_row(K), layer_row, layer_row],
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
