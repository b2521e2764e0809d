"""Top-k positions of masked indexer scores, without sorting the row.

    topk_indices(scores f32[b, C], k) -> i32[b, K]

is lax.top_k's choice and order (value descending, ties by the lower position) with every -inf
(masked) position reported as -1 at the tail, and positions past C (K > C) -1 too:
models/indexer.py's select_topk on scores already masked. -0.0 and +0.0 tie (the reference maps
-0 to +0 first: lax.top_k ties them on the GPU, whose sort is CUB's radix sort, but ranks +0
first on the CPU). A NaN score ranks first and is reported as -1, as there.

The kernels never sort the C scores. One program per request row:
  1. each score becomes a signed-int key in float order (bits ^ (sign ? 0x7fffffff : 0));
     -inf and below (masked) become INVALID;
  2. the K-th largest key T by bisection on the key's integer range: each step counts the keys
     >= mid in one pass over the row (held in registers when it fits one chunk); it stops early
     once exactly K keys are >= mid;
  3. one pass keeps the keys > T and the lowest-position keys == T, K in all, and compacts them
     in position order to a scratch row (one cumsum gives each kept key its slot);
  4. the K kept (key, position) pairs are ordered by (key desc, position asc) with a bitonic
     network in registers (Triton's tl.sort, written with reshapes and 2-wide sums; Pallas has
     no sort), and the positions written, -1 for INVALID and NaN keys.
order: step 4 by lax.sort of the K kept pairs ("xla", the default: on the H200 XLA's sort of
b x 2048 pairs beat the bitonic network in Pallas), in a second kernel ("kernel", fewer warps
than the select needs), or in the selecting kernel ("fused").

Shape letters: b requests, C scores per request, K selected, P = K rounded up to a power of 2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.common import check_rank
from pallas_kernels.indexer_scores import resolve_implementation

INVALID = np.iinfo(np.int32).min  # the key of a masked position (below every real score's key)
_NEG_INF_KEY = int(np.int32(np.uint32(0xFF800000).view(np.int32)) ^ 0x7FFFFFFF)  # key(-inf)
_POS_INF_KEY = 0x7F800000  # key(+inf); larger keys are NaNs


def topk_reference(scores: jax.Array, k: int) -> jax.Array:
    """scores f32[..., C] (-inf: not allowed) -> i32[..., K]: lax.top_k's positions, -1 where
    the score is -inf (and past C when K > C). models/indexer.py's select_topk."""
    take = min(k, scores.shape[-1])
    # -0.0 -> +0.0: lax.top_k on the GPU (a CUB radix sort) ties them, on the CPU +0 ranks first.
    scores = jnp.where(scores == 0, 0.0, scores)
    values, positions = jax.lax.top_k(scores, take)  # [..., take]
    topk = jnp.where(values > -jnp.inf, positions, -1).astype(jnp.int32)
    if take < k:
        topk = jnp.pad(topk, [(0, 0)] * (topk.ndim - 1) + [(0, k - take)], constant_values=-1)
    return topk


def _sort_keys(x: jax.Array) -> jax.Array:
    """f32[n] -> i32[n]: signed ints in the floats' order (-0 = +0, NaN above +inf); -inf (and
    -NaN) -> INVALID."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    key = jnp.where(key == -1, 0, key)  # -0.0 (key -1) ties with +0.0, as on the GPU
    return jnp.where(key > _NEG_INF_KEY, key, INVALID)


def _count(mask: jax.Array) -> jax.Array:
    return jnp.sum(mask.astype(jnp.int32))


def _ceil_mid(lo, hi):
    """ceil((lo + hi) / 2) of two i32 without overflow (arithmetic shifts floor)."""
    return (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)


def _after(key_a, pos_a, key_b, pos_b):
    """Whether (key_a, pos_a) comes after (key_b, pos_b) in (key asc, pos desc) order: a sort
    that is descending in this order gives keys descending, ties by lower position."""
    return (key_a > key_b) | ((key_a == key_b) & (pos_a < pos_b))


def _compare_and_swap(keys, pos, flip, i: int, n_dims: int):
    """One column of the bitonic network (Triton's standard._compare_and_swap): elements 2**(n-i-1)
    apart are compared; a pair swaps where its order disagrees with `flip` (i32[n], 0 or 1)."""
    n = keys.shape[0]
    shape = (1 << i, 2, 1 << (n_dims - i - 1))
    side = jax.lax.broadcasted_iota(jnp.int32, shape, 1)  # 0: left of the pair, 1: right

    def halves(x):  # the pair's left and right values at both of its positions, i32[n] each
        y = x.reshape(shape)
        left = jnp.sum(jnp.where(side == 0, y, 0), axis=1, keepdims=True)
        right = jnp.sum(jnp.where(side == 1, y, 0), axis=1, keepdims=True)
        return jnp.broadcast_to(left, shape).reshape(n), jnp.broadcast_to(right, shape).reshape(n)

    left_key, right_key = halves(keys)
    left_pos, right_pos = halves(pos)
    swap = _after(left_key, left_pos, right_key, right_pos).astype(jnp.int32) != flip
    keys = keys ^ jnp.where(swap, left_key ^ right_key, 0)  # x ^ (l ^ r): the other one of the pair
    pos = pos ^ jnp.where(swap, left_pos ^ right_pos, 0)
    return keys, pos


def _bitonic_sort_descending(keys, pos):
    """keys, pos i32[n] (n a power of two, (key, pos) pairs distinct) -> both ordered by key
    descending, ties by pos ascending (Triton's tl.sort, descending, on pairs)."""
    n = keys.shape[0]
    n_dims = n.bit_length() - 1
    for stage in range(1, n_dims + 1):
        if stage < n_dims:  # alternate directions: blocks of 2**stage become bitonic
            shape = (1 << (n_dims - 1 - stage), 2, 1 << stage)
            flip = jax.lax.broadcasted_iota(jnp.int32, shape, 1).reshape(n)
        else:
            flip = jnp.ones((n,), jnp.int32)
        for i in range(stage):
            keys, pos = _compare_and_swap(keys, pos, flip, i + n_dims - stage, n_dims)
    return keys, pos


def _span(r, start, size: int, length: int, interpret: bool) -> tuple:
    """Index of row r's elements start .. start + size - 1 (a row of `length`; lanes past it must
    be masked). The Triton lowering takes a contiguous slice (vectorised, coalesced accesses);
    the interpreter an index array whose lanes past the end point one past it (common.py)."""
    if interpret:
        lanes = start + jnp.arange(size, dtype=jnp.int32)
        return (r, jnp.minimum(lanes, length))
    return (r, pl.ds(start, size))


def _select_kernel(
    scores_ref,  # f32[b, C]
    out_ref,  # i32[b, K]: the result (order="fused"), else unused
    kept_keys_ref,  # i32[b, P]: the kept keys in position order, INVALID-padded
    kept_pos_ref,  # i32[b, P]: their positions (padding: C + lane, distinct)
    *,
    k: int,
    chunk: int,
    fused: bool,
    stop_after: str | None,
    interpret: bool,
):
    """Steps 1-3 for row r (+ step 4 when fused); see the module docstring."""
    r = pl.program_id(0)
    C = scores_ref.shape[1]
    P = kept_keys_ref.shape[1]
    n_chunks = pl.cdiv(C, chunk)

    def load(ci):  # keys i32[chunk] of chunk ci; past C: INVALID
        c = ci * chunk + jnp.arange(chunk, dtype=jnp.int32)
        return _sort_keys(common.gather(scores_ref, _span(r, ci * chunk, chunk, C, interpret), c < C, -jnp.inf))

    resident = load(0) if n_chunks == 1 else None  # the whole row in registers

    def over_row(fn, init):  # fold fn(carry, keys, chunk index) over the row's chunks
        if n_chunks == 1:
            return fn(init, resident, 0)
        return jax.lax.fori_loop(0, n_chunks, lambda ci, carry: fn(carry, load(ci), ci), init)

    # 2. The K-th largest key: the largest t with #(key >= t) >= K, by bisection on [lo, hi].
    def stats(carry, keys, _):
        n_valid, top = carry
        return n_valid + _count(keys != INVALID), jnp.maximum(top, jnp.max(keys))

    n_valid, top = over_row(stats, (jnp.int32(0), jnp.int32(INVALID)))
    lo = jnp.int32(_NEG_INF_KEY + 1)
    hi = jnp.where(n_valid > k, top, lo)  # K or fewer valid keys: keep them all (T = lo)

    def count_ge(t):
        return over_row(lambda n, keys, _: n + _count(keys >= t), jnp.int32(0))

    def bisect(bounds):
        lo, hi = bounds
        mid = _ceil_mid(lo, hi)
        n = count_ge(mid)
        lo = jnp.where(n >= k, mid, lo)
        hi = jnp.where(n == k, mid, jnp.where(n >= k, hi, mid - 1))  # exactly K >= mid: done
        return lo, hi

    threshold, _ = jax.lax.while_loop(lambda b: b[0] < b[1], bisect, (lo, hi))
    if stop_after == "threshold":  # timing a stage alone (benchmarks/bench_indexer.py)
        lane = jnp.arange(16, dtype=jnp.int32)
        common.scatter(out_ref, (r, common.safe_index(lane, lane < 1, k)), jnp.full((16,), threshold), lane < 1)
        return
    n_gt = over_row(lambda n, keys, _: n + _count(keys > threshold), jnp.int32(0))
    ties_taken = k - n_gt  # the lowest-position keys == T fill the rest

    # 3. Keep and compact, in position order: one cumsum counts both kinds before each key
    # (keys > T in the low 16 bits, keys == T in the high ones; a chunk holds <= 2**15 keys).
    def compact(carry, keys, ci):
        gt_before, eq_before = carry
        gt, eq = keys > threshold, keys == threshold
        packed = gt.astype(jnp.int32) | (eq.astype(jnp.int32) << 16)
        running = jnp.cumsum(packed) - packed  # exclusive, i32[chunk]
        gt_rank = gt_before + (running & 0xFFFF)
        eq_rank = eq_before + ((running >> 16) & 0xFFFF)
        keep = gt | (eq & (eq_rank < ties_taken))
        slot = common.safe_index(gt_rank + jnp.minimum(eq_rank, ties_taken), keep, P)  # kept keys before this one
        common.scatter(kept_keys_ref, (r, slot), keys, keep)
        # positions recomputed here, not kept live across the passes (registers)
        common.scatter(kept_pos_ref, (r, slot), ci * chunk + jnp.arange(chunk, dtype=jnp.int32), keep)
        return gt_before + _count(gt), eq_before + _count(eq)

    over_row(compact, (jnp.int32(0), jnp.int32(0)))
    lanes = jnp.arange(P, dtype=jnp.int32)
    filled = lanes < jnp.minimum(n_valid, k)
    if not fused:  # pad the scratch rows for the separate ordering step
        pad = common.safe_index(lanes, ~filled, P)
        common.scatter(kept_keys_ref, (r, pad), jnp.full((P,), INVALID, jnp.int32), ~filled)
        common.scatter(kept_pos_ref, (r, pad), C + lanes, ~filled)
        return

    # 4. Order the K kept pairs and write their positions.
    common.barrier(interpret)
    keys = common.gather(kept_keys_ref, _span(r, 0, P, P, interpret), filled, INVALID)  # i32[P]
    pos = common.gather(kept_pos_ref, _span(r, 0, P, P, interpret), filled, 0)
    _write_ordered(out_ref, r, keys, jnp.where(filled, pos, C + lanes), k, interpret)


def _write_ordered(out_ref, r, keys, pos, k: int, interpret: bool):
    """Sorts the kept pairs (i32[P] each) and writes row r's K positions, -1 for masked / NaN."""
    keys, pos = _bitonic_sort_descending(keys, pos)
    ok = (keys != INVALID) & (keys <= _POS_INF_KEY)  # masked and NaN scores -> -1
    lanes = jnp.arange(keys.shape[0], dtype=jnp.int32)
    common.scatter(out_ref, _span(r, 0, keys.shape[0], k, interpret), jnp.where(ok, pos, -1), lanes < k)


def _order_kernel(kept_keys_ref, kept_pos_ref, out_ref, *, k: int, interpret: bool):
    """Step 4 as its own kernel (order="kernel"): kept pairs i32[b, P] x 2 -> out i32[b, K]."""
    r = pl.program_id(0)
    P = kept_keys_ref.shape[1]
    every = jnp.ones((P,), jnp.bool_)
    keys = common.gather(kept_keys_ref, _span(r, 0, P, P, interpret), every, INVALID)  # i32[P]
    pos = common.gather(kept_pos_ref, _span(r, 0, P, P, interpret), every, 0)
    _write_ordered(out_ref, r, keys, pos, k, interpret)


def _order_with_lax_sort(kept_keys, kept_pos, k):
    """i32[b, P] kept keys / positions in position order -> i32[b, K] (key desc, position asc)."""
    neg_keys, pos = jax.lax.sort((~kept_keys, kept_pos), dimension=1, num_keys=2)  # ~: order reversed
    keys = ~neg_keys
    ok = (keys != INVALID) & (keys <= _POS_INF_KEY)
    return jnp.where(ok, pos, -1)[:, :k]


ORDERS = ("kernel", "fused", "xla")


def topk_indices_pallas(scores, k: int, *, chunk=32768, num_warps=16, order="xla", order_warps=4, stop_after=None):
    """The Pallas kernels; see topk_indices. chunk: scores per register-resident chunk (a power
    of two; a row longer than one chunk is re-read from memory on every pass). order: how the
    K kept pairs are ordered: "xla" (lax.sort of the K pairs: the fastest on the H200, ~47 us
    faster than "kernel" at 47 x 32k), "kernel" (a second kernel, order_warps warps), "fused"
    (in the selecting kernel). stop_after "threshold" / "compact" ends after that stage
    (timing stages alone; the output is then not the top-k)."""
    check_rank("scores", scores, 2, "[b, C]")
    if k < 1:
        raise ValueError(f"k ({k}) must be >= 1")
    if chunk < 16 or chunk & (chunk - 1) or chunk > 32768:
        raise ValueError(f"chunk ({chunk}) must be a power of two in [16, 32768]")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if stop_after not in (None, "threshold", "compact"):
        raise ValueError(f"stop_after must be None, 'threshold' or 'compact', got {stop_after!r}")
    b, C = scores.shape
    P = max(16, common.next_power_of_2(k))
    chunk = min(chunk, max(16, common.next_power_of_2(C)))
    interpret = common.interpret_mode()
    fused = order == "fused" and stop_after is None
    select = functools.partial(_select_kernel, k=k, chunk=chunk, fused=fused, stop_after=stop_after, interpret=interpret)
    out, kept_keys, kept_pos = pl.pallas_call(
        select,
        out_shape=(
            jax.ShapeDtypeStruct((b, k), jnp.int32),
            jax.ShapeDtypeStruct((b, P), jnp.int32),
            jax.ShapeDtypeStruct((b, P), jnp.int32),
        ),
        grid=(b,),
        in_specs=[common.any_spec()],
        out_specs=[common.any_spec()] * 3,
        compiler_params=common.triton_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="hisparse_indexer_topk_select",
    )(scores.astype(jnp.float32))
    if stop_after is not None:
        return out if stop_after == "threshold" else kept_pos
    if order == "fused":
        return out
    if order == "xla":
        return _order_with_lax_sort(kept_keys, kept_pos, k)
    return pl.pallas_call(
        functools.partial(_order_kernel, k=k, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((b, k), jnp.int32),
        grid=(b,),
        in_specs=[common.any_spec()] * 2,
        out_specs=common.any_spec(),
        compiler_params=common.triton_params(num_warps=order_warps, num_stages=1),
        interpret=interpret,
        name="hisparse_indexer_topk_order",
    )(kept_keys, kept_pos)


def topk_indices(scores, k: int, *, implementation=None, **tuning):
    """Top-k positions of masked scores: f32[b, C] (-inf: not allowed) -> i32[b, K], lax.top_k's
    choice and order, -1 for -inf scores and past C; see the module docstring."""
    check_rank("scores", scores, 2, "[b, C]")
    if resolve_implementation(implementation) == "pallas":
        return topk_indices_pallas(scores, k, **tuning)
    return topk_reference(scores, k)
