"""DSA indexer scores of a batch of decoding requests over the key cache, masked to each context.

For request i of the batch (slot i of the cache) and key position c of layer `layer`:
    score[i, c] = sum_g w[i, g] * relu(q[i, g] . k[c] * I**-0.5)   (x the key's scale, fp8 keys)
where c <= positions[i], and -inf elsewhere (positions[i] = -1: an inactive slot, all -inf).
This is models/indexer.py's formula (score_keys below is its body; models/ cannot be imported
from here, so the model calls this module).

fp8 keys (float8_e4m3fn) carry one f32 scale per key: the dot runs on the fp8 values cast to the
query's dtype (exact) and the scale multiplies the head sum, as a positive scale commutes with
the relu.

The kernel (grid: requests x runs of key blocks) reads the whole key cache [J, R, C, I] in
place, a few blocks of one request's keys per program: q [G, I] . keys [block, I]^T on the tensor cores
(bf16 operands, f32 accumulation; f32 at full precision for f32 models), relu, head-weight sum
and mask in registers, one f32 per key written. No [b, G, C] intermediate reaches memory, and
keys past a request's position are never read (masked loads), so stale or NaN rows there cannot
leak into a score.

Shape letters: b requests in the batch (the first b slots of the cache), G indexer heads,
I index_head_dim, J indexer layers, R request slots, C key positions per slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.common import check_equal, check_layer_index, check_rank

FP8_KEY_DTYPE = jnp.float8_e4m3fn
_MASKED = -float("inf")


def resolve_implementation(implementation: str | None) -> str:
    """"pallas" or "reference" (None: "pallas" on GPU, else "reference"). There is no TPU
    indexer kernel: "tpu" raises (the caller decides whether XLA's path is what it wants)."""
    if implementation is None:
        return "pallas" if common.on_gpu() else "reference"
    if implementation not in ("reference", "pallas"):
        raise ValueError(f"implementation must be 'reference', 'pallas' or None for the indexer, got {implementation!r}")
    return implementation


def is_fp8(dtype) -> bool:
    """Whether keys of `dtype` are the fp8 format (values + a per-key scale)."""
    return jnp.dtype(dtype) == jnp.dtype(FP8_KEY_DTYPE)


def operand_dtype(q_dtype, key_dtype):
    """The dtype the q . k dot runs in: fp8 keys are cast to q's dtype (exact), others promote."""
    return jnp.dtype(q_dtype) if is_fp8(key_dtype) else jnp.promote_types(q_dtype, key_dtype)


def score_keys(q: jax.Array, weights: jax.Array, keys: jax.Array, key_scales: jax.Array | None = None) -> jax.Array:
    """q [T, G, I], weights f32[T, G], keys [S, I] (fp8: + key_scales f32[S]) -> f32[T, S].

    models/indexer.py's index_scores (the model's scoring, unmasked)."""
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


def _check_inputs(q, weights, index_keys, key_scales, layer, positions) -> None:
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


def index_scores_masked_reference(q, weights, index_keys, key_scales, layer, positions):
    """The model's decode path in jnp: score_keys per request over its slot's keys, then -inf
    past each position. Same arguments as index_scores_masked -> f32[b, C]."""
    _check_inputs(q, weights, index_keys, key_scales, layer, positions)
    b, C = q.shape[0], index_keys.shape[2]
    keys = index_keys[layer, :b]  # [b, C, I]
    scales = key_scales[layer, :b] if is_fp8(index_keys.dtype) else None  # f32[b, C]
    scores = jax.vmap(score_keys)(q[:, None], weights[:, None], keys, scales)[:, 0]  # f32[b, C]
    allowed = jnp.arange(C)[None, :] <= positions[:, None]  # bool[b, C]; nothing for -1
    return jnp.where(allowed, scores, _MASKED)


def _scores_kernel(
    layer_ref,  # i32[1]
    positions_ref,  # i32[b]
    q_ref,  # [b, G, I]
    weights_ref,  # f32[b, G]
    keys_ref,  # [J, R, C, I]
    scales_ref,  # f32[J, R, C] (fp8 keys; unused otherwise)
    out_ref,  # f32[b, C]
    *,
    block_g: int,
    block_c: int,
    blocks_per_program: int,
    fp8: bool,
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
        per_head = jax.lax.dot_general(
            q, keys, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # f32[block_g, block_c]
        per_head = jnp.maximum(per_head * I**-0.5, 0.0)
        scores = jnp.sum(per_head * w[:, None], axis=0)  # f32[block_c]
        if fp8:
            scores = scores * common.gather(scales_ref, (layer, i, safe_c), allowed, 1.0)
        in_row = c < C
        common.scatter(out_ref, (i, common.safe_index(c, in_row, C)), jnp.where(allowed, scores, _MASKED), in_row)
        return carry

    if blocks_per_program == 1:
        block(0, 0)
    else:  # q and w loaded once; Triton pipelines the key loads over num_stages
        jax.lax.fori_loop(0, blocks_per_program, block, 0)


def default_blocking(b: int, C: int, fp8: bool) -> tuple[int, int]:
    """(block_c, blocks_per_program), as measured on the H200 (2026-12-01, 64 heads x 128, bf16
    keys, device us; docs/perf/bench_kernels_indexer_h200_2026-12-01b.json). bf16 / f32 keys:
    64-key blocks, 16 per program (47 x 32k 126.8 us vs 130.6 for 8 x 128; 190 x 32k 466.0 vs
    476.7; 47 x 64k 235.9 vs 247.1; 47 x 128k 455.4 vs 465.2), 4 per program when that leaves
    under 1024 programs (13 x 32k: 42.7 us vs 47.0 with 16, 45.9 for 8 x 128). fp8 keys: 1
    block of 128 (35 us faster than 8 at 47 x 32k, docs/PERFORMANCE.md; why is not established)."""
    if fp8:
        return 128, 1
    return 64, (16 if b * pl.cdiv(C, 64 * 16) >= 1024 else 4)


def index_scores_masked_pallas(
    q, weights, index_keys, key_scales, layer, positions, *, block_c=None, blocks_per_program=None, num_warps=4, num_stages=None
):
    """The Pallas kernel; see index_scores_masked. Each program scores blocks_per_program blocks
    of block_c keys (a power of two) of one request; None: default_blocking (measured)."""
    _check_inputs(q, weights, index_keys, key_scales, layer, positions)
    b, G, I = q.shape
    C = index_keys.shape[2]
    if I < 16 or I & (I - 1):
        raise ValueError(f"the indexer kernel needs a power-of-two head dim >= 16 (a Triton dot), got I = {I}")
    fp8 = is_fp8(index_keys.dtype)
    default_c, default_blocks = default_blocking(b, C, fp8)
    block_c = block_c or default_c
    if block_c < 16 or block_c & (block_c - 1):
        raise ValueError(f"block_c ({block_c}) must be a power of two >= 16")
    block_c = min(block_c, max(16, common.next_power_of_2(C)))
    if blocks_per_program is None:
        blocks_per_program = default_blocks
    blocks_per_program = min(blocks_per_program, pl.cdiv(C, block_c))  # no program past the row
    if num_stages is None:
        num_stages = 3 if blocks_per_program > 1 else 1
    kernel = functools.partial(
        _scores_kernel,
        block_g=max(16, common.next_power_of_2(G)),
        block_c=block_c,
        blocks_per_program=blocks_per_program,
        fp8=fp8,
        interpret=common.interpret_mode(),
    )
    # An unused f32[1] stands in for the scales of non-fp8 keys (a zero-size operand has no pointer).
    scales = key_scales if fp8 else jnp.zeros((1,), jnp.float32)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, C), jnp.float32),
        grid=(b, pl.cdiv(C, block_c * blocks_per_program)),
        in_specs=[common.any_spec()] * 6,
        out_specs=common.any_spec(),
        compiler_params=common.triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=common.interpret_mode(),
        name="hisparse_indexer_scores",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), positions.astype(jnp.int32), q, weights.astype(jnp.float32), index_keys, scales)


def index_scores_masked(q, weights, index_keys, key_scales, layer, positions, *, implementation=None, **tuning):
    """Indexer scores of b decoding requests over their slots' cached keys, -inf past each position.

    q [b, G, I] (bf16 or f32); weights f32[b, G]; index_keys [J, R, C, I] (the whole key cache:
    bf16 / f32, or float8_e4m3fn); key_scales f32[J, R, C] for fp8 keys, f32[J, R, 0] otherwise;
    layer: int or i32[] (which of J); positions i32[b]: request i (slot i, b <= R) sees keys
    0..positions[i], -1 none -> f32[b, C]. Raises ValueError on inconsistent static shapes.
    """
    _check_inputs(q, weights, index_keys, key_scales, layer, positions)
    if resolve_implementation(implementation) == "pallas":
        return index_scores_masked_pallas(q, weights, index_keys, key_scales, jnp.asarray(layer, jnp.int32), positions, **tuning)
    return index_scores_masked_reference(q, weights, index_keys, key_scales, layer, positions)
