"""Decoding a DSA model: the model-level cache, prompt prefill, the jitted decode step, greedy
generation, and greedy decoding of a checkpoint (what run_decode.py calls).

Letters: L layers, J full-indexer layers, R request slots, C max context, T prompt tokens,
Tp padded prompt tokens, D hidden, I index_head_dim, K top-k entries, W KV row width, V vocab,
N generated tokens, B prompts.

Per layer of a decode step (docs/architecture.md): MLA projections of the new token -> its KV
row and indexer key -> indexer top-k over the request's whole context (keys stay on the device)
-> hisparse_jax.attention_layer, which swaps the selected rows in and attends (or, with a
FullKVState, attends over the on-device KV) -> W_UV, o_proj, MLP. The cache's KV state type
alone selects HiSparse or no offload: the model code is the same.

Prefill runs layer by layer over the whole prompt, query-chunked, and writes each layer's KV rows
with store_prefill_rows straight into the host pool (direct-to-host), so the decode state never
stages the full context on the device; only the layer being computed holds its rows.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.model import DSAModelConfig
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hisparse_jax import memory
from hisparse_jax import sharding as dp_sharding
from hisparse_jax.attention_layer import attention_layer, prefetch_shared_rows, shared_attention_layer, shared_prefetch_mode
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.host_pages import HostPageAllocator
from hisparse_jax.kv_cache_ops import advance, backup_newest_rows, begin_request, store_prefill_rows
from hisparse_jax.kv_cache_ops import move_request as kv_move_request
from hisparse_jax.row_layout import KVRowLayout
from hisparse_jax.paged_state import PagedHiSparseState
from hisparse_jax.state import FullKVState, HiSparseState, state_shardings
from models import families, inputs, rope
from models.decoder import DSAForCausalLM, DecoderLayer
from models.loading import load_hf_checkpoint  # noqa: F401  (models.families' DSA loader, patched in tests)
from models.footprint import DeviceFootprint
from models.indexer import decode_topk, dequantize_keys, index_key_dtype, is_fp8, quantize_keys
from models.parallel import shard_params

DEFAULT_PREFILL_CHUNK = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeCache:
    """Everything the model keeps between decode steps."""

    kv: HiSparseState | PagedHiSparseState | FullKVState  # MLA KV rows of every layer; its type picks HiSparse or no offload
    index_keys: jax.Array  # [J, R, C, I]: indexer key of every stored position, per full-indexer layer
    # f32[J, R, C]: each fp8 key's scale (models.indexer.quantize_keys); f32[J, R, 0] (no bytes)
    # when the keys are not fp8, so the cache's pytree is the same whatever the key format.
    index_key_scales: jax.Array


class PrefilledKV(NamedTuple):
    """One prompt's KV as a prefill instance hands it to a decode instance (PD disaggregation)."""

    rows: tuple  # row[Tp, W] per layer: KV rows of the (padded) prompt positions
    index_keys: tuple  # [Tp, I] per full-indexer layer, in the prefill runner's key dtype
    logits: jax.Array  # f32[V]: logits of the last prompt token (they pick the first new token)
    index_key_scales: tuple = ()  # f32[Tp] per full-indexer layer with fp8 keys; () otherwise


class StepTelemetry(NamedTuple):
    num_hits: jax.Array  # i32[L, b]: selected rows found on the device, per layer and request
    num_misses: jax.Array  # i32[L, b]: rows copied host -> device (0 without HiSparse)
    # i32[J, b]: positions each full indexer chose; with a top-k override (the SYNTHETIC
    # selection) what the model's indexer would have attended to, computed at full cost
    indexer_selected: jax.Array


def create_cache(
    config: DSAModelConfig,
    *,
    num_requests: int,
    max_context: int,
    dtype,
    hisparse: HiSparseConfig | None = None,
    num_host_pages: int | None = None,
    page_size: int = 64,
    fill_value: float = 0.0,
    mesh: Mesh | None = None,
    kv_cache_dtype: str = "auto",
) -> DecodeCache:
    """An empty cache for `num_requests` slots of up to `max_context` tokens; KV rows in `dtype`.

    kv_cache_dtype (SGLang's --kv-cache-dtype): "auto" (the model dtype `dtype`), "bfloat16",
    "float32" or "fp8_e4m3": how KV rows (KVRowLayout.for_kv_cache_dtype) and indexer keys are
    stored (fp8 keys: I fp8_e4m3 values + one f32 scale per key, index_key_scales).
    hisparse None keeps every row on the device (FullKVState). fill_value initialises unwritten
    rows (tests pass NaN so any stray read shows). With a mesh every request-indexed array is
    split over its "dp" axis (hisparse_jax.sharding).
    """
    layout = KVRowLayout.for_kv_cache_dtype(config.kv_lora_rank, config.qk_rope_head_dim, dtype, kv_cache_dtype)
    if hisparse is None:
        kv = FullKVState.create(
            num_layers=config.num_layers, num_requests=num_requests, max_context=max_context,
            layout=layout, fill_value=fill_value, mesh=mesh,
        )  # fmt: skip
    else:
        if hisparse.top_k != config.index_topk:
            raise ValueError(
                f"hisparse_config top_k ({hisparse.top_k}) must equal the model's index_topk ({config.index_topk})"
            )
        # Dynamic residency needs device rows that pass between requests: a paged pool.
        state_class = HiSparseState if hisparse.dynamic_residency is None else PagedHiSparseState
        kv = state_class.create(
            num_layers=config.num_layers, num_requests=num_requests, max_context=max_context, config=hisparse,
            layout=layout, num_host_pages=num_host_pages, page_size=page_size, fill_value=fill_value, mesh=mesh,
        )  # fmt: skip
    placement = None if mesh is None else NamedSharding(mesh, P(None, dp_sharding.REQUEST_AXIS))
    J, key_dtype = len(config.full_indexer_layers), index_key_dtype(kv_cache_dtype, dtype)
    index_keys = memory.allocate(
        (J, num_requests, max_context, config.index_head_dim), key_dtype, fill_value, memory.DEVICE, placement=placement
    )  # fmt: skip
    scale_positions = max_context if is_fp8(key_dtype) else 0
    # fill_value (NaN in tests) shows a stray read of an unwritten key through its scale too.
    index_key_scales = memory.allocate(
        (J, num_requests, scale_positions), jnp.float32, fill_value, memory.DEVICE, placement=placement
    )  # fmt: skip
    return DecodeCache(kv, index_keys, index_key_scales)


def move_request(cache: DecodeCache, source, target) -> DecodeCache:
    """Moves the request in slot `source` to the free slot `target` (i32[]): its KV state (see
    hisparse_jax.kv_cache_ops.move_request) and its indexer keys; `source` is left free."""
    move = lambda x: x.at[:, target].set(x[:, source])  # noqa: E731  (keys [J, R, C, I], scales f32[J, R, C or 0])
    return DecodeCache(kv_move_request(cache.kv, source, target), move(cache.index_keys), move(cache.index_key_scales))


def cache_shardings(cache: DecodeCache) -> DecodeCache:
    """Output shardings of a jit returning the cache: every array stays where it is (the host
    pool in pinned_host memory, mesh-split arrays split the same way)."""
    return DecodeCache(state_shardings(cache.kv), cache.index_keys.sharding, cache.index_key_scales.sharding)


def write_index_keys(index_keys, index_key_scales, j, requests, targets, keys, key_scales=None):
    """Stores keys at index_keys[j, requests, targets] (targets past C are dropped) in the
    cache's format -> (index_keys, index_key_scales). keys [..., I]: fp8 with key_scales f32[...]
    (already quantised, e.g. by prefill), or any float dtype, quantised here for an fp8 cache."""
    if is_fp8(index_keys.dtype):
        if not is_fp8(keys.dtype):
            keys, key_scales = quantize_keys(keys)
        index_key_scales = index_key_scales.at[j, requests, targets].set(key_scales, mode="drop")
    elif is_fp8(keys.dtype):  # fp8 keys from a prefill instance, into a higher-precision cache
        keys = dequantize_keys(keys, key_scales)
    return index_keys.at[j, requests, targets].set(keys.astype(index_keys.dtype), mode="drop"), index_key_scales


# ---- decode ---------------------------------------------------------------------------------------


def _decode_indexer(layer: DecoderLayer, x, q_resid, cos, sin, index_keys, key_scales, j, positions, topk=None, implementation=None):
    """Writes the new indexer keys (quantised with fp8 keys), returns (index_keys, key_scales,
    top-k i32[b, K], the indexer's own top-k i32[b, K]) over each request's context.

    topk i32[b, K], when given, is returned in place of the indexer's own choice. The indexer
    still scores and selects (a step costs what a real one does; decode_step returns a count of
    its choice so XLA keeps the work)."""
    indexer, config = layer.self_attn.indexer, layer.config
    b, C = positions.shape[0], index_keys.shape[2]  # a batch of b <= R slots: slots 0 .. b - 1
    keys = indexer.keys(x, cos, sin)  # [b, I]
    target = jnp.where(positions >= 0, positions, C)  # an inactive slot writes nothing
    index_keys, key_scales = write_index_keys(index_keys, key_scales, j, jnp.arange(b), target, keys)
    q, w = indexer.queries(x, q_resid, cos, sin)  # [b, G, I], f32[b, G]
    # Scored over the key cache in place (slots 0 .. b - 1 of layer j), each slot up to its own
    # position; on GPU a fused scoring kernel and a top-k kernel (models.indexer.decode_topk).
    selected = decode_topk(q, w, index_keys, key_scales, j, positions, config.index_topk, implementation=implementation)
    # The scoring reads the key cache in place; the next indexer layer writes into the same
    # array. With a top-k override nothing else waits for `selected`, and XLA may then schedule
    # this read after that write, keeping the old cache alive with a copy of all of it (on the
    # H200 2.4 ms per step at 88 slots). The barrier orders the read before any later write.
    index_keys, key_scales, selected = jax.lax.optimization_barrier((index_keys, key_scales, selected))
    return index_keys, key_scales, selected if topk is None else topk, selected


def decode_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cache: DecodeCache,
    tokens: jax.Array,  # i32[b]: this step's input token per request slot 0 .. b - 1 (b <= R)
    positions: jax.Array,  # i32[b]: its position (= tokens stored so far), -1 for an inactive slot
    topk: jax.Array | None = None,  # i32[J, b, K]: per full-indexer layer, overrides the indexer's top-k
    *,
    implementation: str | None = None,
    mesh: Mesh | None = None,
    shared_prefetch: str | None = None,
    defer_backup: bool = True,
) -> tuple[DecodeCache, jax.Array, StepTelemetry]:
    """One token for request slots 0 .. b - 1 -> (cache, logits f32[b, V], telemetry). Traceable;
    see ModelRunner for the jitted, cache-donating version. b (the batch bucket) may be less than
    the cache's R slots: the engine keeps its running requests in the first slots
    (move_request), so a step costs what its bucket costs, not what R does.

    topk None: each full layer's indexer selects. Given, it is what the layers attend to instead
    (the engine's labelled synthetic selection, hisparse_jax.serving.synthetic_selection); entries must
    be distinct positions in [0, positions[r]], -1 padding. The indexers still score and select
    (telemetry.indexer_selected counts their choice), so a step with synthetic selection costs
    what a real one does.

    Copies off the critical path (docs/architecture.md, "Overlap"): every layer's newest row is
    backed up to the host pool after the last layer (kv_cache_ops.backup_newest_rows), and each
    shared-index layer's rows are fetched as soon as its anchor's plan exists, on a second GPU
    stream (attention_layer.prefetch_shared_rows). shared_prefetch: "ffi_stream", "stream",
    "early" or "off" (in-line replay); None reads $HISPARSE_SHARED_PREFETCH, else "off"
    (attention_layer.shared_prefetch_mode; "ffi_stream" is the one that overlaps, see
    docs/architecture.md). defer_backup=False
    backs each row up in its own layer (the earlier behaviour; it forces prefetch "off": the
    in-place pool writes would sit between the prefetches and their layers). Over a mesh the
    layers keep their in-line replay and per-layer backup.
    """
    model: DSAForCausalLM = nnx.merge(graphdef, params)
    config = model.config
    kv, index_keys, key_scales = cache.kv, cache.index_keys, cache.index_key_scales
    layout = kv.layout  # the cache's row layout: packs (for fp8, quantises) each new row
    h = model.embed_tokens(tokens)  # [R, D]
    cos, sin = rope.cos_sin(config.rope, config.qk_rope_head_dim, positions)  # f32[R, P/2]
    attend = dict(latent_dim=config.kv_lora_rank, sm_scale=config.softmax_scale, implementation=implementation)
    attend_layer, attend_shared = attention_layer, shared_attention_layer
    if mesh is not None:  # the Pallas kernels run per device, each group on its own requests
        attend_layer = functools.partial(dp_sharding.attention_layer, mesh)
        attend_shared = functools.partial(dp_sharding.shared_attention_layer, mesh)
    # The indexer kernels run on whole arrays; over a mesh XLA's partitionable einsum and top-k
    # keep each group's scoring on its own devices.
    indexer_implementation = implementation if mesh is None else "reference"
    # Single device: backups after the last layer, shared layers prefetched (over a mesh the
    # layer functions run per group in shard_map and keep their in-line copies and backups).
    late_backup = mesh is None and defer_backup
    prefetch = shared_prefetch_mode(shared_prefetch, implementation) if late_backup else "off"
    deferred = dict(backup=False) if late_backup else {}
    start_at = prefetch_start_point() if prefetch == "ffi_stream" else "mlp"
    anchor, hits, misses, indexer_selected = None, [], [], []
    newest, prefetched = [], {}  # row[R, W] per layer; shared layer -> row[R, K, W] (or None)
    for l, layer in enumerate(model.layers):
        x = layer.input_layernorm(h)
        q_resid, query = layer.self_attn.queries(x, cos, sin)  # [R, Q], [R, H, W]
        new_row = layout.pack(*layer.self_attn.kv_row(x, cos, sin))  # row[R, W]
        newest.append(new_row)
        if layer.self_attn.indexer is not None:
            j = config.indexer_cache_index(l)
            override = None if topk is None else topk[j]
            index_keys, key_scales, selected, indexer_choice = _decode_indexer(
                layer, x, q_resid, cos, sin, index_keys, key_scales, j, positions, override, indexer_implementation
            )  # fmt: skip
            indexer_selected.append(jnp.sum(indexer_choice >= 0, axis=1, dtype=jnp.int32))
            shared = config.shared_layers_after(l)
            hook = {}
            if shared and start_at != "mlp":  # ffi_stream: start before the anchor's attention
                hook = dict(before_attention=_side_gather_starter(prefetched, shared if start_at == "attention" else shared[:1]))
            kv, out, anchor = attend_layer(kv, l, query, new_row, positions, selected, record_plan=bool(shared), **attend, **deferred, **hook)
            info = anchor
            if prefetch != "off" and not hook:  # the plan exists now: start every shared layer's copy
                for s in shared:  # `out` threads through: the anchor's o_proj + MLP run beside the copies
                    prefetched[s], out = prefetch_shared_rows(kv, s, anchor, implementation=implementation, mode=prefetch, tie=out)
            h = layer.finish(h, out)
        else:
            extra = dict(deferred, prefetched=prefetched.pop(l)) if prefetch != "off" else deferred
            following = l + 1 < config.num_layers and config.indexer_types[l + 1] == "shared"
            if start_at == "staggered" and following:  # the next shared layer's gather beside this attention
                extra = dict(extra, before_attention=_side_gather_starter(prefetched, (l + 1,)))
            kv, out, info = attend_shared(kv, l, query, new_row, positions, anchor, **attend, **extra)
            h = layer.finish(h, out)
        hits.append(info.num_hits)
        misses.append(info.num_misses)
    if late_backup:
        kv = backup_newest_rows(kv, newest, positions, implementation=implementation)
    kv = advance(kv, positions >= 0)
    cache = DecodeCache(kv, index_keys, key_scales)
    return cache, model.logits(h), StepTelemetry(jnp.stack(hits), jnp.stack(misses), jnp.stack(indexer_selected))


PREFETCH_START_ENV = "HISPARSE_PREFETCH_START"
PREFETCH_START_POINTS = ("staggered", "attention", "mlp")


def prefetch_start_point() -> str:
    """Where "ffi_stream" starts the shared layers' gathers ($HISPARSE_PREFETCH_START):
    "staggered" (default: the first before the anchor's attention, each next one before the
    previous shared layer's attention), "attention" (all before the anchor's attention), "mlp"
    (all after it, beside its o_proj + MLP). A gather beside an attention kernel slows it
    little; beside the MLP's cuBLAS GEMMs, whose blocks need whole multiprocessors, it slows
    them (H200: device hidden fraction 0.63-0.65 staggered, 0.45 attention, 0.40 mlp;
    docs/PERFORMANCE.md)."""
    point = os.environ.get(PREFETCH_START_ENV) or "staggered"
    if point not in PREFETCH_START_POINTS:
        raise ValueError(f"${PREFETCH_START_ENV} must be one of {PREFETCH_START_POINTS}, got {point!r}")
    return point


def _side_gather_starter(prefetched: dict, layers):
    """A before_attention hook that starts `layers`' side-stream gathers from the plan it is
    given, threading the query through each start, and files them in `prefetched`."""

    def start(state, plan, query):
        for s in layers:
            prefetched[s], query = state.start_side_prefetch(s, plan, query)
        return query

    return start


# ---- prefill --------------------------------------------------------------------------------------


def _prefill_layer(graphdef, params, h, anchor_topk, *, chunk, key_dtype):
    layer: DecoderLayer = nnx.merge(graphdef, params)
    return layer.prefill(h, anchor_topk, chunk=chunk, key_dtype=key_dtype)


def _store_index_keys(cache_keys, j, request, keys, key_scales, prompt_len):
    # cache_keys: (index_keys [J, R, C, I], index_key_scales f32[J, R, C or 0]); keys [Tp, I]
    # (fp8 with key_scales f32[Tp], or key_scales None): positions >= prompt_len are padding, dropped
    index_keys, index_key_scales = cache_keys
    positions = jnp.arange(keys.shape[0])
    target = jnp.where(positions < prompt_len, positions, index_keys.shape[2])
    return write_index_keys(index_keys, index_key_scales, j, request, target, keys, key_scales)


def padded_prompt_length(prompt_len: int, chunk: int) -> tuple[int, int]:
    """(Tp, chunk): prompts pad to a power of two up to `chunk`, then to a multiple of it, so
    prompt lengths share few compiled shapes."""
    if prompt_len <= chunk:
        padded = 1 << (prompt_len - 1).bit_length()
        return padded, padded
    return -(-prompt_len // chunk) * chunk, chunk


def resolved_shared_prefetch(parallel, implementation: str | None, shared_prefetch: str | None = None) -> str:
    """The prefetch mode a ModelRunner built with these arguments decodes with: "off" over a
    mesh (the layers run per group in shard_map), else attention_layer.shared_prefetch_mode's."""
    if parallel is not None and not parallel.is_single_device:
        return "off"
    return shared_prefetch_mode(shared_prefetch, implementation)


class ModelRunner:
    """A model split once into (graph, params) with its jitted prefill and decode functions.

    The decode step is jitted once with the cache donated; prefill compiles one function per
    distinct layer structure (dense/MoE x full/shared indexer) and padded prompt length.
    """

    def __init__(
        self,
        model: DSAForCausalLM,
        *,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        implementation: str | None = None,
        parallel: dp_sharding.ParallelConfig | None = None,
        kv_cache_dtype: str = "auto",
        shared_prefetch: str | None = None,
    ):
        """parallel: tensor / data-parallel-attention layout (hisparse_jax.sharding); None or a
        single-device config runs on the default device. kv_cache_dtype: the caches' format
        (create_cache; "fp8_e4m3": fp8 rows and indexer keys), also what prefill_kv hands over.
        shared_prefetch: decode_step's, resolved now (attention_layer.shared_prefetch_mode; "off"
        over a mesh), so the engine can count the rows it stages (DeviceFootprint)."""
        self.config = model.config
        self.dtype = model.dtype
        self.kv_cache_dtype = kv_cache_dtype
        self._key_dtype = index_key_dtype(kv_cache_dtype, model.dtype)  # refuses an unknown name now
        self.prefill_chunk = prefill_chunk
        self.implementation = implementation
        self.parallel = parallel
        self.mesh = None if parallel is None or parallel.is_single_device else parallel.make_mesh()
        self.shared_prefetch = resolved_shared_prefetch(parallel, implementation, shared_prefetch)
        self.graphdef, self.params = nnx.split(model)
        if self.mesh is not None:
            self.params = shard_params(self.params, self.mesh, parallel)
        # Per-layer views of the same parameter arrays, for the layer-by-layer prefill.
        self._layers = [(nnx.split(layer)[0], self.params["layers"][l]) for l, layer in enumerate(model.layers)]
        self._prefill_layer = jax.jit(_prefill_layer, static_argnames=("graphdef", "chunk", "key_dtype"))
        self._embed = jax.jit(lambda params, tokens: nnx.merge(self.graphdef, params).embed_tokens(tokens))
        self._logits = jax.jit(lambda params, h: nnx.merge(self.graphdef, params).logits(h))
        self._cache_fns = {}  # per KV state type: jits whose outputs keep the host pool pinned

    def device_footprint(self, hisparse: HiSparseConfig | None) -> DeviceFootprint:
        """The device bytes one request holds under `hisparse` (None: no offload), in this runner's
        cache format and prefetch mode: what the engine's admission counts. Raises ValueError
        for a hisparse config this model cannot run (top_k other than its index_topk)."""
        if hisparse is not None and hisparse.top_k != self.config.index_topk:
            raise ValueError(f"hisparse_config top_k ({hisparse.top_k}) must equal the model's index_topk ({self.config.index_topk})")
        return DeviceFootprint.of(self.config, self.dtype, hisparse, self.kv_cache_dtype, self.shared_prefetch)

    def _put(self, x, dtype, per_request: bool):
        """Host values in: split over the requests' mesh axis (per_request) or replicated."""
        x = jnp.asarray(x, dtype)
        if self.mesh is None:
            return x
        spec = P(dp_sharding.REQUEST_AXIS) if per_request else P()
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def _jitted(self, cache: DecodeCache) -> dict:
        kind = type(cache.kv)
        if kind not in self._cache_fns:
            kv_out = state_shardings(cache.kv)
            # Logits and telemetry: the default device alone, or wherever the mesh puts them.
            rest = memory.sharding(memory.DEVICE) if self.mesh is None else None
            store = functools.partial(store_prefill_rows, implementation=self.implementation)
            if self.mesh is not None:  # only the owning data-parallel group writes, into its own pool
                store = functools.partial(dp_sharding.store_prefill_rows, self.mesh, implementation=self.implementation)
            self._cache_fns[kind] = dict(
                begin=jax.jit(begin_request, donate_argnums=0, out_shardings=kv_out),
                store=jax.jit(store, donate_argnums=0, out_shardings=kv_out),
                store_keys=jax.jit(
                    _store_index_keys, donate_argnums=0, out_shardings=(cache.index_keys.sharding, cache.index_key_scales.sharding)
                ),
                move=jax.jit(move_request, donate_argnums=0, out_shardings=cache_shardings(cache)),
                decode=jax.jit(
                    functools.partial(
                        decode_step, self.graphdef, implementation=self.implementation, mesh=self.mesh, shared_prefetch=self.shared_prefetch
                    ),
                    donate_argnums=1,
                    out_shardings=(cache_shardings(cache), rest, rest),
                ),
            )
        return self._cache_fns[kind]

    def create_cache(self, *, num_requests: int, max_context: int, hisparse: HiSparseConfig | None = None, **kwargs) -> DecodeCache:
        """create_cache for this model, in the runner's kv_cache_dtype unless kwargs name another."""
        kwargs.setdefault("kv_cache_dtype", self.kv_cache_dtype)
        return create_cache(
            self.config, num_requests=num_requests, max_context=max_context, dtype=self.dtype, hisparse=hisparse,
            mesh=self.mesh, **kwargs,
        )  # fmt: skip

    def _prefill_layers(self, tokens: np.ndarray, key_dtype):
        """Runs the prompt i32[T] through every layer, yielding (layer, its PrefillOutput) in order:
        one layer's rows exist at a time. The last output's `hidden` feeds _last_logits. Indexer
        keys come out in key_dtype (fp8: with scales) and the prompt's top-k is scored on them."""
        T = tokens.shape[0]
        padded, chunk = padded_prompt_length(T, self.prefill_chunk)
        h = self._embed(self.params, self._put(np.pad(tokens, (0, padded - T)), jnp.int32, per_request=False))
        anchor = None
        for l, (graphdef, params) in enumerate(self._layers):
            out = self._prefill_layer(graphdef, params, h, anchor, chunk=chunk, key_dtype=np.dtype(key_dtype))
            yield l, out
            if out.index_keys is not None:
                anchor = out.topk
            h = out.hidden

    def _last_logits(self, last_out, prompt_len: int) -> jax.Array:
        """f32[V]: logits of the last prompt token, from the last layer's output."""
        return self._logits(self.params, last_out.hidden[prompt_len - 1])

    def prefill(self, cache: DecodeCache, request: int, tokens, *, host_pages=None) -> tuple[DecodeCache, jax.Array]:
        """Admits request slot `request` with prompt tokens i32[T] -> (cache, logits f32[V] of the
        last prompt token). host_pages: i32[P] (HiSparse only), the pages its positions use.

        Each layer's rows go to the host pool (direct-to-host) as soon as that layer is computed."""
        job = self.start_prefill(cache, request, tokens, host_pages=host_pages)
        cache = job.cache
        while not job.done:
            cache = job.advance(cache)
        return cache, job.logits

    def start_prefill(self, cache: DecodeCache, request: int, tokens, *, host_pages=None) -> "PrefillJob":
        """A prefill of prompt tokens i32[T] into slot `request` that runs one layer per
        PrefillJob.advance, so a serving engine can interleave it with decode steps. The slot is
        claimed now (job.cache holds it); it must stay out of decode steps until job.done."""
        return PrefillJob(self, cache, request, tokens, host_pages)

    def prefill_kv(self, tokens) -> "PrefilledKV":
        """A prefill instance's work (PD disaggregation): the prompt's KV rows and indexer keys of
        every layer and its last logits, with no decode cache. Rows are [Tp, W] per layer, Tp the
        padded prompt length (rows past the prompt are padding); keys in the runner's
        kv_cache_dtype (fp8: with their scales)."""
        tokens = np.asarray(tokens, np.int32)
        rows, keys, scales = [], [], []
        for _, out in self._prefill_layers(tokens, self._key_dtype):  # keeps rows and keys, not each layer's activations
            rows.append(out.rows)
            if out.index_keys is not None:
                keys.append(out.index_keys)
                if out.index_key_scales is not None:
                    scales.append(out.index_key_scales)
        return PrefilledKV(tuple(rows), tuple(keys), self._last_logits(out, tokens.shape[0]), tuple(scales))

    def admit_prefilled(self, cache: DecodeCache, request: int, prompt_len: int, kv: "PrefilledKV", *, host_pages=None) -> DecodeCache:
        """A decode instance admits a request whose KV a prefill instance computed: its rows go
        straight to the host pool (HiSparse) or the device KV, its indexer keys to the device
        (converted when the prefill instance's key format is not this cache's)."""
        state, cache_keys, fns = self._begin(cache, request, prompt_len, host_pages)
        T = jnp.int32(prompt_len)
        for l, rows in enumerate(kv.rows):
            state = fns["store"](state, jnp.int32(l), jnp.int32(request), jnp.int32(0), rows, T)
        for j, keys in enumerate(kv.index_keys):
            scales = kv.index_key_scales[j] if kv.index_key_scales else None
            cache_keys = fns["store_keys"](cache_keys, jnp.int32(j), jnp.int32(request), keys, scales, T)
        return DecodeCache(state, *cache_keys)

    def _begin(self, cache: DecodeCache, request: int, prompt_len: int, host_pages):
        """begin_request for a prompt of `prompt_len` tokens -> (kv state, (index_keys,
        index_key_scales), jitted fns)."""
        C = cache.index_keys.shape[2]
        if not 0 < prompt_len < C:
            raise ValueError(f"prompt of {prompt_len} tokens needs 0 < T < max_context ({C}): decoding appends to it")
        fns = self._jitted(cache)
        pages = None if host_pages is None else self._put(host_pages, jnp.int32, per_request=False)
        kv = fns["begin"](cache.kv, jnp.int32(request), jnp.int32(prompt_len), pages)
        return kv, (cache.index_keys, cache.index_key_scales), fns

    def move_request(self, cache: DecodeCache, source: int, target: int) -> DecodeCache:
        """move_request jitted with the cache donated (one compile for every pair of slots)."""
        return self._jitted(cache)["move"](cache, jnp.int32(source), jnp.int32(target))

    def decode_step(self, cache: DecodeCache, tokens, positions, topk=None) -> tuple[DecodeCache, jax.Array, StepTelemetry]:
        """decode_step jitted with the cache donated: tokens i32[b], positions i32[b] (-1 inactive)
        for slots 0 .. b - 1, b <= R; topk None or i32[J, b, K] (overrides the indexers'
        selection, see decode_step). Each distinct b compiles once."""
        if topk is not None and self.mesh is not None:
            topk = jax.device_put(topk, NamedSharding(self.mesh, P(None, dp_sharding.REQUEST_AXIS)))
        return self._jitted(cache)["decode"](
            self.params,
            cache,
            self._put(tokens, jnp.int32, per_request=True),
            self._put(positions, jnp.int32, per_request=True),
            topk,
        )


class PrefillJob:
    """One prompt's layer-by-layer prefill, resumable between decode steps.

    Each advance() computes one layer over the whole prompt (query-chunked) and stores its KV
    rows straight into the host pool (HiSparse) or the device KV, and its indexer keys; the
    hidden state between layers stays on the device. `slot` may change between advances (the
    engine's compaction moves the request; its stored rows and keys move with it). After the
    last layer, `logits` (f32[V], the last prompt token's) picks the first new token.
    """

    def __init__(self, runner: ModelRunner, cache: DecodeCache, slot: int, tokens, host_pages):
        self.runner, self.slot = runner, slot
        self.tokens = np.asarray(tokens, np.int32)  # i32[T]
        self.prompt_len = T = self.tokens.shape[0]
        kv, keys, self._fns = runner._begin(cache, slot, T, host_pages)
        self.cache = DecodeCache(kv, *keys)  # the cache with the slot claimed; thread it on
        self.padded_len = padded_prompt_length(T, runner.prefill_chunk)[0]  # tokens each layer computes
        self.layers_done = 0
        self.logits = None
        self._layers = runner._prefill_layers(self.tokens, cache.index_keys.dtype)

    @property
    def num_layers(self) -> int:
        return self.runner.config.num_layers

    @property
    def done(self) -> bool:
        return self.layers_done == self.num_layers

    def advance(self, cache: DecodeCache) -> DecodeCache:
        """Computes and stores the next layer -> the cache (donated: pass the latest one)."""
        if self.done:
            raise RuntimeError("this prefill is done")
        l, out = next(self._layers)
        fns, slot, T = self._fns, jnp.int32(self.slot), jnp.int32(self.prompt_len)
        kv = fns["store"](cache.kv, jnp.int32(l), slot, jnp.int32(0), out.rows, T)
        keys = (cache.index_keys, cache.index_key_scales)
        if out.index_keys is not None:
            j = self.runner.config.indexer_cache_index(l)
            keys = fns["store_keys"](keys, jnp.int32(j), slot, out.index_keys, out.index_key_scales, T)
        self.layers_done += 1
        if self.done:
            self.logits = self.runner._last_logits(out, self.prompt_len)
            self._layers.close()
        self.cache = None  # only the latest cache is valid: the caller threads it
        return DecodeCache(kv, *keys)


# ---- greedy generation ----------------------------------------------------------------------------


class GenerateOutput(NamedTuple):
    tokens: np.ndarray  # i32[B, N]: greedy tokens
    logits: np.ndarray  # f32[B, N, V]: the logits each token was chosen from
    num_hits: np.ndarray  # i32[N - 1, L, B]: per decode step (the first token comes from prefill)
    num_misses: np.ndarray  # i32[N - 1, L, B]


def generate(
    model: DSAForCausalLM | ModelRunner,
    prompts,
    max_new_tokens: int,
    *,
    hisparse: HiSparseConfig | None = None,
    page_size: int = 64,
    fill_value: float = 0.0,
    kv_cache_dtype: str | None = None,
) -> GenerateOutput:
    """Greedy decoding of prompts i32[B, T], one request slot per prompt; EOS does not stop it.
    kv_cache_dtype: the cache's format (create_cache); None: the runner's (a model: "auto").

    Raises models.inputs.InputError (a ValueError) for prompts the model cannot take: non-integer
    ids, ids outside the vocabulary, an empty array, T + max_new_tokens beyond
    max_position_embeddings, a HiSparse top_k other than the model's, prompts that do not split
    over the runner's data-parallel groups."""
    config = model.config
    max_new_tokens = inputs.check_max_new_tokens(max_new_tokens)
    prompts = inputs.check_prompts(prompts, config, max_new_tokens=max_new_tokens)
    inputs.check_hisparse(hisparse, config)
    runner = model if isinstance(model, ModelRunner) else ModelRunner(model, kv_cache_dtype=kv_cache_dtype or "auto")
    kv_cache_dtype = kv_cache_dtype or runner.kv_cache_dtype
    B, T = prompts.shape
    inputs.check_parallel(config, runner.parallel if runner.mesh is not None else None, num_requests=B, requests="prompts")
    max_context = T + max_new_tokens
    num_host_pages = None
    # With data-parallel attention each group pages its own block of the pool (page ids local to it).
    groups = 1 if runner.mesh is None else runner.mesh.shape[dp_sharding.REQUEST_AXIS]
    if hisparse is not None:
        num_host_pages = B * -(-max_context // page_size)
        allocators = [HostPageAllocator(num_host_pages // groups, page_size) for _ in range(groups)]
    cache = runner.create_cache(
        num_requests=B, max_context=max_context, hisparse=hisparse, num_host_pages=num_host_pages,
        page_size=page_size, fill_value=fill_value, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip

    first = []
    for b in range(B):
        pages = None
        if hisparse is not None:
            allocator = allocators[b // (B // groups)]
            pages = allocator.page_table_row(allocator.allocate(max_context), cache.kv.host_page_table.shape[1])
        cache, logits = runner.prefill(cache, b, prompts[b], host_pages=pages)
        first.append(logits)
    logits = jnp.stack(first)  # f32[B, V]
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out_tokens, out_logits, hits, misses = [tokens], [logits], [], []
    positions = jnp.full((B,), T, jnp.int32)
    for _ in range(max_new_tokens - 1):
        cache, logits, telemetry = runner.decode_step(cache, tokens, positions)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        positions = positions + 1
        out_tokens.append(tokens)
        out_logits.append(logits)
        hits.append(telemetry.num_hits)
        misses.append(telemetry.num_misses)
    L = runner.config.num_layers
    stack = lambda xs: np.stack(xs) if xs else np.zeros((0, L, B), np.int32)  # noqa: E731
    return GenerateOutput(
        np.stack(out_tokens, axis=1), np.stack(out_logits, axis=1).astype(np.float32), stack(hits), stack(misses)
    )


def decode_checkpoint(
    checkpoint: str | os.PathLike,
    prompts_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    max_new_tokens: int,
    dtype=jnp.bfloat16,
    hisparse: HiSparseConfig | None = None,
    kv_cache_dtype: str = "auto",
) -> families.DecodeOutput:
    """Loads a Hugging Face checkpoint, greedy-decodes the prompts of an .npz (`input_ids`
    int32 [B, T]) and writes `tokens` int32 [B, N] and `logits` float32 [B, N, V] to output_path
    (which must end in .npz: it is the file written). kv_cache_dtype: as create_cache's (DSA
    models; DeepSeek-V4 and MiniMax-M3 keep their caches in `dtype` and take "auto" only).

    The model family comes from config.json's model_type (models.families: deepseek_v32 /
    glm_moe_dsa, deepseek_v4, minimax_m3_vl_text / minimax_m3_vl), which picks the loader and the
    decode function (HiSparse on or off). Every input (config.json, the prompts against it,
    max_new_tokens, hisparse, the output path) is checked before the weights load
    (models.inputs.InputError); the output appears whole or not at all (written aside, then renamed)."""
    config = inputs.load_config(checkpoint)
    family = families.family_of_config(config)
    prompts = inputs.check_prompts(
        inputs.read_prompts(prompts_path), config, max_new_tokens=max_new_tokens, name=f"{os.fspath(prompts_path)} input_ids"
    )
    inputs.check_hisparse(hisparse, config)
    inputs.check_kv_cache_dtype(kv_cache_dtype, config, np.dtype(dtype).name)
    index_key_dtype(kv_cache_dtype, dtype)  # a ValueError for an unknown name, before the weights load
    output_path = inputs.check_output_path(output_path)
    out = family.decode(checkpoint, prompts, max_new_tokens, dtype=dtype, hisparse=hisparse, kv_cache_dtype=kv_cache_dtype)
    logging.info("decoded %s: %s (%s family), params %s", checkpoint, config.model_type, family.name, np.dtype(dtype).name)
    partial = f"{output_path}.partial-{os.getpid()}"
    try:
        with open(partial, "wb") as f:  # a file object: np.savez appends no suffix
            np.savez(f, tokens=out.tokens, logits=out.logits)
        os.replace(partial, output_path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    if out.num_misses is not None and np.size(out.num_misses):
        logging.info("hisparse: %d misses over %d decode steps", np.sum(out.num_misses), len(out.num_misses))
    return out
