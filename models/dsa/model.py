"""The DSA decoder (DeepSeek-V3.2, GLM-5.x): modules and the prompt-side forward.

Letters: B sequences, T tokens, D hidden, V vocab, H heads, W KV row width, I index_head_dim,
K top-k entries, J full-indexer layers.

Module and attribute names follow the Hugging Face checkpoints (`model.layers.3.self_attn.
indexer.wk.weight` is `model.layers[3].self_attn.indexer.wk.weight`), which is all the loader
needs to map tensors. The modules hold weights only; the prompt forward below returns what the
caches need (each layer's KV rows, indexer keys, top-k) instead of writing any cache itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from configs.model import DSAModelConfig
from models.common.layers import Embedding, Linear, RMSNorm, einsum
from models.dsa.layer import DecoderLayer, PrefillOutput  # noqa: F401  (importable from here too)
from models.dsa.mtp import MTPLayer


class DSAForCausalLM(nnx.Module):
    """DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM weights (HF `model.*` and `lm_head`)."""

    def __init__(self, config: DSAModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dtype=dtype, rngs=rngs) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        tied = config.tie_word_embeddings
        self.lm_head = None if tied else Linear(config.hidden_size, config.vocab_size, dtype=dtype, rngs=rngs)
        # The checkpoint's MTP layers (decoder layers num_layers + i), the draft model of
        # speculative decoding; None without any (nothing else reads them).
        mtp = config.num_nextn_predict_layers
        self.mtp = nnx.List([MTPLayer(config, dtype=dtype, rngs=rngs) for _ in range(mtp)]) if mtp else None

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., D] (last layer's output) -> f32[..., V]."""
        return self.head_logits(self.norm(h))

    def head_logits(self, normed: jax.Array) -> jax.Array:
        """normed [..., D] (after the final norm) -> f32[..., V] through lm_head (or the tied embeddings)."""
        if self.lm_head is None:
            return einsum("...d,vd->...v", normed, self.embed_tokens.weight[...]).astype(jnp.float32)
        return self.lm_head(normed).astype(jnp.float32)


def forward(model: DSAForCausalLM, tokens: jax.Array, *, chunk: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Full no-cache forward, as transformers runs it: tokens i32[B, T] ->
    (logits f32[B, T, V], top-k i32[J, B, T, K] of every full-indexer layer, -1 padded).

    T must be a multiple of `chunk` (default: one chunk).
    """
    T = tokens.shape[1]
    chunk = chunk or T
    if T % chunk:
        raise ValueError(f"{T=} must be a multiple of {chunk=}")

    def one_sequence(seq):
        h = model.embed_tokens(seq)  # [T, D]
        anchor, topks = None, []
        for layer in model.layers:
            out = layer.prefill(h, anchor, chunk=chunk)
            h = out.hidden
            if out.index_keys is not None:
                anchor = out.topk
                topks.append(out.topk)
        return model.logits(h), jnp.stack(topks)

    logits, topk = jax.lax.map(one_sequence, tokens)  # ragged_dot (MoE) has no batching rule
    return logits, jnp.moveaxis(topk, 1, 0)
