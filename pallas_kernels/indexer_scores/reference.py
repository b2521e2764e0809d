"""The DSA indexer's scores in jnp: the formula (score_keys) and the masked scores over a key cache;
what the kernel is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.indexer_scores.base import MASKED, check_inputs, is_fp8, operand_dtype


def score_keys(q: jax.Array, weights: jax.Array, keys: jax.Array, key_scales: jax.Array | None = None) -> jax.Array:
    """q [T, G, I], weights f32[T, G], keys [S, I] (fp8: + key_scales f32[S]) -> f32[T, S].

    models/dsa/indexer.py's index_scores (the model's scoring, unmasked)."""
    # q . k with its operands in their stored dtype (bf16 in a bf16 model) accumulating in f32:
    # tensor cores on the GPU (an f32 GEMM on the CUDA cores was ~4x slower, docs/PERFORMANCE.md).
    # f32 models keep f32 operands at HIGHEST precision (TF32 would flip top-k choices).
    operand = operand_dtype(q.dtype, keys.dtype)
    precision = jax.lax.Precision.HIGHEST if operand == jnp.float32 else None
    per_head = jnp.einsum(
        "tgi,si->tgs", q.astype(operand), keys.astype(operand), precision=precision, preferred_element_type=jnp.float32
    )  # f32[T, G, S]
    per_head = jax.nn.relu(per_head * q.shape[-1] ** -0.5)
    scores = jnp.einsum("tg,tgs->ts", weights, per_head, precision=jax.lax.Precision.HIGHEST)  # f32[T, S]
    return scores if key_scales is None else scores * key_scales.astype(jnp.float32)[None, :]


def index_scores_masked_reference(q, weights, index_keys, key_scales, layer, positions):
    """The model's decode path in jnp: score_keys per request over its slot's keys, then -inf
    past each position. Same arguments as index_scores_masked -> f32[b, C]."""
    check_inputs(q, weights, index_keys, key_scales, layer, positions)
    b, C = q.shape[0], index_keys.shape[2]
    keys = index_keys[layer, :b]  # [b, C, I]
    scales = key_scales[layer, :b] if is_fp8(index_keys.dtype) else None  # f32[b, C]
    scores = jax.vmap(score_keys)(q[:, None], weights[:, None], keys, scales)[:, 0]  # f32[b, C]
    allowed = jnp.arange(C)[None, :] <= positions[:, None]  # bool[b, C]; nothing for -1
    return jnp.where(allowed, scores, MASKED)
