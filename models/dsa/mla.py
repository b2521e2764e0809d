"""Multi-head latent attention (MLA) in absorbed form, and the sparse attention it feeds.

Letters: T tokens, S stored rows (positions), D hidden, Q q_lora_rank, H heads,
N qk_nope_head_dim, P qk_rope_head_dim, A kv_lora_rank (latent), V v_head_dim,
W = A + P row width, K top-k entries.

Absorbed form: q_nope . (W_UK latent) = (W_UK^T q_nope) . latent, so each head's query becomes
a W-wide vector against the shared KV row [latent, rotated k_rope], and the value is the latent,
lifted per head by W_UV after the attention. Prefill and decode both use it, so a row written at
prefill is read by decode exactly as a freshly computed one would be. transformers computes the
same logits through expanded keys; the two agree to float32 round-off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from configs.model import DSAModelConfig
from models.common import rope
from models.common.layers import Linear, RMSNorm, einsum
from models.dsa.indexer import Indexer


class MLAttention(nnx.Module):
    def __init__(self, config: DSAModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.num_heads = config.num_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.latent_dim = config.kv_lora_rank
        self.v_dim = config.v_head_dim
        H, A, P = config.num_heads, config.kv_lora_rank, config.qk_rope_head_dim
        # block FP8 for the projections below, except kv_b_proj
        fp8_linear = functools.partial(
            Linear, dtype=dtype, rngs=rngs, block=config.weight_block_size, fp8_activations=config.fp8_activations
        )
        self.q_a_proj = fp8_linear(config.hidden_size, config.q_lora_rank)  # [Q, D]
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6, dtype=dtype)  # eps fixed in the reference
        self.q_b_proj = fp8_linear(config.q_lora_rank, H * config.qk_head_dim)  # [H*(N+P), Q]
        self.kv_a_proj_with_mqa = fp8_linear(config.hidden_size, A + P)  # [A+P, D]
        self.kv_a_layernorm = RMSNorm(A, 1e-6, dtype=dtype)
        # kv_b_proj stays in the model dtype: its halves are absorbed into the queries and outputs
        # as whole matrices (_kv_b), not multiplied as a linear layer.
        self.kv_b_proj = Linear(A, H * (self.nope_dim + self.v_dim), dtype=dtype, rngs=rngs)  # [H*(N+V), A]
        self.o_proj = fp8_linear(H * self.v_dim, config.hidden_size)  # [D, H*V]
        self.fp8_activations = config.fp8_activations  # w8a8: the value lift in the weights' 16-bit dtype too (output())
        full = config.indexer_types[layer] == "full"
        self.indexer = Indexer(config, dtype=dtype, rngs=rngs) if full else None

    def _kv_b(self) -> tuple[jax.Array, jax.Array]:
        """(W_UK [H, N, A], W_UV [H, V, A]) from kv_b_proj."""
        w = self.kv_b_proj.weight[...].reshape(self.num_heads, self.nope_dim + self.v_dim, self.latent_dim)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def queries(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] (normed hidden), cos/sin f32[T, P/2] -> (q_resid [T, Q], query [T, H, W]).

        q_resid (the normed query LoRA) also feeds the indexer; query is absorbed: its latent
        part, then its rotated rope part, in the KV row's order.
        """
        q_resid = self.q_a_layernorm(self.q_a_proj(x))  # [T, Q]
        q = self.q_b_proj(q_resid).reshape(*x.shape[:-1], self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q[..., : self.nope_dim], q[..., self.nope_dim :]  # [T, H, N], [T, H, P]
        q_rope = rope.apply_interleaved(q_rope, cos[..., None, :], sin[..., None, :])
        w_uk, _ = self._kv_b()
        q_latent = einsum("thn,hna->tha", q_nope, w_uk)  # [T, H, A]
        return q_resid, jnp.concatenate([q_latent, q_rope], axis=-1)

    def kv_row(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D], cos/sin f32[T, P/2] -> (latent [T, A] after kv_a_layernorm, rotated k_rope [T, P]):
        the two parts of each token's KV row."""
        kv = self.kv_a_proj_with_mqa(x)  # [T, A+P]
        latent = self.kv_a_layernorm(kv[..., : self.latent_dim])
        return latent, rope.apply_interleaved(kv[..., self.latent_dim :], cos, sin)

    def output(self, attn: jax.Array) -> jax.Array:
        """attn f32[T, H, A] (softmax-weighted latents) -> [T, D] through W_UV and o_proj.

        The lift runs in float32 at full precision, except with w8a8 (fp8_activations) over
        16-bit weights: then attn is rounded to the weights' dtype and the products accumulate in
        f32 on the tensor cores, as DeepSeek's inference code lifts its bf16 attention output;
        o_proj rounds its input to e4m3 right after. On the H200 the f32 lift was a full-precision
        f32 GEMM (cuBLAS sm80_xmma_gemm_f32f32...) of 2.1 ms a step at DeepSeek-V3.2's 50 running,
        and 0.8 ms more converting W_UV to f32 (docs/PERFORMANCE.md, fifteenth session; the 16-bit
        lift not yet timed)."""
        _, w_uv = self._kv_b()
        if self.fp8_activations and jnp.dtype(w_uv.dtype).itemsize == 2:
            o = jnp.einsum("tha,hva->thv", attn.astype(w_uv.dtype), w_uv, preferred_element_type=jnp.float32)  # f32[T, H, V]
        else:
            o = einsum("tha,hva->thv", attn, w_uv.astype(jnp.float32))  # f32[T, H, V]
        return self.o_proj(o.reshape(*o.shape[:-2], self.num_heads * self.v_dim))


def sparse_attention(query: jax.Array, rows: jax.Array, topk: jax.Array, *, sm_scale: float, latent_dim: int) -> jax.Array:
    """Attention of each query over its selected rows, f32 softmax.

    query [T, H, W], rows [S, W], topk i32[T, K] (row index, -1 padding; each query selects at
    least one row) -> f32[T, H, A].
    """
    picked = jnp.take(rows, jnp.maximum(topk, 0), axis=0).astype(jnp.float32)  # f32[T, K, W]
    logits = einsum("thw,tkw->thk", query.astype(jnp.float32), picked) * sm_scale
    logits = jnp.where((topk >= 0)[:, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)  # f32[T, H, K]
    return einsum("thk,tka->tha", probs, picked[..., :latent_dim])
