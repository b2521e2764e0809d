"""The indexer's masked scores as a Pallas GPU kernel (Triton lowering): tensor-core q . k over key
blocks read in place from the cache, ReLU, head weights, masking past each request's position."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.indexer_scores.base import MASKED, check_inputs, is_fp8, operand_dtype


def _scores_kernel(
    layer_ref,  # i32[1]
    positions_ref,  # i32[b]
    q_ref,  # [b, G, I]
    weights_ref,  # f32[b, G]
    keys_ref,  # [J, R, C, I]
    scales_ref,  # f32[J, R, C] (fp8 keys; unused otherwise)
    out_ref,  # f32[b, C]
    *hist_ref,  # histogram=True: i32[b, S, N], the top-k's digit counts of this program's scores
    block_g: int,
    block_c: int,
    blocks_per_program: int,
    fp8: bool,
    keys_major: bool,
    histogram: bool,
    interpret: bool,
):
    i, program = pl.program_id(0), pl.program_id(1)
    G, I = q_ref.shape[1], q_ref.shape[2]
    C = keys_ref.shape[2]
    layer, position = layer_ref[0], positions_ref[i]
    operand = operand_dtype(q_ref.dtype, keys_ref.dtype)
    precision = jax.lax.Precision.HIGHEST if operand == jnp.float32 else None
    safe_heads, head_ok = common.head_block(0, block_g, G)  # the head block is padded to >= 16 (Triton dots)
    q = common.gather_rows(q_ref, (i,), safe_heads, head_ok, 0, I, interpret).astype(operand)  # [block_g, I]
    w = common.gather(weights_ref, (i, safe_heads), head_ok, 0.0)  # f32[block_g]; padded heads weigh 0

    def block(j, carry):  # keys block `j` of this program: scores f32[block_c] written
        c = (program * blocks_per_program + j) * block_c + jnp.arange(block_c, dtype=jnp.int32)
        allowed = (c <= position) & (c < C)  # bool[block_c]; keys past the position are not read
        safe_c = common.safe_index(c, allowed, C)
        keys = common.gather(
            keys_ref,
            common.row_block((layer, i), safe_c, 0, I, interpret),
            jnp.broadcast_to(allowed[:, None], (block_c, I)),
            jnp.zeros((), keys_ref.dtype),  # typed: Triton casts no int to fp8
        ).astype(operand)  # [block_c, I]
        if keys_major:  # keys as the dot's M side (wgmma's A may stay in registers after the fp8 cast)
            per_key = jax.lax.dot_general(
                keys, q, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )  # f32[block_c, block_g]
            per_key = jnp.maximum(per_key * I**-0.5, 0.0)
            scores = jnp.sum(per_key * w[None, :], axis=1)  # f32[block_c]
        else:
            per_head = jax.lax.dot_general(
                q, keys, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )  # f32[block_g, block_c]
            per_head = jnp.maximum(per_head * I**-0.5, 0.0)
            scores = jnp.sum(per_head * w[:, None], axis=0)  # f32[block_c]
        if fp8:
            scores = scores * common.gather(scales_ref, (layer, i, safe_c), allowed, 1.0)
        in_row = c < C
        scores = jnp.where(allowed, scores, MASKED)  # f32[block_c]: what is stored
        common.scatter(out_ref, (i, common.safe_index(c, in_row, C)), scores, in_row)
        return carry + common.digit_counts(scores) if histogram else carry  # counts f32[16, 16]: the stored values, masked ones not counted

    counts = jnp.zeros((common.DIGIT_HALF, common.DIGIT_HALF), jnp.float32) if histogram else 0  # f32[16, 16]
    if blocks_per_program == 1:
        counts = block(0, counts)
    else:  # q and w loaded once; Triton pipelines the key loads over num_stages
        counts = jax.lax.fori_loop(0, blocks_per_program, block, counts)
    if histogram:
        common.store_digit_counts(hist_ref[0], (i, program), counts, interpret)


def default_blocking(b: int, C: int, fp8: bool) -> tuple[int, int, bool]:
    """(block_c, blocks_per_program, keys_major), as measured on the H200.

    bf16 / f32 keys (2026-12-01, 64 heads x 128, device us; docs/perf/bench_kernels_indexer_h200_2026-12-01b.json):
    64-key blocks, 16 per program (47 x 32k 126.8 us vs 130.6 for 8 x 128; 190 x 32k 466.0 vs
    476.7; 47 x 64k 235.9 vs 247.1; 47 x 128k 455.4 vs 465.2), 4 per program when that leaves
    under 1024 programs (13 x 32k: 42.7 us vs 47.0 with 16, 45.9 for 8 x 128).
    fp8 keys (2026-12-04, tenth session, benchmarks/probes/indexer_fp8_tiling.py; docs/PERFORMANCE.md): the
    keys-major dot everywhere; 16 blocks of 64 keys per program when that makes >= 1024 programs
    (37 x 61,440 x 64 heads: 149.3 us vs 219.7 for the 2026-12-01 default of one 128-key block
    head-major; 47 x 32k: 106.5 vs 152.9), else one block of 128 (23 x 40,960 x 32 heads: 57.4
    vs 60.5; 1 x 61,440: 7.3 vs 8.0)."""
    many_programs = b * pl.cdiv(C, 64 * 16) >= 1024
    if fp8:
        return (64, 16, True) if many_programs else (128, 1, True)
    return 64, (16 if many_programs else 4), False


# Scores per program when the scoring kernel also counts the top-k's histogram (histogram=True):
# each program's counts are one slice of the radix top-k's histograms, the slices its own
# histogram kernel counts (2048 scores); shorter programs would multiply the slices its plan reads.
HISTOGRAM_SPAN = 2048


def histogram_blocking(b: int, C: int, fp8: bool) -> tuple[int, int, bool]:
    """default_blocking with programs of at least HISTOGRAM_SPAN keys (more blocks per program)."""
    block_c, blocks, keys_major = default_blocking(b, C, fp8)
    block_c = min(block_c, max(16, common.next_power_of_2(C)))
    return block_c, max(blocks, HISTOGRAM_SPAN // block_c), keys_major


def histogram_fills_the_gpu(b: int, C: int, num_sms: int | None = None) -> bool:
    """Whether b requests of C keys in programs of HISTOGRAM_SPAN keys still make two waves on
    num_sms SMs (None: the device's, common.num_sms; an estimate, not measured): on the H200 one
    request of 131,072 keys makes 64 programs, where the unfused scoring runs 1,024."""
    return b * pl.cdiv(C, HISTOGRAM_SPAN) >= 2 * (num_sms or common.num_sms())


def histogram_span(b: int, C: int, fp8: bool) -> int:
    """Scores per program (the top-k's slice_len) of index_scores_masked_pallas(histogram=True)
    with its default blocking."""
    block_c, blocks, _ = histogram_blocking(b, C, fp8)
    span = block_c * min(blocks, pl.cdiv(C, block_c))
    return span if span < C else max(16, common.next_power_of_2(C))  # one program per request: any power of two >= C


@common.lower_once
def index_scores_masked_pallas(
    q, weights, index_keys, key_scales, layer, positions, *, block_c=None, blocks_per_program=None, num_warps=4, num_stages=None,
    keys_major=None, histogram=False,
):
    """The Pallas kernel; see index_scores_masked. Each program scores blocks_per_program blocks
    of block_c keys (a power of two) of one request; None: default_blocking (measured), or with
    histogram histogram_blocking.
    keys_major: the dot as keys [block_c, I] . q^T (f32[block_c, heads]) rather than q . keys^T;
    the same products, summed over heads along the other axis (equal to rounding); None: the default's.
    histogram: also return each program's digit counts of the scores it wrote, i32[b, S, N]
    (S = programs per request), the radix top-k's step 1 (topk_indices_pallas(hist=..., slice_len=
    block_c x blocks_per_program, histogram_span with the default blocking)): (scores, hist)."""
    check_inputs(q, weights, index_keys, key_scales, layer, positions)
    b, G, I = q.shape
    C = index_keys.shape[2]
    if I < 16 or I & (I - 1):
        raise ValueError(f"the indexer kernel needs a power-of-two head dim >= 16 (a Triton dot), got I = {I}")
    fp8 = is_fp8(index_keys.dtype)
    default_c, default_blocks, default_keys_major = (histogram_blocking if histogram else default_blocking)(b, C, fp8)
    keys_major = default_keys_major if keys_major is None else keys_major
    block_c = block_c or default_c
    if block_c < 16 or block_c & (block_c - 1):
        raise ValueError(f"block_c ({block_c}) must be a power of two >= 16")
    block_c = min(block_c, max(16, common.next_power_of_2(C)))
    if blocks_per_program is None:
        blocks_per_program = default_blocks
    blocks_per_program = min(blocks_per_program, pl.cdiv(C, block_c))  # no program past the row
    if histogram and blocks_per_program * block_c < C and blocks_per_program & (blocks_per_program - 1):
        raise ValueError(f"histogram=True needs a power-of-two blocks_per_program (the top-k's slices), got {blocks_per_program}")
    if num_stages is None:
        num_stages = 3 if blocks_per_program > 1 else 1
    kernel = functools.partial(
        _scores_kernel,
        block_g=max(16, common.next_power_of_2(G)),
        block_c=block_c,
        blocks_per_program=blocks_per_program,
        fp8=fp8,
        keys_major=keys_major,
        histogram=histogram,
        interpret=common.interpret_mode(),
    )
    # An unused f32[1] stands in for the scales of non-fp8 keys (a zero-size operand has no pointer).
    scales = key_scales if fp8 else jnp.zeros((1,), jnp.float32)
    programs = pl.cdiv(C, block_c * blocks_per_program)
    out_shape = [jax.ShapeDtypeStruct((b, C), jnp.float32)]
    if histogram:
        out_shape.append(jax.ShapeDtypeStruct((b, programs, common.DIGITS), jnp.int32))
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(b, programs),
        in_specs=[common.any_spec()] * 6,
        out_specs=[common.any_spec()] * len(out_shape),
        compiler_params=common.triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=common.interpret_mode(),
        name="hisparse_indexer_scores",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), positions.astype(jnp.int32), q, weights.astype(jnp.float32), index_keys, scales)
    return tuple(out) if histogram else out[0]
