"""grouped_matmul through tokamax 0.0.17's Mosaic GPU ragged-dot kernels (sm90), imported when
called: the package runs without tokamax (it is in the `gpu` extra).

  bf16:  `implementation="mosaic"` with its heuristic config (block_m 64, block_n 64, block_k
         128, 2 stages on sm90; tokamax 0.0.17 has no H200 autotuning cache) or an explicit
         MosaicConfig (block_m a multiple of 64: 16 and 32 fail to lower).
  fp8:   its quantized kernel (weights dequantised in registers) takes a qwix QArray whose scale
         is per output column, tiled along K: [G, K/bk_s, N]. The block scales are repeated
         along N to that shape per call (1.5% of the weights' bytes at 128 x 128 blocks). It
         reads the weights as `qvalue.mT`, i.e. physical [G, N, K]: the checkpoint's own layout,
         in which the fp8 experts stay, so the QArray's qvalue is their transposed view, which
         the kernel's .mT cancels. Activations and scales are f16, not bf16: the sm90 kernel
         converts e4m3 to the scale dtype, and Mosaic GPU refuses e4m3 -> bf16 with the H200's
         ptxas (CUDA 13.0.88); e4m3 -> f16 works.
Rows past sum(group_sizes) are not written by tokamax: api.grouped_matmul masks them.

Measured on the H200 (2026-12-02, docs/PERFORMANCE.md, "MoE grouped GEMM"): fp8 1.6-2.8x the
fp8 HBM floor (the best fp8 route there), bf16 1.2-2.1x (pallas_triton.py's kernel is faster).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.base import block_edge


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """The knobs of tokamax's Mosaic GPU ragged-dot Config that matter on sm90."""

    block_m: int = 64  # token rows per tile: bf16 a multiple of 64; fp8 (swap-AB) a multiple of 8
    block_n: int = 64  # must equal the output swizzle width: 64 for bf16/f16 output
    block_k: int = 128
    num_stages: int = 2
    persistent: bool | None = None  # None: tokamax's default (True for a quantized rhs)

    def to_tokamax(self, quantized: bool):
        from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as common

        persistent = quantized if self.persistent is None else self.persistent
        return common.Config(
            block_m=self.block_m, block_n=self.block_n, block_k=self.block_k, num_stages=self.num_stages, split_k=1,
            persistent=persistent, grid_minor_dim=common.MatmulDimension.M, grid_tile_width=1,
        )  # fmt: skip


def available() -> bool:
    """Whether tokamax (and qwix) import here."""
    try:
        import qwix  # noqa: F401
        import tokamax  # noqa: F401
    except ImportError:
        return False
    return True


def _op(config: MosaicConfig | None, quantized: bool):
    """tokamax's PallasMosaicGpuRaggedDot op, pinned (its lowering errors do not fall back)."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu

    op = pallas_mosaic_gpu.PallasMosaicGpuRaggedDot()
    return op if config is None else op.replace(config=config.to_tokamax(quantized))


# Both entries are jitted so that a model's N identical call sites (one per layer) trace and lower
# the Mosaic kernel once: lowered per call site, a 61-layer DeepSeek-V3.2 rank spent ~5 s a layer
# lowering and compiling identical kernels (H200, benchmarks/probes/compile_profile.sh, 2026-12-03).
@functools.partial(jax.jit, static_argnames=("config", "out_dtype"))
def ragged_dot_bf16(lhs, rhs, group_sizes, *, config: MosaicConfig | None = None, out_dtype=jnp.bfloat16):
    """lhs bf16[M, K], rhs bf16[G, K, N], group_sizes i32[G] -> out_dtype[M, N] (rows past the groups unwritten)."""
    import tokamax

    out = tokamax.ragged_dot(lhs, rhs, group_sizes, implementation=[_op(config, quantized=False)], bypass_device_check=True)
    return out.astype(out_dtype)


def column_scales(scales_nk: jax.Array, N: int, K: int, dtype=jnp.float16) -> jax.Array:
    """Block scales f32[G, N/bn_s, K/bk_s] (transposed storage) -> dtype[G, K/bk_s, N]: each
    column's scale per K block (the quantized kernel's (1, bk_s, 1) scale tile)."""
    bn_s = block_edge(N, scales_nk.shape[1])
    per_column = jnp.repeat(scales_nk, bn_s, axis=1)[:, :N]  # f32[G, N, Kb]
    return jnp.swapaxes(per_column, 1, 2).astype(dtype)


@functools.partial(jax.jit, static_argnames=("config", "out_dtype"))
def ragged_dot_fp8(lhs, values_nk, scales_nk, group_sizes, *, config: MosaicConfig | None = None, out_dtype=jnp.bfloat16):
    """lhs [M, K], values_nk f8e4m3fn[G, N, K], scales_nk f32[G, N/bn_s, K/bk_s], group_sizes i32[G]
    -> out_dtype[M, N] through the sm90 quantized kernel (f16 activations and scales). Called
    inside the caller's jit, XLA inlines it, so the transposed view of values_nk costs no copy."""
    import qwix
    import tokamax

    G, N, K = values_nk.shape
    q = qwix.QArray(qvalue=jnp.swapaxes(values_nk, 1, 2), scale=column_scales(scales_nk, N, K))
    out = tokamax.ragged_dot(lhs.astype(jnp.float16), q, group_sizes, implementation=[_op(config, quantized=True)], bypass_device_check=True)
    return out.astype(out_dtype)
