"""MiniMax-M3 text model in Flax NNX, and its no-cache forward (transformers 5.24.0 maths).

Letters: B sequences, T queries, S keys, D hidden, V vocab, H attention heads, N KV heads,
E head_dim, R rotated channels, n indexer heads, I index_head_dim, K blocks kept per query,
C key blocks, X experts per token, F intermediate width.

Module and attribute names follow the `minimax_m3_vl_text` checkpoint (`model.layers.1.self_attn.
indexer.q_proj.weight` is `model.layers[1].self_attn.indexer.q_proj.weight`) so the loader
(models/minimax_m3/loading.py) maps tensors by name; routed experts are stored [E, in, out] for
`ragged_dot` (the checkpoint's packed [E, out, in] transposed on loading).

Reference (transformers `models/minimax_m3_vl/modeling_minimax_m3_vl.py`, "MM"):
  - Gemma RMSNorm x / rms(x) * (1 + w), in float32 (MM:153-172);
  - attention: q/k/v projections, per-head q_norm / k_norm, half-split RoPE on the first R
    channels, float32 softmax at scale E^-1/2, GQA (MM:340-490);
  - sparse layers: a block indexer picks, per indexer head, K blocks of `index_block_size` keys
    (max-pooled q.k scores, the query's local blocks forced in); attention head h only sees the
    keys of its indexer head's blocks (h // (H / n)), causally (MM:493-637);
  - MLPs: SwiGLU-OAI, (clip(up, +-L) + 1) * g * sigmoid(alpha g) with g = min(gate, L), gate and
    up packed in one `gate_up_proj` (rows [:F] gate, [F:] up); MoE: sigmoid router, top-X of
    sigmoid + e_score_correction_bias, weights sigmoid / sum, times routed_scaling_factor, plus a
    shared expert (MM:175-275).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.minimax_m3 import MiniMaxM3Config
from models.common.layers import HIGHEST, Linear, einsum, fan_in_normal
from models.common.progress import DecodeProgress
from models.common.rope import apply_half_split


class GemmaRMSNorm(nnx.Module):
    """x / rms(x) * (1 + w) in float32, cast back; w starts at zero."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))  # [dim]

    def __call__(self, x: jax.Array) -> jax.Array:
        # x: [..., dim] -> [..., dim] in x's dtype
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (h * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab_size, hidden_size), jnp.float32).astype(dtype))  # [V, D]

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0)


# ---- RoPE ----------------------------------------------------------------------------------------


def rope_cos_sin(config: MiniMaxM3Config, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions i32[...] -> (cos, sin) f32[..., R/2]: transformers' default RoPE on R channels."""
    R = config.rotary_dim
    inv_freq = 1.0 / (np.float32(config.rope_theta) ** (np.arange(0, R, 2, dtype=np.float32) / np.float32(R)))
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq.astype(np.float32))
    return jnp.cos(angles), jnp.sin(angles)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., E]: the first R = 2 * cos.shape[-1] channels rotated (half-split), the rest kept."""
    R = 2 * cos.shape[-1]
    return jnp.concatenate([apply_half_split(x[..., :R], cos, sin), x[..., R:]], axis=-1)


# ---- MLPs ----------------------------------------------------------------------------------------


def swiglu_oai(gate_up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """[..., 2F] (gate then up) -> [..., F]: (clip(up, +-limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)."""
    F = gate_up.shape[-1] // 2
    g = jnp.minimum(gate_up[..., :F], limit)
    u = jnp.clip(gate_up[..., F:], -limit, limit)
    return (u + 1) * (g * jax.nn.sigmoid(g * alpha))


class MLP(nnx.Module):
    """Dense MLP and the shared expert: down(swiglu_oai(gate_up(x)))."""

    def __init__(self, config: MiniMaxM3Config, width: int, *, dtype, rngs: nnx.Rngs):
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        self.gate_up_proj = Linear(config.hidden_size, 2 * width, dtype=dtype, rngs=rngs)  # [2F, D]
        self.down_proj = Linear(width, config.hidden_size, dtype=dtype, rngs=rngs)  # [D, F]

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(swiglu_oai(self.gate_up_proj(x), self.limit, self.alpha))


class Router(nnx.Module):
    def __init__(self, config: MiniMaxM3Config, *, rngs: nnx.Rngs):
        E, D = config.num_experts, config.hidden_size
        self.top_k = config.num_experts_per_tok
        # float32 whatever the model dtype, as the reference scores in float32.
        self.weight = fan_in_normal(rngs, (E, D), jnp.float32, D)  # f32[E, D]
        self.e_score_correction_bias = nnx.Param(jnp.zeros((E,), jnp.float32))  # f32[E]

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (weights f32[T, X] summing to 1, expert ids i32[T, X])."""
        scores = jax.nn.sigmoid(einsum("td,ed->te", x.astype(jnp.float32), self.weight[...]))  # f32[T, E]
        _, experts = jax.lax.top_k(scores + self.e_score_correction_bias[...], self.top_k)  # i32[T, X]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        return weights / weights.sum(-1, keepdims=True), experts.astype(jnp.int32)


class Experts(nnx.Module):
    """Routed experts, [E, in, out] for ragged_dot: gate_up_proj [E, D, 2F], down_proj [E, F, D]."""

    def __init__(self, config: MiniMaxM3Config, *, dtype, rngs: nnx.Rngs):
        E, D, F = config.num_experts, config.hidden_size, config.intermediate_size
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        self.gate_up_proj = fan_in_normal(rngs, (E, D, 2 * F), dtype, D)  # [E, D, 2F]
        self.down_proj = fan_in_normal(rngs, (E, F, D), dtype, F)  # [E, F, D]

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """x [T, D], weights f32[T, X], experts i32[T, X] -> f32[T, D]: sum of weighted expert outputs."""
        T, X = experts.shape
        E = self.gate_up_proj.shape[0]
        order = jnp.argsort(experts.reshape(-1), stable=True)  # i32[T X]: assignments grouped by expert
        token = order // X
        group_sizes = jnp.bincount(experts.reshape(-1), length=E).astype(jnp.int32)  # i32[E]
        dtype = self.gate_up_proj.dtype
        xs = x[token].astype(dtype)  # [T X, D]

        def grouped(lhs, rhs):
            return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=HIGHEST)

        h = swiglu_oai(grouped(xs, self.gate_up_proj[...]), self.limit, self.alpha)  # [T X, F]
        out = grouped(h, self.down_proj[...]).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        return jnp.zeros((T, x.shape[-1]), jnp.float32).at[token].add(out)


class MoE(nnx.Module):
    def __init__(self, config: MiniMaxM3Config, *, dtype, rngs: nnx.Rngs):
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = Router(config, rngs=rngs)
        self.experts = Experts(config, dtype=dtype, rngs=rngs)
        width = config.shared_intermediate_size
        self.shared_experts = MLP(config, width, dtype=dtype, rngs=rngs) if width else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> [..., D]; tokens are flattened (ragged_dot has no batching rule)."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat)
        y = self.experts(flat, weights, experts) * self.routed_scaling_factor
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat).astype(jnp.float32)
        return y.astype(x.dtype).reshape(x.shape)


# ---- attention -----------------------------------------------------------------------------------


class BlockIndexer(nnx.Module):
    """Scores key blocks for each query, per indexer head (= KV group)."""

    def __init__(self, config: MiniMaxM3Config, *, dtype, rngs: nnx.Rngs):
        D, n, I = config.hidden_size, config.index_n_heads, config.index_head_dim
        self.config = config
        self.q_proj = Linear(D, n * I, dtype=dtype, rngs=rngs)  # [n I, D]
        self.k_proj = Linear(D, I, dtype=dtype, rngs=rngs)  # [I, D]
        self.q_norm = GemmaRMSNorm(I, config.rms_norm_eps, dtype=dtype)
        self.k_norm = GemmaRMSNorm(I, config.rms_norm_eps, dtype=dtype)

    def queries(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [..., T, D] -> index queries [..., T, n, I], normed and rotated."""
        c = self.config
        q = self.q_norm(self.q_proj(x).reshape(*x.shape[:-1], c.index_n_heads, c.index_head_dim))
        return apply_partial_rope(q, cos[..., None, :], sin[..., None, :])

    def keys(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [..., S, D] -> index keys [..., S, I] (one head), normed and rotated: what a cache keeps."""
        return apply_partial_rope(self.k_norm(self.k_proj(x)), cos, sin)


def select_blocks(config: MiniMaxM3Config, iq: jax.Array, ik: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """Block selection of one sequence.

    iq [T, n, I], ik [S, I] (key s at position k_pos[s] = s: keys are the sequence's first S
    tokens), q_pos i32[T] -> i32[n, T, K]: per indexer head and query, the chosen block indices
    b (keys [b*bs, (b+1)*bs)), in top-k order, -1 where fewer than K blocks are available.
    """
    bs, S = config.index_block_size, ik.shape[0]
    C = -(-S // bs)
    scores = einsum("tni,si->nts", iq.astype(jnp.float32), ik.astype(jnp.float32))  # f32[n, T, S]
    scores = jnp.where(k_pos[None, None, :] <= q_pos[None, :, None], scores, -jnp.inf)
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, C * bs - S)), constant_values=-jnp.inf)
    blocks = scores.reshape(*scores.shape[:2], C, bs).max(-1)  # f32[n, T, C]
    own = (q_pos // bs)[:, None]  # i32[T, 1]
    block_ids = jnp.arange(C, dtype=jnp.int32)[None, :]
    local = (block_ids <= own) & (block_ids > own - config.index_local_blocks)  # bool[T, C]
    blocks = jnp.where(local[None], jnp.inf, blocks)
    values, picks = jax.lax.top_k(blocks, min(config.index_topk_blocks, C))  # [n, T, K]
    return jnp.where(values == -jnp.inf, -1, picks).astype(jnp.int32)


def sorted_selection(picks: jax.Array) -> jax.Array:
    """i32[..., K] block picks -> valid indices ascending, then -1 (the fixture's format)."""
    big = jnp.iinfo(jnp.int32).max
    out = jnp.sort(jnp.where(picks < 0, big, picks), axis=-1)
    return jnp.where(out == big, -1, out)


def blocks_to_key_mask(picks: jax.Array, num_keys: int, block_size: int) -> jax.Array:
    """i32[..., K] block picks (-1 = none) -> bool[..., S]: key s lies in a picked block."""
    C = -(-num_keys // block_size)
    chosen = (picks[..., :, None] == jnp.arange(C, dtype=jnp.int32)).any(-2)  # bool[..., C]
    return jnp.repeat(chosen, block_size, axis=-1)[..., :num_keys]


class Attention(nnx.Module):
    def __init__(self, config: MiniMaxM3Config, layer: int, *, dtype, rngs: nnx.Rngs):
        D, H, N, E = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.config = config
        self.q_proj = Linear(D, H * E, dtype=dtype, rngs=rngs)  # [H E, D]
        self.k_proj = Linear(D, N * E, dtype=dtype, rngs=rngs)  # [N E, D]
        self.v_proj = Linear(D, N * E, dtype=dtype, rngs=rngs)  # [N E, D]
        self.o_proj = Linear(H * E, D, dtype=dtype, rngs=rngs)  # [D, H E]
        self.q_norm = GemmaRMSNorm(E, config.rms_norm_eps, dtype=dtype)
        self.k_norm = GemmaRMSNorm(E, config.rms_norm_eps, dtype=dtype)
        sparse = config.layer_types[layer] == "minimax_m3_sparse"
        self.indexer = BlockIndexer(config, dtype=dtype, rngs=rngs) if sparse else None

    def queries(self, x, cos, sin):
        """x [..., T, D] -> q [..., T, H, E], normed and rotated."""
        c = self.config
        q = self.q_norm(self.q_proj(x).reshape(*x.shape[:-1], c.num_heads, c.head_dim))
        return apply_partial_rope(q, cos[..., None, :], sin[..., None, :])

    def keys_values(self, x, cos, sin):
        """x [..., S, D] -> (k, v) [..., S, N, E]; k normed and rotated: what a cache keeps."""
        c = self.config
        k = self.k_norm(self.k_proj(x).reshape(*x.shape[:-1], c.num_kv_heads, c.head_dim))
        v = self.v_proj(x).reshape(*x.shape[:-1], c.num_kv_heads, c.head_dim)
        return apply_partial_rope(k, cos[..., None, :], sin[..., None, :]), v

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        """q [T, H, E], k/v [S, N, E], mask bool[H, T, S] -> o_proj output [T, D]."""
        c = self.config
        G = c.num_heads // c.num_kv_heads
        qg = q.reshape(q.shape[0], c.num_kv_heads, G, c.head_dim)
        logits = einsum("tngd,snd->ngts", qg.astype(jnp.float32), k.astype(jnp.float32)) * (c.head_dim**-0.5)
        logits = jnp.where(mask.reshape(c.num_kv_heads, G, *mask.shape[1:]), logits, -jnp.inf)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # [N, G, T, S]
        out = einsum("ngts,snd->tngd", probs, v).reshape(q.shape[0], -1)  # [T, H E]
        return self.o_proj(out)


class DecoderLayer(nnx.Module):
    def __init__(self, config: MiniMaxM3Config, layer: int, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.self_attn = Attention(config, layer, dtype=dtype, rngs=rngs)
        if config.mlp_layer_types[layer] == "sparse":
            self.mlp = MoE(config, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(config, config.dense_intermediate_size, dtype=dtype, rngs=rngs)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def __call__(self, h: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array | None, tuple]:
        """One sequence, positions 0..T-1: h [T, D] -> (h [T, D], block picks i32[n, T, K] or
        None, what a cache keeps: (k [T, N, E], v [T, N, E], index keys [T, I] or None))."""
        c, attn = self.config, self.self_attn
        T = h.shape[0]
        pos = jnp.arange(T, dtype=jnp.int32)
        x = self.input_layernorm(h)
        q = attn.queries(x, cos, sin)
        k, v = attn.keys_values(x, cos, sin)
        mask = jnp.broadcast_to(pos[None, :] <= pos[:, None], (c.num_heads, T, T))  # bool[H, T, S]
        picks = index_keys = None
        if attn.indexer is not None:
            index_keys = attn.indexer.keys(x, cos, sin)
            picks = select_blocks(c, attn.indexer.queries(x, cos, sin), index_keys, pos, pos)
            keep = blocks_to_key_mask(picks, T, c.index_block_size)  # bool[n, T, S]
            mask = mask & jnp.repeat(keep, c.num_heads // c.index_n_heads, axis=0)
        h = h + attn.attend(q, k, v, mask)
        return h + self.mlp(self.post_attention_layernorm(h)), picks, (k, v, index_keys)

    def decode(self, h, cos, sin, positions, k_cache, v_cache, index_keys):
        """One new token per sequence: h [B, D] at positions i32[B] (cos/sin f32[B, R/2]);
        k_cache / v_cache [B, C, N, E] and index_keys [B, C, I] (sparse layers, else None) hold
        every earlier token. Returns (h [B, D], k_cache, v_cache, index_keys) with the token written."""
        c, attn = self.config, self.self_attn
        B, C = k_cache.shape[:2]
        rows = jnp.arange(B)
        x = self.input_layernorm(h)
        q = attn.queries(x, cos, sin)  # [B, H, E]
        k, v = attn.keys_values(x, cos, sin)  # [B, N, E]
        k_cache = k_cache.at[rows, positions].set(k.astype(k_cache.dtype))
        v_cache = v_cache.at[rows, positions].set(v.astype(v_cache.dtype))
        key_pos = jnp.arange(C, dtype=jnp.int32)
        mask = jnp.broadcast_to((key_pos[None, :] <= positions[:, None])[:, None, None, :], (B, c.num_heads, 1, C))
        if attn.indexer is not None:
            index_keys = index_keys.at[rows, positions].set(attn.indexer.keys(x, cos, sin).astype(index_keys.dtype))
            iq = attn.indexer.queries(x, cos, sin)  # [B, n, I]
            picks = jax.vmap(lambda q1, keys, p: select_blocks(c, q1[None], keys, p[None], key_pos))(iq, index_keys, positions)
            keep = blocks_to_key_mask(picks, C, c.index_block_size)  # bool[B, n, 1, C]
            mask = mask & jnp.repeat(keep, c.num_heads // c.index_n_heads, axis=1)
        out = jax.vmap(attn.attend)(q[:, None], k_cache, v_cache, mask)[:, 0]  # [B, D]
        h = h + out
        return h + self.mlp(self.post_attention_layernorm(h)), k_cache, v_cache, index_keys


class MiniMaxM3ForCausalLM(nnx.Module):
    """MiniMaxM3VLForCausalLM's text weights (HF `model.*` and `lm_head`)."""

    def __init__(self, config: MiniMaxM3Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dtype=dtype, rngs=rngs) for i in range(config.num_layers)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        tied = config.tie_word_embeddings
        self.lm_head = None if tied else Linear(config.hidden_size, config.vocab_size, dtype=dtype, rngs=rngs)

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., D] -> f32[..., V]."""
        h = self.norm(h)
        if self.lm_head is None:
            return einsum("...d,vd->...v", h, self.embed_tokens.weight[...]).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)


def forward_with_selections(model: MiniMaxM3ForCausalLM, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """No-cache forward: tokens i32[B, T] -> (logits f32[B, T, V], block picks i32[J, B, n, T, K]
    of the J sparse layers in config.sparse_layers order, top-k order, -1 padded;
    `sorted_selection` gives the fixture's ascending form). J = 0 gives an empty array."""
    config = model.config
    T = tokens.shape[1]
    cos, sin = rope_cos_sin(config, jnp.arange(T, dtype=jnp.int32))  # f32[T, R/2]

    def one_sequence(seq):
        h = model.embed_tokens(seq)  # [T, D]
        picks = []
        for layer in model.layers:
            h, p, _ = layer(h, cos, sin)
            if p is not None:
                picks.append(p)
        K = min(config.index_topk_blocks, -(-T // config.index_block_size))
        stacked = jnp.stack(picks) if picks else jnp.zeros((0, config.index_n_heads, T, K), jnp.int32)
        return model.logits(h), stacked

    logits, picks = jax.lax.map(one_sequence, tokens)  # ragged_dot (MoE) has no batching rule
    return logits, jnp.moveaxis(picks, 1, 0)


def forward(model: MiniMaxM3ForCausalLM, tokens: jax.Array) -> jax.Array:
    """No-cache forward as transformers runs it: tokens i32[B, T] -> logits f32[B, T, V]."""
    return forward_with_selections(model, tokens)[0]


def greedy_generate(model: MiniMaxM3ForCausalLM, prompts: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Greedy continuation without a cache: prompts i32[B, P] -> (tokens i32[B, N], step logits
    f32[B, N, V]). Each step runs the full forward over a fixed [B, P + N - 1] buffer (one
    compile): positions past the current end hold padding, which causality keeps out of every
    earlier query (the indexer masks future keys before pooling, routing is per token)."""
    B, P = prompts.shape
    total = P + num_tokens - 1
    buffer = jnp.zeros((B, total), jnp.int32).at[:, :P].set(prompts)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, buffer, length):
        logits = forward(nnx.merge(graphdef, state), buffer)  # f32[B, total, V]
        last = jax.lax.dynamic_index_in_dim(logits, length - 1, axis=1, keepdims=False)  # f32[B, V]
        return jnp.argmax(last, axis=-1).astype(jnp.int32), last

    tokens, step_logits = [], []
    for j in range(num_tokens):
        token, last = step(state, buffer, P + j)
        tokens.append(token)
        step_logits.append(last)
        if P + j < total:
            buffer = buffer.at[:, P + j].set(token)
    return jnp.stack(tokens, axis=1), jnp.stack(step_logits, axis=1)


# ---- decoding with a cache -----------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class M3Cache:
    """Everything on the device (no HiSparse yet): per layer K and V after norm + RoPE, per
    sparse layer the index keys after norm + RoPE, as transformers' cache keeps them (MM:57-150).

    k, v [L, B, C, N, E]; index_keys [J, B, C, I] (J = len(config.sparse_layers)), model dtype.
    """

    k: jax.Array
    v: jax.Array
    index_keys: jax.Array


def create_cache(model: MiniMaxM3ForCausalLM, batch: int, max_context: int) -> M3Cache:
    c, dtype = model.config, model.dtype
    kv = (c.num_layers, batch, max_context, c.num_kv_heads, c.head_dim)
    return M3Cache(jnp.zeros(kv, dtype), jnp.zeros(kv, dtype), jnp.zeros((len(c.sparse_layers), batch, max_context, c.index_head_dim), dtype))


def forward_with_cache_rows(model: MiniMaxM3ForCausalLM, tokens: jax.Array, last=None):
    """Prompts i32[B, T] -> (logits f32[B, V] of position `last` (int or i32[]; default T - 1:
    a padded prompt passes its real last position), k / v [L, B, T, N, E] after norm + RoPE,
    index keys [J, B, T, I]): what a prefill writes to the caches."""
    config = model.config
    T = tokens.shape[1]
    cos, sin = rope_cos_sin(config, jnp.arange(T, dtype=jnp.int32))

    def one_sequence(seq):
        h = model.embed_tokens(seq)
        ks, vs, iks = [], [], []
        for layer in model.layers:
            h, _, (k, v, ik) = layer(h, cos, sin)
            ks.append(k)
            vs.append(v)
            if ik is not None:
                iks.append(ik)
        iks = jnp.stack(iks) if iks else jnp.zeros((0, T, config.index_head_dim), h.dtype)
        return model.logits(h[T - 1 if last is None else last]), jnp.stack(ks), jnp.stack(vs), iks

    logits, k, v, ik = jax.lax.map(one_sequence, tokens)  # k [B, L, T, N, E], ik [B, J, T, I]
    return logits, jnp.moveaxis(k, 0, 1), jnp.moveaxis(v, 0, 1), jnp.moveaxis(ik, 0, 1)


def prefill(model: MiniMaxM3ForCausalLM, cache: M3Cache, tokens: jax.Array) -> tuple[M3Cache, jax.Array]:
    """Prompts i32[B, T] (one length for all) into positions 0..T-1 of the cache ->
    (cache, last-position logits f32[B, V])."""
    T = tokens.shape[1]
    logits, k, v, ik = forward_with_cache_rows(model, tokens)
    cache = M3Cache(
        cache.k.at[:, :, :T].set(k.astype(cache.k.dtype)),
        cache.v.at[:, :, :T].set(v.astype(cache.v.dtype)),
        cache.index_keys.at[:, :, :T].set(ik.astype(cache.index_keys.dtype)),
    )
    return cache, logits


def decode_step(model: MiniMaxM3ForCausalLM, cache: M3Cache, tokens: jax.Array, positions: jax.Array) -> tuple[M3Cache, jax.Array]:
    """One token per sequence: tokens i32[B] at positions i32[B] (= tokens already cached) ->
    (cache with the tokens written, logits f32[B, V])."""
    config = model.config
    cos, sin = rope_cos_sin(config, positions)  # f32[B, R/2]
    h = model.embed_tokens(tokens)  # [B, D]
    ks, vs, iks = [], [], []
    j = 0
    for i, layer in enumerate(model.layers):
        ik = None
        if layer.self_attn.indexer is not None:
            ik = cache.index_keys[j]
        h, k, v, ik = layer.decode(h, cos, sin, positions, cache.k[i], cache.v[i], ik)
        ks.append(k)
        vs.append(v)
        if ik is not None:
            iks.append(ik)
            j += 1
    index_keys = jnp.stack(iks) if iks else cache.index_keys
    return M3Cache(jnp.stack(ks), jnp.stack(vs), index_keys), model.logits(h)


def generate(model: MiniMaxM3ForCausalLM, prompts: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Greedy decoding with the cache: prompts i32[B, P] -> (tokens i32[B, N], step logits f32[B, N, V])."""
    B, P = prompts.shape
    graphdef, state = nnx.split(model)
    cache = create_cache(model, B, P + num_tokens)
    progress = DecodeProgress(num_tokens - 1, model.config.model_type)
    progress.prefill(B, P)
    cache, last = jax.jit(lambda s, c, t: prefill(nnx.merge(graphdef, s), c, t))(state, cache, prompts)
    progress.prefilled(wait_for=last)
    step = jax.jit(lambda s, c, t, p: decode_step(nnx.merge(graphdef, s), c, t, p), donate_argnums=1)
    tokens, logits = [], [last]
    token = jnp.argmax(last, -1).astype(jnp.int32)
    for j in range(num_tokens):
        tokens.append(token)
        if j + 1 < num_tokens:
            cache, last = step(state, cache, token, jnp.full((B,), P + j, jnp.int32))
            logits.append(last)
            token = jnp.argmax(last, -1).astype(jnp.int32)
            progress.step(j + 1, wait_for=token)
    return jnp.stack(tokens, axis=1), jnp.stack(logits, axis=1)
