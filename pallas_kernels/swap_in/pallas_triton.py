"""The swap-in plan as a Pallas GPU kernel (Triton lowering): one program per request, the LRU walk
in registers, a per-request scratch row standing in for a shared-memory hash
(docs/architecture.md, "The swap-in kernels")."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.swap_in.base import SCRATCH_EMPTY, SwapInPlan, check_plan_inputs


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


@common.lower_once
def swap_in_plan_pallas(
    buffer_tokens,  # i32[L, R, B]
    lru_slots,  # i32[L, R, B]
    scratch,  # i32[R, C]
    layer,  # i32[]
    topk,  # i32[b, K], b <= R: request slots 0 .. b - 1 (one program each)
    lengths,  # i32[b]
    page_table,  # i32[R, P]
    *,
    page_size: int,
    num_warps: int = 16,
):
    """The Pallas plan kernel for `layer`; updates buffer_tokens/lru_slots/scratch in place.

    Shapes as swap_in_plan (K <= B). Returns (plan, buffer_tokens, lru_slots, scratch). The
    kernel indexes the tables by its program id, so a batch below the slot count runs on the
    whole tables: no slice of them is copied out and back per layer.
    num_warps 16: 85.9 us at batch 256 with no misses against 91.1 (8 warps) and 92.1 (4);
    28.5 / 31.9 us at batch 1 / 64, as with 8 warps (bench_kernels.py --tune, H200, 2026-12-01).
    """
    check_plan_inputs(
        buffer_tokens, lru_slots, topk, lengths, page_table, stacked=True, scratch=scratch, layer=layer
    )
    R, K = topk.shape  # R here: the batch b
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
