"""Speculative layer steps (hisparse_jax.speculative): several query tokens per request, then a
commit of an accepted prefix, HiSparse against no offload and a float64 dense reference.

Each step draws fresh rows for its q tokens (a rejected token's row differs from the one later
accepted at the same position), so a read of a rejected row shows as a wrong output. After each
commit the places rejected rows could have reached (speculative slots, host rows and, without
offload, device rows past the new lengths) are filled with NaN, as are unwritten rows from the
start. The state is then checked against what plain decode steps leave (seq_lens, host rows of
every committed position, fast-path slots, the newest in the reserved slot) and decoding goes
on, speculative and then plain, with the same outputs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax import kv_cache_ops
from hisparse_jax.attention_layer import attention_layer, shared_attention_layer
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.row_layout import KVRowLayout
from hisparse_jax.speculative import commit, plan_groups, speculative_attention_layer, speculative_shared_layer
from hisparse_jax.state import FullKVState, HiSparseState, jit_donating_state
from pallas_kernels.swap_in import host_slots_of
from swap_in_oracle import speculative_plan_one_request

L, R, H, LATENT, ROPE = 2, 3, 4, 32, 16
K, C, PAGE, M = 8, 128, 8, 4  # M: speculative slots (tokens per step)
W = LATENT + ROPE
SCALE = 0.125


def make_states(B, layout_kind="float32"):
    layout = KVRowLayout(LATENT, ROPE, layout_kind)
    config = HiSparseConfig(top_k=K, device_buffer_size=B)
    hisparse = HiSparseState.create(
        num_layers=L, num_requests=R, max_context=C, config=config, layout=layout, num_host_pages=R * C // PAGE,
        page_size=PAGE, fill_value=jnp.nan, speculative_slots=M,
    )  # fmt: skip
    full = FullKVState.create(num_layers=L, num_requests=R, max_context=C, layout=layout, fill_value=jnp.nan)
    return hisparse, full


def prefill(state, rows, prompt_lens):
    """rows f32[L, R, C, W]: the true rows; every request's prompt stored (pages scrambled)."""
    begin = jit_donating_state(kv_cache_ops.begin_request, state)
    store = jit_donating_state(functools.partial(kv_cache_ops.store_prefill_rows, start=0), state)
    pages = np.random.default_rng(5).permutation(R * C // PAGE).reshape(R, C // PAGE).astype(np.int32)
    for r, n in enumerate(prompt_lens):
        state = begin(state, r, n, jnp.asarray(pages[r]) if isinstance(state, HiSparseState) else None)
        for layer in range(L):
            state = store(state, layer, r, rows=jnp.asarray(rows[layer, r, :64]), prompt_len=n)
    return state


def spec_step_fn(implementation, shared):
    kw = dict(latent_dim=LATENT, sm_scale=SCALE, implementation=implementation)

    def step(state, queries, rows, positions, topk, committed, new_committed):
        # queries [L, R, q, H, W], rows [L, R, q, W], positions i32[R, q], topk i32[L, R, q, K]
        outs, hits, misses, info = [], [], [], None
        for layer in range(L):
            if shared and layer == 1:
                state, out, info = speculative_shared_layer(state, layer, queries[layer], rows[layer], positions, committed, info, **kw)
            else:
                state, out, info = speculative_attention_layer(
                    state, layer, queries[layer], rows[layer], positions, topk[layer], committed, record_plan=shared, **kw
                )  # fmt: skip
            outs.append(out)
            hits.append(info.num_hits)
            misses.append(info.num_misses)
        stored = [state.layout.to_stored(rows[layer]) for layer in range(L)]
        state = commit(state, stored, positions, new_committed, implementation=implementation)
        return state, jnp.stack(outs), jnp.stack(hits), jnp.stack(misses)

    return step


def plain_step_fn(implementation, shared):
    kw = dict(latent_dim=LATENT, sm_scale=SCALE, implementation=implementation)

    def step(state, queries, rows, positions, topk):
        outs, info = [], None
        for layer in range(L):
            if shared and layer == 1:  # the anchor's tables govern the shared layer: it stays shared
                state, out, info = shared_attention_layer(state, layer, queries[layer], rows[layer], positions, info, **kw)
            else:
                state, out, info = attention_layer(state, layer, queries[layer], rows[layer], positions, topk[layer], record_plan=shared, **kw)
            outs.append(out)
        return kv_cache_ops.advance(state, positions >= 0), jnp.stack(outs)

    return step


def poison(state, lengths, ends):
    """NaN (the layout's) wherever a row of positions lengths[r] .. ends[r] - 1 may lie: the
    speculative slots and those host rows (HiSparse), those device rows (no offload)."""
    nan = jnp.asarray(state.layout.fill_element(jnp.nan), state.layout.dtype)
    positions = jnp.arange(C)[None, :]
    dead = (positions >= lengths[:, None]) & (positions < ends[:, None])  # bool[R, C]
    if isinstance(state, FullKVState):
        return state.replace(kv=jnp.where(dead[None, :, :, None], nan, state.kv))
    host = jax.vmap(host_slots_of, in_axes=(0, None, None))(state.host_page_table, jnp.arange(C), state.page_size)
    pool = state.host_pool.at[:, jnp.where(dead, host, state.host_pool.shape[1]).reshape(-1)].set(nan, mode="drop")
    return state.replace(host_pool=pool, device_buffer=state.device_buffer.at[:, :, state.buffer_size + 1 :].set(nan))


def select(rng, position, count=K):
    """A top-k for a query at `position`: recent positions favoured, repeats and padding."""
    n = position + 1
    chosen = np.where(rng.random(count) < 0.6, rng.integers(max(0, n - 12), n, count), rng.integers(0, n, count))
    if rng.random() < 0.3:
        chosen[rng.integers(0, count)] = -1
    return chosen


def stored_values(rows, layout_kind):
    layout = KVRowLayout(LATENT, ROPE, layout_kind)
    latent, rope = layout.unpack(layout.pack(jnp.asarray(rows[..., :LATENT]), jnp.asarray(rows[..., LATENT:])))
    return np.concatenate([np.asarray(latent), np.asarray(rope)], axis=-1)


def dense(query, keys):
    """float64 attention of query [H, W] over keys [k, W] (values: their first LATENT)."""
    scores = query.astype(np.float64) @ keys.astype(np.float64).T * SCALE
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    return (weights / weights.sum(axis=1, keepdims=True)) @ keys[:, :LATENT].astype(np.float64)


def check_state_as_plain_decoding_leaves_it(state, truth, lengths):
    """What plain decode steps guarantee: seq_lens, every committed position's host row, the
    fast path's slot = position, the newest in the reserved slot, no table entry past the length."""
    B = state.buffer_size
    np.testing.assert_array_equal(np.asarray(state.seq_lens), lengths)
    # Rows decode one by one: the whole pool and buffer at once (one shape, compiled once, not one
    # eager compile per length), then the rows looked up here.
    pool, buffer = decode(state, np.asarray(state.host_pool)), decode(state, np.asarray(state.device_buffer))
    table, tokens = np.asarray(state.host_page_table), np.asarray(state.buffer_tokens)
    for r, n in enumerate(lengths):
        slots = table[r, np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
        for layer in range(L):
            np.testing.assert_array_equal(pool[layer, slots], truth[layer, r, :n])
            assert tokens[layer, r].max() < n, "a table entry refers to a position past the length"
            if n <= B:
                np.testing.assert_array_equal(tokens[layer, r, :n], np.arange(n))
                np.testing.assert_array_equal(buffer[layer, r, :n], truth[layer, r, :n])
            else:
                np.testing.assert_array_equal(buffer[layer, r, B], truth[layer, r, n - 1])


def decode(state, stored):
    latent, rope = state.layout.unpack(jnp.asarray(stored))
    return np.concatenate([np.asarray(latent), np.asarray(rope)], axis=-1)


@pytest.mark.parametrize(
    "B, implementation, layout_kind, shared",
    [(10, "reference", "float32", False), (16, "reference", "float32", True), (32, "reference", "fp8_e4m3", False),
     (16, "pallas", "float32", True)],
    ids=["groups_of_1", "groups_of_2_shared", "one_group_fp8", "groups_of_2_shared_pallas"],
)  # fmt: skip
def test_speculative_steps_equal_no_offload_and_dense_and_leave_plain_decoding_state(B, implementation, layout_kind, shared):
    q, steps, prompt_lens = M, 7, np.array([3, 12, 60])
    rng = np.random.default_rng(B)
    truth = np.full((L, R, C, W), np.nan, np.float32)  # the committed rows (values as stored)
    prompt = rng.standard_normal((L, R, C, W)).astype(np.float32)
    truth[:, :, :64] = stored_values(prompt[:, :, :64], layout_kind)
    for r, n in enumerate(prompt_lens):
        truth[:, r, n:] = np.nan
    hisparse, full = make_states(B, layout_kind)
    hisparse, full = prefill(hisparse, prompt, prompt_lens), prefill(full, prompt, prompt_lens)
    step = spec_step_fn(implementation, shared)
    step_h, step_f = jit_donating_state(step, hisparse, extra_outputs=3), jit_donating_state(step, full, extra_outputs=3)
    poison_h, poison_f = jit_donating_state(poison, hisparse), jit_donating_state(poison, full)
    lengths, misses = prompt_lens.copy(), 0
    for t in range(steps):
        positions = lengths[:, None] + np.arange(q)[None, :]  # i32[R, q]
        rows = stored_values(rng.standard_normal((L, R, q, W)).astype(np.float32), layout_kind)
        queries = rng.standard_normal((L, R, q, H, W)).astype(np.float32)
        topk = np.stack([[[select(rng, p) for p in positions[r]] for r in range(R)] for _ in range(L)]).astype(np.int32)
        if shared:
            topk[1] = topk[0]
        accepted = rng.integers(0, q, R) if t % 3 else np.array([q - 1, 0, q - 1])  # drafts accepted per request
        new_lengths = lengths + accepted + 1
        args = [jnp.asarray(x) for x in (queries, rows, positions.astype(np.int32), topk, lengths.astype(np.int32), new_lengths.astype(np.int32))]
        hisparse, out_h, _, m = step_h(hisparse, *args)
        full, out_f, _, _ = step_f(full, *args)
        out_h = np.asarray(out_h)
        assert np.all(np.isfinite(out_h)), f"step {t}: read a NaN (unwritten or rejected) row"
        np.testing.assert_array_equal(out_h, np.asarray(out_f), err_msg=f"step {t}")
        for layer in range(L):
            for r in range(R):
                visible = truth[layer, r].copy()
                visible[positions[r]] = rows[layer, r]  # this step's rows, all of them (causal via top-k)
                for i in range(q):
                    chosen = [p for p in topk[layer, r, i] if p >= 0]
                    np.testing.assert_allclose(out_h[layer, r, i], dense(queries[layer, r, i], visible[chosen]), rtol=1e-5, atol=1e-5)
        for r in range(R):  # the accepted prefix becomes the truth
            truth[:, r, lengths[r] : new_lengths[r]] = rows[:, r, : accepted[r] + 1]
        ends = (lengths + q).astype(np.int32)
        hisparse = poison_h(hisparse, jnp.asarray(new_lengths, jnp.int32), jnp.asarray(ends))
        full = poison_f(full, jnp.asarray(new_lengths, jnp.int32), jnp.asarray(ends))
        check_state_as_plain_decoding_leaves_it(hisparse, truth, new_lengths)
        lengths, misses = new_lengths, misses + int(np.asarray(m).sum())
    assert misses > 0, "never exercised a miss"
    # Plain decode steps go on from there.
    plain = plain_step_fn(implementation, shared)
    plain_h, plain_f = jit_donating_state(plain, hisparse, extra_outputs=1), jit_donating_state(plain, full, extra_outputs=1)
    for t in range(3):
        rows = stored_values(rng.standard_normal((L, R, W)).astype(np.float32), layout_kind)
        queries = rng.standard_normal((L, R, H, W)).astype(np.float32)
        topk = np.stack([[select(rng, p) for p in lengths] for _ in range(L)]).astype(np.int32)
        args = [jnp.asarray(x) for x in (queries, rows, lengths.astype(np.int32), topk)]
        hisparse, out_h = plain_h(hisparse, *args)
        full, out_f = plain_f(full, *args)
        assert np.all(np.isfinite(np.asarray(out_h)))
        np.testing.assert_array_equal(np.asarray(out_h), np.asarray(out_f), err_msg=f"plain step {t}")
        truth[:, np.arange(R), lengths] = rows
        lengths = lengths + 1
    check_state_as_plain_decoding_leaves_it(hisparse, truth, lengths)


@pytest.mark.parametrize("implementation", ["reference", "pallas"])
def test_speculative_plan_equals_the_oracle(implementation):
    """plan_speculative (the swap-in kernel over the committed positions, the step's own ones
    resolved to their speculative slots) against swap_in_oracle.speculative_plan_one_request:
    slots, counters, miss plan and the updated tables, over random buffers and groups of 1-2
    positions' selections, on both sides of n = B."""
    B, rng = 16, np.random.default_rng(11)
    hisparse, _ = make_states(B)
    plan_fn = jit_donating_state(
        lambda state, topk, committed: state.plan_speculative(0, topk, committed, implementation=implementation), hisparse,
        extra_outputs=1,
    )  # fmt: skip
    for trial in range(6):
        committed = np.array([5, 16, 40][trial % 3:] + [5, 16, 40][: trial % 3], np.int32)
        tokens = np.full((L, R, B), -1, np.int32)
        lru = np.tile(np.arange(B, dtype=np.int32), (L, R, 1))
        for r, n in enumerate(committed):
            if n <= B:
                tokens[0, r, :n] = np.arange(n)
            else:
                held = rng.choice(n, rng.integers(B // 2, B + 1), replace=False)
                tokens[0, r, rng.choice(B, len(held), replace=False)] = held
            lru[0, r] = rng.permutation(B)
        pages = np.arange(R * C // PAGE, dtype=np.int32).reshape(R, -1)
        state = hisparse.replace(buffer_tokens=jnp.asarray(tokens), lru_slots=jnp.asarray(lru), host_page_table=jnp.asarray(pages))
        group = 1 + trial % 2
        topk = np.stack([np.concatenate([select(rng, n + i) for i in range(group)]) for n in committed]).astype(np.int32)
        state, plan = plan_fn(state, jnp.asarray(topk), jnp.asarray(committed))
        plan = jax.tree.map(np.asarray, plan)
        for r, n in enumerate(committed):
            slots, want_tokens, want_lru, hits, misses, pairs = speculative_plan_one_request(
                list(tokens[0, r]), list(lru[0, r]), list(topk[r]), int(n), lambda p, r=r: int(pages[r, p // PAGE] * PAGE + p % PAGE)
            )  # fmt: skip
            np.testing.assert_array_equal(plan.slots[r], slots)
            assert (plan.num_hits[r], plan.num_misses[r]) == (hits, misses)
            np.testing.assert_array_equal(plan.miss_host_slots[r, : len(pairs)], [h for h, _ in pairs])
            np.testing.assert_array_equal(plan.miss_device_slots[r, : len(pairs)], [d for _, d in pairs])
            np.testing.assert_array_equal(np.asarray(state.buffer_tokens)[0, r], want_tokens)
            np.testing.assert_array_equal(np.asarray(state.lru_slots)[0, r], want_lru)
        hisparse = state


def test_plan_groups_and_checks():
    hisparse, full = make_states(20)
    assert plan_groups(hisparse, 4, K) == ((0, 2), (2, 4))  # floor(20 / 8) = 2 positions per plan
    assert plan_groups(make_states(7 + K)[0], 3, K) == ((0, 1), (1, 2), (2, 3))  # at least one
    assert plan_groups(full, 4, K) == ((0, 4),)  # no offload: one group
    args = dict(
        query=jnp.zeros((R, M + 1, H, W)), new_rows=jnp.zeros((R, M + 1, W)), positions=jnp.zeros((R, M + 1), jnp.int32),
        topk=jnp.zeros((R, M + 1, K), jnp.int32), committed=jnp.zeros((R,), jnp.int32),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"5 tokens per request need as many speculative slots; the state has 4"):
        speculative_attention_layer(hisparse, 0, **args, latent_dim=LATENT, sm_scale=SCALE)
    with pytest.raises(ValueError, match=r"topk batch and tokens"):
        speculative_attention_layer(full, 0, **dict(args, topk=jnp.zeros((R, 2, K), jnp.int32)), latent_dim=LATENT, sm_scale=SCALE)
    with pytest.raises(ValueError, match=r"speculative slots"):
        from hisparse_jax.paged_state import PagedHiSparseState

        PagedHiSparseState.create(
            num_layers=1, num_requests=1, max_context=C, config=HiSparseConfig(top_k=K, device_buffer_size=16),
            layout=KVRowLayout(LATENT, ROPE, "float32"), speculative_slots=2,
        )  # fmt: skip
