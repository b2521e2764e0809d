"""Grouped GEMM for MoE decode as a Pallas kernel (Triton lowering): weight streaming, bf16 or
fp8 (w8a16) weights.

    out[m] = lhs[m] @ rhs[g]   for the rows m of group g (rows sorted by group, as ragged_dot)

Decode has few rows per expert (1-64, sometimes ~128), so the GEMM is bound by reading the
weights of the experts that were hit; this kernel is built to stream each touched expert's
weights exactly once at full HBM rate:
  * grid (N / block_n, G, split_k): one program per (column tile, group, K slice). A program
    whose group is empty returns before reading anything, so the bytes read are those of the
    touched experts only (the HBM floor counts the same bytes).
  * the program loops over K in block_k steps: the weight tile [block_k, block_n] is the long
    pole; the lhs rows [block_m, block_k] are small and mostly L2 hits. The K loop is a static
    fori_loop whose loads feed the dot, which Triton software-pipelines over `num_stages`.
  * a group's rows are covered in passes of block_m * m_subtiles rows: every weight tile loaded
    is used by up to m_subtiles dots of block_m rows, each skipped (lax.cond) when the group has
    no rows left for it. Only a group with more than block_m * m_subtiles rows re-reads its
    weights (one more pass).
  * split_k > 1 (few touched groups, small N: too few programs to fill 132 SMs) writes f32
    partial sums [split_k, M, N] that the wrapper adds (one small XLA fusion).
  * rows past sum(group_sizes) are zero in the output: the last group's programs write them
    (split_k == 1), or the wrapper's reduction masks them (split_k > 1).
  * swap_ab computes the transposed product (weights on the MMA's M side, rows on its N side),
    the "swap-AB" that SGLang / tokamax use for small row counts on Hopper.

transpose_rhs: the weights are [G, N, K] (scales [G, N/bn_s, K/bk_s]): the checkpoint's own
[out, in] layout, in which the block-FP8 weights stay (models.common.fp8); each weight tile is
then [block_n, block_k] and the dot contracts both operands' last dims (Triton's transposed B).

fp8 weights (float8_e4m3fn values, f32 scale per bk_s x bn_s block, 128 x 128 as published) are multiplied as w8a16: the
fp8 tile is converted to bf16 in registers (exact: e4m3 values fit bf16), the dot runs in bf16
with f32 accumulation, and the partial product of each K step (block_k <= 128, inside one scale
block) is multiplied by the block's scale per column before it is added ("post-scale": one
multiply per output element per K step instead of one per weight). Three conversions, chosen
by `fp8_conversion` because what the Triton in jaxlib accepts on sm90 is not yet measured here:
  "native":  tt.fp_to_fp f8E4M3FN -> bf16;
  "via_f16": f8E4M3FN -> f16 (the cvt sm89+ has) -> bf16;
  "bits":    the weights are read as uint8 and widened with integer ops: the e4m3 sign, exponent
             and mantissa bits placed into an f16 (exact, denormals included; the f16 value is
             the e4m3 value / 256, folded into the scale). Needs no fp8 support at all.
  "f16":     f8E4M3FN -> f16 (one cvt per pair on sm89+) and the dot in f16 (activations cast to
             f16 per tile: their range holds decode activations, 11 mantissa bits to bf16's 8),
             skipping the f16 -> bf16 step, which sm90 has no instruction for; tokamax's fp8
             kernel takes the same route.
  "w8a8":    no conversion at all: the activations are quantised to fp8 first (per row and
             K scale block, absmax / 448: DeepSeek's own inference code's act_quant, SGLang's
             per-token-group quantisation), the dot runs on fp8 x fp8 (on Hopper's fp8 tensor
             cores, each K step accumulated there, pallas_kernels.common.FP8_TENSOR_CORE_DOTS;
             through f16 mma.sync before 2026-12-04), and each K step's partial product is
             multiplied by the rows' and the columns' scales in f32. Not the w8a16 numbers: the
             released models' own arithmetic.

Shape letters: M rows of lhs, K contraction, N output columns, G groups, S split_k,
Kb = K / bk_s and Nb = N / bn_s scale blocks (bk_s x bn_s the scale block, 128 x 128 as published).

Measured on the H200 (2026-12-02, docs/PERFORMANCE.md, "MoE grouped GEMM"): bf16 weights at
1.05-1.21x the HBM floor from 1 to 256 tokens for one EP8 rank's experts (32 x 7168 x 4096
gate+up, 32 x 2048 x 7168 down), where jax.lax.ragged_dot took 1.3-5.7x and tokamax's Mosaic
kernel 1.2-2.1x; fp8 weights 2.1-5x (the e4m3 -> bf16 conversion), behind tokamax's 1.6-2.8x.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.grouped_matmul.base import scale_block

FP8_CONVERSIONS = ("native", "via_f16", "bits", "f16", "w8a8")
# The conversion default_config picks (benchmarks/bench_step.py sets it to compare them).
DEFAULT_FP8_CONVERSION = "f16"  # H200: 1.46-1.73x the fp8 floor up to 24 tokens vs "native"'s 1.75-2.12x
_BITS_SCALE = 256.0  # "bits": the f16 built from e4m3 bits is the value / 2**8


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Static tuning knobs of the kernel (powers of two except num_stages and split_k)."""

    block_m: int = 16  # rows of one dot (>= 16: Triton dots)
    block_n: int = 128  # output columns per program
    block_k: int = 128  # contraction step; fp8: divides the scale block's K edge (one scale per step)
    m_subtiles: int = 1  # dots of block_m rows sharing each loaded weight tile
    split_k: int = 1  # programs per (group, column tile), each a K slice; > 1: f32 partials
    num_warps: int = 4
    num_stages: int = 4  # Triton software-pipelining depth of the K loop
    swap_ab: bool = False  # dot(w^T, x^T): weights on the MMA's M side
    fp8_conversion: str = "via_f16"  # one of FP8_CONVERSIONS (default_config: DEFAULT_FP8_CONVERSION)
    evict_first: bool = True  # weight loads marked evict_first (streamed once; keep L2 for lhs)
    n_fastest: bool = True  # grid (N/bn, G, S): programs launched together share a group, so
    #   they stream whole rows of one expert's [K, N] (DRAM pages) instead of 256-byte pieces of
    #   many experts (False: grid (G, N/bn, S)). Unmeasured guess; the benchmark sweeps both.

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "m_subtiles", "num_warps"):
            value = getattr(self, name)
            if not _is_pow2(value):
                raise ValueError(f"{name} ({value}) must be a power of two")
        if self.split_k < 1:
            raise ValueError(f"{self.split_k=} must be >= 1 (K must be a multiple of block_k * split_k)")
        for name in ("block_m", "block_n", "block_k"):
            if getattr(self, name) < 16:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 16 (Triton dot)")
        if self.num_stages < 1:
            raise ValueError(f"{self.num_stages=} must be >= 1")
        if self.fp8_conversion not in FP8_CONVERSIONS:
            raise ValueError(f"{self.fp8_conversion=} must be one of {FP8_CONVERSIONS}")

    def replace(self, **changes) -> "TritonConfig":
        return dataclasses.replace(self, **changes)

    @property
    def rows_per_pass(self) -> int:
        return self.block_m * self.m_subtiles


def default_config(M: int, G: int, K: int, N: int, fp8: bool, num_sms: int = 132) -> TritonConfig:
    """A decode-oriented guess, to be replaced by what bench_grouped_matmul_gpu.py measures.

    Rows per touched group ~ M / min(G, M); one pass holds ~1.5x that (a power of two, 16..256)
    as m_subtiles dots of block_m rows (2 dots from 32 rows on, so a group with fewer rows skips
    one). 4 warps up to 32 rows, 8 above: with 4 warps, 64+ rows of accumulators next to the
    converted weight tile spilled registers (tools/compile_check.py: pip triton 3.6 + ptxas 13.0
    for sm_90a, 2026-12-02). split_k, a divisor of K / block_k keeping >= 4 K steps per program,
    when the touched groups x column tiles would not give two programs per SM, as long as the f32
    partials (8 bytes per output and slice, written and read) stay under twice the weight bytes.
    """
    touched = max(1, min(G, M))
    mean_rows = max(1, M // touched)
    target = min(256, max(16, _next_pow2(-(-3 * mean_rows // 2))))
    if target >= 256:  # dense M >= ~171: one 256-row dot on narrower column tiles (smem)
        block_m, m_subtiles, block_n = 256, 1, 64
    else:
        block_m = 16 if target <= 32 else target // 2
        m_subtiles = target // block_m
        block_n = 128
    while N % block_n:
        block_n //= 2
    block_k = 128
    while K % block_k:
        block_k //= 2
    num_warps = 4 if target <= 32 else 8
    num_stages = 4 if target <= 128 else 3
    if target >= 128 and block_m < 256 and K % 64 == 0:  # 128 rows a pass: shallower K steps, deeper pipeline
        block_k, num_stages = 64, 6  # H200: 439 us at 256 tokens (1.12x); 128 x 4 stages overflowed shared memory
    x_bytes, w_bytes = 2, 1 if fp8 else 2
    while num_stages > 2 and num_stages * (target * block_k * x_bytes + block_k * block_n * w_bytes) > 200 * 1024:
        num_stages -= 1  # the pipeline's buffers must fit the SM's 227 KB of shared memory
    programs = touched * (N // block_n)
    k_blocks = K // block_k
    max_split = max(1, K * (1 if fp8 else 2) // (4 * M))
    split_k = 1
    for s in range(2, k_blocks + 1):
        if programs * split_k >= 2 * num_sms or k_blocks // s < 4 or s > max_split:
            break
        if k_blocks % s == 0:
            split_k = s
    return TritonConfig(
        fp8_conversion=DEFAULT_FP8_CONVERSION,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        m_subtiles=m_subtiles,
        split_k=split_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def w8a8_config(M: int, G: int, K: int, N: int, num_sms: int = 132) -> TritonConfig:
    """The w8a8 kernel's config by rows per touched expert, as measured on the H200 (2026-12-03,
    DeepSeek-V3.2's EP8 rank as the model runs it, gate / up / down; docs/PERFORMANCE.md, "w8a8
    tilings"): up to 16 rows default_config's (1.29x the fp8 floor at 2 rows, 1.36x at 16);
    up to 24 swap-AB with 32-row tiles (1.62x at 22 rows, default 1.92x); above, one 64-row
    dot per weight tile (2.23x at 32 rows, default 2.64x; 4.49x at 64, default 5.94x). Larger
    tiles (128 rows, 8 warps) were slower at every size."""
    cfg = default_config(M, G, K, N, fp8=True, num_sms=num_sms).replace(fp8_conversion="w8a8")
    mean_rows = max(1, M // max(1, min(G, M)))
    if mean_rows <= 16:
        return cfg
    tile = dict(block_m=32, swap_ab=True) if mean_rows <= 24 else dict(block_m=64)
    return cfg.replace(m_subtiles=1, num_warps=4, num_stages=4, **tile)  # default_config's block_k and split_k, as timed


def sweep_configs(M: int, G: int, K: int, N: int, fp8: bool, conversion: str = "native") -> list[TritonConfig]:
    """The default and three alternatives (what the GPU benchmark compares; compile_check.py
    checks them for spills). bf16: swap-AB (wgmma with the weights on the M side, 70-120
    registers without spills); fp8: swap-AB loads its weights straight to registers (no cp.async
    pipelining) and spilled, so instead shallower K steps (block_k 64, 6 stages). Second
    alternative: narrower column tiles (more programs) for small row counts, else another depth.
    Third: the other grid order (groups fastest)."""
    base = default_config(M, G, K, N, fp8)
    if fp8:
        base = base.replace(fp8_conversion=conversion)
    out = [base]
    if fp8:
        if K % (64 * base.split_k) == 0:
            out.append(base.replace(block_k=64, num_stages=6))
    else:
        out.append(base.replace(swap_ab=True))
    if base.rows_per_pass <= 32 and N % 64 == 0 and base.block_n > 64:
        bk = 128 if fp8 else 256
        out.append(base.replace(block_n=64, block_k=bk if K % (bk * base.split_k) == 0 else base.block_k, num_stages=3 if bk == 256 else 4))
    elif not fp8 and K % (64 * base.split_k) == 0:
        out.append(base.replace(block_k=64, num_stages=6))
    elif fp8 and base.num_stages > 3:
        out.append(base.replace(num_stages=3))
    out.append(base.replace(n_fastest=False))
    return out


# --------------------------------------------------------------------------------------------
# Block addressing: rows as an index vector; columns a contiguous slice on the GPU (vectorised
# loads), an index vector in the interpreter (which cannot mix slices with index arrays). A
# masked-off row's index is one past the end: the GPU never dereferences it and the
# interpreter's XLA scatter drops it (its gather clamps it, and the mask replaces the value).
# --------------------------------------------------------------------------------------------


def _rows(first, count, block: int, limit: int):
    """Rows first .. first + block - 1, of which the first `count` are real -> (safe rows
    i32[block], ok bool[block]); rows not ok index `limit` (one past the end)."""
    offsets = jnp.arange(block, dtype=jnp.int32)
    ok = offsets < count
    return jnp.where(ok, first + offsets, limit), ok


def _row_block(leading: tuple, rows, col0, size: int, interpret: bool) -> tuple:
    if interpret:
        cols = col0 + jnp.arange(size, dtype=jnp.int32)
        return (*leading, rows[:, None], cols[None, :])
    return (*leading, rows, pl.ds(col0, size))


def _fp8_tile_to_bf16(w, conversion: str):
    """A weight tile f8e4m3fn[bk, bn] (uint8 for "bits") -> bf16[bk, bn] (/ 256 for "bits"; f16 for
    "f16"; kept fp8 for "w8a8")."""
    if conversion == "w8a8":
        return w
    if conversion == "f16":
        return w.astype(jnp.float16)
    if conversion == "native":
        return w.astype(jnp.bfloat16)
    if conversion == "via_f16":
        return w.astype(jnp.float16).astype(jnp.bfloat16)
    u = w.astype(jnp.uint16)  # zero-extended e4m3 bits: s eeee mmm
    sign = jnp.left_shift(jnp.bitwise_and(u, jnp.uint16(0x80)), jnp.uint16(8))
    magnitude = jnp.left_shift(jnp.bitwise_and(u, jnp.uint16(0x7F)), jnp.uint16(7))
    # f16 bits s 0eeee mmm0000000: exponent bias 15 vs e4m3's 7, so the f16 is the value / 2**8;
    # e4m3 denormals (eeee = 0) land on f16 denormals with the same factor. NaN (0x7F) is not kept.
    return jax.lax.bitcast_convert_type(jnp.bitwise_or(sign, magnitude), jnp.float16).astype(jnp.bfloat16)


def _kernel(
    sizes_ref,  # i32[G]
    x_ref,  # [M, K] (bf16; other float dtypes are cast to bf16 per tile)
    w_ref,  # bf16[G, K, N], f8e4m3fn[G, K, N], or uint8[G, K, N] ("bits")
    s_ref,  # f32[G, Kb, Nb] (or [G, Nb, Kb] transposed; fp8; x 256 for "bits"), f32[1] unused otherwise
    init_ref,  # the output's initial contents when aliased (tests), else unused f32[1]
    xs_ref,  # f32[M, Kb]: the activations' scales ("w8a8": x_ref is then f8e4m3fn), else unused f32[1]
    o_ref,  # out[M, N] (split_k == 1) or f32[S, M, N] partial sums
    *,
    cfg: TritonConfig,
    fp8: bool,
    k_steps: int,
    interpret: bool,
    transpose_rhs: bool,
    scale_block: tuple[int, int],  # (bk_s, bn_s): the fp8 scale block over (K, N)
):
    del init_ref  # aliased to o_ref when given; the kernel only writes o_ref
    G = sizes_ref.shape[0]
    M = x_ref.shape[0]
    bm, bn, bk, NM = cfg.block_m, cfg.block_n, cfg.block_k, cfg.m_subtiles
    R = cfg.rows_per_pass
    if cfg.n_fastest:
        n_tile, g = pl.program_id(0), pl.program_id(1)
    else:
        g, n_tile = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2)
    partials = cfg.split_k > 1

    Gp = _next_pow2(G)
    gi = jnp.arange(Gp, dtype=jnp.int32)
    sizes = plgpu.load(sizes_ref.at[jnp.where(gi < G, gi, G)], mask=gi < G, other=0)  # i32[Gp]
    size = jnp.sum(jnp.where(gi == g, sizes, 0))  # rows of this group
    start = jnp.sum(jnp.where(gi < g, sizes, 0))  # its first row
    total = jnp.sum(sizes)  # rows in some group
    n0 = pl.multiple_of(n_tile * bn, bn)
    k_first = split * (k_steps * bk)
    out_lead = (split,) if partials else ()

    bk_s, bn_s = scale_block
    w8a8 = fp8 and cfg.fp8_conversion == "w8a8"
    dot_dtype = {"f16": jnp.float16, "w8a8": jnp.float8_e4m3fn}.get(cfg.fp8_conversion, jnp.bfloat16) if fp8 else jnp.bfloat16

    def load_scale(k0):  # f32[] (block_n <= bn_s) or f32[bn]: the scale of each column here
        kb = k0 // bk_s
        if bn <= bn_s:
            return s_ref[g, n0 // bn_s, kb] if transpose_rhs else s_ref[g, kb, n0 // bn_s]
        cols = (n0 + jnp.arange(bn, dtype=jnp.int32)) // bn_s
        return plgpu.load(s_ref.at[g, cols, kb] if transpose_rhs else s_ref.at[g, kb, cols])

    def one_pass(p, carry):  # rows start + p*R .. + R - 1 of this group, all of K's slice
        row0 = start + p * R
        left = size - p * R  # rows of the group from row0 on

        def k_step(kk, accs):
            k0 = pl.multiple_of(k_first + kk * bk, bk)
            w_block = w_ref.at[g, pl.ds(n0, bn), pl.ds(k0, bk)] if transpose_rhs else w_ref.at[g, pl.ds(k0, bk), pl.ds(n0, bn)]
            w = plgpu.load(w_block, eviction_policy="evict_first") if cfg.evict_first and not interpret else w_block[...]
            w = _fp8_tile_to_bf16(w, cfg.fp8_conversion) if fp8 else w.astype(jnp.bfloat16)  # bf16[bk, bn] ([bn, bk] transposed)
            w_contract = 1 if transpose_rhs else 0  # w's K axis
            scale = load_scale(k0) if fp8 else None
            new = []
            for j, acc in enumerate(accs):

                def sub(acc, j=j):
                    rows, ok = _rows(row0 + j * bm, left - j * bm, bm, M)
                    x = plgpu.load(
                        x_ref.at[_row_block((), rows, k0, bk, interpret)],
                        mask=jnp.broadcast_to(ok[:, None], (bm, bk)),
                        other=jnp.zeros((), x_ref.dtype),
                    ).astype(dot_dtype)  # bf16[bm, bk] (f16 with the "f16" conversion, f8 with "w8a8")
                    if w8a8:  # the rows' scales of this K block
                        row_scale = plgpu.load(
                            xs_ref.at[_row_block((), rows, k0 // bk_s, 1, interpret)], mask=ok[:, None], other=0.0
                        )  # f32[bm, 1]
                    if cfg.swap_ab:
                        part = jax.lax.dot_general(
                            w, x, (((w_contract,), (1,)), ((), ())), preferred_element_type=jnp.float32
                        )  # f32[bn, bm]
                        if fp8:
                            part = part * (scale if scale.ndim == 0 else scale[:, None])
                        if w8a8:
                            part = part * row_scale.reshape(1, bm)
                    else:
                        part = jax.lax.dot_general(
                            x, w, (((1,), (w_contract,)), ((), ())), preferred_element_type=jnp.float32
                        )  # f32[bm, bn]
                        if fp8:
                            part = part * (scale if scale.ndim == 0 else scale[None, :])
                        if w8a8:
                            part = part * row_scale
                    return acc + part

                if j == 0:
                    new.append(sub(acc))
                else:  # this sub-tile's rows exist only in big groups: skip its MMA otherwise
                    new.append(jax.lax.cond(left > j * bm, sub, lambda a: a, acc))
            return tuple(new)

        acc_shape = (bn, bm) if cfg.swap_ab else (bm, bn)
        accs = jax.lax.fori_loop(0, k_steps, k_step, tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(NM)))
        for j, acc in enumerate(accs):
            rows, ok = _rows(row0 + j * bm, left - j * bm, bm, M)
            value = (acc.T if cfg.swap_ab else acc).astype(o_ref.dtype)  # [bm, bn]
            plgpu.store(
                o_ref.at[_row_block(out_lead, rows, n0, bn, interpret)],
                value,
                mask=jnp.broadcast_to(ok[:, None], (bm, bn)),
            )
        return carry

    @pl.when(size > 0)
    def _():
        jax.lax.fori_loop(0, pl.cdiv(size, R), one_pass, 0)

    if not partials:  # rows past the groups are zero: the last group's programs write them

        @pl.when(g == G - 1)
        def _():
            def zero_rows(c, carry):
                row0 = total + c * bm
                rows, ok = _rows(row0, M - row0, bm, M)
                plgpu.store(
                    o_ref.at[_row_block((), rows, n0, bn, interpret)],
                    jnp.zeros((bm, bn), o_ref.dtype),
                    mask=jnp.broadcast_to(ok[:, None], (bm, bn)),
                )
                return carry

            jax.lax.fori_loop(0, pl.cdiv(M - total, bm), zero_rows, 0)


def check_shapes(lhs, values, scales, group_sizes, cfg: TritonConfig | None, fp8: bool, transpose_rhs: bool = False) -> tuple[int, int]:
    """Static checks of the kernel's operands (ValueError naming both values) -> the fp8 scale
    block (bk_s, bn_s) ((1, 1) without fp8)."""
    if lhs.ndim != 2 or values.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"lhs [M, K], rhs [G, K, N], group_sizes [G] expected, got {lhs.shape}, {values.shape}, {group_sizes.shape}")
    M, K = lhs.shape
    G, K2, N = (values.shape[0], values.shape[2], values.shape[1]) if transpose_rhs else values.shape
    if K2 != K:
        raise ValueError(f"rhs K ({K2}) must equal lhs K ({K})")
    if group_sizes.shape[0] != G:
        raise ValueError(f"group_sizes length ({group_sizes.shape[0]}) must equal rhs groups ({G})")
    block = (1, 1)
    if fp8:
        Kb, Nb = (scales.shape[2], scales.shape[1]) if transpose_rhs else (scales.shape[1], scales.shape[2])
        block = scale_block((K, N), (Kb, Nb))
    if cfg is None:
        return block
    if N % cfg.block_n:
        raise ValueError(f"N ({N}) must be a multiple of block_n ({cfg.block_n})")
    if K % (cfg.block_k * cfg.split_k):
        raise ValueError(f"K ({K}) must be a multiple of block_k * split_k ({cfg.block_k * cfg.split_k})")
    if fp8 and block[0] % cfg.block_k:
        raise ValueError(f"fp8 weights need block_k ({cfg.block_k}) dividing the scale block's K edge ({block[0]})")
    if fp8 and (block[1] % cfg.block_n if cfg.block_n <= block[1] else cfg.block_n % block[1]):
        raise ValueError(f"fp8 weights need block_n ({cfg.block_n}) dividing or a multiple of the scale block's N edge ({block[1]})")
    return block


def quantize_rows(x: jax.Array, block_k: int) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (f8e4m3fn[M, K], f32[M, K / block_k]): per row and K block, absmax / 448 (a
    block of zeros gets the smallest normal scale), as DeepSeek's act_quant; x ~ values x scale."""
    M, K = x.shape
    blocks = x.astype(jnp.float32).reshape(M, K // block_k, block_k)  # f32[M, Kb, bk]
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1) / 448.0, jnp.finfo(jnp.float32).tiny)  # f32[M, Kb]
    values = jnp.clip(blocks / scale[..., None], -448.0, 448.0).astype(jnp.float8_e4m3fn)  # clip: division round-off past 448
    return values.reshape(M, K), scale


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "transpose_rhs"))
def grouped_matmul_triton(
    lhs: jax.Array,  # [M, K]
    values: jax.Array,  # bf16[G, K, N] or f8e4m3fn[G, K, N] ([G, N, K] with transpose_rhs)
    scales: jax.Array | None,  # f32[G, Kb, Nb] ([G, Nb, Kb] transposed) for fp8, None for bf16
    group_sizes: jax.Array,  # i32[G]
    *,
    out_dtype,
    config: TritonConfig | None = None,
    interpret: bool = False,
    transpose_rhs: bool = False,
    output_init: jax.Array | None = None,  # tests: initial output ([M, N], or f32[S, M, N]), aliased
) -> jax.Array:
    """The Pallas kernel -> out_dtype[M, N]; config None: default_config."""
    fp8 = values.dtype == jnp.float8_e4m3fn
    M, K = lhs.shape
    G, N = values.shape[0], values.shape[1] if transpose_rhs else values.shape[2]
    cfg = config or default_config(M, G, K, N, fp8)
    block = check_shapes(lhs, values, scales, group_sizes, cfg, fp8, transpose_rhs)
    if fp8:
        scales = scales.astype(jnp.float32)
        if cfg.fp8_conversion == "bits":
            values = jax.lax.bitcast_convert_type(values, jnp.uint8)  # same bytes, no copy
            scales = scales * _BITS_SCALE  # exact (a power of two)
    else:
        scales = jnp.zeros((1,), jnp.float32)  # unused operand (a zero-size one has no pointer)
    x_scales = jnp.zeros((1,), jnp.float32)  # unused unless "w8a8"
    if fp8 and cfg.fp8_conversion == "w8a8":
        lhs, x_scales = quantize_rows(lhs, block[0])  # f8[M, K], f32[M, Kb]
    partials = cfg.split_k > 1
    out_shape = jax.ShapeDtypeStruct((cfg.split_k, M, N) if partials else (M, N), jnp.float32 if partials else out_dtype)
    aliases = {}
    if output_init is None:
        output_init = jnp.zeros((1,), jnp.float32)
    else:
        if output_init.shape != out_shape.shape or output_init.dtype != out_shape.dtype:
            raise ValueError(f"output_init ({output_init.shape}, {output_init.dtype}) must be {out_shape}")
        aliases = {4: 0}
    kernel = functools.partial(
        _kernel, cfg=cfg, fp8=fp8, k_steps=K // (cfg.block_k * cfg.split_k), interpret=interpret,
        transpose_rhs=transpose_rhs, scale_block=block,
    )  # fmt: skip
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(N // cfg.block_n, G, cfg.split_k) if cfg.n_fastest else (G, N // cfg.block_n, cfg.split_k),
        in_specs=[any_spec] * 6,
        out_specs=any_spec,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="hisparse_grouped_matmul",
    )(group_sizes.astype(jnp.int32), lhs, values, scales, output_init, x_scales)
    if partials:  # one XLA fusion: sum of the K slices, rows past the groups zeroed, cast
        rows_ok = jnp.arange(M) < jnp.sum(group_sizes)
        out = jnp.where(rows_ok[:, None], out.sum(axis=0), 0.0).astype(out_dtype)
    return out
