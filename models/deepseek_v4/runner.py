"""DeepSeek-V4 served by serving.engine.Engine: the family's prefill and decode step
(models.deepseek_v4.decoding) over request slots, with the CSA layers' compressed "C4" entries
in a hisparse_jax KV state (the same one DSA models use).

    engine = Engine(V4Runner(model), EngineConfig(max_running_requests=4, context_length=256,
                                                  hisparse=HiSparseConfig(top_k=8, device_buffer_size=10)))

Letters as in models/deepseek_v4/model.py; R request slots, J CSA layers, Ne = ceil(C / csa_rate)
entry positions of a request, Tp a padded prompt length.

Placement per request (docs/models.md): the C4 entries in the KV state (HiSparse: the pinned
host pool + an LRU device buffer of device_buffer_size entries per CSA layer, swapped in from
the CSA indexer's top-k each step; baseline: a FullKVState, every entry on the device, the same
code); sliding windows, HCA ("C128") entries, CSA indexer keys and the compressors' pending raw
windows in the V4Cache on the device. A state position is an entry index, so a host page holds
page_size / csa_rate entries: the engine's page of page_size tokens is exactly one state page.

Prefill: one forward over the (padded) prompt (deepseek_v4_decoding.prefill, batch 1); its C4
entries go straight to the host pool (store_prefill_rows: never into the decode cache on the
device; they exist on the device only as that one prompt's forward output), the prompt's last
entry also to the reserved newest slot, the rest into the slot's rows of the V4Cache. Decode: deepseek_v4_decoding._step over all R slots with per-slot positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from configs.deepseek_v4 import CSA, HCA
from hisparse_jax.row_layout import KVRowLayout
from hisparse_jax.state import FullKVState, HiSparseState
from models.common.runner import FamilyRunner, RequestFootprint, StepCounts
from models.deepseek_v4 import decoding as v4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class V4ServingCache:
    """Everything a V4 engine keeps between steps."""

    kv: HiSparseState | FullKVState  # C4 entries: L = J CSA layers, R slots, Ne positions; its type picks HiSparse
    rest: v4.V4Cache  # windows, HCA entries, indexer keys, raw windows; CSA entries [R, 0, A] (they are in kv)
    max_len: int = dataclasses.field(metadata=dict(static=True))  # static: C, the tokens a slot holds (array sizes derive from it)


def c4_layout(config, dtype) -> KVRowLayout:
    """A C4 entry's row: head_dim values, the trailing qk_rope_head_dim rotated (stored as one plain row)."""
    return KVRowLayout(config.head_dim - config.qk_rope_head_dim, config.qk_rope_head_dim, np.dtype(dtype).name)


def footprint(config, dtype, hisparse) -> RequestFootprint:
    """Device bytes of one request (admission's count), from the config: per token the CSA
    indexer keys (one per csa_rate tokens and CSA layer) and HCA entries (one per hca_rate tokens
    and HCA layer), plus the C4 entries without HiSparse; per request the sliding windows (every
    layer), the compressors' raw windows and, with HiSparse, the C4 device buffers (B + 1 rows
    per CSA layer)."""
    e = np.dtype(dtype).itemsize
    A, I, S = config.head_dim, config.index_head_dim, config.sliding_window
    J = sum(t == CSA for t in config.layer_types)
    hca = sum(t == HCA for t in config.layer_types)
    row = c4_layout(config, dtype).bytes_per_row
    # raw kv + gate per compressed layer: CSA (overlapping) 2M tokens x 2A, HCA M x A; indexer 2M x 2I
    raw = 2 * e * (J * 2 * config.csa_rate * 2 * A + hca * config.hca_rate * A + J * 2 * config.csa_rate * 2 * I)
    fixed = config.num_layers * S * A * e + raw
    per_tokens = [(J * I * e, config.csa_rate), (hca * A * e, config.hca_rate)]
    if hisparse is None:
        per_tokens.append((J * row, config.csa_rate))
        host = ()
    else:
        fixed += J * (hisparse.device_buffer_size + 1) * row
        host = ((J * row, config.csa_rate),)  # every C4 entry of every CSA layer, in the host pool
    return RequestFootprint(row_bytes=row, fixed_bytes=fixed, per_tokens=tuple(per_tokens), host_per_tokens=host)


def prompt_caches(model, tokens, prompt_len, max_len: int):
    """Prompt tokens i32[Tp] (prompt_len real, i32[]) -> (a batch-1 V4Cache for max_len tokens,
    with the prompt's CSA entries; logits f32[V] of the last prompt token)."""
    one, logits = v4.prefill(model, tokens[None], max_len, prompt_len)
    return one, logits[0, prompt_len - 1]


def store_prompt(config, cache: V4ServingCache, slot, one: v4.V4Cache, prompt_len, host_pages, *, implementation=None):
    """The prompt's caches (prompt_caches) into free slot `slot`: its C4 entries to the KV state
    (HiSparse: straight to the host pool; host_pages i32[P] its pages, None for the baseline),
    the prompt's last entry also to the newest slot, everything else into the slot's V4Cache rows."""
    n = prompt_len // config.csa_rate  # i32[]: entries the prompt closed
    kv = cache.kv.begin_request(slot, n, host_pages)
    R = kv.num_requests
    newest = jnp.full((R,), -1, jnp.int32).at[slot].set(n - 1)  # i32[R]: the prompt's last entry (-1: none)
    for j, layer in enumerate(config.csa_layers):
        entries = one.entries[layer][0]  # [Nmax, A]: positions >= n are not the prompt's and are dropped
        kv = kv.store_prefill_rows(j, slot, 0, entries, n, implementation=implementation)
        # An entry is the newest until the next window closes: the library keeps it in the reserved slot.
        last = jnp.zeros((R, entries.shape[-1]), entries.dtype).at[slot].set(entries[jnp.maximum(n - 1, 0)])  # [R, A]
        kv = kv.write_newest(j, last, newest)
    return V4ServingCache(kv, v4.put_request(cache.rest, slot, one), cache.max_len)


def decode_all_slots(model, cache: V4ServingCache, tokens, positions, *, implementation=None):
    """tokens, positions i32[R] (-1 inactive) -> (cache, logits f32[R, V], StepCounts i32[J, R])."""
    rest, kv, logits, (hits, misses) = v4._step(model, cache.rest, cache.kv, tokens, positions, implementation)
    return V4ServingCache(kv, rest, cache.max_len), logits, StepCounts(hits, misses)


def move_slot(cache: V4ServingCache, source, target) -> V4ServingCache:
    return V4ServingCache(cache.kv.move_request(source, target), v4.move_request(cache.rest, source, target), cache.max_len)


class V4Runner(FamilyRunner):
    """The engine's runner for a DeepseekV4ForCausalLM (models/common/runner.py has the contract)."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        if not self.config.csa_layers:
            raise ValueError("the model has no compressed_sparse_attention layer: there is no C4 pool to serve from")
        impl = self.implementation
        self._forward_fn = prompt_caches
        self._store_fn = lambda c, slot, one, n, pages: store_prompt(self.config, c, slot, one, n, pages, implementation=impl)
        self._decode_fn = lambda m, c, tokens, positions: decode_all_slots(m, c, tokens, positions, implementation=impl)
        self._move_fn = move_slot

    def _create_cache(self, *, num_requests, max_context, hisparse, num_host_pages, page_size, fill_value) -> V4ServingCache:
        config, rate = self.config, self.config.csa_rate
        if page_size % rate:
            raise ValueError(f"page_size ({page_size}) must be a multiple of the CSA rate ({rate}): a host page holds page_size / {rate} entries")
        J, Ne = len(config.csa_layers), -(-max_context // rate)  # entry positions: a started window counts
        layout = c4_layout(config, self.dtype)
        if hisparse is None:
            kv = FullKVState.create(num_layers=J, num_requests=num_requests, max_context=Ne, layout=layout, fill_value=fill_value)
        else:
            if hisparse.top_k != config.index_topk:
                raise ValueError(f"hisparse_config top_k ({hisparse.top_k}) must equal the model's index_topk ({config.index_topk})")
            kv = HiSparseState.create(
                num_layers=J, num_requests=num_requests, max_context=Ne, config=hisparse, layout=layout,
                num_host_pages=num_host_pages, page_size=page_size // rate, fill_value=fill_value,
            )  # fmt: skip
        return V4ServingCache(kv, v4.create_cache(self.model, num_requests, max_context, csa_entries=False), max_context)

    def max_context(self, cache: V4ServingCache) -> int:
        return cache.max_len

    def device_footprint(self, hisparse) -> RequestFootprint:
        return footprint(self.config, self.dtype, hisparse)
