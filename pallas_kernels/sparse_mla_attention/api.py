"""Sparse absorbed-MLA decode attention over device slots.

For each request r and head h:
    out[r, h] = sum_k softmax_k(scale * q[r, h] . row[slot[r, k]]) * row[slot[r, k], :latent]
where rows come from one layer of a stacked KV buffer (the HiSparse device buffer [L, R, B+1, W]
or the full on-device KV [L, R, C, W]; the kernel does not care which), a row is the 576-wide
latent + rope (the key) and its first `latent_dim` values are the value, entries with slot -1
are masked, and the softmax is in f32. A request with no valid entry gets zeros.

Rows are plain (bf16 / f32 values, W = latent + rope) or, with `layout` an fp8_e4m3
KVRowLayout (hisparse_jax.row_layout), packed uint32 words: per row D/4 words of fp8 latent
bytes, one f32 scale per group of G latent values, rope/2 words of bf16 pairs (164 words = 656 B
for 512 + 64). The reference unpacks the gathered rows to f32 (layout.unpack). The kernel
dequantises each block of selected rows as it reads it, as FlashMLA does: the 4 bytes of every
word (byte j of word w is latent value 4w + j) are put back in latent order (two levels of
2-way joins), converted to f32 and multiplied by their group's scale, and the rope pairs split
and joined likewise; the keys then go to the same two matmuls as plain rows, in the query's
dtype (bf16; f32 at full precision for an f32 query).

implementation="tpu" (pallas_kernels/sparse_mla_attention/pallas_tpu.py) gathers the selected rows by
DMA into VMEM instead, and dequantises fp8 rows in VMEM.

Shape letters: R requests, H heads, K selected entries, W stored row width, D latent (value)
width, L layers, S slots per request. The query is D + rope wide (the row's values).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.sparse_mla_attention.base import check_inputs
from pallas_kernels.sparse_mla_attention.pallas_triton import sparse_mla_attention_pallas, sparse_mla_attention_reading_host_pallas
from pallas_kernels.sparse_mla_attention.reference import sparse_mla_attention_reading_host_reference, sparse_mla_attention_reference


def sparse_mla_attention(query, kv, layer, slots, *, latent_dim, sm_scale, layout=None, implementation=None, **tuning):
    """Sparse MLA decode attention; see the module docstring.

    query: [R, H, D + rope] (latent-absorbed q then rope q); kv: row[L, R, S, W], or row[L, 1, S, W]
    a device pool every request reads (slots then index pool rows); layer: int or
    i32[]; slots: i32[R, K] (-1 masked) -> f32[R, H, D] with D = latent_dim. layout: the rows'
    KVRowLayout (hisparse_jax.row_layout; required for fp8 rows, optional for plain ones, whose
    dtype says it all). Raises ValueError on inconsistent static shapes.
    """
    check_inputs(query, kv, layer, slots, latent_dim, layout)
    implementation = common.resolve_implementation(implementation)
    if implementation == "tpu":
        from pallas_kernels.sparse_mla_attention.pallas_tpu import sparse_mla_attention_tpu

        if kv.shape[1] == 1 < query.shape[0]:
            raise ValueError("the TPU attention kernel does not read a shared device pool (kv row[L, 1, S, W]) yet")

        return sparse_mla_attention_tpu(
            query, kv, jnp.asarray(layer, jnp.int32), slots, latent_dim=latent_dim, sm_scale=sm_scale, layout=layout, **tuning
        )
    if implementation == "pallas":
        return sparse_mla_attention_pallas(
            query, kv, jnp.asarray(layer, jnp.int32), slots, latent_dim=latent_dim, sm_scale=sm_scale, layout=layout, **tuning
        )
    return sparse_mla_attention_reference(query, kv, layer, slots, latent_dim=latent_dim, sm_scale=sm_scale, layout=layout)


def sparse_mla_attention_reading_host(
    query, kv, layer, slots, host_slots, pool, *, latent_dim, sm_scale, layout=None, implementation=None, **tuning
):
    """sparse_mla_attention that also reads this step's missed rows straight from the pinned host
    pool -> (f32[R, H, D], kv with those rows written to their slots).

    host_slots: i32[R, K], the pool row (of `layer`) of each entry whose row is not on the device
    yet (a swap-in miss, or a repeat of one), -1 for the others; slots[r, k] is where that row
    goes. pool: row[L, S_host, W] (pinned host). The result equals copying the rows to their
    slots first and then attending (the reference does exactly that); the Pallas kernel reads them
    over PCIe as it attends, so the copy needs no launch of its own and no wait before attention.
    Not on TPU (ValueError). Other arguments as sparse_mla_attention's.
    """
    implementation = common.resolve_implementation(implementation)
    if implementation == "tpu":
        raise ValueError("reading misses from the host inside attention needs the GPU / reference kernels; the TPU kernel has no host reads")
    layer = jnp.asarray(layer, jnp.int32)
    if implementation == "pallas":
        return sparse_mla_attention_reading_host_pallas(
            query, kv, layer, slots, host_slots, pool, latent_dim=latent_dim, sm_scale=sm_scale, layout=layout, **tuning
        )
    return sparse_mla_attention_reading_host_reference(
        query, kv, layer, slots, host_slots, pool, latent_dim=latent_dim, sm_scale=sm_scale, layout=layout
    )
