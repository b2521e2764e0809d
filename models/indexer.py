"""The DSA lightning indexer: scores every earlier position, keeps the top-k.

Letters: T query tokens, S key positions, D hidden, Q q_lora_rank, G indexer heads,
I index_head_dim, P rotated dims (qk_rope_head_dim, the first P of I), K top-k entries.

score[t, s] = sum_g w[t, g] * relu(q[t, g] . k[s] / sqrt(I)),  w = weights_proj(x) / sqrt(G),
as transformers' DeepseekV32Indexer computes it (the checkpoint's Hadamard rotation and FP8
scoring are accuracy-neutral kernels there and here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from configs.model import DSAModelConfig
from models import rope
from models.layers import LayerNorm, Linear, einsum


class Indexer(nnx.Module):
    """Weights of one layer's indexer; keys and queries come out, the cache stays outside."""

    def __init__(self, config: DSAModelConfig, *, dtype, rngs: nnx.Rngs):
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.interleaved = config.indexer_rope_interleave
        self.wq_b = Linear(config.q_lora_rank, self.num_heads * self.head_dim, dtype=dtype, rngs=rngs)  # [G*I, Q]
        self.wk = Linear(config.hidden_size, self.head_dim, dtype=dtype, rngs=rngs)  # [I, D]
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)  # eps fixed in the reference
        # transformers keeps weights_proj in float32 whatever the model dtype.
        self.weights_proj = Linear(config.hidden_size, self.num_heads, dtype=jnp.float32, rngs=rngs)  # [G, D]

    def _rotate(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        # x: [..., I]; the first P dims are rotated, the rest pass through
        apply = rope.apply_interleaved if self.interleaved else rope.apply_half_split
        return jnp.concatenate([apply(x[..., : self.rope_dim], cos, sin), x[..., self.rope_dim :]], axis=-1)

    def keys(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [T, D] (normed hidden), cos/sin f32[T, P/2] -> keys [T, I] (what the key cache holds)."""
        return self._rotate(self.k_norm(self.wk(x)), cos, sin)

    def queries(self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D], q_resid [T, Q] (MLA's normed query LoRA) -> (q [T, G, I], head weights f32[T, G])."""
        q = self.wq_b(q_resid).reshape(*q_resid.shape[:-1], self.num_heads, self.head_dim)  # [T, G, I]
        q = self._rotate(q, cos[..., None, :], sin[..., None, :])
        weights = self.weights_proj(x).astype(jnp.float32) * self.num_heads**-0.5  # f32[T, G]
        return q, weights


def index_scores(q: jax.Array, weights: jax.Array, keys: jax.Array) -> jax.Array:
    """q [T, G, I], weights f32[T, G], keys [S, I] -> f32[T, S]."""
    per_head = einsum("tgi,si->tgs", q.astype(jnp.float32), keys.astype(jnp.float32))  # f32[T, G, S]
    per_head = jax.nn.relu(per_head * q.shape[-1] ** -0.5)
    return einsum("tg,tgs->ts", weights, per_head)


def select_topk(scores: jax.Array, allowed: jax.Array, k: int) -> jax.Array:
    """scores f32[T, S], allowed bool[T, S] -> i32[T, K]: best allowed positions, -1 padded.

    Fewer than k allowed positions (a short context) leave the tail -1; the reference picks
    arbitrary masked positions there, which its mask then ignores.
    """
    masked = jnp.where(allowed, scores, -jnp.inf)
    take = min(k, scores.shape[-1])
    values, positions = jax.lax.top_k(masked, take)  # [T, take]
    topk = jnp.where(values > -jnp.inf, positions, -1).astype(jnp.int32)
    if take < k:
        topk = jnp.pad(topk, [(0, 0)] * (topk.ndim - 1) + [(0, k - take)], constant_values=-1)
    return topk
