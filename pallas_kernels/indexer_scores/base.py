"""The indexer scores' key format, dtype rules and input checks, shared by their implementations."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.common import check_equal, check_layer_index, check_rank

FP8_KEY_DTYPE = jnp.float8_e4m3fn
MASKED = -float("inf")


def is_fp8(dtype) -> bool:
    """Whether keys of `dtype` are the fp8 format (values + a per-key scale)."""
    return jnp.dtype(dtype) == jnp.dtype(FP8_KEY_DTYPE)


def operand_dtype(q_dtype, key_dtype):
    """The dtype the q . k dot runs in: fp8 with fp8 queries and keys (w8a8: fp8 tensor cores, the
    products exact in f32); else the fp8 side is cast to the other's dtype (exact); others promote."""
    if is_fp8(key_dtype):
        return jnp.dtype(q_dtype)
    return jnp.dtype(key_dtype) if is_fp8(q_dtype) else jnp.promote_types(q_dtype, key_dtype)


def check_inputs(q, weights, index_keys, key_scales, layer, positions) -> None:
    """Static shape checks shared by the reference and the kernel."""
    check_rank("q", q, 3, "[b, G, I]")
    check_rank("weights", weights, 2, "[b, G]")
    check_rank("index_keys", index_keys, 4, "[J, R, C, I]")
    check_rank("key_scales", key_scales, 3, "[J, R, C or 0]")
    check_rank("positions", positions, 1, "[b]")
    b, G, I = q.shape
    J, R, C, _ = index_keys.shape
    check_equal("weights shape", tuple(weights.shape), "q's [b, G]", (b, G))
    check_equal("positions length", positions.shape[0], "q batch (b)", b)
    check_equal("index_keys head dim", index_keys.shape[3], "q head dim (I)", I)
    if b > R:
        raise ValueError(f"q batch (b = {b}) must be <= the cache's request slots (R = {R})")
    scale_len = C if is_fp8(index_keys.dtype) else 0  # fp8 keys: one scale per key; others: none
    check_equal("key_scales shape", tuple(key_scales.shape), f"[J, R, {'C' if scale_len else '0'}] of the keys", (J, R, scale_len))
    check_layer_index(layer, J)
