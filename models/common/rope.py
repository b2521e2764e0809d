"""Rotary position embedding as transformers' DeepSeek-V3.2 / GLM-5 code computes it.

Letters: T tokens (any leading shape), P rotated dims (qk_rope_head_dim), P/2 frequencies.

Both RoPE forms rotate pairs (x1[i], x2[i]) by angle position * inv_freq[i] and write the result
half-split, [x1 cos - x2 sin, x2 cos + x1 sin]; they differ only in which elements pair up:
  interleaved  (x[2i], x[2i+1]): MLA attention of both models, the GLM indexer;
  half-split   (x[i], x[i + P/2]): the DeepSeek-V3.2 indexer.
Queries and keys are permuted alike, so dot products match the textbook interleaved form.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from configs.model import RopeConfig, yarn_get_mscale


def inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """(inv_freq f32[dim / 2], attention_factor): transformers' default / YaRN rope init."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)  # f32[P/2]
    pos_freqs = np.float32(rope.theta) ** exponents  # f32[P/2]
    if rope.rope_type == "default":
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0

    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = np.float32(1) - ramp  # f32[P/2]: 1 keeps the original frequency
    inv_extrapolation = np.float32(1.0) / pos_freqs
    inv_interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = inv_interpolation * (1 - extrapolation) + inv_extrapolation * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def cos_sin(rope: RopeConfig, dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions i32[...] -> (cos, sin) f32[..., P/2], scaled by YaRN's attention factor."""
    inv_freq, attention_factor = inverse_frequencies(rope, dim)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # f32[..., P/2]
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def _rotate(x1: jax.Array, x2: jax.Array, cos: jax.Array, sin: jax.Array, dtype) -> jax.Array:
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype)


def apply_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., P] with pairs (2i, 2i+1); cos/sin broadcastable to [..., P/2]."""
    return _rotate(x[..., 0::2], x[..., 1::2], cos, sin, x.dtype)


def apply_half_split(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., P] with pairs (i, i + P/2); cos/sin broadcastable to [..., P/2]."""
    half = x.shape[-1] // 2
    return _rotate(x[..., :half], x[..., half:], cos, sin, x.dtype)
