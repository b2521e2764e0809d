"""The MTP (multi-token prediction, "NextN") layer of DeepSeek-V3.2 / GLM-5.x: the draft model of
speculative decoding (models.dsa.speculative).

Letters: T tokens, D hidden, V vocab.

Checkpoint names (DeepSeek's; GLM-5 uses the same): decoder layer num_layers + i holds
`enorm`, `hnorm`, `eh_proj` [D, 2D], `shared_head.norm`, `shared_head.head` [V, D] (optional:
without it the main lm_head is used, as transformers and SGLang do) and one ordinary decoder
layer's weights under the same prefix (`self_attn.*` with its own indexer, `mlp.*`, the two
layer norms). Its `embed_tokens` is the main model's (SGLang reads the main one; the loader
ignores the copy).

For position j the layer reads the hidden state h_j the target computed there (after the
target's final norm, as SGLang's captured hidden states are) and the embedding of the token at
j + 1, and predicts the token at j + 2:

    h' = eh_proj(concat(enorm(embed(x_{j+1})), hnorm(h_j)))      [T, D]
    g  = shared_head.norm(DecoderLayer(h'))                       [T, D]
    logits = (shared_head.head or lm_head)(g)                    f32[T, V]

A chain of draft steps feeds g back in place of h (SGLang's EAGLE chain). The decoder layer
attends over the request's own MTP KV rows, one more layer of the decode cache
(models.dsa.speculative).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from configs.model import DSAModelConfig
from models.common.layers import Linear, RMSNorm
from models.dsa.layer import DecoderLayer


def mtp_layer_config(config: DSAModelConfig) -> DSAModelConfig:
    """The config of the decoder inside an MTP layer: one layer with its own (full) indexer and
    the MLP kind of the model's last layer (MoE in every released model: its index is past
    first_k_dense_replace)."""
    return config.replace(
        num_layers=1, mlp_layer_types=(config.mlp_layer_types[-1],), indexer_types=("full",), num_nextn_predict_layers=0
    )


class SharedHead(nnx.Module):
    """`shared_head.norm` and, when the checkpoint has it, `shared_head.head`."""

    def __init__(self, config: DSAModelConfig, *, dtype, rngs: nnx.Rngs):
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        own = config.mtp_own_head
        self.head = Linear(config.hidden_size, config.vocab_size, dtype=dtype, rngs=rngs) if own else None  # [V, D]


class MTPLayer(DecoderLayer):
    """Decoder layer num_layers + i of the checkpoint: a DecoderLayer (same attribute names, so the
    same checkpoint names) plus the input fusion and the output head."""

    def __init__(self, config: DSAModelConfig, *, dtype, rngs: nnx.Rngs):
        super().__init__(mtp_layer_config(config), 0, dtype=dtype, rngs=rngs)
        D = config.hidden_size
        self.enorm = RMSNorm(D, config.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(D, config.rms_norm_eps, dtype=dtype)
        # Plain even in FP8 checkpoints (DeepSeek leaves eh_proj unquantised; an FP8 one would be
        # dequantised at load).
        self.eh_proj = Linear(2 * D, D, dtype=dtype, rngs=rngs)  # [D, 2D]
        self.shared_head = SharedHead(config, dtype=dtype, rngs=rngs)

    def fuse(self, embeds: jax.Array, hidden: jax.Array) -> jax.Array:
        """embeds [..., D] (of the next tokens), hidden [..., D] (the target's, or the previous draft
        step's g) -> the decoder layer's input [..., D]."""
        e = self.enorm(embeds)
        h = self.hnorm(hidden.astype(embeds.dtype))
        return self.eh_proj(jnp.concatenate([e, h], axis=-1))


def mtp_head(model, layer: MTPLayer, out: jax.Array) -> tuple[jax.Array, jax.Array]:
    """out [..., D] (the decoder layer's output) -> (g [..., D]: shared_head.norm(out), the hidden a
    next draft step reads; logits f32[..., V])."""
    g = layer.shared_head.norm(out)
    if layer.shared_head.head is not None:
        return g, layer.shared_head.head(g).astype(jnp.float32)
    return g, model.head_logits(g)
