"""Top-k over masked scores in jnp (lax.top_k): the choice and order the kernels reproduce exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def topk_reference(scores: jax.Array, k: int) -> jax.Array:
    """scores f32[..., C] (-inf: not allowed) -> i32[..., K]: lax.top_k's positions, -1 where
    the score is -inf (and past C when K > C). models/dsa/indexer.py's select_topk."""
    take = min(k, scores.shape[-1])
    # -0.0 -> +0.0: lax.top_k on the GPU (a CUB radix sort) ties them, on the CPU +0 ranks first.
    scores = jnp.where(scores == 0, 0.0, scores)
    values, positions = jax.lax.top_k(scores, take)  # [..., take]
    topk = jnp.where(values > -jnp.inf, positions, -1).astype(jnp.int32)
    if take < k:
        topk = jnp.pad(topk, [(0, 0)] * (topk.ndim - 1) + [(0, k - take)], constant_values=-1)
    return topk
