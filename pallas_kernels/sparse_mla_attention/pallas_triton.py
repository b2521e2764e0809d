"""Sparse MLA attention as Pallas GPU kernels (Triton lowering): bf16 rows, and fp8 rows dequantised
in the kernel; split-K over the selected rows with a combine of the partial softmaxes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.sparse_mla_attention.base import MASKED, check_host_inputs, check_inputs, is_quantized

_RUNNING_MAX_START = -1e30  # finite, so a fully masked block gives exp(-inf) = 0, not NaN


def _dot_precision(dtype):
    # f32 rows are for exact tests: keep full f32 products (Triton's default would be TF32).
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _online_softmax(running_max, total, scores, valid, keys_axis: int = 1):
    """One key block of flash attention's running softmax: scores f32[block_h, block_k] (valid
    bool[block_k] masks keys) -> (new running max f32[block_h], new total f32[block_h], rescale
    f32[block_h] for the accumulators, weights f32[block_h, block_k]). keys_axis 0: scores and
    weights are [block_k, block_h] (keys_major)."""
    heads_axis = 1 - keys_axis
    scores = jnp.where(jnp.expand_dims(valid, heads_axis), scores, MASKED)
    new_max = jnp.maximum(running_max, jnp.max(scores, axis=keys_axis))
    rescale = jnp.exp(running_max - new_max)
    weights = jnp.exp(scores - jnp.expand_dims(new_max, keys_axis))
    return new_max, total * rescale + jnp.sum(weights, axis=keys_axis), rescale, weights


def _accumulate(acc, weights, values, rescale, keys_major: bool, transposed_acc: bool, precision):
    """acc * rescale + weights . values in the layouts the launch picks: acc f32[block_h, s] ([s,
    block_h] transposed_acc: values^T . weights, both dots then with keys or columns on M),
    weights [block_h, block_k] ([block_k, block_h] keys_major), values [block_k, s]."""
    if transposed_acc:
        return acc * rescale[None, :] + jax.lax.dot_general(
            values, weights, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
    contract = 0 if keys_major else 1  # the weights' key axis
    return acc * rescale[:, None] + jax.lax.dot_general(
        weights, values, (((contract,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


class _RowReader:
    """Reads blocks of the selected rows of one key block: from the device rows kv (kv_ref), or,
    for entries with a host slot (reads_host: the misses of this step's swap-in), from the
    pinned host pool over PCIe. write_back() then stores those rows in their device slots (head
    block 0 only: one writer per entry) so that later steps hit them. Masked-off lanes read 0.

    Every read of a key block is issued before any store: the compiler cannot tell kv_out from
    the pool, so a load placed after a store waits for the store, and the store for its own
    load; stored as they came, the pieces of a row would cost one PCIe round trip each."""

    def __init__(self, kv_ref, host_refs, kv_out_ref, layer, r, head_block, slot, valid, k, K, interpret):
        # slot, valid, k: i32[block_k], bool[block_k], i32[block_k] (this key block's entries)
        self.kv_ref, self.kv_out_ref, self.interpret = kv_ref, kv_out_ref, interpret
        self.row = (layer, common.request_row(r, kv_ref))
        self.slot = common.safe_index(slot, valid, kv_ref.shape[2])
        self.on_device = valid
        self.host_ref = None
        if host_refs is not None:
            host_slots_ref, pool_ref = host_refs
            host_slot = common.gather(host_slots_ref, (r, common.safe_index(k, k < K, K)), valid, -1)  # i32[block_k]
            self.from_host = valid & (host_slot >= 0)
            self.on_device = valid & (host_slot < 0)
            self.writes = self.from_host & (head_block == 0)
            self.host_ref, self.layer = pool_ref, layer
            self.host_slot = common.safe_index(host_slot, self.from_host, pool_ref.shape[1])
        self.pending = []  # (kv index, host values, mask): the stores write_back issues

    def block(self, start: int, size: int):
        """row[block_k, size]: words / values start .. start + size - 1 of each selected row."""
        n = self.slot.shape[0]
        index = common.row_block(self.row, self.slot, start, size, self.interpret)
        values = common.gather(self.kv_ref, index, jnp.broadcast_to(self.on_device[:, None], (n, size)), 0)
        if self.host_ref is None:
            return values
        host_index = common.row_block((self.layer,), self.host_slot, start, size, self.interpret)
        host = common.gather(self.host_ref, host_index, jnp.broadcast_to(self.from_host[:, None], (n, size)), 0)
        self.pending.append((index, host, jnp.broadcast_to(self.writes[:, None], (n, size))))
        return jnp.where(self.from_host[:, None], host, values)

    def column(self, word: int):
        """row[block_k]: word `word` of each selected row (read, and written, as a block above)."""
        values = common.gather(self.kv_ref, (*self.row, self.slot, word), self.on_device, 0)
        if self.host_ref is None:
            return values
        host = common.gather(self.host_ref, (self.layer, self.host_slot, word), self.from_host, 0)
        self.pending.append(((*self.row, self.slot, word), host, self.writes))
        return jnp.where(self.from_host, host, values)

    def write_back(self) -> None:
        """Stores the rows read from the host in their device slots: call once every read of the
        block is issued, before the block's compute, so the host values need no registers past it."""
        for index, values, mask in self.pending:
            common.scatter(self.kv_out_ref, index, values, mask)
        self.pending = []


def _split_refs(refs, reads_host: bool):
    """(host refs (host_slots_ref, pool_ref) or None, output refs, kv output ref or None)."""
    if not reads_host:
        return None, refs, None
    host_slots_ref, pool_ref, *out_refs = refs
    return (host_slots_ref, pool_ref), out_refs[:-1], out_refs[-1]


def _attention_kernel(
    layer_ref,  # i32[1]
    query_ref,  # [R, H, W]
    slots_ref,  # i32[R, K]
    kv_ref,  # row[L, R, S, W]
    *refs,  # reads_host: i32[R, K] host slots, row[L, S_host, W] pinned pool; then the outputs:
    #         f32[R, H, D]; split-K: f32[N, R, H, D] partial sums, f32[N, R, H] maxima and totals;
    #         reads_host: row[L, R, S, W] kv again (aliased: the misses written to their slots)
    latent_dim: int,
    sm_scale: float,
    block_h: int,
    block_k: int,
    num_splits: int,
    interpret: bool,
    reads_host: bool = False,
    keys_major: bool = False,
    transposed_acc: bool = False,
):
    host_refs, out_refs, kv_out_ref = _split_refs(refs, reads_host)
    r, head_block = pl.program_id(0), pl.program_id(1)
    H, W = query_ref.shape[1], query_ref.shape[2]
    K = slots_ref.shape[1]
    layer = layer_ref[0]
    precision = _dot_precision(kv_ref.dtype)
    safe_heads, head_ok = common.head_block(head_block * block_h, block_h, H)
    value_pieces = common.power_of_2_pieces(latent_dim)
    key_pieces = value_pieces + [(latent_dim + o, s) for o, s in common.power_of_2_pieces(W - latent_dim)]
    queries = [
        common.gather_rows(query_ref, (r,), safe_heads, head_ok, o, s, interpret).astype(kv_ref.dtype) for o, s in key_pieces
    ]  # [block_h, s] each

    def body(step, carry):
        running_max, total, accs = carry
        k = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        slot = common.gather(slots_ref, (r, common.safe_index(k, k < K, K)), k < K, -1)
        valid = slot >= 0
        rows = _RowReader(kv_ref, host_refs, kv_out_ref, layer, r, head_block, slot, valid, k, K, interpret)
        keys = [rows.block(o, s) for o, s in key_pieces]  # row[block_k, s] each
        rows.write_back()  # every read issued: the host rows die here, before the dots (registers)
        pairs = [(kk, q) if keys_major else (q, kk) for q, kk in zip(queries, keys)]
        scores = sum(
            jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
            for a, b in pairs
        ) * sm_scale  # f32[block_h, block_k], or [block_k, block_h] keys_major
        new_max, total, rescale, weights = _online_softmax(running_max, total, scores, valid, keys_axis=0 if keys_major else 1)
        weights = weights.astype(kv_ref.dtype)
        accs = [_accumulate(acc, weights, v, rescale, keys_major, transposed_acc, precision) for acc, v in zip(accs, keys[: len(value_pieces)])]
        return new_max, total, accs

    init = (
        jnp.full((block_h,), _RUNNING_MAX_START, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        [jnp.zeros((s, block_h) if transposed_acc else (block_h, s), jnp.float32) for _, s in value_pieces],
    )
    running_max, total, accs = jax.lax.fori_loop(*_key_block_range(K, block_k, num_splits), body, init)
    if transposed_acc:
        accs = [acc.T for acc in accs]  # f32[block_h, s] each
    _store(out_refs, r, safe_heads, head_ok, value_pieces, accs, running_max, total, num_splits, interpret)


def _key_block_range(K: int, block_k: int, num_splits: int):
    """(first, end) key blocks of this program: all of them, or its split's share (program axis 2)."""
    steps = pl.cdiv(K, block_k)
    if num_splits == 1:
        return 0, steps
    per_split = pl.cdiv(steps, num_splits)
    first = pl.program_id(2) * per_split
    return first, jnp.minimum(first + per_split, steps)


def _store(out_refs, r, safe_heads, head_ok, value_pieces, accs, running_max, total, num_splits, interpret):
    """The program's result: normalised rows of out[r], or (split-K) its unnormalised partial sums,
    running maxima and totals for combine_splits. accs: f32[block_h, s] per value piece."""
    block_h = head_ok.shape[0]
    if num_splits == 1:
        (out_ref,) = out_refs
        scale = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
        leading = (r,)
    else:
        out_ref, max_ref, total_ref = out_refs
        scale = jnp.ones_like(total)
        leading = (pl.program_id(2), r)
        common.scatter(max_ref, (*leading, safe_heads), running_max, head_ok)
        common.scatter(total_ref, (*leading, safe_heads), total, head_ok)
    for (o, s), acc in zip(value_pieces, accs):
        common.scatter(
            out_ref, common.row_block(leading, safe_heads, o, s, interpret), acc * scale[:, None], jnp.broadcast_to(head_ok[:, None], (block_h, s))
        )


def combine_splits(partial, maxima, totals):
    """Split-K partial results -> f32[R, H, D]: partial f32[N, R, H, D] (unnormalised sums of each
    split's keys), maxima, totals f32[N, R, H] (its running max and softmax total). Rescales
    every split to the overall max, as flash-decoding does; zero where no key was valid."""
    top = jnp.max(maxima, axis=0)  # f32[R, H]
    weight = jnp.exp(maxima - top[None])  # f32[N, R, H]: 0 for a split that saw no valid key
    total = jnp.sum(weight * totals, axis=0)  # f32[R, H]
    out = jnp.sum(weight[..., None] * partial, axis=0)  # f32[R, H, D]
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def _interleave4(p0, p1, p2, p3):
    """Four [N, n] planes -> [N, 4n] with column 4w + j = p_j[:, w]: two levels of 2-way stacks
    on the last axis (Triton's join) and a reshape that keeps element order."""
    inner = jnp.stack([jnp.stack([p0, p2], axis=-1), jnp.stack([p1, p3], axis=-1)], axis=-1)  # [N, n, 2, 2]
    return inner.reshape(p0.shape[0], 4 * p0.shape[1])


def _dequantized_block(rows, latent_dim: int, group_size: int, rope_dim: int, compute_dtype) -> tuple:
    """One block of packed fp8 rows (rows: a _RowReader over block_k selected rows) -> (latent
    [block_k, D], rope [block_k, rope]) in compute_dtype, the values layout.unpack gives: fp8
    bytes back in latent order (joined as bytes: the cheapest layout change), times their
    group's scale in f32, then compute_dtype; the rope's bf16 halves as they are. A masked entry
    reads zero words: zero values, zero scale. The three reads cover the whole stored row; every
    read is issued before rows.write_back() (host rows die there, before any compute)."""
    D, G = latent_dim, group_size
    num_groups = D // G
    scale_word, rope_word = D // 4, D // 4 + num_groups  # first scale word, first rope word
    block_k = rows.slot.shape[0]
    words = rows.block(0, D // 4)  # u32[block_k, D / 4]
    scale_words = [rows.column(scale_word + g) for g in range(num_groups)]  # u32[block_k] each
    rope_words = rows.block(rope_word, rope_dim // 2)  # u32[block_k, rope / 2]
    rows.write_back()
    byte_of = lambda j: ((words >> (8 * j)) & 0xFF).astype(jnp.uint8)  # noqa: E731 (u8: byte j of each word)
    latent = _interleave4(*(byte_of(j) for j in range(4)))  # u8[block_k, D], latent order
    latent = jax.lax.bitcast_convert_type(latent, jnp.float8_e4m3fn).astype(jnp.float32)
    column = jnp.arange(D, dtype=jnp.int32)[None, :]  # i32[1, D]: latent column
    scale = 0.0
    for g, word in enumerate(scale_words):  # f32[block_k, D]: each column's group scale, by selects (no reshape)
        scale = jnp.where(column // G == g, jax.lax.bitcast_convert_type(word, jnp.float32)[:, None], scale)
    halves = [((rope_words >> (16 * j)) & 0xFFFF).astype(jnp.uint16) for j in range(2)]  # joined as u16, then bf16
    rope = jnp.stack(halves, axis=-1).reshape(block_k, rope_dim)  # u16[block_k, rope], rope order
    rope = jax.lax.bitcast_convert_type(rope, jnp.bfloat16).astype(compute_dtype)
    return (latent * scale).astype(compute_dtype), rope


def _dequantize_rows_kernel(
    layer_ref,  # i32[1]
    slots_ref,  # i32[R, K]
    kv_ref,  # u32[L, R, S, W]: packed fp8 rows
    out_ref,  # [1, R, K, D + rope] in compute_dtype: entry k of request r's selected rows, dequantised
    *,
    latent_dim: int,
    group_size: int,
    rope_dim: int,
    block_k: int,
    compute_dtype,
    interpret: bool,
):
    """fp8_form "dequantize_kernel", step 1 for block kb of request r's selected rows: the
    entries' packed rows read (16-byte loads of contiguous words), dequantised once
    (_dequantized_block) and written as dense rows; entries with no slot read and write zeros
    (the attention masks them)."""
    r, kb = pl.program_id(0), pl.program_id(1)
    K = slots_ref.shape[1]
    k = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)  # i32[block_k]
    in_row = k < K
    safe_k = common.safe_index(k, in_row, K)
    slot = common.gather(slots_ref, (r, safe_k), in_row, -1)
    rows = _RowReader(kv_ref, None, None, layer_ref[0], r, 0, slot, slot >= 0, k, K, interpret)
    latent, rope = _dequantized_block(rows, latent_dim, group_size, rope_dim, compute_dtype)
    for offset, values in ((0, latent), (latent_dim, rope)):
        size = values.shape[1]
        mask = jnp.broadcast_to(in_row[:, None], (block_k, size))
        common.scatter(out_ref, common.row_block((0, r), safe_k, offset, size, interpret), values, mask)


def _fp8_attention_kernel(
    layer_ref,  # i32[1]
    query_ref,  # [R, H, D + rope]
    slots_ref,  # i32[R, K]
    kv_ref,  # u32[L, R, S, W]: packed fp8 rows
    *refs,  # as _attention_kernel's
    latent_dim: int,
    group_size: int,
    rope_dim: int,
    sm_scale: float,
    block_h: int,
    block_k: int,
    compute_dtype,
    num_splits: int,
    interpret: bool,
    reads_host: bool = False,
):
    host_refs, out_refs, kv_out_ref = _split_refs(refs, reads_host)
    r, head_block = pl.program_id(0), pl.program_id(1)
    H, K = query_ref.shape[1], slots_ref.shape[1]
    D, G = latent_dim, group_size
    layer = layer_ref[0]
    precision = _dot_precision(compute_dtype)
    safe_heads, head_ok = common.head_block(head_block * block_h, block_h, H)

    def load_query(start, size):
        block = common.row_block((r,), safe_heads, start, size, interpret)
        return common.gather(query_ref, block, jnp.broadcast_to(head_ok[:, None], (block_h, size)), 0).astype(compute_dtype)

    q_latent, q_rope = load_query(0, D), load_query(D, rope_dim)  # [block_h, D], [block_h, rope]

    def dot_t(a, b):  # a [M, n] . b [N, n]^T -> f32[M, N]
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)

    def body(step, carry):
        running_max, total, acc = carry
        k = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        slot = common.gather(slots_ref, (r, common.safe_index(k, k < K, K)), k < K, -1)
        valid = slot >= 0
        rows = _RowReader(kv_ref, host_refs, kv_out_ref, layer, r, head_block, slot, valid, k, K, interpret)
        keys, rope = _dequantized_block(rows, D, G, rope_dim, compute_dtype)  # [block_k, D], [block_k, rope]
        scores = (dot_t(q_latent, keys) + dot_t(q_rope, rope)) * sm_scale  # f32[block_h, block_k]
        new_max, total, rescale, weights = _online_softmax(running_max, total, scores, valid)
        acc = acc * rescale[:, None] + jax.lax.dot(
            weights.astype(compute_dtype), keys, precision=precision, preferred_element_type=jnp.float32
        )
        return new_max, total, acc

    init = (
        jnp.full((block_h,), _RUNNING_MAX_START, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        jnp.zeros((block_h, D), jnp.float32),
    )
    running_max, total, acc = jax.lax.fori_loop(*_key_block_range(K, block_k, num_splits), body, init)
    _store(out_refs, r, safe_heads, head_ok, [(0, D)], [acc], running_max, total, num_splits, interpret)


def _fp8_planes_kernel(
    layer_ref,  # i32[1]
    query_ref,  # [R, H, D + rope], columns in plane order (plane_permutation)
    slots_ref,  # i32[R, K]
    kv_ref,  # u32[L, R, S, W]: packed fp8 rows
    *refs,  # as _attention_kernel's, latent columns in plane order
    latent_dim: int,
    group_size: int,
    rope_dim: int,
    sm_scale: float,
    block_h: int,
    block_k: int,
    compute_dtype,
    num_splits: int,
    interpret: bool,
    reads_host: bool = False,
):
    """fp8 rows without putting bytes back in latent order: byte j of every word is a plane of
    the latent (columns 4w + j), and the query and output columns are permuted to match
    (plane_permutation), so each plane goes to the matmuls as it is, scaled by selects on its
    columns' groups. (One plane per group and byte, 34 dots per key block, measured slower
    everywhere on the H200: docs/PERFORMANCE.md, 2026-12-03.)"""
    host_refs, out_refs, kv_out_ref = _split_refs(refs, reads_host)
    r, head_block = pl.program_id(0), pl.program_id(1)
    H, K = query_ref.shape[1], slots_ref.shape[1]
    D, G = latent_dim, group_size
    num_groups, words_per_group, rope_words = D // G, G // 4, rope_dim // 2
    scale_word, rope_word = D // 4, D // 4 + num_groups  # first scale word, first rope word
    layer = layer_ref[0]
    precision = _dot_precision(compute_dtype)
    safe_heads, head_ok = common.head_block(head_block * block_h, block_h, H)
    value_pieces = [(j * (D // 4), D // 4) for j in range(4)]  # plane j's output columns
    queries = [
        common.gather_rows(query_ref, (r,), safe_heads, head_ok, column, n, interpret).astype(compute_dtype) for column, n in value_pieces
    ]  # [block_h, n] each
    rope_queries = [
        common.gather_rows(query_ref, (r,), safe_heads, head_ok, D + j * rope_words, rope_words, interpret).astype(compute_dtype)
        for j in range(2)
    ]  # [block_h, rope / 2] each: rope columns 2w + j

    def dot_t(a, b):  # a [M, n] . b [N, n]^T -> f32[M, N]
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)

    def body(step, carry):
        running_max, total, accs = carry
        k = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        slot = common.gather(slots_ref, (r, common.safe_index(k, k < K, K)), k < K, -1)
        valid = slot >= 0
        rows = _RowReader(kv_ref, host_refs, kv_out_ref, layer, r, head_block, slot, valid, k, K, interpret)

        # f32[block_k] per group: a masked entry reads a zero word, so zero values.
        scales = [jax.lax.bitcast_convert_type(rows.column(scale_word + g), jnp.float32) for g in range(num_groups)]
        words = rows.block(0, D // 4)  # u32[block_k, D / 4]
        group = jnp.arange(D // 4, dtype=jnp.int32)[None, :] // words_per_group  # plane column w is latent 4w + j: group w // (G / 4)
        scale = 0.0
        for g in range(num_groups):  # f32[block_k, D / 4]: each plane column's group scale
            scale = jnp.where(group == g, scales[g][:, None], scale)
        keys = []
        for j in range(4):
            plane = jax.lax.bitcast_convert_type(((words >> (8 * j)) & 0xFF).astype(jnp.uint8), jnp.float8_e4m3fn)
            keys.append((plane.astype(jnp.float32) * scale).astype(compute_dtype))  # [block_k, D / 4]: latent 4w + j
        words = rows.block(rope_word, rope_words)
        rows.write_back()  # every read issued: the host rows die here, before the dots (registers)
        ropes = [
            jax.lax.bitcast_convert_type(((words >> (16 * j)) & 0xFFFF).astype(jnp.uint16), jnp.bfloat16).astype(compute_dtype) for j in range(2)
        ]  # [block_k, rope / 2] each: rope columns 2w + j
        scores = sum(dot_t(q, kk) for q, kk in zip(queries + rope_queries, keys + ropes)) * sm_scale  # f32[block_h, block_k]
        new_max, total, rescale, weights = _online_softmax(running_max, total, scores, valid)
        weights = weights.astype(compute_dtype)
        accs = [
            acc * rescale[:, None] + jax.lax.dot(weights, v, precision=precision, preferred_element_type=jnp.float32) for acc, v in zip(accs, keys)
        ]
        return new_max, total, accs

    init = (
        jnp.full((block_h,), _RUNNING_MAX_START, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        [jnp.zeros((block_h, n), jnp.float32) for _, n in value_pieces],
    )
    running_max, total, accs = jax.lax.fori_loop(*_key_block_range(K, block_k, num_splits), body, init)
    _store(out_refs, r, safe_heads, head_ok, value_pieces, accs, running_max, total, num_splits, interpret)


FP8_FORMS = ("interleave", "planes", "dequantize_first", "dequantize_kernel")


def plane_permutation(latent_dim: int, rope_dim: int, form: str) -> np.ndarray:
    """i32[D + rope]: column c of a plane-ordered query (or output) is column perm[c] of the
    logical one. Byte j of word w holds latent 4w + j; "planes" orders columns by byte, then
    word, and the rope's bf16 pairs by half, then pair. The other forms read columns in latent
    order: the identity."""
    D, rope = latent_dim, rope_dim
    if form != "planes":
        return np.arange(D + rope, dtype=np.int32)
    latent = [4 * np.arange(D // 4) + j for j in range(4)]
    halves = [D + 2 * np.arange(rope // 2) + j for j in range(2)]
    return np.concatenate(latent + halves).astype(np.int32)


def _check_fp8_kernel_sizes(layout) -> None:
    """The kernel holds the latent and the rope words as single tiles: Triton needs power-of-two
    sizes (512 / 4 = 128 words and 64 / 2 = 32 words for DeepSeek-V3.2)."""
    D, rope = layout.latent_dim, layout.rope_dim
    for name, n in (("latent_dim / 4", D // 4), ("rope_dim / 2", rope // 2)):
        if n & (n - 1):
            raise ValueError(f"the Pallas fp8 attention needs {name} ({n}) a power of two; use implementation='reference'")


def default_launch_shape(num_requests: int, num_heads: int, quantized: bool = False) -> dict:
    """The kernel's launch shape (block_h, block_k, num_warps, num_stages) for R x H heads.

    Measured on the H200 (docs/PERFORMANCE.md, top_k 2048, bf16): 64-head blocks win once the
    grid is large (batch 128 x 128 heads: 406 us vs 614 us for 32-head blocks; with 3 pipeline
    stages 351 us, 2026-12-03), 32-head blocks with 128-row key blocks when it is small (batch
    16 x 128 heads: 105 us vs 207 us); from 50 x 64 heads on, 64-head blocks with 3 stages win
    (50 x 64: 103 vs 110 us; 50 x 128: 201 vs 210; 2026-12-03). fp8 rows (quantized) read by
    the kernel's own forms dequantise each key block on top of that: FP8_LAUNCH."""
    if quantized:
        return dict(FP8_LAUNCH)
    if num_requests * num_heads >= 3072:
        return dict(block_h=64, block_k=64, num_warps=8, num_stages=3)
    return dict(block_h=32, block_k=128, num_warps=8, num_stages=2)


# Measured on the H200 at batch 128 x 128 heads, top_k 2048 (us per call, back to back): 64-head
# blocks of 32 keys, 8 warps, 2 stages: 741; 1 stage: 881; 64 keys, 1 stage: 887; 32-head blocks
# of 64 keys, 8 warps: 1182; 4 warps: 1986; 64 keys with 2 stages or 128-head blocks need more
# than the 227 KB of shared memory. bench_kernels (L2 flushed): 701 us, vs 415 us for bf16 rows.
# With the planes form (2026-12-03, bench_kernels, device time): 64-key blocks, 1 stage: 583 us
# at 128 x 128 (interleave, 32-key blocks: 693) and 301 us at 50 x 128 (351); 32-key blocks 840
# and 421: the planes pay off only with the larger key block.
FP8_LAUNCH = dict(block_h=64, block_k=64, num_warps=8, num_stages=1)
# How fp8 rows are read (FP8_FORMS). "dequantize_first" measured fastest at the DeepSeek-V3.2
# rank's 50 x 128 (H200, 2026-12-03: 282 us with 64-head blocks and 3 stages, planes 288-303,
# interleave 353; with unsplit keys 253) and compiles the plain-rows kernel (3 dots, where
# planes have 10). Compile + first run measured 1.3-1.5 s for either form (bench_kernels'
# first_call_s), so the planes kernel did not cause the rank engine's slower start that
# session (292.7 s vs 176.5 s; its cause was not found).
DEFAULT_FP8_FORM = "dequantize_first"
# q . k as keys x heads (scores^T) instead of heads x keys. Triton gives a dot whose result feeds
# another dot (flash attention's chain) all its warps along M; with the default 64-head blocks and
# 8 warps that is two warpgroups over 64 rows, each computing the whole [64, block_k] scores (the
# PTX holds wgmma m64n32k16 for both halves of the keys in each warpgroup: q . k, 53% of the FLOPs,
# done twice; pip Triton 3.6 for sm_90, benchmarks/probes/kernel_resources.py, 2026-12-04).
# keys_major with 128-key blocks puts the keys on M, one warpgroup a half (the weights then cross
# to the values' dot through shared memory); transposed_acc also accumulates [columns, heads], so
# both dots keep their long side on M and one layout (compiled: 632 B of spills a thread against
# keys_major's 728 and the default's 376). Not yet timed on the H200: off until attention_h200.sh's
# rows say otherwise.
KEYS_MAJOR = False


def _plane_widths(layout) -> tuple[int, int]:
    """(latent plane width, rope half width) the planes form hands to the matmuls."""
    return layout.latent_dim // 4, layout.rope_dim // 2


def _check_fp8_form(form: str, layout) -> None:
    if form not in FP8_FORMS:
        raise ValueError(f"fp8_form {form!r} is not one of {FP8_FORMS}")
    if form == "planes" and not common.interpret_mode() and min(_plane_widths(layout)) < 16:
        raise ValueError(f"fp8_form 'planes' hands Triton's dots planes of {_plane_widths(layout)} columns; they need >= 16")


@common.lower_once
def sparse_mla_attention_pallas(
    query, kv, layer, slots, *, latent_dim, sm_scale, layout=None, block_h=None, block_k=None, num_warps=None, num_stages=None,
    num_splits=None, fp8_form=None, keys_major=None, transposed_acc=None,
):
    """The Pallas kernel: shapes as sparse_mla_attention_reference; the launch shape defaults
    to default_launch_shape(R, H). One program per (request, head block), or with num_splits
    N > 1 (flash-decoding's split-K; default default_num_splits) per (request, head block, N-th
    of the keys), whose partial results combine_splits merges. fp8 rows (layout) are
    dequantised in the kernel; its matmuls run in the query's dtype (bf16, or f32 at full
    precision for an f32 query), as plain rows' run in the row dtype. fp8_form (fp8 rows; default
    DEFAULT_FP8_FORM): how the kernel reads the packed bytes, one of FP8_FORMS (see
    _fp8_planes_kernel and plane_permutation). keys_major (rows the kernel reads unpacked: plain
    and dequantize_first; default KEYS_MAJOR): q . k computed as keys x heads (see KEYS_MAJOR);
    transposed_acc (with keys_major): the values' product accumulated as [columns, heads]."""
    return _attention_pallas(
        query, kv, layer, slots, None, latent_dim=latent_dim, sm_scale=sm_scale, layout=layout, block_h=block_h, block_k=block_k,
        num_warps=num_warps, num_stages=num_stages, num_splits=num_splits, fp8_form=fp8_form, keys_major=keys_major,
        transposed_acc=transposed_acc,
    )


# The form fp8 rows are read in when the kernel also reads misses from the host: one of the
# kernel's own forms (dequantize_first gathers every row in XLA first, which cannot read the pool).
READING_HOST_FP8_FORM = "interleave"


def sparse_mla_attention_reading_host_pallas(
    query, kv, layer, slots, host_slots, pool, *, latent_dim, sm_scale, layout=None, fp8_form=None, **launch
):
    """The Pallas kernel reading this step's misses straight from the pinned pool -> (f32[R, H, D], kv).

    host_slots i32[R, K]: the pool row (of `layer`) of each entry to read from the host, -1 for
    entries already on the device; pool row[L, S_host, W] in pinned host memory. Each such entry's
    row is read over PCIe by the programs that attend over it and written into its device slot
    (slots[r, k]) of kv by head block 0, in place: kv comes back with the misses placed, as the
    swap-in copy would have left it, and the output equals sparse_mla_attention_pallas over that
    kv bit for bit. Not lower_once: the pool's memory kind is the outer jit's to keep (row_copy).
    fp8 rows are read in READING_HOST_FP8_FORM (or the fp8_form given; not dequantize_first)."""
    check_inputs(query, kv, layer, slots, latent_dim, layout)
    check_host_inputs(kv, slots, host_slots, pool)
    fp8_form = fp8_form or READING_HOST_FP8_FORM
    if is_quantized(layout) and fp8_form not in ("interleave", "planes"):
        raise ValueError(f"reading misses from the host needs fp8_form 'interleave' or 'planes' (the kernel's own reads), got {fp8_form!r}")
    return _attention_pallas(
        query, kv, jnp.asarray(layer, jnp.int32), slots, (host_slots.astype(jnp.int32), pool), latent_dim=latent_dim, sm_scale=sm_scale,
        layout=layout, fp8_form=fp8_form, **launch,
    )


def _attention_pallas(
    query, kv, layer, slots, host, *, latent_dim, sm_scale, layout=None, block_h=None, block_k=None, num_warps=None, num_stages=None,
    num_splits=None, fp8_form=None, keys_major=None, transposed_acc=None,
):
    """The launch behind both entries; host: None, or (host_slots i32[R, K], pool row[L, S_host,
    W]) -> (out, kv) with the misses read from the pool and placed in kv."""
    check_inputs(query, kv, layer, slots, latent_dim, layout)
    fp8_form = fp8_form or DEFAULT_FP8_FORM
    if is_quantized(layout) and fp8_form in ("dequantize_first", "dequantize_kernel"):
        return _dequantize_then_attend(
            query, kv, layer, slots, latent_dim=latent_dim, sm_scale=sm_scale, layout=layout, block_h=block_h, block_k=block_k,
            num_warps=num_warps, num_stages=num_stages, num_splits=num_splits, in_kernel=fp8_form == "dequantize_kernel",
            keys_major=keys_major, transposed_acc=transposed_acc,
        )
    keys_major = KEYS_MAJOR if keys_major is None else keys_major
    transposed_acc = bool(transposed_acc)
    if (keys_major or transposed_acc) and is_quantized(layout):
        raise ValueError(f"keys_major applies to rows the kernel reads unpacked (plain rows, dequantize_first), not fp8_form {fp8_form!r}")
    if transposed_acc and not keys_major:
        raise ValueError("transposed_acc multiplies keys-major weights: it needs keys_major")
    R, H, _ = query.shape
    shape = default_launch_shape(R, H, is_quantized(layout))
    if keys_major and shape["block_h"] >= 64:  # the wgmma launch: 128 keys on M, one warpgroup a half
        shape = dict(shape, block_k=128, num_stages=1)  # two stages of 128 keys overflow shared memory
    block_h = block_h or shape["block_h"]
    block_k = block_k or shape["block_k"]
    num_warps = num_warps or shape["num_warps"]
    num_stages = num_stages or shape["num_stages"]
    # Triton dots need every dimension >= 16: pad the head block and mask the extra heads.
    block_h = max(16, min(block_h, common.next_power_of_2(H)))
    block_k = max(16, min(block_k, common.next_power_of_2(slots.shape[1])))
    if num_splits is None:
        num_splits = default_num_splits(R * pl.cdiv(H, block_h), pl.cdiv(slots.shape[1], block_k))
    permutation = None
    if is_quantized(layout):
        _check_fp8_kernel_sizes(layout)
        compute_dtype = jnp.float32 if jnp.dtype(query.dtype) == jnp.float32 else jnp.bfloat16
        _check_fp8_form(fp8_form, layout)
        if fp8_form == "planes":
            permutation = plane_permutation(latent_dim, layout.rope_dim, fp8_form)  # i32[D + rope]
            query = query[..., permutation]
        kernel = functools.partial(
            _fp8_planes_kernel,
            latent_dim=latent_dim,
            group_size=layout.group_size,
            rope_dim=layout.rope_dim,
            sm_scale=float(sm_scale),
            block_h=block_h,
            block_k=block_k,
            compute_dtype=compute_dtype,
            num_splits=num_splits,
            interpret=common.interpret_mode(),
        ) if permutation is not None else functools.partial(
            _fp8_attention_kernel,
            latent_dim=latent_dim,
            group_size=layout.group_size,
            rope_dim=layout.rope_dim,
            sm_scale=float(sm_scale),
            block_h=block_h,
            block_k=block_k,
            compute_dtype=compute_dtype,
            num_splits=num_splits,
            interpret=common.interpret_mode(),
        )
    else:
        kernel = functools.partial(
            _attention_kernel,
            latent_dim=latent_dim,
            sm_scale=float(sm_scale),
            block_h=block_h,
            block_k=block_k,
            num_splits=num_splits,
            interpret=common.interpret_mode(),
            keys_major=keys_major,
            transposed_acc=transposed_acc,
        )
    f32 = jnp.float32
    out_shape = [jax.ShapeDtypeStruct((R, H, latent_dim), f32)]
    if num_splits > 1:
        out_shape = [jax.ShapeDtypeStruct((num_splits, R, H, latent_dim), f32)] + [jax.ShapeDtypeStruct((num_splits, R, H), f32)] * 2
    grid = (R, pl.cdiv(H, block_h)) + ((num_splits,) if num_splits > 1 else ())
    operands = [jnp.reshape(layer, (1,)).astype(jnp.int32), query, slots, kv]
    aliases = {}
    if host is not None:  # the misses' host slots and the pool; kv comes back as the last output
        kernel = functools.partial(kernel, reads_host=True)
        operands += list(host)
        aliases = {3: len(out_shape)}
        out_shape = out_shape + [jax.ShapeDtypeStruct(kv.shape, kv.dtype)]
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[common.any_spec()] * len(operands),
        out_specs=[common.any_spec()] * len(out_shape),
        input_output_aliases=aliases,
        compiler_params=common.triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=common.interpret_mode(),
        name="hisparse_sparse_mla_attention" if host is None else "hisparse_sparse_mla_attention_reading_host",
    )(*operands)
    out = outs[:3] if num_splits > 1 else outs[:1]
    out = out[0] if num_splits == 1 else combine_splits(*out)  # f32[R, H, D]
    if permutation is not None:  # the kernel wrote latent columns in plane order
        out = out[..., np.argsort(permutation[:latent_dim])]
    return out if host is None else (out, outs[-1])


# Selected rows per program of the dequantising kernel (fp8_form "dequantize_kernel"; not timed):
# 16 rows x 4 warps hold 70 registers, 7 programs an SM, no spills, where 64 rows spilled (255
# registers) and 32 rows x 8 warps made 3 an SM (benchmarks/probes/kernel_resources.py, estimates).
DEQUANTIZE_BLOCK_K, DEQUANTIZE_WARPS = 16, 4


def _dequantize_then_attend(query, kv, layer, slots, *, latent_dim, sm_scale, layout, in_kernel=False, **launch):
    """fp8_form "dequantize_first": one XLA fusion gathers each request's selected fp8 rows and
    writes them dequantised, in the query's dtype, as a dense [1, R, K, D + rope] block (once
    per request, where the kernel's forms dequantise once per head block); the plain-rows kernel
    then attends over it. Costs the block's write and read: 2 x 1152 B per selected bf16 row.
    in_kernel (fp8_form "dequantize_kernel"): the same dense block made by a Pallas kernel
    (_dequantize_rows_kernel, the interleave form's dequantisation; the same values bit for bit)
    where XLA's fusion moved ~2.3 TB/s at DeepSeek-V3.2's rank (4.98 ms a step at 50 running)."""
    R, K = slots.shape
    valid = slots >= 0  # bool[R, K]
    compute_dtype = jnp.float32 if jnp.dtype(query.dtype) == jnp.float32 else jnp.bfloat16
    if in_kernel:
        _check_fp8_kernel_sizes(layout)
        block_k = max(16, min(DEQUANTIZE_BLOCK_K, common.next_power_of_2(K)))
        dense = pl.pallas_call(
            functools.partial(
                _dequantize_rows_kernel, latent_dim=latent_dim, group_size=layout.group_size, rope_dim=layout.rope_dim,
                block_k=block_k, compute_dtype=compute_dtype, interpret=common.interpret_mode(),
            ),
            out_shape=jax.ShapeDtypeStruct((1, R, K, latent_dim + layout.rope_dim), compute_dtype),
            grid=(R, pl.cdiv(K, block_k)),
            in_specs=[common.any_spec()] * 3,
            out_specs=common.any_spec(),
            compiler_params=common.triton_params(num_warps=DEQUANTIZE_WARPS, num_stages=1),
            interpret=common.interpret_mode(),
            name="hisparse_dequantize_rows",
        )(jnp.reshape(layer, (1,)).astype(jnp.int32), slots, kv)  # [1, R, K, D + rope]
    else:
        requests = common.request_row(jnp.arange(R, dtype=jnp.int32), kv)[:, None]  # i32[R, 1]
        rows = kv[layer, requests, jnp.where(valid, slots, 0)]  # u32[R, K, W]: one gather, no layer slice
        latent, rope = layout.unpack(rows)  # f32[R, K, D], f32[R, K, rope]
        dense = jnp.concatenate([latent, rope], axis=-1).astype(compute_dtype)[None]  # [1, R, K, D + rope]
    dense_slots = jnp.where(valid, jnp.arange(K, dtype=jnp.int32)[None, :], -1)  # i32[R, K]
    launch = {name: value for name, value in launch.items() if value is not None}
    return sparse_mla_attention_pallas(query, dense, jnp.int32(0), dense_slots, latent_dim=latent_dim, sm_scale=sm_scale, **launch)


# About two waves of programs on the H200's 132 SMs: below that, split the keys.
TARGET_PROGRAMS = 264
MAX_SPLITS = 16


def default_num_splits(programs: int, key_blocks: int) -> int:
    """Key splits for `programs` (request, head block) programs over `key_blocks` blocks of keys:
    1 from two thirds of a wave on, else enough for ~TARGET_PROGRAMS programs (at most
    MAX_SPLITS, at least 2 key blocks per split). H200, 2026-12-03, top_k 2048, 64-head blocks:
    unsplit wins at 100 programs (50 x 128 heads: 175 vs 202 us with 3 splits over bf16 rows,
    253 vs 282 over fp8 rows) and 128 (128 x 64: 183 vs 211); splitting wins at 50 (50 x 64:
    103 vs 175)."""
    if programs >= TARGET_PROGRAMS // 3:
        return 1
    return max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // programs), key_blocks // 2))
