"""The KV state a decode step carries, as one explicit pytree per memory mode.

Two memory modes, one interface (KVState):
  HiSparseState: the full KV in pinned host memory, a B-slot hot buffer per request on device;
  FullKVState:   the no-offload baseline, every row on the device.
The state's class is the one place the mode is chosen: hisparse_jax.attention_layer and
hisparse_jax.kv_cache_ops call KVState methods and never test the type.

Letters used in shapes throughout the package:
  L  sparse layers          R  request slots (the decode batch, fixed)
  B  device_buffer_size     K  top_k entries per step
  W  stored row width       C  max context (positions per request)
  S  host pool rows         P  pages per request (C / page_size, rounded up)
  H  attention heads        D  latent (value) width, the first D values of a row
  T  prompt rows in one store_prefill_rows call
"row" is the stored row dtype (KVRowLayout.dtype: bf16, f32, or uint32 words of packed fp8 rows);
i32 is int32, f32 float32. Each state carries its KVRowLayout (a static field, `layout`): how its
rows are packed, which attention needs to read them.

A decode step may run a batch of b <= R requests (the engine's batch buckets): its per-request
arrays (new_row, positions, topk: b rows) stand for slots 0 .. b - 1, which the engine keeps
filled by moving requests down when one retires (move_request); slots b .. R - 1 are untouched.

Invariants of a HiSparseState the kernels rely on (tests check them):
  * buffer_tokens[l, r] holds each position at most once; -1 marks an empty slot.
  * lru_slots[l, r] is a permutation of range(B), least recently used first.
  * slot B of device_buffer[l, r] holds the newest token once the context exceeds B.
  * host_pool holds the row of every stored token: host slot of position p of request r is
    host_page_table[r, p // page_size] * page_size + p % page_size.
  * swap_in_scratch is SCRATCH_EMPTY everywhere between calls (the Pallas swap-in restores it).
  * with M speculative slots (create(speculative_slots=M)), slots B + 1 .. B + M of
    device_buffer[l, r] hold the rows of a speculative step's tokens, positions seq_len ..
    seq_len + M - 1, during that step only (hisparse_jax.speculative; docs/contract.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hisparse_jax import memory
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.row_layout import KVRowLayout
from pallas_kernels.row_copy import copy_host_rows_to_buffer, gather_host_rows, write_all_layer_rows_to_host, write_rows_to_host
from pallas_kernels.side_stream_gather import PendingGather
from pallas_kernels.sparse_mla_attention import sparse_mla_attention, sparse_mla_attention_reading_host
from pallas_kernels.swap_in import SCRATCH_EMPTY  # the swap-in kernel owns its scratch's sentinel
from pallas_kernels.swap_in import SwapInPlan, host_slots_of, swap_in_plan

# Mesh axis the request slots are split over (data-parallel attention, hisparse_jax.sharding).
# Every array with a request dimension is split on it; nothing else is, so no device holds
# another data-parallel group's KV.
REQUEST_AXIS = "dp"


def _field(static: bool = False):  # a dataclass field; static ones are pytree metadata, not leaves
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
    "device_page_table": 0,  # hisparse_jax.paged_state
    "resident": 0,
}


def partition_specs(state):
    """The PartitionSpec of every array of a HiSparseState / FullKVState over a ("dp", ...) mesh.

    Returns a pytree of the state's structure holding a PartitionSpec per array: the request
    dimension on REQUEST_AXIS, every other dimension replicated.
    """

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


class KVState(Protocol):
    """What the layer step and the request lifecycle need of a memory mode.

    HiSparseState and FullKVState implement it. Every method is traceable and returns a new
    state (the arrays are updated functionally; under a state-donating jit, in place). Users call
    the functions of hisparse_jax.kv_cache_ops and hisparse_jax.attention_layer, which validate
    their arguments and run these methods in the order docs/contract.md describes. Methods taking
    rows accept stored rows row[..., W] or their values [..., latent + rope], which they pack
    with `layout` (KVRowLayout.to_stored: quantised for fp8 rows).
    """

    seq_lens: jax.Array  # i32[R]: tokens stored for each request slot (0 = free slot)
    layout: KVRowLayout  # static: how every row of the state is stored (width W, dtype, fp8 or not)

    @property
    def device_rows(self) -> jax.Array:
        """row[L, R, S, W]: the device array attention reads rows from (S slots per request)."""
        ...

    @property
    def num_layers(self) -> int:
        """L: sparse layers."""
        ...

    @property
    def num_requests(self) -> int:
        """R: request slots."""
        ...

    @property
    def max_context(self) -> int:
        """C: positions per request."""
        ...

    def replace(self, **changes) -> "KVState":
        """A copy with the given fields replaced."""
        ...

    def begin_request(self, request, prompt_len, host_pages=None) -> "KVState":
        """Claims slot `request` (i32[]) for a prompt of `prompt_len` (i32[]) tokens; host_pages i32[P]."""
        ...

    def store_prefill_rows(self, layer, request, start, rows, prompt_len, *, implementation=None) -> "KVState":
        """Stores rows row[T, W] of positions start .. start + T - 1 below prompt_len."""
        ...

    def end_request(self, request) -> "KVState":
        """Frees slot `request` (i32[])."""
        ...

    def move_request(self, source, target) -> "KVState":
        """Moves the request in slot `source` (i32[]) to the free slot `target` (i32[]): every
        per-request array's row; the host pool is addressed by page and stays. `source` is left
        free."""
        ...

    def write_newest(self, layer, new_row, positions) -> "KVState":
        """Puts new_row row[b, W] where attention finds it; positions i32[b], -1 inactive; b <= R
        (slots 0 .. b - 1, as in every step method below)."""
        ...

    def swap_in(self, layer, topk, lengths, *, implementation=None, defer_copy=False) -> tuple["KVState", SwapInPlan]:
        """Makes the rows topk i32[R, K] selects readable in device_rows: returns the state and the
        plan, whose slots i32[R, K] index device_rows. lengths i32[R]: tokens stored with the newest.
        defer_copy: the caller attends with attend(..., deferred_topk=topk) next, which may read
        the misses from the host itself (miss_read "attention"); then they are not copied here."""
        ...

    def attend(self, layer, query, plan: SwapInPlan, *, deferred_topk=None, latent_dim, sm_scale, implementation=None) -> tuple["KVState", jax.Array]:
        """Sparse MLA attention of query [b, H, D + rope] over the plan's slots -> (state,
        f32[b, H, D]). deferred_topk: the plan's i32[b, K] selection, given exactly when swap_in
        ran with defer_copy=True (the misses may still be on the host: they are read here);
        None when every row is in place (a copy or a replay placed them)."""
        ...

    def replay_swap_in(self, layer, plan: SwapInPlan, *, implementation=None) -> "KVState":
        """Applies another layer's plan to `layer` (a shared-index layer): copies its misses only."""
        ...

    def backup_newest(self, layer, new_row, positions, *, implementation=None) -> "KVState":
        """Makes new_row row[R, W] durable wherever the mode keeps every row (positions i32[R])."""
        ...

    def backup_all_newest(self, rows, positions, *, implementation=None) -> "KVState":
        """backup_newest of every layer at once: rows row[L, R, W] (layer l's at rows[l])."""
        ...

    def prefetch_misses(self, layer, plan: SwapInPlan, *, implementation=None, launch=None) -> jax.Array | None:
        """The rows a shared-index `layer` will replay from another layer's plan, fetched now into
        a new array (row[R, K, W], None when the mode copies nothing), through
        `launch(fn, *arrays) -> fn(*arrays)` (the caller picks where it runs, e.g. a side stream)."""
        ...

    def start_side_prefetch(self, layer: int, plan: SwapInPlan, tie: jax.Array) -> "tuple[PendingGather | None, jax.Array]":
        """prefetch_misses on a CUDA stream of its own (pallas_kernels.side_stream_gather) ->
        (the pending gather, None when the mode copies nothing; tie passed through: compute
        that uses it runs beside the copy). `layer` is a static int (it tags the gather)."""
        ...

    def replay_prefetched(self, layer, plan: SwapInPlan, rows) -> "KVState":
        """replay_swap_in from rows prefetch_misses fetched (a device-to-device placement)."""
        ...

    # ---- speculative steps (hisparse_jax.speculative) ----------------------------------------

    def speculative_plan_width(self, top_k: int) -> int | None:
        """Top-k entries one speculative plan may take at most (the positions of one group are
        planned together); None: any number."""
        ...

    def write_speculative(self, layer, rows, positions, committed) -> "KVState":
        """Puts rows row[b, q, W] of a speculative step's tokens where attention finds them;
        positions i32[b, q] (-1 inactive), committed i32[b]: tokens stored before the step."""
        ...

    def plan_speculative(self, layer, topk, committed, *, implementation=None) -> tuple["KVState", SwapInPlan]:
        """swap_in of topk i32[b, n] over the committed context, the step's own tokens (positions
        >= committed) resolved to where write_speculative put them. committed i32[b], -1 inactive."""
        ...

    def commit_speculative(self, layer, rows, positions, committed, *, implementation=None) -> "KVState":
        """Keeps the rows row[b, q, W] of positions i32[b, q] below committed i32[b] (the new
        lengths) as if decoded one by one; the rest are dropped. seq_lens is the caller's."""
        ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HiSparseState:
    """KVState with offload: device hot buffers, LRU bookkeeping, page tables, the pinned host pool."""

    device_buffer: jax.Array  # row[L, R, B + 1, W]: B LRU-managed slots + slot B for the newest token
    buffer_tokens: jax.Array  # i32[L, R, B]: logical position held by each slot, -1 empty
    lru_slots: jax.Array  # i32[L, R, B]: slot ids ordered least -> most recently used
    host_pool: jax.Array  # row[L, S, W], pinned_host: the full KV of every request, addressed by page
    host_page_table: jax.Array  # i32[R, P]: host page backing each page of a request, -1 none
    seq_lens: jax.Array  # i32[R]: tokens stored for each request slot (0 = free slot)
    swap_in_scratch: jax.Array  # i32[R, C]: Pallas swap-in workspace indexed by position
    page_size: int = _field(static=True)  # tokens per host page
    copy_rows_per_program: int = _field(static=True)  # swap-in copy launch shape (HiSparseConfig)
    layout: KVRowLayout = _field(static=True)  # how the rows of device_buffer and host_pool are stored
    # HiSparseConfig.miss_read: "copy" (a copy kernel before attention) or "attention" (the
    # attention kernel reads a decode step's misses from the pool itself; attention_layer only)
    miss_read: str = dataclasses.field(default="copy", kw_only=True, metadata=dict(static=True))
    reads_misses_in_attention_ok = True  # class constant: the static buffer's slots are rows

    @property
    def device_rows(self) -> jax.Array:
        """row[L, R, B + 1, W]: the device buffer, the array attention reads rows from."""
        return self.device_buffer

    @property
    def num_layers(self) -> int:
        """L: sparse layers."""
        return self.device_buffer.shape[0]

    @property
    def num_requests(self) -> int:
        """R: request slots."""
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
        """C: positions per request."""
        return self.swap_in_scratch.shape[1]

    @property
    def num_host_pages(self) -> int:
        """Pages of the host pool (S / page_size)."""
        return self.host_pool.shape[1] // self.page_size

    def replace(self, **changes) -> "HiSparseState":
        """A copy with the given fields replaced."""
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
        host_memory_kind: str | None = None,
        speculative_slots: int = 0,
        **device_options,
    ) -> "HiSparseState":
        """Allocates an empty state; every request slot starts free.

        speculative_slots (M): device rows per request and layer, after the newest-token slot,
        for the tokens of a speculative step (hisparse_jax.speculative): M = the most tokens one
        step verifies or drafts (SGLang's num_draft_tokens). 0: none (plain decoding).

        B = config.device_buffer_size; rows in layout.dtype, W = layout.width. num_host_pages
        defaults to host_to_device_ratio x the device pool (R x B tokens), as SGLang sizes its
        host pool. fill_value initialises rows nothing has written (tests pass NaN so a stray
        read shows; fp8 rows take 0 or NaN only). With a mesh, request slots and host pool rows
        are split over its "dp" axis (num_requests and num_host_pages must divide by its size).
        device_options go to _device_arrays (a subclass's own sizes, e.g. PagedHiSparseState's
        num_device_pages). host_memory_kind: where the host pool lives (None: pinned_host;
        memory.host_pool_kind says where the kernels of an implementation need it).
        """
        B = config.device_buffer_size
        if num_host_pages is None:
            num_host_pages = math.ceil(config.host_to_device_ratio * num_requests * B / page_size)
        pages_per_request = math.ceil(max_context / page_size)
        L, R, W = num_layers, num_requests, layout.width
        fill_value = layout.fill_element(fill_value)
        place = _Placer(device, mesh)
        lru = place("lru_slots", (L, R, B), jnp.int32, 0)
        lru = jax.jit(lambda x: x + jnp.arange(B, dtype=jnp.int32), out_shardings=lru.sharding, donate_argnums=0)(lru)
        if speculative_slots:  # only the static buffer has them (a paged pool refuses in _device_arrays)
            device_options["speculative_slots"] = speculative_slots
        return cls(
            **cls._device_arrays(place, L, R, B, W, max_context, page_size, layout, fill_value, **device_options),
            buffer_tokens=place("buffer_tokens", (L, R, B), jnp.int32, -1),
            lru_slots=lru,
            # With a mesh, each data-parallel group owns the contiguous pool block of its shard
            # and its page table holds page numbers local to that block.
            host_pool=place("host_pool", (L, num_host_pages * page_size, W), layout.dtype, fill_value, host_memory_kind or memory.PINNED_HOST),
            host_page_table=place("host_page_table", (R, pages_per_request), jnp.int32, -1),
            seq_lens=place("seq_lens", (R,), jnp.int32, 0),
            swap_in_scratch=place("swap_in_scratch", (R, max_context), jnp.int32, SCRATCH_EMPTY),
            page_size=page_size,
            copy_rows_per_program=config.copy_rows_per_program,
            layout=layout,
            miss_read=cls._checked_miss_read(config.miss_read),
        )

    @classmethod
    def _checked_miss_read(cls, miss_read: str) -> str:
        if miss_read == "attention" and not cls.reads_misses_in_attention_ok:
            raise ValueError(f"miss_read 'attention' is not available for {cls.__name__}: use 'copy'")
        return miss_read

    @classmethod
    def _device_arrays(cls, place, L, R, B, W, max_context, page_size, layout, fill_value, speculative_slots=0) -> dict:
        """The device row arrays create allocates: here one static B + 1 (+ M speculative) row
        buffer per slot."""
        return dict(device_buffer=place("device_buffer", (L, R, B + 1 + speculative_slots, W), layout.dtype, fill_value))

    @property
    def speculative_slots(self) -> int:
        """M: device slots per request and layer for a speculative step's tokens (B + 1 .. B + M)."""
        return self.device_buffer.shape[2] - self.buffer_size - 1

    # ---- where rows live on the device: what a subclass (PagedHiSparseState) remaps ----------

    def _slot_rows(self, requests, slots) -> jax.Array:
        """i32[...]: the device row (the index into device_rows[layer, request]) of each buffer slot
        of requests (same shapes; -1 stays -1). Here a slot is its own row."""
        return slots

    def _scatter_device_rows(self, layer, requests, rows_at, values) -> jax.Array:
        """device_buffer with values row[..., W] written at device rows rows_at i32[...] of
        `requests` (same shape); a row of -1 writes nothing."""
        dropped = jnp.where(rows_at >= 0, rows_at, self.device_buffer.shape[2])  # past the end: dropped
        return self.device_buffer.at[layer, self._buffer_request(requests), dropped].set(values, mode="drop")

    def _buffer_request(self, requests) -> jax.Array:
        """The device_buffer request index of each request: itself (one buffer row each)."""
        return requests

    def _newest_slot(self, positions) -> jax.Array:
        """i32[b]: the slot the newest token's row goes to: its position while n <= B, else B."""
        return jnp.where(positions < self.buffer_size, positions, self.reserved_slot)

    def _prefill_on_device(self, request, preload, valid) -> jax.Array:
        """bool[T]: which prompt rows also go to the device (slot = position): the preloaded ones."""
        return preload

    # ---- KVState: request lifecycle ----------------------------------------------------------

    def begin_request(self, request, prompt_len, host_pages=None) -> "HiSparseState":
        """Records host_pages i32[P] in the page table; the buffer starts empty, the LRU in slot order."""
        if host_pages is None:
            raise ValueError("begin_request on a HiSparseState needs the request's host_pages")
        P = self.host_page_table.shape[1]
        if jnp.shape(host_pages) != (P,):
            raise ValueError(f"host_pages shape {jnp.shape(host_pages)} must be (P,) = ({P},), the page table's row")
        return self.replace(
            host_page_table=self.host_page_table.at[request].set(jnp.asarray(host_pages).astype(jnp.int32)),
            buffer_tokens=self.buffer_tokens.at[:, request].set(-1),
            lru_slots=self.lru_slots.at[:, request].set(jnp.arange(self.buffer_size, dtype=jnp.int32)),
            seq_lens=self.seq_lens.at[request].set(prompt_len),
        )

    def store_prefill_rows(self, layer, request, start, rows, prompt_len, *, implementation=None) -> "HiSparseState":
        """Rows row[T, W] go straight to their host slots (the device never holds the whole
        context); when the prompt fits (prompt_len <= B) they are also preloaded into slots
        0 .. prompt_len - 1, as the decode fast path expects. Rows may also be their values
        [T, latent + rope], packed here (KVRowLayout.to_stored)."""
        rows = self.layout.to_stored(rows)
        positions = start + jnp.arange(rows.shape[0], dtype=jnp.int32)  # i32[T]
        valid = positions < prompt_len
        page_row = self.host_page_table[request]  # i32[P]
        host_slot = jnp.where(valid, host_slots_of(page_row, positions, self.page_size), -1)
        pool = write_rows_to_host(self.host_pool, layer, rows, host_slot, implementation=implementation)
        B = self.buffer_size
        preload = valid & (prompt_len <= B)
        target = jnp.where(preload, positions, B + 1)  # dropped unless preloading
        on_device = jnp.where(self._prefill_on_device(request, preload, valid), positions, -1)  # i32[T]: slot = position
        requests = jnp.broadcast_to(request, positions.shape)
        device_buffer = self._scatter_device_rows(layer, requests, self._slot_rows(requests, on_device), rows)
        buffer_tokens = self.buffer_tokens.at[layer, request, target].set(positions, mode="drop")
        return self.replace(host_pool=pool, device_buffer=device_buffer, buffer_tokens=buffer_tokens)

    def end_request(self, request) -> "HiSparseState":
        """Clears the slot's page table row and buffer, and its seq_len."""
        return self.replace(
            host_page_table=self.host_page_table.at[request].set(-1),
            buffer_tokens=self.buffer_tokens.at[:, request].set(-1),
            seq_lens=self.seq_lens.at[request].set(0),
        )

    def move_request(self, source, target) -> "HiSparseState":
        """Moves slot `source`'s buffer, LRU and page table to `target` and frees `source`
        (its scratch row is SCRATCH_EMPTY between steps, as the target's is)."""
        moved = {}
        for name in self._moved_with_request:  # each array's row of `source` -> `target`
            array, lead = getattr(self, name), (slice(None),) * _REQUEST_DIM[name]
            moved[name] = array.at[lead + (target,)].set(array[lead + (source,)])
        return self.replace(**moved).end_request(source)

    # The per-request arrays move_request moves (the host pool is addressed by page and stays;
    # the scratch row is SCRATCH_EMPTY between steps in every slot).
    _moved_with_request = ("device_buffer", "buffer_tokens", "lru_slots", "host_page_table", "seq_lens")

    # ---- KVState: one layer's decode step ----------------------------------------------------

    def write_newest(self, layer, new_row, positions) -> "HiSparseState":
        """new_row row[b, W] goes to slot = position while n <= B (and buffer_tokens records it),
        else to the reserved slot B; positions i32[b], -1 inactive (nothing written)."""
        B = self.buffer_size
        new_row = self.layout.to_stored(new_row)
        requests = jnp.arange(positions.shape[0])
        active = positions >= 0
        slot = jnp.where(active, self._newest_slot(positions), -1)  # i32[b]
        device_buffer = self._scatter_device_rows(layer, requests, self._slot_rows(requests, slot), new_row)
        fast = active & (positions < B)
        buffer_tokens = self.buffer_tokens.at[layer, requests, jnp.where(fast, positions, B)].set(positions, mode="drop")
        return self.replace(device_buffer=device_buffer, buffer_tokens=buffer_tokens)

    def swap_in(self, layer, topk, lengths, *, implementation=None, defer_copy=False) -> tuple["HiSparseState", SwapInPlan]:
        """Plans the swap-in of topk i32[b, K] (updating buffer_tokens, lru_slots) and copies the
        misses host -> device, unless defer_copy and miss_read "attention": then attend(...,
        deferred_topk=topk) reads them. lengths i32[b]: tokens stored including the newest, 0 inactive."""
        # A batch b smaller than R plans slots 0 .. b - 1 on the whole tables (the plan kernel
        # indexes them by request): no per-layer slices copied out and back.
        plan, buffer_tokens, lru_slots, scratch = swap_in_plan(
            self.buffer_tokens,
            self.lru_slots,
            self.swap_in_scratch,
            layer,
            topk,
            self._planned_lengths(lengths),
            self.host_page_table,
            page_size=self.page_size,
            implementation=implementation,
        )
        plan = self._plan_in_device_rows(plan)
        deferred = defer_copy and self.miss_read == "attention"
        state = self if deferred else self.replay_swap_in(layer, plan, implementation=implementation)
        return state.replace(buffer_tokens=buffer_tokens, lru_slots=lru_slots, swap_in_scratch=scratch), plan

    def attend(self, layer, query, plan: SwapInPlan, *, deferred_topk=None, latent_dim, sm_scale, implementation=None) -> tuple["HiSparseState", jax.Array]:
        """Attention over the plan's slots; with deferred_topk (swap_in deferred its copy, miss_read
        "attention") the kernel reads the misses from the pool and places them in their slots."""
        if deferred_topk is None or self.miss_read != "attention":
            return self, _attend_device_rows(self, layer, query, plan, latent_dim, sm_scale, implementation)
        out, device_buffer = sparse_mla_attention_reading_host(
            query, self.device_buffer, layer, plan.slots, self._entry_host_slots(plan, deferred_topk), self.host_pool,
            latent_dim=latent_dim, sm_scale=sm_scale, layout=self.layout, implementation=implementation,
        )
        # As in replay_swap_in: every later in-place write of the pool waits for this read.
        device_buffer, host_pool = jax.lax.optimization_barrier((device_buffer, self.host_pool))
        return self.replace(device_buffer=device_buffer, host_pool=host_pool), out

    def _entry_host_slots(self, plan: SwapInPlan, topk) -> jax.Array:
        """i32[b, K]: the host slot of every top-k entry whose row this step's misses bring in (a
        miss, or a repeat of one: its slot is a miss's destination), -1 for the others."""
        b, K = plan.slots.shape
        rows = self.device_buffer.shape[2]
        requests = jnp.arange(b)[:, None]  # i32[b, 1]
        take = jnp.arange(K)[None, :] < plan.num_misses[:, None]  # bool[b, K]
        filled = jnp.zeros((b, rows), jnp.bool_).at[requests, jnp.where(take, plan.miss_device_slots, rows)].set(True, mode="drop")
        missed = (plan.slots >= 0) & filled[requests, jnp.maximum(plan.slots, 0)]  # bool[b, K]
        host = jax.vmap(host_slots_of, in_axes=(0, 0, None))(self.host_page_table[:b], jnp.maximum(topk, 0), self.page_size)
        return jnp.where(missed, host, -1)

    def _planned_lengths(self, lengths) -> jax.Array:
        """i32[b]: the lengths the plan sees (a subclass may plan some requests as inactive)."""
        return lengths

    def _plan_in_device_rows(self, plan: SwapInPlan) -> SwapInPlan:
        """The plan with its slots (and its misses' destinations) as device rows (_slot_rows)."""
        requests = jnp.arange(plan.slots.shape[0])[:, None]  # i32[b, 1]
        return plan._replace(
            slots=self._slot_rows(requests, plan.slots), miss_device_slots=self._slot_rows(requests, plan.miss_device_slots)
        )

    def _layer_batch(self, layer, b) -> "HiSparseState":
        """The plan's inputs for slots 0 .. b - 1 of `layer`, as a one-layer, b-slot state."""
        layer_rows = lambda x: jax.lax.dynamic_slice_in_dim(x, layer, 1, axis=0)[:, :b]  # noqa: E731
        return self.replace(
            buffer_tokens=layer_rows(self.buffer_tokens),  # i32[1, b, B]
            lru_slots=layer_rows(self.lru_slots),  # i32[1, b, B]
            swap_in_scratch=self.swap_in_scratch[:b],  # i32[b, C]
            host_page_table=self.host_page_table[:b],  # i32[b, P]
        )

    def _put_layer_batch(self, layer, buffer_tokens, lru_slots, scratch) -> "HiSparseState":
        """Writes a _layer_batch's updated arrays back into slots 0 .. b - 1 of `layer`."""
        put = lambda full, part: jax.lax.dynamic_update_slice(full, part, (layer, 0, 0))  # noqa: E731
        return self.replace(
            buffer_tokens=put(self.buffer_tokens, buffer_tokens),
            lru_slots=put(self.lru_slots, lru_slots),
            swap_in_scratch=jax.lax.dynamic_update_slice(self.swap_in_scratch, scratch, (0, 0)),
        )

    def replay_swap_in(self, layer, plan: SwapInPlan, *, implementation=None) -> "HiSparseState":
        """Copies the plan's missed rows from the host pool into `layer`'s device buffer."""
        device_buffer = copy_host_rows_to_buffer(
            self.host_pool,
            self.device_buffer,  # a plan of b <= R requests copies into slots 0 .. b - 1, in place
            layer,
            plan.miss_host_slots,
            plan.miss_device_slots,
            plan.num_misses,
            implementation=implementation,
            rows_per_program=self.copy_rows_per_program,
        )
        # The copy reads the pool that backup_newest then writes in place (an aliased Pallas
        # output). Nothing else orders that write after this read, and where XLA schedules it
        # first it must keep the old pool alive: it copies the whole pinned pool (GBs through
        # PCIe, ~0.3 s per copy on the H200; seen with a top-k override). Passing the pool
        # through one barrier with the copy's output makes every later write wait for the copy.
        device_buffer, host_pool = jax.lax.optimization_barrier((device_buffer, self.host_pool))
        return self.replace(device_buffer=device_buffer, host_pool=host_pool)

    def backup_newest(self, layer, new_row, positions, *, implementation=None) -> "HiSparseState":
        """Writes new_row row[b, W] to its host slot (eager backup); positions i32[b], -1 skipped."""
        pool = write_rows_to_host(
            self.host_pool, layer, self.layout.to_stored(new_row), self._newest_host_slots(positions), implementation=implementation
        )
        return self.replace(host_pool=pool)

    def backup_all_newest(self, rows, positions, *, implementation=None) -> "HiSparseState":
        """backup_newest of every layer in one launch: rows row[L, b, W]; a request's newest row
        has the same host slot in every layer."""
        pool = write_all_layer_rows_to_host(
            self.host_pool, self.layout.to_stored(rows), self._newest_host_slots(positions), implementation=implementation
        )
        return self.replace(host_pool=pool)

    def _newest_host_slots(self, positions) -> jax.Array:
        """i32[b]: the host slot of each request's newest row at positions i32[b]; -1 where inactive."""
        host_slot = jax.vmap(host_slots_of, in_axes=(0, 0, None))(
            self.host_page_table[: positions.shape[0]], jnp.maximum(positions, 0), self.page_size
        )  # i32[b]
        return jnp.where(positions >= 0, host_slot, -1)

    def prefetch_misses(self, layer, plan: SwapInPlan, *, implementation=None, launch=None) -> jax.Array:
        """row[b, K, W]: the plan's missed rows of `layer` read from the pool now (the i-th miss
        of request r at [r, i], i < plan.num_misses[r]). Only the pool and the plan go into
        `launch`: no operand is written in place, so it may run beside kernels using the buffer.
        Every in-place pool write must come after it (decode_step backs rows up after the last
        layer)."""
        launch = launch or (lambda fn, *arrays: fn(*arrays))
        fetch = lambda pool, layer, host_slots, counts: gather_host_rows(  # noqa: E731
            pool, layer, host_slots, counts, implementation=implementation, rows_per_program=self.copy_rows_per_program
        )
        return launch(fetch, self.host_pool, jnp.asarray(layer, jnp.int32), plan.miss_host_slots, plan.num_misses)

    def start_side_prefetch(self, layer: int, plan: SwapInPlan, tie: jax.Array) -> "tuple[PendingGather, jax.Array]":
        """prefetch_misses started on the side stream: the same gather, the pool read in place."""
        return PendingGather.start(self.host_pool, layer, plan.miss_host_slots, plan.num_misses, tie, tag=layer)

    def replay_prefetched(self, layer, plan: SwapInPlan, rows) -> "HiSparseState":
        """Scatters prefetched rows row[b, K, W] into `layer`'s buffer at the plan's miss slots
        (device to device: ~10% of K rows per request at 0.9 overlap); entries past num_misses drop."""
        b, K = plan.miss_device_slots.shape
        take = jnp.arange(K)[None, :] < plan.num_misses[:, None]  # bool[b, K]
        requests = jnp.broadcast_to(jnp.arange(b)[:, None], (b, K))
        rows_at = jnp.where(take, plan.miss_device_slots, -1)  # i32[b, K]: the plan's device rows
        return self.replace(device_buffer=self._scatter_device_rows(layer, requests, rows_at, rows))

    # ---- KVState: speculative steps (the rule: docs/contract.md, "Speculative steps") --------

    def speculative_plan_width(self, top_k: int) -> int:
        """B: a plan's distinct positions must find slots among the B LRU-managed ones."""
        return self.buffer_size

    def _speculative_slot(self, positions, committed) -> jax.Array:
        """i32[b, q]: the slot of each of the step's tokens, B + 1 + (position - committed); -1 inactive."""
        offset = positions - committed[:, None]
        return jnp.where((positions >= 0) & (offset >= 0), self.buffer_size + 1 + offset, -1)

    def write_speculative(self, layer, rows, positions, committed) -> "HiSparseState":
        """rows row[b, q, W] go to their speculative slots (B + 1 + position - committed); neither
        buffer_tokens, the LRU order nor the host pool sees them until commit_speculative."""
        requests = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
        slots = self._speculative_slot(positions, committed)
        rows = self.layout.to_stored(rows)
        return self.replace(device_buffer=self._scatter_device_rows(layer, requests, self._slot_rows(requests, slots), rows))

    def plan_speculative(self, layer, topk, committed, *, implementation=None) -> tuple["HiSparseState", SwapInPlan]:
        """The plan of topk i32[b, n] (n <= B): the committed positions through swap_in (hits,
        misses copied, LRU) as in a decode step whose newest token is one nobody selected (so the
        reserved slot B is never read), then the step's own positions (>= committed) resolved to
        their speculative slots, counted as hits."""
        own = (topk >= 0) & (topk >= committed[:, None])  # bool[b, n]: this step's tokens
        lengths = jnp.where(committed >= 0, committed + 1, 0)  # i32[b]: the newest, `committed`, is never selected
        state, plan = self.swap_in(layer, jnp.where(own, -1, topk), lengths, implementation=implementation)
        requests = jnp.arange(topk.shape[0])[:, None]
        own_slots = self._slot_rows(requests, self._speculative_slot(topk, committed))
        slots = jnp.where(own, own_slots, plan.slots)
        return state, plan._replace(slots=slots, num_hits=plan.num_hits + _distinct_valid(jnp.where(own, topk, -1)))

    def commit_speculative(self, layer, rows, positions, committed, *, implementation=None) -> "HiSparseState":
        """Keeps rows row[b, q, W] of positions i32[b, q] below committed i32[b] (the new lengths):
        their host rows are written (the backup), and the device holds what a decode step would
        have left: while committed <= B each kept row at slot = position (buffer_tokens records
        it), else the newest (position committed - 1) in the reserved slot B. Rows of positions
        >= committed are dropped: they stay only in speculative slots, which the next step
        overwrites. Speculative slots are read by nothing after this."""
        B = self.buffer_size
        b, q = positions.shape
        rows = self.layout.to_stored(rows)
        keep = (positions >= 0) & (positions < committed[:, None])  # bool[b, q]
        host = jax.vmap(host_slots_of, in_axes=(0, 0, None))(self.host_page_table[:b], jnp.maximum(positions, 0), self.page_size)
        pool = write_rows_to_host(
            self.host_pool, layer, rows.reshape(b * q, -1), jnp.where(keep, host, -1).reshape(-1), implementation=implementation
        )
        fast = keep & (committed[:, None] <= B)  # slot = position, as decode steps leave the fast path
        newest = keep & (positions == committed[:, None] - 1) & (committed[:, None] > B)  # to the reserved slot
        slots = jnp.where(fast, positions, jnp.where(newest, B, -1))  # i32[b, q]
        requests = jnp.broadcast_to(jnp.arange(b)[:, None], (b, q))
        device_buffer = self._scatter_device_rows(layer, requests, self._slot_rows(requests, slots), rows)
        buffer_tokens = self.buffer_tokens.at[layer, requests, jnp.where(fast, positions, B)].set(positions, mode="drop")
        return self.replace(host_pool=pool, device_buffer=device_buffer, buffer_tokens=buffer_tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FullKVState:
    """KVState without offload (the baseline): every token's row on the device, indexed by position."""

    kv: jax.Array  # row[L, R, C, W]: row of position p of request r at kv[l, r, p]
    seq_lens: jax.Array  # i32[R]: tokens stored for each request slot
    layout: KVRowLayout = _field(static=True)  # how the rows of kv are stored

    @property
    def device_rows(self) -> jax.Array:
        """row[L, R, C, W]: the whole KV, the array attention reads rows from (slot = position)."""
        return self.kv

    @property
    def num_layers(self) -> int:
        """L: sparse layers."""
        return self.kv.shape[0]

    @property
    def num_requests(self) -> int:
        """R: request slots."""
        return self.kv.shape[1]

    @property
    def max_context(self) -> int:
        """C: positions per request."""
        return self.kv.shape[2]

    def replace(self, **changes) -> "FullKVState":
        """A copy with the given fields replaced."""
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
        """Allocates an empty state: kv row[L, R, C, W] filled with fill_value, every slot free.

        fp8 rows take fill_value 0 or NaN only. With a mesh, request slots are split over its "dp"
        axis."""
        place = _Placer(device, mesh)
        shape = (num_layers, num_requests, max_context, layout.width)
        return cls(
            kv=place("kv", shape, layout.dtype, layout.fill_element(fill_value)),
            seq_lens=place("seq_lens", (num_requests,), jnp.int32, 0),
            layout=layout,
        )

    # ---- KVState: request lifecycle ----------------------------------------------------------

    def begin_request(self, request, prompt_len, host_pages=None) -> "FullKVState":
        """Sets the slot's seq_len; host_pages is ignored (no host pool)."""
        return self.replace(seq_lens=self.seq_lens.at[request].set(prompt_len))

    def store_prefill_rows(self, layer, request, start, rows, prompt_len, *, implementation=None) -> "FullKVState":
        """Rows row[T, W] go to kv[layer, request, position] for positions below prompt_len."""
        rows = self.layout.to_stored(rows)
        positions = start + jnp.arange(rows.shape[0], dtype=jnp.int32)  # i32[T]
        target = jnp.where(positions < prompt_len, positions, self.max_context)
        return self.replace(kv=self.kv.at[layer, request, target].set(rows, mode="drop"))

    def end_request(self, request) -> "FullKVState":
        """Clears the slot's seq_len (its rows are overwritten by the next request)."""
        return self.replace(seq_lens=self.seq_lens.at[request].set(0))

    def move_request(self, source, target) -> "FullKVState":
        """Moves slot `source`'s rows and seq_len to `target` and frees `source`."""
        moved = self.replace(
            kv=self.kv.at[:, target].set(self.kv[:, source]),
            seq_lens=self.seq_lens.at[target].set(self.seq_lens[source]),
        )
        return moved.end_request(source)

    # ---- KVState: one layer's decode step ----------------------------------------------------

    def write_newest(self, layer, new_row, positions) -> "FullKVState":
        """new_row row[b, W] goes to kv[layer, r, positions[r]]; -1 (inactive) writes nothing."""
        kv = self.kv.at[layer, jnp.arange(positions.shape[0]), jnp.where(positions >= 0, positions, self.max_context)].set(
            self.layout.to_stored(new_row), mode="drop"
        )
        return self.replace(kv=kv)

    def swap_in(self, layer, topk, lengths, *, implementation=None, defer_copy=False) -> tuple["FullKVState", SwapInPlan]:
        """Nothing to move: each selected position is its own slot, a hit; no misses."""
        plan = SwapInPlan(
            slots=topk,
            num_hits=_distinct_valid(topk),
            num_misses=jnp.zeros((topk.shape[0],), jnp.int32),
            miss_host_slots=jnp.full_like(topk, -1),
            miss_device_slots=jnp.full_like(topk, -1),
        )
        return self, plan

    def replay_swap_in(self, layer, plan: SwapInPlan, *, implementation=None) -> "FullKVState":
        """Nothing to copy: every row is already on the device."""
        return self

    def attend(self, layer, query, plan: SwapInPlan, *, deferred_topk=None, latent_dim, sm_scale, implementation=None) -> tuple["FullKVState", jax.Array]:
        """Attention over the selected positions of the on-device KV (nothing to read from a host)."""
        return self, _attend_device_rows(self, layer, query, plan, latent_dim, sm_scale, implementation)

    def backup_newest(self, layer, new_row, positions, *, implementation=None) -> "FullKVState":
        """Nothing to back up: write_newest stored the row where it stays."""
        return self

    def backup_all_newest(self, rows, positions, *, implementation=None) -> "FullKVState":
        """Nothing to back up."""
        return self

    def prefetch_misses(self, layer, plan: SwapInPlan, *, implementation=None, launch=None) -> None:
        """Nothing to fetch: every row is already on the device."""
        return None

    def start_side_prefetch(self, layer: int, plan: SwapInPlan, tie: jax.Array) -> "tuple[None, jax.Array]":
        """Nothing to fetch."""
        return None, tie

    def replay_prefetched(self, layer, plan: SwapInPlan, rows) -> "FullKVState":
        """Nothing to place."""
        return self

    # ---- KVState: speculative steps ----------------------------------------------------------

    def speculative_plan_width(self, top_k: int) -> None:
        """No limit: every position is on the device."""
        return None

    def write_speculative(self, layer, rows, positions, committed) -> "FullKVState":
        """rows row[b, q, W] go to their positions i32[b, q] (-1 inactive writes nothing)."""
        requests = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
        target = jnp.where(positions >= 0, positions, self.max_context)
        return self.replace(kv=self.kv.at[layer, requests, target].set(self.layout.to_stored(rows), mode="drop"))

    def plan_speculative(self, layer, topk, committed, *, implementation=None) -> tuple["FullKVState", SwapInPlan]:
        """Every position is its own slot, a hit."""
        return self.swap_in(layer, topk, committed, implementation=implementation)

    def commit_speculative(self, layer, rows, positions, committed, *, implementation=None) -> "FullKVState":
        """Nothing to move: the kept rows are at their positions already; dropped ones lie past
        the new lengths, where the next tokens overwrite them."""
        return self


def _attend_device_rows(state, layer, query, plan: SwapInPlan, latent_dim, sm_scale, implementation) -> jax.Array:
    """f32[b, H, D]: the sparse MLA attention over the plan's slots of state.device_rows."""
    return sparse_mla_attention(
        query, state.device_rows, layer, plan.slots, latent_dim=latent_dim, sm_scale=sm_scale, layout=state.layout,
        implementation=implementation,
    )


def _distinct_valid(topk: jax.Array) -> jax.Array:
    """i32[R, K] -> i32[R]: distinct non-negative entries of each row."""
    ordered = jnp.sort(topk, axis=1)
    fresh = jnp.concatenate([jnp.ones_like(ordered[:, :1], bool), ordered[:, 1:] != ordered[:, :-1]], axis=1)
    return jnp.sum(fresh & (ordered >= 0), axis=1, dtype=jnp.int32)


def state_shardings(state):
    """Output shardings for a jit that returns `state`: each array stays where it is.

    XLA refuses a kernel's in-place write to pinned_host memory unless the jit's output is
    declared pinned_host too, so every jit returning a state passes these; they also keep a
    mesh-split state split the same way. Returns a pytree of the state's structure holding
    each array's sharding.
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
