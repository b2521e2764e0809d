"""HiSparse over a paged device pool: the KVState behind dynamic residency.

HiSparseState gives every request slot a static B + 1 row hot buffer, so device memory cannot
pass from one request to another. PagedHiSparseState keeps the same LRU bookkeeping, host pool
and plan, but its rows live in one device pool of pages shared by all slots, and a device page
table maps each slot's rows to pool rows:

  * a host-backed request maps ceil((B + 1) / page_size) pages: buffer slot s lives in pool row
    device_page_table[r, s // page_size] * page_size + s % page_size (HiSparse as before);
  * a resident request maps a page for every position of its context: position p lives in pool
    row device_page_table[r, p // page_size] * page_size + p % page_size. Its top-k resolves
    straight to pool rows: no plan, no copy.

A resident request's first pages are laid out exactly as a host-backed buffer whose slot s
holds position s, so demotion copies nothing (keep the first pages, say so in buffer_tokens),
and promotion copies the context host -> device into the request's pages once. Every row is
backed up to the host pool in both modes, so the host pool always holds the whole context.
Which request is resident, and when pages move, is the engine's choice
(hisparse_jax.serving.residency).

The attention and copy kernels read this pool as row[L, 1, N, W] (a kv / buffer with one
request slot is a pool the batch shares; slots index its rows). Shape letters as in
hisparse_jax.state, plus N pool rows (pool pages x page_size) and Q device pages per request.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from hisparse_jax.state import HiSparseState
from pallas_kernels.row_copy import copy_host_rows_to_buffer
from pallas_kernels.swap_in import SwapInPlan, host_slots_of


def buffer_pages(buffer_size: int, page_size: int) -> int:
    """Device pages a host-backed request maps: its B LRU slots and the newest-token slot."""
    return math.ceil((buffer_size + 1) / page_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedHiSparseState(HiSparseState):
    """HiSparseState whose device_buffer is a pool row[L, 1, N, W] addressed through page tables."""

    device_page_table: jax.Array  # i32[R, Q]: device pool page of each page of a slot's rows, -1 none
    resident: jax.Array  # bool[R]: the slot's whole context is in the pool (no plan, no copy)

    @property
    def num_requests(self) -> int:
        return self.buffer_tokens.shape[1]

    @property
    def num_device_pages(self) -> int:
        return self.device_buffer.shape[2] // self.page_size

    @classmethod
    def _device_arrays(cls, place, L, R, B, W, max_context, page_size, layout, fill_value, num_device_pages=None) -> dict:
        """The pool row[L, 1, N, W] (num_device_pages defaults to a buffer's pages for every slot,
        buffer_pages(B, page_size) x R, so every slot can always run host-backed), the device page
        table and the resident flags. create(..., num_device_pages=N) passes it here."""
        if place.mesh is not None:
            raise ValueError("dynamic_residency does not run with data-parallel attention (a mesh) yet")
        if num_device_pages is None:
            num_device_pages = buffer_pages(B, page_size) * R
        pages_per_context = math.ceil(max(max_context, B + 1) / page_size)
        return dict(
            device_buffer=place("device_buffer", (L, 1, num_device_pages * page_size, W), layout.dtype, fill_value),
            device_page_table=place("device_page_table", (R, pages_per_context), jnp.int32, -1),
            resident=place("resident", (R,), jnp.bool_, False),
        )

    def pool_rows(self, slots) -> jax.Array:
        """i32[b, K]: the pool row of each slot (buffer slot, or position of a resident request)
        of requests 0 .. b - 1; slots i32[b, K], -1 (or a slot past the mapped pages) gives -1."""
        b = slots.shape[0]
        table = self.device_page_table[:b]  # i32[b, Q]
        page = jnp.take_along_axis(table, jnp.clip(slots // self.page_size, 0, table.shape[1] - 1), axis=1)
        return jnp.where((slots >= 0) & (page >= 0), page * self.page_size + slots % self.page_size, -1)

    # ---- request lifecycle ------------------------------------------------------------------

    def assign_device_pages(self, request, pages, resident) -> "PagedHiSparseState":
        """Maps slot `request` (i32[]) to device pages i32[Q] (-1 past the last); resident
        bool[]. Call before begin_request / store_prefill_rows, which write through the map."""
        return self.replace(
            device_page_table=self.device_page_table.at[request].set(jnp.asarray(pages, jnp.int32)),
            resident=self.resident.at[request].set(resident),
        )

    def _write_prefill_device_rows(self, layer, request, positions, rows, preload, valid) -> jax.Array:
        """Prompt rows row[T, W] into the pool: every valid position of a resident request, else
        the preloaded ones (buffer slot = position, as HiSparseState preloads)."""
        write = preload | (valid & self.resident[request])  # bool[T]
        table = self.device_page_table[request]  # i32[Q]
        page = jnp.take(table, jnp.clip(positions // self.page_size, 0, table.shape[0] - 1))  # i32[T]
        row = jnp.where(write & (page >= 0), page * self.page_size + positions % self.page_size, self.device_buffer.shape[2])
        return self.device_buffer.at[layer, 0, row].set(rows, mode="drop")

    def end_request(self, request) -> "PagedHiSparseState":
        state = super().end_request(request)
        return state.replace(
            device_page_table=state.device_page_table.at[request].set(-1), resident=state.resident.at[request].set(False)
        )

    def move_request(self, source, target) -> "PagedHiSparseState":
        """Moves the slot's tables (no rows move: its pages stay where they are)."""
        moved = self.replace(
            buffer_tokens=self.buffer_tokens.at[:, target].set(self.buffer_tokens[:, source]),
            lru_slots=self.lru_slots.at[:, target].set(self.lru_slots[:, source]),
            host_page_table=self.host_page_table.at[target].set(self.host_page_table[source]),
            seq_lens=self.seq_lens.at[target].set(self.seq_lens[source]),
            device_page_table=self.device_page_table.at[target].set(self.device_page_table[source]),
            resident=self.resident.at[target].set(self.resident[source]),
        )
        return moved.end_request(source)

    def promote(self, request, pages, *, implementation=None) -> "PagedHiSparseState":
        """Makes slot `request` resident on device pages i32[Q] covering its whole context:
        copies its seq_len rows of every layer host -> device (the host pool holds them all)."""
        state = self.assign_device_pages(request, pages, True)
        C = self.max_context
        positions = jnp.arange(C, dtype=jnp.int32)[None, :]  # i32[1, C]
        host = host_slots_of(self.host_page_table[request], positions[0], self.page_size)[None, :]  # i32[1, C]
        rows = state.replace(device_page_table=state.device_page_table[request][None, :]).pool_rows(positions)  # i32[1, C]
        count = self.seq_lens[request][None]  # i32[1]
        pool = state.device_buffer
        for layer in range(self.num_layers):
            pool = copy_host_rows_to_buffer(
                self.host_pool, pool, layer, host, rows, count, implementation=implementation,
                rows_per_program=self.copy_rows_per_program,
            )  # fmt: skip
        return state.replace(device_buffer=pool)

    def demote(self, request, pages) -> "PagedHiSparseState":
        """Makes resident slot `request` host-backed on device pages i32[Q] that must be the
        first buffer_pages(B) of its resident pages (then -1): those hold positions
        0 .. buffer_pages x page_size - 1 in order, which become buffer slots holding the same
        positions. Nothing is copied; the rest of its pages are the caller's to free."""
        B = self.buffer_size
        held = jnp.arange(B, dtype=jnp.int32)  # i32[B]: slot s holds position s ...
        held = jnp.where(held < jnp.minimum(self.seq_lens[request], B), held, -1)  # ... if stored
        return self.assign_device_pages(request, pages, False).replace(
            buffer_tokens=self.buffer_tokens.at[:, request].set(held),
            lru_slots=self.lru_slots.at[:, request].set(jnp.arange(B, dtype=jnp.int32)),
        )

    # ---- one layer's decode step ------------------------------------------------------------

    def write_newest(self, layer, new_row, positions) -> "PagedHiSparseState":
        """As HiSparseState's, through the page table; a resident request's row goes to its position."""
        B = self.buffer_size
        new_row = self.layout.to_stored(new_row)
        b = positions.shape[0]
        active = positions >= 0
        resident = self.resident[:b]
        slot = jnp.where(resident | (positions < B), positions, self.reserved_slot)  # i32[b]
        row = self.pool_rows(jnp.where(active, slot, -1)[:, None])[:, 0]  # i32[b]
        device_buffer = self.device_buffer.at[layer, 0, jnp.where(row >= 0, row, self.device_buffer.shape[2])].set(
            new_row, mode="drop"
        )
        fast = active & (positions < B) & ~resident
        requests = jnp.arange(b)
        buffer_tokens = self.buffer_tokens.at[layer, requests, jnp.where(fast, positions, B)].set(positions, mode="drop")
        return self.replace(device_buffer=device_buffer, buffer_tokens=buffer_tokens)

    def _planned_lengths(self, lengths) -> jax.Array:
        """Resident requests plan as inactive (length 0): no misses, their tables untouched."""
        return jnp.where(self.resident[: lengths.shape[0]], 0, lengths)

    def _plan_in_device_rows(self, plan: SwapInPlan, topk) -> SwapInPlan:
        """The plan in pool rows: a resident request's entries map its selected positions, a
        host-backed one's its buffer slots; the misses' destinations likewise."""
        resident = self.resident[: topk.shape[0], None]  # bool[b, 1]
        slots = jnp.where(resident, self.pool_rows(topk), self.pool_rows(plan.slots))  # i32[b, K]
        return plan._replace(slots=slots, miss_device_slots=self.pool_rows(plan.miss_device_slots))

    def replay_prefetched(self, layer, plan: SwapInPlan, rows) -> "PagedHiSparseState":
        """Scatters prefetched rows row[b, K, W] into the pool rows of the plan's misses."""
        K = plan.miss_device_slots.shape[1]
        take = (jnp.arange(K)[None, :] < plan.num_misses[:, None]) & (plan.miss_device_slots >= 0)  # bool[b, K]
        row = jnp.where(take, plan.miss_device_slots, self.device_buffer.shape[2])  # i32[b, K]
        return self.replace(device_buffer=self.device_buffer.at[layer, 0, row].set(rows, mode="drop"))
