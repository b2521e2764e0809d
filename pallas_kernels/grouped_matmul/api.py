"""Grouped (ragged) matmul for MoE experts and the fp8 weights' dense matmul, behind one
`implementation=` switch.

    out = grouped_matmul(lhs, rhs, group_sizes)                                 # jax.lax.ragged_dot's semantics
    out = grouped_matmul(lhs, values, group_sizes, rhs_scale=s, transpose_rhs=True)  # block-FP8 experts
    y = fp8_matmul(x, values, scale)                                            # x @ dequantize(values, scale)^T

lhs [M, K] holds the token-expert assignments sorted by expert: group g owns group_sizes[g] rows
after those of the groups before it; out[m] = lhs[m] @ rhs[g] for its rows; rows past
sum(group_sizes) are 0. rhs [G, K, N] in the activations' dtype, or with transpose_rhs [G, N, K]
(the checkpoint's [out, in], in which block-FP8 weights stay); fp8 rhs are float8_e4m3fn with one
f32 scale per block (DeepSeek's `weight_scale_inv`: [G, N/bn_s, K/bk_s] transposed,
[G, K/bk_s, N/bn_s] otherwise). fp8_matmul's w is [N, K] (a linear layer's [out, in]).

implementation:
  "reference"  reference.py: jax.lax.ragged_dot / einsum over the weights dequantised to the
               activations' dtype (what an fp8 model computes with its weights dequantised at
               load); also what runs over a mesh, where XLA partitions it;
  "pallas"     pallas_triton.py, the weight-streaming kernel (compiled on a GPU, interpret mode
               elsewhere; `config=` a TritonConfig);
  "tokamax"    tokamax_mosaic.py, tokamax's Mosaic GPU kernels (GPU only; fp8 needs transpose_rhs);
  None         on a GPU: bf16 "pallas"; fp8 "pallas" (its dot in f16) up to ~8 rows per expert,
               "tokamax" above where tokamax imports (resolve_implementation); with
               fp8_activations "pallas" always; elsewhere "reference". A named implementation
               runs or raises; it never falls back.

fp8_activations=True (fp8 weights only; the checkpoints' quantization_config
"activation_scheme": "dynamic", as DeepSeek's inference code and SGLang run block-FP8 models):
the activations are quantised to e4m3 per row and 128-wide K block before the matmul (w8a8),
which then runs on fp8 tensor cores. Not the numbers of the weights dequantised at load (the
reference implementation's, and the default): e4m3 rounds each activation by up to ~3%. The
"reference" implementation quantises and dequantises the activations the same way first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.common import check_rank
from pallas_kernels.grouped_matmul import pallas_triton, tokamax_mosaic
from pallas_kernels.grouped_matmul.base import check_inputs, check_scale, is_fp8, scale_block
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference, matmul_reference

IMPLEMENTATIONS = ("reference", "pallas", "tokamax")


def resolve_implementation(implementation: str | None, fp8: bool, M: int = 0, G: int = 1, fp8_activations: bool = False) -> str:
    """The implementation that runs for `implementation` (None: the measured best) on M rows over
    G groups. On a GPU, bf16: the Pallas kernel (1.1-1.3x the floor from 1 to 256 tokens); fp8:
    the Pallas kernel with its dot in f16 while experts see few rows (<= ~8 on average:
    1.5-1.7x), tokamax's Mosaic kernel above (1.8-2.9x vs Pallas' 2.4-4.4x). H200, 2026-12-02,
    docs/PERFORMANCE.md. fp8_activations: the Pallas kernel's w8a8 (tokamax's fp8 kernel takes
    16-bit activations)."""
    if implementation is None:
        if not common.on_gpu():
            return "reference"
        return "tokamax" if fp8 and not fp8_activations and M > 8 * G and tokamax_mosaic.available() else "pallas"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None for the grouped matmul, got {implementation!r}")
    if implementation == "tokamax" and fp8 and fp8_activations:
        raise ValueError("fp8_activations (w8a8) has no 'tokamax' implementation: tokamax's fp8 kernel takes 16-bit activations")
    return implementation


def _check_fp8_activations(fp8_activations: bool, fp8: bool) -> None:
    if fp8_activations and not fp8:
        raise ValueError("fp8_activations needs fp8 weights (rhs float8_e4m3fn with rhs_scale)")


def _quantized_activations(lhs, block_k: int):
    """lhs [M, K] -> lhs rounded as the w8a8 kernel rounds it (e4m3 per row and block_k-wide K
    block, pallas_triton.quantize_rows) as f32 [M, K]: what "reference"
    multiplies for fp8_activations."""
    M, K = lhs.shape
    values, scale = pallas_triton.quantize_rows(lhs, block_k)  # f8[M, K], f32[M, K / block_k]
    return (values.astype(jnp.float32).reshape(M, -1, block_k) * scale[..., None]).reshape(M, K)


def _logical(x, transpose: bool):
    """x's [G, K, N] shape as a ShapeDtypeStruct (for the checks; no transposed copy)."""
    shape = (*x.shape[:-2], x.shape[-1], x.shape[-2]) if transpose else x.shape
    return jax.ShapeDtypeStruct(shape, x.dtype)


def _row_mask(M: int, group_sizes) -> jax.Array:
    return jnp.arange(M) < jnp.sum(group_sizes)  # bool[M]


def _triton_config(M, G, K, N, fp8, scale_block, config, fp8_activations=False):
    if config is not None:
        return config.replace(fp8_conversion="w8a8") if fp8_activations else config
    cfg = pallas_triton.w8a8_config(M, G, K, N) if fp8_activations else pallas_triton.default_config(M, G, K, N, fp8)
    if fp8 and scale_block[0] % cfg.block_k:  # one scale per K step: small test blocks
        cfg = cfg.replace(block_k=max(16, scale_block[0]), split_k=1)
    if fp8 and cfg.block_n > scale_block[1]:
        cfg = cfg.replace(block_n=max(16, scale_block[1]))
    return cfg


def grouped_matmul(
    lhs, rhs, group_sizes, *, rhs_scale=None, transpose_rhs: bool = False, implementation=None, preferred_element_type=None, config=None,
    fp8_activations: bool = False,
):  # fmt: skip
    """lhs [M, K], rhs [G, K, N] ([G, N, K] with transpose_rhs; fp8 with rhs_scale), group_sizes
    i32[G] -> [M, N] in preferred_element_type (default: lhs's dtype). fp8_activations: w8a8
    (module docstring)."""
    check_inputs(lhs, _logical(rhs, transpose_rhs), group_sizes, None if rhs_scale is None else _logical(rhs_scale, transpose_rhs))
    fp8 = is_fp8(rhs.dtype)
    _check_fp8_activations(fp8_activations, fp8)
    impl = resolve_implementation(implementation, fp8, lhs.shape[0], rhs.shape[0], fp8_activations)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    M, K = lhs.shape
    G, N = rhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2]
    block = (1, 1)
    if fp8:
        Kb, Nb = (rhs_scale.shape[2], rhs_scale.shape[1]) if transpose_rhs else rhs_scale.shape[1:]
        block = scale_block((K, N), (Kb, Nb))
    if impl == "reference":
        rhs_kn = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
        scale_kn = None if rhs_scale is None else (jnp.swapaxes(rhs_scale, 1, 2) if transpose_rhs else rhs_scale)
        if fp8_activations:  # in f32: the reference multiplies the rounded activations as they are
            out = grouped_matmul_reference(_quantized_activations(lhs, block[0]), rhs_kn, group_sizes, scale_kn)
            return out.astype(out_dtype)
        return grouped_matmul_reference(lhs, rhs_kn, group_sizes, scale_kn, preferred_element_type=out_dtype)
    if impl == "pallas":
        cfg = _triton_config(M, G, K, N, fp8, block, config, fp8_activations)
        return pallas_triton.grouped_matmul_triton(
            lhs, rhs, rhs_scale, group_sizes, out_dtype=out_dtype, config=cfg, interpret=common.interpret_mode(), transpose_rhs=transpose_rhs
        )  # fmt: skip
    if fp8:
        if not transpose_rhs:
            raise ValueError("the tokamax fp8 route reads [G, N, K] weights: pass them with transpose_rhs=True")
        out = tokamax_mosaic.ragged_dot_fp8(lhs, rhs, rhs_scale, group_sizes, config=config, out_dtype=out_dtype)
    else:
        rhs_kn = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
        out = tokamax_mosaic.ragged_dot_bf16(lhs, rhs_kn, group_sizes, config=config, out_dtype=out_dtype)
    return jnp.where(_row_mask(M, group_sizes)[:, None], out, 0).astype(out_dtype)


def fp8_matmul(x, w, w_scale, *, implementation=None, config=None, fp8_activations: bool = False):
    """x [M, K], w f8[N, K] (a linear layer's [out, in]), w_scale f32[N/bn_s, K/bk_s] -> [M, N] in
    x's dtype. "pallas": the grouped kernel with one group; "tokamax" is not offered here (its
    fp8 kernel is a ragged dot: one group is the same call, measured slower than "pallas").
    fp8_activations: w8a8 (module docstring)."""
    check_rank("x", x, 2, "[M, K]")
    check_rank("w", w, 2, "[N, K]")
    check_scale(w, w_scale)
    impl = resolve_implementation(implementation, fp8=False)
    if impl == "reference":
        if fp8_activations:
            block_k = scale_block(w.T.shape, w_scale.T.shape)[0]
            return matmul_reference(_quantized_activations(x, block_k), w.T, w_scale.T).astype(x.dtype)
        return matmul_reference(x, w.T, w_scale.T)
    if impl == "tokamax":
        raise ValueError("fp8_matmul has no 'tokamax' implementation; use 'pallas' or 'reference'")
    sizes = jnp.full((1,), x.shape[0], jnp.int32)
    return grouped_matmul(
        x, w[None], sizes, rhs_scale=w_scale[None], transpose_rhs=True, implementation="pallas", config=config,
        fp8_activations=fp8_activations,
    )  # fmt: skip
