"""Admission: a FCFS waiting queue over three pools, request slots, host pages and device KV bytes.

A request is admitted only when all three have room for its whole context (prompt +
max_new_tokens); otherwise it waits, and so do the requests behind it (strict FCFS: a long
request is never starved by short ones slipping past). Running out of any pool never raises;
only a request that could not run even on an empty engine is rejected, at submit, with a
UsageError. `finish` gives every pool back.

Device bytes are counted per token, as a paged device pool would hold them (SGLang's token pool),
so the baseline's admission is bounded by full-context KV and HiSparse's by its buffers; the
engine's arrays themselves are static (see engine.py).
"""

from __future__ import annotations

import collections
import heapq
from typing import NamedTuple

from hisparse_jax.host_pages import HostPageAllocator
from models.dsa.footprint import DeviceFootprint
from serving.errors import UsageError
from serving.workload import Request


class Admission(NamedTuple):
    request: Request
    slot: int  # request slot (row of the decode batch) it runs in
    host_pages: list[int] | None  # host pages backing its positions in order (HiSparse only)
    # Dynamic residency: ResidencyManager.admit's Placement (its device pages, taken when the
    # request is admitted); else None.
    residency: object | None = None


class _Running(NamedTuple):
    request: Request
    host_pages: list[int] | None
    device_bytes: int


class Scheduler:
    def __init__(
        self,
        *,
        num_slots: int,
        context_length: int,
        footprint: DeviceFootprint,
        kv_budget_bytes: int | None = None,
        host_pages: HostPageAllocator | None = None,
        residency=None,
        extra_tokens: int = 0,
    ):
        """kv_budget_bytes None: no device limit beyond the slots. host_pages None: no host pool
        (the baseline). residency: a serving.residency.ResidencyManager whose device pages must
        also take the request (dynamic residency), or None. extra_tokens: positions a request
        may write past prompt + max_new_tokens (speculative decoding's drafts: num_steps), counted
        in its context, host pages and device bytes."""
        self.extra_tokens = extra_tokens
        self.num_slots = num_slots
        self.context_length = context_length
        self.footprint = footprint
        self.kv_budget_bytes = kv_budget_bytes
        self.host_pages = host_pages
        self.residency = residency
        self.waiting: collections.deque[Request] = collections.deque()
        self._free_slots = list(range(num_slots))  # a min-heap: lowest slot handed out first
        self._running: dict[int, _Running] = {}
        self.device_bytes_in_use = 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def running_request(self, slot: int) -> Request:
        return self._running[slot].request

    def check(self, request: Request) -> None:
        """Raises UsageError when `request` could not run even with every pool free."""
        tokens = self._tokens(request)
        if tokens > self.context_length:
            drafts = f" + {self.extra_tokens} speculative" if self.extra_tokens else ""
            raise UsageError(
                f"request {request.id} needs {tokens} tokens ({request.prompt_len} prompt + {request.max_new_tokens}"
                f" new{drafts}) > context_length {self.context_length}"
            )
        if self.host_pages is not None and not self.host_pages.pages_for(tokens) <= self.host_pages.num_pages:
            raise UsageError(
                f"request {request.id} needs {self.host_pages.pages_for(tokens)} host pages; the host pool has"
                f" {self.host_pages.num_pages}: raise host_to_device_ratio"
            )
        if self.residency is not None:
            self.residency.check(request)
        need = self.footprint.request_bytes(tokens)
        if self.kv_budget_bytes is not None and need > self.kv_budget_bytes:
            raise UsageError(
                f"request {request.id} needs {need} B of device KV > kv budget {self.kv_budget_bytes} B"
            )

    def submit(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)

    def _tokens(self, request: Request) -> int:
        """Positions `request` may write: prompt + max_new_tokens (+ extra_tokens)."""
        return request.max_tokens + self.extra_tokens

    def _fits(self, request: Request) -> bool:
        if not self._free_slots:
            return False
        if self.host_pages is not None and not self.host_pages.can_allocate(self._tokens(request)):
            return False
        if self.residency is not None and not self.residency.can_admit(request):
            return False
        need = self.footprint.request_bytes(self._tokens(request))
        return self.kv_budget_bytes is None or self.device_bytes_in_use + need <= self.kv_budget_bytes

    def admit(self) -> list[Admission]:
        """Admits waiting requests in arrival order while all three pools have room."""
        admitted = []
        while self.waiting and self._fits(self.waiting[0]):
            request = self.waiting.popleft()
            pages = None if self.host_pages is None else self.host_pages.allocate(self._tokens(request))
            slot = heapq.heappop(self._free_slots)
            need = self.footprint.request_bytes(self._tokens(request))
            self.device_bytes_in_use += need
            self._running[slot] = _Running(request, pages, need)
            residency = None if self.residency is None else self.residency.admit(slot, request)
            admitted.append(Admission(request, slot, pages, residency))
        return admitted

    def finish(self, slot: int) -> Request:
        """Frees the slot, host pages and device bytes of the request running in `slot`."""
        running = self._running.pop(slot)
        if running.host_pages is not None:
            self.host_pages.free(running.host_pages)
        self.device_bytes_in_use -= running.device_bytes
        heapq.heappush(self._free_slots, slot)
        return running.request

    def running_slots(self) -> list[int]:
        """Slots with a request running, lowest first."""
        return sorted(self._running)

    def move(self, source: int, target: int) -> None:
        """The request running in `source` now runs in the free slot `target` (the engine moved
        its KV state); its host pages and device bytes go with it, `source` is free."""
        if source not in self._running or target in self._running or target not in self._free_slots:
            raise ValueError(f"cannot move the request in slot {source} to slot {target}")
        self._running[target] = self._running.pop(source)
        self._free_slots.remove(target)
        self._free_slots.append(source)
        heapq.heapify(self._free_slots)

    def all_free(self) -> bool:
        """True when nothing waits or runs and every slot, host page and device byte is back."""
        pages_free = self.host_pages is None or self.host_pages.num_free == self.host_pages.num_pages
        return not self.waiting and not self._running and len(self._free_slots) == self.num_slots and pages_free and self.device_bytes_in_use == 0


class DataParallelScheduler:
    """Admission over data-parallel attention groups (hisparse_jax.sharding), SGLang's DP ranks.

    Each group is a Scheduler over its own block of request slots, its own host pool block
    (page numbers local to it) and its share of the device budget; nothing is shared across
    groups. One FCFS queue feeds them: the request at its head goes to the least loaded group
    that has room, and waits while none has. Slots are global: group g owns slots
    [g * S, (g + 1) * S) for S slots per group.
    """

    def __init__(self, groups: list[Scheduler]):
        if len({g.num_slots for g in groups}) != 1:
            raise ValueError("data-parallel groups must have equal slot counts")
        self.groups = groups
        self.slots_per_group = groups[0].num_slots
        self.context_length = groups[0].context_length
        self.waiting: collections.deque[Request] = collections.deque()

    @property
    def num_slots(self) -> int:
        return self.slots_per_group * len(self.groups)

    @property
    def num_running(self) -> int:
        return sum(g.num_running for g in self.groups)

    @property
    def num_free_slots(self) -> int:
        return sum(g.num_free_slots for g in self.groups)

    @property
    def device_bytes_in_use(self) -> int:
        return sum(g.device_bytes_in_use for g in self.groups)

    def _split(self, slot: int) -> tuple[Scheduler, int]:
        group, local = divmod(slot, self.slots_per_group)
        return self.groups[group], local

    def running_request(self, slot: int) -> Request:
        group, local = self._split(slot)
        return group.running_request(local)

    def check(self, request: Request) -> None:
        self.groups[0].check(request)  # the groups are alike: what fits one empty group fits any

    def submit(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)

    def admit(self) -> list[Admission]:
        admitted = []
        while self.waiting:
            candidates = [i for i, g in enumerate(self.groups) if g._fits(self.waiting[0])]
            if not candidates:
                break
            index = min(candidates, key=lambda i: self.groups[i].num_running)
            group = self.groups[index]
            group.submit(self.waiting.popleft())
            (admission,) = group.admit()
            admitted.append(admission._replace(slot=index * self.slots_per_group + admission.slot))
        return admitted

    def finish(self, slot: int) -> Request:
        group, local = self._split(slot)
        return group.finish(local)

    def running_slots(self) -> list[int]:
        return [i * self.slots_per_group + s for i, g in enumerate(self.groups) for s in g.running_slots()]

    def all_free(self) -> bool:
        return not self.waiting and all(g.all_free() for g in self.groups)
