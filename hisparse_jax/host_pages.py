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
        # Lowest pages first: pages handed out in order are contiguous in the pool.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= len(self._free)

    def allocate(self, num_tokens: int) -> list[int] | None:
        """Pages for `num_tokens` tokens, or None when too few are free (nothing is taken)."""
        count = self.pages_for(num_tokens)
        if count > len(self._free):
            return None
        taken = self._free[len(self._free) - count :][::-1]
        del self._free[len(self._free) - count :]
        return taken

    def free(self, pages) -> None:
        pages = list(pages)
        if len(set(pages)) != len(pages) or any(not 0 <= p < self.num_pages for p in pages):
            raise ValueError(f"cannot free pages {pages}: out of range or repeated")
        if set(pages) & set(self._free):
            raise ValueError("double free of host pages")
        self._free.extend(sorted(pages, reverse=True))
        self._free.sort(reverse=True)

    @staticmethod
    def page_table_row(pages, pages_per_request: int) -> np.ndarray:
        """i32[P]: `pages` then -1, the row begin_request records."""
        if len(pages) > pages_per_request:
            raise ValueError(f"{len(pages)} pages exceed the page table's {pages_per_request} per request")
        row = np.full(pages_per_request, -1, np.int32)
        row[: len(pages)] = pages
        return row
