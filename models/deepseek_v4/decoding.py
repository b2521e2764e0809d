"""DeepSeek-V4 decoding with a cache: one token per sequence per step, jitted, cache donated.

Letters as in models/deepseek_v4/model.py; L layers, S window slots (= sliding_window), Nmax entry
slots of a compressed layer (max_len // M), U buffered tokens (2M on CSA layers and the indexer:
an entry pools the previous window's first halves; M on HCA layers).

What the cache holds per layer is what transformers' DeepseekV4{HCA,CSA}Cache holds
(modeling_deepseek_v4.py:156-311), laid out with static shapes:
  window       the last S K=V rows (transformers keeps S - 1 and appends the new one);
  entries      compressed entries emitted so far (CSA: the "C4" pool, HCA: the "C128" one);
  index_keys   the CSA indexer's own entries;
  raw kv/gate  projections of the last U tokens: the pending window plus, on CSA layers, the
               previous window whose first halves the next entry pools (transformers' buffer +
               overlap state). An entry is emitted when position p closes a window,
               (p + 1) % M == 0, at RoPE position w * M: entry_count x M, as transformers does.
Each sequence has its own position per step (positions i32[B], -1: an inactive slot, whose
state the step leaves untouched), so a serving engine can batch requests of any lengths
(models/deepseek_v4/runner.py); `generate` passes one shared position. `prefill` builds
the cache from one forward pass over the prompt (`forward_with_aux(..., with_cache_inputs=True)`);
`generate(..., prefill_by_steps=True)` feeds the prompt through decode_step instead (the test
that the step's state handling is exact).

`generate_hisparse` moves the CSA entries (the "C4" pool) into a hisparse_jax HiSparseState:
pinned host pool + LRU device buffer, the indexer's top-k swapped in each step; the indexer keys,
HCA entries, window and raw buffers stay in this cache on the device (docs/models.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.deepseek_v4 import CSA
from hisparse_jax.host_pages import HostPageAllocator
from hisparse_jax.row_layout import KVRowLayout
from hisparse_jax.state import HiSparseState, jit_donating_state
from models.common.progress import DecodeProgress
from models.deepseek_v4.model import (
    Compressor,
    DeepseekV4ForCausalLM,
    HyperConnection,
    attend,
    cos_sin,
    forward_with_aux,
    select_topk,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class V4Cache:
    window: jax.Array  # [L, B, S, A]: K=V row of position window_pos[s] in slot s = pos % S
    window_pos: jax.Array  # i32[B, S]: position held by each window slot, -1 empty (shared by layers)
    entries: tuple  # per layer [B, Nmax, A] (sliding layers: [B, 0, A]): compressed entries
    index_keys: tuple  # per layer [B, Nmax, I] (non-CSA layers: [B, 0, I]): indexer entries
    raw_kv: tuple  # per layer [B, U, c*A]: compressor kv projections of the last U tokens, slot pos % U
    raw_gate: tuple  # per layer [B, U, c*A]: same for the gate projections
    index_raw_kv: tuple  # per layer [B, U, 2I] (non-CSA: [B, 0, 2I]): the indexer compressor's
    index_raw_gate: tuple  # per layer, as index_raw_kv


def _request_axis(field: str) -> int:
    """The request (batch) axis of a V4Cache field: window is [L, B, S, A], the rest [B, ...]."""
    return 1 if field == "window" else 0


def put_request(cache: V4Cache, slot, one: V4Cache) -> V4Cache:
    """`cache` with row 0 of `one` (a batch-1 cache of the same max_len, e.g. a prefill's) in
    request row `slot` (int or i32[]). Arrays `cache` keeps empty ([B, 0, A]: the CSA entries,
    held by a HiSparse state instead) are left as they are."""

    def put(field, big, small):
        axis = _request_axis(field)
        if big.shape[axis + 1 :] != small.shape[axis + 1 :]:
            return big  # empty here: the rows live elsewhere
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis)

    return V4Cache(**{f.name: _map_field(f.name, put, getattr(cache, f.name), getattr(one, f.name)) for f in dataclasses.fields(V4Cache)})


def move_request(cache: V4Cache, source, target) -> V4Cache:
    """`cache` with request row `source` copied to row `target` (ints or i32[])."""

    def move(field, x):
        axis = _request_axis(field)
        row = jax.lax.dynamic_slice_in_dim(x, source, 1, axis)
        return jax.lax.dynamic_update_slice_in_dim(x, row, target, axis)

    return V4Cache(**{f.name: _map_field(f.name, move, getattr(cache, f.name)) for f in dataclasses.fields(V4Cache)})


def _map_field(field: str, fn, *values):
    """fn(field, *arrays) over one V4Cache field: an array, or a tuple of per-layer arrays."""
    if isinstance(values[0], tuple):
        return tuple(fn(field, *arrays) for arrays in zip(*values))
    return fn(field, *values)


def _buffer_len(compressor: Compressor | None) -> int:
    if compressor is None:
        return 0
    return 2 * compressor.rate if compressor.overlap else compressor.rate


def create_cache(model: DeepseekV4ForCausalLM, batch: int, max_len: int, *, csa_entries: bool = True) -> V4Cache:
    """An empty cache for `batch` sequences of up to `max_len` tokens, in the model's dtype.
    csa_entries False: the CSA layers' entries live elsewhere (a HiSparse KV state, the
    serving runner's), so their arrays here are [B, 0, A]."""
    config, dtype = model.config, model.dtype
    A, I, S = config.head_dim, config.index_head_dim, config.sliding_window
    entries, index_keys, raw_kv, raw_gate, index_raw_kv, index_raw_gate = [], [], [], [], [], []
    for i, layer in enumerate(model.layers):
        comp = layer.attn.compressor
        rate = config.compress_rate(i)
        n = max_len // rate if rate else 0
        csa = config.layer_types[i] == CSA
        U = _buffer_len(comp)
        wide = (2 * A if comp is not None and comp.overlap else A)
        entries.append(jnp.zeros((batch, n if csa_entries or not csa else 0, A), dtype))
        raw_kv.append(jnp.zeros((batch, U, wide), dtype))
        raw_gate.append(jnp.zeros((batch, U, wide), dtype))
        index_keys.append(jnp.zeros((batch, n if csa else 0, I), dtype))
        index_raw_kv.append(jnp.zeros((batch, 2 * config.csa_rate if csa else 0, 2 * I), dtype))
        index_raw_gate.append(jnp.zeros((batch, 2 * config.csa_rate if csa else 0, 2 * I), dtype))
    return V4Cache(
        window=jnp.zeros((config.num_layers, batch, S, A), dtype),
        window_pos=jnp.full((batch, S), -1, jnp.int32),
        entries=tuple(entries), index_keys=tuple(index_keys), raw_kv=tuple(raw_kv), raw_gate=tuple(raw_gate),
        index_raw_kv=tuple(index_raw_kv), index_raw_gate=tuple(index_raw_gate),
    )  # fmt: skip


def _compress_step(comp: Compressor, x, raw_kv, raw_gate, positions, active, rope, rope_dim):
    """Buffer each sequence's token projections and pool the window it closes, if any.

    x [B, D]; raw_* [B, U, c*W]; positions i32[B]; active bool[B] (inactive rows keep their
    buffers) -> (raw_kv, raw_gate, entry [B, W], closes bool[B], w i32[B]): row b's entry is
    window w[b] = (positions[b] + 1) // M - 1's, meaningful only where closes[b]."""
    U, M = raw_kv.shape[1], comp.rate
    B = x.shape[0]
    rows = jnp.arange(B)
    kv, gate = comp.project(x)  # [B, c*W]
    slot = jnp.where(active, positions % U, U)  # i32[B]: U (out of range) drops an inactive row's write
    raw_kv = raw_kv.at[rows, slot].set(kv, mode="drop")
    raw_gate = raw_gate.at[rows, slot].set(gate, mode="drop")
    # The last U tokens in order; positions before 0 (window -1 of entry 0) get gate -inf.
    held = positions[:, None] + 1 - U + jnp.arange(U, dtype=jnp.int32)  # i32[B, U]
    order = (held % U)[..., None]  # i32[B, U, 1]
    ordered_kv = jnp.where((held >= 0)[..., None], jnp.take_along_axis(raw_kv, order, axis=1), 0)
    ordered_gate = jnp.where((held >= 0)[..., None], jnp.take_along_axis(raw_gate, order, axis=1), -jnp.inf)
    # CSA: pool() pairs window k's second halves with window k-1's first halves; with two windows
    # in, its entry 1 is the one closing now (window 0's -inf first halves get weight 0).
    pooled = comp.pool(ordered_kv, ordered_gate)[:, -1:]  # [B, 1, W]
    w = (positions + 1) // M - 1  # i32[B]
    entry = comp.finish(pooled, w[:, None], rope, rope_dim)[:, 0]  # [B, W]; RoPE at w[b] x M per row
    return raw_kv, raw_gate, entry, active & ((positions + 1) % M == 0), w


def _store_entry(entries, entry, closes, w):
    """entries [B, Nmax, W] with entry [B, W] written at w i32[B] in the rows where closes bool[B]."""
    if entries.shape[1] == 0:
        return entries
    N = entries.shape[1]
    target = jnp.where(closes & (w < N), w, N)  # i32[B]: N (out of range) writes nothing
    return entries.at[jnp.arange(entries.shape[0]), target].set(entry.astype(entries.dtype), mode="drop")


def decode_step(model: DeepseekV4ForCausalLM, cache: V4Cache, tokens: jax.Array, positions: jax.Array):
    """tokens i32[B] at positions i32[B] (or one shared i32[]; -1: inactive) -> (cache, logits f32[B, V])."""
    cache, _, logits, _ = _step(model, cache, None, tokens, positions)
    return cache, logits


def _step(model, cache: V4Cache, c4, tokens, positions, implementation=None):
    """decode_step; with c4 (a hisparse_jax KVState over the CSA layers, rows = entries, row
    position = entry index) the CSA entries live there instead of cache.entries: each closing
    entry is written as the newest row and backed up to the host, the indexer's top-k is swapped
    in, and attention reads the selected rows from the device buffer (a FullKVState c4: every
    entry on the device, the same code, the serving baseline). positions i32[B] (or i32[],
    shared), -1 for an inactive row: nothing of its state is written. -> (cache, c4, logits,
    plan telemetry (num_hits, num_misses) i32[J, B] each, or None without c4)."""
    config = model.config
    S, P = config.sliding_window, config.qk_rope_head_dim
    h = model.embed_tokens(tokens)  # [B, D]
    B = h.shape[0]
    rows_b = jnp.arange(B)
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (B,))  # i32[B]
    active = positions >= 0  # bool[B]
    slot = jnp.where(active, positions % S, S)  # i32[B]: S (out of range) writes nothing
    window_pos = cache.window_pos.at[rows_b, slot].set(positions, mode="drop")  # i32[B, S]
    window_ok = (window_pos >= 0) & (window_pos > positions[:, None] - S) & active[:, None]  # bool[B, S]
    streams = jnp.broadcast_to(h[:, None, :], (B, config.hc_mult, h.shape[-1]))
    window = cache.window
    entries, index_keys = list(cache.entries), list(cache.index_keys)
    raw_kv, raw_gate = list(cache.raw_kv), list(cache.raw_gate)
    index_raw_kv, index_raw_gate = list(cache.index_raw_kv), list(cache.index_raw_gate)
    hits, misses = [], []
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        cos, sin = cos_sin(attn.rope, P, jnp.maximum(positions, 0))  # f32[B, P/2]
        pre, post, comb = layer.hc("attn", streams)
        x = layer.attn_norm(HyperConnection.collapse(streams, pre)).astype(streams.dtype)  # [B, D]
        q_resid, q = attn.queries(x, cos, sin)  # [B, Q], [B, H, A]
        row = attn.kv(x, cos, sin)  # [B, A]
        window = window.at[i, rows_b, slot].set(row.astype(window.dtype), mode="drop")
        keys, mask = window[i], window_ok
        if attn.compressor is not None:
            raw_kv[i], raw_gate[i], entry, closes, w = _compress_step(
                attn.compressor, x, raw_kv[i], raw_gate[i], positions, active, config.rope_compress, P
            )
            M = attn.compressor.rate
            N = (index_keys if attn.indexer is not None else entries)[i].shape[1]  # entry slots (CSA entries may live in c4)
            n_visible = jnp.where(active, (positions + 1) // M, 0)  # i32[B]
            offload = c4 is not None and attn.indexer is not None
            if not offload:
                entries[i] = _store_entry(entries[i], entry, closes, w)
            visible = jnp.arange(N)[None, :] < n_visible[:, None]  # bool[B, N]
            if attn.indexer is not None:
                index_raw_kv[i], index_raw_gate[i], ikey, iclose, iw_ = _compress_step(
                    attn.indexer.compressor, x, index_raw_kv[i], index_raw_gate[i], positions, active, config.rope_compress, P
                )
                index_keys[i] = _store_entry(index_keys[i], ikey, iclose, iw_)  # indexer keys stay on the device
                iq, iw = attn.indexer.queries(x, q_resid, cos, sin)  # compress rope = this layer's
                scores = attn.indexer.scores(iq[:, None], iw[:, None], index_keys[i])[:, 0]  # f32[B, N]
                topk = select_topk(scores, visible, config.index_topk)  # i32[B, K]
                if offload:
                    j = config.csa_layers.index(i)
                    newest = jnp.where(closes, w, -1).astype(jnp.int32)  # i32[B]: entry written now, -1 none
                    lengths = n_visible.astype(jnp.int32)  # i32[B]: entries stored, 0 inactive
                    stored = c4.layout.to_stored(entry)
                    c4 = c4.write_newest(j, stored, newest)
                    c4, plan = c4.swap_in(j, topk, lengths, implementation=implementation)
                    c4 = c4.backup_newest(j, stored, newest, implementation=implementation)
                    rows = c4.device_rows[j][rows_b[:, None], jnp.maximum(plan.slots, 0)]  # row[B, K, W]
                    latent, rope_part = c4.layout.unpack(rows)
                    selected = jnp.concatenate([latent, rope_part], axis=-1).astype(keys.dtype)  # [B, K, A]
                    # padding slots may hold anything (NaN in tests): zero them, 0 x NaN would leak
                    selected = jnp.where((plan.slots >= 0)[..., None], selected, 0)
                    keys = jnp.concatenate([keys, selected], axis=1)
                    mask = jnp.concatenate([mask, plan.slots >= 0], axis=-1)
                    hits.append(plan.num_hits)
                    misses.append(plan.num_misses)
                else:
                    chosen = jnp.zeros((B, N + 1), bool).at[jnp.arange(B)[:, None], jnp.where(topk < 0, N, topk)].set(True)
                    visible = visible & chosen[:, :N]
            if not offload:
                keys = jnp.concatenate([keys, entries[i].astype(keys.dtype)], axis=1)
                mask = jnp.concatenate([mask, visible], axis=-1)
        out = attend(q[:, None], keys, mask[:, None], attn.attn_sink[...], config.head_dim**-0.5)[:, 0]
        streams = HyperConnection.expand(streams, attn.output(out, cos, sin), post, comb)
        pre, post, comb = layer.hc("ffn", streams)
        x = layer.ffn_norm(HyperConnection.collapse(streams, pre)).astype(streams.dtype)
        streams = HyperConnection.expand(streams, layer.ffn(x, tokens), post, comb)
    cache = V4Cache(
        window=window, window_pos=window_pos, entries=tuple(entries), index_keys=tuple(index_keys),
        raw_kv=tuple(raw_kv), raw_gate=tuple(raw_gate), index_raw_kv=tuple(index_raw_kv),
        index_raw_gate=tuple(index_raw_gate),
    )  # fmt: skip
    telemetry = (jnp.stack(hits), jnp.stack(misses)) if misses else None
    return cache, c4, model.logits(streams), telemetry


def prefill(model: DeepseekV4ForCausalLM, prompts: jax.Array, max_len: int, prompt_len=None) -> tuple[V4Cache, jax.Array]:
    """The whole prompt in one forward pass -> (cache for max_len tokens, logits f32[B, T, V]).

    The cache holds what feeding the prompt through decode_step would leave: the last S rows at
    slot p % S, every entry and indexer key the prompt closed, the raw projections of the last U
    tokens at slot p % U. prompt_len (int or i32[], default T): the prompts' real length when
    they are padded to T (a serving runner pads to few compiled lengths); the padding, after the
    last real token, cannot reach it (the model is causal) and is left out of the cache.
    Traceable (jit it with the prompt shape static)."""
    config = model.config
    B, T = prompts.shape
    n_real = T if prompt_len is None else prompt_len  # int or i32[]
    logits, aux = forward_with_aux(model, prompts, with_cache_inputs=True)
    cache = create_cache(model, B, max_len)
    S = config.sliding_window
    last = n_real - S + jnp.arange(S, dtype=jnp.int32)  # i32[S]: the window's positions, < 0 none
    window = cache.window
    entries, index_keys = list(cache.entries), list(cache.index_keys)
    raw_kv, raw_gate = list(cache.raw_kv), list(cache.raw_gate)
    index_raw_kv, index_raw_gate = list(cache.index_raw_kv), list(cache.index_raw_gate)

    def keep_last(buffer, values):  # buffer [B, U, X], values [B, T, X]: the last U positions p at slot p % U
        U = buffer.shape[1]
        pos = n_real - U + jnp.arange(U, dtype=jnp.int32)  # i32[U], a permutation of the slots mod U
        kept = jnp.where((pos >= 0)[None, :, None], values[:, jnp.maximum(pos, 0)], 0)
        return buffer.at[:, pos % U].set(kept.astype(buffer.dtype))

    def keep_closed(buffer, computed, rate):  # buffer [B, Nmax, X], computed [B, T // rate, X]
        n = min(computed.shape[1], buffer.shape[1])
        closed = jnp.arange(n) < n_real // rate  # bool[n]: entries of real windows, not padding's
        return buffer.at[:, :n].set(jnp.where(closed[None, :, None], computed[:, :n], 0).astype(buffer.dtype))

    for i, a in enumerate(aux):
        window = window.at[i].set(keep_last(window[i], a.rows))
        if a.compressed_kv is not None:
            entries[i] = keep_closed(entries[i], a.compressed_kv, config.compress_rate(i))
            raw_kv[i], raw_gate[i] = keep_last(raw_kv[i], a.raw[0]), keep_last(raw_gate[i], a.raw[1])
        if a.indexer_keys is not None:
            index_keys[i] = keep_closed(index_keys[i], a.indexer_keys, config.csa_rate)
            index_raw_kv[i] = keep_last(index_raw_kv[i], a.index_raw[0])
            index_raw_gate[i] = keep_last(index_raw_gate[i], a.index_raw[1])
    window_pos = jnp.full((S,), -1, jnp.int32).at[last % S].set(jnp.where(last >= 0, last, -1))  # i32[S]
    cache = V4Cache(
        window=window, window_pos=jnp.broadcast_to(window_pos, (B, S)), entries=tuple(entries),
        index_keys=tuple(index_keys), raw_kv=tuple(raw_kv), raw_gate=tuple(raw_gate),
        index_raw_kv=tuple(index_raw_kv), index_raw_gate=tuple(index_raw_gate),
    )  # fmt: skip
    return cache, logits


def generate(
    model: DeepseekV4ForCausalLM, prompts: jax.Array, steps: int, *, prefill_by_steps: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy decoding with the cache: prompts i32[B, T] -> (tokens i32[B, steps], their logits
    f32[B, steps, V], prompt logits f32[B, T, V]). The prompt runs through `prefill` (one forward
    pass), or with prefill_by_steps through decode_step one token at a time."""
    B, T = prompts.shape
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, c, tok, p: decode_step(nnx.merge(graphdef, s), c, tok, p), donate_argnums=1)
    progress = DecodeProgress(steps - 1, model.config.model_type)
    progress.prefill(B, T)
    cache, prompt_logits = _prefill(graphdef, state, model, prompts, T + steps, prefill_by_steps, step)
    progress.prefilled()
    logits = jnp.asarray(prompt_logits[:, -1])
    out_tokens, out_logits = [], []
    for j in range(steps):
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out_tokens.append(np.asarray(nxt))
        out_logits.append(np.asarray(logits))
        if j + 1 < steps:
            cache, logits = step(state, cache, nxt, jnp.int32(T + j))
            progress.step(j + 1, wait_for=logits)
    return np.stack(out_tokens, 1), np.stack(out_logits, 1), prompt_logits


def _prefill(graphdef, state, model, prompts, max_len, by_steps, step):
    """(cache, prompt logits f32[B, T, V] as numpy) through prefill or token by token."""
    if not by_steps:
        run = jax.jit(lambda s, tok: prefill(nnx.merge(graphdef, s), tok, max_len))
        cache, logits = run(state, prompts)
        return cache, np.asarray(logits)
    cache = create_cache(model, prompts.shape[0], max_len)
    out = []
    for t in range(prompts.shape[1]):
        cache, logits = step(state, cache, prompts[:, t], jnp.int32(t))
        out.append(np.asarray(logits))
    return cache, np.stack(out, 1)


# ---- HiSparse: the C4 (CSA) entry pool in pinned host memory ---------------------------------------


def create_c4_state(model: DeepseekV4ForCausalLM, batch: int, max_len: int, hisparse, *, page_size: int = 64,
                    fill_value: float = 0.0) -> HiSparseState:  # fmt: skip
    """A HiSparseState holding the CSA layers' compressed entries (rows of head_dim = values then
    the rotated trailing rope part), one row per entry: L = CSA layers, C = max_len // csa_rate.
    The host pool holds every request's entries; hisparse.top_k must be the model's index_topk."""
    config = model.config
    if hisparse.top_k != config.index_topk:
        raise ValueError(f"hisparse_config top_k ({hisparse.top_k}) must equal the model's index_topk ({config.index_topk})")
    if not config.csa_layers:
        raise ValueError("the model has no CSA layer: there is no C4 pool to offload")
    C = max(max_len // config.csa_rate, 1)
    layout = KVRowLayout(config.head_dim - config.qk_rope_head_dim, config.qk_rope_head_dim, np.dtype(model.dtype).name)
    return HiSparseState.create(
        num_layers=len(config.csa_layers), num_requests=batch, max_context=C, config=hisparse, layout=layout,
        num_host_pages=batch * -(-C // page_size), page_size=page_size, fill_value=fill_value,
    )  # fmt: skip


def generate_hisparse(model: DeepseekV4ForCausalLM, prompts: jax.Array, steps: int, hisparse, *, page_size: int = 64,
                      implementation: str | None = None, fill_value: float = 0.0, prefill_by_steps: bool = False):  # fmt: skip
    """Greedy decoding with the C4 pool offloaded: prompts i32[B, T] -> (tokens i32[B, steps],
    logits f32[B, steps, V], misses i32[steps - 1, J, B]: C4 rows copied host -> device per
    decode step and CSA layer).

    The prompt runs through `prefill` (as `generate`); its CSA entries then go to the host
    pool (store_prefill_rows) and the device copies are dropped (overwritten with NaN, so a read
    of them would show). Decode steps keep the window, the indexer keys, the HCA ("C128") entries
    and the raw window buffers on the device, and swap the indexer's top-k C4 rows in."""
    config = model.config
    B, T = prompts.shape
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, c, tok, p: decode_step(nnx.merge(graphdef, s), c, tok, p), donate_argnums=1)
    progress = DecodeProgress(steps - 1, model.config.model_type)
    progress.prefill(B, T)
    cache, prompt_logits = _prefill(graphdef, state, model, prompts, T + steps, prefill_by_steps, step)
    logits = jnp.asarray(prompt_logits[:, -1])

    c4 = create_c4_state(model, B, T + steps, hisparse, page_size=page_size, fill_value=fill_value)
    allocator = HostPageAllocator(c4.num_host_pages, page_size)
    n = T // config.csa_rate  # entries the prompt emitted
    entries = list(cache.entries)
    for r in range(B):
        pages = allocator.allocate(c4.max_context)
        c4 = c4.begin_request(r, n, jnp.asarray(HostPageAllocator.page_table_row(pages, c4.host_page_table.shape[1])))
        for j, layer in enumerate(config.csa_layers):
            c4 = c4.store_prefill_rows(j, r, 0, entries[layer][r, :n], n, implementation=implementation)
    for j, layer in enumerate(config.csa_layers):
        # The library keeps the newest row on the device (slot B once the context exceeds B); a
        # C4 entry is "newest" until the next window closes, so the prompt's last one goes there.
        if n:
            last = jnp.full((B,), n - 1, jnp.int32)
            c4 = c4.write_newest(j, c4.layout.to_stored(entries[layer][:, n - 1]), last)
        entries[layer] = jnp.full_like(entries[layer], jnp.nan)
    cache = dataclasses.replace(cache, entries=tuple(entries))
    progress.prefilled(wait_for=c4)

    def hisparse_step(c4, s, c, tok, p):
        c, c4, logits, (_, misses) = _step(nnx.merge(graphdef, s), c, c4, tok, p, implementation)
        return c4, c, logits, misses

    hstep = jit_donating_state(hisparse_step, c4, extra_outputs=3)
    out_tokens, out_logits, out_misses = [], [], []
    for j in range(steps):
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out_tokens.append(np.asarray(nxt))
        out_logits.append(np.asarray(logits))
        if j + 1 < steps:
            c4, cache, logits, misses = hstep(c4, state, cache, nxt, jnp.int32(T + j))
            out_misses.append(np.asarray(misses))
            progress.step(j + 1)
    return np.stack(out_tokens, 1), np.stack(out_logits, 1), np.stack(out_misses)
