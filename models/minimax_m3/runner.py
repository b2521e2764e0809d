"""MiniMax-M3 served by serving.engine.Engine: the family's prefill and decode step
(models.minimax_m3.hisparse) over request slots.

    engine = Engine(M3Runner(model), EngineConfig(max_running_requests=4, context_length=256,
                                                  hisparse=HiSparseConfig(top_k=16, device_buffer_size=20)))

Letters as in models/minimax_m3/model.py; R request slots, J sparse layers, Lf full-attention layers,
N KV heads, E head_dim, I index_head_dim.

Placement per request (docs/models.md, models/minimax_m3/hisparse.py): the sparse layers' K/V
in the KV state, one layer per (sparse layer, KV group) (HiSparse: pinned host pool + a working
set of device_buffer_size rows, filled from the selected blocks' keys; baseline: a FullKVState,
the same code); full-attention layers' K/V and the index keys on the device. One engine slot is
one state slot, so host pages and release are the engine's as for DSA models.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.common.runner import FamilyRunner, RequestFootprint, StepCounts
from models.minimax_m3.hisparse import M3HiSparseCache, create_hisparse_cache, decode_step_counts, hisparse_plan, store_request
from models.minimax_m3.model import forward_with_cache_rows


def footprint(config, dtype, hisparse) -> RequestFootprint:
    """Device bytes of one request (admission's count), from the config: per token the full
    layers' K and V and the sparse layers' index keys, plus the sparse layers' K and V without
    HiSparse; with HiSparse, per request the working sets (B + 1 rows per sparse layer and KV
    group)."""
    e = np.dtype(dtype).itemsize
    J, Lf, N, E = len(config.sparse_layers), len(config.dense_attention_layers), config.num_kv_heads, config.head_dim
    row = 2 * E * e  # one KV head's [k, v] of one token
    per_token = Lf * N * row + J * config.index_head_dim * e
    if hisparse is None:
        return RequestFootprint(row_bytes=row, fixed_bytes=0, per_tokens=((per_token + J * N * row, 1),))
    return RequestFootprint(
        row_bytes=row, fixed_bytes=J * N * (hisparse.device_buffer_size + 1) * row, per_tokens=((per_token, 1),),
        host_per_tokens=((J * N * row, 1),),  # the sparse layers' K and V of every token, in the host pool
    )  # fmt: skip


def prompt_caches(model, tokens, prompt_len, max_context: int):
    """Prompt tokens i32[Tp] (prompt_len real, i32[]) -> ((k, v [L, Tp, N, E], index keys
    [J, Tp, I]), logits f32[V] of the last prompt token). max_context: unused (the rows are per token)."""
    logits, k, v, ik = forward_with_cache_rows(model, tokens[None], last=prompt_len - 1)  # k [L, 1, Tp, N, E]
    return (k[:, 0], v[:, 0], ik[:, 0]), logits[0]


def store_prompt(config, cache: M3HiSparseCache, slot, rows, prompt_len, host_pages, *, implementation=None) -> M3HiSparseCache:
    """The prompt's caches (prompt_caches) into free slot `slot`: begins the request (host_pages
    i32[P] for HiSparse, None for the baseline), then minimax_m3_hisparse.store_request."""
    cache = dataclasses.replace(cache, kv=cache.kv.begin_request(slot, prompt_len, host_pages))
    return store_request(config, cache, slot, *rows, prompt_len, implementation=implementation)


def move_slot(cache: M3HiSparseCache, source, target) -> M3HiSparseCache:
    """Request row `source` copied to `target` (k, v [Lf, R, ...], index_keys [J, R, ...]) and its KV state moved."""
    move = lambda x: x.at[:, target].set(x[:, source])  # noqa: E731
    return M3HiSparseCache(move(cache.k), move(cache.v), move(cache.index_keys), cache.kv.move_request(source, target))


class M3Runner(FamilyRunner):
    """The engine's runner for a MiniMaxM3ForCausalLM (models/common/runner.py has the contract)."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        impl = self.implementation
        self._forward_fn = prompt_caches
        self._store_fn = lambda c, slot, rows, n, pages: store_prompt(self.config, c, slot, rows, n, pages, implementation=impl)
        self._decode_fn = lambda m, c, tokens, positions: _counts(decode_step_counts(m, c, tokens, positions, implementation=impl))
        self._move_fn = move_slot

    def _create_cache(self, *, num_requests, max_context, hisparse, num_host_pages, page_size, fill_value) -> M3HiSparseCache:
        if hisparse is not None:
            hisparse_plan(self.config, hisparse)  # refuses a working set smaller than one selection
        return create_hisparse_cache(
            self.model, num_requests, max_context, hisparse, page_size=page_size, num_host_pages=num_host_pages,
            fill_value=fill_value, begin=False,
        )  # fmt: skip

    def max_context(self, cache: M3HiSparseCache) -> int:
        return cache.k.shape[2]

    def device_footprint(self, hisparse) -> RequestFootprint:
        return footprint(self.config, self.dtype, hisparse)


def _counts(out):
    cache, logits, (hits, misses) = out
    return cache, logits, StepCounts(hits, misses)

