"""The grouped matmul's input checks and block-scale helpers, shared by its implementations.

Letters: M rows (token-expert assignments sorted by group), K contraction, N columns, G groups
(experts), b0 x b1 a scale block (over K x N).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import check_equal, check_rank

FP8 = jnp.float8_e4m3fn


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) == np.dtype(FP8)


PUBLISHED_BLOCK = 128  # DeepSeek / GLM FP8 checkpoints' weight_block_size edge


def block_edge(dim: int, blocks: int) -> int:
    """The block edge that cuts `dim` into `blocks` blocks, the last one possibly partial. A partial
    last block makes the edge ambiguous from the counts alone (576 rows in 5 blocks: any edge in
    116..143): the published 128 when it fits, else the smallest that does."""
    if -(-dim // PUBLISHED_BLOCK) == blocks:
        return PUBLISHED_BLOCK
    return -(-dim // blocks)


def scale_block(shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int] | None = None) -> tuple[int, int]:
    """The block over the last two dims of a weight of `shape` whose scales have `scale_shape`:
    `block` when given (checked against the counts), else as block_edge infers it."""
    if block is None:
        return block_edge(shape[-2], scale_shape[-2]), block_edge(shape[-1], scale_shape[-1])
    if (-(-shape[-2] // block[0]), -(-shape[-1] // block[1])) != tuple(scale_shape[-2:]):
        raise ValueError(f"scales {tuple(scale_shape)} are not the {block} blocks of a weight {tuple(shape)}")
    return tuple(block)


def expand_scale(scale: jax.Array, shape: tuple[int, ...], block: tuple[int, int] | None = None) -> jax.Array:
    """f32[..., K/b0, N/b1] -> f32[..., K, N]: each element's block scale."""
    b0, b1 = scale_block(shape, scale.shape, block)
    full = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), b0, axis=-2), b1, axis=-1)
    return full[..., : shape[-2], : shape[-1]]


def dequantize(values: jax.Array, scale: jax.Array, dtype, block: tuple[int, int] | None = None) -> jax.Array:
    """f8[..., K, N] with f32[..., K/b0, N/b1] -> [..., K, N] in dtype (each block times its scale in f32)."""
    return (values.astype(jnp.float32) * expand_scale(scale, values.shape, block)).astype(dtype)


def check_inputs(lhs, rhs, group_sizes, rhs_scale) -> None:
    """Static checks of grouped_matmul's operands."""
    check_rank("lhs", lhs, 2, "[M, K]")
    check_rank("rhs", rhs, 3, "[G, K, N]")
    check_rank("group_sizes", group_sizes, 1, "[G]")
    check_equal("lhs K", lhs.shape[1], "rhs K", rhs.shape[1])
    check_equal("group_sizes G", group_sizes.shape[0], "rhs G", rhs.shape[0])
    check_scale(rhs, rhs_scale)


def check_scale(rhs, rhs_scale) -> None:
    if is_fp8(rhs.dtype) != (rhs_scale is not None):
        raise ValueError(f"an fp8 rhs needs rhs_scale and only an fp8 rhs takes one (rhs {rhs.dtype}, rhs_scale {rhs_scale is not None})")
    if rhs_scale is not None:
        check_rank("rhs_scale", rhs_scale, rhs.ndim, "[..., K/b0, N/b1]")
        check_equal("rhs_scale leading dims", rhs_scale.shape[:-2], "rhs leading dims", rhs.shape[:-2])
        scale_block(rhs.shape, rhs_scale.shape)  # a count no block edge gives: ValueError
