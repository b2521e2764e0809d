"""The side-stream gather's two FFI calls (pallas_kernels.side_stream_gather), on the CPU build.

The CUDA build runs the same calls on a stream of its own (checked on the H200 by
benchmarks/bench_overlap.py: tiny_check bit-identical to no offload, tokens equal to the in-line
replay). Here: the gather against its jnp reference, input checks, and that in a compiled decode
step XLA keeps each start early and its wait late (the pass-through operand's job).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model import DSAModelConfig
from hisparse_jax import memory
from hisparse_jax.config import HiSparseConfig
from models.dsa.model import DSAForCausalLM
from models.dsa.runner import ModelRunner
from models.dsa.generate import generate
from models.dsa.decoding import prefetch_start_point
from pallas_kernels.row_copy import gather_host_rows_reference
from pallas_kernels.side_stream_gather import PendingGather, side_gather_start, side_gather_wait

L, S, W, R, K = 3, 50, 164, 4, 8


@pytest.fixture(scope="module")
def pool():
    words = np.random.default_rng(0).integers(0, 2**32, (L, S, W), dtype=np.uint32)  # fp8 rows as uint32 words
    return jax.device_put(jnp.asarray(words), memory.sharding(memory.PINNED_HOST))


@pytest.mark.parametrize("layer", [0, 2])
def test_gather_equals_the_reference(pool, layer):
    rng = np.random.default_rng(layer)
    host_slots = jnp.asarray(rng.integers(0, S, (R, K)), jnp.int32)
    counts = jnp.asarray([0, 3, K, 5], jnp.int32)

    @jax.jit
    def fetch(pool, layer, host_slots, counts, tie):
        pending, tie = PendingGather.start(pool, layer, host_slots, counts, tie, tag=7)
        rows, tie = pending.wait(tie * 2)
        return rows, tie

    rows, tie = fetch(pool, jnp.int32(layer), host_slots, counts, jnp.ones(3))  # a traced layer index
    expected = gather_host_rows_reference(pool, layer, host_slots, counts)
    taken = np.arange(K)[None, :] < np.asarray(counts)[:, None]  # only the first counts[r] are defined
    np.testing.assert_array_equal(np.asarray(rows)[taken], np.asarray(expected)[taken])
    np.testing.assert_array_equal(tie, 2 * np.ones(3))


def test_inputs_are_checked(pool):
    slots, counts, tie = jnp.zeros((R, K), jnp.int32), jnp.zeros((R,), jnp.int32), jnp.zeros(())
    with pytest.raises(ValueError, match=r"layer \(3\) must be in \[0, num_layers \(3\)\)"):
        side_gather_start(pool, 3, slots, counts, tie, tag=0)
    with pytest.raises(ValueError, match=r"counts batch \(3\) must equal host_slots batch \(R\) \(4\)"):
        side_gather_start(pool, 0, slots, counts[:3], tie, tag=0)
    with pytest.raises(ValueError, match=r"whole 4-byte words"):
        side_gather_start(jnp.zeros((L, S, 3), jnp.uint8), 0, slots, counts, tie, tag=0)
    with pytest.raises(TypeError, match=r"tag must be a static int"):
        side_gather_wait(jnp.zeros((R, K, W), jnp.uint32), pool, 0, slots, counts, tie, tag="a")


def test_decode_step_threads_compute_through_start_and_wait():
    """tiny_glm with HiSparse and shared_prefetch="ffi_stream": what pins each call's place in
    XLA's schedule is the pass-through operand, so the compute after each start (the anchor's
    o_proj) and each wait (the shared layer's attention) must use the call's second result.
    Without it XLA may put a start right before its wait, as it did with the stream annotation
    (docs/architecture.md); the CPU scheduler keeps them apart either way, so the dependency is
    what this checks. The compiled step copies neither the pool nor the buffer."""
    config = DSAModelConfig.tiny_glm()
    runner = ModelRunner(DSAForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0)), shared_prefetch="ffi_stream")
    cache = runner.create_cache(num_requests=2, max_context=64, hisparse=HiSparseConfig(top_k=config.index_topk), page_size=8)
    tokens = jnp.zeros(2, jnp.int32)
    lowered = runner._jitted(cache)["decode"].lower(runner.params, cache, tokens, tokens, None)
    text = lowered.as_text()
    starts = re.findall(r"(%\w+):2 = stablehlo.custom_call @hisparse_side_gather_start\(", text)
    waits = re.findall(r"(%\w+) = stablehlo.custom_call @hisparse_side_gather_wait\(", text)
    assert len(starts) == len(waits) == config.indexer_types.count("shared")
    for name in starts:
        assert f"{name}#1" in text, f"start: nothing uses its pass-through result {name}#1"
    for name in waits:  # the wait's tie comes back through a barrier with the rows
        barrier = re.search(rf"(%\w+):2 = stablehlo.optimization_barrier %[\w#]+, {name}\b", text)
        assert barrier, f"wait {name}: no barrier orders the rows after it"
        assert f"{barrier.group(1)}#1" in text, f"wait {name}: nothing uses its pass-through result"
    compiled = lowered.compile().as_text()
    for array in (cache.kv.host_pool, cache.kv.device_buffer):
        shape = f"{jnp.dtype(array.dtype).name.replace('float', 'f')}[{','.join(map(str, array.shape))}]"
        assert memory.hlo_copy_lines(compiled, shape) == []


@pytest.mark.parametrize(
    "start_at",  # CI runs the default; "mlp" is also the start test_attention_layer's ffi_stream case uses
    ["staggered", pytest.param("attention", marks=pytest.mark.slow), pytest.param("mlp", marks=pytest.mark.slow)],
)
def test_every_start_point_decodes_as_no_offload(monkeypatch, start_at):
    """A GLM pattern with consecutive shared layers (F S S F S), NaN in every unwritten row:
    wherever the gathers start (models.dsa.decoding.prefetch_start_point), HiSparse with the
    side-stream prefetch decodes the logits of no offload bit for bit."""
    monkeypatch.setenv("HISPARSE_PREFETCH_START", start_at)
    config = DSAModelConfig.tiny_glm().replace(indexer_types=("full", "shared", "shared", "full", "shared"))
    model = DSAForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(1).integers(0, config.vocab_size, (2, 21)).astype(np.int32)
    base = generate(ModelRunner(model, shared_prefetch="off"), prompts, 6, fill_value=np.nan)
    got = generate(ModelRunner(model, shared_prefetch="ffi_stream"), prompts, 6,
                   hisparse=HiSparseConfig(top_k=8, device_buffer_size=10), page_size=8, fill_value=np.nan)  # fmt: skip
    assert got.num_misses.sum() > 0
    np.testing.assert_array_equal(got.logits, base.logits)


def test_an_unknown_start_point_is_refused(monkeypatch):
    monkeypatch.setenv("HISPARSE_PREFETCH_START", "sideways")
    with pytest.raises(ValueError, match=r"HISPARSE_PREFETCH_START must be one of"):
        prefetch_start_point()
