"""The DSA models against transformers' outputs (tests/fixtures: deepseek_v32_tiny and
glm_moe_dsa_tiny), decoding with HiSparse on and off: prefill + decode steps == the full forward,
GLM shared-index layers identical on and off.

Float32 throughout: in both fixtures every discrete choice (indexer top-k, routing, greedy argmax)
has a margin >= 10x float32 round-off, so they must all match exactly.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model import DSAModelConfig
from hisparse_jax import memory
from hisparse_jax.config import HiSparseConfig
from models.dsa.model import DSAForCausalLM, forward
from models.dsa.runner import ModelRunner
from models.dsa.decoding import create_cache
from models.dsa.generate import generate
from models.dsa.loading import load_hf_checkpoint

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
DEEPSEEK = os.path.join(FIXTURES, "deepseek_v32_tiny")
GLM = os.path.join(FIXTURES, "glm_moe_dsa_tiny")
# Block FP8 (16 x 16 blocks): its linear layers and experts stay fp8 on the device when loaded.
DEEPSEEK_FP8 = os.path.join(FIXTURES, "deepseek_v32_tiny_fp8")
RTOL = 1e-4  # relative to the largest |logit|, as the fixtures' README suggests
# HiSparse sized just above top_k so decoding misses and evicts: (top_k, device_buffer_size).
BUFFERS = {DEEPSEEK: (16, 24), GLM: (8, 10), DEEPSEEK_FP8: (16, 24)}


@pytest.fixture(scope="module", params=[DEEPSEEK, GLM, DEEPSEEK_FP8], ids=["deepseek_v32", "glm_moe_dsa", "deepseek_v32_fp8"])
def reference(request):
    """(fixture dir, golden outputs, float32 model loaded from its checkpoint)."""
    with np.load(os.path.join(request.param, "golden.npz")) as data:
        golden = dict(data)
    model = load_hf_checkpoint(request.param, dtype=jnp.float32)
    if request.param == DEEPSEEK_FP8:  # the fp8 weights stay fp8: the matmuls dequantise per block
        assert model.config.weight_block_size == (16, 16)
        assert model.layers[1].mlp.experts.gate_proj.dtype == jnp.float8_e4m3fn
        assert model.layers[0].self_attn.q_b_proj.weight.dtype == jnp.float8_e4m3fn
    return request.param, golden, model


@pytest.fixture(scope="module")
def glm():
    model = load_hf_checkpoint(GLM, dtype=jnp.float32)
    assert "shared" in model.config.indexer_types and model.config.indexer_rope_interleave
    return model


def assert_logits_close(actual, expected):
    error = np.abs(np.asarray(actual) - expected).max() / np.abs(expected).max()
    assert error < RTOL, f"max error {error:.2e} of the largest |logit|"


def assert_same_logits(actual, expected):
    """HiSparse on vs off: bit-identical on the CPU; the GPU kernels may differ in the last bit."""
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(actual, expected)
    else:
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def sort_topk(topk):
    """Ascending positions, -1 padding last (the fixtures' order)."""
    topk = np.asarray(topk)
    ordered = np.sort(np.where(topk < 0, np.iinfo(np.int32).max, topk), axis=-1)
    return np.where(ordered == np.iinfo(np.int32).max, -1, ordered)


def test_forward_matches_reference_logits_and_indexer_topk(reference):
    _, golden, model = reference
    graphdef, params = nnx.split(model)
    run = jax.jit(lambda p, t: forward(nnx.merge(graphdef, p), t, chunk=16))  # several query chunks
    logits, topk = run(params, golden["input_ids"])
    assert_logits_close(logits, golden["logits"])
    np.testing.assert_array_equal(sort_topk(topk), golden["indexer_topk_all"])
    k = model.config.index_topk
    assert (golden["indexer_topk_all"][:, :, k - 1 :] >= 0).all()  # sparse from position k - 1 on


def _greedy_case(path, hisparse, implementation, slow=False):
    name = {DEEPSEEK: "deepseek_v32", GLM: "glm_moe_dsa", DEEPSEEK_FP8: "deepseek_v32_fp8"}[path]
    mode = "hisparse_on" if hisparse else "hisparse_off"
    mode += "_pallas_interpret" if implementation == "pallas" else ""
    return pytest.param(path, hisparse, implementation, id=f"{name}-{mode}", marks=[pytest.mark.slow] if slow else [])


# deepseek_v32_fp8 with the Pallas kernels under -m slow (CI time, ~8 s of compiles no other case
# shares): the fp8 checkpoint's weights stay covered by deepseek_v32_fp8-hisparse_on, the Pallas
# kernels over the same architecture by deepseek_v32-hisparse_on_pallas_interpret.
@pytest.mark.parametrize(
    "reference, hisparse, implementation",
    [_greedy_case(DEEPSEEK, False, "reference"), _greedy_case(DEEPSEEK, True, "reference"), _greedy_case(DEEPSEEK, True, "pallas"),
     _greedy_case(GLM, False, "reference"), _greedy_case(GLM, True, "reference"), _greedy_case(GLM, True, "pallas"),
     _greedy_case(DEEPSEEK_FP8, False, "reference"), _greedy_case(DEEPSEEK_FP8, True, "reference"),
     _greedy_case(DEEPSEEK_FP8, True, "pallas", slow=True)],
    indirect=["reference"],
)  # fmt: skip
def test_greedy_decoding_matches_reference(reference, hisparse, implementation):
    path, golden, model = reference
    top_k, buffer = BUFFERS[path]
    config = HiSparseConfig(top_k=top_k, device_buffer_size=buffer) if hisparse else None
    runner = ModelRunner(model, prefill_chunk=16, implementation=implementation)  # multi-chunk prefill
    steps = golden["greedy_tokens"].shape[1]
    # NaN in every unwritten row: attending to one would poison the logits.
    out = generate(runner, golden["input_ids"], steps, hisparse=config, page_size=16, fill_value=np.nan)
    np.testing.assert_array_equal(out.tokens, golden["greedy_tokens"])
    assert_logits_close(out.logits, golden["greedy_logits"])
    assert out.num_hits.shape == (steps - 1, model.config.num_layers, 2)
    if config is None:
        assert out.num_misses.sum() == 0
    else:
        # Each (layer, request) loads more rows than its buffer holds: it really evicts.
        assert (out.num_misses.sum(axis=0) > buffer).all()


@pytest.mark.parametrize(
    "hisparse", [pytest.param(None, marks=pytest.mark.slow), HiSparseConfig(top_k=8, device_buffer_size=12)], ids=["hisparse_off", "hisparse_on"]
)  # hisparse_off under -m slow: CI time (~11 s); the greedy tests cover the no-offload cache
def test_prefill_then_decode_equals_full_forward(glm, hisparse):
    prompts = np.random.default_rng(0).integers(0, glm.config.vocab_size, (3, 40)).astype(np.int32)
    out = generate(ModelRunner(glm, prefill_chunk=16), prompts, 12, hisparse=hisparse, page_size=8, fill_value=np.nan)
    full = np.concatenate([prompts, out.tokens[:, :-1]], axis=1)  # every token the decode saw
    logits, _ = jax.jit(lambda tokens: forward(glm, tokens))(full)
    np.testing.assert_allclose(out.logits, np.asarray(logits)[:, 39:], rtol=0, atol=RTOL * np.abs(out.logits).max())


def test_glm_shared_index_layers_decode_identically_with_hisparse_on_and_off(glm):
    prompts = np.random.default_rng(1).integers(0, glm.config.vocab_size, (2, 33)).astype(np.int32)
    runner = ModelRunner(glm)
    off = generate(runner, prompts, 10)
    on = generate(runner, prompts, 10, hisparse=HiSparseConfig(top_k=8, device_buffer_size=9), page_size=8, fill_value=np.nan)
    np.testing.assert_array_equal(on.tokens, off.tokens)
    assert_same_logits(on.logits, off.logits)
    shared = [i for i, t in enumerate(glm.config.indexer_types) if t == "shared"]
    assert on.num_misses[:, shared].sum() > 0
    # A shared layer replays its anchor's swap-in: same hits and misses.
    for layer in shared:
        np.testing.assert_array_equal(on.num_misses[:, layer], on.num_misses[:, glm.config.anchor_layer(layer)])


def test_bfloat16_decodes_identically_with_hisparse_on_and_off():
    # The fixtures' sparse selection amplifies bf16 round-off far beyond any tolerance (rounding
    # the weights alone changes many top-k sets and the logits by O(1)), so bf16 is checked for
    # self-consistency only.
    model = load_hf_checkpoint(GLM, dtype=jnp.bfloat16)
    prompts = np.random.default_rng(3).integers(0, model.config.vocab_size, (2, 24)).astype(np.int32)
    runner = ModelRunner(model)
    off = generate(runner, prompts, 6)
    on = generate(runner, prompts, 6, hisparse=HiSparseConfig(top_k=8, device_buffer_size=9), page_size=8)
    assert on.num_misses.sum() > 0
    np.testing.assert_array_equal(on.tokens, off.tokens)
    assert_same_logits(on.logits, off.logits)


def test_inactive_request_slots_change_nothing(glm):
    prompt = np.random.default_rng(2).integers(0, glm.config.vocab_size, (1, 20)).astype(np.int32)
    alone = generate(glm, prompt, 4)
    runner = ModelRunner(glm)
    cache = runner.create_cache(num_requests=3, max_context=24, hisparse=None, fill_value=np.nan)
    cache, logits = runner.prefill(cache, 1, prompt[0])
    steps = [logits]
    token = int(jnp.argmax(logits))
    for i in range(3):
        cache, logits, _ = runner.decode_step(cache, [0, token, 0], [-1, 20 + i, -1])
        steps.append(logits[1])
        token = int(jnp.argmax(logits[1]))
    # Same math, batch of 3 instead of 1: equal up to the round-off of differently shaped matmuls.
    np.testing.assert_allclose(np.stack(steps), alone.logits[0], rtol=0, atol=1e-5 * np.abs(alone.logits).max())


def test_hisparse_top_k_must_match_the_model():
    with pytest.raises(ValueError, match=r"top_k \(32\) must equal the model's index_topk \(16\)"):
        create_cache(
            DSAModelConfig.tiny(), num_requests=1, max_context=64, dtype=jnp.float32,
            hisparse=HiSparseConfig(top_k=32, device_buffer_size=64),
        )  # fmt: skip


def test_run_decode_reproduces_the_fixture(tmp_path):
    with np.load(os.path.join(DEEPSEEK, "golden.npz")) as data:
        golden = dict(data)
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "run_decode.py")
    output = tmp_path / "out.npz"
    done = subprocess.run(
        [sys.executable, script, f"--checkpoint={DEEPSEEK}", f"--prompts={os.path.join(DEEPSEEK, 'golden.npz')}",
         "--max_new_tokens=24", f"--output={output}", "--dtype=float32", "--enable_hisparse",
         '--hisparse_config={"top_k": 16, "device_buffer_size": 24}'],
        check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=os.path.dirname(script), capture_output=True, text=True,
    )  # fmt: skip
    for said in ("loading weights from", "prefill: 2 prompt(s) of 96 tokens", "prefill done", "decode step 23/23"):
        assert said in done.stderr, (said, done.stderr[-3000:])  # progress at INFO
    with np.load(output) as data:
        assert data["tokens"].dtype == np.int32 and data["logits"].dtype == np.float32
        np.testing.assert_array_equal(data["tokens"], golden["greedy_tokens"])
        assert_logits_close(data["logits"], golden["greedy_logits"])


@pytest.mark.parametrize("implementation, override", [pytest.param("reference", False, marks=pytest.mark.slow), ("pallas", True)])  # CI time
def test_compiled_decode_step_holds_no_copy_of_the_host_pool_or_key_cache(implementation, override):
    # The swap-in copy reads the pool that the backup then writes in place; unless that write
    # is ordered after the read, XLA keeps the old pool alive by copying all of it every step
    # (on the H200: 2 x 7.1 GB per step, 1.9 s instead of 9 ms, with a top-k override).
    config = DSAModelConfig.tiny()
    runner = ModelRunner(DSAForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0)), implementation=implementation)
    cache = runner.create_cache(num_requests=4, max_context=128, hisparse=HiSparseConfig(top_k=config.index_topk), page_size=16)
    topk = jnp.zeros((len(config.full_indexer_layers), 4, config.index_topk), jnp.int32) if override else None
    tokens = jnp.zeros(4, jnp.int32)
    compiled = runner._jitted(cache)["decode"].lower(runner.params, cache, tokens, tokens, topk).compile().as_text()
    # Likewise the indexer's scoring reads the key cache that the next indexer layer writes: with
    # an override nothing waits for the scoring, and XLA copied the whole key cache per layer
    # (on the H200 2.4 ms of a 7.7 ms step at 88 slots) until the read was ordered first.
    for array in (cache.kv.host_pool, cache.index_keys):
        shape = f"{jnp.dtype(array.dtype).name.replace('float', 'f')}[{','.join(map(str, array.shape))}]"
        assert shape in compiled
        assert memory.hlo_copy_lines(compiled, shape) == []
