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
# Pallas kernel: one program per request, the whole top-k row and LRU walk in registers.
#
# The program keeps no table of its own: a per-request row of `scratch` indexed by position
# (SCRATCH_EMPTY between calls) plays the role of SGLang's shared-memory hash. Entry values:
#   k >= 0        position first selected at top-k index k
#   -2 - slot     position held by `slot` (a hit), or (repeated misses only) its victim
# Every other value lives in registers; the dependent global-memory round trips, in order:
#   1. load the top-k row and the LRU order          4. mark hits in the scratch, write the LRU
#   2. mark the top-k in the scratch; load tokens     5. read the marks back at the top-k
#   3. read marks at the top-k and at the tokens      6. read victims (the new LRU) and pages
# then the outputs, and the scratch restored. The fast path (n <= B) stops after 3.
# The new LRU order is computed in registers from the walk's ranks and written once; the
# victims are read back out of it (the i-th miss's victim sits at num_nonhit - num_misses + i).
# --------------------------------------------------------------------------------------------


def _mark_first_occurrences(scratch_at, scratch_set, k, pos, want, interpret):
    """Leaves scratch[pos] = the smallest k selecting pos; returns (distinct positions, repeats?).

    k, pos: i32[Kb]; want: bool[Kb]. Plain stores leave one arbitrary writer per position;
    "store k where k is smaller" repeats until no lane is smaller, which takes no extra pass
    unless the top-k repeats a position. (JAX 0.11's Triton lowering mis-lowers a vector integer
    atomic_min as a float min, so no atomics.) The caller has stored k at pos and synchronised."""

    def survey():
        marked = scratch_at(pos, want, -1)  # i32[Kb]
        lost = jnp.max((want & (k < marked)).astype(jnp.int32)) > 0
        return lost, jnp.sum((want & (marked == k)).astype(jnp.int32))

    def store_smaller(_):
        scratch_set(pos, k, want & (k < scratch_at(pos, want, -1)))
        common.barrier(interpret)
        return survey()

    # The loop condition is carried, not read from refs: the interpreter evaluates a while
    # condition on the refs as they were when the loop started.
    _, num_distinct = jax.lax.while_loop(lambda carry: carry[0], store_smaller, survey())
    return num_distinct, num_distinct < jnp.sum(want.astype(jnp.int32))


def _new_lru_index(hit, walk, i, B, num_misses):
    """Where each slot of the old LRU order goes in the new one, and the number of non-hit slots.

    hit, walk: bool[Bb] (walk: a real slot of a long-path request); i: i32[Bb] the old index.
    New order: untouched non-hits (old order), the first num_misses non-hits (the victims, just
    filled, in miss order), then the hits (old order)."""
    nonhit = walk & ~hit
    nonhit_end = jnp.cumsum(nonhit.astype(jnp.int32))  # i32[Bb]: non-hits in [0, i]
    num_nonhit = B - jnp.sum(hit.astype(jnp.int32))
    nonhit_rank = nonhit_end - 1
    hit_rank = i - nonhit_end  # hits before i
    index = jnp.where(
        hit,
        num_nonhit + hit_rank,
        jnp.where(nonhit_rank >= num_misses, nonhit_rank - num_misses, num_nonhit - num_misses + nonhit_rank),
    )
    return index, num_nonhit


def _plan_kernel(
    layer_ref,  # i32[1]
    lengths_ref,  # i32[R]
    topk_ref,  # i32[R, K]
    page_table_ref,  # i32[R, P]
    _buffer_tokens_in,  # aliased to buffer_tokens_ref
    _lru_in,  # aliased to lru_ref
    _scratch_in,  # aliased to scratch_ref
    slots_ref,  # i32[R, K] out
    hits_ref,  # i32[R] out
    misses_ref,  # i32[R] out (separate outputs: a column of one [R, 2] array would cost the
    #              copy kernel a slicing launch in front of it)
    miss_host_ref,  # i32[R, K] out
    miss_device_ref,  # i32[R, K] out
    buffer_tokens_ref,  # i32[L, R, B] in/out
    lru_ref,  # i32[L, R, B] in/out
    scratch_ref,  # i32[R, C] in/out
    *,
    page_size: int,
    k_block: int,
    b_block: int,
    interpret: bool,
):
    r = pl.program_id(0)
    layer = layer_ref[0]
    K, B, C, P = topk_ref.shape[1], buffer_tokens_ref.shape[2], scratch_ref.shape[1], page_table_ref.shape[1]
    n = lengths_ref[r]
    newest = n - 1
    long = n > B

    def scratch_at(pos, mask, other):
        return common.gather(scratch_ref, (r, common.safe_index(pos, mask, C)), mask, other)

    def scratch_set(pos, value, mask):
        common.scatter(scratch_ref, (r, common.safe_index(pos, mask, C)), value, mask)

    def lru_at(index, mask, other):
        return common.gather(lru_ref, (layer, r, common.safe_index(index, mask, B)), mask, other)

    # Round trip 1: the top-k row and, on the long path, the LRU order (independent loads).
    k = jnp.arange(k_block, dtype=jnp.int32)  # i32[Kb]
    k_in = k < K
    pos = common.gather(topk_ref, (r, common.safe_index(k, k_in, K)), k_in, -1)  # i32[Kb]
    want = (pos >= 0) & (pos != newest)  # bool[Kb]: every selected position but the newest
    newest_selected = jnp.max(((pos >= 0) & (pos == newest)).astype(jnp.int32))
    i = jnp.arange(b_block, dtype=jnp.int32)  # i32[Bb]: index in the LRU order
    walk = (i < B) & long
    slot = lru_at(i, walk, 0)  # i32[Bb]: slots, least recently used first

    # Round trip 2: mark the selection; meanwhile fetch the token of every slot.
    scratch_set(pos, k, want)
    token = common.gather(buffer_tokens_ref, (layer, r, common.safe_index(slot, walk, B)), walk, -1)  # i32[Bb]
    common.barrier(interpret)

    # Round trip 3: a slot holding a marked position is a hit; first occurrences and repeats.
    held = walk & (token >= 0)
    hit = held & (scratch_at(token, held, SCRATCH_EMPTY) != SCRATCH_EMPTY)  # bool[Bb]
    num_distinct, has_repeats = _mark_first_occurrences(scratch_at, scratch_set, k, pos, want, interpret)
    common.barrier(interpret)  # every read of the marks is done before the hit marks replace some

    def write_plan_padding(num_misses):
        past_end = k_in & (k >= num_misses)
        safe_k = common.safe_index(k, past_end, K)
        common.scatter(miss_host_ref, (r, safe_k), jnp.full_like(k, -1), past_end)
        common.scatter(miss_device_ref, (r, safe_k), jnp.full_like(k, -1), past_end)

    @pl.when(~long)
    def _fast_path():
        common.scatter(slots_ref, (r, common.safe_index(k, k_in, K)), pos, k_in)
        write_plan_padding(0)
        hits_ref[r] = num_distinct + newest_selected
        misses_ref[r] = jnp.int32(0)

    @pl.when(long)
    def _long_path():
        # Each hit slot holds one distinct selected position (buffer_tokens has no repeats), so
        # the misses are known before any top-k entry learns whether it hit.
        # Round trip 4: the hit slot of every hit position (first: the tokens are then dead), and
        # the new LRU order.
        scratch_set(token, -2 - slot, hit)
        num_misses = num_distinct - jnp.sum(hit.astype(jnp.int32))
        new_index, num_nonhit = _new_lru_index(hit, walk, i, B, num_misses)
        common.scatter(lru_ref, (layer, r, common.safe_index(new_index, walk, B)), slot, walk)
        common.barrier(interpret)

        # Round trip 5: hit entries read their slot; first occurrences still reading k missed.
        code = scratch_at(pos, want, -1)  # i32[Kb]
        hit_entry = want & (code <= -2)
        miss = want & (code == k)
        miss_rank = jnp.cumsum(miss.astype(jnp.int32)) - 1  # i32[Kb]

        # Round trip 6: the i-th miss's victim (new LRU index num_nonhit - num_misses + i) and page.
        victim = lru_at(num_nonhit - num_misses + miss_rank, miss, -1)  # i32[Kb]
        page = common.gather(page_table_ref, (r, common.safe_index(pos // page_size, miss, P)), miss, 0)
        common.scatter(buffer_tokens_ref, (layer, r, common.safe_index(victim, miss, B)), pos, miss)
        safe_rank = common.safe_index(miss_rank, miss, K)
        common.scatter(miss_host_ref, (r, safe_rank), page * page_size + pos % page_size, miss)
        common.scatter(miss_device_ref, (r, safe_rank), victim, miss)
        write_plan_padding(num_misses)
        slot_of_entry = jnp.where(hit_entry, -2 - code, jnp.where(miss, victim, jnp.where(pos >= 0, B, -1)))
        repeat = want & ~hit_entry & ~miss  # a later listing of a missed position
        known = k_in & ~repeat
        common.scatter(slots_ref, (r, common.safe_index(k, known, K)), slot_of_entry, known)
        hits_ref[r] = num_distinct - num_misses + newest_selected
        misses_ref[r] = num_misses

        @pl.when(has_repeats)
        def _resolve_repeated_misses():
            scratch_set(pos, -2 - victim, miss)
            common.barrier(interpret)
            slot_of_repeat = -2 - scratch_at(pos, repeat, -1)
            common.scatter(slots_ref, (r, common.safe_index(k, repeat, K)), slot_of_repeat, repeat)

    # Leave the scratch row empty for the next call (every mark is at a selected position).
    common.barrier(interpret)
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
    num_warps: int = 16,
):
    """The Pallas plan kernel for `layer`; updates buffer_tokens/lru_slots/scratch in place.

    Shapes as swap_in_plan (K <= B). Returns (plan, buffer_tokens, lru_slots, scratch).
    num_warps 16: 85.9 us at batch 256 with no misses against 91.1 (8 warps) and 92.1 (4);
    28.5 / 31.9 us at batch 1 / 64, as with 8 warps (bench_kernels.py --tune, H200, 2026-12-01).
    """
    _check_plan_inputs(
        buffer_tokens, lru_slots, topk, lengths, page_table, stacked=True, scratch=scratch, layer=layer
    )
    R, K = topk.shape
    B = buffer_tokens.shape[2]
    kernel = functools.partial(
        _plan_kernel,
        page_size=page_size,
        k_block=common.next_power_of_2(K),
        b_block=common.next_power_of_2(B),
        interpret=common.interpret_mode(),
    )
    i32 = jnp.int32
    out_shape = (
        jax.ShapeDtypeStruct((R, K), i32),  # slots
        jax.ShapeDtypeStruct((R,), i32),  # num_hits
        jax.ShapeDtypeStruct((R,), i32),  # num_misses
        jax.ShapeDtypeStruct((R, K), i32),  # miss_host
        jax.ShapeDtypeStruct((R, K), i32),  # miss_device
        jax.ShapeDtypeStruct(buffer_tokens.shape, i32),
        jax.ShapeDtypeStruct(lru_slots.shape, i32),
        jax.ShapeDtypeStruct(scratch.shape, i32),
    )
    slots, hits, misses, miss_host, miss_device, buffer_tokens, lru_slots, scratch = pl.pallas_call(
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
    plan = SwapInPlan(slots, hits, misses, miss_host, miss_device)
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
