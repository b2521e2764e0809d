"""SYNTHETIC contexts for decode benchmarks: random KV rows and indexer keys, no model prefill.

A PD decode instance receives each request's finished KV (docs/background.md); decode throughput is
what HiSparse changes. This writes random rows where the model's prefill would write them (the
host pool with HiSparse, the device KV without) and random indexer keys into the device key
cache (in its format: fp8 keys quantised with their scales), so prefill stays out of a
benchmark's timing. Every figure produced this way is labelled
synthetic-context.

Letters: L layers, J full-indexer layers, T positions filled (static), W row width, I key width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hisparse_jax import sharding as dp_sharding
from hisparse_jax.kv_cache_ops import begin_request, store_prefill_rows
from models.dsa.decoding import DecodeCache, cache_shardings, write_index_keys


def _random_rows(key, num_positions: int, layout):
    """row[T, W] as the state stores them: random latent and rope values packed by its
    KVRowLayout (plain rows: the values cast; fp8 rows: quantised into words)."""
    values = jax.random.normal(key, (num_positions, layout.latent_dim + layout.rope_dim), jnp.float32)
    return layout.pack(values[:, : layout.latent_dim], values[:, layout.latent_dim :])


def _fill(cache, slot, prompt_len, host_pages, key, *, num_positions: int, implementation, mesh):
    """begin_request, then random rows for positions < prompt_len of every layer (host pool or
    device KV, as store_prefill_rows puts a prefill's) and random indexer keys. host_pages i32[P]."""
    kv, index_keys, key_scales = cache.kv, cache.index_keys, cache.index_key_scales
    J, _, C, I = index_keys.shape
    L = kv.num_layers
    kv = begin_request(kv, slot, prompt_len, host_pages)
    for layer in range(L):
        rows = _random_rows(jax.random.fold_in(key, layer), num_positions, kv.layout)  # row[T, W]
        if mesh is None:
            kv = store_prefill_rows(kv, layer, slot, 0, rows, prompt_len, implementation=implementation)
        else:  # only the slot's data-parallel group writes, into its own pool block
            kv = dp_sharding.store_prefill_rows(mesh, kv, layer, slot, 0, rows, prompt_len, implementation=implementation)
    positions = jnp.arange(num_positions)  # i32[T]
    target = jnp.where(positions < prompt_len, positions, C)  # i32[T]; past the prompt: dropped
    # the keys' stream apart from the rows' whatever L is: a cache with an MTP layer (one more
    # layer) holds the same model-layer contexts (benchmarks/bench_mtp.py compares the two)
    key_rows = jax.random.fold_in(key, 1 << 20)
    for j in range(J):
        keys = jax.random.normal(jax.random.fold_in(key_rows, j), (num_positions, I), jnp.float32)  # f32[T, I]
        index_keys, key_scales = write_index_keys(index_keys, key_scales, j, slot, target, keys)
    return DecodeCache(kv, index_keys, key_scales)


class SyntheticFill:
    """fill(cache, slot, prompt_len, host_pages, key) -> cache: jitted once, cache donated."""

    def __init__(self, cache, *, implementation: str | None = None, mesh=None):
        num_positions = cache.index_keys.shape[2]  # one compiled shape for every prompt length
        fn = functools.partial(_fill, num_positions=num_positions, implementation=implementation, mesh=mesh)
        self._fill = jax.jit(fn, donate_argnums=0, out_shardings=cache_shardings(cache))

    def __call__(self, cache, slot: int, prompt_len: int, host_pages, key):
        return self._fill(cache, *self._inputs(slot, prompt_len, host_pages), key)

    def lower(self, cache, host_pages, key):
        """The fill lowered (jax.stages.Lowered) for `cache` as it will be handed over and a
        request's host_pages i32[P] (or None): its .compile() is the first call's compile."""
        return self._fill.lower(cache, *self._inputs(0, 1, host_pages), key)

    @staticmethod
    def _inputs(slot: int, prompt_len: int, host_pages) -> tuple:
        """(slot i32[], prompt_len i32[], pages i32[P] or None) as the jit takes them."""
        pages = None if host_pages is None else jnp.asarray(host_pages, jnp.int32)
        return jnp.int32(slot), jnp.int32(prompt_len), pages
