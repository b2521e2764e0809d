"""Many decode steps through attention_layer: HiSparse vs no-offload vs dense references.

Small sizes (top_k 8, B 16, contexts to ~120 tokens) so every path runs on CPU: the fast path,
the transition at n = B + 1, long paths that hit, miss and evict. Device slots and host rows
nothing has written are NaN, so a stray read shows up as a NaN in the output. Rows are f32,
bf16, or fp8 (FlashMLA's packed layout; the states are given row values and pack them).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax import kv_cache_ops
from hisparse_jax.attention_layer import (
    LayerStepInfo,
    attention_layer,
    jit_attention_layer,
    prefetch_shared_rows,
    shared_attention_layer,
    shared_prefetch_mode,
)
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.row_layout import KVRowLayout
from hisparse_jax.state import FullKVState, HiSparseState, jit_donating_state
from pallas_kernels.sparse_mla_attention import default_num_splits, sparse_mla_attention
from pallas_kernels.common import interpret_mode
from pallas_kernels.sparse_mla_attention import pallas_triton
from pallas_kernels.sparse_mla_attention.pallas_triton import FP8_FORMS, plane_permutation
from pallas_kernels.swap_in import SwapInPlan

L, R, H, LATENT, ROPE = 2, 3, 4, 32, 16
K, B, C, PAGE = 8, 16, 128, 8
SCALE = 0.125


def make_states(dtype, layout_kind, miss_read="copy"):
    layout = KVRowLayout(LATENT, ROPE, layout_kind)
    config = HiSparseConfig(top_k=K, device_buffer_size=B, host_to_device_ratio=8, miss_read=miss_read)
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


def decode_step_fn(implementation, shared_second_layer=False, *, prefetch=None, deferred_backup=False, skip_backup=False):
    """A step over the L layers. prefetch ("stream" / "early"): layer 1 (shared) gets its rows
    from prefetch_shared_rows, started right after layer 0's plan; deferred_backup: layers run
    with backup=False and kv_cache_ops.backup_newest_rows backs every row up after the last
    layer; skip_backup: no backup at all (to show the tests catch a missing one)."""
    later = deferred_backup or skip_backup
    kw = dict(latent_dim=LATENT, sm_scale=SCALE, implementation=implementation, backup=not later)

    def step(state, queries, new_rows, positions, topk):
        outs, hits, misses = [], [], []
        info, prefetched = None, None
        for layer in range(L):
            if shared_second_layer and layer == 1:
                state, out, info = shared_attention_layer(
                    state, layer, queries[layer], new_rows[layer], positions, info, prefetched=prefetched, **kw
                )
            else:
                state, out, info = attention_layer(
                    state, layer, queries[layer], new_rows[layer], positions, topk[layer], record_plan=shared_second_layer, **kw
                )
                if prefetch and shared_second_layer:
                    prefetched, out = prefetch_shared_rows(state, 1, info, implementation=implementation, mode=prefetch, tie=out)
            outs.append(out)
            hits.append(info.num_hits)
            misses.append(info.num_misses)
        if deferred_backup:
            stored = [state.layout.to_stored(new_rows[layer]) for layer in range(L)]
            state = kv_cache_ops.backup_newest_rows(state, stored, positions, implementation=implementation)
        state = kv_cache_ops.advance(state, positions >= 0)
        return state, jnp.stack(outs), jnp.stack(hits), jnp.stack(misses)

    return step


def run_decode(
    implementation, dtype, layout_kind, *, steps, prompt_lens, select, shared_second_layer=False, seed=0, miss_read="copy", **step_options
):
    """Runs both memory modes over the same rows and selections; returns outputs and counters."""
    rng = np.random.default_rng(seed)
    total = max(prompt_lens) + steps
    rows = rng.standard_normal((L, R, total, LATENT + ROPE)).astype(np.float32)
    rows = np.asarray(jnp.asarray(rows, dtype).astype(jnp.float32))  # representable in the row dtype
    queries = rng.standard_normal((steps, L, R, H, LATENT + ROPE)).astype(np.float32)
    hisparse, full = make_states(dtype, layout_kind, miss_read)
    pages_per_request = C // PAGE
    hisparse = prefill(hisparse, rows, prompt_lens, pages_per_request, implementation)
    full = prefill(full, rows, prompt_lens, pages_per_request, implementation)
    step_fn = decode_step_fn(implementation, shared_second_layer, **step_options)
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


def stored_values(rows, layout_kind):
    """The values attention reads back from rows[..., W] stored in `layout_kind` (fp8: dequantised)."""
    layout = KVRowLayout(LATENT, ROPE, layout_kind)
    latent, rope = layout.unpack(layout.pack(jnp.asarray(rows[..., :LATENT]), jnp.asarray(rows[..., LATENT:])))
    return np.concatenate([np.asarray(latent), np.asarray(rope)], axis=-1)


def dense_reference(query, rows_upto, topk):
    """float64 numpy attention over the true rows of the selected entries (each entry counts,
    repeats too; -1 is masked; a request with no valid entry gets zeros). Independent of the
    library's own reference kernel."""
    out = np.zeros((query.shape[0], query.shape[1], LATENT))
    for r in range(query.shape[0]):
        chosen = [p for p in topk[r] if p >= 0]
        if not chosen:
            continue
        keys = rows_upto[r, chosen].astype(np.float64)  # [k, W]
        scores = query[r].astype(np.float64) @ keys.T * SCALE  # [H, k]
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[r] = (weights / weights.sum(axis=1, keepdims=True)) @ keys[:, :LATENT]
    return out


# reference-fp8_e4m3 under -m slow (CI time): the reference kernel over fp8 rows stays covered by
# test_shared_layer_replays_anchor_plan[reference-fp8_e4m3] and test_fp8_attention_kernel_equals_reference,
# fp8 rows over many steps by pallas-fp8_e4m3 here.
@pytest.mark.parametrize(
    "implementation, layout_kind",
    [("reference", "float32"), pytest.param("reference", "fp8_e4m3", marks=pytest.mark.slow), ("pallas", "float32"),
     ("pallas", "fp8_e4m3")],
    ids=["reference-float32", "reference-fp8_e4m3", "pallas-float32", "pallas-fp8_e4m3"],
)  # fmt: skip
def test_hisparse_equals_no_offload_over_many_steps(implementation, layout_kind):
    # Prompts: fits in B, crosses B during decode, far beyond B (buffer starts empty).
    prompt_lens = [3, 12, 60]
    results, rows, queries, state = run_decode(
        implementation, jnp.float32, layout_kind, steps=40, prompt_lens=prompt_lens, select=recent_and_random
    )
    rows = stored_values(rows, layout_kind)  # fp8: what the packed rows hold; f32: the rows
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


@pytest.mark.parametrize(
    "implementation, layout_kind, step_options",
    [("reference", "float32", {}), ("pallas", "float32", {}), ("pallas", "fp8_e4m3", {}),
     ("pallas", "fp8_e4m3", {"deferred_backup": True}), ("pallas", "float32", {"shared_second_layer": True})],
    ids=["reference-float32", "pallas-float32", "pallas-fp8_e4m3", "pallas-fp8_e4m3-deferred_backup", "pallas-float32-shared"],
)  # fmt: skip
def test_misses_read_in_attention_equal_the_copy_and_no_offload(implementation, layout_kind, step_options, monkeypatch):
    """miss_read "attention": the attention kernel reads each step's misses from the pool and
    places them. Outputs equal the no-offload run's bit for bit (fp8 rows: both in the kernel's
    interleave form, the form the host-reading kernel uses), and the device buffer after every
    step equals the copy mode's: the same rows in the same slots."""
    monkeypatch.setattr(pallas_triton, "DEFAULT_FP8_FORM", pallas_triton.READING_HOST_FP8_FORM)
    kw = dict(steps=24, prompt_lens=[3, 12, 60], select=recent_and_random, seed=3, **step_options)
    read, _, _, read_state = run_decode(implementation, jnp.float32, layout_kind, miss_read="attention", **kw)
    copied, _, _, copied_state = run_decode(implementation, jnp.float32, layout_kind, miss_read="copy", **kw)
    assert read_state.miss_read == "attention" and copied_state.miss_read == "copy"
    total_misses = 0
    for t, ((out_r, out_f, hits, misses, _, _), (out_c, _, hits_c, _, _, _)) in enumerate(zip(read, copied)):
        assert np.all(np.isfinite(out_r)), f"step {t}: read an unwritten (NaN) row"
        np.testing.assert_array_equal(out_r, out_f, err_msg=f"step {t}: miss_read 'attention' != no-offload")
        np.testing.assert_array_equal(out_r, out_c, err_msg=f"step {t}: miss_read 'attention' != 'copy'")
        np.testing.assert_array_equal(hits, hits_c)
        total_misses += misses.sum()
    assert total_misses > 0, "the test never exercised a miss"
    for name in ("device_buffer", "buffer_tokens", "lru_slots", "host_pool"):
        a, b = (np.asarray(getattr(s, name)) for s in (read_state, copied_state))
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"{name} differs from the copy mode's")


def test_miss_read_attention_is_refused_where_it_does_not_run():
    from hisparse_jax.config import HiSparseConfigError
    from hisparse_jax.paged_state import PagedHiSparseState

    with pytest.raises(HiSparseConfigError, match="miss_read must be one of"):
        HiSparseConfig(miss_read="kernel")
    config = HiSparseConfig(top_k=K, device_buffer_size=B, miss_read="attention")
    with pytest.raises(ValueError, match="miss_read 'attention' is not available for PagedHiSparseState"):
        PagedHiSparseState.create(num_layers=L, num_requests=R, max_context=C, config=config, layout=KVRowLayout(LATENT, ROPE, "float32"), page_size=PAGE)


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


# pallas-fp8_e4m3 under -m slow (CI time): the Pallas kernels over fp8 rows stay covered by
# test_hisparse_equals_no_offload_over_many_steps[pallas-fp8_e4m3], the shared layer's replay by
# the other three cases here.
@pytest.mark.parametrize(
    "implementation, layout_kind",
    [("reference", "float32"), ("reference", "fp8_e4m3"), ("pallas", "float32"),
     pytest.param("pallas", "fp8_e4m3", marks=pytest.mark.slow)],
    ids=["reference-float32", "reference-fp8_e4m3", "pallas-float32", "pallas-fp8_e4m3"],
)  # fmt: skip
def test_shared_layer_replays_anchor_plan(implementation, layout_kind):
    """Layer 1 reuses layer 0's top-k and replays its miss plan: equal to no-offload."""
    results, *_ = run_decode(
        implementation, jnp.float32, layout_kind, steps=25, prompt_lens=[5, 20, 70],
        select=recent_and_random, shared_second_layer=True, seed=3,
    )
    misses = 0
    for t, (out_h, out_f, _, m, _, _) in enumerate(results):
        assert np.all(np.isfinite(out_h))
        np.testing.assert_array_equal(out_h, out_f, err_msg=f"step {t}")
        misses += m.sum()
    assert misses > 0


# ---- copies off the critical path: deferred backup, shared-layer prefetch ----------------------


@pytest.mark.parametrize(
    "implementation, layout_kind, prefetch",
    [("reference", "float32", "stream"), ("pallas", "float32", "stream"), ("pallas", "float32", "ffi_stream"),
     pytest.param("pallas", "fp8_e4m3", "early", marks=pytest.mark.slow)],  # ~20 s: CI time
)
def test_prefetched_shared_layer_and_deferred_backup_equal_no_offload(implementation, layout_kind, prefetch):
    """Layer 1 (shared) places rows fetched right after layer 0's plan (on a side stream, through
    XLA's annotation or our FFI calls, which on the CPU gather in line; or early in the main one) and every newest row is backed up after the last layer: bit-identical
    to no-offload, step after step. Host rows nothing wrote are NaN, so a row evicted before its
    backup, or a prefetch that read the wrong rows, shows."""
    prompt_lens, steps = [5, 20, 70], 12
    results, rows, _, state = run_decode(
        implementation, jnp.float32, layout_kind, steps=steps, prompt_lens=prompt_lens, select=recent_and_random,
        shared_second_layer=True, seed=3, prefetch=prefetch, deferred_backup=True,
    )  # fmt: skip
    misses = 0
    for t, (out_h, out_f, _, m, _, _) in enumerate(results):
        assert np.all(np.isfinite(out_h)), f"step {t}: HiSparse read an unwritten (NaN) row"
        np.testing.assert_array_equal(out_h, out_f, err_msg=f"step {t}")
        misses += m.sum()
    assert misses > 0
    backed_up = decoded_host_rows(state, prompt_lens, steps)  # [L, R, steps, W]
    expected = stored_values(rows, layout_kind)[:, np.arange(R)[:, None], np.array(prompt_lens)[:, None] + np.arange(steps)]
    np.testing.assert_array_equal(backed_up, expected)


def decoded_host_rows(state, prompt_lens, steps):
    """[L, R, steps, W] values of the host pool rows of the positions decoded (prompt_len ..
    prompt_len + steps - 1), read through the page table."""
    pool, table = np.asarray(state.host_pool), np.asarray(state.host_page_table)
    positions = np.array(prompt_lens)[:, None] + np.arange(steps)  # [R, steps]
    slots = table[np.arange(R)[:, None], positions // PAGE] * PAGE + positions % PAGE
    stored = jnp.asarray(pool[:, slots])  # row[L, R, steps, W]
    latent, rope = state.layout.unpack(stored)
    return np.concatenate([np.asarray(latent), np.asarray(rope)], axis=-1)


def test_without_the_backup_decoded_rows_stay_unwritten():
    """The check above can fail: with no backup at all, the decoded positions' host rows are
    still the NaN the pool was created with."""
    _, _, _, state = run_decode(
        "reference", jnp.float32, "float32", steps=4, prompt_lens=[5, 20, 70], select=recent_and_random,
        shared_second_layer=True, seed=3, skip_backup=True,
    )  # fmt: skip
    assert np.all(np.isnan(decoded_host_rows(state, [5, 20, 70], 4)))


def test_backup_newest_rows_checks_its_layers(states):
    with pytest.raises(ValueError, match=r"rows holds 1 layers, expected the state's L = 2"):
        kv_cache_ops.backup_newest_rows(states["hisparse"], [jnp.zeros((R, W))], jnp.zeros((R,), jnp.int32))


def test_shared_prefetch_mode(monkeypatch):
    monkeypatch.delenv("HISPARSE_SHARED_PREFETCH", raising=False)
    assert shared_prefetch_mode() == "off"  # the default off a CUDA GPU
    import hisparse_jax.attention_layer as attention_layer_module

    monkeypatch.setattr(attention_layer_module.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention_layer_module, "can_build_gpu", lambda: True)
    assert shared_prefetch_mode() == "ffi_stream"  # on a GPU that can build it: the default
    assert shared_prefetch_mode(implementation="tpu") == "off"  # the TPU kernels have no gather
    monkeypatch.setattr(attention_layer_module, "can_build_gpu", lambda: False)
    assert shared_prefetch_mode() == "off"  # no nvcc: in line
    monkeypatch.undo()
    monkeypatch.setenv("HISPARSE_SHARED_PREFETCH", "ffi_stream")
    assert shared_prefetch_mode() == "ffi_stream"
    monkeypatch.setenv("HISPARSE_SHARED_PREFETCH", "stream")
    assert shared_prefetch_mode() == "stream"
    with pytest.raises(ValueError, match=r"the TPU path has no gather yet"):
        shared_prefetch_mode(implementation="tpu")
    monkeypatch.setenv("HISPARSE_SHARED_PREFETCH", "off")
    assert shared_prefetch_mode() == "off"
    assert shared_prefetch_mode("early") == "early"
    with pytest.raises(ValueError, match=r"shared prefetch mode must be one of"):
        shared_prefetch_mode("sideways")


def test_prefetch_checks_the_anchor(states):
    with pytest.raises(ValueError, match=r"prefetch_shared_rows needs the anchor's plan"):
        prefetch_shared_rows(states["hisparse"], 1, LayerStepInfo(jnp.zeros(R), jnp.zeros(R), None))


@pytest.mark.slow  # ~29 s; the side-stream prefetch is opt-in (HISPARSE_SHARED_PREFETCH)
def test_glm_decode_step_prefetches_on_a_side_stream_without_copies(monkeypatch):
    """tiny_glm (full, full, shared, full, shared): the decode step lowers one side-stream call
    per shared layer (compute_on "gpu_stream:1"), and the compiled step copies neither the host
    pool nor the device buffer (a prefetch or backup XLA could not order in place would)."""
    from flax import nnx

    from configs.model import DSAModelConfig
    from hisparse_jax import memory
    from models.dsa.model import DSAForCausalLM
    from models.dsa.runner import ModelRunner

    monkeypatch.setenv("HISPARSE_SHARED_PREFETCH", "stream")
    config = DSAModelConfig.tiny_glm()
    runner = ModelRunner(DSAForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0)), implementation="pallas")
    cache = runner.create_cache(num_requests=2, max_context=64, hisparse=HiSparseConfig(top_k=config.index_topk), page_size=8)
    tokens = jnp.zeros(2, jnp.int32)
    lowered = runner._jitted(cache)["decode"].lower(runner.params, cache, tokens, tokens, None)
    calls = [line for line in lowered.as_text().splitlines() if "call @compute_on" in line and '_xla_stream_annotation = "1"' in line]
    assert len(calls) == config.indexer_types.count("shared")
    compiled = lowered.compile().as_text()
    for array in (cache.kv.host_pool, cache.kv.device_buffer):
        shape = f"{jnp.dtype(array.dtype).name.replace('float', 'f')}[{','.join(map(str, array.shape))}]"
        assert shape in compiled
        assert memory.hlo_copy_lines(compiled, shape) == []


def test_one_jitted_layer_step_serves_every_layer():
    """jit_attention_layer compiles once (traced layer index) and matches attention_layer with a
    static layer index bit for bit: outputs, counters and every state array, step after step."""
    prompt_lens = [20, 5, 40]
    rows = np.random.default_rng(6).standard_normal((L, R, C, LATENT + ROPE)).astype(np.float32)

    def prefilled():
        hisparse, _ = make_states(jnp.float32, "float32")
        return prefill(hisparse, rows, prompt_lens, C // PAGE, "pallas")

    traced, static = prefilled(), prefilled()
    step = jit_attention_layer(traced, latent_dim=LATENT, sm_scale=SCALE, implementation="pallas")
    static_steps = [
        jit_donating_state(
            functools.partial(attention_layer, layer=layer, latent_dim=LATENT, sm_scale=SCALE, implementation="pallas"),
            static, extra_outputs=2,
        )
        for layer in range(L)
    ]  # fmt: skip
    advance = jit_donating_state(kv_cache_ops.advance, traced)
    rng = np.random.default_rng(4)
    positions = np.array(prompt_lens, np.int32)
    misses = 0
    for _ in range(3):
        for layer in range(L):
            query = jnp.asarray(rng.standard_normal((R, H, LATENT + ROPE)), jnp.float32)
            row = jnp.asarray(rng.standard_normal((R, LATENT + ROPE)), jnp.float32)
            topk = jnp.asarray(rng.integers(0, 6, (R, K)), jnp.int32)
            args = (query, row, jnp.asarray(positions), topk)
            traced, out, info = step(traced, jnp.int32(layer), *args)
            static, expected_out, expected_info = static_steps[layer](static, query=query, new_row=row, positions=args[2], topk=topk)
            assert np.all(np.isfinite(np.asarray(out)))
            np.testing.assert_array_equal(np.asarray(out), np.asarray(expected_out))
            np.testing.assert_array_equal(np.asarray(info.num_hits), np.asarray(expected_info.num_hits))
            np.testing.assert_array_equal(np.asarray(info.num_misses), np.asarray(expected_info.num_misses))
            misses += int(info.num_misses.sum())
        traced = advance(traced, jnp.asarray(positions) >= 0)
        static = advance(static, jnp.asarray(positions) >= 0)
        positions = positions + 1
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(traced)[0], jax.tree.leaves(static)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))  # NaN == NaN
    assert misses > 0
    assert step._cache_size() == 1


# ---- static shape checks ----------------------------------------------------------------------

W = LATENT + ROPE


@pytest.fixture(scope="module")
def states():
    hisparse, full = make_states(jnp.float32, "float32")
    return dict(hisparse=hisparse, full=full)


def layer_args(**changes):
    args = dict(
        layer=0,
        query=jnp.zeros((R, H, W), jnp.float32),
        new_row=jnp.zeros((R, W), jnp.float32),
        positions=jnp.zeros((R,), jnp.int32),
        topk=jnp.zeros((R, K), jnp.int32),
    )
    return {**args, **changes}


STEP_SHAPE_ERRORS = [
    (dict(query=jnp.zeros((R, H, W + 1))), r"query width \(49\) must equal the state's latent \+ rope width \(48\)"),
    (dict(new_row=jnp.zeros((R, W - 1))), r"new_row width \(47\) must equal the state's row width \(48\)"),
    (dict(query=jnp.zeros((R + 1, H, W))), r"query batch \(4\) must equal positions batch \(b\) \(3\)"),
    (dict(new_row=jnp.zeros((R - 1, W))), r"new_row batch \(2\) must equal positions batch \(b\) \(3\)"),
    (dict(positions=jnp.zeros((R + 2,), jnp.int32)), r"positions batch \(5\) must not exceed the state's request slots \(R = 3\)"),
    (dict(topk=jnp.zeros((1, K), jnp.int32)), r"topk batch \(1\) must equal positions batch \(b\) \(3\)"),
    (dict(topk=jnp.zeros((K,), jnp.int32)), r"topk must be \[R, K\] \(2 dimensions\), got shape \(8,\)"),
    (dict(query=jnp.zeros((R, W))), r"query must be \[R, H, W\]"),
    (dict(layer=L), r"layer \(2\) must be in \[0, num_layers \(2\)\)"),
    (dict(layer=-1), r"layer \(-1\) must be in \[0, num_layers \(2\)\)"),
]


@pytest.mark.parametrize("kind", ["hisparse", "full"])
@pytest.mark.parametrize("changes, message", STEP_SHAPE_ERRORS)
def test_attention_layer_checks_static_shapes(states, kind, changes, message):
    args = layer_args(**changes)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda: attention_layer(states[kind], **args, latent_dim=LATENT, sm_scale=SCALE))


def test_attention_layer_checks_top_k_fits_the_buffer(states):
    args = layer_args(topk=jnp.zeros((R, B + 1), jnp.int32))
    with pytest.raises(ValueError, match=r"top_k \(17\) must be <= device_buffer_size \(16\)"):
        jax.eval_shape(lambda: attention_layer(states["hisparse"], **args, latent_dim=LATENT, sm_scale=SCALE))
    # Without offload there is no buffer to fit: every position is on the device.
    jax.eval_shape(lambda: attention_layer(states["full"], **args, latent_dim=LATENT, sm_scale=SCALE))


def anchor_info(rows, k=K):
    plan = SwapInPlan(*(jnp.zeros((rows, k), jnp.int32), jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.int32)),
                      jnp.full((rows, k), -1, jnp.int32), jnp.full((rows, k), -1, jnp.int32))
    return LayerStepInfo(plan.num_hits, plan.num_misses, plan)


@pytest.mark.parametrize("kind", ["hisparse", "full"])
@pytest.mark.parametrize("changes, message", [case for case in STEP_SHAPE_ERRORS if "topk" not in case[0]])
def test_shared_attention_layer_checks_static_shapes(states, kind, changes, message):
    args = layer_args(**changes)
    del args["topk"]
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda: shared_attention_layer(states[kind], **args, anchor=anchor_info(R), latent_dim=LATENT, sm_scale=SCALE))


def test_shared_attention_layer_checks_the_anchor(states):
    args = layer_args()
    del args["topk"]
    with pytest.raises(ValueError, match=r"anchor plan slots batch \(2\) must equal positions batch \(b\) \(3\)"):
        shared_attention_layer(states["hisparse"], **args, anchor=anchor_info(R - 1), latent_dim=LATENT, sm_scale=SCALE)
    with pytest.raises(ValueError, match="needs the anchor's plan"):
        shared_attention_layer(states["hisparse"], **args, anchor=LayerStepInfo(None, None, None), latent_dim=LATENT, sm_scale=SCALE)


@pytest.mark.parametrize("kind", ["hisparse", "full"])
def test_lifecycle_checks_static_shapes(states, kind):
    state = states[kind]
    with pytest.raises(ValueError, match=r"rows width \(47\) must equal the state's row width \(48\)"):
        kv_cache_ops.store_prefill_rows(state, 0, 0, 0, jnp.zeros((5, W - 1)), 5)
    with pytest.raises(ValueError, match=r"layer \(2\) must be in \[0, num_layers \(2\)\)"):
        kv_cache_ops.store_prefill_rows(state, L, 0, 0, jnp.zeros((5, W)), 5)
    with pytest.raises(ValueError, match=r"active length \(4\) must not exceed the state's request slots \(3\)"):
        kv_cache_ops.advance(state, jnp.ones((R + 1,), bool))


def test_begin_request_checks_host_pages(states):
    with pytest.raises(ValueError, match=r"host_pages shape \(3,\) must be \(P,\) = \(16,\)"):
        kv_cache_ops.begin_request(states["hisparse"], 0, 5, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="needs the request's host_pages"):
        kv_cache_ops.begin_request(states["hisparse"], 0, 5)


@pytest.mark.parametrize("implementation", ["reference", "pallas"])
@pytest.mark.parametrize(
    "query_shape, kv_shape, slots_shape, layer, latent, message",
    [
        ((R, H, W + 1), (L, R, B, W), (R, K), 0, LATENT, r"query width \(49\) must equal kv row width \(W\) \(48\)"),
        ((R + 1, H, W), (L, R, B, W), (R + 1, K), 0, LATENT, r"query batch \(R = 4\) must not exceed the kv request slots \(3\)"),
        ((R, H, W), (L, R, B, W), (R - 1, K), 0, LATENT, r"slots batch \(2\) must equal query batch \(R\) \(3\)"),
        ((R, H, W), (L, R, B, W), (R, K), L, LATENT, r"layer \(2\) must be in \[0, num_layers \(2\)\)"),
        ((R, H, W), (L, R, B, W), (R, K), 0, W + 1, r"latent_dim \(49\) must be in \[1, row width \(48\)\]"),
        ((R, H, W), (R, B, W), (R, K), 0, LATENT, r"kv must be \[L, R, S, W\]"),
    ],
)
def test_sparse_mla_attention_checks_static_shapes(implementation, query_shape, kv_shape, slots_shape, layer, latent, message):
    query, kv, slots = jnp.zeros(query_shape), jnp.zeros(kv_shape), jnp.zeros(slots_shape, jnp.int32)
    with pytest.raises(ValueError, match=message):
        sparse_mla_attention(query, kv, layer, slots, latent_dim=latent, sm_scale=SCALE, implementation=implementation)


# ---- fp8 rows (FlashMLA's packed layout) ------------------------------------------------------

FP8_LAYOUT = KVRowLayout(LATENT, ROPE, "fp8_e4m3")


@pytest.mark.parametrize("fp8_form", FP8_FORMS)
@pytest.mark.parametrize(
    "query_dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)]
)  # f32: full-precision matmuls; bf16: the bf16 rows' tolerance
def test_fp8_attention_kernel_equals_reference(query_dtype, tolerance, fp8_form):
    """The kernel dequantises fp8 rows itself, in each byte order (fp8_form); the reference
    unpacks them to f32. Slots nothing selects are NaN (all-ones words), so a stray read shows."""
    rng = np.random.default_rng(7)
    S = 24
    values = rng.standard_normal((L, R, S, W)).astype(np.float32)
    values[..., :LATENT] *= np.exp(rng.uniform(-3, 3, (L, R, S, 1))).astype(np.float32)
    kv = FP8_LAYOUT.pack(jnp.asarray(values[..., :LATENT]), jnp.asarray(values[..., LATENT:]))
    slots = rng.integers(0, 16, (R, K)).astype(np.int32)
    slots[0, 2] = slots[0, 5] = -1
    slots[1, 3] = slots[1, 0]  # a repeat
    slots[2] = -1  # nothing valid: zeros
    nan_word = FP8_LAYOUT.fill_element(float("nan"))
    kv = kv.at[:, :, 16:].set(nan_word).at[0].set(nan_word)  # slots >= 16 and the other layer
    query = jnp.asarray(rng.standard_normal((R, H, W)), query_dtype)
    attend = lambda impl: np.asarray(  # noqa: E731
        sparse_mla_attention(
            query, kv, 1, jnp.asarray(slots), latent_dim=LATENT, sm_scale=SCALE, layout=FP8_LAYOUT, implementation=impl,
            **({"fp8_form": fp8_form} if impl == "pallas" else {}),
        )
    )
    if not interpret_mode() and fp8_form == "planes":
        # Planes of LATENT / 4 = 8 columns are too narrow for Triton's dots: refused by name.
        with pytest.raises(ValueError, match="need >= 16"):
            attend("pallas")
        return
    ref, got = attend("reference"), attend("pallas")
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(ref))
    np.testing.assert_allclose(got, ref, rtol=tolerance, atol=tolerance * np.abs(ref).max())
    np.testing.assert_array_equal(got[2], 0.0)
    # The reference over the dequantised values, independent of the library's kernels.
    deq = stored_values(values[1], "fp8_e4m3")  # [R, S, W]
    q = np.asarray(query.astype(jnp.float32))
    np.testing.assert_allclose(ref, dense_reference(q, deq, slots), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("query_dtype", [jnp.float32, jnp.bfloat16])
def test_dequantizing_kernel_makes_the_rows_xla_makes(query_dtype):
    """fp8_form "dequantize_kernel" (a Pallas kernel writes the dequantised rows) attends over the
    same values as "dequantize_first" (XLA's fusion does): the outputs are equal bit for bit,
    with repeats, empty entries and NaN words in the slots nothing selects."""
    rng = np.random.default_rng(11)
    values = rng.standard_normal((L, R, 24, W)).astype(np.float32)
    values[..., :LATENT] *= np.exp(rng.uniform(-3, 3, (L, R, 24, 1))).astype(np.float32)
    kv = FP8_LAYOUT.pack(jnp.asarray(values[..., :LATENT]), jnp.asarray(values[..., LATENT:]))
    kv = kv.at[:, :, 16:].set(FP8_LAYOUT.fill_element(float("nan")))
    slots = rng.integers(0, 16, (R, K)).astype(np.int32)
    slots[0, 1], slots[1, 4], slots[2, 0] = -1, slots[1, 2], -1
    query = jnp.asarray(rng.standard_normal((R, H, W)), query_dtype)
    attend = lambda form: np.asarray(  # noqa: E731
        sparse_mla_attention(query, kv, 1, jnp.asarray(slots), latent_dim=LATENT, sm_scale=SCALE, layout=FP8_LAYOUT,
                             implementation="pallas", fp8_form=form)  # fmt: skip
    )
    first, kernel = attend("dequantize_first"), attend("dequantize_kernel")
    assert np.all(np.isfinite(kernel)) and np.abs(kernel).max() > 0
    np.testing.assert_array_equal(kernel, first)


@pytest.mark.parametrize("form", FP8_FORMS)
def test_plane_permutation_is_a_permutation_that_matches_the_packed_bytes(form):
    """Column c of the plane-ordered latent is the byte of the word the kernel reads it from:
    every latent column of a packed random row, read plane by plane, is the dequantised value of
    column perm[c]."""
    D, rope, G = 512, 64, 128
    perm = plane_permutation(D, rope, form)
    assert sorted(perm) == list(range(D + rope))
    if form != "planes":
        np.testing.assert_array_equal(perm, np.arange(D + rope))
        return
    layout = KVRowLayout(D, rope, "fp8_e4m3")
    row = np.asarray(layout.pack(jnp.asarray(np.random.default_rng(3).standard_normal((1, D)), jnp.float32), jnp.zeros((1, rope))))[0]
    words, scale = row[: D // 4], row[D // 4 : D // 4 + D // G].view(np.float32)
    planes = [(words >> (8 * j)) & 0xFF for j in range(4)]  # plane j: latent 4w + j
    fp8 = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(np.concatenate(planes), jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32))
    dequantised = np.asarray(layout.unpack(jnp.asarray(row))[0])  # f32[D], latent order
    np.testing.assert_array_equal(fp8 * scale[perm[:D] // G], dequantised[perm[:D]])
    assert len(np.unique(dequantised)) > D // 2  # distinct columns, so a wrong order shows


def test_fp8_rows_bf16_queries_within_tolerance_of_dense():
    """bf16 queries over fp8 rows through whole decode steps (Pallas): HiSparse == no-offload bit
    for bit, and within the bf16 tolerance of float64 attention over the dequantised rows."""
    results, rows, queries, _ = run_decode(
        "pallas", jnp.bfloat16, "fp8_e4m3", steps=8, prompt_lens=[10, 30, 50], select=recent_and_random, seed=1
    )
    rows = stored_values(rows, "fp8_e4m3")
    misses = 0
    for t, (out_h, out_f, _, m, topk, positions) in enumerate(results):
        assert np.all(np.isfinite(out_h))
        np.testing.assert_array_equal(out_h, out_f, err_msg=f"step {t}")
        for layer in range(L):
            q = np.asarray(jnp.asarray(queries[t, layer], jnp.bfloat16).astype(jnp.float32))
            expected = dense_reference(q, rows[layer, :, : positions.max() + 1], topk[layer])
            np.testing.assert_allclose(out_h[layer], expected, rtol=2e-2, atol=2e-2)
        misses += m.sum()
    assert misses > 0


@pytest.fixture(scope="module")
def fp8_states():
    hisparse, full = make_states(jnp.float32, "fp8_e4m3")
    return dict(hisparse=hisparse, full=full)


@pytest.mark.parametrize("kind", ["hisparse", "full"])
def test_fp8_states_hold_packed_rows(fp8_states, kind):
    state = fp8_states[kind]
    assert state.layout == FP8_LAYOUT
    assert state.device_rows.dtype == jnp.uint32 and state.device_rows.shape[-1] == FP8_LAYOUT.width == 17
    if kind == "hisparse":
        assert state.host_pool.dtype == jnp.uint32 and state.host_pool.shape[-1] == 17
    # Unwritten rows read as NaN (the fill), so a stray read shows.
    assert np.all(np.isnan(np.asarray(FP8_LAYOUT.unpack(state.device_rows[0, 0, :2])[0])))


@pytest.mark.parametrize("kind", ["hisparse", "full"])
@pytest.mark.parametrize(
    "changes, message",
    [
        # The query meets the row's values: latent + rope (48), not the stored width (17).
        (dict(query=jnp.zeros((R, H, 17))), r"query width \(17\) must equal the state's latent \+ rope width \(48\)"),
        (dict(new_row=jnp.zeros((R, 17), jnp.float32)), r"new_row \(float32, width 17\) must be stored rows \(uint32, width 17\)"),
        (dict(new_row=jnp.zeros((R, 48), jnp.uint32)), r"new_row \(uint32, width 48\) must be stored rows"),
    ],
)
def test_fp8_attention_layer_checks_widths(fp8_states, kind, changes, message):
    args = layer_args(**changes)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda: attention_layer(fp8_states[kind], **args, latent_dim=LATENT, sm_scale=SCALE))
    # Stored rows and row values are both accepted.
    for row in (jnp.zeros((R, 17), jnp.uint32), jnp.zeros((R, 48), jnp.bfloat16)):
        jax.eval_shape(lambda: attention_layer(fp8_states[kind], **layer_args(new_row=row), latent_dim=LATENT, sm_scale=SCALE))


def test_fp8_attention_checks_the_layout():
    kv = jnp.zeros((L, R, B, 17), jnp.uint32)
    query, slots = jnp.zeros((R, H, W)), jnp.zeros((R, K), jnp.int32)
    with pytest.raises(ValueError, match=r"kv rows of uint32 are packed: pass their layout="):
        sparse_mla_attention(query, kv, 0, slots, latent_dim=LATENT, sm_scale=SCALE)
    with pytest.raises(ValueError, match=r"query width \(17\) must equal the layout's latent \+ rope width \(48\)"):
        sparse_mla_attention(jnp.zeros((R, H, 17)), kv, 0, slots, latent_dim=LATENT, sm_scale=SCALE, layout=FP8_LAYOUT)
    with pytest.raises(ValueError, match=r"kv row width \(18\) must equal the fp8_e4m3 layout's row width \(W\) \(17\)"):
        sparse_mla_attention(query, jnp.zeros((L, R, B, 18), jnp.uint32), 0, slots, latent_dim=LATENT, sm_scale=SCALE, layout=FP8_LAYOUT)


@pytest.mark.parametrize("implementation", ["reference", "pallas"])
def test_a_batch_smaller_than_the_slots_steps_the_first_slots(implementation):
    # The engine's batch buckets: a step over b = 2 of R = 3 slots must give slots 0 and 1 what a
    # step over all 3 gives them (slot 2 inactive), and leave slot 2's state as it was.
    rng = np.random.default_rng(11)
    prompt_lens, steps = [40, 9, 30], 6
    rows = rng.standard_normal((L, R, max(prompt_lens) + steps, LATENT + ROPE)).astype(np.float32)
    queries = rng.standard_normal((steps, L, R, H, LATENT + ROPE)).astype(np.float32)
    step_fn = decode_step_fn(implementation)
    states = {}
    for b in (2, 3):
        state, _ = make_states(jnp.float32, "float32")
        states[b] = prefill(state, rows, prompt_lens, C // PAGE, implementation)
    before = jax.tree.map(np.asarray, states[2])
    step = {b: jit_donating_state(step_fn, states[b], extra_outputs=3) for b in (2, 3)}
    positions = np.array(prompt_lens, np.int32)
    positions[2] = -1  # the third slot sits out
    misses = 0
    for t in range(steps):
        topk = np.stack([recent_and_random(rng, np.maximum(positions, 0), layer) for layer in range(L)]).astype(np.int32)
        new_rows = rows[:, np.arange(R), np.maximum(positions, 0)]  # [L, R, W]
        outs = {}
        for b in (2, 3):
            args = (queries[t][:, :b], new_rows[:, :b], positions[:b], topk[:, :b])
            states[b], outs[b], _, miss = step[b](states[b], *map(jnp.asarray, args))
        misses += int(np.sum(miss))
        np.testing.assert_array_equal(outs[2], np.asarray(outs[3])[:, :2], err_msg=f"step {t}")
        assert np.all(np.isfinite(outs[2]))
        positions[:2] += 1
    assert misses > 0, "the test never exercised a miss"
    after = jax.tree.map(np.asarray, states[2])
    for name in ("device_buffer", "buffer_tokens", "lru_slots"):
        np.testing.assert_array_equal(getattr(after, name)[:, 2], getattr(before, name)[:, 2], err_msg=name)
    np.testing.assert_array_equal(after.seq_lens, [40 + steps, 9 + steps, 30])
    for name in ("device_buffer", "buffer_tokens", "lru_slots", "seq_lens"):
        np.testing.assert_array_equal(getattr(after, name), np.asarray(getattr(states[3], name)), err_msg=name)


@pytest.mark.parametrize("layout_kind", ["float32", "fp8_e4m3"])
@pytest.mark.parametrize("num_splits, keys_major, transposed_acc", [(2, False, False), (3, False, False), (1, True, False), (3, True, True)])
def test_split_k_attention_equals_the_reference(layout_kind, num_splits, keys_major, transposed_acc):
    """Flash-decoding's split-K: each program attends over its share of the key blocks and
    combine_splits merges them. 3 splits of 3 key blocks leave none empty, 2 splits an uneven
    share; request 2 selects nothing (zeros), request 1 has valid keys in one split only.
    keys_major: q . k as keys x heads and its softmax over the rows, split or not (fp8 rows:
    through dequantize_first, the default form); transposed_acc: the values' product too."""
    rng = np.random.default_rng(3)
    S, k = 24, 3 * 16  # 3 key blocks of 16 (the smallest block the kernel takes)
    values = rng.standard_normal((L, R, S, W)).astype(np.float32)
    layout = KVRowLayout(LATENT, ROPE, layout_kind)
    kv = layout.pack(jnp.asarray(values[..., :LATENT]), jnp.asarray(values[..., LATENT:]))
    slots = rng.integers(0, 16, (R, k)).astype(np.int32)
    slots[1, 16:] = -1
    slots[2] = -1
    kv = kv.at[:, :, 16:].set(layout.fill_element(float("nan")))  # never selected
    query = jnp.asarray(rng.standard_normal((R, H, W)), jnp.float32)
    attend = dict(latent_dim=LATENT, sm_scale=SCALE, layout=layout)
    ref = np.asarray(sparse_mla_attention(query, kv, 1, jnp.asarray(slots), implementation="reference", **attend))
    got = np.asarray(sparse_mla_attention(query, kv, 1, jnp.asarray(slots), implementation="pallas", block_k=16, num_splits=num_splits,
                                          keys_major=keys_major, transposed_acc=transposed_acc, **attend))  # fmt: skip
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_array_equal(got[2], 0.0)
    # The kernel the option builds: the weights [keys, heads] contract their first axis with the values.
    kernel = functools.partial(pallas_triton.sparse_mla_attention_pallas, latent_dim=LATENT, sm_scale=SCALE, block_k=16, keys_major=keys_major)
    text = str(jax.make_jaxpr(kernel)(query, jnp.asarray(values), 1, jnp.asarray(slots)))  # plain f32 rows
    assert ("dimension_numbers=(([0], [0])" in text) == keys_major
    if keys_major and layout_kind == "fp8_e4m3":
        with pytest.raises(ValueError, match="keys_major applies to rows the kernel reads unpacked"):
            sparse_mla_attention(query, kv, 1, jnp.asarray(slots), implementation="pallas", keys_major=True, fp8_form="interleave", **attend)
    if transposed_acc:
        with pytest.raises(ValueError, match="transposed_acc multiplies keys-major weights"):
            sparse_mla_attention(query, kv, 1, jnp.asarray(slots), implementation="pallas", keys_major=False, transposed_acc=True, **attend)


def test_small_grids_split_the_keys():
    assert default_num_splits(256, 32) == 1  # batch 128 x 2 head blocks: the grid fills the GPU
    assert default_num_splits(100, 32) == 1  # the rank's 50 x 128 heads: unsplit measured faster
    assert default_num_splits(50, 32) == 6  # 50 x 64 heads: splitting measured faster
    assert default_num_splits(2, 32) == 16  # one request, 2 head blocks: 16 splits of 2 key blocks
    assert default_num_splits(32, 16) == 8  # batch 16 x 2 head blocks
    assert default_num_splits(4, 3) == 1  # too few key blocks to share


def test_fp8_attention_default_form_at_deepseek_widths():
    """At DeepSeek-V3.2's row widths (512 + 64) the default form and the planes form (which the
    tiny rows the other tests use cannot take on a GPU) equal the reference."""
    layout = KVRowLayout(512, 64, "fp8_e4m3")
    rng = np.random.default_rng(11)
    R_, H_, S_, K_ = 2, 16, 40, 16
    values = rng.standard_normal((1, R_, S_, 576)).astype(np.float32)
    kv = layout.pack(jnp.asarray(values[..., :512]), jnp.asarray(values[..., 512:]))
    kv = kv.at[:, :, 32:].set(layout.fill_element(float("nan")))  # never selected
    slots = rng.integers(0, 32, (R_, K_)).astype(np.int32)
    slots[1, 3:7] = -1
    query = jnp.asarray(rng.standard_normal((R_, H_, 576)), jnp.float32)
    attend = lambda impl, **form: np.asarray(  # noqa: E731
        sparse_mla_attention(query, kv, 0, jnp.asarray(slots), latent_dim=512, sm_scale=0.05, layout=layout, implementation=impl, **form)
    )
    ref = attend("reference")
    for form in ({}, {"fp8_form": "planes"}):
        got = attend("pallas", **form)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=str(form))
