"""The swap-in plan's types, constants and input checks, shared by its implementations."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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


def check_plan_inputs(buffer_tokens, lru_slots, topk, lengths, page_table, *, stacked, scratch=None, layer=None):
    """Static shape checks of the plan's inputs; the tables are [L, R, B] if stacked, else [R, B].

    Stacked, the tables (and scratch, page_table) may hold more request slots than topk's b rows:
    the plan then covers slots 0 .. b - 1 and leaves the others as they are."""
    check_rank("topk", topk, 2, "[R, K]")
    check_rank("buffer_tokens", buffer_tokens, 3 if stacked else 2, "[L, R, B]" if stacked else "[R, B]")
    check_equal("lru_slots shape", lru_slots.shape, "buffer_tokens shape", buffer_tokens.shape)
    check_rank("lengths", lengths, 1, "[R]")
    check_rank("page_table", page_table, 2, "[R, P]")
    (R, K), B, slots = topk.shape, buffer_tokens.shape[-1], buffer_tokens.shape[-2]
    if not stacked:
        check_equal("topk batch", R, "buffer_tokens request slots (R)", slots)
    elif R > slots:
        raise ValueError(f"topk batch ({R}) must be <= buffer_tokens request slots (R) ({slots})")
    check_equal("lengths batch", lengths.shape[0], "topk batch (R)", R)
    check_equal("page_table batch", page_table.shape[0], "buffer_tokens request slots (R)", slots)
    if K > B:
        raise ValueError(f"top_k ({K}) must be <= device_buffer_size ({B}): a step's misses need that many evictable slots")
    if scratch is not None:
        check_rank("scratch", scratch, 2, "[R, C]")
        check_equal("scratch batch", scratch.shape[0], "buffer_tokens request slots (R)", slots)
    if layer is not None:
        check_layer_index(layer, buffer_tokens.shape[0])
