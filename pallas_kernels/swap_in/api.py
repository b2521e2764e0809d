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

implementation="tpu" (pallas_kernels/swap_in/pallas_tpu.py) computes the same plan, bit for bit, with
comparison matrices in VMEM instead of the scratch hash.

Shape letters: R requests, K top-k entries, B buffer slots, L layers, C max context,
P host pages per request.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.swap_in.base import check_plan_inputs
from pallas_kernels.swap_in.pallas_triton import swap_in_plan_pallas
from pallas_kernels.swap_in.reference import swap_in_plan_reference


def swap_in_plan(buffer_tokens, lru_slots, scratch, layer, topk, lengths, page_table, *, page_size, implementation=None):
    """Plans one layer's swap-in over the stacked state arrays; see the module docstring.

    buffer_tokens, lru_slots: i32[L, R, B]; scratch: i32[R, C] (SCRATCH_EMPTY everywhere);
    layer: int or i32[]; topk: i32[b, K] with K <= B and b <= R: the plan covers request slots
    0 .. b - 1 (a batch bucket below the slot count), the others stay as they are;
    lengths: i32[b]; page_table: i32[R, P].
    Returns (plan, buffer_tokens, lru_slots, scratch), the plan's arrays [b, ...], the last three
    shaped as given. Raises ValueError on inconsistent static shapes.
    """
    check_plan_inputs(
        buffer_tokens, lru_slots, topk, lengths, page_table, stacked=True, scratch=scratch, layer=layer
    )
    implementation = common.resolve_implementation(implementation)
    if implementation == "pallas":  # grid over the b requests, indexing the whole tables: no slicing copies
        return swap_in_plan_pallas(
            buffer_tokens, lru_slots, scratch, jnp.asarray(layer, jnp.int32), topk, lengths, page_table, page_size=page_size
        )
    b = topk.shape[0]
    if implementation == "tpu":  # its grid covers every request slot: a smaller batch plans on `layer`'s first b, cut out
        from pallas_kernels.swap_in.pallas_tpu import swap_in_plan_tpu

        if b == buffer_tokens.shape[1]:
            return swap_in_plan_tpu(
                buffer_tokens, lru_slots, scratch, jnp.asarray(layer, jnp.int32), topk, lengths, page_table, page_size=page_size
            )
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, layer, 1, axis=0)[:, :b]  # noqa: E731  i32[1, b, B]
        plan, tokens, lru, _ = swap_in_plan_tpu(
            cut(buffer_tokens), cut(lru_slots), scratch[:b], jnp.int32(0), topk, lengths, page_table[:b], page_size=page_size
        )
        put = lambda full, part: jax.lax.dynamic_update_slice(full, part, (layer, 0, 0))  # noqa: E731
        return plan, put(buffer_tokens, tokens), put(lru_slots, lru), scratch
    plan, tokens, lru = swap_in_plan_reference(
        buffer_tokens[layer, :b], lru_slots[layer, :b], topk, lengths, page_table[:b], page_size=page_size
    )
    return plan, buffer_tokens.at[layer, :b].set(tokens), lru_slots.at[layer, :b].set(lru), scratch
