"""TPU sparse MLA decode attention (implementation="tpu"): DMA gather into VMEM, online softmax.

The same formula, signature and result as pallas_kernels.sparse_mla_attention (within the f32
tolerance of the reference; the softmax runs in f32, the two matmuls in the row dtype, f32 at
HIGHEST precision for f32 rows).

How it differs from the GPU kernel: a Triton program loads the selected rows with a vector
gather straight from global memory; a TPU core cannot gather rows from HBM with vector loads.
Here each program (request r, block of `block_h` heads) walks the K selected entries in blocks
of `block_k`: the slots are scalar-prefetched into SMEM, every selected row of the block is
fetched by its own DMA (`pltpu.make_async_copy(kv.at[layer, r, pl.ds(slot, 1)], ...)`) into a
[block_k, W] VMEM tile, all of a block's DMAs on one semaphore, double-buffered (block b + 1 is
in flight while block b is in the MXU). Masked entries (slot -1, or the padding of K up to a
multiple of block_k) get a zero row in the tile, so no unread row is ever multiplied. Then
scores = q [block_h, W] . keys^T [W, block_k] and acc += p [block_h, block_k] . keys[:, :D] on the
MXU: with block_h = 64 heads and block_k = 128 keys both matmuls are MXU-shaped (multiples of
the 128 x 128 systolic array in the key / value dimensions, 8-row sublane tiles in the heads).

The 576-wide row (512 latent + 64 rope) is 4.5 x 128 lanes: the VMEM tile pads it to 640 lanes
(11% more VMEM per tile and per DMA destination row), and the value slice keys[:, :512] ends on
a lane-tile boundary, so it needs no relayout. The row is moved whole by each DMA.

fp8 rows (packed uint32 words, hisparse_jax.row_layout) are DMA'd as packed words (164 per row
for 512 + 64: 656 B, 1.28 lane tiles) and dequantised in VMEM per key block with the layout's
own unpacking (bytes back in latent order, times the group's f32 scale; the rope's bf16
halves); the matmuls then run in the query's dtype (bf16, or f32 at full precision for an f32
query), as the GPU kernel's do. Verified in interpret mode only (docs/tpu.md).

Shape letters as in pallas_kernels.sparse_mla_attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common

_MASKED = -float("inf")
_RUNNING_MAX_START = -1e30  # finite, so a fully masked block gives exp(-inf) = 0, not NaN
DEFAULT_BLOCK_H = 64
DEFAULT_BLOCK_K = 128


def _attention_kernel(
    layer_ref,  # SMEM i32[1]
    slots_smem,  # SMEM i32[R, Kp]: Kp = K padded with -1 to a multiple of block_k
    query_ref,  # VMEM [block_h, W] of request r
    slots_vmem,  # VMEM i32[1, Kp] of request r (the same slots, as a vector for the mask)
    kv_ref,  # ANY row[L, R, S, W] (HBM)
    out_ref,  # VMEM f32[block_h, D]
    tiles,  # VMEM row[2, block_k, W]: double-buffered gathered rows
    sems,  # DMA semaphores [2]: one per tile
    *,
    latent_dim: int,
    sm_scale: float,
    block_k: int,
    layout,
    compute_dtype,
):
    r = pl.program_id(0)
    layer = layer_ref[0]
    Kp, W = slots_smem.shape[1], tiles.shape[2]
    num_blocks = Kp // block_k
    dtype = compute_dtype  # the matmuls' dtype: the rows' for plain rows; bf16 / f32 for fp8 rows
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None

    def keys_of(words):
        """The tile's rows as attention keys [block_k, D + rope] in `dtype`: plain rows as they
        are; packed fp8 rows dequantised (layout.unpack: bytes in latent order times their
        group's scale, the rope's bf16 halves). A zeroed (masked) row gives zeros."""
        if layout is None or not layout.quantized:
            return words
        latent, rope = layout.unpack(words)
        return jnp.concatenate([latent, rope], axis=1).astype(dtype)

    def row_copy(block, j, tile):
        slot = slots_smem[r, block * block_k + j]
        return slot, pltpu.make_async_copy(
            kv_ref.at[layer, r, pl.ds(jnp.maximum(slot, 0), 1)], tiles.at[tile, pl.ds(j, 1)], sems.at[tile]
        )

    def fetch(block, tile):
        def one(j, _):
            slot, copy = row_copy(block, j, tile)

            @pl.when(slot >= 0)
            def _():
                copy.start()

            @pl.when(slot < 0)
            def _():
                tiles[tile, pl.ds(j, 1), :] = jnp.zeros((1, W), tiles.dtype)

            return 0

        jax.lax.fori_loop(0, block_k, one, 0)

    def wait(block, tile):
        def one(j, _):
            slot, copy = row_copy(block, j, tile)

            @pl.when(slot >= 0)
            def _():
                copy.wait()

            return 0

        jax.lax.fori_loop(0, block_k, one, 0)

    query = query_ref[...].astype(dtype)  # [block_h, W]
    block_h = query.shape[0]
    fetch(0, 0)

    def body(block, carry):
        running_max, total, acc = carry
        tile = block % 2

        @pl.when(block + 1 < num_blocks)
        def _():
            fetch(block + 1, 1 - tile)

        wait(block, tile)
        keys = keys_of(tiles[tile])  # [block_k, D + rope]
        start = pl.multiple_of(block * block_k, block_k)
        valid = slots_vmem[:, pl.ds(start, block_k)] >= 0  # [1, block_k]
        scores = jax.lax.dot_general(
            query, keys, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        ) * sm_scale  # f32[block_h, block_k]
        scores = jnp.where(valid, scores, _MASKED)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1, keepdims=True))  # [block_h, 1]
        rescale = jnp.exp(running_max - new_max)
        weights = jnp.exp(scores - new_max)
        total = total * rescale + jnp.sum(weights, axis=1, keepdims=True)
        acc = acc * rescale + jax.lax.dot(
            weights.astype(dtype), keys[:, :latent_dim], precision=precision, preferred_element_type=jnp.float32
        )
        return new_max, total, acc

    init = (
        jnp.full((block_h, 1), _RUNNING_MAX_START, jnp.float32),
        jnp.zeros((block_h, 1), jnp.float32),
        jnp.zeros((block_h, latent_dim), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out_ref[...] = acc * jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)


def _block_h(H: int, block_h: int | None) -> int:
    """Heads per program: a multiple of 8 dividing H, or H itself (Mosaic's block rule)."""
    block_h = block_h or DEFAULT_BLOCK_H
    if block_h >= H or H % block_h or block_h % 8:
        return H
    return block_h


def sparse_mla_attention_tpu(query, kv, layer, slots, *, latent_dim, sm_scale, layout=None, block_h=None, block_k=None):
    """The TPU kernel: shapes as sparse_mla_attention (checked by its caller). One program per
    (request, head block); block_h defaults to 64 heads (H if 64 does not divide H), block_k to
    128 entries (K rounded up to a multiple of 8 if smaller). fp8 rows (layout) are dequantised
    in the kernel; the matmuls run in the query's dtype then (bf16, or f32)."""
    R, H, W = query.shape
    K = slots.shape[1]
    block_h = _block_h(H, block_h)
    block_k = block_k or min(DEFAULT_BLOCK_K, -(-K // 8) * 8)
    Kp = pl.cdiv(K, block_k) * block_k
    slots = jnp.pad(slots.astype(jnp.int32), ((0, 0), (0, Kp - K)), constant_values=-1)
    quantized = layout is not None and layout.quantized
    if quantized:
        compute_dtype = jnp.float32 if jnp.dtype(query.dtype) == jnp.float32 else jnp.bfloat16
    else:
        compute_dtype = kv.dtype
    kernel = functools.partial(
        _attention_kernel, latent_dim=latent_dim, sm_scale=float(sm_scale), block_k=block_k, layout=layout,
        compute_dtype=compute_dtype,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((R, H, latent_dim), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(R, H // block_h),
            in_specs=[
                pl.BlockSpec((None, block_h, W), lambda r, h, layer, slots: (r, h, 0)),
                pl.BlockSpec((None, 1, Kp), lambda r, h, layer, slots: (r, 0, 0)),
                common.any_spec(),
            ],
            out_specs=pl.BlockSpec((None, block_h, latent_dim), lambda r, h, layer, slots: (r, h, 0)),
            scratch_shapes=[pltpu.VMEM((2, block_k, kv.shape[3]), kv.dtype), pltpu.SemaphoreType.DMA((2,))],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=common.tpu_interpret(),
        name="hisparse_sparse_mla_attention_tpu",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), slots, query, slots.reshape(R, 1, Kp), kv)
