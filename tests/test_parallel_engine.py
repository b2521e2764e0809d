"""The engine over data-parallel attention groups: requests spread over the groups, each group
pages its own host pool block, tokens equal the single-device engine's, everything comes back,
after a failed run too."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model import DSAModelConfig
from hisparse_jax.config import HiSparseConfig
from serving.engine import Engine, EngineConfig
from serving.workload import Request
from serving.scheduler import DataParallelScheduler
from hisparse_jax.sharding import ParallelConfig
from models.dsa.model import DSAForCausalLM
from models.dsa.runner import ModelRunner

TINY = DSAModelConfig.tiny()
HISPARSE = HiSparseConfig(top_k=16, device_buffer_size=20, host_to_device_ratio=8)


@pytest.mark.slow  # ~56 s on 2 cores; tests/test_sharding.py and test_parallel_models.py cover the sharded step
def test_dp_attention_engine_equals_single_device(monkeypatch):
    model = DSAForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    lengths = [(60, 10), (9, 12), (70, 4), (30, 9), (66, 7), (12, 11)]
    requests = [Request(i, rng.integers(0, TINY.vocab_size, t).astype(np.int32), n) for i, (t, n) in enumerate(lengths)]
    config = EngineConfig(max_running_requests=4, context_length=96, hisparse=HISPARSE, page_size=8, fill_value=np.nan)
    single = Engine(ModelRunner(model, prefill_chunk=32), config).run(requests)
    parallel = ParallelConfig(tp_size=4, dp_size=2, enable_dp_attention=True)
    engine = Engine(ModelRunner(model, prefill_chunk=32, parallel=parallel), config)
    assert isinstance(engine.scheduler, DataParallelScheduler) and len(engine.scheduler.groups) == 2
    # A run failing at its second decode step, both groups busy, two requests waiting: every
    # group gets its slots and pages back, and the run below is as on a fresh engine.
    decode, calls = engine.runner.greedy_step, []  # the decode step as the engine runs it

    def failing(*args):
        calls.append(None)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return decode(*args)

    monkeypatch.setattr(engine.runner, "greedy_step", failing)
    with pytest.raises(RuntimeError, match="injected"):
        engine.run(requests)
    monkeypatch.undo()
    assert engine.scheduler.all_free()
    np.testing.assert_array_equal(np.asarray(engine.cache.kv.host_page_table), -1)
    result = engine.run(requests)
    for request in requests:
        np.testing.assert_array_equal(result.tokens[request.id], single.tokens[request.id], err_msg=f"request {request.id}")
    assert result.summary["misses"] > 0
    assert max(s.running for s in result.steps) == 4  # both groups ran requests at once
    assert engine.scheduler.all_free()
    kv = engine.cache.kv
    np.testing.assert_array_equal(np.asarray(kv.host_page_table), -1)
    np.testing.assert_array_equal(np.asarray(kv.seq_lens), 0)
