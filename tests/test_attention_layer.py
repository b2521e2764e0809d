"""Many decode steps through attention_layer: HiSparse vs no-offload vs dense references.

Small sizes (top_k 8, B 16, contexts to ~120 tokens) so every path runs on CPU: the fast path,
the transition at n = B + 1, long paths that hit, miss and evict. Device slots and host rows
nothing has written are NaN, so a stray read shows up as a NaN in the output.
"""


import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax import kv_cache_ops
from hisparse_jax.attention_layer import attention_layer, shared_attention_layer
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.row_layout import KVRowLayout
from hisparse_jax.state import FullKVState, HiSparseState, jit_donating_state
from pallas_kernels.sparse_mla_attention import sparse_mla_attention_reference

L, R, H, LATENT, ROPE = 2, 3, 4, 32, 16
K, B, C, PAGE = 8, 16, 128, 8
SCALE = 0.125


def make_states(dtype, layout_kind):
    layout = KVRowLayout(LATENT, ROPE, layout_kind)
    config = HiSparseConfig(top_k=K, device_buffer_size=B, host_to_device_ratio=8)
    hisparse = HiSparseState.create(
        num_layers=L, num_requests=R, max_context=C, config=config, layout=layout,
        num_host_pages=R * C // PAGE + 3, page_size=PAGE, fill_value=jnp.nan,
    )
    full = FullKVState.create(num_layers=L, num_requests=R, max_context=C, layout=layout, fill_value=jnp.nan)
    return hisparse, full


def prefill(state, rows, prompt_lens, pages_per_request, implementation):
    """Admits every request and stores its prompt rows, in chunks of 5 (the last one padded)."""
    P = state.host_page_table.shape[1] if isinstance(state, HiSparseState) else None

    def admit(state, request, prompt_len, pages):
        return kv_cache_ops.begin_request(state, request, prompt_len, pages)

    def store(state, layer, request, start, chunk, prompt_len):
        return kv_cache_ops.store_prefill_rows(state, layer, request, start, chunk, prompt_len, implementation=implementation)

    admit = jit_donating_state(admit, state)
    store = jit_donating_state(store, state)
    # Pages handed out in a scrambled order, so host slots differ from positions.
    all_pages = np.random.default_rng(5).permutation(R * C // PAGE + 3)
    for r, n in enumerate(prompt_lens):
        pages = None
        if P is not None:
            pages = np.full(P, -1, np.int32)
            pages[:pages_per_request] = all_pages[r * pages_per_request : (r + 1) * pages_per_request]
            pages = jnp.asarray(pages)
        state = admit(state, r, n, pages)
        for layer in range(L):
            for start in range(0, n, 5):
                chunk = np.zeros((5, LATENT + ROPE), np.float32)
                end = min(start + 5, n)
                chunk[: end - start] = rows[layer, r, start:end]
                state = store(state, layer, r, start, jnp.asarray(chunk), n)
    return state


def decode_step_fn(implementation, shared_second_layer=False):
    def step(state, queries, new_rows, positions, topk):
        outs, hits, misses = [], [], []
        info = None
        for layer in range(L):
            if shared_second_layer and layer == 1:
                state, out, info = shared_attention_layer(
                    state, layer, queries[layer], new_rows[layer], positions, info,
                    latent_dim=LATENT, sm_scale=SCALE, implementation=implementation,
                )
            else:
                state, out, info = attention_layer(
                    state, layer, queries[layer], new_rows[layer], positions, topk[layer],
                    latent_dim=LATENT, sm_scale=SCALE, implementation=implementation, record_plan=shared_second_layer,
                )
            outs.append(out)
            hits.append(info.num_hits)
            misses.append(info.num_misses)
        state = kv_cache_ops.advance(state, positions >= 0)
        return state, jnp.stack(outs), jnp.stack(hits), jnp.stack(misses)

    return step


def run_decode(implementation, dtype, layout_kind, *, steps, prompt_lens, select, shared_second_layer=False, seed=0):
    """Runs both memory modes over the same rows and selections; returns outputs and counters."""
    rng = np.random.default_rng(seed)
    total = max(prompt_lens) + steps
    rows = rng.standard_normal((L, R, total, LATENT + ROPE)).astype(np.float32)
    rows = np.asarray(jnp.asarray(rows, dtype).astype(jnp.float32))  # representable in the row dtype
    queries = rng.standard_normal((steps, L, R, H, LATENT + ROPE)).astype(np.float32)
    hisparse, full = make_states(dtype, layout_kind)
    pages_per_request = C // PAGE
    hisparse = prefill(hisparse, rows, prompt_lens, pages_per_request, implementation)
    full = prefill(full, rows, prompt_lens, pages_per_request, implementation)
    step_fn = decode_step_fn(implementation, shared_second_layer)
    step_hisparse = jit_donating_state(step_fn, hisparse, extra_outputs=3)
    step_full = jit_donating_state(step_fn, full, extra_outputs=3)
    positions = np.array(prompt_lens, np.int32)
    results = []
    for t in range(steps):
        topk = np.stack([select(rng, positions, layer) for layer in range(L)]).astype(np.int32)  # [L, R, K]
        if shared_second_layer:
            topk[1] = topk[0]
        new_rows = rows[:, np.arange(R), positions]  # [L, R, W]
        args = (jnp.asarray(queries[t], dtype), jnp.asarray(new_rows, dtype), jnp.asarray(positions), jnp.asarray(topk))
        hisparse, out_h, hits, misses = step_hisparse(hisparse, *args)
        full, out_f, _, _ = step_full(full, *args)
        results.append((np.asarray(out_h), np.asarray(out_f), np.asarray(hits), np.asarray(misses), topk, positions.copy()))
        positions = positions + 1
    return results, rows, queries, hisparse


def recent_and_random(rng, positions, layer):
    """A top-k that favours recent positions (as trained indexers do), with repeats and padding."""
    out = np.full((R, K), -1, np.int64)
    for r, p in enumerate(positions):
        n = p + 1
        count = min(K, n)
        recent = rng.integers(max(0, n - 20), n, count)
        anywhere = rng.integers(0, n, count)
        chosen = np.where(rng.random(count) < 0.6, recent, anywhere)
        out[r, :count] = chosen
        if rng.random() < 0.3:
            out[r, rng.integers(0, K)] = -1
    return out


def dense_reference(query, rows_upto, topk):
    """f32 attention over the true rows, restricted to the selected positions."""
    kv = jnp.asarray(rows_upto)[None]  # [1, R, T, W]
    return np.asarray(sparse_mla_attention_reference(jnp.asarray(query), kv, 0, jnp.asarray(topk), latent_dim=LATENT, sm_scale=SCALE))


@pytest.mark.parametrize("implementation", ["reference", "pallas"])
def test_hisparse_equals_no_offload_over_many_steps(implementation):
    # Prompts: fits in B, crosses B during decode, far beyond B (buffer starts empty).
    prompt_lens = [3, 12, 60]
    results, rows, queries, state = run_decode(
        implementation, jnp.float32, "float32", steps=40, prompt_lens=prompt_lens, select=recent_and_random
    )
    total_misses = 0
    for t, (out_h, out_f, hits, misses, topk, positions) in enumerate(results):
        assert np.all(np.isfinite(out_h)), f"step {t}: HiSparse read an unwritten (NaN) row"
        np.testing.assert_array_equal(out_h, out_f, err_msg=f"step {t}: HiSparse != no-offload")
        for layer in range(L):
            expected = dense_reference(queries[t, layer], rows[layer, :, : positions.max() + 1], topk[layer])
            np.testing.assert_allclose(out_h[layer], expected, rtol=1e-5, atol=1e-5)
        total_misses += misses.sum()
    assert total_misses > 0, "the test never exercised a miss"
    np.testing.assert_array_equal(np.asarray(state.seq_lens), np.array(prompt_lens) + 40)


def test_bf16_rows_within_tolerance_of_f32_dense():
    results, rows, queries, _ = run_decode(
        "pallas", jnp.bfloat16, "bfloat16", steps=12, prompt_lens=[10, 30, 50], select=recent_and_random, seed=1
    )
    for t, (out_h, out_f, _, _, topk, positions) in enumerate(results):
        np.testing.assert_array_equal(out_h, out_f)
        for layer in range(L):
            q = np.asarray(jnp.asarray(queries[t, layer], jnp.bfloat16).astype(jnp.float32))
            expected = dense_reference(q, rows[layer, :, : positions.max() + 1], topk[layer])
            np.testing.assert_allclose(out_h[layer], expected, rtol=2e-2, atol=2e-2)


def all_positions(rng, positions, layer):
    """top_k >= n: every position selected (K = 8 covers contexts of up to 8 tokens)."""
    out = np.full((R, K), -1, np.int64)
    for r, p in enumerate(positions):
        out[r, : p + 1] = rng.permutation(p + 1)
    return out


def test_top_k_covering_the_context_equals_dense_attention():
    results, rows, queries, _ = run_decode(
        "pallas", jnp.float32, "float32", steps=4, prompt_lens=[1, 3, 4], select=all_positions, seed=2
    )
    for t, (out_h, _, _, _, _, positions) in enumerate(results):
        for layer in range(L):
            for r, p in enumerate(positions):
                keys = rows[layer, r, : p + 1]  # [n, W]: all of the context, no selection
                scores = queries[t, layer, r] @ keys.T * SCALE  # [H, n]
                weights = np.exp(scores - scores.max(axis=1, keepdims=True))
                dense = (weights / weights.sum(axis=1, keepdims=True)) @ keys[:, :LATENT]
                np.testing.assert_allclose(out_h[layer, r], dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["reference", "pallas"])
def test_shared_layer_replays_anchor_plan(implementation):
    """Layer 1 reuses layer 0's top-k and replays its miss plan: equal to no-offload."""
    results, *_ = run_decode(
        implementation, jnp.float32, "float32", steps=25, prompt_lens=[5, 20, 70],
        select=recent_and_random, shared_second_layer=True, seed=3,
    )
    misses = 0
    for t, (out_h, out_f, _, m, _, _) in enumerate(results):
        assert np.all(np.isfinite(out_h))
        np.testing.assert_array_equal(out_h, out_f, err_msg=f"step {t}")
        misses += m.sum()
    assert misses > 0


def test_one_jitted_layer_step_serves_every_layer():
    """jit_attention_layer compiles once (traced layer index) and matches attention_layer."""
    from hisparse_jax.attention_layer import jit_attention_layer

    hisparse, _ = make_states(jnp.float32, "float32")
    hisparse = prefill(hisparse, np.ones((L, R, C, LATENT + ROPE), np.float32), [20, 5, 40], C // PAGE, "pallas")
    step = jit_attention_layer(hisparse, latent_dim=LATENT, sm_scale=SCALE, implementation="pallas")
    rng = np.random.default_rng(4)
    positions = jnp.asarray([20, 5, 40], jnp.int32)
    for layer in range(L):
        query = jnp.asarray(rng.standard_normal((R, H, LATENT + ROPE)), jnp.float32)
        row = jnp.asarray(rng.standard_normal((R, LATENT + ROPE)), jnp.float32)
        topk = jnp.asarray(rng.integers(0, 6, (R, K)), jnp.int32)
        hisparse, out, info = step(hisparse, jnp.int32(layer), query, row, positions, topk)
        assert np.all(np.isfinite(np.asarray(out))) and int(info.num_misses.sum()) > 0
    assert step._cache_size() == 1
