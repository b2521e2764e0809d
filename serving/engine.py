"""The decode engine: continuous batching over a fixed set of request slots, HiSparse or baseline.

    engine = Engine(ModelRunner(model), EngineConfig(max_running_requests=8, context_length=512,
                                                    hisparse=HiSparseConfig(top_k=16)))
    result = engine.run(requests, max_concurrency=4)   # result.tokens[id], result.summary

Each loop iteration: the client side sends requests while fewer than `max_concurrency` are in
flight (SGLang bench_serving's semaphore); the scheduler admits what the pools hold
(scheduler.py); admitted prompts are prefilled alone, layer by layer, their KV written
direct-to-host (ModelRunner.start_prefill), within `prefill_token_budget` prompt-token-layers
per iteration (None: whole), so a long prompt does not stall the running requests for all its
layers at once; a prompt whose last layer is done samples its first token and decodes from the
next step. Then ONE decode step runs every decoding request at once (static shapes: a batch
bucket of slots, inactive ones at position -1, see below), one dispatch that also takes its
input tokens from the last step's output on the device and computes the greedy tokens and
counters (runner.greedy_step); the tokens come back to the host, and requests that reached
max_new_tokens or EOS retire, giving back slot, host pages and device bytes.

Overlap schedule (SGLang's, `overlap_schedule`, default on): the host dispatches step t + 1
before it reads step t's tokens, so the device never waits for the host's loop. Positions and
length limits are known on the host; an EOS is known one step late, so its request runs one
extra step whose token is dropped and then retires (docs/engine.md says why that is exact).
A step's recorded time is then the time between consecutive steps' results on the host.

Batch buckets (SGLang's CUDA-graph batch sizes): the decode step is compiled for a few batch
sizes, the powers of two below R and R itself, and each step runs the smallest bucket that holds
the running requests, so a step costs what its requests cost rather than what R slots do. The
running requests are kept in the first slots: when one retires, the request in the highest slot
moves into the hole (ModelRunner.move_request: its device buffer, LRU, page table and indexer
keys; its host pages stay). warmup() compiles every bucket up front; requests coming and going
then change only the values of `tokens` / `positions` and which bucket runs, never compile.

Dynamic residency (`hisparse.dynamic_residency`): the KV state is a PagedHiSparseState, one device
pool of pages shared by all slots, and serving.residency.ResidencyManager decides which requests
keep their whole context there (resident: no plan, no copy) and which run host-backed on a
buffer's pages. Its changes are carried out between steps: promotions copy a context host ->
device once, demotions copy nothing; admission never waits for them except in forced_resident.

The baseline is the same engine with `hisparse=None`: a FullKVState keeps every row on the
device and admission counts full-context KV against the same budget. Both attend to the same
rows with the same kernels, so they produce the same tokens.

Speculative decoding (a runner built with `speculative=SpeculativeConfig(...)`,
models.dsa.speculative): each step drafts with the MTP layer, verifies num_steps + 1 tokens per
request and emits the accepted ones (1 .. num_steps + 1 per request), in one dispatch
(runner.speculative_greedy_step); each request's draft state (DraftState, R slots) stays on the
device, set by its prefill and moved by compaction. How many tokens a step makes is known only
once it is read, so these steps run without the overlap schedule. Admission reserves num_steps
- 1 positions past prompt + max_new_tokens for the drafts a last step writes.

Two labelled SYNTHETIC options serve studies and benchmarks, never real-model figures:
  synthetic_topk_overlap: decode top-k from serving.synthetic_selection in place of
    the indexers' choice (miss rate vs buffer size for a selection as stable as a trained
    model's); the indexers still run inside the step, so it costs what a real one does; the
    selector is dispatched ahead of each step (overlap schedule on) and its device time (sorts of
    K-sized rows per layer and request) counts in both engines' steps;
  synthetic_context: random KV and indexer keys instead of a prefill (serving.synthetic_fill),
    to keep prefill out of decode timing; TTFT is then not reported.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.host_pages import HostPageAllocator
from hisparse_jax.kv_cache_ops import end_request
from hisparse_jax.paged_state import PagedHiSparseState
from hisparse_jax.state import REQUEST_AXIS, jit_donating_state, state_shardings
from models.common.runner import PrefillJob, StepResult, TokenFeed, padded_prompt_length
from models.dsa.decoding import DecodeCache
from models.dsa.runner import ModelRunner
from serving.errors import UsageError
from serving.fit import available_host_bytes
from serving.residency import ResidencyManager
from serving.scheduler import Admission, DataParallelScheduler, Scheduler
from serving.synthetic_fill import SyntheticFill
from serving.synthetic_selection import SyntheticSelector
from serving.telemetry import RequestTrace, StepRecord, summarize
from serving.workload import Request


class _NoBar:
    def update(self, n=1):
        pass

    def close(self):
        pass


def progress_bar(enabled: bool, **kwargs):
    """A tqdm progress bar, or nothing; tqdm (the `serving` extra) is imported only when shown,
    and without it the run goes on with a one-time warning instead of bars."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ModuleNotFoundError:
        warnings.warn("progress bars need tqdm (pip install -e '.[serving]'); running without them", stacklevel=3)
        return _NoBar()
    return tqdm(leave=False, **kwargs)


def _positive_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value!r}")


def batch_buckets(num_slots: int) -> tuple[int, ...]:
    """The decode batch sizes compiled for `num_slots` slots: 1, 2, 4, ... below it, then itself."""
    return tuple(1 << i for i in range(num_slots.bit_length()) if 1 << i < num_slots) + (num_slots,)


# Host memory one decode program's compile is given (auto_compile_threads). Three GLM-5.1 rank
# programs (78 layers) at once took 8 GB (72 -> 80 GB used); DeepSeek-V3.2's engine at 131,072
# tokens (a 105 GB pinned pool on a 128 GB host) was killed (SIGKILL) compiling four at once.
COMPILE_HOST_BYTES = 8 << 30


def auto_compile_threads(programs: int, cpus: int | None, available_bytes: int | None) -> int:
    """Compiles to run at once for EngineConfig.compile_threads = 0: one per program, up to one
    per 4 CPU cores (XLA's own compile runs several threads each) and one per COMPILE_HOST_BYTES
    of the host's available memory (None: unknown, not capped); at least one."""
    threads = min(programs, (cpus or 1) // 4)
    if available_bytes is not None:
        threads = min(threads, available_bytes // COMPILE_HOST_BYTES)
    return max(1, threads)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_running_requests: int  # R: request slots, the static decode batch
    context_length: int  # C: most tokens (prompt + new) one request may hold
    hisparse: HiSparseConfig | None  # None: the full-KV baseline
    kv_budget_bytes: int | None = None  # device memory for KV rows + indexer keys; None: slots only
    page_size: int = 16  # tokens per host page
    num_host_pages: int | None = None  # None: host_to_device_ratio x the device pool (R x B tokens)
    synthetic_topk_overlap: float | None = None  # SYNTHETIC decode selection with this overlap
    synthetic_context: bool = False  # SYNTHETIC contexts (random KV) instead of prefill
    seed: int = 0  # synthetic selection / fill randomness
    fill_value: float = 0.0  # of KV rows nothing wrote (tests pass NaN so a stray read shows)
    # Decode only the bucket holding the running requests: True, batch_buckets(R); a tuple, these
    # sizes (R is added: every step must fit one); False: every step runs all R slots.
    batch_buckets: bool | tuple[int, ...] = True
    # Prefill work per engine step, in prompt tokens x layers (one layer of a prompt padded to Tp
    # tokens costs Tp); at least one layer runs per step. None: an admitted prompt is prefilled
    # whole before the next decode step (running requests wait for it).
    prefill_token_budget: int | None = None
    # SGLang's overlap scheduler: step t + 1 is dispatched before step t's tokens are read, so the
    # device never waits for the host's loop (False: SGLang's --disable-overlap-schedule).
    overlap_schedule: bool = True
    # Decode programs warmup compiles at once (compile_decode_programs): 0, one thread per program
    # up to one per 4 CPU cores (the H200 machine's 16: 4) and one per COMPILE_HOST_BYTES of
    # available host memory (auto_compile_threads); 1, one after another.
    compile_threads: int = 0

    def __post_init__(self):
        _positive_int("max_running_requests", self.max_running_requests)
        _positive_int("context_length", self.context_length, 2)
        _positive_int("page_size", self.page_size)
        if self.kv_budget_bytes is not None:
            _positive_int("kv_budget_bytes", self.kv_budget_bytes)
        if self.num_host_pages is not None:
            _positive_int("num_host_pages", self.num_host_pages)
        if not isinstance(self.batch_buckets, bool):
            for size in self.batch_buckets:
                _positive_int("batch_buckets size", size)
        if self.prefill_token_budget is not None:
            _positive_int("prefill_token_budget", self.prefill_token_budget)
        if type(self.compile_threads) is not int or self.compile_threads < 0:
            raise UsageError(f"compile_threads must be an integer >= 0, got {self.compile_threads!r}")
        if self.synthetic_topk_overlap is not None and not 0.0 <= self.synthetic_topk_overlap <= 1.0:
            raise UsageError(f"synthetic_topk_overlap must be in [0, 1], got {self.synthetic_topk_overlap}")

    @property
    def mode(self) -> str:
        return "baseline" if self.hisparse is None else "hisparse"

    @property
    def selection(self) -> str:
        """How decode top-k sets are chosen: the label every output carries."""
        if self.synthetic_topk_overlap is None:
            return "model"
        return f"synthetic(overlap={self.synthetic_topk_overlap:g})"


class _SlotInputs:
    """What the next decode step takes per slot, host arrays i32[R] each; compaction moves a
    request's entries with it."""

    def __init__(self, num_slots: int):
        self.tokens = np.zeros(num_slots, np.int32)  # i32[R]: input token from the host, read where src is -1
        # i32[R]: the slot of the last step's tokens (on the device) that is this slot's input; -1: `tokens`
        self.src = np.full(num_slots, -1, np.int32)
        self.positions = np.full(num_slots, -1, np.int32)  # i32[R]: the input's position, -1 inactive
        self.request_ids = np.zeros(num_slots, np.int32)  # i32[R]: id of the request in each slot (synthetic selection)

    def start(self, slot: int, token: int, position: int) -> None:
        """The request in `slot` decodes from the next step on, its first input from the host."""
        self.tokens[slot], self.src[slot], self.positions[slot] = token, -1, position

    def move(self, source: int, target: int) -> None:
        for array in (self.tokens, self.src, self.positions, self.request_ids):
            array[target] = array[source]
        self.positions[source] = -1  # the source slot is inactive now


@dataclasses.dataclass
class _InFlight:
    """A dispatched decode step whose results the host has not read yet."""

    result: StepResult  # on the device
    batch: list[tuple[int, Request]]  # (slot, its request) per active slot; the slot is its row of result.next_tokens
    size: int  # b: the slots the step computed (its batch bucket)
    begin_s: float  # perf_counter when it was dispatched (after the synthetic selector's dispatch, if any)
    ready_s: float | None = None  # perf_counter when its results were ready on the host


@dataclasses.dataclass
class RunResult:
    tokens: dict[int, np.ndarray]  # request id -> i32[N] generated tokens
    steps: list[StepRecord]
    traces: list[RequestTrace]
    summary: dict


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig):
        self.runner, self.config = runner, config
        hisparse = config.hisparse
        R, C = config.max_running_requests, config.context_length
        try:  # every runner sizes its own requests (cache format, prefetch mode, family layout)
            self.footprint = runner.device_footprint(hisparse)
        except ValueError as error:  # a hisparse_config the model cannot run, e.g. its top_k
            raise UsageError(str(error)) from None
        if hisparse is not None and hisparse.dynamic_residency is not None and runner.mesh is not None:
            raise UsageError("dynamic_residency runs on one device only yet (one device pool per engine); drop the mesh")
        self.speculative = getattr(runner, "speculative", None)  # a SpeculativeConfig (DSA runners), else None
        if self.speculative is not None:
            self._check_speculative()
        self.cache: DecodeCache = self._empty_cache()
        # Data-parallel attention (runner.mesh): each group schedules its own slots, host pool
        # block and share of the device budget, as SGLang's DP ranks do.
        groups = 1 if runner.mesh is None else runner.mesh.shape[REQUEST_AXIS]
        if R % groups:
            raise UsageError(f"max_running_requests ({R}) must divide by the {groups} data-parallel groups")
        budget = None if config.kv_budget_bytes is None else config.kv_budget_bytes // groups
        self.residency = self._residency_manager()
        self._host_pages = None
        if hisparse is not None:
            pages = self.cache.kv.num_host_pages
            if pages % groups:
                raise UsageError(f"{pages} host pages do not split over {groups} data-parallel groups")
            self._host_pages = [HostPageAllocator(pages // groups, config.page_size) for _ in range(groups)]
            self._pages_per_request = self.cache.kv.host_page_table.shape[1]
        schedulers = [
            Scheduler(
                num_slots=R // groups, context_length=C, footprint=self.footprint, kv_budget_bytes=budget,
                host_pages=None if self._host_pages is None else self._host_pages[g], residency=self.residency,
                extra_tokens=0 if self.speculative is None else self.speculative.num_steps - 1,  # a last step's drafts
            )  # fmt: skip
            for g in range(groups)
        ]
        self.scheduler = schedulers[0] if groups == 1 else DataParallelScheduler(schedulers)
        self._end = jax.jit(end_request, donate_argnums=0, out_shardings=state_shardings(self.cache.kv))
        self._argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))  # a prefill's first token
        self.selector = None
        self.use_selection(config.synthetic_topk_overlap)
        # Data-parallel groups each own a block of slots, so one prefix of them is not a group's
        # share: with a mesh every step runs all R slots.
        self.buckets = (R,)
        if groups == 1 and config.batch_buckets is True:
            self.buckets = batch_buckets(R)
        elif groups == 1 and config.batch_buckets:
            self.buckets = tuple(sorted({b for b in config.batch_buckets if b < R} | {R}))
        self._fill = SyntheticFill(self.cache, implementation=runner.implementation, mesh=runner.mesh) if config.synthetic_context else None
        self._fill_key = jax.random.key(config.seed)
        # What compile_decode_programs last did: {programs, threads, host_available_gb} (None: not run)
        self.decode_compiles: dict | None = None
        if self.speculative is not None:  # every slot's DraftState, on the device
            self._carry = runner.empty_draft_state(R)
            self._set_carry = jax.jit(lambda carry, slot, draft: jax.tree.map(lambda x, v: x.at[slot].set(v), carry, draft), donate_argnums=0)
            self._move_carry = jax.jit(lambda carry, source, target: jax.tree.map(lambda x: x.at[target].set(x[source]), carry), donate_argnums=0)

    def _check_speculative(self) -> None:
        """What speculative decoding does not run with yet, refused by name."""
        config = self.config
        unsupported = {
            "dynamic_residency": config.hisparse is not None and config.hisparse.dynamic_residency is not None,
            "synthetic_topk_overlap": config.synthetic_topk_overlap is not None,
            "synthetic_context": config.synthetic_context,
        }
        for name, used in unsupported.items():
            if used:
                raise UsageError(f"{name} does not run with speculative decoding yet")

    def _empty_cache(self) -> DecodeCache:
        config = self.config
        return self.runner.create_cache(
            num_requests=config.max_running_requests, max_context=config.context_length, hisparse=config.hisparse,
            num_host_pages=config.num_host_pages, page_size=config.page_size, fill_value=config.fill_value,
        )  # fmt: skip

    def _residency_manager(self) -> ResidencyManager | None:
        """The manager of a dynamic-residency engine (and its jitted state changes), else None."""
        hisparse, kv = self.config.hisparse, self.cache.kv
        if hisparse is None or hisparse.dynamic_residency is None:
            return None
        if not isinstance(kv, PagedHiSparseState):
            raise UsageError(f"dynamic_residency is not supported by {type(self.runner).__name__} yet")
        implementation = self.runner.implementation
        self._assign = jit_donating_state(lambda s, slot, row, resident: s.assign_device_pages(slot, row, resident), kv)
        self._promote = jit_donating_state(lambda s, slot, row: s.promote(slot, row, implementation=implementation), kv)
        self._demote = jit_donating_state(lambda s, slot, row: s.demote(slot, row), kv)
        return ResidencyManager(
            hisparse.dynamic_residency, num_pages=kv.num_device_pages, page_size=kv.page_size,
            buffer_size=kv.buffer_size, pages_per_row=kv.device_page_table.shape[1],
        )  # fmt: skip

    def _apply(self, changes, positions=None) -> None:
        """Carries out the residency manager's changes on the device state, in order; positions
        i32[R] (the loop's: tokens stored per slot) counts what promotions copy."""
        for change in changes:
            if change.action == "promote":  # its stored rows of every layer cross the link
                self.residency.promoted_rows += int(positions[change.slot]) * self.cache.kv.num_layers
            apply = self._promote if change.action == "promote" else self._demote
            kv = apply(self.cache.kv, jnp.int32(change.slot), jnp.asarray(change.page_row))
            self.cache = dataclasses.replace(self.cache, kv=kv)

    def use_selection(self, synthetic_topk_overlap: float | None) -> None:
        """Decode top-k from the model's indexers (None) or the SYNTHETIC selector with this
        overlap, from the next run on; the cache stays (benchmarks switch without reallocating)."""
        if synthetic_topk_overlap is not None and getattr(self, "speculative", None) is not None:
            raise UsageError("synthetic_topk_overlap does not run with speculative decoding yet")
        self.config = dataclasses.replace(self.config, synthetic_topk_overlap=synthetic_topk_overlap)
        self.selector = None
        if synthetic_topk_overlap is not None:
            model, R = self.runner.config, self.config.max_running_requests
            self.selector = SyntheticSelector(
                num_index_layers=len(model.full_indexer_layers), num_requests=R, top_k=model.index_topk,
                overlap=synthetic_topk_overlap, seed=self.config.seed,
            )  # fmt: skip

    # ---- sizes ------------------------------------------------------------------------------------

    def capacity(self, num_tokens: int) -> int:
        """Requests of `num_tokens` tokens that can run at once: slots, host pool and budget."""
        fits = self.config.max_running_requests
        groups = 1 if self._host_pages is None else len(self._host_pages)
        if self.config.kv_budget_bytes is not None:  # each data-parallel group has its share
            fits = min(fits, groups * self.footprint.capacity(self.config.kv_budget_bytes // groups, num_tokens))
        if self._host_pages is not None:
            fits = min(fits, sum(pool.num_pages // pool.pages_for(num_tokens) for pool in self._host_pages))
        return fits

    def kv_bytes_per_request(self, num_tokens: int | None = None) -> dict:
        """KV bytes one request of `num_tokens` tokens (default: context_length) holds: on the device
        as admission counts them (HiSparse: its hot buffers + indexer keys; the baseline: every row
        + keys) and in the host pool (HiSparse: every offloaded row; the baseline: 0)."""
        tokens = num_tokens or self.config.context_length
        return dict(tokens=tokens, device=self.footprint.request_bytes(tokens), host=self.footprint.host_request_bytes(tokens))

    # ---- one request --------------------------------------------------------------------------------

    def _start(self, admission: Admission) -> int | None | PrefillJob:
        """Starts an admitted request: its first token when it is ready now (a PD transfer), None
        for a synthetic context (no first token), or the PrefillJob that computes its prompt."""
        request, slot = admission.request, admission.slot
        pages = None
        if admission.host_pages is not None:
            pages = HostPageAllocator.page_table_row(admission.host_pages, self._pages_per_request)
        if self.selector is not None:
            self.selector.reset(slot)
        placement = admission.residency
        if placement is not None:  # device pages first: prefill writes through them
            self._apply(placement.changes)  # demotions only
            kv = self._assign(self.cache.kv, jnp.int32(slot), jnp.asarray(placement.page_row), jnp.bool_(placement.resident))
            self.cache = dataclasses.replace(self.cache, kv=kv)
        if request.prefilled is not None and self.speculative is not None:
            raise UsageError("PD disaggregation does not run with speculative decoding yet (no MTP draft state from the prefill instance)")
        if request.prefilled is not None:  # PD: a prefill instance computed it; store it as it came
            self.cache = self.runner.admit_prefilled(self.cache, slot, request.prompt_len, request.prefilled, host_pages=pages)
            return request.first_token
        if self._fill is not None:
            key = jax.random.fold_in(self._fill_key, request.id)
            self.cache = self._fill(self.cache, slot, request.prompt_len, pages, key)
            return None
        job = self.runner.start_prefill(self.cache, slot, request.prompt, host_pages=pages)
        self.cache = job.cache
        return job

    def _advance_prefills(self, prefilling: dict) -> list[tuple[Request, int, int]]:
        """Runs prefill layers, oldest prompt first, within the step's prefill_token_budget ->
        (request, slot, first token) of each prefill that finished."""
        budget, spent, finished = self.config.prefill_token_budget, 0, []
        for slot, (request, job) in list(prefilling.items()):
            while not job.done and (budget is None or spent == 0 or spent + job.padded_len <= budget):
                self.cache = job.advance(self.cache)
                spent += job.padded_len
            if not job.done:
                break  # FCFS: later prompts wait for this one
            del prefilling[slot]
            if self.speculative is not None:  # its first token, the MTP layer's draft after it
                self._carry = self._set_carry(self._carry, jnp.int32(slot), job.draft)
            finished.append((request, slot, int(self._argmax(job.logits))))
        return finished

    def _bucket(self, num_running: int) -> int:
        """The smallest compiled batch size holding `num_running` requests (slots 0 .. n - 1)."""
        return next(b for b in self.buckets if b >= num_running)

    def _compact(self, inputs: _SlotInputs, prefilling: dict) -> None:
        """Moves running requests from the highest slots into the holes below them, so they
        occupy slots 0 .. n - 1; the next step's inputs and prefills in progress (slot ->
        (request, PrefillJob)) move with them. A mover's input token stays where the last step
        left it on the device: its src moves, nothing is read."""
        running = self.scheduler.running_slots()
        n = len(running)
        holes = sorted(set(range(n)) - set(running))
        movers = [slot for slot in running if slot >= n]
        for source, target in zip(movers, holes):
            self.cache = self.runner.move_request(self.cache, source, target)
            self.scheduler.move(source, target)
            if self.residency is not None:
                self.residency.move(source, target)
            if self.selector is not None:
                self.selector.move(source, target)
            if self.speculative is not None:
                self._carry = self._move_carry(self._carry, jnp.int32(source), jnp.int32(target))
            inputs.move(source, target)
            if source in prefilling:
                prefilling[target] = prefilling.pop(source)
                prefilling[target][1].slot = target

    def _retire(self, slot: int) -> None:
        self.cache = dataclasses.replace(self.cache, kv=self._end(self.cache.kv, jnp.int32(slot)))
        self.scheduler.finish(slot)
        if self.residency is not None:
            self.residency.release(slot)

    def _slot_of(self, request: Request) -> int:
        """The slot `request` runs in now (compaction may have moved it since it was dispatched)."""
        return next(slot for slot in self.scheduler.running_slots() if self.scheduler.running_request(slot).id == request.id)

    def _dispatch(self, inputs: _SlotInputs, active: np.ndarray, previous: jax.Array | None) -> _InFlight:
        """Dispatches one decode step for the `active` slots on the smallest bucket holding them:
        ONE jitted call, which also feeds the input tokens from `previous` (the last step's, on
        the device) and computes the greedy tokens and counts. Returns before it runs."""
        b = self._bucket(int(active.max()) + 1)  # compacted: active slots are 0 .. n - 1
        topk = None
        if self.selector is not None:
            # The SYNTHETIC selector stands in for nothing a real deployment runs (the indexers
            # still run inside the step). It needs nothing from the step before, so it is
            # dispatched ahead like the step (the overlap schedule stays on); its device time
            # (sorts of K-sized rows per layer and request; not timed on its own) lands between
            # steps, and both engines pay it.
            # Copies, as below: the call returns before it reads them, and the loop moves on.
            topk = self.selector.select(inputs.positions[:b].copy(), inputs.request_ids[:b].copy())
        begin = time.perf_counter()
        # Copies: the loop changes its arrays before the step runs (the CPU may not copy them in).
        tokens, positions, src = (array[:b].copy() for array in (inputs.tokens, inputs.positions, inputs.src))
        self.cache, _, result = self.runner.greedy_step(self.cache, tokens, positions, topk, TokenFeed(previous, src))
        batch = [(int(slot), self.scheduler.running_request(int(slot))) for slot in active]
        return _InFlight(result, batch, b, begin)

    def _dispatch_speculative(self, inputs: _SlotInputs, active: np.ndarray) -> _InFlight:
        """One speculative step for the `active` slots (positions: their committed lengths) on
        the smallest bucket holding them; their input tokens and drafts are in the device carry."""
        b = self._bucket(int(active.max()) + 1)
        begin = time.perf_counter()
        committed = inputs.positions[:b].copy()
        self.cache, result, self._carry = self.runner.speculative_greedy_step(self.cache, self._carry, committed)
        batch = [(int(slot), self.scheduler.running_request(int(slot))) for slot in active]
        return _InFlight(result, batch, b, begin)

    @staticmethod
    def _read(step: _InFlight) -> tuple[np.ndarray, int, int]:
        """(next tokens i32[R], hits, misses) of `step`: its one device -> host transfer."""
        next_tokens, hits, misses = jax.device_get(step.result)
        if step.ready_s is None:
            step.ready_s = time.perf_counter()
        return next_tokens, int(hits), int(misses)

    def _abort(self) -> None:
        """After a run failed: drops the waiting requests and retires every admitted one (slot,
        host pages, device bytes, KV state), leaving the engine as a completed run would."""
        slots = self.scheduler.running_slots()
        for slot in slots:  # the pools first: pure bookkeeping, nothing here can fail
            self.scheduler.finish(slot)
        if self.residency is not None:
            self.residency.reset()
        self.scheduler.waiting.clear()
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache)):
            # The failure came after the cache was donated (mid-prefill or mid-step): its arrays
            # are gone, so start over from an empty one.
            self.cache = self._empty_cache()
            return
        try:
            for slot in slots:
                self.cache = dataclasses.replace(self.cache, kv=self._end(self.cache.kv, jnp.int32(slot)))
            jax.block_until_ready(self.cache)
        except Exception:  # a step that failed on the device poisons what it would have written
            self.cache = self._empty_cache()

    # ---- the loop -----------------------------------------------------------------------------------

    def run(
        self,
        requests: list[Request],
        *,
        max_concurrency: int | None = None,
        progress: bool = False,
        label: str = "",
        arrivals=None,
    ) -> RunResult:
        """Serves `requests` to completion; at most `max_concurrency` in flight (None: all).

        arrivals: a source of requests that arrive while running (PD disaggregation's
        KVReceiver: `poll(timeout)` -> new requests, `closed` once no more come); the run then
        also lasts until it is closed and everything it delivered finished.

        If anything raises mid-run, every request of the run is dropped or retired (slots, host
        pages, device bytes, KV state) before the exception propagates: the next run starts on
        an idle engine."""
        requests = list(requests)
        if not requests and arrivals is None:
            raise UsageError("no requests to run")
        if len({r.id for r in requests}) != len(requests):
            raise UsageError("request ids must be distinct")
        if max_concurrency is not None:
            _positive_int("max_concurrency", max_concurrency)
        for request in requests:
            self.scheduler.check(request)
        if self.selector is not None:
            self.selector.reset_counts()
        if self.residency is not None:
            self.residency.reset_counts()
        limit = max_concurrency or (len(requests) if arrivals is None else self.config.max_running_requests)
        inputs = _SlotInputs(self.config.max_running_requests)
        generated: dict[int, list[int]] = {}
        issued: dict[int, int] = {}  # request id -> tokens emitted or coming from dispatched steps
        finished: set[int] = set()  # ids of requests whose last token was emitted
        traces: dict[int, RequestTrace] = {}
        steps: list[StepRecord] = []
        pending = collections.deque(requests)
        prefilling: dict[int, tuple[Request, PrefillJob]] = {}  # slot -> prompt being prefilled, oldest first
        in_flight = 0
        inflight: _InFlight | None = None  # the last dispatched step, its results not read yet
        previous = None  # i32[R] on the device: the last dispatched step's tokens
        last_ready = -np.inf  # perf_counter when the last read step's results were ready
        # PD decode instance with nothing to start with: the clock starts at the first arrival, so the
        # figures leave out the wait for the prefill instance (first_arrival_wait_s says how long)
        clock_waits, waited_s = arrivals is not None and not requests, None
        prefill_bar = progress_bar(progress, total=len(requests) if arrivals is None else None, desc=f"{label} prefill".strip(), unit="req")
        decode_bar = progress_bar(
            progress, total=sum(r.max_new_tokens for r in requests) if arrivals is None else None,
            desc=f"{label} decode".strip(), unit="tok",
        )  # fmt: skip
        start = time.perf_counter()

        def emit(request: Request, token: int, now: float) -> bool:
            """Records one output token; True when it is the request's last (the caller retires it)."""
            nonlocal in_flight
            generated[request.id].append(token)
            traces[request.id].token_times_s.append(now)
            decode_bar.update(1)
            done = len(generated[request.id]) >= request.max_new_tokens or token == request.eos_token_id
            if done:
                finished.add(request.id)
                in_flight -= 1
            return done

        def retire(slot: int) -> None:
            self._retire(slot)
            inputs.positions[slot] = -1

        def advance(step: _InFlight) -> None:
            """After dispatching `step`: what the host knows without its tokens. Each request's
            next position; a request whose last token this step makes (max_new_tokens) runs in
            no later step and retires now, after the step in the device's order."""
            for slot, request in step.batch:
                issued[request.id] += 1
                if issued[request.id] == request.max_new_tokens:
                    retire(slot)
                else:
                    inputs.positions[slot] += 1
                    inputs.src[slot] = slot  # its next input: this step's token for this slot

        def read_speculative(step: _InFlight) -> None:
            """Reads a speculative step (right after its dispatch: no overlap): each request emits
            its accepted drafts + 1 tokens, stopping at its EOS or max_new_tokens (the rest are
            dropped: its KV past them is never read), and moves on by what it kept."""
            nonlocal last_ready
            tokens, accepted, hits, misses = jax.device_get(step.result)
            step.ready_s = time.perf_counter()
            now = step.ready_s - start
            emitted = 0
            for slot, request in step.batch:
                made = int(accepted[slot]) + 1
                for token in tokens[slot, :made]:
                    emitted += 1
                    if emit(request, int(token), now):
                        retire(slot)
                        break
                else:
                    inputs.positions[slot] += made
            slots = [slot for slot, _ in step.batch]
            step_s = step.ready_s - max(step.begin_s, last_ready)
            steps.append(StepRecord(
                now, step_s, len(step.batch), int(hits), int(misses), int(misses) * self.footprint.row_bytes, step.size,
                accepted=int(accepted[slots].sum()), emitted=emitted,
            ))  # fmt: skip
            last_ready = step.ready_s

        def read(step: _InFlight) -> None:
            """Reads `step`'s tokens and counts: emits each request's token, retires a request
            that emitted its EOS. Under the overlap schedule the next step is already dispatched
            and ran such a request once more: that token is dropped, its KV row lies inside the
            context its request was admitted with, and end_request clears it with the slot."""
            nonlocal last_ready
            next_tokens, hits, misses = self._read(step)
            now = step.ready_s - start
            # Its time: since the last step's results (the ITL a client sees), or since its own
            # dispatch when nothing ran before it.
            step_s = step.ready_s - max(step.begin_s, last_ready)
            steps.append(StepRecord(now, step_s, len(step.batch), hits, misses, misses * self.footprint.row_bytes, step.size))
            last_ready = step.ready_s
            for slot, request in step.batch:
                if request.id in finished:
                    continue  # the step after its EOS: never emitted
                if emit(request, int(next_tokens[slot]), now) and issued[request.id] < request.max_new_tokens:
                    retire(self._slot_of(request))  # its EOS, known only now

        try:
            while pending or in_flight or inflight is not None or (arrivals is not None and not arrivals.closed):
                if arrivals is not None:
                    idle = not pending and not in_flight  # nothing to do but wait for the next arrival
                    for request in arrivals.poll(timeout=0.05 if idle else None):
                        if clock_waits:
                            now = time.perf_counter()
                            waited_s, start, clock_waits = now - start, now, False
                        self.scheduler.check(request)
                        requests.append(request)
                        pending.append(request)
                while pending and in_flight < limit:
                    request = pending.popleft()
                    self.scheduler.submit(request)
                    traces[request.id] = RequestTrace(request.id, request.prompt_len, time.perf_counter() - start)
                    generated[request.id] = []
                    in_flight += 1
                admitted = self.scheduler.admit()
                ready = []  # (request, slot, first token or None) of requests that decode from the next step
                for admission in admitted:
                    request, slot = admission.request, admission.slot
                    traces[request.id].admitted_s = time.perf_counter() - start
                    started = self._start(admission)
                    inputs.request_ids[slot] = request.id
                    if isinstance(started, PrefillJob):
                        prefilling[slot] = (request, started)
                    else:
                        ready.append((request, slot, started))
                ready += self._advance_prefills(prefilling)
                for request, slot, first in ready:
                    prefill_bar.update(1)
                    if self.residency is not None:
                        self.residency.started_decoding(slot)
                    issued[request.id] = 0 if first is None else 1
                    if first is None:  # synthetic context: no first token; the last prompt token stands in
                        inputs.start(slot, request.prompt[-1], request.prompt_len)
                    elif emit(request, first, time.perf_counter() - start):
                        retire(slot)
                    else:
                        inputs.start(slot, first, request.prompt_len)
                if len(self.buckets) > 1:
                    self._compact(inputs, prefilling)
                active = np.flatnonzero(inputs.positions >= 0)
                if active.size == 0 and inflight is None:
                    if prefilling:
                        continue  # prompts still prefilling: the next iteration advances them
                    if self.scheduler.waiting and not admitted:  # check() makes every request fit an idle engine
                        raise RuntimeError("admission stalled with nothing running")
                    continue  # what was admitted finished at prefill (max_new_tokens 1 or EOS): admit again
                step = None
                if active.size and self.speculative is not None:  # no overlap: read right away
                    read_speculative(self._dispatch_speculative(inputs, active))
                elif active.size:
                    if self.residency is not None:
                        self._apply(self.residency.rebalance(), inputs.positions)
                    step = self._dispatch(inputs, active, previous)
                    previous = step.result.next_tokens
                    advance(step)
                if inflight is not None:
                    read(inflight)  # step t's tokens, while step t + 1 runs
                inflight = step
                if not self.config.overlap_schedule and inflight is not None:
                    read(inflight)
                    inflight = None
        except BaseException:  # interrupts too: a run never keeps slots or pages after it ends
            self._abort()
            raise
        finally:
            prefill_bar.close()
            decode_bar.close()
        duration = time.perf_counter() - start

        ordered = [traces[r.id] for r in requests]
        summary = summarize(steps, ordered, duration, measure_ttft=not self.config.synthetic_context)
        summary.update(mode=self.config.mode, selection=self.config.selection, max_concurrency=limit,
                       synthetic_context=self.config.synthetic_context,
                       kv_bytes_per_request=self.kv_bytes_per_request())  # fmt: skip
        if self.selector is not None:
            summary["measured_topk_overlap"] = self.selector.measured_overlap
        if self.residency is not None:
            summary["residency"] = self.residency.summary()
        if waited_s is not None:
            summary["first_arrival_wait_s"] = waited_s
        outputs = {r.id: np.asarray(generated[r.id], np.int32) for r in requests}
        return RunResult(outputs, steps, ordered, summary)

    def warmup(self, requests: list[Request], *, progress: bool = False) -> None:
        """Compiles everything `requests` will run (one prefill per padded prompt length, the
        decode step, retirement) on throwaway requests, so a timed run measures no compile."""
        for request in requests:
            self.scheduler.check(request)
        chunk = self.runner.prefill_chunk
        by_bucket = {}
        for request in requests:  # per prompt bucket one request, one that decodes if any does
            bucket = padded_prompt_length(request.prompt_len, chunk)
            if bucket not in by_bucket or by_bucket[bucket].max_new_tokens < 2 <= request.max_new_tokens:
                by_bucket[bucket] = request
        # A warm request fits wherever its real one does: 2 tokens where that one makes at least 2,
        # else 1 (it ends at prefill). Some warm request decodes whenever a real one would, so the
        # decode step is compiled whenever the run needs it.
        warm = [Request(i, r.prompt, min(2, r.max_new_tokens)) for i, r in enumerate(by_bucket.values())]
        decodes = any(r.max_new_tokens >= 2 for r in requests)
        if decodes:
            self.compile_decode_programs(progress=progress)
        self.run(warm, max_concurrency=1)
        if decodes:
            self.compile_buckets(progress=progress)

    def compile_decode_programs(self, *, progress: bool = False) -> None:
        """Compiles every bucket's decode programs (and their copies) side by side, with the
        synthetic fill, a thread each as cores and host memory allow (EngineConfig.compile_threads,
        auto_compile_threads):
        XLA's compile releases the GIL, and at 61-78 layers one program compiles for a minute or
        more. The steps that run them afterwards compile nothing (the lowered programs share the
        jits' caches); tracing stays serial. On an idle engine (the selector's warm clears slots)."""
        if self.scheduler.running_slots():
            raise RuntimeError("compile_decode_programs needs an idle engine")
        lowered = []
        for b in self.buckets:
            topk = None if self.selector is None else self.selector.warm(b)  # i32[J, b, K]: all -1
            lowered += self.runner.decode_programs(self.cache, b, topk)
        if not lowered:
            return
        if self._fill is not None and self.residency is None:  # the warm run's first jit, on this cache
            pages = None if self.config.hisparse is None else np.zeros(self._pages_per_request, np.int32)  # i32[P]
            lowered.append(self._fill.lower(self.cache, pages, jax.random.fold_in(self._fill_key, 0)))
        bar = progress_bar(progress, total=len(lowered), desc="compile decode programs", unit="program")
        available = available_host_bytes()
        threads = self.config.compile_threads or auto_compile_threads(len(lowered), os.cpu_count(), available)
        self.decode_compiles = dict(programs=len(lowered), threads=threads, host_available_gb=None if available is None else available / 1e9)
        pool = concurrent.futures.ThreadPoolExecutor(threads)
        try:
            for done in concurrent.futures.as_completed([pool.submit(program.compile) for program in lowered]):
                done.result()  # the first failure (or Ctrl-C) raises here
                bar.update(1)
        finally:  # on a failure: the compiles not begun are dropped, those under way end (XLA's cannot be stopped)
            pool.shutdown(wait=True, cancel_futures=True)
            bar.close()

    def compile_buckets(self, *, progress: bool = False) -> None:
        """Runs one decode step of every batch bucket (each compiled copy once) with every slot
        inactive: nothing is written, read or moved. After compile_decode_programs this compiles
        no decode program (called alone, it compiles them one by one); it still compiles the
        synthetic selector, the compaction's move and residency's changes, and on a GPU records
        each program's CUDA graphs, so the timed run that follows compiles and records nothing."""
        if self.scheduler.running_slots():
            raise RuntimeError("compile_buckets needs an idle engine")
        bar = progress_bar(progress, total=len(self.buckets), desc="compile decode buckets", unit="bucket")
        try:
            for b in self.buckets:
                tokens, positions = np.zeros(b, np.int32), np.full(b, -1, np.int32)  # i32[b]: all inactive
                if self.speculative is not None:
                    self.cache, result, self._carry = self.runner.speculative_greedy_step(self.cache, self._carry, positions)
                else:  # every copy of the decode program (ModelRunner.decode_program_copies_for) runs once
                    topk = None if self.selector is None else self.selector.warm(b)
                    for _ in range(self.runner.decode_program_copies_for(self.cache, b)):
                        self.cache, _, result = self.runner.greedy_step(self.cache, tokens, positions, topk)
                jax.device_get(result)
                bar.update(1)
            if self.residency is not None:  # residency changes on a free slot: nothing to copy
                kv, row = self.cache.kv, jnp.full(self.cache.kv.device_page_table.shape[1], -1, jnp.int32)
                kv = self._demote(self._promote(self._assign(kv, jnp.int32(0), row, jnp.bool_(False)), jnp.int32(0), row), jnp.int32(0), row)
                self.cache = dataclasses.replace(self.cache, kv=self._end(kv, jnp.int32(0)))
            if len(self.buckets) > 1:  # compaction's move, on a free slot onto itself: changes nothing
                self.cache = self.runner.move_request(self.cache, 0, 0)
                if self.speculative is not None:
                    self._carry = self._move_carry(self._carry, jnp.int32(0), jnp.int32(0))
                if self.selector is not None:
                    self.selector.move(0, 0)
        finally:
            bar.close()
