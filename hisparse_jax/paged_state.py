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
(serving.residency).

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
from pallas_kernels.swap_in import host_slots_of


def buffer_pages(buffer_size: int, page_size: int) -> int:
    """Device pages a host-backed request maps: its B LRU slots and the newest-token slot."""
    return math.ceil((buffer_size + 1) / page_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedHiSparseState(HiSparseState):
    """HiSparseState whose device_buffer is a pool row[L, 1, N, W] addressed through page tables."""

    device_page_table: jax.Array  # i32[R, Q]: device pool page of each page of a slot's rows, -1 none
    resident: jax.Array  # bool[R]: the slot's whole context is in the pool (no plan, no copy)
    reads_misses_in_attention_ok = False  # miss_read "attention" is for the static buffer only (for now)

    @property
    def num_requests(self) -> int:
        return self.buffer_tokens.shape[1]

    @property
    def num_device_pages(self) -> int:
        return self.device_buffer.shape[2] // self.page_size

    @property
    def speculative_slots(self) -> int:
        return 0  # refused at create (_device_arrays)

    @classmethod
    def _device_arrays(
        cls, place, L, R, B, W, max_context, page_size, layout, fill_value, num_device_pages=None, speculative_slots=0
    ) -> dict:
        """The pool row[L, 1, N, W] (num_device_pages defaults to a buffer's pages for every slot,
        buffer_pages(B, page_size) x R, so every slot can always run host-backed), the device page
        table and the resident flags. create(..., num_device_pages=N) passes it here."""
        if speculative_slots:
            raise ValueError("dynamic_residency does not run speculative decoding (speculative slots) yet")
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

    def _slot_rows(self, requests, slots) -> jax.Array:
        """i32[...]: the pool row of each slot (a buffer slot, or a resident request's position)
        of requests (same shapes) through the device page table; -1, or a slot past the mapped
        pages, gives -1."""
        table = self.device_page_table  # i32[R, Q]
        page = table[requests, jnp.clip(slots // self.page_size, 0, table.shape[1] - 1)]
        return jnp.where((slots >= 0) & (page >= 0), page * self.page_size + slots % self.page_size, -1)

    def _buffer_request(self, requests) -> jax.Array:
        """Every request reads and writes the one shared pool: device_buffer[:, 0]."""
        return requests * 0

    def _newest_slot(self, positions) -> jax.Array:
        """A resident request's newest row goes to its position; a host-backed one's as in HiSparse."""
        return jnp.where(self.resident[: positions.shape[0]], positions, super()._newest_slot(positions))

    def _prefill_on_device(self, request, preload, valid) -> jax.Array:
        """A resident request's every prompt row goes to the pool too."""
        return preload | (valid & self.resident[request])

    def _planned_lengths(self, lengths) -> jax.Array:
        """Resident requests plan as inactive (length 0): no misses, their tables untouched, and
        the plan's slots are their selected positions, which _slot_rows maps into the pool."""
        return jnp.where(self.resident[: lengths.shape[0]], 0, lengths)

    # ---- request lifecycle ------------------------------------------------------------------

    def assign_device_pages(self, request, pages, resident) -> "PagedHiSparseState":
        """Maps slot `request` (i32[]) to device pages i32[Q] (-1 past the last); resident
        bool[]. Call before begin_request / store_prefill_rows, which write through the map."""
        return self.replace(
            device_page_table=self.device_page_table.at[request].set(jnp.asarray(pages, jnp.int32)),
            resident=self.resident.at[request].set(resident),
        )

    def end_request(self, request) -> "PagedHiSparseState":
        state = super().end_request(request)
        return state.replace(
            device_page_table=state.device_page_table.at[request].set(-1), resident=state.resident.at[request].set(False)
        )

    # move_request moves the tables only: a request's rows stay in its pages.
    _moved_with_request = ("buffer_tokens", "lru_slots", "host_page_table", "seq_lens", "device_page_table", "resident")

    def promote(self, request, pages, *, implementation=None) -> "PagedHiSparseState":
        """Makes slot `request` resident on device pages i32[Q] covering its whole context:
        copies its seq_len rows of every layer host -> device (the host pool holds them all)."""
        state = self.assign_device_pages(request, pages, True)
        positions = jnp.arange(self.max_context, dtype=jnp.int32)  # i32[C]
        host = host_slots_of(self.host_page_table[request], positions, self.page_size)[None, :]  # i32[1, C]
        rows = state._slot_rows(jnp.broadcast_to(request, positions.shape), positions)[None, :]  # i32[1, C]
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
