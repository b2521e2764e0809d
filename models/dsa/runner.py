"""The serving runner of a DSA model: the decode step jitted with its cache donated, prompt
prefill layer by layer (direct-to-host), PD's prefill_kv / admit_prefilled, and the device
footprint admission counts. It implements models.common.runner's contract, what the serving
engine drives.

Prefill runs layer by layer over the whole prompt, query-chunked, and writes each layer's KV rows
with store_prefill_rows straight into the host pool (direct-to-host), so the decode state never
stages the full context on the device; only the layer being computed holds its rows.

Letters: as models.dsa.decoding's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hisparse_jax import memory
from hisparse_jax import sharding as dp_sharding
from hisparse_jax.attention_layer import shared_prefetch_mode
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.kv_cache_ops import begin_request, store_prefill_rows
from hisparse_jax.row_layout import KVRowLayout
from hisparse_jax.state import FullKVState, state_shardings
from models.common.layers import matmul_implementation
from models.common.parallel import shard_params
from models.common.runner import (
    DEFAULT_PREFILL_CHUNK,
    PrefillJob,
    StepResult,
    TokenFeed,
    fed_tokens,
    flat_params,
    padded_prompt_length,
    step_result,
    unflat_params,
)
from models.dsa.decoding import (
    DecodeCache,
    StepTelemetry,
    cache_shardings,
    create_cache,
    decode_step,
    move_request,
    write_index_keys,
)
from models.dsa.footprint import DeviceFootprint
from models.dsa.indexer import index_key_dtype
from models.dsa.model import DecoderLayer, DSAForCausalLM
from models.dsa.speculative import DraftState, SpeculativeStepOutput, prefill_draft, speculative_step


class PrefilledKV(NamedTuple):
    """One prompt's KV as a prefill instance hands it to a decode instance (PD disaggregation)."""

    rows: tuple  # row[Tp, W] per layer: KV rows of the (padded) prompt positions, stored as row_layout says
    index_keys: tuple  # [Tp, I] per full-indexer layer, in the prefill runner's key dtype
    logits: jax.Array  # f32[V]: logits of the last prompt token (they pick the first new token)
    index_key_scales: tuple = ()  # f32[Tp] per full-indexer layer with fp8 keys; () otherwise
    # How `rows` are stored: the prefill runner's kv_cache_dtype layout (fp8_e4m3: FlashMLA's 656 B
    # rows, quantised on the prefill side); None: their values [Tp, latent + rope]
    row_layout: KVRowLayout | None = None


def _prefill_layer(graphdef, params, h, anchor_topk, *, chunk, key_dtype, matmul=None):
    layer: DecoderLayer = nnx.merge(graphdef, params)
    with matmul_implementation(matmul):  # "reference" over a mesh (decoding.decode_step says why)
        return layer.prefill(h, anchor_topk, chunk=chunk, key_dtype=key_dtype)


def _store_index_keys(cache_keys, j, request, keys, key_scales, prompt_len):
    # cache_keys: (index_keys [J, R, C, I], index_key_scales f32[J, R, C or 0]); keys [Tp, I]
    # (fp8 with key_scales f32[Tp], or key_scales None): positions >= prompt_len are padding, dropped
    index_keys, index_key_scales = cache_keys
    positions = jnp.arange(keys.shape[0])
    target = jnp.where(positions < prompt_len, positions, index_keys.shape[2])
    return write_index_keys(index_keys, index_key_scales, j, request, target, keys, key_scales)


def _greedy_decode_step(step, treedef, params, cache, tokens, positions, topk=None, previous=None, src=None):
    """A whole engine decode step in one jit: the input tokens fed on the device (fed_tokens:
    previous i32[R], src i32[b]), `step` (decode_step, graphdef and keywords bound), the greedy
    tokens and summed counts -> (cache, logits f32[b, V], StepTelemetry, StepResult). params: the
    runner's leaves (flat_params) or an nnx.State."""
    cache, logits, telemetry = step(unflat_params(treedef, params), cache, fed_tokens(tokens, previous, src), positions, topk)
    return cache, logits, telemetry, step_result(logits, telemetry, cache.kv.num_requests)


def _cache_types(cache: DecodeCache) -> tuple:
    """What a jit keys a cache argument on: its tree and each leaf's shape, dtype and placement
    (a sharding carries the memory kind)."""
    leaves, treedef = jax.tree.flatten(cache)
    return treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)


def _prefill_draft_layer(graphdef, params, h_last, tokens, first_token, prompt_len, *, chunk, key_dtype):
    return prefill_draft(nnx.merge(graphdef, params), h_last, tokens, first_token, prompt_len, chunk=chunk, key_dtype=key_dtype)


class SpeculativeResult(NamedTuple):
    """What the engine reads back from a speculative step: a few bytes per slot."""

    tokens: jax.Array  # i32[b, Q]: the target's greedy tokens; the first num_accepted + 1 are the step's output
    num_accepted: jax.Array  # i32[b]: drafts accepted per slot
    hits: jax.Array  # i32[]: summed over layers (the MTP layer's too) and slots
    misses: jax.Array  # i32[]


def _speculative_step(step, treedef, params, cache, carry, committed, draft_override):
    """The jitted speculative step over slots 0 .. b - 1 (b = committed's length) with the carry
    of all R slots (DraftState of R rows: the step reads and rewrites its first b, so one carry
    serves every batch bucket) -> (cache, SpeculativeStepOutput (carry: all R), SpeculativeResult)."""
    b = committed.shape[0]
    cache, out = step(unflat_params(treedef, params), cache, jax.tree.map(lambda x: x[:b], carry), committed, draft_override)
    carry = jax.tree.map(lambda whole, new: whole.at[:b].set(new), carry, out.carry)
    result = SpeculativeResult(out.tokens, out.num_accepted, jnp.sum(out.num_hits, dtype=jnp.int32), jnp.sum(out.num_misses, dtype=jnp.int32))
    return cache, out._replace(carry=carry), result


def resolved_shared_prefetch(parallel, implementation: str | None, shared_prefetch: str | None = None) -> str:
    """The prefetch mode a ModelRunner built with these arguments decodes with: "off" over a
    mesh (the layers run per group in shard_map), else attention_layer.shared_prefetch_mode's."""
    if parallel is not None and not parallel.is_single_device:
        return "off"
    return shared_prefetch_mode(shared_prefetch, implementation)


# XLA options for a decode step without command buffers (CUDA graphs): SGLang's --disable-cuda-graph.
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}


@functools.cache  # one tuple per count: _step asks every step
def decode_copy_names(copies: int) -> tuple[str, ...]:
    """The jits k copies of a decode program run as, in turn: "decode" itself first."""
    return ("decode",) + tuple(f"decode_copy{i}" for i in range(1, copies))


class DecodeGraphs(NamedTuple):
    """How one engine's decode step is compiled (ModelRunner's arguments of the same names)."""

    compiler_options: dict  # jax.jit compiler_options of the decode step
    cuda_graph_max_bs: int | None  # buckets of more slots: the same step without command buffers
    program_copies: int  # compiled copies of each graph-keeping program, run in turn

    def keeps_graphs(self, b: int) -> bool:
        """Whether the b-slot step compiles with these options (else without command buffers)."""
        return self.cuda_graph_max_bs is None or b <= self.cuda_graph_max_bs

    def copies_for(self, b: int) -> int:
        """The copies a b-slot step runs in turn (one where it keeps no graphs)."""
        return self.program_copies if self.keeps_graphs(b) else 1


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
        speculative=None,
        decode_compiler_options: dict | None = None,
        hisparse_decode_compiler_options: dict | None = None,
        cuda_graph_max_bs: int | None = None,
        decode_program_copies: int = 1,
        hisparse_cuda_graph_max_bs: int | None = None,
        hisparse_decode_program_copies: int | None = None,
    ):
        """parallel: tensor / data-parallel-attention layout (hisparse_jax.sharding); None or a
        single-device config runs on the default device. kv_cache_dtype: the caches' format
        (create_cache; "fp8_e4m3": fp8 rows and indexer keys), also what prefill_kv hands over.
        shared_prefetch: decode_step's, resolved now (attention_layer.shared_prefetch_mode; "off"
        over a mesh), so the engine can count the rows it stages (DeviceFootprint).
        speculative: a configs.speculative.SpeculativeConfig to decode with the model's MTP layer
        (models.dsa.speculative; speculative_step): caches then hold the MTP layer's KV too and
        prefill ends with it. One device only. decode_compiler_options: XLA options for the decode
        step's compile alone (jax.jit compiler_options), e.g. its command-buffer update mode.
        hisparse_decode_compiler_options: the same for caches with HiSparse alone (None: as
        decode_compiler_options). At 61 layers HiSparse's step runs faster without command
        buffers ({"xla_gpu_enable_command_buffer": ""}) and the dense step slower (docs/PERFORMANCE.md,
        2026-12-04 eleventh session), so the two engines can differ. cuda_graph_max_bs: SGLang's
        --cuda-graph-max-bs: decode steps of more than this many slots (the batch bucket b) compile
        without command buffers, those up to it as above (None: every bucket as above). At
        131,072 tokens HiSparse's c = 1 step was faster with graphs and its 20-request step without.
        decode_program_copies: k > 1 compiles each decode program that keeps its graphs k times
        and runs the copies in turn, so each copy's CUDA graph meets the buffers of every k-th
        step. XLA re-records a graph on every run whose buffers moved (at 61 layers 10-32 ms a
        step at c = 1); under the overlap schedule a step's fresh buffers (inputs, outputs, temp)
        may alternate between two places, and then 2 copies would each see the same ones every
        time. With two, the baseline's c = 1 graph stopped re-recording on the H200 and HiSparse's
        did not (docs/PERFORMANCE.md, twelfth session); k x the compiles.
        hisparse_cuda_graph_max_bs, hisparse_decode_program_copies: the same for caches with
        HiSparse alone (None: as the two above), so one run can give each engine the setting it
        was measured fastest in (DeepSeek-V3.2's rank: HiSparse with graphs at c = 1 only, the
        baseline with graphs at every bucket)."""
        if speculative is not None:
            if model.mtp is None:
                raise ValueError("speculative decoding needs the model's MTP layer (num_nextn_predict_layers = 0 here)")
            if parallel is not None and not parallel.is_single_device:
                raise ValueError("speculative decoding runs on one device (no tensor / data-parallel mesh) yet")
        for name, value in (("cuda_graph_max_bs", cuda_graph_max_bs), ("hisparse_cuda_graph_max_bs", hisparse_cuda_graph_max_bs)):
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
        for name, value in (("decode_program_copies", decode_program_copies), ("hisparse_decode_program_copies", hisparse_decode_program_copies)):
            if (value is not None or name == "decode_program_copies") and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.dense_graphs = DecodeGraphs(dict(decode_compiler_options or {}), cuda_graph_max_bs, decode_program_copies)
        self.hisparse_graphs = DecodeGraphs(  # each None: the dense step's
            self.dense_graphs.compiler_options if hisparse_decode_compiler_options is None else dict(hisparse_decode_compiler_options),
            cuda_graph_max_bs if hisparse_cuda_graph_max_bs is None else hisparse_cuda_graph_max_bs,
            decode_program_copies if hisparse_decode_program_copies is None else hisparse_decode_program_copies,
        )
        self._turn = {}  # (cache kind, b) -> the decode copy that ran last
        # A models.common.buffer_addresses.BufferAddressLog to fill (bench_serving --log_buffer_addresses)
        self.buffer_addresses = None
        self.speculative = speculative
        self.config = model.config
        self.dtype = model.dtype
        self.kv_cache_dtype = kv_cache_dtype
        self._key_dtype = index_key_dtype(kv_cache_dtype, model.dtype)  # refuses an unknown name now
        # How this runner's caches store a KV row (prefill_kv ships rows in it too)
        self.row_layout = KVRowLayout.for_kv_cache_dtype(self.config.kv_lora_rank, self.config.qk_rope_head_dim, model.dtype, kv_cache_dtype)
        self._to_stored = jax.jit(self.row_layout.to_stored)
        self.prefill_chunk = prefill_chunk
        self.implementation = implementation
        self.parallel = parallel
        self.mesh = None if parallel is None or parallel.is_single_device else parallel.make_mesh()
        self.shared_prefetch = resolved_shared_prefetch(parallel, implementation, shared_prefetch)
        self.host_memory_kind = memory.host_pool_kind(implementation)  # pinned_host but for TPU interpret mode
        self.graphdef, self.params = nnx.split(model)
        if self.mesh is not None:
            self.params = shard_params(self.params, self.mesh, parallel)
        self._param_leaves, self._param_treedef = flat_params(self.params)  # what each decode step is handed
        self._zeros = {}  # R -> i32[R] where the step's tokens live (_no_tokens)
        # Per-layer views of the same parameter arrays, for the layer-by-layer prefill.
        self._layers = [(nnx.split(layer)[0], self.params["layers"][l]) for l, layer in enumerate(model.layers)]
        self._prefill_layer = jax.jit(
            functools.partial(_prefill_layer, matmul=None if self.mesh is None else "reference"), static_argnames=("graphdef", "chunk", "key_dtype")
        )
        self._prefill_draft = jax.jit(
            functools.partial(_prefill_draft_layer, self.graphdef), static_argnames=("chunk", "key_dtype")
        )  # the MTP layer over a prompt (speculative runners)
        self._embed = jax.jit(lambda params, tokens: nnx.merge(self.graphdef, params).embed_tokens(tokens))
        self._logits = jax.jit(lambda params, h: nnx.merge(self.graphdef, params).logits(h))
        self._cache_fns = {}  # per KV state tree: jits whose outputs keep the host pool pinned
        self._handed_on = {}  # per cache's types (_cache_types): the types a decode step returns it in (decode_programs)

    def device_footprint(self, hisparse: HiSparseConfig | None) -> DeviceFootprint:
        """The device bytes one request holds under `hisparse` (None: no offload), in this runner's
        cache format and prefetch mode: what the engine's admission counts. Raises ValueError
        for a hisparse config this model cannot run (top_k other than its index_topk)."""
        if hisparse is not None and hisparse.top_k != self.config.index_topk:
            raise ValueError(f"hisparse_config top_k ({hisparse.top_k}) must equal the model's index_topk ({self.config.index_topk})")
        return DeviceFootprint.of(self.config, self.dtype, hisparse, self.kv_cache_dtype, self.shared_prefetch, self.speculative)

    def _put(self, x, dtype, per_request: bool):
        """Host values in: split over the requests' mesh axis (per_request) or replicated."""
        x = jnp.asarray(x, dtype)
        if self.mesh is None:
            return x
        spec = P(dp_sharding.REQUEST_AXIS) if per_request else P()
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def _jitted(self, cache: DecodeCache) -> dict:
        # The state's type and static fields (layout, launch shapes, miss_read): the output
        # shardings below are a prefix of exactly that tree, so a state differing in any of them
        # gets its own jits (a HiSparseConfig with another miss_read is another tree).
        kind = jax.tree.structure(cache.kv)
        if kind not in self._cache_fns:
            graphs = self.decode_graphs(cache)
            options = graphs.compiler_options
            decode = functools.partial(
                decode_step, self.graphdef, implementation=self.implementation, mesh=self.mesh, shared_prefetch=self.shared_prefetch
            )
            graph_options = {"compiler_options": options} if options else {}
            kv_out = state_shardings(cache.kv)
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
                decode=self.jit_decode(cache, decode, **graph_options),
            )
            for name in decode_copy_names(graphs.program_copies)[1:]:  # a distinct function each: its own compile and graph
                self._cache_fns[kind][name] = self.jit_decode(cache, functools.partial(decode), **graph_options)
            if graphs.cuda_graph_max_bs is not None:  # the buckets above it: the same step, no graphs
                self._cache_fns[kind]["decode_without_graphs"] = self.jit_decode(
                    cache, decode, compiler_options={**options, **NO_COMMAND_BUFFERS}
                )
            if self.speculative is not None:
                step = functools.partial(
                    speculative_step, self.graphdef, num_steps=self.speculative.num_steps, implementation=self.implementation
                )
                device = memory.sharding(memory.DEVICE)
                self._cache_fns[kind]["speculative"] = jax.jit(
                    functools.partial(_speculative_step, step, self._param_treedef), donate_argnums=1,
                    out_shardings=(cache_shardings(cache), device, device),
                )  # fmt: skip
        return self._cache_fns[kind]

    def decode_graphs(self, cache: DecodeCache) -> DecodeGraphs:
        """How this cache's decode step is compiled: hisparse_graphs for a HiSparse cache."""
        return self.dense_graphs if isinstance(cache.kv, FullKVState) else self.hisparse_graphs

    def decode_program_copies_for(self, cache: DecodeCache, b: int) -> int:
        """How many compiled copies of the b-slot decode program this cache's steps run in turn
        (the engine runs each once to compile them all)."""
        return self.decode_graphs(cache).copies_for(b)

    def _result_shardings(self) -> StepResult:
        """Where a step's StepResult lives: the tokens where the next step takes `previous` from
        (split over the requests with a mesh), so every step compiles once whoever fed the last."""
        if self.mesh is None:
            device = memory.sharding(memory.DEVICE)
            return StepResult(device, device, device)
        whole = NamedSharding(self.mesh, P())
        return StepResult(NamedSharding(self.mesh, P(dp_sharding.REQUEST_AXIS)), whole, whole)

    def jit_decode(self, cache: DecodeCache, step, **options):
        """`step` (decode_step with its graphdef and keywords bound) jitted as the engine runs it
        (_greedy_decode_step): the cache donated and kept where it is, params as leaves, tokens fed,
        greedy tokens and counts out of the same jit. options: more jax.jit arguments."""
        # Logits and telemetry: the default device alone, or wherever the mesh puts them.
        rest = memory.sharding(memory.DEVICE) if self.mesh is None else None
        return jax.jit(
            functools.partial(_greedy_decode_step, step, self._param_treedef),
            donate_argnums=1,
            out_shardings=(cache_shardings(cache), rest, rest, self._result_shardings()),
            **options,
        )

    def _no_tokens(self, num_slots: int) -> jax.Array:
        """i32[R] zeros where a step's tokens live: `previous` when nothing is fed."""
        if num_slots not in self._zeros:
            self._zeros[num_slots] = jax.device_put(np.zeros(num_slots, np.int32), self._result_shardings().next_tokens)
        return self._zeros[num_slots]

    def create_cache(self, *, num_requests: int, max_context: int, hisparse: HiSparseConfig | None = None, **kwargs) -> DecodeCache:
        """create_cache for this model, in the runner's kv_cache_dtype unless kwargs name another."""
        kwargs.setdefault("kv_cache_dtype", self.kv_cache_dtype)
        kwargs.setdefault("host_memory_kind", self.host_memory_kind)
        if self.speculative is not None:  # the MTP layer's KV and the speculative slots
            kwargs.update(draft_layers=1, speculative_slots=self.speculative.tokens_per_step)
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

    def start_prefill(self, cache: DecodeCache, request: int, tokens, *, host_pages=None) -> "LayerwisePrefill":
        """A prefill of prompt tokens i32[T] into slot `request` that runs one layer per
        LayerwisePrefill.advance, so a serving engine can interleave it with decode steps. The slot is
        claimed now (job.cache holds it); it must stay out of decode steps until job.done."""
        return LayerwisePrefill(self, cache, request, tokens, host_pages)

    def prefill_kv(self, tokens) -> "PrefilledKV":
        """A prefill instance's work (PD disaggregation): the prompt's KV rows and indexer keys of
        every layer and its last logits, with no decode cache. Rows are [Tp, W] per layer, Tp the
        padded prompt length (rows past the prompt are padding), stored in the runner's
        kv_cache_dtype layout (fp8_e4m3: the 656 B rows, quantised here, so the hand-over moves
        what the decode side stores); keys in that kv_cache_dtype too (fp8: with their scales)."""
        if self.speculative is not None:
            raise ValueError("speculative decoding does not run with PD disaggregation yet")
        tokens = np.asarray(tokens, np.int32)
        rows, keys, scales = [], [], []
        for _, out in self._prefill_layers(tokens, self._key_dtype):  # keeps rows and keys, not each layer's activations
            rows.append(self._to_stored(out.rows))
            if out.index_keys is not None:
                keys.append(out.index_keys)
                if out.index_key_scales is not None:
                    scales.append(out.index_key_scales)
        return PrefilledKV(tuple(rows), tuple(keys), self._last_logits(out, tokens.shape[0]), tuple(scales), self.row_layout)

    def admit_prefilled(self, cache: DecodeCache, request: int, prompt_len: int, kv: "PrefilledKV", *, host_pages=None) -> DecodeCache:
        """A decode instance admits a request whose KV a prefill instance computed: its rows go
        straight to the host pool (HiSparse) or the device KV, its indexer keys to the device
        (converted when the prefill instance's key or row format is not this cache's)."""
        state, cache_keys, fns = self._begin(cache, request, prompt_len, host_pages)
        T = jnp.int32(prompt_len)
        for l, rows in enumerate(kv.rows):
            if kv.row_layout is not None and kv.row_layout != state.layout:  # e.g. fp8 rows, a bf16 cache
                rows = self._row_values(kv.row_layout, rows)
            state = fns["store"](state, jnp.int32(l), jnp.int32(request), jnp.int32(0), rows, T)
        for j, keys in enumerate(kv.index_keys):
            scales = kv.index_key_scales[j] if kv.index_key_scales else None
            cache_keys = fns["store_keys"](cache_keys, jnp.int32(j), jnp.int32(request), keys, scales, T)
        return DecodeCache(state, *cache_keys)

    @staticmethod
    def _row_values(layout: KVRowLayout, rows: jax.Array) -> jax.Array:
        """Rows stored in another runner's `layout` -> their values f32[Tp, latent + rope] on the
        device (the store packs them in this cache's layout)."""
        latent, rope = layout.unpack(jax.device_put(rows, memory.sharding(memory.DEVICE)))
        return jnp.concatenate([latent, rope], axis=-1)

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

    def speculative_step(self, cache: DecodeCache, carry: DraftState, committed, draft_override=None) -> tuple[DecodeCache, SpeculativeStepOutput]:
        """models.dsa.speculative.speculative_step jitted with the cache donated: carry (DraftState
        of R slots, or of b), committed i32[b] (seq_lens of slots 0 .. b - 1, -1 inactive),
        draft_override None or i32[b, C] -> (cache, SpeculativeStepOutput, its carry shaped as
        given). One compile per b."""
        cache, out, _ = self._speculative(cache, carry, committed, draft_override)
        return cache, out

    def speculative_greedy_step(self, cache: DecodeCache, carry: DraftState, committed) -> tuple[DecodeCache, SpeculativeResult, DraftState]:
        """speculative_step as the engine runs it -> (cache, SpeculativeResult: what the host reads,
        the carry of all R slots, on the device)."""
        cache, out, result = self._speculative(cache, carry, committed, None)
        return cache, result, out.carry

    def empty_draft_state(self, num_slots: int) -> DraftState:
        """A DraftState of `num_slots` free slots (zeros), where each request's prefill puts its own."""
        D = self.config.hidden_size
        empty = DraftState(jnp.zeros(num_slots, jnp.int32), jnp.zeros(num_slots, jnp.int32), jnp.zeros((num_slots, D), self.dtype))
        # Placed where the speculative step leaves its carry: an unplaced first carry compiled the step twice.
        return jax.device_put(empty, memory.sharding(memory.DEVICE))

    def _speculative(self, cache, carry, committed, draft_override):
        if self.speculative is None:
            raise ValueError("this runner was built without speculative=SpeculativeConfig(...)")
        override = None if draft_override is None else jnp.asarray(draft_override, jnp.int32)
        return self._jitted(cache)["speculative"](self._param_leaves, cache, carry, jnp.asarray(committed, jnp.int32), override)

    def move_request(self, cache: DecodeCache, source: int, target: int) -> DecodeCache:
        """move_request jitted with the cache donated (one compile for every pair of slots)."""
        return self._jitted(cache)["move"](cache, jnp.int32(source), jnp.int32(target))

    def decode_step(self, cache: DecodeCache, tokens, positions, topk=None) -> tuple[DecodeCache, jax.Array, StepTelemetry]:
        """decode_step jitted with the cache donated: tokens i32[b], positions i32[b] (-1 inactive)
        for slots 0 .. b - 1, b <= R; topk None or i32[J, b, K] (overrides the indexers'
        selection, see decode_step) -> (cache, logits f32[b, V], telemetry). Each distinct b
        compiles once, the same function as greedy_step's."""
        cache, logits, telemetry, _ = self._step(cache, tokens, positions, topk, None)
        return cache, logits, telemetry

    def greedy_step(self, cache: DecodeCache, tokens, positions, topk=None, feed: TokenFeed | None = None) -> tuple[DecodeCache, jax.Array, StepResult]:
        """decode_step as the engine runs it, one dispatch: feed says where the input tokens come
        from (TokenFeed: the last step's tokens on the device, per slot; None: all from `tokens`)
        -> (cache, logits f32[b, V], StepResult: greedy tokens i32[R] and summed counts)."""
        cache, logits, _, result = self._step(cache, tokens, positions, topk, feed)
        return cache, logits, result

    def _program(self, cache: DecodeCache, b: int, turn: int | None) -> tuple:
        """(the jitted b-slot decode program, its copy number or "no graphs") for copy `turn`
        (None: the next in turn, which advances it)."""
        fns = self._jitted(cache)
        graphs = self.decode_graphs(cache)
        if not graphs.keeps_graphs(b):
            return fns["decode_without_graphs"], "no graphs"
        if turn is None:  # the copies in turn, per cache kind and bucket (one copy: always "decode")
            key = (id(fns), b)  # fns: this cache kind's jits
            turn = self._turn[key] = (self._turn.get(key, -1) + 1) % graphs.program_copies
        return fns[decode_copy_names(graphs.program_copies)[turn]], turn

    def _inputs(self, cache: DecodeCache, tokens, positions, topk, feed: TokenFeed | None) -> tuple:
        """A step's inputs after the params and the cache, on the device as its program takes them:
        (tokens i32[b], positions i32[b], topk, previous i32[R], src i32[b])."""
        if topk is not None and self.mesh is not None:
            topk = jax.device_put(topk, NamedSharding(self.mesh, P(None, dp_sharding.REQUEST_AXIS)))
        previous = None if feed is None else feed.previous
        src = np.full(len(tokens), -1, np.int32) if feed is None else feed.src  # i32[b]: -1, the host's token
        return (
            self._put(tokens, jnp.int32, per_request=True),
            self._put(positions, jnp.int32, per_request=True),
            topk,
            self._no_tokens(cache.kv.num_requests) if previous is None else previous,
            self._put(src, jnp.int32, per_request=True),
        )

    def decode_programs(self, cache: DecodeCache, b: int, topk=None) -> list:
        """Every compiled copy of the b-slot decode step, lowered (jax.stages.Lowered) with the
        inputs a step of b inactive slots would take (topk: i32[J, b, K], the SYNTHETIC selection
        each step will pass, or None). Their .compile() fills the same jit caches a step reads, so
        the engine compiles them side by side (Engine.compile_decode_programs) and the steps compile nothing."""
        if self.speculative is not None:  # the speculative step: compiled by its first run
            return []
        tokens, positions = np.zeros(b, np.int32), np.full(b, -1, np.int32)  # i32[b]: all inactive
        inputs = self._inputs(cache, tokens, positions, topk, None)
        programs = [self._program(cache, b, turn)[0] for turn in range(self.decode_program_copies_for(cache, b))]
        key = _cache_types(cache)  # engines of other slot counts share this runner: shapes in the key
        if key not in self._handed_on:
            # The cache's types as a step hands it on, which every step after the first takes: a
            # fresh host pool is typed in host memory, and one a GPU kernel wrote (the synthetic
            # fill's, a step's) in device memory though it stays pinned_host; the compile is keyed
            # on the type. One more trace of the step, once per cache shape and kind.
            self._handed_on[key] = jax.eval_shape(programs[0], self._param_leaves, cache, *inputs)[0]
        return [program.lower(self._param_leaves, self._handed_on[key], *inputs) for program in programs]

    def _step(self, cache: DecodeCache, tokens, positions, topk, feed: TokenFeed | None):
        step, turn = self._program(cache, len(tokens), None)
        inputs = self._inputs(cache, tokens, positions, topk, feed)
        out = step(self._param_leaves, cache, *inputs)
        if self.buffer_addresses is not None:  # what moved since this program's last run (not the donated cache)
            kind = "baseline" if isinstance(cache.kv, FullKVState) else "hisparse"
            named_inputs = dict(zip(("tokens", "positions", "topk", "previous", "src"), inputs))
            self.buffer_addresses.record((kind, len(tokens), turn), named_inputs, dict(logits=out[1], telemetry=out[2], result=out[3]))
        return out


class LayerwisePrefill(PrefillJob):
    """One prompt's layer-by-layer prefill, resumable between decode steps.

    Each advance() computes one layer over the whole prompt (query-chunked) and stores its KV
    rows straight into the host pool (HiSparse) or the device KV, and its indexer keys; the
    hidden state between layers stays on the device. `slot` may change between advances (the
    engine's compaction moves the request; its stored rows and keys move with it). After the
    last layer, `logits` (f32[V], the last prompt token's) picks the first new token.

    A speculative runner's prefill has one more advance, the MTP layer over the prompt (its KV
    and keys stored like a layer's; models.dsa.speculative.prefill_draft), after which `draft`
    holds the request's DraftState (bonus i32[], draft i32[], hidden [D]): the first token
    (argmax of `logits`), the MTP layer's proposal after it, and the hidden that proposed it.
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
        self.draft = None  # DraftState of this request once a speculative prefill is done
        self._last_hidden = None  # [Tp, D]: the last layer's output, for the MTP layer
        self._layers = runner._prefill_layers(self.tokens, cache.index_keys.dtype)

    @property
    def num_layers(self) -> int:
        return self.runner.config.num_layers + (self.runner.speculative is not None)

    def advance(self, cache: DecodeCache) -> DecodeCache:
        """Computes and stores the next layer -> the cache (donated: pass the latest one)."""
        if self.done:
            raise RuntimeError("this prefill is done")
        if self.layers_done == self.runner.config.num_layers:  # a speculative runner's MTP layer
            return self._advance_draft(cache)
        l, out = next(self._layers)
        fns, slot, T = self._fns, jnp.int32(self.slot), jnp.int32(self.prompt_len)
        kv = fns["store"](cache.kv, jnp.int32(l), slot, jnp.int32(0), out.rows, T)
        keys = (cache.index_keys, cache.index_key_scales)
        if out.index_keys is not None:
            j = self.runner.config.indexer_cache_index(l)
            keys = fns["store_keys"](keys, jnp.int32(j), slot, out.index_keys, out.index_key_scales, T)
        self.layers_done += 1
        if self.layers_done == self.runner.config.num_layers:  # the model's last layer
            self.logits = self.runner._last_logits(out, self.prompt_len)
            self._layers.close()
            if self.runner.speculative is not None:
                self._last_hidden = out.hidden
        self.cache = None  # only the latest cache is valid: the caller threads it
        return DecodeCache(kv, *keys)

    def _advance_draft(self, cache: DecodeCache) -> DecodeCache:
        """The MTP layer over the prompt, stored as kv layer L and key row J."""
        runner, fns = self.runner, self._fns
        first = jnp.argmax(self.logits).astype(jnp.int32)  # x_T, as the caller will choose it
        tokens = runner._put(np.pad(self.tokens, (0, self.padded_len - self.prompt_len)), jnp.int32, per_request=False)
        chunk = padded_prompt_length(self.prompt_len, runner.prefill_chunk)[1]
        out, draft, hidden = runner._prefill_draft(
            runner.params, self._last_hidden, tokens, first, jnp.int32(self.prompt_len), chunk=chunk,
            key_dtype=np.dtype(cache.index_keys.dtype),
        )  # fmt: skip
        slot, T, config = jnp.int32(self.slot), jnp.int32(self.prompt_len), runner.config
        kv = fns["store"](cache.kv, jnp.int32(config.num_layers), slot, jnp.int32(0), out.rows, T)
        keys = fns["store_keys"]((cache.index_keys, cache.index_key_scales), jnp.int32(len(config.full_indexer_layers)), slot,
                                 out.index_keys, out.index_key_scales, T)  # fmt: skip
        self.draft = DraftState(first, draft, hidden)
        self.layers_done += 1
        self._last_hidden = None
        return DecodeCache(kv, *keys)
