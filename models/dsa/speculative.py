"""Speculative decoding of a DSA model with its MTP layer: EAGLE chain drafting (topk 1, N steps),
N + 1 tokens verified per request in one target forward, greedy acceptance, rollback.

Letters: L model layers, J full-indexer layers, b request slots of the step, N draft steps
(num_steps), Q = N + 1 tokens verified per request, D hidden, V vocab, W KV row width, K top-k.

What a request carries between steps (DraftState, on the device): c = its committed tokens
(seq_lens, the host knows it), x_c = the token at position c, chosen but not yet in the KV (the
"bonus"), d_1 = the MTP layer's proposal for position c + 1, and g = the MTP output that proposed
it. One step, one jit (speculative_step):

  1. draft chain: N - 1 MTP steps at positions c .. c + N - 2: at position j the MTP layer reads
     the token proposed for j + 1 and the previous step's g (in place of the target's hidden at
     j, which does not exist yet) and proposes the token at j + 2: d_2 .. d_N;
  2. verify: the target runs [x_c, d_1, .. d_N] at positions c .. c + N, each token attending
     over its own top-k (its own indexer selection over the context up to it: causal among the
     step's tokens) -> target tokens t_0 .. t_N, t_i = argmax of the logits at c + i;
  3. accept: a = the number of leading drafts with d_{i+1} = t_i (greedy); the step emits
     t_0 .. t_a (a + 1 tokens); the target's KV of positions c .. c + a is kept, the rest rolled
     back (hisparse_jax.speculative.commit: nothing of a rejected token stays where anything
     reads it);
  4. extend: the MTP layer runs positions c .. c + a with the tokens that follow them (t_0 ..
     t_a) and the target's hidden states there (after the final norm, as SGLang feeds it),
     writing its own KV for them (kept), and from position c + a proposes d'_1 (its g carried).
     The next step verifies [t_a, d'_1, ...] from c' = c + a + 1.

Prefill ends the same way: the MTP layer runs over the prompt (positions 0 .. T - 1, each with the
token after it, the last one the first generated token) and proposes d_1 (runner.LayerwisePrefill).

The MTP layer's KV is one more layer of the request's KV state (kv layer L, indexer key row J):
with HiSparse it is offloaded like the model's layers (its own hot buffer, the request's host
pages), and the draft chain's tokens live in the same speculative slots as the verified ones
(hisparse_jax.speculative). Tokens past max context are the caller's to avoid: a step writes
positions up to c + N.

draft_override i32[b, C] (tests and benchmarks): the draft tokens are read from it by position
(d_i = draft_override[r, c + i]) instead of the MTP layer's argmax; the chain still runs, on those
tokens. With the target's own greedy tokens there every draft is accepted (the machinery's
ceiling); with other tokens none is.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hisparse_jax.speculative import commit, speculative_attention_layer, speculative_shared_layer
from models.common import rope
from models.dsa.decoding import DecodeCache, write_index_keys
from models.dsa.indexer import decode_topk
from models.dsa.layer import DecoderLayer
from models.dsa.model import DSAForCausalLM
from models.dsa.mtp import mtp_head


class DraftState(NamedTuple):
    """What each request carries from one speculative step (or its prefill) to the next."""

    bonus: jax.Array  # i32[b]: x_c, the token at the committed length c, not in the KV yet
    draft: jax.Array  # i32[b]: d_1, the MTP layer's proposal for position c + 1
    hidden: jax.Array  # [b, D]: g, the MTP output that proposed d_1 (the draft chain reads it)


class SpeculativeStepOutput(NamedTuple):
    tokens: jax.Array  # i32[b, Q]: the target's greedy token after each verified position; the first num_accepted + 1 are emitted
    num_accepted: jax.Array  # i32[b]: drafts accepted, 0 .. N (0 for an inactive slot)
    logits: jax.Array  # f32[b, Q, V]: the target's logits at the verified positions
    carry: DraftState  # for the next step
    num_hits: jax.Array  # i32[L + 1, b]: per layer (the MTP layer last: its chain and extend together)
    num_misses: jax.Array  # i32[L + 1, b]
    draft_tokens: jax.Array  # i32[b, N]: what was verified after x_c


def _indexer_topk(layer: DecoderLayer, x, q_resid, cos, sin, index_keys, key_scales, j, positions, implementation):
    """The step's indexer keys written (key row j), then each token's own top-k over the context
    up to its position (the step's earlier tokens included) -> (index_keys, key_scales, i32[b, q, K]).

    x [b*q, D], q_resid [b*q, Q'], cos/sin f32[b*q, P/2]; positions i32[b, q], -1 inactive."""
    indexer, config = layer.self_attn.indexer, layer.config
    b, q = positions.shape
    C = index_keys.shape[2]
    keys = indexer.keys(x, cos, sin).reshape(b, q, -1)  # [b, q, I]
    requests = jnp.broadcast_to(jnp.arange(b)[:, None], (b, q))
    index_keys, key_scales = write_index_keys(index_keys, key_scales, j, requests, jnp.where(positions >= 0, positions, C), keys)
    iq, iw = indexer.queries(x, q_resid, cos, sin, index_keys.dtype)  # [b*q, G, I], f32[b*q, G]
    iq, iw = iq.reshape(b, q, *iq.shape[1:]), iw.reshape(b, q, -1)
    topk = jnp.stack(
        [decode_topk(iq[:, i], iw[:, i], index_keys, key_scales, j, positions[:, i], config.index_topk, implementation=implementation)
         for i in range(q)],
        axis=1,
    )  # fmt: skip
    # The scoring reads the key cache in place; the next indexer layer writes it (decoding.py's
    # _decode_indexer says why the barrier).
    return jax.lax.optimization_barrier((index_keys, key_scales, topk))


def _layer_step(layer: DecoderLayer, state: dict, h, positions, committed, cos, sin, *, kv_layer: int, key_row, anchor, implementation):
    """One decoder layer over q tokens per request. h [b, q, D] -> (h [b, q, D], rows row[b, q, W],
    info); state {kv, index_keys, key_scales} updated in place (a dict the caller threads)."""
    b, q, D = h.shape
    attn = layer.self_attn
    x = layer.input_layernorm(h.reshape(b * q, D))
    q_resid, query = attn.queries(x, cos, sin)  # [b*q, Q'], [b*q, H, W']
    query = query.reshape(b, q, *query.shape[1:])
    rows = state["kv"].layout.pack(*attn.kv_row(x, cos, sin)).reshape(b, q, -1)  # row[b, q, W]
    kw = dict(latent_dim=layer.config.kv_lora_rank, sm_scale=layer.config.softmax_scale, implementation=implementation)
    if attn.indexer is not None:
        state["index_keys"], state["key_scales"], topk = _indexer_topk(
            layer, x, q_resid, cos, sin, state["index_keys"], state["key_scales"], key_row, positions, implementation
        )  # fmt: skip
        state["kv"], out, info = speculative_attention_layer(state["kv"], kv_layer, query, rows, positions, topk, committed, record_plan=True, **kw)
    else:
        state["kv"], out, info = speculative_shared_layer(state["kv"], kv_layer, query, rows, positions, committed, anchor, **kw)
    h = layer.finish(h.reshape(b * q, D), out.reshape(b * q, *out.shape[2:])).reshape(b, q, D)
    return h, rows, info


def _cos_sin(model: DSAForCausalLM, positions):
    """positions i32[b, q] -> cos, sin f32[b*q, P/2]."""
    return rope.cos_sin(model.config.rope, model.config.qk_rope_head_dim, positions.reshape(-1))


def verify(model: DSAForCausalLM, state: dict, tokens, positions, committed, implementation):
    """The target over q tokens per request: tokens, positions i32[b, q] -> (logits f32[b, q, V],
    normed hidden [b, q, D] (after the final norm: what the MTP layer reads), rows (row[b, q, W]
    per layer), hits, misses i32[L, b])."""
    config = model.config
    h = model.embed_tokens(tokens)  # [b, q, D]
    cos, sin = _cos_sin(model, positions)
    anchor, rows, hits, misses = None, [], [], []
    for l, layer in enumerate(model.layers):
        full = layer.self_attn.indexer is not None
        key_row = config.indexer_cache_index(l) if full else None
        h, layer_rows, info = _layer_step(
            layer, state, h, positions, committed, cos, sin, kv_layer=l, key_row=key_row, anchor=anchor, implementation=implementation
        )  # fmt: skip
        anchor = info if full else anchor
        rows.append(layer_rows)
        hits.append(info.num_hits)
        misses.append(info.num_misses)
    normed = model.norm(h)
    return model.head_logits(normed), normed, rows, jnp.stack(hits), jnp.stack(misses)


def draft_step(model: DSAForCausalLM, state: dict, tokens, hidden, positions, committed, implementation):
    """The MTP layer over q tokens per request: tokens i32[b, q] (each position's next token),
    hidden [b, q, D] -> (g [b, q, D], logits f32[b, q, V], rows row[b, q, W], info). Its KV is
    kv layer L, its keys key row J."""
    config, layer = model.config, model.mtp[0]
    h = layer.fuse(model.embed_tokens(tokens), hidden)
    cos, sin = _cos_sin(model, positions)
    out, rows, info = _layer_step(
        layer, state, h, positions, committed, cos, sin, kv_layer=config.num_layers,
        key_row=len(config.full_indexer_layers), anchor=None, implementation=implementation,
    )  # fmt: skip
    g, logits = mtp_head(model, layer, out)
    return g, logits, rows, info


def _at(x, index):
    """x [b, q, ...], index i32[b] -> x[r, index[r]]: [b, ...]."""
    return jnp.take_along_axis(x, index.reshape(-1, 1, *([1] * (x.ndim - 2))), axis=1)[:, 0]


def speculative_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cache: DecodeCache,
    carry: DraftState,
    committed: jax.Array,  # i32[b]: tokens stored per request slot 0 .. b - 1 (seq_lens), -1 inactive
    draft_override: jax.Array | None = None,  # i32[b, C]: draft tokens by position (module docstring)
    *,
    num_steps: int,
    implementation: str | None = None,
) -> tuple[DecodeCache, SpeculativeStepOutput]:
    """One speculative step (module docstring) -> (cache, SpeculativeStepOutput). Traceable; the
    runner jits it with the cache donated (ModelRunner.speculative_step)."""
    model: DSAForCausalLM = nnx.merge(graphdef, params)
    L, N, Q = model.config.num_layers, num_steps, num_steps + 1
    b = committed.shape[0]
    active = committed >= 0
    state = dict(kv=cache.kv, index_keys=cache.index_keys, key_scales=cache.index_key_scales)
    offsets = jnp.arange(Q, dtype=jnp.int32)
    draft_hits = draft_misses = jnp.zeros((b,), jnp.int32)

    # 1. The draft chain: d_2 .. d_N from (d_1, g).
    override = None
    if draft_override is not None:  # d_i = draft_override[r, c + i]
        drafted_at = jnp.clip(committed[:, None] + 1 + offsets[:N], 0, draft_override.shape[1] - 1)  # i32[b, N]
        override = jnp.take_along_axis(draft_override, drafted_at, axis=1)  # i32[b, N]
    drafts, g = [carry.draft if override is None else override[:, 0]], carry.hidden
    for k in range(1, N):
        chain_positions = jnp.where(active, committed + k - 1, -1)[:, None]  # i32[b, 1]
        with jax.named_scope("mtp_draft"):  # phase names for a profile (benchmarks/step_split.py)
            g, logits, _, info = draft_step(model, state, drafts[-1][:, None], g[:, None], chain_positions, committed, implementation)
        g = g[:, 0]
        drafts.append(jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32) if override is None else override[:, k])
        draft_hits, draft_misses = draft_hits + info.num_hits, draft_misses + info.num_misses
    draft_tokens = jnp.stack(drafts, axis=1)  # i32[b, N]

    # 2. Verify [x_c, d_1 .. d_N] at c .. c + N.
    tokens = jnp.concatenate([carry.bonus[:, None], draft_tokens], axis=1)  # i32[b, Q]
    positions = jnp.where(active[:, None], committed[:, None] + offsets, -1)  # i32[b, Q]
    with jax.named_scope("mtp_verify"):
        logits, normed, rows, hits, misses = verify(model, state, tokens, positions, committed, implementation)
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # i32[b, Q]

    # 3. Accept the longest agreeing prefix; keep its KV, drop the rest.
    agree = (draft_tokens == target[:, :N]).astype(jnp.int32)
    accepted = jnp.where(active, jnp.sum(jnp.cumprod(agree, axis=1), axis=1), 0)  # i32[b]
    kept = jnp.where(active, committed + accepted + 1, -1)  # i32[b]: the new lengths
    with jax.named_scope("mtp_commit"):
        state["kv"] = commit(state["kv"], rows + [None], positions, kept, implementation=implementation)

    # 4. Extend: the MTP layer over the kept positions, with the tokens after them and the
    # target's hidden states there; its proposal from the last kept position is the next d_1.
    extend_positions = jnp.where(offsets[None, :] <= accepted[:, None], positions, -1)
    with jax.named_scope("mtp_extend"):
        g_all, draft_logits, draft_rows, info = draft_step(model, state, target, normed, extend_positions, committed, implementation)
        state["kv"] = commit(state["kv"], [None] * L + [draft_rows], extend_positions, kept, implementation=implementation)
    draft_hits, draft_misses = draft_hits + info.num_hits, draft_misses + info.num_misses
    next_draft = jnp.argmax(_at(draft_logits, accepted), axis=-1).astype(jnp.int32)
    carry = DraftState(_at(target, accepted), next_draft, _at(g_all, accepted))

    cache = DecodeCache(state["kv"], state["index_keys"], state["key_scales"])
    return cache, SpeculativeStepOutput(
        target, accepted, logits, carry, jnp.concatenate([hits, draft_hits[None]]), jnp.concatenate([misses, draft_misses[None]]),
        draft_tokens,
    )


def prefill_draft(model: DSAForCausalLM, h_last, tokens, first_token, prompt_len, *, chunk: int, key_dtype):
    """The MTP layer over a prompt after the target's prefill: h_last [Tp, D] (the last layer's
    output), tokens i32[Tp] (the padded prompt), first_token i32[] (x_T, chosen from the target's
    logits), prompt_len i32[] -> (the layer's PrefillOutput, d_1 i32[], g [D]). Position j reads
    x_{j+1} (x_T at T - 1) and the target's normed hidden state at j."""
    layer = model.mtp[0]
    following = jnp.roll(tokens, -1).at[prompt_len - 1].set(first_token)  # i32[Tp]: x_{j+1} at j (past T: padding)
    h = layer.fuse(model.embed_tokens(following), model.norm(h_last))
    out = layer.prefill(h, None, chunk=chunk, key_dtype=key_dtype)
    g, logits = mtp_head(model, layer, out.hidden[prompt_len - 1])
    return out, jnp.argmax(logits).astype(jnp.int32), g
