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
from hisparse_jax.state import HiSparseState
from models.layers import HIGHEST
from models.minimax_m3 import forward_with_cache_rows, rope_cos_sin, select_blocks


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
# Each (request b, KV group g) is one HiSparse request slot r = b * N + g: its rows are the
# group's [k, v] (W = 2 E, stored as KVRowLayout(latent_dim=E, rope_dim=E): a plain float row),
# its top-k the positions of the keys in the group's selected blocks (K x block_size, future
# keys of the query's own block dropped). The library's write_newest / swap_in / backup_newest
# run unchanged; attention (GQA over the gathered rows) is computed here, since the library's
# attention kernel is MLA's.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class M3HiSparseCache:
    k: jax.Array  # [Lf, B, C, N, E]: full_attention layers, on the device
    v: jax.Array  # [Lf, B, C, N, E]
    index_keys: jax.Array  # [J, B, C, I]: sparse layers' index keys, on the device
    kv: HiSparseState  # sparse layers' [k, v] rows: L = J, R = B x N


def create_hisparse_cache(model, batch: int, max_context: int, hisparse: HiSparseConfig, *, page_size: int = 16) -> M3HiSparseCache:
    """Every (request, KV group) slot gets its own contiguous host pages (no allocator needed here)."""
    c, dtype = model.config, model.dtype
    plan = hisparse_plan(c, hisparse)
    R = batch * c.num_kv_heads
    pages = -(-max_context // page_size)
    kind = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16"}[jnp.dtype(dtype)]
    state = HiSparseState.create(
        num_layers=len(plan.offloaded_kv_layers), num_requests=R, max_context=max_context, config=hisparse,
        layout=KVRowLayout(latent_dim=c.head_dim, rope_dim=c.head_dim, kind=kind), num_host_pages=R * pages,
        page_size=page_size,
    )  # fmt: skip
    for r in range(R):
        state = state.begin_request(r, 0, jnp.arange(r * pages, (r + 1) * pages, dtype=jnp.int32))
    Lf = len(plan.device_kv_layers)
    kv = (Lf, batch, max_context, c.num_kv_heads, c.head_dim)
    return M3HiSparseCache(jnp.zeros(kv, dtype), jnp.zeros(kv, dtype), jnp.zeros((len(c.sparse_layers), batch, max_context, c.index_head_dim), dtype), state)


def _rows(k: jax.Array, v: jax.Array) -> jax.Array:
    """k, v [B, ..., N, E] -> rows [B x N, ..., 2E] (slot b * N + g)."""
    rows = jnp.concatenate([k, v], axis=-1)  # [B, ..., N, 2E]
    rows = jnp.moveaxis(rows, -2, 1)  # [B, N, ..., 2E]
    return rows.reshape(-1, *rows.shape[2:])


def hisparse_prefill(model, cache: M3HiSparseCache, tokens: jax.Array) -> tuple[M3HiSparseCache, jax.Array]:
    """Prompts i32[B, T] -> (cache, last logits f32[B, V]); sparse layers' rows go to the host pool."""
    c = model.config
    B, T = tokens.shape
    logits, k, v, ik = forward_with_cache_rows(model, tokens)  # k [L, B, T, N, E], ik [J, B, T, I]
    full, sparse = list(c.dense_attention_layers), list(c.sparse_layers)
    state = cache.kv
    R = B * c.num_kv_heads
    for j, layer in enumerate(sparse):
        rows = _rows(k[layer], v[layer])  # [R, T, 2E]
        for r in range(R):
            state = state.store_prefill_rows(j, r, 0, rows[r], T)
    state = state.replace(seq_lens=jnp.full((R,), T, jnp.int32))
    new = M3HiSparseCache(
        cache.k.at[:, :, :T].set(k[jnp.asarray(full, jnp.int32)].astype(cache.k.dtype)) if full else cache.k,
        cache.v.at[:, :, :T].set(v[jnp.asarray(full, jnp.int32)].astype(cache.v.dtype)) if full else cache.v,
        cache.index_keys.at[:, :, :T].set(ik.astype(cache.index_keys.dtype)),
        state,
    )
    return new, logits


def hisparse_decode_step(model, cache: M3HiSparseCache, tokens: jax.Array, positions: jax.Array):
    """One token per sequence (tokens, positions i32[B]) -> (cache, logits f32[B, V], misses i32[J, B x N])."""
    c = model.config
    B, C = cache.k.shape[1], cache.k.shape[2]
    N, G, E, bs = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim, c.index_block_size
    rows_b = jnp.arange(B)
    cos, sin = rope_cos_sin(c, positions)
    key_pos = jnp.arange(C, dtype=jnp.int32)
    h = model.embed_tokens(tokens)
    ks, vs, iks, misses = [], [], [], []
    state = cache.kv
    slot_positions = jnp.repeat(positions, N)  # i32[B N]
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.queries(x, cos, sin)  # [B, H, E]
        k, v = attn.keys_values(x, cos, sin)  # [B, N, E]
        if attn.indexer is None:
            f = len(ks)
            kc = cache.k[f].at[rows_b, positions].set(k.astype(cache.k.dtype))
            vc = cache.v[f].at[rows_b, positions].set(v.astype(cache.v.dtype))
            ks.append(kc)
            vs.append(vc)
            mask = jnp.broadcast_to((key_pos[None, :] <= positions[:, None])[:, None, None, :], (B, c.num_heads, 1, C))
            out = jax.vmap(attn.attend)(q[:, None], kc, vc, mask)[:, 0]
        else:
            j = len(iks)
            ik = cache.index_keys[j].at[rows_b, positions].set(attn.indexer.keys(x, cos, sin).astype(cache.index_keys.dtype))
            iks.append(ik)
            picks = jax.vmap(lambda q1, keys, p: select_blocks(c, q1[None], keys, p[None], key_pos))(
                attn.indexer.queries(x, cos, sin), ik, positions
            )[:, :, 0]  # i32[B, n, K]
            # Key positions of the picked blocks: -1 for no block and for keys after the query.
            topk = picks[..., None] * bs + jnp.arange(bs, dtype=jnp.int32)  # [B, N, K, bs]
            topk = jnp.where((picks[..., None] >= 0) & (topk <= positions[:, None, None, None]), topk, -1)
            topk = topk.reshape(B * N, -1)  # i32[B N, K bs]
            new_row = _rows(k, v)  # [B N, 2E]
            state = state.write_newest(j, new_row, slot_positions)
            state, plan = state.swap_in(j, topk, slot_positions + 1)
            state = state.backup_newest(j, new_row, slot_positions)
            gathered = jnp.take_along_axis(state.device_rows[j], jnp.maximum(plan.slots, 0)[..., None], axis=1)  # [B N, K bs, 2E]
            gathered = gathered.reshape(B, N, -1, 2 * E)
            qg = q.reshape(B, N, G, E).astype(jnp.float32)
            logits = jnp.einsum("bngd,bnsd->bngs", qg, gathered[..., :E].astype(jnp.float32), precision=HIGHEST) * (E**-0.5)
            logits = jnp.where((plan.slots >= 0).reshape(B, N, 1, -1), logits, -jnp.inf)
            probs = jax.nn.softmax(logits, axis=-1).astype(gathered.dtype)
            o = jnp.einsum("bngs,bnsd->bngd", probs, gathered[..., E:], precision=HIGHEST).reshape(B, -1)
            out = attn.o_proj(o)
            misses.append(plan.num_misses)
        h = h + out
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    new = M3HiSparseCache(
        jnp.stack(ks) if ks else cache.k, jnp.stack(vs) if vs else cache.v, jnp.stack(iks) if iks else cache.index_keys,
        state.replace(seq_lens=slot_positions + 1),
    )
    return new, model.logits(h), jnp.stack(misses) if misses else jnp.zeros((0, B * N), jnp.int32)


def generate_hisparse(model, prompts: jax.Array, num_tokens: int, hisparse: HiSparseConfig, *, page_size: int = 16):
    """Greedy decoding with the sparse layers' K/V in the HiSparse state: prompts i32[B, P] ->
    (tokens i32[B, N], step logits f32[B, N, V], misses i32[N - 1, J, B x N_kv]: rows copied
    host -> device per decode step, sparse layer and (request, KV group) slot). The first token
    comes from the prefill, as models.minimax_m3.generate."""
    B, P = prompts.shape
    cache = create_hisparse_cache(model, B, P + num_tokens, hisparse, page_size=page_size)
    cache, last = jax.jit(hisparse_prefill)(model, cache, jnp.asarray(prompts, jnp.int32))
    step = jax.jit(hisparse_decode_step, donate_argnums=1)
    token = jnp.argmax(last, -1).astype(jnp.int32)
    tokens, logits, misses = [np.asarray(token)], [np.asarray(last)], []
    for j in range(1, num_tokens):
        cache, last, step_misses = step(model, cache, token, jnp.full((B,), P + j - 1, jnp.int32))
        token = jnp.argmax(last, -1).astype(jnp.int32)
        tokens.append(np.asarray(token))
        logits.append(np.asarray(last))
        misses.append(np.asarray(step_misses))
    J = len(model.config.sparse_layers)
    misses = np.stack(misses) if misses else np.zeros((0, J, B * model.config.num_kv_heads), np.int32)
    return np.stack(tokens, 1), np.stack(logits, 1).astype(np.float32), misses
