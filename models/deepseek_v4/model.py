"""DeepSeek-V4 in Flax NNX: modules and the no-cache forward, as transformers 5.24.0 computes it.

Letters: B sequences, T tokens, D hidden, V vocab, H query heads, A head_dim (the one shared K=V
head), P rotated dims (qk_rope_head_dim, the *trailing* P of a head), Q q_lora_rank, G o_groups,
R o_lora_rank, N compressed entries, M tokens per entry (compress rate), C hc_mult streams,
E routed experts, X experts per token, F moe_intermediate_size, J indexer heads, I index_head_dim,
K index_topk.

Module and attribute names follow the checkpoint's upstream-style names (what transformers'
`save_pretrained` writes): `model.layers.3.attn.indexer.compressor.wkv.weight` is
`model.layers[3].attn.indexer.compressor.wkv.weight`, `head.weight` is `model.head.weight`.
Weights keep the checkpoint layout ([out, in]); routed experts are stacked [E, in, out] for
`ragged_dot` (the loader transposes). Every matmul runs at Precision.HIGHEST.

Per layer (transformers `DeepseekV4DecoderLayer`): mHC collapses the C residual streams, then
attn_norm -> attention, mHC expands back; the same around ffn_norm -> MoE.

Attention: q = unweighted-RMSNorm(wq_b(q_norm(wq_a x))) per head, one K=V head
kv = norm(wkv x), both rotated on their trailing P channels (interleaved pairs, layout kept);
keys = the causal window (t - W, t] plus, on CSA/HCA layers, the layer's compressed entries (HCA:
every causal one; CSA: the lightning indexer's top-k); softmax with a per-head sink logit; the
output's rope slice is rotated back (-sin) at the query position; grouped low-rank output
projection wo_a (block-diagonal, G blocks) then wo_b.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.deepseek_v4 import CSA, SLIDING, DeepseekV4Config
from configs.model import RopeConfig
from models.common import rope as rope_lib
from models.common.layers import HIGHEST, Embedding, Linear, RMSNorm, einsum, fan_in_normal

# ---- small pieces ---------------------------------------------------------------------------------


def unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """transformers' DeepseekV4UnweightedRMSNorm: x * rsqrt(mean(x^2) + eps), the factor in f32."""
    h = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps).astype(x.dtype)


def cos_sin(rope: RopeConfig, dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions i32[...] -> cos, sin f32[..., P/2] (V4 never rescales them: attention_factor 1)."""
    return rope_lib.cos_sin(rope, dim, positions)


def rotate_trailing(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """V4's apply_rotary_pos_emb: rotate the trailing P channels of x [..., A] in interleaved pairs
    (2i, 2i+1) -> (x0 cos - x1 sin, x1 cos + x0 sin), written back in the same interleaved
    layout (the layout matters here: K=V, so rotated channels reach the output projection).
    cos/sin broadcastable to [..., P/2]."""
    P = 2 * cos.shape[-1]
    nope, r = x[..., :-P], x[..., -P:].astype(jnp.float32)
    x0, x1 = r[..., 0::2], r[..., 1::2]
    rotated = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1).reshape(r.shape)
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)


# ---- compressors and the indexer -----------------------------------------------------------------


class Compressor(nnx.Module):
    """One compressed series: HCA (`overlap=False`: an entry pools M tokens) or CSA / the indexer's
    (`overlap=True`: projections 2*width wide, entry w pools channels [:width] of window w-1 and
    [width:] of window w over 2M slots). Checkpoint names: wkv, wgate, ape, norm."""

    def __init__(self, config: DeepseekV4Config, rate: int, width: int, overlap: bool, *, dtype, rngs: nnx.Rngs):
        self.rate, self.width, self.overlap = rate, width, overlap
        self.eps = config.rms_norm_eps
        wide = 2 * width if overlap else width
        self.wkv = Linear(config.hidden_size, wide, dtype=dtype, rngs=rngs)  # [c*width, D]
        self.wgate = Linear(config.hidden_size, wide, dtype=dtype, rngs=rngs)  # [c*width, D]
        # position bias per slot of a window; kept float32 as transformers does
        self.ape = nnx.Param(0.5 * jax.random.normal(rngs.params(), (rate, wide), jnp.float32))  # f32[M, c*width]
        self.norm = RMSNorm(width, config.rms_norm_eps, dtype=jnp.float32)

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [..., T, D] -> (kv, gate) [..., T, c*width]: the per-token state a cache would buffer."""
        return self.wkv(x), self.wgate(x)

    def pool(self, kv: jax.Array, gate: jax.Array, prior: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """kv, gate [B, N*M, c*width] (whole windows) -> entries before norm/RoPE [B, N, width].

        prior: (kv, gate) [B, M, width] of the previous window's first half (CSA, decoding);
        None leaves window 0's first half empty (gate -inf), as on a first forward."""
        B, L, _ = kv.shape
        M, W = self.rate, self.width
        N = L // M
        kv = kv.reshape(B, N, M, -1)
        gate = gate.reshape(B, N, M, -1) + self.ape[...].astype(gate.dtype)
        if self.overlap:
            if prior is None:
                prev_kv = jnp.zeros((B, 1, M, W), kv.dtype)
                prev_gate = jnp.full((B, 1, M, W), -jnp.inf, gate.dtype)
            else:
                prev_kv, prev_gate = prior[0][:, None], prior[1][:, None]
            first_kv = jnp.concatenate([prev_kv, kv[:, :-1, :, :W]], axis=1)  # [B, N, M, W]
            first_gate = jnp.concatenate([prev_gate, gate[:, :-1, :, :W]], axis=1)
            kv = jnp.concatenate([first_kv, kv[..., W:]], axis=2)  # [B, N, 2M, W]
            gate = jnp.concatenate([first_gate, gate[..., W:]], axis=2)
        weights = jax.nn.softmax(gate.astype(jnp.float32), axis=2).astype(kv.dtype)
        return jnp.sum(kv * weights, axis=2)

    def finish(self, pooled: jax.Array, first_entry: int, rope: RopeConfig, rope_dim: int) -> jax.Array:
        """pooled [B, N, width] -> entries [B, N, width]: norm, then RoPE at position w*M."""
        N = pooled.shape[1]
        positions = (jnp.arange(N, dtype=jnp.int32) + first_entry) * self.rate
        cos, sin = cos_sin(rope, rope_dim, positions)  # f32[N, P/2]
        return rotate_trailing(self.norm(pooled), cos, sin)

    def __call__(self, x: jax.Array, rope: RopeConfig, rope_dim: int) -> jax.Array:
        """x [B, T, D] -> entries [B, T // M, width] of every complete window (stateless forward)."""
        usable = (x.shape[1] // self.rate) * self.rate
        kv, gate = self.project(x[:, :usable])
        return self.finish(self.pool(kv, gate), 0, rope, rope_dim)


def causal_entries(T: int, N: int, rate: int, first_position: int = 0) -> jax.Array:
    """bool[T, N]: query t (position first_position + t) may see entry w iff w < (pos + 1) // M."""
    positions = jnp.arange(T, dtype=jnp.int32) + first_position
    return jnp.arange(N, dtype=jnp.int32)[None, :] < ((positions + 1) // rate)[:, None]


class Indexer(nnx.Module):
    """The CSA lightning indexer: its own overlapping compressor at index_head_dim, queries from
    the attention's q LoRA residual. Checkpoint names: wq_b, weights_proj, compressor.*."""

    def __init__(self, config: DeepseekV4Config, *, dtype, rngs: nnx.Rngs):
        self.num_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.rope, self.rope_dim = config.rope_compress, config.qk_rope_head_dim
        self.compressor = Compressor(config, config.csa_rate, config.index_head_dim, True, dtype=dtype, rngs=rngs)
        self.wq_b = Linear(config.q_lora_rank, self.num_heads * self.head_dim, dtype=dtype, rngs=rngs)  # [J*I, Q]
        self.weights_proj = Linear(config.hidden_size, self.num_heads, dtype=jnp.float32, rngs=rngs)  # f32[J, D]

    def queries(self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [..., D], q_resid [..., Q], cos/sin f32[..., P/2] -> (q [..., J, I], weights f32[..., J])."""
        q = self.wq_b(q_resid).reshape(*q_resid.shape[:-1], self.num_heads, self.head_dim)
        q = rotate_trailing(q, cos[..., None, :], sin[..., None, :])
        weights = self.weights_proj(x).astype(jnp.float32) * self.num_heads**-0.5
        return q, weights

    def scores(self, q: jax.Array, weights: jax.Array, keys: jax.Array) -> jax.Array:
        """q [B, T, J, I], weights f32[B, T, J], keys [B, N, I] -> f32[B, T, N]:
        sum_j weights_j * relu(q_j . k) / sqrt(I)."""
        per_head = einsum("btji,bni->btjn", q.astype(jnp.float32), keys.astype(jnp.float32))
        per_head = jax.nn.relu(per_head) * self.head_dim**-0.5
        return einsum("btj,btjn->btn", weights, per_head)


def select_topk(scores: jax.Array, allowed: jax.Array, k: int) -> jax.Array:
    """scores f32[..., N], allowed bool[..., N] -> i32[..., K]: the best allowed entries, -1 where
    fewer than K are allowed (the reference returns -1 there too)."""
    take = min(k, scores.shape[-1])
    if take == 0:
        return jnp.full((*scores.shape[:-1], k), -1, jnp.int32)
    values, idx = jax.lax.top_k(jnp.where(allowed, scores, -jnp.inf), take)
    idx = jnp.where(values > -jnp.inf, idx, -1).astype(jnp.int32)
    if take < k:
        idx = jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, k - take)], constant_values=-1)
    return idx


def sorted_selection(topk: jax.Array) -> jax.Array:
    """i32[..., K] -> the same entries ascending, -1 padding last (the fixture's layout)."""
    big = jnp.iinfo(jnp.int32).max
    s = jnp.sort(jnp.where(topk < 0, big, topk), axis=-1)
    return jnp.where(s == big, -1, s)


# ---- attention -----------------------------------------------------------------------------------


class Attention(nnx.Module):
    """Checkpoint names: wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b, attn_sink, compressor, indexer."""

    def __init__(self, config: DeepseekV4Config, layer: int, *, dtype, rngs: nnx.Rngs):
        self.config, self.layer = config, layer
        self.layer_type = config.layer_types[layer]
        H, A, D = config.num_heads, config.head_dim, config.hidden_size
        G, R = config.o_groups, config.o_lora_rank
        self.wq_a = Linear(D, config.q_lora_rank, dtype=dtype, rngs=rngs)  # [Q, D]
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, dtype=dtype)
        self.wq_b = Linear(config.q_lora_rank, H * A, dtype=dtype, rngs=rngs)  # [H*A, Q]
        self.wkv = Linear(D, A, dtype=dtype, rngs=rngs)  # [A, D]
        self.norm = RMSNorm(A, config.rms_norm_eps, dtype=dtype)
        self.wo_a = Linear(H * A // G, G * R, dtype=dtype, rngs=rngs)  # [G*R, H*A/G]: G diagonal blocks
        self.wo_b = Linear(G * R, D, dtype=dtype, rngs=rngs)  # [D, G*R]
        self.attn_sink = nnx.Param(jax.random.normal(rngs.params(), (H,), jnp.float32))  # f32[H]
        rate = config.compress_rate(layer)
        compressed = self.layer_type != SLIDING
        self.compressor = Compressor(config, rate, A, self.layer_type == CSA, dtype=dtype, rngs=rngs) if compressed else None
        self.indexer = Indexer(config, dtype=dtype, rngs=rngs) if self.layer_type == CSA else None

    @property
    def rope(self) -> RopeConfig:
        return self.config.rope(self.layer)

    def queries(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [..., D] (normed) -> (q_resid [..., Q], rotated queries [..., H, A])."""
        q_resid = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_resid).reshape(*x.shape[:-1], self.config.num_heads, self.config.head_dim)
        q = unweighted_rms_norm(q, self.config.rms_norm_eps)
        return q_resid, rotate_trailing(q, cos[..., None, :], sin[..., None, :])

    def kv(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [..., D] -> the rotated K=V row [..., A] (what the window cache holds)."""
        return rotate_trailing(self.norm(self.wkv(x)), cos, sin)

    def output(self, attn: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """attn [..., H, A] (softmax-weighted rows) -> [..., D]: rotate back, wo_a blocks, wo_b."""
        G, R = self.config.o_groups, self.config.o_lora_rank
        attn = rotate_trailing(attn, cos[..., None, :], -sin[..., None, :])
        grouped = attn.reshape(*attn.shape[:-2], G, -1)  # [..., G, H*A/G]
        w = self.wo_a.weight[...].reshape(G, R, -1)  # [G, R, H*A/G]
        y = einsum("...gi,gri->...gr", grouped.astype(w.dtype), w)
        return self.wo_b(y.reshape(*y.shape[:-2], G * R))


def attend(q: jax.Array, keys: jax.Array, mask: jax.Array, sinks: jax.Array, scale: float) -> jax.Array:
    """q [B, T, H, A], keys (= values) [B, S, A], mask bool[B, T, S], sinks f32[H] -> [B, T, H, A].

    softmax over the S keys plus one sink logit per head (dropped after the softmax), in f32."""
    logits = einsum("btha,bsa->bhts", q.astype(jnp.float32), keys.astype(jnp.float32)) * scale
    logits = jnp.where(mask[:, None], logits, -jnp.inf)  # f32[B, H, T, S]
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], (*logits.shape[:-1], 1))
    combined = jnp.concatenate([logits, sink], axis=-1)
    probs = jax.nn.softmax(combined - jnp.max(combined, axis=-1, keepdims=True), axis=-1)[..., :-1]
    return einsum("bhts,bsa->btha", probs, keys.astype(jnp.float32)).astype(q.dtype)


# ---- mHC -----------------------------------------------------------------------------------------


class HyperConnection:
    """Parameters fn f32[(2+C)*C, C*D], base f32[(2+C)*C], scale f32[3] of one mHC site (held by
    the decoder layer as hc_<site>_{fn,base,scale}, the checkpoint's names)."""

    @staticmethod
    def weights(streams: jax.Array, fn, base, scale, config: DeepseekV4Config):
        """streams [..., C, D] -> (pre f32[..., C], post f32[..., C], comb f32[..., C, C])."""
        C = config.hc_mult
        flat = unweighted_rms_norm(streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32), config.rms_norm_eps)
        mixes = einsum("...k,ok->...o", flat, fn.astype(jnp.float32))
        pre_w, post_w, comb_w = mixes[..., :C], mixes[..., C : 2 * C], mixes[..., 2 * C :]
        base = base.astype(jnp.float32)
        scale = scale.astype(jnp.float32)
        pre = jax.nn.sigmoid(pre_w * scale[0] + base[:C]) + config.hc_eps
        post = 2 * jax.nn.sigmoid(post_w * scale[1] + base[C : 2 * C])
        comb = comb_w.reshape(*comb_w.shape[:-1], C, C) * scale[2] + base[2 * C :].reshape(C, C)
        comb = jax.nn.softmax(comb, axis=-1) + config.hc_eps
        eps = config.hc_eps
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
        for _ in range(config.hc_sinkhorn_iters - 1):  # Sinkhorn: rows then columns
            comb = comb / (comb.sum(-1, keepdims=True) + eps)
            comb = comb / (comb.sum(-2, keepdims=True) + eps)
        return pre, post, comb

    @staticmethod
    def collapse(streams: jax.Array, pre: jax.Array) -> jax.Array:
        """streams [..., C, D], pre f32[..., C] -> [..., D]: sum_j pre_j X_j."""
        return jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=-2).astype(streams.dtype)

    @staticmethod
    def expand(streams: jax.Array, out: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
        """new stream k = post_k * out + sum_j comb[j, k] X_j: [..., C, D]."""
        dtype = streams.dtype
        mixed = einsum("...jk,...jd->...kd", comb.astype(dtype), streams)
        return post.astype(dtype)[..., None] * out[..., None, :] + mixed


class HyperHead(nnx.Module):
    """The final stream collapse (checkpoint: model.hc_head.{hc_fn, hc_base, hc_scale})."""

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs):
        C, D = config.hc_mult, config.hidden_size
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = fan_in_normal(rngs, (C, C * D), jnp.float32, C * D)  # f32[C, C*D]
        self.hc_base = nnx.Param(jnp.zeros((C,), jnp.float32))
        self.hc_scale = nnx.Param(jnp.ones((1,), jnp.float32))

    def __call__(self, streams: jax.Array) -> jax.Array:
        """[..., C, D] -> [..., D]."""
        flat = unweighted_rms_norm(streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32), self.norm_eps)
        mixes = einsum("...k,ok->...o", flat, self.hc_fn[...])
        pre = jax.nn.sigmoid(mixes * self.hc_scale[...] + self.hc_base[...]) + self.eps
        return HyperConnection.collapse(streams, pre)


# ---- MoE -----------------------------------------------------------------------------------------


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, limit)) * clip(up, -limit, limit)."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


class SharedExpert(nnx.Module):
    """w1 gate [F, D], w3 up [F, D], w2 down [D, F]; the swiglu clamp applies here too."""

    def __init__(self, config: DeepseekV4Config, *, dtype, rngs: nnx.Rngs):
        D, F = config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.w1 = Linear(D, F, dtype=dtype, rngs=rngs)
        self.w2 = Linear(F, D, dtype=dtype, rngs=rngs)
        self.w3 = Linear(D, F, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class Gate(nnx.Module):
    """Router: weight f32[E, D]; `moe` layers also bias f32[E] (e_score_correction_bias), `hash_moe`
    layers tid2eid i32[V, X] (which experts each token id goes to)."""

    def __init__(self, config: DeepseekV4Config, is_hash: bool, *, rngs: nnx.Rngs):
        E, D = config.n_routed_experts, config.hidden_size
        self.is_hash, self.top_k = is_hash, config.num_experts_per_tok
        self.scoring_func, self.scaling = config.scoring_func, config.routed_scaling_factor
        self.weight = fan_in_normal(rngs, (E, D), jnp.float32, D)
        table = jax.random.randint(rngs.params(), (config.vocab_size, self.top_k), 0, E, jnp.int32)
        self.tid2eid = nnx.Param(table) if is_hash else None  # i32[V, X]
        self.bias = None if is_hash else nnx.Param(jnp.zeros((E,), jnp.float32))  # f32[E]

    def __call__(self, x: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, D], tokens i32[N] -> (weights f32[N, X], experts i32[N, X])."""
        logits = einsum("nd,ed->ne", x.astype(jnp.float32), self.weight[...])
        if self.scoring_func == "sqrtsoftplus":
            scores = jnp.sqrt(jax.nn.softplus(logits))
        else:
            scores = jax.nn.sigmoid(logits)
        if self.is_hash:
            experts = self.tid2eid[...][tokens].astype(jnp.int32)
        else:
            _, experts = jax.lax.top_k(scores + self.bias[...], self.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * self.scaling, experts.astype(jnp.int32)


class Experts(nnx.Module):
    """Routed experts stacked [E, in, out] (checkpoint: ffn.experts.<e>.{w1,w2,w3}.weight [out, in])."""

    def __init__(self, config: DeepseekV4Config, *, dtype, rngs: nnx.Rngs):
        E, D, F = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.w1 = fan_in_normal(rngs, (E, D, F), dtype, D)  # gate
        self.w3 = fan_in_normal(rngs, (E, D, F), dtype, D)  # up
        self.w2 = fan_in_normal(rngs, (E, F, D), dtype, F)  # down

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """x [N, D], weights f32[N, X], experts i32[N, X] -> [N, D]."""
        N, X = experts.shape
        E = self.w1.shape[0]
        order = jnp.argsort(experts.reshape(-1), stable=True)
        token = order // X
        sizes = jnp.bincount(experts.reshape(-1), length=E).astype(jnp.int32)
        xs = x[token].astype(self.w1.dtype)

        def grouped(lhs, rhs):
            return jax.lax.ragged_dot(lhs, rhs, sizes, precision=HIGHEST)

        h = clamped_swiglu(grouped(xs, self.w1[...]), grouped(xs, self.w3[...]), self.limit)
        out = grouped(h, self.w2[...]).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        return jnp.zeros((N, x.shape[-1]), jnp.float32).at[token].add(out).astype(x.dtype)


class MoE(nnx.Module):
    def __init__(self, config: DeepseekV4Config, layer: int, *, dtype, rngs: nnx.Rngs):
        self.gate = Gate(config, config.mlp_layer_types[layer] == "hash_moe", rngs=rngs)
        self.experts = Experts(config, dtype=dtype, rngs=rngs)
        self.shared_experts = SharedExpert(config, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, tokens: jax.Array) -> jax.Array:
        """x [..., D], tokens i32[...] -> [..., D]."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat, tokens.reshape(-1))
        return (self.experts(flat, weights, experts) + self.shared_experts(flat)).reshape(x.shape)


# ---- the model -----------------------------------------------------------------------------------


class DecoderLayer(nnx.Module):
    def __init__(self, config: DeepseekV4Config, layer: int, *, dtype, rngs: nnx.Rngs):
        self.config = config
        C, D = config.hc_mult, config.hidden_size
        self.attn = Attention(config, layer, dtype=dtype, rngs=rngs)
        self.ffn = MoE(config, layer, dtype=dtype, rngs=rngs)
        self.attn_norm = RMSNorm(D, config.rms_norm_eps, dtype=jnp.float32)
        self.ffn_norm = RMSNorm(D, config.rms_norm_eps, dtype=jnp.float32)
        n = (2 + C) * C
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", fan_in_normal(rngs, (n, C * D), jnp.float32, C * D))
            setattr(self, f"hc_{site}_base", nnx.Param(jnp.zeros((n,), jnp.float32)))
            setattr(self, f"hc_{site}_scale", nnx.Param(jnp.ones((3,), jnp.float32)))

    def hc(self, site: str, streams: jax.Array):
        return HyperConnection.weights(
            streams, getattr(self, f"hc_{site}_fn")[...], getattr(self, f"hc_{site}_base")[...],
            getattr(self, f"hc_{site}_scale")[...], self.config,
        )  # fmt: skip


class LayerAux(NamedTuple):
    """What a no-cache forward exposes of one layer (the fixture's intermediate goldens)."""

    compressed_kv: jax.Array | None  # [B, N, A]: entries after norm + RoPE (CSA/HCA layers)
    indexer_keys: jax.Array | None  # [B, N, I]: the indexer's entries (CSA layers)
    topk: jax.Array | None  # i32[B, T, K]: the indexer's selection, ascending, -1 last (CSA layers)
    rows: jax.Array | None = None  # [B, T, A]: every token's rotated K=V row (a cache's window)
    raw: tuple | None = None  # (kv, gate) [B, T, c*A]: the compressor's projections (CSA/HCA)
    index_raw: tuple | None = None  # (kv, gate) [B, T, 2I]: the indexer compressor's (CSA)


class DeepseekV4ForCausalLM(nnx.Module):
    """DeepseekV4ForCausalLM weights (checkpoint `model.*` and `head.weight`)."""

    def __init__(self, config: DeepseekV4Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dtype=dtype, rngs=rngs) for i in range(config.num_layers)])
        self.hc_head = HyperHead(config, rngs=rngs)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=jnp.float32)
        tied = config.tie_word_embeddings
        self.head = None if tied else Linear(config.hidden_size, config.vocab_size, dtype=dtype, rngs=rngs)

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def logits(self, streams: jax.Array) -> jax.Array:
        """streams [..., C, D] (last layer's output) -> f32[..., V]."""
        h = self.norm(self.hc_head(streams)).astype(self.dtype)
        if self.head is None:
            return einsum("...d,vd->...v", h, self.embed_tokens.weight[...]).astype(jnp.float32)
        return self.head(h).astype(jnp.float32)


def _layer_forward(layer: DecoderLayer, streams: jax.Array, tokens: jax.Array, with_cache_inputs: bool = False):
    """One layer over whole sequences, positions 0..T-1, no cache: streams [B, T, C, D] ->
    (streams, LayerAux); with_cache_inputs adds what a decode cache is built from."""
    config, attn = layer.config, layer.attn
    B, T = tokens.shape
    positions = jnp.arange(T, dtype=jnp.int32)
    cos, sin = cos_sin(attn.rope, config.qk_rope_head_dim, positions)  # f32[T, P/2]

    pre, post, comb = layer.hc("attn", streams)
    x = layer.attn_norm(HyperConnection.collapse(streams, pre)).astype(streams.dtype)  # [B, T, D]
    q_resid, q = attn.queries(x, cos, sin)
    kv = attn.kv(x, cos, sin)  # [B, T, A]
    window = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - config.sliding_window)
    keys, mask = kv, jnp.broadcast_to(window, (B, T, T))
    entries = index_keys = topk = raw = index_raw = None
    if attn.compressor is not None:
        entries = attn.compressor(x, config.rope_compress, config.qk_rope_head_dim)  # [B, N, A]
        raw = attn.compressor.project(x) if with_cache_inputs else None
        N = entries.shape[1]
        visible = jnp.broadcast_to(causal_entries(T, N, attn.compressor.rate), (B, T, N))
        if attn.indexer is not None:
            index_keys = attn.indexer.compressor(x, config.rope_compress, config.qk_rope_head_dim)  # [B, N, I]
            index_raw = attn.indexer.compressor.project(x) if with_cache_inputs else None
            icos, isin = cos_sin(config.rope_compress, config.qk_rope_head_dim, positions)
            iq, iw = attn.indexer.queries(x, q_resid, icos, isin)
            topk = select_topk(attn.indexer.scores(iq, iw, index_keys), visible, config.index_topk)  # i32[B, T, K]
            chosen = jnp.zeros((B, T, N + 1), bool).at[
                jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], jnp.where(topk < 0, N, topk)
            ].set(True)
            visible = visible & chosen[..., :N]
            topk = sorted_selection(topk)
        keys = jnp.concatenate([kv, entries.astype(kv.dtype)], axis=1)
        mask = jnp.concatenate([mask, visible], axis=-1)
    out = attend(q, keys, mask, attn.attn_sink[...], config.head_dim**-0.5)  # [B, T, H, A]
    streams = HyperConnection.expand(streams, attn.output(out, cos, sin), post, comb)

    pre, post, comb = layer.hc("ffn", streams)
    x = layer.ffn_norm(HyperConnection.collapse(streams, pre)).astype(streams.dtype)
    streams = HyperConnection.expand(streams, layer.ffn(x, tokens), post, comb)
    rows = kv if with_cache_inputs else None
    return streams, LayerAux(entries, index_keys, topk, rows, raw, index_raw)


def forward_with_aux(
    model: DeepseekV4ForCausalLM, tokens: jax.Array, with_cache_inputs: bool = False
) -> tuple[jax.Array, list[LayerAux]]:
    """Full no-cache forward as transformers runs it: tokens i32[B, T] -> (logits f32[B, T, V],
    per-layer LayerAux; with_cache_inputs: also the rows and projections a cache needs)."""
    h = model.embed_tokens(tokens)  # [B, T, D]
    streams = jnp.broadcast_to(h[:, :, None, :], (*h.shape[:2], model.config.hc_mult, h.shape[-1]))
    aux = []
    for layer in model.layers:
        streams, layer_aux = _layer_forward(layer, streams, tokens, with_cache_inputs)
        aux.append(layer_aux)
    return model.logits(streams), aux


def forward(model: DeepseekV4ForCausalLM, tokens: jax.Array) -> jax.Array:
    """tokens i32[B, T] -> logits f32[B, T, V] (no cache)."""
    return forward_with_aux(model, tokens)[0]


def greedy_no_cache(model: DeepseekV4ForCausalLM, prompts: jax.Array, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy continuation by full forwards (the fixture's truth): prompts i32[B, T] ->
    (tokens i32[B, steps], logits f32[B, steps, V]). Runs one compiled forward over a buffer of
    T + steps - 1 tokens: the padding after the last real token cannot reach it (every part of
    the model is causal: window, compressed entries w < (t+1)//M, per-token MoE and mHC)."""
    B, T = prompts.shape
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, buf, t: jax.lax.dynamic_index_in_dim(forward(nnx.merge(graphdef, s), buf), t, 1, False))
    buf = jnp.zeros((B, T + steps - 1), jnp.int32).at[:, :T].set(prompts)
    out_tokens, out_logits = [], []
    for j in range(steps):
        logits = step(state, buf, T + j - 1)  # f32[B, V]
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out_tokens.append(nxt)
        out_logits.append(logits)
        if j + 1 < steps:
            buf = buf.at[:, T + j].set(nxt)
    return np.stack([np.asarray(t) for t in out_tokens], 1), np.stack([np.asarray(l) for l in out_logits], 1)
