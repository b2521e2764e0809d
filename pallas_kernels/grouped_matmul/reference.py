"""The grouped matmul in jnp: jax.lax.ragged_dot over the (dequantised) weights at HIGHEST
precision; fp8 weights dequantised to the activations' dtype first, so an fp8 model computes
exactly what the same model with its weights dequantised at load computes. What the kernels are
tested against (within their dtype's tolerance: they accumulate in another order)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.base import dequantize


def grouped_matmul_reference(lhs, rhs, group_sizes, rhs_scale=None, *, preferred_element_type=None):
    """lhs [M, K], rhs [G, K, N] (fp8: with rhs_scale f32[G, K/b0, N/b1]), group_sizes i32[G] -> [M, N];
    rows past sum(group_sizes) are 0."""
    if rhs_scale is not None:
        rhs = dequantize(rhs, rhs_scale, lhs.dtype)
    out = jax.lax.ragged_dot(
        lhs, rhs.astype(lhs.dtype), group_sizes, precision=jax.lax.Precision.HIGHEST, preferred_element_type=preferred_element_type
    )
    return out


def matmul_reference(x, w, w_scale=None):
    """x [M, K], w [K, N] (fp8: with w_scale f32[K/b0, N/b1]) -> [M, N] in x's dtype."""
    if w_scale is not None:
        w = dequantize(w, w_scale, x.dtype)
    return jnp.einsum("mk,kn->mn", x, w.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)
