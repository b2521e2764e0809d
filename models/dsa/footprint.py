"""Device bytes one DSA request holds, as admission counts them (the engine's Scheduler).

Here, below the serving layer, so the DSA ModelRunner can hand the engine its own footprint as
the V4 / M3 runners do theirs (models.common.runner.RequestFootprint): one interface,
`runner.device_footprint(hisparse)`.
"""

from __future__ import annotations

import dataclasses

from configs.model import DSAModelConfig
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.row_layout import KVRowLayout
from models.dsa.indexer import index_key_bytes, index_key_dtype


@dataclasses.dataclass(frozen=True)
class DeviceFootprint:
    """Device bytes one request holds: its KV rows (a hot buffer with HiSparse, else every row)
    plus its indexer keys, which stay on the device for the whole context (docs/background.md)."""

    num_layers: int  # layers with a KV cache (all of them)
    num_index_layers: int  # full-indexer layers, each caching one key per token
    row_bytes: int  # one KV row of one layer (KVRowLayout.bytes_per_row)
    key_bytes: int  # one indexer key of one layer: I x element size, + a 4 B scale with fp8 keys
    buffer_size: int | None  # HiSparse's B; None: the baseline, every row on the device
    staged_rows: int = 0  # rows a request's shared-layer prefetch holds in flight at most (HiSparse)
    speculative_slots: int = 0  # HiSparse: each layer's slots for a speculative step's tokens (M)

    def request_bytes(self, num_tokens: int) -> int:
        keys = self.num_index_layers * num_tokens * self.key_bytes
        if self.buffer_size is None:
            return self.num_layers * num_tokens * self.row_bytes + keys
        # + the newest-token slot (and speculative slots) per layer, + the prefetched rows
        # waiting for their shared layers
        slots = self.buffer_size + 1 + self.speculative_slots
        return (self.num_layers * slots + self.staged_rows) * self.row_bytes + keys

    def host_request_bytes(self, num_tokens: int) -> int:
        """Host pool bytes one request's KV rows take (HiSparse: every row of every layer is kept
        in the pinned host pool); 0 for the baseline."""
        return 0 if self.buffer_size is None else self.num_layers * num_tokens * self.row_bytes

    def capacity(self, budget_bytes: int, num_tokens: int) -> int:
        """Requests of `num_tokens` tokens that fit in `budget_bytes`."""
        return budget_bytes // self.request_bytes(num_tokens)

    @classmethod
    def of(
        cls, config: DSAModelConfig, dtype, hisparse: HiSparseConfig | None, kv_cache_dtype: str = "auto", shared_prefetch: str = "off",
        speculative=None,
    ) -> "DeviceFootprint":
        """The footprint of a model whose params are `dtype` with caches in `kv_cache_dtype`
        (models.dsa.decoding.create_cache's: "auto" is `dtype`), decoding with `shared_prefetch`
        (a mode other than "off" stages K rows per shared layer after each anchor). speculative (a
        SpeculativeConfig): the MTP layer's KV and keys count as one more layer, and HiSparse
        buffers have its speculative slots."""
        staged = 0
        if hisparse is not None and shared_prefetch != "off":
            staged = hisparse.top_k * max((len(config.shared_layers_after(l)) for l in config.full_indexer_layers), default=0)
        layout = KVRowLayout.for_kv_cache_dtype(config.kv_lora_rank, config.qk_rope_head_dim, dtype, kv_cache_dtype)
        draft = 0 if speculative is None else 1
        return cls(
            num_layers=config.num_layers + draft,
            num_index_layers=len(config.full_indexer_layers) + draft,
            row_bytes=layout.bytes_per_row,
            key_bytes=index_key_bytes(config.index_head_dim, index_key_dtype(kv_cache_dtype, dtype)),
            buffer_size=None if hisparse is None else hisparse.device_buffer_size,
            staged_rows=staged,
            speculative_slots=0 if speculative is None or hisparse is None else speculative.tokens_per_step,
        )
