"""One DSA decoder layer (MLA + indexer, then a dense MLP or the MoE): its weights and its
prompt-side forward. DSAForCausalLM stacks them (models.dsa.model); an MTP layer is one more
(models.dsa.mtp).

Letters: T tokens, D hidden, H heads, W KV row width, I index_head_dim, K top-k entries.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from configs.model import DSAModelConfig
from models.common import rope
from models.common.layers import MLP, RMSNorm
from models.common.moe import MoE
from models.dsa.indexer import index_scores, is_fp8, quantize_keys, select_topk
from models.dsa.mla import MLAttention, sparse_attention


class PrefillOutput(NamedTuple):
    hidden: jax.Array  # [T, D]: the layer's output
    rows: jax.Array  # [T, W]: KV row of every token (latent, rotated k_rope), in the param dtype
    index_keys: jax.Array | None  # [T, I]: indexer keys in the key cache's dtype, None on a shared-indexer layer
    topk: jax.Array  # i32[T, K]: positions each query attended to, -1 padding
    index_key_scales: jax.Array | None = None  # f32[T]: per-key scales of fp8 index_keys, else None


class DecoderLayer(nnx.Module):
    def __init__(self, config: DSAModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.self_attn = MLAttention(config, layer, dtype=dtype, rngs=rngs)
        if config.mlp_layer_types[layer] == "sparse":
            self.mlp = MoE(config, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(
                config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs, block=config.weight_block_size,
                fp8_activations=config.fp8_activations,
            )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def finish(self, h: jax.Array, attn: jax.Array) -> jax.Array:
        """h [T, D] (layer input), attn f32[T, H, A] (attention over latents) -> layer output [T, D]."""
        h = h + self.self_attn.output(attn)
        return h + self.mlp(self.post_attention_layernorm(h))

    def prefill(self, h: jax.Array, anchor_topk: jax.Array | None, *, chunk: int, key_dtype=None) -> PrefillOutput:
        """One sequence through this layer, positions 0..T-1, `chunk` queries at a time.

        h [T, D] with T a multiple of chunk (tokens past the prompt are padding: they come after
        every real token, so causality keeps them out of real queries). anchor_topk i32[T, K]:
        the anchor full layer's selection, for a shared-indexer layer. Only the KV rows and
        indexer keys exist for all T tokens at once; queries, scores and the MLP live per chunk,
        so peak memory is O(chunk x T), never T x T.

        key_dtype: the key cache's element type (None: the model dtype). The indexer scores the
        keys as stored, fp8 ones quantised (models.dsa.indexer.quantize_keys), as decoding will.
        """
        config, attn = self.config, self.self_attn
        T = h.shape[0]
        positions = jnp.arange(T, dtype=jnp.int32)  # i32[T]
        x = self.input_layernorm(h)
        cos, sin = rope.cos_sin(config.rope, config.qk_rope_head_dim, positions)  # f32[T, P/2]
        latent, k_rope = attn.kv_row(x, cos, sin)
        rows = jnp.concatenate([latent, k_rope], axis=-1)  # [T, W]
        index_keys = key_scales = None
        if attn.indexer is not None:
            index_keys = attn.indexer.keys(x, cos, sin)  # [T, I]
            if key_dtype is not None and is_fp8(key_dtype):
                index_keys, key_scales = quantize_keys(index_keys)  # f8[T, I], f32[T]
            elif key_dtype is not None:
                index_keys = index_keys.astype(key_dtype)

        def one_chunk(c):
            q_resid, query = attn.queries(c["x"], c["cos"], c["sin"])
            if attn.indexer is not None:
                iq, iw = attn.indexer.queries(c["x"], q_resid, c["cos"], c["sin"], index_keys.dtype)
                allowed = positions[None, :] <= c["positions"][:, None]  # bool[chunk, T]
                topk = select_topk(index_scores(iq, iw, index_keys, key_scales), allowed, config.index_topk)
            else:
                topk = c["topk"]
            out = sparse_attention(query, rows, topk, sm_scale=config.softmax_scale, latent_dim=config.kv_lora_rank)
            return self.finish(c["h"], out), topk

        per_query = dict(h=h, x=x, cos=cos, sin=sin, positions=positions)
        if attn.indexer is None:
            per_query["topk"] = anchor_topk
        chunks = jax.tree.map(lambda a: a.reshape(T // chunk, chunk, *a.shape[1:]), per_query)
        hidden, topk = jax.lax.map(one_chunk, chunks)
        return PrefillOutput(hidden.reshape(T, -1), rows, index_keys, topk.reshape(T, -1), key_scales)
