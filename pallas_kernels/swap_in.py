"""Swap-in planning: map each selected position to a device slot, LRU-evicting on misses.

The contract (docs/contract.md), per request with n stored tokens (newest at n - 1) and
B = device_buffer_size:
  * fast path n <= B: slot j holds token j, so the slot of a position is the position; nothing
    is copied and the LRU order does not change.
  * long path n > B:
      - position n - 1 resolves to the reserved slot B, always a hit, never in the LRU;
      - a position held by a slot is a hit and resolves to that slot;
      - the other positions are misses; taken in top-k order of first occurrence, the i-th
        miss gets the i-th least recently used slot among the slots not hit this step, and
        that slot's `buffer_tokens` entry becomes the position;
      - new LRU order, least to most recent: untouched slots (old order), then the slots just
        filled by misses (in miss order), then the hit slots (old relative order);
      - a position listed twice resolves to one slot; -1 entries are padding and give -1.
  * counters: num_hits = distinct selected positions resolved without a copy (the newest
    token included), num_misses = distinct positions copied (= rows the copy moves).
  * the miss plan: the i-th miss's host slot and device slot, -1 past num_misses. The copy
    kernel (pallas_kernels.row_copy) moves exactly these rows; shared-index layers replay it.
  * B >= K, so a step's misses always find victims (checked: ValueError otherwise).

implementation="tpu" (pallas_kernels/tpu_swap_in.py) computes the same plan, bit for bit, with
comparison matrices in VMEM instead of the scratch hash.

Shape letters: R requests, K top-k entries, B buffer slots, L layers, C max context,
P host pages per request.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.common import check_equal, check_layer_index, check_rank

SCRATCH_EMPTY = np.iinfo(np.int32).max  # unused scratch entry: larger than any top-k index


class SwapInPlan(NamedTuple):
    """One layer's swap-in decisions for every request."""

    slots: jax.Array  # i32[R, K]: device slot of every top-k entry, -1 for padding
    num_hits: jax.Array  # i32[R]: distinct positions already on the device
    num_misses: jax.Array  # i32[R]: distinct positions to copy from the host
    miss_host_slots: jax.Array  # i32[R, K]: host pool slot of the i-th miss, -1 past num_misses
    miss_device_slots: jax.Array  # i32[R, K]: device slot receiving the i-th miss, -1 past num_misses


def host_slots_of(page_table_row: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Host pool slot of each position: its page's host page, plus the offset in the page.

    page_table_row: i32[P]; positions: i32[...] (non-negative where used) -> i32[...].
    """
    page = jnp.take(page_table_row, positions // page_size, mode="clip")
    return page * page_size + positions % page_size


def _check_plan_inputs(buffer_tokens, lru_slots, topk, lengths, page_table, *, stacked, scratch=None, layer=None):
    """Static shape checks of the plan's inputs; the tables are [L, R, B] if stacked, else [R, B]."""
    check_rank("topk", topk, 2, "[R, K]")
    check_rank("buffer_tokens", buffer_tokens, 3 if stacked else 2, "[L, R, B]" if stacked else "[R, B]")
    check_equal("lru_slots shape", lru_slots.shape, "buffer_tokens shape", buffer_tokens.shape)
    check_rank("lengths", lengths, 1, "[R]")
    check_rank("page_table", page_table, 2, "[R, P]")
    (R, K), B = topk.shape, buffer_tokens.shape[-1]
    check_equal("topk batch", R, "buffer_tokens request slots (R)", buffer_tokens.shape[-2])
    check_equal("lengths batch", lengths.shape[0], "topk batch (R)", R)
    check_equal("page_table batch", page_table.shape[0], "topk batch (R)", R)
    if K > B:
        raise ValueError(f"top_k ({K}) must be <= device_buffer_size ({B}): a step's misses need that many evictable slots")
    if scratch is not None:
        check_rank("scratch", scratch, 2, "[R, C]")
        check_equal("scratch batch", scratch.shape[0], "topk batch (R)", R)
    if layer is not None:
        check_layer_index(layer, buffer_tokens.shape[0])


# --------------------------------------------------------------------------------------------
# Reference: plain jnp, one request at a time, written to be checked against the contract.
# --------------------------------------------------------------------------------------------


def _sorted_lookup(table: jax.Array, queries: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each query, (found, index in `table`) of an equal entry; entries of `table` are unique."""
    order = jnp.argsort(table)  # i32[B]
    at = jnp.clip(jnp.searchsorted(table[order], queries), 0, table.shape[0] - 1)
    return table[order][at] == queries, order[at]


def _plan_one_request(buffer_tokens, lru_slots, topk, length, page_table_row, *, page_size):
    # buffer_tokens: i32[B]; lru_slots: i32[B]; topk: i32[K]; length: i32[]; page_table_row: i32[P]
    B, K = buffer_tokens.shape[0], topk.shape[0]
    valid = topk >= 0
    is_newest = valid & (topk == length - 1)
    needs_slot = valid & ~is_newest  # every selected position but the newest

    # First occurrence of each position, in top-k order (a stable sort keeps the earliest first).
    key = jnp.where(needs_slot, topk, np.iinfo(np.int32).max)
    order = jnp.argsort(key, stable=True)
    repeats_previous = jnp.concatenate([jnp.array([False]), key[order][1:] == key[order][:-1]])
    is_first = jnp.zeros(K, bool).at[order].set(~repeats_previous) & needs_slot
    num_distinct = jnp.sum(is_first, dtype=jnp.int32)
    newest_selected = jnp.any(is_newest).astype(jnp.int32)

    # Hits: positions some slot already holds.
    is_hit, hit_slot = _sorted_lookup(buffer_tokens, topk)
    is_hit &= needs_slot
    slot_is_hit = jnp.zeros(B, bool).at[jnp.where(is_hit, hit_slot, B)].set(True, mode="drop")

    # Misses in order of first occurrence take the least recently used non-hit slots.
    is_miss = is_first & ~is_hit
    miss_rank = jnp.cumsum(is_miss) - 1  # i32[K]
    num_misses = jnp.sum(is_miss, dtype=jnp.int32)
    hit_in_lru_order = slot_is_hit[lru_slots]  # bool[B]
    nonhit_rank = jnp.cumsum(~hit_in_lru_order) - 1
    hit_rank = jnp.cumsum(hit_in_lru_order) - 1
    victims = jnp.full(B, -1, jnp.int32).at[jnp.where(hit_in_lru_order, B, nonhit_rank)].set(
        lru_slots, mode="drop"
    )  # non-hit slots, least recently used first
    miss_slot = victims[jnp.where(is_miss, miss_rank, 0)]
    new_buffer_tokens = buffer_tokens.at[jnp.where(is_miss, miss_slot, B)].set(topk, mode="drop")

    # Every entry (duplicates too) resolves through the updated table.
    _, slot = _sorted_lookup(new_buffer_tokens, topk)
    long_slots = jnp.where(is_newest, B, jnp.where(valid, slot, -1))

    # LRU: untouched non-hits, then the just-filled victims, then the hits.
    num_nonhit = B - jnp.sum(slot_is_hit, dtype=jnp.int32)
    new_index = jnp.where(
        hit_in_lru_order,
        num_nonhit + hit_rank,
        jnp.where(nonhit_rank >= num_misses, nonhit_rank - num_misses, num_nonhit - num_misses + nonhit_rank),
    )
    new_lru = jnp.zeros(B, jnp.int32).at[new_index].set(lru_slots)

    plan_index = jnp.where(is_miss, miss_rank, K)
    host_slot = host_slots_of(page_table_row, jnp.maximum(topk, 0), page_size)
    miss_host = jnp.full(K, -1, jnp.int32).at[plan_index].set(host_slot, mode="drop")
    miss_device = jnp.full(K, -1, jnp.int32).at[plan_index].set(miss_slot, mode="drop")

    long = length > B
    return (
        jnp.where(long, long_slots, topk),
        jnp.where(long, new_buffer_tokens, buffer_tokens),
        jnp.where(long, new_lru, lru_slots),
        num_distinct - jnp.where(long, num_misses, 0) + newest_selected,
        jnp.where(long, num_misses, 0),
        jnp.where(long, miss_host, -1),
        jnp.where(long, miss_device, -1),
    )


def swap_in_plan_reference(buffer_tokens, lru_slots, topk, lengths, page_table, *, page_size):
    """The contract in jnp, for one layer: returns (plan, new buffer_tokens, new lru_slots).

    buffer_tokens, lru_slots: i32[R, B]; topk: i32[R, K] with K <= B; lengths: i32[R] (n,
    newest at n - 1; 0 for an inactive slot); page_table: i32[R, P]. The new tables are i32[R, B].
    """
    _check_plan_inputs(buffer_tokens, lru_slots, topk, lengths, page_table, stacked=False)
    slots, tokens, lru, hits, misses, miss_host, miss_device = jax.vmap(
        functools.partial(_plan_one_request, page_size=page_size)
    )(buffer_tokens, lru_slots, topk, lengths, page_table)
    return SwapInPlan(slots, hits, misses, miss_host, miss_device), tokens, lru


# --------------------------------------------------------------------------------------------
# Pallas kernel: one program per request, phases separated by CTA barriers.
#
# The program keeps no table of its own: a per-request row of `scratch` indexed by position
# (SCRATCH_EMPTY between calls) plays the role of SGLang's shared-memory hash. Entry values:
#   k >= 0        position first selected at top-k index k
#   -2 - slot     position resolved to `slot` (hit, or miss just assigned)
# `order` is a per-request temporary: non-hit slots in LRU order from the front, hit slots in
# LRU order from the back; the new LRU order is read straight out of it.
# --------------------------------------------------------------------------------------------


def _plan_kernel(
    layer_ref,  # i32[1]
    lengths_ref,  # i32[R]
    topk_ref,  # i32[R, K]
    page_table_ref,  # i32[R, P]
    _buffer_tokens_in,  # aliased to buffer_tokens_ref
    _lru_in,  # aliased to lru_ref
    _scratch_in,  # aliased to scratch_ref
    slots_ref,  # i32[R, K] out
    counts_ref,  # i32[R, 2] out: (hits, misses)
    miss_host_ref,  # i32[R, K] out
    miss_device_ref,  # i32[R, K] out
    order_ref,  # i32[R, B] out, temporary
    buffer_tokens_ref,  # i32[L, R, B] in/out
    lru_ref,  # i32[L, R, B] in/out
    scratch_ref,  # i32[R, C] in/out
    *,
    page_size: int,
    k_chunk: int,
    b_chunk: int,
    interpret: bool,
):
    r = pl.program_id(0)
    layer = layer_ref[0]
    K, B, C, P = topk_ref.shape[1], buffer_tokens_ref.shape[2], scratch_ref.shape[1], page_table_ref.shape[1]
    n = lengths_ref[r]
    newest = n - 1

    def scratch_at(pos, mask, other):
        return common.gather(scratch_ref, (r, common.safe_index(pos, mask, C)), mask, other)

    def scratch_set(pos, value, mask):
        common.scatter(scratch_ref, (r, common.safe_index(pos, mask, C)), value, mask)

    # The top-k row, loaded once and kept in registers through every phase: each reload would
    # be one more dependent memory round trip on a program that is latency-bound.
    topk_chunks = []  # (k, in_range, pos, wants_slot) per chunk of the row
    for start in range(0, K, k_chunk):
        k = start + jnp.arange(k_chunk, dtype=jnp.int32)
        in_range = k < K
        pos = common.gather(topk_ref, (r, common.safe_index(k, in_range, K)), in_range, -1)
        topk_chunks.append((k, in_range, pos, (pos >= 0) & (pos != newest)))
    num_wanted = sum(jnp.sum(want.astype(jnp.int32)) for *_, want in topk_chunks)
    newest_selected = functools.reduce(
        jnp.maximum, [jnp.max(((pos >= 0) & (pos == newest)).astype(jnp.int32)) for _, _, pos, _ in topk_chunks]
    )

    def slot_chunks():
        for start in range(0, B, b_chunk):
            i = start + jnp.arange(b_chunk, dtype=jnp.int32)
            yield i, i < B

    # Phase 1: mark the first occurrence of every position needing a slot. Plain stores leave one
    # arbitrary writer per position; repeating "store k where k is smaller" until no lane is
    # smaller leaves the minimum (no repeat pass unless the top-k repeats a position). JAX 0.11's
    # Triton lowering mis-lowers a vector integer atomic_min (as a float min), so no atomics.
    for k, _, pos, want in topk_chunks:
        scratch_set(pos, k, want)
    common.barrier(interpret)

    def survey():
        """(a smaller index lost a store somewhere, distinct positions marked)."""
        lost, distinct = jnp.int32(0), jnp.int32(0)
        for k, _, pos, want in topk_chunks:
            marked = scratch_at(pos, want, -1)
            lost = jnp.maximum(lost, jnp.max((want & (k < marked)).astype(jnp.int32)))
            distinct += jnp.sum((want & (marked == k)).astype(jnp.int32))
        return lost > 0, distinct

    def store_smaller(_):
        for k, _, pos, want in topk_chunks:
            scratch_set(pos, k, want & (k < scratch_at(pos, want, -1)))
        common.barrier(interpret)
        return survey()

    # The loop condition is carried, not read from refs: the interpreter evaluates a while
    # condition on the refs as they were when the loop started.
    _, num_distinct = jax.lax.while_loop(lambda carry: carry[0], store_smaller, survey())
    has_repeats = num_distinct < num_wanted
    common.barrier(interpret)

    def write_plan_padding(num_misses):
        for k, in_range, _, _ in topk_chunks:
            past_end = in_range & (k >= num_misses)
            safe_k = common.safe_index(k, past_end, K)
            common.scatter(miss_host_ref, (r, safe_k), jnp.full_like(k, -1), past_end)
            common.scatter(miss_device_ref, (r, safe_k), jnp.full_like(k, -1), past_end)

    @pl.when(n <= B)
    def _fast_path():
        for k, in_range, pos, _ in topk_chunks:
            common.scatter(slots_ref, (r, common.safe_index(k, in_range, K)), pos, in_range)
        write_plan_padding(0)
        counts_ref[r, 0] = num_distinct + newest_selected
        counts_ref[r, 1] = jnp.int32(0)

    @pl.when(n > B)
    def _long_path():
        # Phase 2: walk the LRU order, split hits from eviction candidates.
        num_hit = jnp.int32(0)
        num_nonhit = jnp.int32(0)
        for i, in_range in slot_chunks():
            slot = common.gather(lru_ref, (layer, r, common.safe_index(i, in_range, B)), in_range, 0)
            token = common.gather(buffer_tokens_ref, (layer, r, common.safe_index(slot, in_range, B)), in_range, -1)
            held = token >= 0
            hit = held & (scratch_at(token, held, SCRATCH_EMPTY) != SCRATCH_EMPTY)
            nonhit = in_range & ~hit
            hit_rank = num_hit + jnp.cumsum(hit.astype(jnp.int32)) - 1
            nonhit_rank = num_nonhit + jnp.cumsum(nonhit.astype(jnp.int32)) - 1
            common.scatter(order_ref, (r, common.safe_index(nonhit_rank, nonhit, B)), slot, nonhit)
            common.scatter(order_ref, (r, common.safe_index(B - 1 - hit_rank, hit, B)), slot, hit)
            scratch_set(token, -2 - slot, hit)
            num_hit += jnp.sum(hit.astype(jnp.int32))
            num_nonhit += jnp.sum(nonhit.astype(jnp.int32))
        common.barrier(interpret)

        # Phase 3: first occurrences not hit are misses; the i-th takes order[i]. Every entry
        # but a repeat of a miss learns its slot here.
        num_misses = jnp.int32(0)
        unresolved = []  # per chunk: repeats of a miss, resolved below through the scratch
        for k, in_range, pos, want in topk_chunks:
            code = scratch_at(pos, want, -1)
            miss = want & (code == k)
            rank = num_misses + jnp.cumsum(miss.astype(jnp.int32)) - 1
            victim = common.gather(order_ref, (r, common.safe_index(rank, miss, B)), miss, -1)
            page = common.gather(page_table_ref, (r, common.safe_index(pos // page_size, miss, P)), miss, 0)
            common.scatter(buffer_tokens_ref, (layer, r, common.safe_index(victim, miss, B)), pos, miss)
            safe_rank = common.safe_index(rank, miss, K)
            common.scatter(miss_host_ref, (r, safe_rank), page * page_size + pos % page_size, miss)
            common.scatter(miss_device_ref, (r, safe_rank), victim, miss)
            hit = want & (code <= -2)
            slot = jnp.where(hit, -2 - code, jnp.where(miss, victim, jnp.where(pos >= 0, B, -1)))
            known = in_range & (hit | miss | ~want)
            common.scatter(slots_ref, (r, common.safe_index(k, known, K)), slot, known)
            scratch_set(pos, -2 - victim, miss & has_repeats)
            unresolved.append(in_range & ~known)
            num_misses += jnp.sum(miss.astype(jnp.int32))
        write_plan_padding(num_misses)

        # Phase 4: new LRU order, read straight out of `order` (which phase 3 only read).
        untouched = B - num_hit - num_misses
        for j, in_range in slot_chunks():
            source = jnp.where(
                j < untouched,
                num_misses + j,  # untouched non-hits keep their order
                jnp.where(j < B - num_hit, j - untouched, B - 1 - (j - (B - num_hit))),  # victims, hits
            )
            slot = common.gather(order_ref, (r, common.safe_index(source, in_range, B)), in_range, 0)
            common.scatter(lru_ref, (layer, r, common.safe_index(j, in_range, B)), slot, in_range)
        counts_ref[r, 0] = num_distinct - num_misses + newest_selected
        counts_ref[r, 1] = num_misses

        @pl.when(has_repeats)
        def _resolve_repeated_misses():
            common.barrier(interpret)
            for (k, _, pos, _), repeat in zip(topk_chunks, unresolved):
                slot = -2 - scratch_at(pos, repeat, -1)
                common.scatter(slots_ref, (r, common.safe_index(k, repeat, K)), slot, repeat)

    # Phase 5: leave the scratch row empty for the next call.
    common.barrier(interpret)
    for _, _, pos, want in topk_chunks:
        scratch_set(pos, jnp.full_like(pos, SCRATCH_EMPTY), want)


def swap_in_plan_pallas(
    buffer_tokens,  # i32[L, R, B]
    lru_slots,  # i32[L, R, B]
    scratch,  # i32[R, C]
    layer,  # i32[]
    topk,  # i32[R, K]
    lengths,  # i32[R]
    page_table,  # i32[R, P]
    *,
    page_size: int,
    k_chunk: int = 2048,
    b_chunk: int = 4096,
    num_warps: int = 8,
):
    """The Pallas plan kernel for `layer`; updates buffer_tokens/lru_slots/scratch in place.

    Shapes as swap_in_plan (K <= B). Returns (plan, buffer_tokens, lru_slots, scratch).
    """
    _check_plan_inputs(
        buffer_tokens, lru_slots, topk, lengths, page_table, stacked=True, scratch=scratch, layer=layer
    )
    R, K = topk.shape
    B = buffer_tokens.shape[2]
    kernel = functools.partial(
        _plan_kernel,
        page_size=page_size,
        k_chunk=min(common.next_power_of_2(K), k_chunk),
        b_chunk=min(common.next_power_of_2(B), b_chunk),
        interpret=common.interpret_mode(),
    )
    i32 = jnp.int32
    out_shape = (
        jax.ShapeDtypeStruct((R, K), i32),  # slots
        jax.ShapeDtypeStruct((R, 2), i32),  # counts
        jax.ShapeDtypeStruct((R, K), i32),  # miss_host
        jax.ShapeDtypeStruct((R, K), i32),  # miss_device
        jax.ShapeDtypeStruct((R, B), i32),  # order temporary
        jax.ShapeDtypeStruct(buffer_tokens.shape, i32),
        jax.ShapeDtypeStruct(lru_slots.shape, i32),
        jax.ShapeDtypeStruct(scratch.shape, i32),
    )
    slots, counts, miss_host, miss_device, _, buffer_tokens, lru_slots, scratch = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(R,),
        in_specs=[common.any_spec()] * 7,
        out_specs=[common.any_spec()] * 8,
        input_output_aliases={4: 5, 5: 6, 6: 7},
        compiler_params=common.triton_params(num_warps=num_warps),
        interpret=common.interpret_mode(),
        name="hisparse_swap_in_plan",
    )(
        jnp.reshape(layer, (1,)).astype(i32),
        lengths.astype(i32),
        topk.astype(i32),
        page_table,
        buffer_tokens,
        lru_slots,
        scratch,
    )
    plan = SwapInPlan(slots, counts[:, 0], counts[:, 1], miss_host, miss_device)
    return plan, buffer_tokens, lru_slots, scratch


def swap_in_plan(buffer_tokens, lru_slots, scratch, layer, topk, lengths, page_table, *, page_size, implementation=None):
    """Plans one layer's swap-in over the stacked state arrays; see the module docstring.

    buffer_tokens, lru_slots: i32[L, R, B]; scratch: i32[R, C] (SCRATCH_EMPTY everywhere);
    layer: int or i32[]; topk: i32[R, K] with K <= B; lengths: i32[R]; page_table: i32[R, P].
    Returns (plan, buffer_tokens, lru_slots, scratch), the last three shaped as given.
    Raises ValueError on inconsistent static shapes.
    """
    _check_plan_inputs(
        buffer_tokens, lru_slots, topk, lengths, page_table, stacked=True, scratch=scratch, layer=layer
    )
    implementation = common.resolve_implementation(implementation)
    if implementation == "tpu":
        from pallas_kernels.tpu_swap_in import swap_in_plan_tpu

        return swap_in_plan_tpu(
            buffer_tokens, lru_slots, scratch, jnp.asarray(layer, jnp.int32), topk, lengths, page_table, page_size=page_size
        )
    if implementation == "pallas":
        return swap_in_plan_pallas(
            buffer_tokens, lru_slots, scratch, jnp.asarray(layer, jnp.int32), topk, lengths, page_table, page_size=page_size
        )
    plan, tokens, lru = swap_in_plan_reference(
        buffer_tokens[layer], lru_slots[layer], topk, lengths, page_table, page_size=page_size
    )
    return plan, buffer_tokens.at[layer].set(tokens), lru_slots.at[layer].set(lru), scratch
