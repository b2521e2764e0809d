"""The top-k kernels in Pallas (Triton on a GPU, interpret mode elsewhere): method "radix" and
method "bisect", as api.py describes them; api.py is their only caller."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.common import DIGITS, INVALID, check_rank

_POS_INF_KEY = 0x7F800000  # key(+inf); larger keys are NaNs


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


def _largest_threshold(count_ge, lo, hi, need):
    """The largest t in [lo, hi] with count_ge(t) >= need, by bisection on the key's integer
    range (count_ge(lo) >= need must hold); it stops early once exactly `need` keys are >= mid."""

    def bisect(bounds):
        lo, hi = bounds
        mid = _ceil_mid(lo, hi)
        n = count_ge(mid)
        lo = jnp.where(n >= need, mid, lo)
        hi = jnp.where(n == need, mid, jnp.where(n >= need, hi, mid - 1))  # exactly `need`: done
        return lo, hi

    threshold, _ = jax.lax.while_loop(lambda b: b[0] < b[1], bisect, (lo, hi))
    return threshold


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
        return common.sort_keys(common.gather(scores_ref, common.span(r, ci * chunk, chunk, C, interpret), c < C, -jnp.inf))

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
    lo = jnp.int32(common.NEG_INF_KEY + 1)
    hi = jnp.where(n_valid > k, top, lo)  # K or fewer valid keys: keep them all (T = lo)

    count_ge = lambda t: over_row(lambda n, keys, _: n + _count(keys >= t), jnp.int32(0))  # noqa: E731
    threshold = _largest_threshold(count_ge, lo, hi, k)
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
    keys = common.gather(kept_keys_ref, common.span(r, 0, P, P, interpret), filled, INVALID)  # i32[P]
    pos = common.gather(kept_pos_ref, common.span(r, 0, P, P, interpret), filled, 0)
    _write_ordered(out_ref, r, keys, jnp.where(filled, pos, C + lanes), k, interpret)


def _write_ordered(out_ref, r, keys, pos, k: int, interpret: bool):
    """Sorts the kept pairs (i32[P] each) and writes row r's K positions, -1 for masked / NaN."""
    keys, pos = _bitonic_sort_descending(keys, pos)
    ok = (keys != INVALID) & (keys <= _POS_INF_KEY)  # masked and NaN scores -> -1
    lanes = jnp.arange(keys.shape[0], dtype=jnp.int32)
    common.scatter(out_ref, common.span(r, 0, keys.shape[0], k, interpret), jnp.where(ok, pos, -1), lanes < k)


def _order_kernel(kept_keys_ref, kept_pos_ref, out_ref, *, k: int, interpret: bool):
    """Step 4 as its own kernel (order="kernel"): kept pairs i32[b, P] x 2 -> out i32[b, K]."""
    r = pl.program_id(0)
    P = kept_keys_ref.shape[1]
    every = jnp.ones((P,), jnp.bool_)
    keys = common.gather(kept_keys_ref, common.span(r, 0, P, P, interpret), every, INVALID)  # i32[P]
    pos = common.gather(kept_pos_ref, common.span(r, 0, P, P, interpret), every, 0)
    _write_ordered(out_ref, r, keys, pos, k, interpret)


def _order_with_lax_sort(kept_keys, kept_pos, k):
    """i32[b, P] kept keys / positions in position order -> i32[b, K] (key desc, position asc)."""
    neg_keys, pos = jax.lax.sort((~kept_keys, kept_pos), dimension=1, num_keys=2)  # ~: order reversed
    keys = ~neg_keys
    ok = (keys != INVALID) & (keys <= _POS_INF_KEY)
    return jnp.where(ok, pos, -1)[:, :k]


ORDERS = ("kernel", "fused", "xla")


def _topk_bisect(scores, k: int, *, chunk=32768, num_warps=16, order="xla", order_warps=4, stop_after=None):
    """method="bisect" (one program per row; module docstring). chunk: scores per register-resident chunk (a power
    of two; a row longer than one chunk is re-read from memory on every pass). order: how the
    K kept pairs are ordered: "xla" (lax.sort of the K pairs: the fastest on the H200, ~47 us
    faster than "kernel" at 47 x 32k), "kernel" (a second kernel, order_warps warps), "fused"
    (in the selecting kernel). stop_after "threshold" / "compact" ends after that stage
    (timing stages alone; the output is then not the top-k)."""
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


_MAX_KEY = np.iinfo(np.int32).max  # ~INVALID: the stored (inverted) key of a padding entry


def _reported(keys: jax.Array, pos: jax.Array) -> jax.Array:
    """The position a kept key reports: -1 for a NaN score (select_topk's), else its own."""
    return jnp.where(keys <= _POS_INF_KEY, pos, -1)


def _histogram_kernel(scores_ref, hist_ref, *, slice_len: int, sub: int, onehot: str, interpret: bool):
    """scores f32[b, C] -> hist i32[b, S, N]: per digit, the valid scores of slice s of row r
    (digit_counts over sub-blocks of `sub` scores)."""
    r, s = pl.program_id(0), pl.program_id(1)
    C = scores_ref.shape[1]

    def body(j, counts):  # counts [16, 16]: [high half, low half] of the digit
        start = s * slice_len + j * sub
        c = start + jnp.arange(sub, dtype=jnp.int32)
        x = common.gather(scores_ref, common.span(r, start, sub, C, interpret), c < C, -jnp.inf)  # f32[sub]; past C: not counted
        return counts + common.digit_counts(x, onehot)

    counts = jax.lax.fori_loop(0, slice_len // sub, body, jnp.zeros((common.DIGIT_HALF, common.DIGIT_HALF), common.onehot_dtypes(onehot)[1]))
    common.store_digit_counts(hist_ref, (r, s), counts, interpret)


def _row_histogram(hist_ref, r, interpret: bool) -> jax.Array:
    """Row r's slice histograms, i32[S', N] (S' = S rounded up to a power of 2; extra rows 0)."""
    S = hist_ref.shape[1]
    rows = jnp.arange(common.next_power_of_2(S), dtype=jnp.int32)
    ok = rows < S
    index = common.row_block((r,), common.safe_index(rows, ok, S), 0, DIGITS, interpret)
    return common.gather(hist_ref, index, jnp.broadcast_to(ok[:, None], (rows.shape[0], DIGITS)), 0)


def _row_plan(hist: jax.Array, k: int) -> tuple:
    """One row's slice histograms i32[S', N] -> (D, sure i32[S'], cand i32[S'], n_valid): the
    threshold digit D (the largest with >= K valid scores at or above it; -1 when the row has
    fewer than K: all of them are kept), and per slice its sure scores (digit > D, all kept) and
    candidates (digit == D)."""
    total = jnp.sum(hist, axis=0)  # i32[N]
    n_valid = jnp.sum(total)
    at_or_above = n_valid - (jnp.cumsum(total) - total)  # i32[N]: valid scores with digit >= d
    digits = jnp.arange(DIGITS, dtype=jnp.int32)
    d = jnp.max(jnp.where(at_or_above >= k, digits, -1))
    sure = jnp.sum(jnp.where(digits[None, :] > d, hist, 0), axis=1)  # i32[S']
    cand = jnp.sum(jnp.where(digits[None, :] == d, hist, 0), axis=1)  # i32[S']
    return d, sure, cand, n_valid


def _row_plan_kernel(hist_ref, totals_ref, sure_before_ref, cand_before_ref, *, k: int, interpret: bool):
    """Step 2a (row_plan=True), once per row r: _row_plan of its histograms, written as
    totals[r] = (D, sure, candidates, valid) and per slice s the sure scores and candidates in the
    slices before s. The split and resolve programs then read a few counts, not the whole
    histogram (S x 256 values: a split program at 64 slices used 255 registers for it, 154
    without, by benchmarks/probes/kernel_resources.py)."""
    r = pl.program_id(0)
    hist = _row_histogram(hist_ref, r, interpret)  # i32[S', N]
    d, sure, cand, n_valid = _row_plan(hist, k)
    S = sure_before_ref.shape[1]
    slices = jnp.arange(hist.shape[0], dtype=jnp.int32)
    in_row = slices < S
    common.scatter(sure_before_ref, (r, common.safe_index(slices, in_row, S)), jnp.cumsum(sure) - sure, in_row)
    common.scatter(cand_before_ref, (r, common.safe_index(slices, in_row, S)), jnp.cumsum(cand) - cand, in_row)
    fields = jnp.arange(4, dtype=jnp.int32)
    values = jnp.where(fields == 0, d, jnp.where(fields == 1, jnp.sum(sure), jnp.where(fields == 2, jnp.sum(cand), n_valid)))
    common.scatter(totals_ref, (r, fields), values, fields < 4)


def _plan_of(plan_refs, r, s, k: int, interpret: bool) -> tuple:
    """(D, sure before slice s, candidates before s, sure, candidates, valid) of row r: read from
    _row_plan_kernel's outputs (plan_refs: totals, sure_before, cand_before), or computed here from
    the row's histograms (plan_refs: the histogram ref alone; row_plan=False)."""
    if len(plan_refs) == 3:
        totals_ref, sure_before_ref, cand_before_ref = plan_refs
        return (totals_ref[r, 0], sure_before_ref[r, s], cand_before_ref[r, s], totals_ref[r, 1], totals_ref[r, 2], totals_ref[r, 3])
    hist = _row_histogram(plan_refs[0], r, interpret)  # i32[S', N]
    d, sure, cand, n_valid = _row_plan(hist, k)
    before = jnp.arange(hist.shape[0], dtype=jnp.int32) < s
    return d, jnp.sum(jnp.where(before, sure, 0)), jnp.sum(jnp.where(before, cand, 0)), jnp.sum(sure), jnp.sum(cand), n_valid


def _split_kernel(
    *refs,  # the plan (_plan_of: i32[b, 4] totals, i32[b, S] x 2; or the histograms i32[b, S, N]), then:
    #   scores f32[b, C]; out: kept keys i32[b, K] (~key of the kept scores, [0, n_sure) written
    #   here), kept positions i32[b, K], candidate keys i32[b, C] (digit == D, [0, n_cand)
    #   written), candidate positions i32[b, C]
    k: int,
    slice_len: int,
    chunk: int,
    interpret: bool,
):
    """Step 2 for slice s of row r: sure scores to the kept row, candidates to the scratch row,
    both in position order (a slice's offset: the counts of the slices before it)."""
    *plan_refs, scores_ref, kept_keys_ref, kept_pos_ref, cand_keys_ref, cand_pos_ref = refs
    r, s = pl.program_id(0), pl.program_id(1)
    C, K = scores_ref.shape[1], kept_keys_ref.shape[1]
    d, sure_before, cand_before, _, _, _ = _plan_of(plan_refs, r, s, k, interpret)

    def body(j, carry):
        sure_seen, cand_seen = carry  # kept / candidate scores before this chunk, in the row
        start = s * slice_len + j * chunk
        c = start + jnp.arange(chunk, dtype=jnp.int32)
        x = common.gather(scores_ref, common.span(r, start, chunk, C, interpret), c < C, -jnp.inf)  # f32[chunk]
        keys, digit = common.sort_keys(x), common.score_digit(x)  # i32[chunk] each
        valid = keys != INVALID
        sure, cand = valid & (digit > d), valid & (digit == d)
        # one cumsum ranks both kinds: sure in the low 16 bits, candidates in the high ones
        packed = sure.astype(jnp.int32) | (cand.astype(jnp.int32) << 16)
        running = jnp.cumsum(packed) - packed  # exclusive, i32[chunk]
        slot = common.safe_index(sure_seen + (running & 0xFFFF), sure, K)
        common.scatter(kept_keys_ref, (r, slot), ~keys, sure)  # ~: lax.sort ascending = keys descending
        common.scatter(kept_pos_ref, (r, slot), _reported(keys, c), sure)
        slot = common.safe_index(cand_seen + (running >> 16), cand, C)
        common.scatter(cand_keys_ref, (r, slot), keys, cand)
        common.scatter(cand_pos_ref, (r, slot), c, cand)
        return sure_seen + _count(sure), cand_seen + _count(cand)

    jax.lax.fori_loop(0, slice_len // chunk, body, (sure_before, cand_before))


def _resolve_kernel(
    *refs,  # the plan (as _split_kernel's), then: candidate keys and positions i32[b, C] x 2, kept keys and
    #         positions i32[b, K] x 2 (aliased to the outputs), out: kept keys and positions ([n_sure, K)
    #         written here: chosen candidates, then padding)
    k: int,
    chunk: int,
    interpret: bool,
):
    """Step 3 for row r: the exact threshold among the candidates, the chosen ones appended in
    position order, the rest of the kept row padded (key ~INVALID, position -1)."""
    *plan_refs, cand_keys_ref, cand_pos_ref, _kept_keys_in, _kept_pos_in, kept_keys_ref, kept_pos_ref = refs
    r = pl.program_id(0)
    C, K = cand_keys_ref.shape[1], kept_keys_ref.shape[1]
    _, _, _, n_sure, n_cand, n_valid = _plan_of(plan_refs, r, 0, k, interpret)
    n_kept = jnp.minimum(n_valid, k)
    need = n_kept - n_sure  # candidates to keep: 1 .. n_cand, or 0 (then n_cand is 0)

    def load(ref, ci, other):  # chunk ci of row r's candidates, i32[chunk]; `other` past n_cand
        c = ci * chunk + jnp.arange(chunk, dtype=jnp.int32)
        return common.gather(ref, common.span(r, ci * chunk, chunk, C, interpret), c < n_cand, other)

    first = load(cand_keys_ref, 0, INVALID)  # held in registers: usually every candidate

    def over(fn, init):  # fold fn(carry, keys, chunk index) over the candidates
        carry = fn(init, first, 0)
        return jax.lax.fori_loop(1, pl.cdiv(n_cand, chunk), lambda ci, c: fn(c, load(cand_keys_ref, ci, INVALID), ci), carry)

    def stats(carry, keys, _):
        low, top = carry
        return jnp.minimum(low, jnp.min(jnp.where(keys != INVALID, keys, _MAX_KEY))), jnp.maximum(top, jnp.max(keys))

    low, top = over(stats, (jnp.int32(_MAX_KEY), jnp.int32(INVALID)))
    hi = jnp.where(n_cand > need, top, low)  # all candidates needed: T = their smallest key
    count_ge = lambda t: over(lambda n, keys, _: n + _count(keys >= t), jnp.int32(0))  # noqa: E731
    threshold = _largest_threshold(count_ge, low, hi, need)
    ties_taken = need - over(lambda n, keys, _: n + _count(keys > threshold), jnp.int32(0))

    def append(carry, keys, ci):  # as the bisect kernel's compaction, after the sure scores
        gt_before, eq_before = carry
        gt, eq = keys > threshold, keys == threshold  # padding (INVALID) is neither
        packed = gt.astype(jnp.int32) | (eq.astype(jnp.int32) << 16)
        running = jnp.cumsum(packed) - packed  # exclusive, i32[chunk]
        gt_rank, eq_rank = gt_before + (running & 0xFFFF), eq_before + (running >> 16)
        keep = gt | (eq & (eq_rank < ties_taken))
        slot = common.safe_index(n_sure + gt_rank + jnp.minimum(eq_rank, ties_taken), keep, K)
        common.scatter(kept_keys_ref, (r, slot), ~keys, keep)
        common.scatter(kept_pos_ref, (r, slot), _reported(keys, load(cand_pos_ref, ci, 0)), keep)
        return gt_before + _count(gt), eq_before + _count(eq)

    over(append, (jnp.int32(0), jnp.int32(0)))
    lanes = jnp.arange(common.next_power_of_2(K), dtype=jnp.int32)
    pad = (lanes >= n_kept) & (lanes < K)
    common.scatter(kept_keys_ref, (r, common.safe_index(lanes, pad, K)), jnp.full(lanes.shape, _MAX_KEY, jnp.int32), pad)
    common.scatter(kept_pos_ref, (r, common.safe_index(lanes, pad, K)), jnp.full(lanes.shape, -1, jnp.int32), pad)


# Slices from which the radix top-k plans once per row (row_plan=None): a split program loading
# the whole [S, 256] histogram used 255 registers at 64 slices (9 x 131,072) and the same 154 as
# without it at 20 (50 x 40,960), by benchmarks/probes/kernel_resources.py (pip Triton 3.6, sm_90).
ROW_PLAN_MIN_SLICES = 32


def _topk_radix(
    scores, k: int, *, hist=None, row_plan=None, slice_len=2048, sub=512, onehot="bfloat16", split_chunk=None, chunk=4096, hist_warps=4,
    plan_warps=8, split_warps=4, resolve_warps=8, stop_after=None,
):  # fmt: skip
    """method="radix" (module docstring). row_plan: the threshold digit and each slice's offsets
    computed once per row by a kernel of their own (step 2a), rather than by every split program
    and the resolve from the whole histogram (False: the 2026-12-01 kernels). None: from
    ROW_PLAN_MIN_SLICES slices on, where loading the histogram costs a split program its
    registers (estimated offline; not yet timed on the GPU). hist: i32[b, S, N], step 1's histograms made already
    (the indexer's scoring kernel with histogram=True) over slices of `slice_len` scores: the
    histogram kernel is then skipped. slice_len: scores per histogram / split program (a
    power of two); sub: scores per one-hot product, onehot its dtype ("bfloat16" or "int8");
    split_chunk: scores per split step (None: the slice); chunk: candidates held in registers
    by the resolve program (more are re-read from memory on every bisection step). stop_after
    "histogram" / "resolve" returns that stage's output (timing only).
    Defaults: H200, 47 x 32k, 2026-12-01 (docs/perf/bench_kernels_indexer_h200_2026-12-01a.json):
    2048-score slices 5.6 us faster than 4096 (83.0 vs 88.6 us), 8192 24 us slower; the
    resolve with 4096 candidates in registers and 8 warps 8.7 us against 12.6 with 2048 / 4.
    Not faster (..._2026-12-01b.json): int8 one-hots (+2.1 us), 8 histogram warps (+7.3),
    1024-score products (+2.3)."""
    for name, value in (("slice_len", slice_len), ("sub", sub), ("chunk", chunk)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} ({value}) must be a power of two >= 16")
    if onehot not in ("bfloat16", "int8"):
        raise ValueError(f"onehot must be 'bfloat16' or 'int8', got {onehot!r}")
    if stop_after not in (None, "histogram", "resolve"):
        raise ValueError(f"stop_after must be None, 'histogram' or 'resolve', got {stop_after!r}")
    b, C = scores.shape
    interpret = common.interpret_mode()
    slice_len = min(slice_len, max(16, common.next_power_of_2(C)))
    sub = min(sub, slice_len)
    split_chunk = min(split_chunk or slice_len, slice_len)
    chunk = min(chunk, max(16, common.next_power_of_2(C)))
    S = pl.cdiv(C, slice_len)
    i32 = jnp.int32
    scores = scores.astype(jnp.float32)
    if hist is not None:
        if tuple(hist.shape) != (b, S, DIGITS) or hist.dtype != i32:
            raise ValueError(f"hist must be i32[b, S, N] = ({b}, {S}, {DIGITS}) for {C} scores in slices of {slice_len}, got {hist.dtype}{list(hist.shape)}")
    else:
        hist = pl.pallas_call(
            functools.partial(_histogram_kernel, slice_len=slice_len, sub=sub, onehot=onehot, interpret=interpret),
            out_shape=jax.ShapeDtypeStruct((b, S, DIGITS), i32),
            grid=(b, S),
            in_specs=[common.any_spec()],
            out_specs=common.any_spec(),
            compiler_params=common.triton_params(num_warps=hist_warps, num_stages=1),
            interpret=interpret,
            name="hisparse_indexer_topk_histogram",
        )(scores)
    if stop_after == "histogram":
        return hist
    plan = (hist,)
    if row_plan or (row_plan is None and S >= ROW_PLAN_MIN_SLICES):
        plan = pl.pallas_call(
            functools.partial(_row_plan_kernel, k=k, interpret=interpret),
            out_shape=[jax.ShapeDtypeStruct((b, 4), i32), jax.ShapeDtypeStruct((b, S), i32), jax.ShapeDtypeStruct((b, S), i32)],
            grid=(b,),
            in_specs=[common.any_spec()],
            out_specs=[common.any_spec()] * 3,
            compiler_params=common.triton_params(num_warps=plan_warps, num_stages=1),
            interpret=interpret,
            name="hisparse_indexer_topk_plan",
        )(hist)
    kept_keys, kept_pos, cand_keys, cand_pos = pl.pallas_call(
        functools.partial(_split_kernel, k=k, slice_len=slice_len, chunk=split_chunk, interpret=interpret),
        out_shape=[jax.ShapeDtypeStruct(shape, i32) for shape in ((b, k), (b, k), (b, C), (b, C))],
        grid=(b, S),
        in_specs=[common.any_spec()] * (len(plan) + 1),
        out_specs=[common.any_spec()] * 4,
        compiler_params=common.triton_params(num_warps=split_warps, num_stages=1),
        interpret=interpret,
        name="hisparse_indexer_topk_split",
    )(*plan, scores)
    kept_keys, kept_pos = pl.pallas_call(
        functools.partial(_resolve_kernel, k=k, chunk=chunk, interpret=interpret),
        out_shape=[jax.ShapeDtypeStruct((b, k), i32)] * 2,
        grid=(b,),
        in_specs=[common.any_spec()] * (len(plan) + 4),
        out_specs=[common.any_spec()] * 2,
        input_output_aliases={len(plan) + 2: 0, len(plan) + 3: 1},
        compiler_params=common.triton_params(num_warps=resolve_warps, num_stages=1),
        interpret=interpret,
        name="hisparse_indexer_topk_resolve",
    )(*plan, cand_keys, cand_pos, kept_keys, kept_pos)
    if stop_after == "resolve":
        return kept_pos
    # (~key asc, position asc) = key descending, ties by the lower position; NaN and padding
    # entries carry position -1 already, so the sorted positions are the result.
    return jax.lax.sort((kept_keys, kept_pos), dimension=1, num_keys=2)[1]


METHODS = ("radix", "bisect")


def default_method(b: int, C: int) -> str:
    """The faster method for b rows of C scores, as measured on the H200 (2026-12-01, K 2048,
    docs/perf/bench_kernels_indexer_h200_2026-12-01b.json, device us radix / bisect): 13 x 32k
    51.8 / 75.8, 47 x 32k 79.5 / 78.0, 190 x 32k 223.6 / 174.2, 47 x 64k 124.3 / 283.5,
    47 x 128k 230.2 / 499.3. bisect (one program per row) wins once its row fits in registers
    and the rows fill a third of the SMs; radix's histogram costs ~0.7 us per 1k-score slice
    in all (throughput-bound), bisect's ~31 passes are latency-bound per row."""
    return "bisect" if C <= 32768 and b >= 47 else "radix"


@common.lower_once
def topk_indices_pallas(scores, k: int, *, method=None, **tuning):
    """The Pallas kernels; see topk_indices. method "radix" (tuning: _topk_radix's arguments,
    hist= included), "bisect" (the 2026-12-01 kernel; tuning: _topk_bisect's) or None
    (default_method, "radix" when given hist; name the method when passing other tuning)."""
    check_rank("scores", scores, 2, "[b, C]")
    if k < 1:
        raise ValueError(f"k ({k}) must be >= 1")
    if tuning.get("hist") is not None and method not in (None, "radix"):
        raise ValueError(f"hist (the scoring kernel's histograms) is for method 'radix', not {method!r}")
    method = method or ("radix" if tuning.get("hist") is not None else default_method(*scores.shape))
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "radix":
        return _topk_radix(scores, k, **tuning)
    return _topk_bisect(scores, k, **tuning)
