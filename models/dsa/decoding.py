"""Decoding a DSA model (DeepSeek-V3.2, GLM-5.x): the model-level cache and the decode step.

Letters: L layers, J full-indexer layers, R request slots, C max context, T prompt tokens,
Tp padded prompt tokens, D hidden, I index_head_dim, K top-k entries, W KV row width, V vocab,
N generated tokens, B prompts.

Per layer of a decode step (docs/architecture.md): MLA projections of the new token -> its KV
row and indexer key -> indexer top-k over the request's whole context (keys stay on the device)
-> hisparse_jax.attention_layer, which swaps the selected rows in and attends (or, with a
FullKVState, attends over the on-device KV) -> W_UV, o_proj, MLP. The cache's KV state type
alone selects HiSparse or no offload: the model code is the same. The jitted, cache-donating
step and prefill are models.dsa.runner.ModelRunner's; greedy generation is models.dsa.generate.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from configs.model import DSAModelConfig
from hisparse_jax import memory
from hisparse_jax import sharding as dp_sharding
from hisparse_jax.attention_layer import attention_layer, prefetch_shared_rows, shared_attention_layer, shared_prefetch_mode
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.kv_cache_ops import advance, backup_newest_rows
from hisparse_jax.kv_cache_ops import move_request as kv_move_request
from hisparse_jax.paged_state import PagedHiSparseState
from hisparse_jax.row_layout import KVRowLayout
from hisparse_jax.state import FullKVState, HiSparseState, state_shardings
from models.common import rope
from models.common.layers import current_matmul_implementation, matmul_implementation
from models.dsa.indexer import decode_topk, dequantize_keys, index_key_dtype, is_fp8, quantize_keys
from models.dsa.model import DecoderLayer, DSAForCausalLM


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeCache:
    """Everything the model keeps between decode steps."""

    kv: HiSparseState | PagedHiSparseState | FullKVState  # MLA KV rows of every layer; its type picks HiSparse or no offload
    index_keys: jax.Array  # [J, R, C, I]: indexer key of every stored position, per full-indexer layer
    # f32[J, R, C]: each fp8 key's scale (models.dsa.indexer.quantize_keys); f32[J, R, 0] (no bytes)
    # when the keys are not fp8, so the cache's pytree is the same whatever the key format.
    index_key_scales: jax.Array


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
    host_memory_kind: str | None = None,
    draft_layers: int = 0,
    speculative_slots: int = 0,
) -> DecodeCache:
    """An empty cache for `num_requests` slots of up to `max_context` tokens; KV rows in `dtype`.

    kv_cache_dtype (SGLang's --kv-cache-dtype): "auto" (the model dtype `dtype`), "bfloat16",
    "float32" or "fp8_e4m3": how KV rows (KVRowLayout.for_kv_cache_dtype) and indexer keys are
    stored (fp8 keys: I fp8_e4m3 values + one f32 scale per key, index_key_scales).
    hisparse None keeps every row on the device (FullKVState). fill_value initialises unwritten
    rows (tests pass NaN so any stray read shows). With a mesh every request-indexed array is
    split over its "dp" axis (hisparse_jax.sharding). host_memory_kind: where the HiSparse host
    pool lives (None: pinned_host; memory.host_pool_kind for the kernels that will run).

    Speculative decoding (models.dsa.speculative): draft_layers MTP layers get a KV layer each
    after the model's (kv layer num_layers + i, sharing the request's host pages) and an indexer
    key row each after the full layers' (J + i); speculative_slots: the HiSparse state's
    (hisparse_jax.speculative; no offload needs none).
    """
    layout = KVRowLayout.for_kv_cache_dtype(config.kv_lora_rank, config.qk_rope_head_dim, dtype, kv_cache_dtype)
    num_layers = config.num_layers + draft_layers
    if hisparse is None:
        kv = FullKVState.create(
            num_layers=num_layers, num_requests=num_requests, max_context=max_context,
            layout=layout, fill_value=fill_value, mesh=mesh,
        )  # fmt: skip
    else:
        if hisparse.top_k != config.index_topk:
            raise ValueError(
                f"hisparse_config top_k ({hisparse.top_k}) must equal the model's index_topk ({config.index_topk})"
            )
        # Dynamic residency needs device rows that pass between requests: a paged pool.
        state_class = HiSparseState if hisparse.dynamic_residency is None else PagedHiSparseState
        slots = dict(speculative_slots=speculative_slots) if speculative_slots else {}
        kv = state_class.create(
            num_layers=num_layers, num_requests=num_requests, max_context=max_context, config=hisparse,
            layout=layout, num_host_pages=num_host_pages, page_size=page_size, fill_value=fill_value, mesh=mesh,
            host_memory_kind=host_memory_kind, **slots,
        )  # fmt: skip
    placement = None if mesh is None else NamedSharding(mesh, P(None, dp_sharding.REQUEST_AXIS))
    J, key_dtype = len(config.full_indexer_layers) + draft_layers, index_key_dtype(kv_cache_dtype, dtype)
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
    q, w = indexer.queries(x, q_resid, cos, sin, index_keys.dtype)  # [b, G, I] (f8 with w8a8 over fp8 keys), f32[b, G]
    # Scored over the key cache in place (slots 0 .. b - 1 of layer j), each slot up to its own
    # position; on GPU a fused scoring kernel and a top-k kernel (models.dsa.indexer.decode_topk).
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
    (the engine's labelled synthetic selection, serving.synthetic_selection); entries must
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
    layers keep their in-line replay and per-layer backup, and the MoE and fp8 matmuls their
    XLA reference (partitioned over the mesh; models.common.layers.matmul_implementation).
    """
    matmul = "reference" if mesh is not None else current_matmul_implementation()
    with matmul_implementation(matmul):
        return _decode_step(
            graphdef, params, cache, tokens, positions, topk, implementation=implementation, mesh=mesh,
            shared_prefetch=shared_prefetch, defer_backup=defer_backup,
        )  # fmt: skip


def _decode_step(graphdef, params, cache, tokens, positions, topk, *, implementation, mesh, shared_prefetch, defer_backup):
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
            with jax.named_scope("indexer"):  # scope names: where a profile's kernels belong (benchmarks/step_split.py)
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
