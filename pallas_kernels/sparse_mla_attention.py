"""Sparse absorbed-MLA decode attention over device slots.

For each request r and head h:
    out[r, h] = sum_k softmax_k(scale * q[r, h] . row[slot[r, k]]) * row[slot[r, k], :latent]
where rows come from one layer of a stacked KV buffer (the HiSparse device buffer [L, R, B+1, W]
or the full on-device KV [L, R, C, W]; the kernel does not care which), a row is the 576-wide
latent + rope (the key) and its first `latent_dim` values are the value, entries with slot -1
are masked, and the softmax is in f32. A request with no valid entry gets zeros.

Shape letters: R requests, H heads, K selected entries, W row width, D latent (value) width,
L layers, S slots per request.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.common import check_equal, check_layer_index, check_rank

_MASKED = -float("inf")
_RUNNING_MAX_START = -1e30  # finite, so a fully masked block gives exp(-inf) = 0, not NaN


def _dot_precision(dtype):
    # f32 rows are for exact tests: keep full f32 products (Triton's default would be TF32).
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _check_inputs(query, kv, layer, slots, latent_dim) -> None:
    """Static shape checks shared by the reference and the kernel."""
    check_rank("query", query, 3, "[R, H, W]")
    check_rank("kv", kv, 4, "[L, R, S, W]")
    check_rank("slots", slots, 2, "[R, K]")
    R, W = query.shape[0], kv.shape[3]
    check_equal("kv request slots", kv.shape[1], "query batch (R)", R)
    check_equal("slots batch", slots.shape[0], "query batch (R)", R)
    check_equal("query width", query.shape[2], "kv row width (W)", W)
    if not 0 < latent_dim <= W:
        raise ValueError(f"latent_dim ({latent_dim}) must be in [1, row width ({W})]")
    check_layer_index(layer, kv.shape[0])


def sparse_mla_attention_reference(query, kv, layer, slots, *, latent_dim, sm_scale):
    """The formula in jnp, f32 throughout: query [R, H, W]; kv row[L, R, S, W]; layer int or
    i32[]; slots i32[R, K] (-1 masked) -> f32[R, H, D] with D = latent_dim."""
    _check_inputs(query, kv, layer, slots, latent_dim)
    R = query.shape[0]
    valid = slots >= 0  # bool[R, K]
    rows = kv[layer][jnp.arange(R)[:, None], jnp.where(valid, slots, 0)]  # row[R, K, W]
    rows = jnp.where(valid[:, :, None], rows.astype(jnp.float32), 0.0)  # never multiply an unread row
    scores = jnp.einsum(
        "rhw,rkw->rhk", query.astype(jnp.float32), rows, precision=jax.lax.Precision.HIGHEST
    ) * sm_scale  # f32[R, H, K]
    scores = jnp.where(valid[:, None, :], scores, _MASKED)
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))  # f32[R, H, K]
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("rhk,rkd->rhd", weights, rows[..., :latent_dim], precision=jax.lax.Precision.HIGHEST)
    return jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)


def _attention_kernel(
    layer_ref,  # i32[1]
    query_ref,  # [R, H, W]
    slots_ref,  # i32[R, K]
    kv_ref,  # row[L, R, S, W]
    out_ref,  # f32[R, H, D]
    *,
    latent_dim: int,
    sm_scale: float,
    block_h: int,
    block_k: int,
    interpret: bool,
):
    r, head_block = pl.program_id(0), pl.program_id(1)
    H, W = query_ref.shape[1], query_ref.shape[2]
    K, S = slots_ref.shape[1], kv_ref.shape[2]
    layer = layer_ref[0]
    precision = _dot_precision(kv_ref.dtype)
    heads = head_block * block_h + jnp.arange(block_h, dtype=jnp.int32)
    head_ok = heads < H
    safe_heads = common.safe_index(heads, head_ok, H)
    value_pieces = common.power_of_2_pieces(latent_dim)
    key_pieces = value_pieces + [(latent_dim + o, s) for o, s in common.power_of_2_pieces(W - latent_dim)]
    queries = [
        common.gather(
            query_ref, common.row_block((r,), safe_heads, o, s, interpret), jnp.broadcast_to(head_ok[:, None], (block_h, s)), 0
        ).astype(kv_ref.dtype)
        for o, s in key_pieces
    ]  # [block_h, s] each

    def body(step, carry):
        running_max, total, accs = carry
        k = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        slot = common.gather(slots_ref, (r, common.safe_index(k, k < K, K)), k < K, -1)
        valid = slot >= 0
        safe_slot = common.safe_index(slot, valid, S)
        keys = [
            common.gather(
                kv_ref, common.row_block((layer, r), safe_slot, o, s, interpret), jnp.broadcast_to(valid[:, None], (block_k, s)), 0
            )
            for o, s in key_pieces
        ]  # row[block_k, s] each
        scores = sum(
            jax.lax.dot_general(q, kk, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
            for q, kk in zip(queries, keys)
        ) * sm_scale  # f32[block_h, block_k]
        scores = jnp.where(valid[None, :], scores, _MASKED)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1))  # f32[block_h]
        rescale = jnp.exp(running_max - new_max)
        weights = jnp.exp(scores - new_max[:, None])  # f32[block_h, block_k]
        total = total * rescale + jnp.sum(weights, axis=1)
        accs = [
            acc * rescale[:, None]
            + jax.lax.dot(weights.astype(kv_ref.dtype), v, precision=precision, preferred_element_type=jnp.float32)
            for acc, v in zip(accs, keys[: len(value_pieces)])
        ]
        return new_max, total, accs

    init = (
        jnp.full((block_h,), _RUNNING_MAX_START, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        [jnp.zeros((block_h, s), jnp.float32) for _, s in value_pieces],
    )
    _, total, accs = jax.lax.fori_loop(0, pl.cdiv(K, block_k), body, init)
    scale = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    for (o, s), acc in zip(value_pieces, accs):
        common.scatter(
            out_ref, common.row_block((r,), safe_heads, o, s, interpret), acc * scale[:, None], jnp.broadcast_to(head_ok[:, None], (block_h, s))
        )


def default_launch_shape(num_requests: int, num_heads: int) -> dict:
    """The kernel's launch shape (block_h, block_k, num_warps, num_stages) for R x H heads.

    Measured on the H200 (docs/PERFORMANCE.md, top_k 2048, bf16): 64-head blocks win once the
    grid is large (batch 128 x 128 heads: 406 us vs 614 us for 32-head blocks), 32-head blocks
    with 128-row key blocks when it is small (batch 16 x 128 heads: 105 us vs 207 us)."""
    if num_requests * num_heads >= 8192:
        return dict(block_h=64, block_k=64, num_warps=8, num_stages=2)
    return dict(block_h=32, block_k=128, num_warps=8, num_stages=2)


def sparse_mla_attention_pallas(query, kv, layer, slots, *, latent_dim, sm_scale, block_h=None, block_k=None, num_warps=None, num_stages=None):
    """The Pallas kernel: shapes as sparse_mla_attention_reference; the launch shape defaults
    to default_launch_shape(R, H). One program per (request, head block)."""
    _check_inputs(query, kv, layer, slots, latent_dim)
    R, H, _ = query.shape
    shape = default_launch_shape(R, H)
    block_h = block_h or shape["block_h"]
    block_k = block_k or shape["block_k"]
    num_warps = num_warps or shape["num_warps"]
    num_stages = num_stages or shape["num_stages"]
    # Triton dots need every dimension >= 16: pad the head block and mask the extra heads.
    block_h = max(16, min(block_h, common.next_power_of_2(H)))
    block_k = max(16, min(block_k, common.next_power_of_2(slots.shape[1])))
    kernel = functools.partial(
        _attention_kernel,
        latent_dim=latent_dim,
        sm_scale=float(sm_scale),
        block_h=block_h,
        block_k=block_k,
        interpret=common.interpret_mode(),
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((R, H, latent_dim), jnp.float32),
        grid=(R, pl.cdiv(H, block_h)),
        in_specs=[common.any_spec()] * 4,
        out_specs=common.any_spec(),
        compiler_params=common.triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=common.interpret_mode(),
        name="hisparse_sparse_mla_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), query, slots, kv)


def sparse_mla_attention(query, kv, layer, slots, *, latent_dim, sm_scale, implementation=None, **tuning):
    """Sparse MLA decode attention; see the module docstring.

    query: [R, H, W] (latent-absorbed q then rope q); kv: row[L, R, S, W]; layer: int or i32[];
    slots: i32[R, K] (-1 masked) -> f32[R, H, D] with D = latent_dim. Raises ValueError on
    inconsistent static shapes.
    """
    _check_inputs(query, kv, layer, slots, latent_dim)
    if common.resolve_implementation(implementation) == "pallas":
        return sparse_mla_attention_pallas(
            query, kv, jnp.asarray(layer, jnp.int32), slots, latent_dim=latent_dim, sm_scale=sm_scale, **tuning
        )
    return sparse_mla_attention_reference(query, kv, layer, slots, latent_dim=latent_dim, sm_scale=sm_scale)
