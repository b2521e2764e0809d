"""Sparse MLA attention in jnp (f32 softmax over the gathered rows): what the kernels are tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.sparse_mla_attention.base import MASKED, check_host_inputs, check_inputs, is_quantized


def sparse_mla_attention_reference(query, kv, layer, slots, *, latent_dim, sm_scale, layout=None):
    """The formula in jnp, f32 throughout: query [R, H, D + rope]; kv row[L, R, S, W]; layer
    int or i32[]; slots i32[R, K] (-1 masked) -> f32[R, H, D] with D = latent_dim. Packed
    (fp8) rows are unpacked to f32 with `layout` first."""
    check_inputs(query, kv, layer, slots, latent_dim, layout)
    R = query.shape[0]
    valid = slots >= 0  # bool[R, K]
    rows = kv[layer][common.request_row(jnp.arange(R), kv)[:, None], jnp.where(valid, slots, 0)]  # row[R, K, W]
    if is_quantized(layout):
        rows = jnp.concatenate(layout.unpack(rows), axis=-1)  # f32[R, K, D + rope]
    rows = jnp.where(valid[:, :, None], rows.astype(jnp.float32), 0.0)  # never multiply an unread row
    scores = jnp.einsum(
        "rhw,rkw->rhk", query.astype(jnp.float32), rows, precision=jax.lax.Precision.HIGHEST
    ) * sm_scale  # f32[R, H, K]
    scores = jnp.where(valid[:, None, :], scores, MASKED)
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))  # f32[R, H, K]
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("rhk,rkd->rhd", weights, rows[..., :latent_dim], precision=jax.lax.Precision.HIGHEST)
    return jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)


def sparse_mla_attention_reading_host_reference(query, kv, layer, slots, host_slots, pool, *, latent_dim, sm_scale, layout=None):
    """The contract of reading misses from the host, in jnp: place every entry's pool row
    (host_slots i32[R, K] >= 0) into its slot of kv, then attend -> (f32[R, H, D], kv). The pool
    (row[L, S_host, W], pinned host) is staged on the device first, as row_copy's reference does."""
    check_inputs(query, kv, layer, slots, latent_dim, layout)
    check_host_inputs(kv, slots, host_slots, pool)
    R = slots.shape[0]
    from_host = (slots >= 0) & (host_slots >= 0)  # bool[R, K]
    rows = jax.device_put(pool, jax.memory.Space.Device)[layer][jnp.where(from_host, host_slots, 0)]  # row[R, K, W]
    requests = common.request_row(jnp.broadcast_to(jnp.arange(R)[:, None], slots.shape), kv)  # i32[R, K]
    kv = kv.at[layer, requests, jnp.where(from_host, slots, kv.shape[2])].set(rows, mode="drop")
    return sparse_mla_attention_reference(query, kv, layer, slots, latent_dim=latent_dim, sm_scale=sm_scale, layout=layout), kv
