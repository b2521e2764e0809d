"""Host pool pages: which request owns which page of the pinned host pool.

Pure Python bookkeeping on the host (the scheduler's side); the device only ever sees the page
table rows that kv_cache_ops.begin_request writes. Allocation never raises for lack of pages:
it returns None and the caller keeps the request waiting.
"""

from __future__ import annotations

import math

import numpy as np


class HostPageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        # A stack of free pages (the top at _free[_num_free - 1]) and a bitmap of which are free:
        # allocate and free cost O(pages touched), never O(pool), so retiring a request stays
        # cheap at ~500k pages. A fresh pool hands pages out lowest first, so pages handed out in
        # order are contiguous; freed pages go back on top in their order, so the next request
        # reuses a retired request's run of pages as it was.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)  # i64[num_pages]: stack, [:_num_free] live
        self._num_free = num_pages
        self._is_free = np.ones(num_pages, bool)  # bool[num_pages]

    @property
    def num_free(self) -> int:
        return self._num_free

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= self._num_free

    def allocate(self, num_tokens: int) -> list[int] | None:
        """Pages for `num_tokens` tokens, or None when too few are free (nothing is taken)."""
        count = self.pages_for(num_tokens)
        if count > self._num_free:
            return None
        taken = self._free[self._num_free - count : self._num_free][::-1]  # top of the stack first
        self._num_free -= count
        self._is_free[taken] = False
        return taken.tolist()

    def free(self, pages) -> None:
        pages = np.asarray(list(pages), np.int64)  # i64[n]
        if pages.size == 0:
            return
        if pages.min() < 0 or pages.max() >= self.num_pages or np.unique(pages).size != pages.size:
            raise ValueError(f"cannot free pages {pages.tolist()}: out of range or repeated")
        if self._is_free[pages].any():
            raise ValueError("double free of host pages")
        self._is_free[pages] = True
        self._free[self._num_free : self._num_free + pages.size] = pages[::-1]  # pages[0] on top
        self._num_free += pages.size

    @staticmethod
    def page_table_row(pages, pages_per_request: int) -> np.ndarray:
        """i32[P]: `pages` then -1, the row begin_request records."""
        if len(pages) > pages_per_request:
            raise ValueError(f"{len(pages)} pages exceed the page table's {pages_per_request} per request")
        row = np.full(pages_per_request, -1, np.int32)
        row[: len(pages)] = pages
        return row
