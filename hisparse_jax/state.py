"""HiSparseState: everything HiSparse keeps between decode steps, as one explicit pytree.

Letters used in shapes throughout the package:
  L  sparse layers          R  request slots (the decode batch, fixed)
  B  device_buffer_size     K  top_k entries per step
  W  stored row width       C  max context (positions per request)
  S  host pool rows         P  pages per request (C / page_size, rounded up)

Invariants the kernels rely on (tests check them):
  * buffer_tokens[l, r] holds each position at most once; -1 marks an empty slot.
  * lru_slots[l, r] is a permutation of range(B), least recently used first.
  * slot B of device_buffer[l, r] holds the newest token once the context exceeds B.
  * host_pool holds the row of every stored token: host slot of position p of request r is
    host_page_table[r, p // page_size] * page_size + p % page_size.
  * swap_in_scratch is SCRATCH_EMPTY everywhere between calls (the Pallas swap-in restores it).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax import memory
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.row_layout import KVRowLayout

# Value of an unused swap-in scratch entry: larger than any top-k index, so marking the first
# occurrence of a position (the smallest top-k index) works against it.
SCRATCH_EMPTY = np.iinfo(np.int32).max


def _field(static: bool = False):
    return dataclasses.field(metadata=dict(static=static))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HiSparseState:
    """Device hot buffers, LRU bookkeeping, page tables and the pinned host pool."""

    device_buffer: jax.Array  # row[L, R, B + 1, W]: B LRU-managed slots + slot B for the newest token
    buffer_tokens: jax.Array  # i32[L, R, B]: logical position held by each slot, -1 empty
    lru_slots: jax.Array  # i32[L, R, B]: slot ids ordered least -> most recently used
    host_pool: jax.Array  # row[L, S, W], pinned_host: the full KV of every request, addressed by page
    host_page_table: jax.Array  # i32[R, P]: host page backing each page of a request, -1 none
    seq_lens: jax.Array  # i32[R]: tokens stored for each request slot (0 = free slot)
    swap_in_scratch: jax.Array  # i32[R, C]: Pallas swap-in workspace indexed by position
    page_size: int = _field(static=True)  # tokens per host page

    @property
    def num_layers(self) -> int:
        return self.device_buffer.shape[0]

    @property
    def num_requests(self) -> int:
        return self.device_buffer.shape[1]

    @property
    def buffer_size(self) -> int:
        """B: LRU-managed slots per request and layer."""
        return self.buffer_tokens.shape[2]

    @property
    def reserved_slot(self) -> int:
        """Slot index holding the newest token on the long path (n > B)."""
        return self.buffer_size

    @property
    def max_context(self) -> int:
        return self.swap_in_scratch.shape[1]

    @property
    def num_host_pages(self) -> int:
        return self.host_pool.shape[1] // self.page_size

    def replace(self, **changes) -> "HiSparseState":
        return dataclasses.replace(self, **changes)

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        num_requests: int,
        max_context: int,
        config: HiSparseConfig,
        layout: KVRowLayout,
        num_host_pages: int | None = None,
        page_size: int = 64,
        fill_value: float = 0.0,
        device: jax.Device | None = None,
    ) -> "HiSparseState":
        """Allocates an empty state; every request slot starts free.

        num_host_pages defaults to host_to_device_ratio x the device pool (R x B tokens), as
        SGLang sizes its host pool. fill_value initialises rows nothing has written (tests pass
        NaN so a stray read shows).
        """
        B = config.device_buffer_size
        if num_host_pages is None:
            num_host_pages = math.ceil(config.host_to_device_ratio * num_requests * B / page_size)
        pages_per_request = math.ceil(max_context / page_size)
        L, R, W = num_layers, num_requests, layout.width
        dev = memory.DEVICE
        return cls(
            device_buffer=memory.allocate((L, R, B + 1, W), layout.dtype, fill_value, dev, device),
            buffer_tokens=memory.allocate((L, R, B), jnp.int32, -1, dev, device),
            lru_slots=jax.device_put(
                jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32), (L, R, B)), memory.sharding(dev, device)
            ),
            host_pool=memory.allocate(
                (L, num_host_pages * page_size, W), layout.dtype, fill_value, memory.PINNED_HOST, device
            ),
            host_page_table=memory.allocate((R, pages_per_request), jnp.int32, -1, dev, device),
            seq_lens=memory.allocate((R,), jnp.int32, 0, dev, device),
            swap_in_scratch=memory.allocate((R, max_context), jnp.int32, SCRATCH_EMPTY, dev, device),
            page_size=page_size,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FullKVState:
    """The no-offload baseline: every token's row on the device, indexed by position."""

    kv: jax.Array  # row[L, R, C, W]: row of position p of request r at kv[l, r, p]
    seq_lens: jax.Array  # i32[R]: tokens stored for each request slot

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def num_requests(self) -> int:
        return self.kv.shape[1]

    @property
    def max_context(self) -> int:
        return self.kv.shape[2]

    def replace(self, **changes) -> "FullKVState":
        return dataclasses.replace(self, **changes)

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        num_requests: int,
        max_context: int,
        layout: KVRowLayout,
        fill_value: float = 0.0,
        device: jax.Device | None = None,
    ) -> "FullKVState":
        dev = memory.DEVICE
        return cls(
            kv=memory.allocate(
                (num_layers, num_requests, max_context, layout.width), layout.dtype, fill_value, dev, device
            ),
            seq_lens=memory.allocate((num_requests,), jnp.int32, 0, dev, device),
        )


def state_shardings(state):
    """Output shardings for a jit that returns `state`: the host pool stays in pinned_host.

    XLA refuses a kernel's in-place write to pinned_host memory unless the jit's output is
    declared pinned_host too (GPU_FACTS), so every jit returning a HiSparseState passes this.
    """
    device = next(iter(state.seq_lens.devices()))

    def one(path, leaf):
        name = jax.tree_util.keystr(path)
        kind = memory.PINNED_HOST if "host_pool" in name else memory.DEVICE
        return memory.sharding(kind, device)

    return jax.tree_util.tree_map_with_path(one, state)


def jit_donating_state(fn, state, *, extra_outputs: int = 0, **jit_kwargs):
    """jax.jit of `fn(state, ...) -> state` (or `(state, *extras)` with extra_outputs > 0).

    The state (first argument) is donated, so kernels update its buffers in place, and the
    output keeps the host pool in pinned_host memory (see state_shardings).
    """
    shardings = state_shardings(state)
    out_shardings = shardings if extra_outputs == 0 else (shardings,) + (None,) * extra_outputs
    return jax.jit(fn, donate_argnums=0, out_shardings=out_shardings, **jit_kwargs)
