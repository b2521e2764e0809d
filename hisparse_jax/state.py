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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hisparse_jax import memory
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.row_layout import KVRowLayout
from pallas_kernels.swap_in import SCRATCH_EMPTY  # the swap-in kernel owns its scratch's sentinel

# Mesh axis the request slots are split over (data-parallel attention, hisparse_jax.sharding).
# Every array with a request dimension is split on it; nothing else is, so no device holds
# another data-parallel group's KV.
REQUEST_AXIS = "dp"



def _field(static: bool = False):
    return dataclasses.field(metadata=dict(static=static))


# Which dimension of each state array indexes request slots (None: no such dimension).
_REQUEST_DIM = {
    "device_buffer": 1,
    "buffer_tokens": 1,
    "lru_slots": 1,
    "host_pool": 1,  # pool rows: each data-parallel group owns one contiguous block
    "host_page_table": 0,
    "seq_lens": 0,
    "swap_in_scratch": 0,
    "kv": 1,
}


def partition_specs(state):
    """The PartitionSpec of every array of a HiSparseState / FullKVState over a ("dp", ...) mesh."""

    def spec(path, leaf):
        name = path[-1].name
        dims = [None] * leaf.ndim
        dims[_REQUEST_DIM[name]] = REQUEST_AXIS
        return P(*dims)

    return jax.tree_util.tree_map_with_path(spec, state)


class _Placer:
    """Where `create` puts each array: one device, or split over a mesh's request axis."""

    def __init__(self, device: jax.Device | None, mesh: Mesh | None):
        self.device, self.mesh = device, mesh

    def __call__(self, name, shape, dtype, fill_value, memory_kind=memory.DEVICE):
        if self.mesh is None:
            return memory.allocate(shape, dtype, fill_value, memory_kind, self.device)
        spec = [None] * len(shape)
        spec[_REQUEST_DIM[name]] = REQUEST_AXIS
        placement = NamedSharding(self.mesh, P(*spec), memory_kind=memory_kind)
        return memory.allocate(shape, dtype, fill_value, memory_kind, placement=placement)


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
    copy_rows_per_program: int = _field(static=True)  # swap-in copy launch shape (HiSparseConfig)

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
        mesh: Mesh | None = None,
    ) -> "HiSparseState":
        """Allocates an empty state; every request slot starts free.

        num_host_pages defaults to host_to_device_ratio x the device pool (R x B tokens), as
        SGLang sizes its host pool. fill_value initialises rows nothing has written (tests pass
        NaN so a stray read shows). With a mesh, request slots and host pool rows are split over
        its "dp" axis (num_requests and num_host_pages must divide by its size).
        """
        B = config.device_buffer_size
        if num_host_pages is None:
            num_host_pages = math.ceil(config.host_to_device_ratio * num_requests * B / page_size)
        pages_per_request = math.ceil(max_context / page_size)
        L, R, W = num_layers, num_requests, layout.width
        place = _Placer(device, mesh)
        lru = place("lru_slots", (L, R, B), jnp.int32, 0)
        lru = jax.jit(lambda x: x + jnp.arange(B, dtype=jnp.int32), out_shardings=lru.sharding, donate_argnums=0)(lru)
        return cls(
            device_buffer=place("device_buffer", (L, R, B + 1, W), layout.dtype, fill_value),
            buffer_tokens=place("buffer_tokens", (L, R, B), jnp.int32, -1),
            lru_slots=lru,
            # With a mesh, each data-parallel group owns the contiguous pool block of its shard
            # and its page table holds page numbers local to that block.
            host_pool=place("host_pool", (L, num_host_pages * page_size, W), layout.dtype, fill_value, memory.PINNED_HOST),
            host_page_table=place("host_page_table", (R, pages_per_request), jnp.int32, -1),
            seq_lens=place("seq_lens", (R,), jnp.int32, 0),
            swap_in_scratch=place("swap_in_scratch", (R, max_context), jnp.int32, SCRATCH_EMPTY),
            page_size=page_size,
            copy_rows_per_program=config.copy_rows_per_program,
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
        mesh: Mesh | None = None,
    ) -> "FullKVState":
        place = _Placer(device, mesh)
        return cls(
            kv=place("kv", (num_layers, num_requests, max_context, layout.width), layout.dtype, fill_value),
            seq_lens=place("seq_lens", (num_requests,), jnp.int32, 0),
        )


def state_shardings(state):
    """Output shardings for a jit that returns `state`: each array stays where it is.

    XLA refuses a kernel's in-place write to pinned_host memory unless the jit's output is
    declared pinned_host too (GPU_FACTS), so every jit returning a state passes these; they
    also keep a mesh-split state split the same way.
    """
    return jax.tree.map(lambda leaf: leaf.sharding, state)


def jit_donating_state(fn, state, *, extra_outputs: int = 0, **jit_kwargs):
    """jax.jit of `fn(state, ...) -> state` (or `(state, *extras)` with extra_outputs > 0).

    The state (first argument) is donated, so kernels update its buffers in place, and the
    output keeps the host pool in pinned_host memory (see state_shardings).
    """
    shardings = state_shardings(state)
    out_shardings = shardings if extra_outputs == 0 else (shardings,) + (None,) * extra_outputs
    return jax.jit(fn, donate_argnums=0, out_shardings=out_shardings, **jit_kwargs)
