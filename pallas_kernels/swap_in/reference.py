"""The swap-in plan in jnp, one request at a time: the contract (pallas_kernels.swap_in.api) written
plainly; what the kernels are tested against."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.swap_in.base import SwapInPlan, check_plan_inputs, host_slots_of


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
    check_plan_inputs(buffer_tokens, lru_slots, topk, lengths, page_table, stacked=False)
    slots, tokens, lru, hits, misses, miss_host, miss_device = jax.vmap(
        functools.partial(_plan_one_request, page_size=page_size)
    )(buffer_tokens, lru_slots, topk, lengths, page_table)
    return SwapInPlan(slots, hits, misses, miss_host, miss_device), tokens, lru
