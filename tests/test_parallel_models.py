"""Data-parallel attention x tensor parallelism on the fixtures: a 2 x 2 CPU mesh decodes what
one device decodes, token for token, and what the reference implementation decoded.

dp 2 x tp 2 in SGLang's terms: tp_size 4, dp_size 2, enable_dp_attention — each of the 2 groups
owns one of the 2 prompts (its KV, buffers and host pool block) and splits the heads 2 ways;
dense and MoE weights are split 4 ways.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.sharding import ParallelConfig
from models.dsa.runner import ModelRunner
from models.dsa.generate import generate
from models.dsa.loading import load_hf_checkpoint

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
RTOL = 1e-4
DP2_TP2 = ParallelConfig(tp_size=4, dp_size=2, enable_dp_attention=True)
REPLICAS = ParallelConfig(tp_size=2, dp_size=2)  # two tensor-parallel replicas, no dp attention


# GLM under -m slow (CI time, ~40 s): tests/test_sharding.py covers the sharded layer step for both.
@pytest.fixture(scope="module", params=["deepseek_v32_tiny", pytest.param("glm_moe_dsa_tiny", marks=pytest.mark.slow)])
def fixture(request):
    path = os.path.join(FIXTURES, request.param)
    with np.load(os.path.join(path, "golden.npz")) as data:
        golden = dict(data)
    return golden, load_hf_checkpoint(path, dtype=jnp.float32)


@pytest.mark.parametrize("parallel", [DP2_TP2, pytest.param(REPLICAS, marks=pytest.mark.slow)], ids=["dp_attention", "replicas"])
@pytest.mark.parametrize("hisparse", [pytest.param(False, marks=pytest.mark.slow), True], ids=["hisparse_off", "hisparse_on"])
def test_sharded_decoding_equals_single_device_and_reference(fixture, parallel, hisparse):
    golden, model = fixture
    top_k = model.config.index_topk
    config = HiSparseConfig(top_k=top_k, device_buffer_size=top_k + top_k // 2) if hisparse else None
    steps = golden["greedy_tokens"].shape[1]
    kwargs = dict(hisparse=config, page_size=16, fill_value=np.nan)
    single = generate(ModelRunner(model, prefill_chunk=32), golden["input_ids"], steps, **kwargs)
    runner = ModelRunner(model, prefill_chunk=32, parallel=parallel)
    assert runner.mesh.shape == {"dp": 2, "tp": 2}
    split = generate(runner, golden["input_ids"], steps, **kwargs)
    np.testing.assert_array_equal(split.tokens, single.tokens)
    np.testing.assert_array_equal(split.tokens, golden["greedy_tokens"])
    scale = np.abs(golden["greedy_logits"]).max()
    assert np.abs(split.logits - golden["greedy_logits"]).max() < RTOL * scale
    assert np.abs(split.logits - single.logits).max() < 1e-5 * scale  # only the reduction order differs
    np.testing.assert_array_equal(split.num_misses, single.num_misses)
    if hisparse:
        assert split.num_misses.sum() > 0
