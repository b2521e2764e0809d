"""Dynamic residency: which requests keep their whole KV on the device, and when that changes.

Host-side bookkeeping over the device pool of a PagedHiSparseState (hisparse_jax.paged_state):
which pages each request slot holds and whether it is resident. The manager decides; the engine
carries out each decision on the device state (promote: copy the context host -> device into
the request's pages; demote: keep its first pages as a buffer, copy nothing) before anything
else writes the pages involved.

Invariant that makes admission never wait in "adaptive" mode: the pool has buffer_pages(B) pages
per request slot, every host-backed request holds exactly that many, and every resident one
holds more and is decoding (requests are promoted only once their prefill is done), so
demoting residents always frees a buffer's worth for a new request.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hisparse_jax.config import ResidencyConfig
from hisparse_jax.host_pages import HostPageAllocator
from hisparse_jax.paged_state import buffer_pages
from serving.errors import UsageError
from serving.workload import Request


class Placement(NamedTuple):
    """Where a newly admitted request's rows go (ResidencyManager.admit)."""

    changes: list  # ResidencyChange: demotions to carry out first, in order
    page_row: np.ndarray  # i32[Q]: its device pages, -1 past the last
    resident: bool  # whether it starts resident


class ResidencyChange(NamedTuple):
    action: str  # "promote" or "demote"
    slot: int
    page_row: np.ndarray  # i32[Q]: the slot's device pages afterwards, -1 past the last


class ResidencyManager:
    def __init__(self, config: ResidencyConfig, *, num_pages: int, page_size: int, buffer_size: int, pages_per_row: int):
        self.config = config
        self.pages = HostPageAllocator(num_pages, page_size)  # the same page bookkeeping, over device pages
        self.page_size = page_size
        self.buffer_pages = buffer_pages(buffer_size, page_size)
        self.pages_per_row = pages_per_row
        self._held: dict[int, list[int]] = {}  # slot -> its device pages, in the order its rows use them
        self._context_pages: dict[int, int] = {}  # slot -> pages its whole context needs
        self._resident: set[int] = set()
        self._decoding: list[int] = []  # slots whose prefill is done, oldest admission first
        self.promotions = 0
        self.demotions = 0
        self.promoted_rows = 0  # rows (tokens x layers) promotions copied host -> device

    # ---- what the scheduler asks ------------------------------------------------------------

    def context_pages(self, request: Request) -> int:
        return math.ceil(request.max_tokens / self.page_size)

    def check(self, request: Request) -> None:
        """forced_resident: raises UsageError when `request` could not be resident even alone."""
        if self.config.mode == "forced_resident" and self.context_pages(request) > self.pages.num_pages:
            raise UsageError(
                f"request {request.id} needs {self.context_pages(request)} device pages to be resident; the pool has"
                f" {self.pages.num_pages} (dynamic_residency mode forced_resident)"
            )

    def can_admit(self, request: Request) -> bool:
        """Whether the pool can take `request` now. Only forced_resident ever waits (see the
        module's invariant); it needs the whole context's pages free."""
        if self.config.mode != "forced_resident":
            return True
        return self.pages.num_free >= max(self.context_pages(request), self.buffer_pages)

    # ---- lifecycle ----------------------------------------------------------------------------

    def _row(self, slot: int) -> np.ndarray:
        return HostPageAllocator.page_table_row(self._held[slot], self.pages_per_row)

    def admit(self, slot: int, request: Request) -> Placement:
        """Pages for a newly admitted request. forced_resident: resident on its whole context's
        pages; otherwise host-backed on a buffer's pages, demoting residents if needed."""
        changes = []
        need = self.context_pages(request)
        resident = self.config.mode == "forced_resident" and need > self.buffer_pages
        count = need if resident else self.buffer_pages
        while self.pages.num_free < count and self._resident:
            changes.append(self._demote(self._largest_resident()))
        pages = self.pages.allocate(count * self.page_size)
        if pages is None:
            raise RuntimeError(f"device pool out of pages for slot {slot}: admission should have waited")
        self._held[slot], self._context_pages[slot] = pages, need
        if resident:
            self._resident.add(slot)
        return Placement(changes, self._row(slot), resident)

    def started_decoding(self, slot: int) -> None:
        self._decoding.append(slot)

    def release(self, slot: int) -> None:
        self.pages.free(self._held.pop(slot))
        del self._context_pages[slot]
        self._resident.discard(slot)
        if slot in self._decoding:
            self._decoding.remove(slot)

    def move(self, source: int, target: int) -> None:
        self._held[target] = self._held.pop(source)
        self._context_pages[target] = self._context_pages.pop(source)
        if source in self._resident:
            self._resident.remove(source)
            self._resident.add(target)
        if source in self._decoding:
            self._decoding[self._decoding.index(source)] = target

    def reset(self) -> None:
        for slot in list(self._held):
            self.release(slot)

    # ---- the policy ---------------------------------------------------------------------------

    def _free_fraction(self, extra_pages: int = 0) -> float:
        return (self.pages.num_free - extra_pages) / self.pages.num_pages

    def _largest_resident(self) -> int:
        return max(self._resident, key=lambda slot: (len(self._held[slot]), slot))

    def _demote(self, slot: int) -> ResidencyChange:
        self.pages.free(self._held[slot][self.buffer_pages :])
        self._held[slot] = self._held[slot][: self.buffer_pages]
        self._resident.remove(slot)
        self.demotions += 1
        return ResidencyChange("demote", slot, self._row(slot))

    def _promote(self, slot: int) -> ResidencyChange:
        extra = self._context_pages[slot] - len(self._held[slot])
        self._held[slot] = self._held[slot] + self.pages.allocate(extra * self.page_size)  # its buffer pages first
        self._resident.add(slot)
        self.promotions += 1
        return ResidencyChange("promote", slot, self._row(slot))

    def rebalance(self) -> list[ResidencyChange]:
        """adaptive, between decode steps: demote the largest residents while free pages are
        below demote_watermark; else promote the oldest decoding host-backed request whose
        pages leave promote_watermark free (one per step: each promotion copies a context)."""
        if self.config.mode != "adaptive":
            return []
        changes = []
        while self._resident and self._free_fraction() < self.config.demote_watermark:
            changes.append(self._demote(self._largest_resident()))
        if changes or self._free_fraction() < self.config.promote_watermark:
            return changes  # no promotion can leave promote_watermark free
        for slot in self._decoding:
            extra = self._context_pages[slot] - self.buffer_pages
            if slot in self._resident or extra <= 0:
                continue  # resident already, or its buffer holds its whole context
            if self._free_fraction(extra) >= self.config.promote_watermark:
                return [self._promote(slot)]
        return []

    @property
    def num_resident(self) -> int:
        return len(self._resident)

    def reset_counts(self) -> None:
        self.promotions = self.demotions = self.promoted_rows = 0

    def summary(self) -> dict:
        return dict(mode=self.config.mode, promotions=self.promotions, demotions=self.demotions, promoted_rows=self.promoted_rows)
