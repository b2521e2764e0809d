"""One sparse layer's decode step: write newest -> swap-in -> sparse MLA attention -> backup.

`attention_layer` is what a model calls in each DSA layer. The same signature serves both
memory modes, chosen by the state it is given:
  HiSparseState: the full KV in pinned host memory, a B-slot hot buffer per request on device;
  FullKVState:   the no-offload baseline, every row on the device.
Both run the same attention kernel over rows in the same top-k order, so with the same inputs
their outputs are bit-identical (tests/test_attention_layer.py).

Order inside a HiSparse step, and why:
  1. the newest row goes to its device slot (slot = position while n <= B, else the reserved
     slot B), so attention can read it without a host round trip;
  2. swap-in plan, then the copy of the missed rows host -> device (pallas_kernels);
  3. eager backup of the newest row device -> its host slot, after the copy (which never needs
     it: the newest position resolves to a device slot), so it is off the swap-in/attention
     chain; the next step's swap-in reads the pool XLA returns here, which orders the backup
     before any read of that row from the host;
  4. attention over the resolved slots.

Shape letters: R requests, H heads, K top-k entries, W row width, D latent width.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hisparse_jax.state import FullKVState, HiSparseState, jit_donating_state
from pallas_kernels.row_copy import copy_host_rows_to_buffer, write_rows_to_host
from pallas_kernels.sparse_mla_attention import sparse_mla_attention
from pallas_kernels.swap_in import SwapInPlan, host_slots_of, swap_in_plan


class LayerStepInfo(NamedTuple):
    num_hits: jax.Array  # i32[R]: distinct selected positions already on the device
    num_misses: jax.Array  # i32[R]: distinct positions copied host -> device
    plan: SwapInPlan | None  # the swap-in plan, for shared-index layers to replay (record_plan)


def _copy_misses(state: HiSparseState, layer, plan: SwapInPlan, implementation) -> jax.Array:
    """The device buffer with the plan's missed rows copied in from the host pool."""
    return copy_host_rows_to_buffer(
        state.host_pool,
        state.device_buffer,
        layer,
        plan.miss_host_slots,
        plan.miss_device_slots,
        plan.num_misses,
        implementation=implementation,
        rows_per_program=state.copy_rows_per_program,
    )


def lengths_from_positions(positions: jax.Array) -> jax.Array:
    """i32[R] tokens stored once this step's row is written; 0 for an inactive slot (-1)."""
    return jnp.where(positions >= 0, positions + 1, 0)


def _write_newest(state: HiSparseState, layer, new_row, positions) -> HiSparseState:
    """Puts the newest row in its device slot; on the fast path its slot also records it."""
    R, B = state.num_requests, state.buffer_size
    requests = jnp.arange(R)
    active = positions >= 0
    slot = jnp.where(positions < B, positions, state.reserved_slot)  # i32[R]
    device_buffer = state.device_buffer.at[layer, requests, jnp.where(active, slot, B + 1)].set(
        new_row.astype(state.device_buffer.dtype), mode="drop"
    )
    fast = active & (positions < B)
    buffer_tokens = state.buffer_tokens.at[layer, requests, jnp.where(fast, positions, B)].set(positions, mode="drop")
    return state.replace(device_buffer=device_buffer, buffer_tokens=buffer_tokens)


def _backup_newest(state: HiSparseState, layer, new_row, positions, implementation) -> HiSparseState:
    host_slot = jax.vmap(host_slots_of, in_axes=(0, 0, None))(
        state.host_page_table, jnp.maximum(positions, 0), state.page_size
    )  # i32[R]
    host_slot = jnp.where(positions >= 0, host_slot, -1)
    pool = write_rows_to_host(state.host_pool, layer, new_row, host_slot, implementation=implementation)
    return state.replace(host_pool=pool)


def attention_layer(
    state,
    layer,
    query,  # [R, H, W]: absorbed query in the row's order (latent part, then rope part)
    new_row,  # row[R, W]: this step's KV row of every request
    positions,  # i32[R]: position of the new token (= tokens already stored), -1 inactive
    topk,  # i32[R, K]: selected positions in [0, positions], -1 padding
    *,
    latent_dim: int,
    sm_scale: float,
    implementation: str | None = None,
    record_plan: bool = False,
):
    """One DSA layer's decode attention. Returns (state, f32[R, H, latent_dim], LayerStepInfo).

    Traceable; call it inside the model's jitted, state-donating decode step.
    """
    if query.shape[-1] != new_row.shape[-1]:
        raise ValueError(f"query width {query.shape[-1]} != new_row width {new_row.shape[-1]}")
    if isinstance(state, FullKVState):
        return _dense_attention_layer(state, layer, query, new_row, positions, topk, latent_dim, sm_scale, implementation, record_plan)
    state = _write_newest(state, layer, new_row, positions)
    plan, buffer_tokens, lru_slots, scratch = swap_in_plan(
        state.buffer_tokens,
        state.lru_slots,
        state.swap_in_scratch,
        layer,
        topk,
        lengths_from_positions(positions),
        state.host_page_table,
        page_size=state.page_size,
        implementation=implementation,
    )
    device_buffer = _copy_misses(state, layer, plan, implementation)
    state = state.replace(
        device_buffer=device_buffer, buffer_tokens=buffer_tokens, lru_slots=lru_slots, swap_in_scratch=scratch
    )
    state = _backup_newest(state, layer, new_row, positions, implementation)
    out = sparse_mla_attention(
        query, state.device_buffer, layer, plan.slots, latent_dim=latent_dim, sm_scale=sm_scale, implementation=implementation
    )
    return state, out, LayerStepInfo(plan.num_hits, plan.num_misses, plan if record_plan else None)


def jit_attention_layer(state, *, latent_dim: int, sm_scale: float, implementation: str | None = None):
    """attention_layer as one jitted function for every layer (the layer index is traced, so
    it compiles once), the state donated: `step(state, layer, query, new_row, positions, topk)
    -> (state, out, info)`. A model that runs all its layers in one jitted step (models/decoding.py)
    calls attention_layer directly instead."""
    fn = functools.partial(attention_layer, latent_dim=latent_dim, sm_scale=sm_scale, implementation=implementation)
    return jit_donating_state(fn, state, extra_outputs=2)


def shared_attention_layer(
    state,
    layer,
    query,  # [R, H, W]
    new_row,  # row[R, W]
    positions,  # i32[R]
    anchor: LayerStepInfo,  # the anchor (full indexer) layer's info, recorded with record_plan=True
    *,
    latent_dim: int,
    sm_scale: float,
    implementation: str | None = None,
):
    """A layer that reuses its anchor's top-k (GLM IndexShare): the anchor's swap-in decisions hold
    for it too, so it replays the anchor's miss plan as a copy-only kernel into its own buffer.

    Its own buffer_tokens / lru_slots rows are not consulted: the anchor's govern both layers.
    """
    if anchor.plan is None:
        raise ValueError("shared_attention_layer needs the anchor's plan: call attention_layer(..., record_plan=True)")
    plan = anchor.plan
    if isinstance(state, FullKVState):
        # Without offload the slots are the positions themselves; the anchor's dense path keeps them.
        return _dense_attention_layer(state, layer, query, new_row, positions, plan.slots, latent_dim, sm_scale, implementation, True)
    state = _write_newest(state, layer, new_row, positions)
    device_buffer = _copy_misses(state, layer, plan, implementation)
    state = _backup_newest(state.replace(device_buffer=device_buffer), layer, new_row, positions, implementation)
    out = sparse_mla_attention(
        query, state.device_buffer, layer, plan.slots, latent_dim=latent_dim, sm_scale=sm_scale, implementation=implementation
    )
    return state, out, LayerStepInfo(plan.num_hits, plan.num_misses, plan)


def _distinct_valid(topk):
    # topk: i32[R, K] -> i32[R] distinct non-negative entries
    ordered = jnp.sort(topk, axis=1)
    fresh = jnp.concatenate([jnp.ones_like(ordered[:, :1], bool), ordered[:, 1:] != ordered[:, :-1]], axis=1)
    return jnp.sum(fresh & (ordered >= 0), axis=1, dtype=jnp.int32)


def _dense_attention_layer(state: FullKVState, layer, query, new_row, positions, topk, latent_dim, sm_scale, implementation, record_plan):
    R, C = state.num_requests, state.max_context
    kv = state.kv.at[layer, jnp.arange(R), jnp.where(positions >= 0, positions, C)].set(
        new_row.astype(state.kv.dtype), mode="drop"
    )
    state = state.replace(kv=kv)
    out = sparse_mla_attention(query, kv, layer, topk, latent_dim=latent_dim, sm_scale=sm_scale, implementation=implementation)
    plan = SwapInPlan(
        slots=topk,
        num_hits=_distinct_valid(topk),
        num_misses=jnp.zeros((R,), jnp.int32),
        miss_host_slots=jnp.full_like(topk, -1),
        miss_device_slots=jnp.full_like(topk, -1),
    )
    return state, out, LayerStepInfo(plan.num_hits, plan.num_misses, plan if record_plan else None)
