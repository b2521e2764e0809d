"""SYNTHETIC contexts for decode benchmarks: random KV rows and indexer keys, no model prefill.

A PD decode instance receives each request's finished KV (docs/background.md); decode throughput is
what HiSparse changes. This writes random rows where the model's prefill would write them (the
host pool with HiSparse, the device KV without) and random indexer keys into the device key
cache, so prefill stays out of a benchmark's timing. Every figure produced this way is labelled
synthetic-context.

Letters: L layers, J full-indexer layers, T positions filled (static), W row width, I key width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hisparse_jax import sharding as dp_sharding
from hisparse_jax.kv_cache_ops import begin_request, store_prefill_rows
from models.decoding import DecodeCache, cache_shardings


def _fill(cache, slot, prompt_len, host_pages, key, *, num_positions: int, implementation, mesh):
    """begin_request, then random rows for positions < prompt_len of every layer (host pool or
    device KV, as store_prefill_rows puts a prefill's) and random indexer keys. host_pages i32[P]."""
    kv, index_keys = cache.kv, cache.index_keys
    J, _, C, I = index_keys.shape
    rows_like = kv.device_rows
    L, W, dtype = kv.num_layers, rows_like.shape[-1], rows_like.dtype
    kv = begin_request(kv, slot, prompt_len, host_pages)
    for layer in range(L):
        rows = jax.random.normal(jax.random.fold_in(key, layer), (num_positions, W), jnp.float32).astype(dtype)  # row[T, W]
        if mesh is None:
            kv = store_prefill_rows(kv, layer, slot, 0, rows, prompt_len, implementation=implementation)
        else:  # only the slot's data-parallel group writes, into its own pool block
            kv = dp_sharding.store_prefill_rows(mesh, kv, layer, slot, 0, rows, prompt_len, implementation=implementation)
    positions = jnp.arange(num_positions)  # i32[T]
    target = jnp.where(positions < prompt_len, positions, C)  # i32[T]; past the prompt: dropped
    for j in range(J):
        keys = jax.random.normal(jax.random.fold_in(key, L + j), (num_positions, I), jnp.float32)  # f32[T, I]
        index_keys = index_keys.at[j, slot, target].set(keys.astype(index_keys.dtype), mode="drop")
    return DecodeCache(kv, index_keys)


class SyntheticFill:
    """fill(cache, slot, prompt_len, host_pages, key) -> cache: jitted once, cache donated."""

    def __init__(self, cache, *, implementation: str | None = None, mesh=None):
        num_positions = cache.index_keys.shape[2]  # one compiled shape for every prompt length
        fn = functools.partial(_fill, num_positions=num_positions, implementation=implementation, mesh=mesh)
        self._fill = jax.jit(fn, donate_argnums=0, out_shardings=cache_shardings(cache))

    def __call__(self, cache, slot: int, prompt_len: int, host_pages, key):
        pages = None if host_pages is None else jnp.asarray(host_pages, jnp.int32)
        return self._fill(cache, jnp.int32(slot), jnp.int32(prompt_len), pages, key)
