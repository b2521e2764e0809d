"""Speculative steps: several query tokens per request in one layer step, then a commit that keeps
an accepted prefix and drops the rest (EAGLE-style drafting and verification; the DSA models'
use: models.dsa.speculative).

A speculative step of request r covers tokens at positions committed[r] .. committed[r] + q - 1
(some may be inactive, -1), where committed[r] = seq_lens[r], the tokens stored before it. In
each layer:
  1. write_speculative: every token's new row goes to its speculative slot, B + 1 + (position -
     committed) (HiSparse; full KV: its position). Nothing else sees it yet: not buffer_tokens,
     not the LRU order, not the host pool.
  2. the positions are planned in groups of G consecutive ones, G = floor(B / K) (at least 1;
     all of them without offload): one swap-in plan over the group's concatenated top-k rows
     (at most G x K <= B distinct positions, so every miss finds a victim), its misses copied,
     then the group's queries attend, before the next group's plan may evict their rows. Within
     a plan the step's own positions resolve to their speculative slots (hits); the committed
     ones go through the LRU exactly as in a decode step whose newest token nobody selected.
  3. attention of each query over its own top-k (its own indexer selection: causal among the
     step's tokens) in one kernel call per group, the buffer read as a pool of the batch.
After the step's last layer, commit_speculative keeps the rows of positions < the new lengths:
their host rows are written, and the device is left as decode steps would have left it (slot =
position while the context fits the buffer, else the newest in the reserved slot B); set_lengths
then sets seq_lens. A dropped token's row stayed in its speculative slot and is overwritten by
the next step; no table refers to it. The rule, and what the LRU order keeps of dropped tokens'
selections, is in docs/contract.md ("Speculative steps").

Shape letters (hisparse_jax.state): b request slots of the step, q tokens per request, H heads,
K top-k entries, W stored row width, D latent width. The query is D + rope wide.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hisparse_jax.state import KVState
from pallas_kernels.common import check_equal, check_layer_index, check_rank
from pallas_kernels.sparse_mla_attention import sparse_mla_attention


class SpeculativeStepInfo(NamedTuple):
    """What a speculative layer step reports besides its output."""

    num_hits: jax.Array  # i32[b]: distinct positions resolved on the device, summed over the groups
    num_misses: jax.Array  # i32[b]: rows copied host -> device, summed over the groups
    plans: tuple  # one SwapInPlan per group (slots i32[b, g x K]), for shared-index layers to replay
    groups: tuple  # ((first, end) query index of each group)


def plan_groups(state: KVState, q: int, top_k: int) -> tuple[tuple[int, int], ...]:
    """The groups of consecutive query positions planned together: G = floor(B / K) per group."""
    width = state.speculative_plan_width(top_k)
    size = q if width is None else max(1, min(q, width // top_k))
    return tuple((i, min(i + size, q)) for i in range(0, q, size))


def _check(state: KVState, layer, query, rows, positions, committed, topk=None) -> None:
    check_layer_index(layer, state.num_layers)
    check_rank("query", query, 4, "[b, q, H, W]")
    check_rank("new_rows", rows, 3, "[b, q, W]")
    check_rank("positions", positions, 2, "[b, q]")
    check_rank("committed", committed, 1, "[b]")
    b, q = positions.shape
    if b > state.num_requests:
        raise ValueError(f"positions batch ({b}) must not exceed the state's request slots (R = {state.num_requests})")
    for name, array in (("query", query), ("new_rows", rows), ("topk", positions if topk is None else topk)):
        check_equal(f"{name} batch and tokens", array.shape[:2], "positions' [b, q]", (b, q))
    check_equal("committed batch", committed.shape[0], "positions batch (b)", b)
    check_equal("query width", query.shape[3], "the state's latent + rope width", state.layout.logical_width)
    state.layout.check_rows("new_rows", rows)
    slots = getattr(state, "speculative_slots", None)
    if slots is not None and q > slots:
        raise ValueError(f"{q} tokens per request need as many speculative slots; the state has {slots} (create(speculative_slots=...))")


def _attend(state: KVState, layer, query, slots, *, latent_dim, sm_scale, implementation) -> jax.Array:
    """query [b, g, H, W'], slots i32[b, g, K] (device slots of request r's rows) -> f32[b, g, H, D],
    one kernel call: the device rows read as one pool of the batch (request r's slot s at row
    r x S + s), so each of the b x g queries reads its own request's rows."""
    b, g, H, _ = query.shape
    rows = state.device_rows  # row[L, R, S, W]
    L, R, S, W = rows.shape
    pool = rows.reshape(L, 1, R * S, W)  # a reshape of the whole array: no copy
    pool_slots = jnp.where(slots >= 0, slots + (jnp.arange(b) * S)[:, None, None], -1)
    out = sparse_mla_attention(
        query.reshape(b * g, H, -1), pool, layer, pool_slots.reshape(b * g, -1), latent_dim=latent_dim, sm_scale=sm_scale,
        layout=state.layout, implementation=implementation,
    )  # fmt: skip
    return out.reshape(b, g, H, -1)


def speculative_attention_layer(
    state: KVState,
    layer,  # int or i32[]
    query,  # [b, q, H, latent + rope]: each token's absorbed query
    new_rows,  # row[b, q, W] (or values [b, q, latent + rope]): each token's KV row
    positions,  # i32[b, q]: committed[r] + i for token i, or later tokens of a chain; -1 inactive
    topk,  # i32[b, q, K]: each token's own selection, positions in [0, its position], -1 padding
    committed,  # i32[b]: tokens stored before the step (seq_lens); -1 for an inactive request
    *,
    latent_dim: int,
    sm_scale: float,
    implementation: str | None = None,
    record_plan: bool = False,
):
    """One DSA layer over q tokens per request -> (state, f32[b, q, H, D], SpeculativeStepInfo).

    Every position must satisfy committed <= position < committed + M (the state's speculative
    slots), and the rows of positions committed .. position - 1 that a token may select must be
    written, in this call or an earlier speculative call of the same step (a draft chain).
    record_plan keeps the plans for speculative_shared_layer. Traceable; raises ValueError on
    inconsistent static shapes."""
    _check(state, layer, query, new_rows, positions, committed, topk)
    new_rows = state.layout.to_stored(new_rows)
    state = state.write_speculative(layer, new_rows, positions, committed)
    b, q, K = topk.shape
    hits = misses = jnp.zeros((b,), jnp.int32)
    outs, plans, groups = [], [], plan_groups(state, q, K)
    for first, end in groups:
        state, plan = state.plan_speculative(layer, topk[:, first:end].reshape(b, -1), committed, implementation=implementation)
        outs.append(
            _attend(state, layer, query[:, first:end], plan.slots.reshape(b, end - first, K), latent_dim=latent_dim,
                    sm_scale=sm_scale, implementation=implementation)
        )  # fmt: skip
        hits, misses = hits + plan.num_hits, misses + plan.num_misses
        plans.append(plan)
    info = SpeculativeStepInfo(hits, misses, tuple(plans) if record_plan else (), groups)
    return state, jnp.concatenate(outs, axis=1), info


def speculative_shared_layer(
    state: KVState,
    layer,
    query,  # [b, q, H, W']
    new_rows,  # row[b, q, W]
    positions,  # i32[b, q]
    committed,  # i32[b]
    anchor: SpeculativeStepInfo,  # the anchor layer's, with record_plan=True
    *,
    latent_dim: int,
    sm_scale: float,
    implementation: str | None = None,
):
    """A shared-index layer (GLM IndexShare) of a speculative step: the anchor's plans replayed
    group by group (copies only), each group attending before the next group's copies ->
    (state, f32[b, q, H, D], the anchor's info)."""
    if not anchor.plans:
        raise ValueError("speculative_shared_layer needs the anchor's plans: call speculative_attention_layer(..., record_plan=True)")
    b = positions.shape[0]
    _check(state, layer, query, new_rows, positions, committed)
    state = state.write_speculative(layer, state.layout.to_stored(new_rows), positions, committed)
    outs = []
    for (first, end), plan in zip(anchor.groups, anchor.plans):
        state = state.replay_swap_in(layer, plan, implementation=implementation)
        outs.append(
            _attend(state, layer, query[:, first:end], plan.slots.reshape(b, end - first, -1), latent_dim=latent_dim,
                    sm_scale=sm_scale, implementation=implementation)
        )  # fmt: skip
    return state, jnp.concatenate(outs, axis=1), anchor


def commit(state: KVState, rows, positions, committed, *, implementation=None) -> KVState:
    """After a speculative step's last layer: keeps, in every layer, the rows of positions below
    the new lengths committed i32[b] (-1: an inactive request, nothing kept) and sets seq_lens.
    rows: a sequence of the state's L layers' stored rows row[b, q, W] (or row[L, b, q, W]);
    positions i32[b, q] as the step's. Layers with no row this step (a draft layer a verify step
    does not run) are left out by passing None in their place.

    One barrier first orders every copy of the step (they read the host pool) before these
    in-place pool writes, as kv_cache_ops.backup_newest_rows does."""
    check_rank("positions", positions, 2, "[b, q]")
    if len(rows) != state.num_layers:
        raise ValueError(f"rows holds {len(rows)} layers, expected the state's L = {state.num_layers}")
    state = jax.lax.optimization_barrier(state)
    for layer, layer_rows in enumerate(rows):
        if layer_rows is not None:
            state = state.commit_speculative(layer, layer_rows, positions, committed, implementation=implementation)
    return set_lengths(state, committed)


def set_lengths(state: KVState, committed) -> KVState:
    """seq_lens of slots 0 .. b - 1 set to committed i32[b] where it is >= 0 (others unchanged)."""
    b = committed.shape[0]
    lengths = state.seq_lens[:b]
    return state.replace(seq_lens=state.seq_lens.at[:b].set(jnp.where(committed >= 0, committed, lengths)))

