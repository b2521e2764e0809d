"""The serving engine's runner for a model family other than DSA (DeepSeek-V4, MiniMax-M3): what
serving.engine.Engine calls, with the family's own prefill and decode functions.

    runner = V4Runner(model)                      # models/deepseek_v4/runner.py (or M3Runner)
    engine = Engine(runner, EngineConfig(max_running_requests=4, context_length=256, hisparse=hs))

Letters: R request slots, b <= R slots of one decode step, T prompt tokens, Tp padded to a
compiled length, V vocab, L state layers of the family's KV state.

The contract is models.dsa.runner.ModelRunner's: create_cache -> a pytree with a `kv` field (a
hisparse_jax KVState the engine ends requests on), start_prefill -> a PrefillJob, decode_step
over slots 0 .. b - 1 (-1 positions inactive) -> (cache, logits, telemetry with num_hits /
num_misses), greedy_step, the same step as the engine runs it (input tokens fed from the last
step's outputs on the device, TokenFeed; -> (cache, logits, StepResult): greedy tokens and summed
counts from the same jit, one dispatch per step), move_request; plus device_footprint, the
device bytes admission counts per request (the DSA runner's are
models.dsa.footprint.DeviceFootprint). decode_step and greedy_step run one jitted function (one
compile per batch size), which takes the params as leaves flattened once (flat_params). A family
supplies three
pure functions for prefill (the prompt's forward, then storing its caches into a slot: the
offloaded rows straight to the host pool), one for a decode step over all slots and one to move
a slot; this class splits the model once, jits them with the cache donated (its host pool kept
in pinned_host by output shardings) and pads prompts to the DSA runner's compiled lengths. The
prompt's forward does not depend on the cache's KV state type, so HiSparse and the baseline
share its compiled function (one compile fewer per prompt length: ~7 s of a V4 CPU test).

Differences from the DSA runner, on purpose:
  - a prompt is prefilled in one call (the families' prefill is one forward over the prompt),
    so a PrefillJob here has a single step;
  - every decode step runs all R slots (a smaller batch b is padded with inactive slots): the
    families' steps are written over the whole cache; batch buckets then save nothing;
  - one device, kv_cache_dtype "auto" (the caches in the model dtype), no SYNTHETIC top-k.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax import memory

DEFAULT_PREFILL_CHUNK = 128


def padded_prompt_length(prompt_len: int, chunk: int) -> tuple[int, int]:
    """(Tp, chunk): prompts pad to a power of two up to `chunk`, then to a multiple of it, so
    prompt lengths share few compiled shapes."""
    if prompt_len <= chunk:
        padded = 1 << (prompt_len - 1).bit_length()
        return padded, padded
    return -(-prompt_len // chunk) * chunk, chunk


class PrefillJob:
    """A prompt's prefill in progress, as the engine drives it: advance(cache) -> cache until
    `done`, then `logits` (f32[V], the last prompt token's) picks the first new token. `slot`
    may change between advances (the engine's compaction moves the request). The engine tells a
    prefill in progress from a ready first token by this type. Subclasses: the DSA runner's
    layer-by-layer prefill (models.dsa.runner.LayerwisePrefill) and WholePromptPrefill below."""

    slot: int  # the request slot being filled
    prompt_len: int  # T
    padded_len: int  # Tp: tokens each step of the prefill computes
    layers_done: int
    logits: jax.Array | None
    cache: object  # the cache with the slot claimed, until the first advance (then None)

    @property
    def num_layers(self) -> int:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        return self.layers_done == self.num_layers

    def advance(self, cache):
        raise NotImplementedError



@dataclasses.dataclass(frozen=True)
class RequestFootprint:
    """Device bytes one request holds, as admission counts them (the interface of the DSA
    runner's DeviceFootprint: row_bytes, request_bytes, capacity)."""

    row_bytes: int  # one offloaded KV row (telemetry: bytes one miss copies host -> device)
    fixed_bytes: int  # held whatever the length: windows, raw buffers, HiSparse buffers (L x (B + 1) rows)
    # (bytes, every): `bytes` per started `every` tokens of context, e.g. one CSA indexer key per 4 tokens
    per_tokens: tuple[tuple[int, int], ...]
    # (bytes, every) as per_tokens, of the host pool: the offloaded rows (HiSparse); () for the baseline
    host_per_tokens: tuple[tuple[int, int], ...] = ()

    def request_bytes(self, num_tokens: int) -> int:
        return self.fixed_bytes + sum(size * math.ceil(num_tokens / every) for size, every in self.per_tokens)

    def host_request_bytes(self, num_tokens: int) -> int:
        """Host pool bytes of one request's offloaded rows."""
        return sum(size * math.ceil(num_tokens / every) for size, every in self.host_per_tokens)

    def capacity(self, budget_bytes: int, num_tokens: int) -> int:
        """Requests of `num_tokens` tokens that fit in `budget_bytes`."""
        return budget_bytes // self.request_bytes(num_tokens)


class StepCounts(NamedTuple):
    """A decode step's swap-in counts, what the engine's telemetry sums."""

    num_hits: jax.Array  # i32[L, R]: selected rows found on the device, per state layer and slot
    num_misses: jax.Array  # i32[L, R]: rows copied host -> device (0 without HiSparse)


class TokenFeed(NamedTuple):
    """Where a decode step's input tokens come from, so that they need not pass through the host:
    the engine dispatches step t + 1 before it reads step t's tokens (its overlap schedule)."""

    previous: jax.Array | None  # i32[R]: the last step's StepResult.next_tokens, on the device (None: none yet)
    src: np.ndarray  # i32[b]: per slot, the slot of `previous` holding its input token; -1: the host's token


class StepResult(NamedTuple):
    """What the engine reads back from a decode step, computed in the step's own jit: one transfer
    of a few bytes per slot, no second dispatch."""

    next_tokens: jax.Array  # i32[R]: greedy token per slot (argmax of the f32 logits); 0 in slots past the step's b
    hits: jax.Array  # i32[]: selected rows found on the device, all layers and slots
    misses: jax.Array  # i32[]: rows copied host -> device, all layers and slots


def fed_tokens(tokens, previous, src):
    """A step's input tokens i32[b] (traceable): previous[src] where src >= 0 (a request decoding
    on, perhaps moved to another slot since), else the host's tokens (a first token after prefill
    or a PD hand-over). previous None: the host's tokens."""
    if previous is None:
        return tokens
    return jnp.where(src >= 0, previous[jnp.maximum(src, 0)], tokens)


def step_result(logits, counts, num_slots: int) -> StepResult:
    """logits f32[b, V] and counts (num_hits / num_misses, i32[L, b] or [L, R]) -> StepResult
    (traceable). The tokens are padded to R slots so that the next step's `previous` has one shape
    whatever its batch bucket (else a compile per pair of buckets)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # i32[b]: as a separate argmax of the logits
    next_tokens = jnp.zeros(num_slots, jnp.int32).at[: greedy.shape[0]].set(greedy)  # i32[R]
    return StepResult(next_tokens, jnp.sum(counts.num_hits, dtype=jnp.int32), jnp.sum(counts.num_misses, dtype=jnp.int32))


def flat_params(params) -> tuple[tuple, object]:
    """(leaves, treedef) of a model's params (an nnx.State), flattened once. Runners hand their
    jitted steps the leaves: jit flattens an nnx.State in Python on every call (2.2 ms per call
    for 61 layers' 1340 leaves on the CPU, against 0.3 ms for the same leaves as a tuple)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return tuple(leaves), treedef


def unflat_params(treedef, params):
    """Inside a jit: the params as the nnx.State the model merges, from the leaves a runner passes
    (a tuple); an nnx.State passes through (tests lower the step with runner.params)."""
    return jax.tree_util.tree_unflatten(treedef, params) if isinstance(params, tuple) else params


class WholePromptPrefill(PrefillJob):
    """One prompt's prefill, done in one advance()."""

    def __init__(self, runner: "FamilyRunner", cache, slot: int, tokens, host_pages):  # noqa: D107
        self.runner, self.slot = runner, slot  # slot may change before advance (the engine's compaction)
        self.tokens = np.asarray(tokens, np.int32)  # i32[T]
        self.prompt_len = self.tokens.shape[0]
        self.padded_len = padded_prompt_length(self.prompt_len, runner.prefill_chunk)[0]  # Tp
        self.host_pages = host_pages  # i32[P] (HiSparse) or None
        self.cache = cache  # the slot is claimed in advance(), so the cache is unchanged until then
        self.layers_done = 0
        self.logits = None  # f32[V] once done: the last prompt token's

    @property
    def num_layers(self) -> int:
        return 1

    def advance(self, cache):
        """Prefills the whole prompt into `slot` -> the cache (donated: pass the latest one)."""
        if self.done:
            raise RuntimeError("this prefill is done")
        cache, self.logits = self.runner.prefill(cache, self.slot, self.tokens, host_pages=self.host_pages)
        self.layers_done, self.cache = 1, None
        return cache


class FamilyRunner:
    """Splits a family's model once and jits its serving functions (see the module docstring).

    Subclasses set `_forward_fn(model, tokens i32[Tp], prompt_len i32[], max_context: static) ->
    (prompt caches: a pytree, logits f32[V] of the last prompt token)`, `_store_fn(cache, slot,
    prompt caches, prompt_len, host_pages i32[P] or None) -> cache` (begins the request),
    `_decode_fn(model, cache, tokens i32[R], positions i32[R]) -> (cache, logits f32[R, V],
    StepCounts)`, `_move_fn(cache, source, target) -> cache`, and implement _create_cache,
    max_context and device_footprint."""

    mesh = None  # one device: the engine's data-parallel paths stay off
    kv_cache_dtype = "auto"  # caches in the model dtype
    _forward_fn: Callable
    _store_fn: Callable
    _decode_fn: Callable
    _move_fn: Callable

    def decode_program_copies_for(self, cache, b: int) -> int:
        """One decode program per bucket (models.dsa.runner.ModelRunner can run several in turn)."""
        return 1

    def decode_programs(self, cache, b: int, topk=None) -> list:
        """Nothing to compile ahead (models.dsa.runner.ModelRunner lowers its programs here): one
        R-slot program, which the engine's first warm step compiles."""
        return []

    def __init__(self, model, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, implementation: str | None = None):
        self.model = model  # kept for cache shapes (create_cache); the jitted functions take params
        self.config = model.config
        self.dtype = model.dtype
        self.prefill_chunk = prefill_chunk
        self.implementation = implementation
        self.graphdef, self.params = nnx.split(model)
        self._param_leaves, self._param_treedef = flat_params(self.params)
        self._jits = {}  # per KV state type: the cache's output shardings differ (pinned host pool or not)
        self._zeros = {}  # R -> i32[R] on the device (_no_tokens)
        merge = lambda params: nnx.merge(self.graphdef, params)  # noqa: E731
        self._forward = jax.jit(
            lambda params, tokens, n, max_context: self._forward_fn(merge(params), tokens, n, max_context), static_argnums=3
        )  # one compile per padded prompt length, whatever the cache

    # ---- what a family provides ----------------------------------------------------------------

    def _create_cache(self, *, num_requests: int, max_context: int, hisparse, num_host_pages, page_size: int, fill_value: float):
        raise NotImplementedError

    def max_context(self, cache) -> int:
        """C: the tokens one slot of `cache` holds (static)."""
        raise NotImplementedError

    def device_footprint(self, hisparse):
        """RequestFootprint of one request under `hisparse` (None: the no-offload baseline)."""
        raise NotImplementedError

    # ---- the engine's interface ----------------------------------------------------------------

    def create_cache(self, *, num_requests: int, max_context: int, hisparse=None, num_host_pages: int | None = None,
                     page_size: int = 16, fill_value: float = 0.0):  # fmt: skip
        """An empty cache of `num_requests` free slots of up to `max_context` tokens each."""
        cache = self._create_cache(
            num_requests=num_requests, max_context=max_context, hisparse=hisparse, num_host_pages=num_host_pages,
            page_size=page_size, fill_value=fill_value,
        )  # fmt: skip
        # Commit every array where it is (jnp.zeros are uncommitted, jit outputs committed): jit keys
        # its cache on that, so a fresh cache would compile prefill and decode a second time (25 s
        # per V4 prefill compile on the 2-core CI machine, seen as a 17 s mean TTFT).
        return jax.tree.map(lambda x: x if x.committed else jax.device_put(x, x.sharding), cache)

    def _jitted(self, cache) -> dict:
        kind = type(cache.kv)
        if kind not in self._jits:
            shardings = jax.tree.map(lambda leaf: leaf.sharding, cache)  # host pool stays pinned_host
            # The step's tokens where the next step's `previous` must be, whoever fed that one (one compile).
            device = memory.sharding(memory.DEVICE)
            self._jits[kind] = dict(
                store=jax.jit(self._store_fn, donate_argnums=0, out_shardings=shardings),
                decode=jax.jit(self._greedy_decode_step, donate_argnums=1, out_shardings=(shardings, None, None, StepResult(device, device, device))),
                move=jax.jit(self._move_fn, donate_argnums=0, out_shardings=shardings),
            )  # fmt: skip
        return self._jits[kind]

    def _greedy_decode_step(self, params, cache, tokens, positions, previous, src):
        """The jitted decode step: params (leaves, flat_params), tokens fed (fed_tokens), i32[R]
        each -> (cache, logits f32[R, V], StepCounts, StepResult)."""
        model = nnx.merge(self.graphdef, unflat_params(self._param_treedef, params))
        cache, logits, counts = self._decode_fn(model, cache, fed_tokens(tokens, previous, src), positions)
        return cache, logits, counts, step_result(logits, counts, cache.kv.num_requests)

    def _no_tokens(self, num_slots: int) -> jax.Array:
        """i32[R] zeros where the decode step's tokens live: `previous` when nothing is fed."""
        if num_slots not in self._zeros:
            self._zeros[num_slots] = jax.device_put(np.zeros(num_slots, np.int32), memory.sharding(memory.DEVICE))
        return self._zeros[num_slots]

    def prefill(self, cache, request: int, tokens, *, host_pages=None):
        """Admits free slot `request` with prompt tokens i32[T] -> (cache, logits f32[V] of the
        last prompt token). host_pages: i32[P] (HiSparse only), the pages its positions use."""
        tokens = np.asarray(tokens, np.int32)
        T = tokens.shape[0]
        Tp = padded_prompt_length(T, self.prefill_chunk)[0]  # few compiled lengths (the DSA runner's)
        pages = None if host_pages is None else jnp.asarray(host_pages, jnp.int32)
        prompt, logits = self._forward(self.params, jnp.asarray(np.pad(tokens, (0, Tp - T))), jnp.int32(T), self.max_context(cache))
        return self._jitted(cache)["store"](cache, jnp.int32(request), prompt, jnp.int32(T), pages), logits

    def start_prefill(self, cache, request: int, tokens, *, host_pages=None) -> WholePromptPrefill:
        return WholePromptPrefill(self, cache, request, tokens, host_pages)

    def _step(self, cache, tokens, positions, topk, feed: TokenFeed | None):
        """The jitted step over all R slots, slots past b = len(tokens) inactive -> (cache, logits
        f32[R, V], StepCounts i32[L, R], StepResult)."""
        if topk is not None:
            raise ValueError("a top-k override (SYNTHETIC selection) is not supported for this model family")
        R, b = cache.kv.num_requests, len(tokens)
        full = np.zeros((3, R), np.int32)  # i32[3, R]: tokens, positions, src
        full[1:] = -1  # past b: inactive, tokens from the host
        full[0, :b], full[1, :b] = tokens, positions
        previous = None
        if feed is not None:
            full[2, :b], previous = feed.src, feed.previous
        previous = self._no_tokens(R) if previous is None else previous
        tokens, positions, src = (jnp.asarray(row) for row in full)
        return self._jitted(cache)["decode"](self._param_leaves, cache, tokens, positions, previous, src)

    def greedy_step(self, cache, tokens, positions, topk=None, feed: TokenFeed | None = None):
        """One token for each of slots 0 .. b - 1 as the engine runs it (tokens, positions i32[b],
        -1 inactive; feed: where the input tokens come from, None: all from `tokens`) -> (cache,
        logits f32[R, V], StepResult). Runs all R slots (the rest inactive); the logits of all R,
        unsliced (a slice would be a dispatch of its own)."""
        cache, logits, _, result = self._step(cache, tokens, positions, topk, feed)
        return cache, logits, result

    def decode_step(self, cache, tokens, positions, topk=None):
        """One token for each of slots 0 .. b - 1 (tokens, positions i32[b]; -1 inactive) ->
        (cache, logits f32[b, V], StepCounts i32[L, R]). Runs all R slots (the rest inactive)."""
        cache, logits, counts, _ = self._step(cache, tokens, positions, topk, None)
        return cache, logits[: len(tokens)], counts

    def move_request(self, cache, source: int, target: int):
        """Moves the request in slot `source` to the free slot `target` (the engine's compaction)."""
        return self._jitted(cache)["move"](cache, jnp.int32(source), jnp.int32(target))
