"""Data-parallel attention x tensor parallelism on a 2 x 2 mesh of CPU devices.

The sharded layer must give what the single-device layer gives, step after step, with the
requests (and their KV, buffers and host pool blocks) split over the "dp" axis and the heads
over "tp".
"""

import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax import kv_cache_ops, sharding
from hisparse_jax.attention_layer import attention_layer
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.row_layout import KVRowLayout
from hisparse_jax.state import FullKVState, HiSparseState, jit_donating_state

L, R, H, LATENT, ROPE = 2, 4, 4, 32, 16
K, B, C, PAGE = 8, 16, 96, 8
PAGES_PER_REQUEST = C // PAGE
PARALLEL = sharding.ParallelConfig(tp_size=4, dp_size=2, enable_dp_attention=True)


def test_parallel_config_follows_sglang():
    assert (PARALLEL.num_devices, PARALLEL.attention_tp, PARALLEL.ffn_axes) == (4, 2, ("dp", "tp"))
    replicas = sharding.ParallelConfig(tp_size=2, dp_size=2)
    assert (replicas.num_devices, replicas.attention_tp, replicas.ffn_axes) == (4, 2, ("tp",))
    with pytest.raises(sharding.ParallelConfigError, match="multiple of dp_size"):
        sharding.ParallelConfig(tp_size=3, dp_size=2, enable_dp_attention=True)
    with pytest.raises(sharding.ParallelConfigError, match="needs 16 devices"):
        sharding.ParallelConfig(tp_size=8, dp_size=2).make_mesh()


def make_state(kind, mesh):
    layout = KVRowLayout(LATENT, ROPE, "float32")
    if kind == "full":
        return FullKVState.create(num_layers=L, num_requests=R, max_context=C, layout=layout, fill_value=jnp.nan, mesh=mesh)
    config = HiSparseConfig(top_k=K, device_buffer_size=B, miss_read="attention" if kind == "hisparse_miss_read" else "copy")
    return HiSparseState.create(
        num_layers=L, num_requests=R, max_context=C, config=config, layout=layout,
        num_host_pages=R * PAGES_PER_REQUEST, page_size=PAGE, fill_value=jnp.nan, mesh=mesh,
    )


def run(kind, mesh, rows, queries, topks, prompt_lens, steps):
    state = make_state(kind, mesh)
    groups = 1 if mesh is None else mesh.shape["dp"]
    per_group = R // groups
    store = kv_cache_ops.store_prefill_rows if mesh is None else (lambda *a: sharding.store_prefill_rows(mesh, *a))
    layer_fn = attention_layer if mesh is None else (lambda *a, **k: sharding.attention_layer(mesh, *a, **k))
    admit = jit_donating_state(kv_cache_ops.begin_request, state)
    put = jit_donating_state(store, state)
    for r, n in enumerate(prompt_lens):
        pages = None
        if kind.startswith("hisparse"):  # page numbers local to the request's group block
            local = r % per_group
            pages = jnp.arange(local * PAGES_PER_REQUEST, (local + 1) * PAGES_PER_REQUEST, dtype=jnp.int32)
        state = admit(state, r, n, pages)
        for layer in range(L):
            chunk = np.zeros((C, LATENT + ROPE), np.float32)
            chunk[:n] = rows[layer, r, :n]
            state = put(state, layer, r, 0, jnp.asarray(chunk), n)

    def step(state, query, new_rows, positions, topk):
        outs = []
        for layer in range(L):
            state, out, _ = layer_fn(state, layer, query[layer], new_rows[layer], positions, topk[layer],
                                     latent_dim=LATENT, sm_scale=0.2, implementation="pallas")
            outs.append(out)
        return kv_cache_ops.advance(state, positions >= 0), jnp.stack(outs)

    step = jit_donating_state(step, state, extra_outputs=1)
    positions = np.array(prompt_lens, np.int32)
    outs = []
    for t in range(steps):
        new_rows = rows[:, np.arange(R), positions]
        state, out = step(state, jnp.asarray(queries[t]), jnp.asarray(new_rows), jnp.asarray(positions), jnp.asarray(topks[t]))
        outs.append(np.asarray(out))
        positions = positions + 1
    return np.stack(outs), state


@pytest.mark.parametrize("kind", ["hisparse", "hisparse_miss_read", "full"])
def test_dp2_tp2_attention_equals_single_device(kind):
    rng = np.random.default_rng(0)
    steps, prompt_lens = 12, [5, 20, 40, 14]
    rows = rng.standard_normal((L, R, C, LATENT + ROPE)).astype(np.float32)
    queries = rng.standard_normal((steps, L, R, H, LATENT + ROPE)).astype(np.float32)
    topks = np.full((steps, L, R, K), -1, np.int32)
    for t in range(steps):
        for r, n0 in enumerate(prompt_lens):
            n = n0 + t + 1
            topks[t, :, r, : min(K, n)] = rng.integers(0, n, (L, min(K, n)))
    mesh = PARALLEL.make_mesh()
    single, _ = run(kind, None, rows, queries, topks, prompt_lens, steps)
    split, state = run(kind, mesh, rows, queries, topks, prompt_lens, steps)
    assert np.all(np.isfinite(split))
    np.testing.assert_allclose(split, single, rtol=1e-6, atol=1e-6)
    # Each group's devices hold only its own requests' KV.
    leaf = state.kv if kind == "full" else state.host_pool
    shard_rows = {s.device: s.index for s in leaf.addressable_shards}
    assert len({str(index) for index in shard_rows.values()}) == 2
