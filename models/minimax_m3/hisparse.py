"""How MiniMax-M3 maps onto HiSparse, and decoding with its sparse layers' K/V offloaded (generate_hisparse).

Which caches go where (docs/models.md, MiniMax-M3):
  - full_attention layers attend every key: their K/V stay on the device (no selection to
    drive a swap-in);
  - the index keys of sparse layers stay on the device: the indexer scores every past key
    each step, so they cannot be offloaded;
  - sparse (minimax_m3_sparse) layers' K/V go to the pinned host pool, with a device working
    set per request (device_buffer_size rows, LRU) filled by the swap-in of the selected keys.

Selection unit: each indexer head picks its own blocks, one selection per KV group, so a
sparse layer's row is one KV head's (k, v) of one token, 2 x head_dim values, and each KV group
swaps in index_topk_blocks x index_block_size rows per step (2048 for the released model: 16
blocks of 128). That width is the model's: the `top_k` field of --hisparse_config does not
override it (M3 selects blocks, not a free number of entries); device_buffer_size must hold a
whole selection, so it must be >= 2048 for the released model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from configs.minimax_m3 import MiniMaxM3Config
from hisparse_jax.config import HiSparseConfig, HiSparseConfigError
from hisparse_jax.row_layout import KVRowLayout
from hisparse_jax.state import FullKVState, HiSparseState
from models.common.layers import HIGHEST
from models.common.progress import DecodeProgress
from models.minimax_m3.model import forward_with_cache_rows, rope_cos_sin, select_blocks


@dataclasses.dataclass(frozen=True)
class M3HiSparsePlan:
    device_kv_layers: tuple[int, ...]  # full_attention layers: K/V rows on the device
    offloaded_kv_layers: tuple[int, ...]  # sparse layers: K/V rows in the host pool + device working set
    index_key_layers: tuple[int, ...]  # sparse layers: index keys on the device
    selection_width: int  # rows one KV group selects per step: index_topk_blocks x index_block_size
    groups_per_token: int  # independent selections (KV groups) per token and sparse layer
    row_width: int  # values per offloaded row: K and V of one KV head
    device_buffer_size: int  # working-set rows per request, KV group and sparse layer


def hisparse_plan(config: MiniMaxM3Config, hisparse: HiSparseConfig) -> M3HiSparsePlan:
    """The placement of every M3 cache under `hisparse`; raises HiSparseConfigError when the
    device working set cannot hold one selection. `hisparse.top_k` is ignored: the selection
    width is the model's index_topk_blocks x index_block_size."""
    if config.index_n_heads != config.num_kv_heads:
        raise HiSparseConfigError(
            f"HiSparse maps one selection per KV group: index_n_heads ({config.index_n_heads}) must equal"
            f" num_key_value_heads ({config.num_kv_heads})"
        )
    width = config.selected_keys
    if hisparse.device_buffer_size < width:
        raise HiSparseConfigError(
            f"device_buffer_size ({hisparse.device_buffer_size}) must be >= the keys one MiniMax-M3 query selects,"
            f" index_topk_blocks x index_block_size = {config.index_topk_blocks} x {config.index_block_size} = {width}"
        )
    return M3HiSparsePlan(
        device_kv_layers=config.dense_attention_layers,
        offloaded_kv_layers=config.sparse_layers,
        index_key_layers=config.sparse_layers,
        selection_width=width,
        groups_per_token=config.num_kv_heads,
        row_width=2 * config.head_dim,
        device_buffer_size=hisparse.device_buffer_size,
    )


# ---- decoding with the sparse layers' K/V in the HiSparse state ----------------------------------
#
# One request is one HiSparse request slot (so a serving engine's slot, host pages and release
# map 1:1); each (sparse layer j, KV group g) is one layer l = j * N + g of the state. Its rows
# are the group's [k, v] (W = 2 E, stored as KVRowLayout(latent_dim=E, rope_dim=E): a plain
# float row), its top-k the positions of the keys in the group's selected blocks (K x
# block_size, future keys of the query's own block dropped). Host pages are the request's,
# shared by its J x N layers (as a DSA model's are by its layers). The library's write_newest /
# swap_in / backup_newest run unchanged; attention (GQA over the gathered rows) is computed
# here, since the library's attention kernel is MLA's. With a FullKVState instead (every row on
# the device, slot = position) the same code is the no-offload baseline the serving engine
# compares against.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class M3HiSparseCache:
    k: jax.Array  # [Lf, B, C, N, E]: full_attention layers, on the device
    v: jax.Array  # [Lf, B, C, N, E]
    index_keys: jax.Array  # [J, B, C, I]: sparse layers' index keys, on the device
    kv: HiSparseState | FullKVState  # sparse layers' [k, v] rows: L = J x N (layer j, group g at j N + g), R = B


def create_hisparse_cache(
    model, batch: int, max_context: int, hisparse: HiSparseConfig | None, *, page_size: int = 16,
    num_host_pages: int | None = None, fill_value: float = 0.0, begin: bool = True,
) -> M3HiSparseCache:  # fmt: skip
    """An empty cache for `batch` requests of up to `max_context` tokens; hisparse None keeps
    the sparse layers' rows on the device too (FullKVState). begin True (generate_hisparse):
    every slot starts a request with its own contiguous host pages; False (a serving engine):
    slots stay free until begin_request with the allocator's pages, and num_host_pages defaults
    to host_to_device_ratio x the device pool (HiSparseState.create)."""
    c, dtype = model.config, model.dtype
    J, N = len(c.sparse_layers), c.num_kv_heads
    kind = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16"}[jnp.dtype(dtype)]
    layout = KVRowLayout(latent_dim=c.head_dim, rope_dim=c.head_dim, kind=kind)
    pages = -(-max_context // page_size)  # per request
    if hisparse is None:
        state = FullKVState.create(num_layers=J * N, num_requests=batch, max_context=max_context, layout=layout, fill_value=fill_value)
    else:
        hisparse_plan(c, hisparse)  # refuses a working set smaller than one selection
        state = HiSparseState.create(
            num_layers=J * N, num_requests=batch, max_context=max_context, config=hisparse, layout=layout,
            num_host_pages=batch * pages if begin else num_host_pages, page_size=page_size, fill_value=fill_value,
        )  # fmt: skip
    if begin:
        for r in range(batch):
            state = state.begin_request(r, 0, jnp.arange(r * pages, (r + 1) * pages, dtype=jnp.int32))
    Lf = len(c.dense_attention_layers)
    kv = (Lf, batch, max_context, N, c.head_dim)
    return M3HiSparseCache(jnp.zeros(kv, dtype), jnp.zeros(kv, dtype), jnp.zeros((J, batch, max_context, c.index_head_dim), dtype), state)


def store_request(c: MiniMaxM3Config, cache: M3HiSparseCache, slot, k, v, ik, prompt_len, *, implementation=None) -> M3HiSparseCache:
    """One request's prompt caches into slot `slot` (int or i32[]): k, v [L, T, N, E] (T may
    be padded past prompt_len, int or i32[]; padding rows are dropped), ik [J, T, I]. The
    sparse layers' rows go to the KV state (HiSparse: straight to the host pool), the full
    layers' K/V and the index keys to their device arrays. The slot's request must be begun."""
    N, C = c.num_kv_heads, cache.k.shape[2]
    T = k.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32)
    target = jnp.where(positions < prompt_len, positions, C)  # i32[T]: C (out of range) drops padding
    state = cache.kv
    for j, layer in enumerate(c.sparse_layers):
        rows = jnp.concatenate([k[layer], v[layer]], axis=-1)  # [T, N, 2E]
        for g in range(N):
            state = state.store_prefill_rows(j * N + g, slot, 0, rows[:, g], prompt_len, implementation=implementation)
    full = jnp.asarray(c.dense_attention_layers, jnp.int32)
    put = lambda dst, src: dst.at[:, slot, target].set(src.astype(dst.dtype), mode="drop")  # noqa: E731
    return M3HiSparseCache(
        put(cache.k, k[full]) if len(full) else cache.k, put(cache.v, v[full]) if len(full) else cache.v,
        put(cache.index_keys, ik), state,
    )  # fmt: skip


def hisparse_prefill(model, cache: M3HiSparseCache, tokens: jax.Array) -> tuple[M3HiSparseCache, jax.Array]:
    """Prompts i32[B, T] (slots begun by create_hisparse_cache) -> (cache, last logits f32[B, V]);
    sparse layers' rows go to the host pool."""
    B, T = tokens.shape
    logits, k, v, ik = forward_with_cache_rows(model, tokens)  # k [L, B, T, N, E], ik [J, B, T, I]
    for b in range(B):
        cache = store_request(model.config, cache, b, k[:, b], v[:, b], ik[:, b], T)
    return dataclasses.replace(cache, kv=cache.kv.replace(seq_lens=jnp.full((B,), T, jnp.int32))), logits


def hisparse_decode_step(model, cache: M3HiSparseCache, tokens: jax.Array, positions: jax.Array, *, implementation=None):
    """One token per request (tokens, positions i32[B]; position -1: an inactive slot, nothing
    of it written) -> (cache, logits f32[B, V], misses i32[J N, B]: rows copied host -> device
    per state layer (sparse layer j, KV group g at j N + g) and request)."""
    cache, logits, (_, misses) = decode_step_counts(model, cache, tokens, positions, implementation=implementation)
    return cache, logits, misses


def decode_step_counts(model, cache: M3HiSparseCache, tokens: jax.Array, positions: jax.Array, *, implementation=None):
    """hisparse_decode_step with both swap-in counts: -> (cache, logits f32[B, V], (num_hits,
    num_misses) i32[J N, B] each), what a serving engine's telemetry reads."""
    c = model.config
    B, C = cache.k.shape[1], cache.k.shape[2]
    N, G, E, bs = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim, c.index_block_size
    rows_b = jnp.arange(B)
    active = positions >= 0  # bool[B]
    target = jnp.where(active, positions, C)  # i32[B]: C (out of range) drops an inactive slot's writes
    cos, sin = rope_cos_sin(c, jnp.maximum(positions, 0))
    key_pos = jnp.arange(C, dtype=jnp.int32)
    lengths = jnp.where(active, positions + 1, 0)  # i32[B]: rows stored with the new one, 0 inactive
    h = model.embed_tokens(tokens)
    ks, vs, iks, hits, misses = [], [], [], [], []
    state = cache.kv
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.queries(x, cos, sin)  # [B, H, E]
        k, v = attn.keys_values(x, cos, sin)  # [B, N, E]
        if attn.indexer is None:
            f = len(ks)
            kc = cache.k[f].at[rows_b, target].set(k.astype(cache.k.dtype), mode="drop")
            vc = cache.v[f].at[rows_b, target].set(v.astype(cache.v.dtype), mode="drop")
            ks.append(kc)
            vs.append(vc)
            mask = jnp.broadcast_to((key_pos[None, :] <= positions[:, None])[:, None, None, :], (B, c.num_heads, 1, C))
            out = jax.vmap(attn.attend)(q[:, None], kc, vc, mask)[:, 0]
        else:
            j = len(iks)
            new_key = attn.indexer.keys(x, cos, sin).astype(cache.index_keys.dtype)
            ik = cache.index_keys[j].at[rows_b, target].set(new_key, mode="drop")
            iks.append(ik)
            picks = jax.vmap(lambda q1, keys, p: select_blocks(c, q1[None], keys, p[None], key_pos))(
                attn.indexer.queries(x, cos, sin), ik, positions
            )[:, :, 0]  # i32[B, n, K]
            # Key positions of the picked blocks: -1 for no block and for keys after the query.
            topk = picks[..., None] * bs + jnp.arange(bs, dtype=jnp.int32)  # [B, N, K, bs]
            topk = jnp.where((picks[..., None] >= 0) & (topk <= positions[:, None, None, None]), topk, -1)
            topk = topk.reshape(B, N, -1)  # i32[B, N, K bs]
            new_rows = jnp.concatenate([k, v], axis=-1)  # [B, N, 2E]
            gathered, valid = [], []
            for g in range(N):
                l = j * N + g
                state = state.write_newest(l, new_rows[:, g], positions)
                state, plan = state.swap_in(l, topk[:, g], lengths, implementation=implementation)
                state = state.backup_newest(l, new_rows[:, g], positions, implementation=implementation)
                slots = jnp.maximum(plan.slots, 0)[..., None]  # i32[B, K bs, 1]
                gathered.append(jnp.take_along_axis(state.device_rows[l], slots, axis=1))  # [B, K bs, 2E]
                valid.append(plan.slots >= 0)
                hits.append(plan.num_hits)
                misses.append(plan.num_misses)
            gathered = jnp.stack(gathered, axis=1)  # [B, N, K bs, 2E]
            qg = q.reshape(B, N, G, E).astype(jnp.float32)
            logits = jnp.einsum("bngd,bnsd->bngs", qg, gathered[..., :E].astype(jnp.float32), precision=HIGHEST) * (E**-0.5)
            logits = jnp.where(jnp.stack(valid, axis=1)[:, :, None, :], logits, -jnp.inf)
            probs = jax.nn.softmax(logits, axis=-1).astype(gathered.dtype)
            o = jnp.einsum("bngs,bnsd->bngd", probs, gathered[..., E:], precision=HIGHEST).reshape(B, -1)
            out = attn.o_proj(o)
        h = h + out
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    new = M3HiSparseCache(
        jnp.stack(ks) if ks else cache.k, jnp.stack(vs) if vs else cache.v, jnp.stack(iks) if iks else cache.index_keys,
        state.replace(seq_lens=jnp.where(active, positions + 1, state.seq_lens)),
    )
    empty = jnp.zeros((0, B), jnp.int32)
    counts = (jnp.stack(hits), jnp.stack(misses)) if misses else (empty, empty)
    return new, model.logits(h), counts


def generate_hisparse(model, prompts: jax.Array, num_tokens: int, hisparse: HiSparseConfig, *, page_size: int = 16):
    """Greedy decoding with the sparse layers' K/V in the HiSparse state: prompts i32[B, P] ->
    (tokens i32[B, N], step logits f32[B, N, V], misses i32[N - 1, J, B x N_kv]: rows copied
    host -> device per decode step, sparse layer and (request b, KV group g) at b x N_kv + g).
    The first token comes from the prefill, as models.minimax_m3.generate."""
    B, P = prompts.shape
    J, N = len(model.config.sparse_layers), model.config.num_kv_heads
    cache = create_hisparse_cache(model, B, P + num_tokens, hisparse, page_size=page_size)
    progress = DecodeProgress(num_tokens - 1, model.config.model_type)
    progress.prefill(B, P)
    cache, last = jax.jit(hisparse_prefill)(model, cache, jnp.asarray(prompts, jnp.int32))
    progress.prefilled(wait_for=last)
    step = jax.jit(hisparse_decode_step, donate_argnums=1)
    token = jnp.argmax(last, -1).astype(jnp.int32)
    tokens, logits, misses = [np.asarray(token)], [np.asarray(last)], []
    for j in range(1, num_tokens):
        cache, last, step_misses = step(model, cache, token, jnp.full((B,), P + j - 1, jnp.int32))
        token = jnp.argmax(last, -1).astype(jnp.int32)
        tokens.append(np.asarray(token))
        logits.append(np.asarray(last))
        # [J N, B] -> [J, B N]: the (request, group) order this function has always reported
        misses.append(np.asarray(step_misses).reshape(J, N, B).transpose(0, 2, 1).reshape(J, B * N))
        progress.step(j)
    misses = np.stack(misses) if misses else np.zeros((0, J, B * N), np.int32)
    return np.stack(tokens, 1), np.stack(logits, 1).astype(np.float32), misses
