"""Swap-in states and top-k selections with an exact number of misses per request.

Shared by the GPU benchmark and the GPU correctness tests. Every request's buffer holds B
distinct positions of a `context`-token request in a random LRU order; a selection takes
K - misses of them (hits) and `misses` positions the buffer does not hold, all distinct, so a
plan from this state copies exactly `misses` rows per request. Host pages are a random
permutation of the pool, so missed rows are scattered over the whole pool as in serving.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SwapInWorkload:
    buffer_tokens: np.ndarray  # i32[1, R, B]
    lru_slots: np.ndarray  # i32[1, R, B]
    topk_sets: np.ndarray  # i32[N, R, K]: N different selections, each with `misses` misses per request
    lengths: np.ndarray  # i32[R]
    page_table: np.ndarray  # i32[R, P]
    page_size: int
    pool_rows: int


def make_workload(rng, *, requests, buffer_size, top_k, context, misses, page_size=64, num_sets=4, fast_path=False, page_layout="contiguous"):
    R, B, K = requests, buffer_size, top_k
    pages_per_request = -(-context // page_size)
    pool_pages = R * pages_per_request
    if page_layout == "contiguous":  # what a fresh allocator hands out: each request's pages in a row
        page_table = np.arange(pool_pages, dtype=np.int32).reshape(R, pages_per_request)
    elif page_layout == "random":  # a fragmented pool: pages scattered over all of it
        page_table = rng.permutation(pool_pages).astype(np.int32).reshape(R, pages_per_request)
    else:
        raise ValueError(f"page_layout {page_layout!r}")
    lru = np.stack([rng.permutation(B) for _ in range(R)]).astype(np.int32)[None]
    if fast_path:  # n = K <= B: slot j holds token j, the selection is every position
        tokens = np.full((1, R, B), -1, np.int32)
        tokens[0, :, :K] = np.arange(K)
        topk = np.stack([[rng.permutation(K) for _ in range(R)] for _ in range(num_sets)]).astype(np.int32)
        lengths = np.full(R, K, np.int32)
        return SwapInWorkload(tokens, np.tile(np.arange(B, dtype=np.int32), (1, R, 1)), topk, lengths, page_table, page_size, pool_pages * page_size)
    if not 0 <= misses <= K or K - misses > B or context - 1 < B + misses:
        raise ValueError(f"cannot build {misses} misses of {K} with B={B}, context={context}")
    tokens = np.empty((1, R, B), np.int32)
    topk = np.empty((num_sets, R, K), np.int32)
    for r in range(R):
        older = rng.permutation(context - 1)  # the newest (context - 1) is never selected here
        held, absent = older[:B], older[B:]
        tokens[0, r] = held
        for s in range(num_sets):
            chosen = np.concatenate([rng.choice(held, K - misses, replace=False), rng.choice(absent, misses, replace=False)])
            topk[s, r] = rng.permutation(chosen)
    lengths = np.full(R, context, np.int32)
    return SwapInWorkload(tokens, lru, topk, lengths, page_table, page_size, pool_pages * page_size)
