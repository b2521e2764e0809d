"""fp8 indexer keys (--kv_cache_dtype=fp8_e4m3): each key stored as fp8_e4m3 values plus one
float32 scale, as SGLang stores DSA indexer keys. The quantiser's error, scoring on fp8 keys,
decoding the GLM fixture with fp8 keys (HiSparse on == off, close to f32 keys), the PD hand-over,
the device bytes the scheduler counts, and the run_decode flag."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model import DSAModelConfig
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.row_layout import KVRowLayout
from serving.engine import Engine, EngineConfig
from serving.workload import Request
from hisparse_jax.sharding import ParallelConfig
from serving import validation
from serving.errors import UsageError
from models.dsa.footprint import DeviceFootprint
from models.dsa.model import DSAForCausalLM
from models.dsa.runner import ModelRunner
from models.dsa.decoding import create_cache
from models.dsa.generate import generate
from models.dsa.indexer import KV_CACHE_DTYPES, dequantize_keys, index_scores, quantize_keys
from models.dsa.loading import load_hf_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLM = os.path.join(ROOT, "tests", "fixtures", "glm_moe_dsa_tiny")
FP8 = "fp8_e4m3"


@pytest.fixture(scope="module")
def glm():
    return load_hf_checkpoint(GLM, dtype=jnp.float32)


@pytest.fixture(scope="module")
def golden():
    with np.load(os.path.join(GLM, "golden.npz")) as data:
        return dict(data)


# ---- the quantiser --------------------------------------------------------------------------------


def test_quantize_dequantize_round_trip_is_within_fp8_error():
    rng = np.random.default_rng(0)
    # Keys of very different magnitudes (1e-6 .. 1e6): each gets its own scale.
    keys = rng.standard_normal((6, 5, 128)) * 10.0 ** rng.integers(-6, 7, (6, 5, 1))
    q, scales = quantize_keys(jnp.asarray(keys, jnp.float32))
    assert q.dtype == jnp.float8_e4m3fn and q.shape == keys.shape
    assert scales.dtype == jnp.float32 and scales.shape == keys.shape[:-1]
    amax = np.abs(keys).max(axis=-1)
    np.testing.assert_allclose(np.asarray(scales), amax / 448, rtol=1e-6)  # amax / 448 per key
    back = np.asarray(dequantize_keys(q, scales))
    error = np.abs(back - keys)
    # fp8_e4m3 keeps 3 mantissa bits: round to nearest is within 2^-4 of each value, and the
    # largest value maps to 448 exactly; the brief's bound, 2^-3 of the key's amax, holds with
    # room to spare. atol floor: f32 round-off of the smallest keys.
    assert (error <= 2.0**-3 * amax[..., None] + 1e-30).all()
    assert (error <= 2.0**-4 * np.abs(keys) + 2.0**-10 * amax[..., None] / 448 + 1e-30).all()
    assert np.abs(np.asarray(q, np.float32)).max(axis=-1).min() == 448.0


def test_zero_keys_quantize_to_zero_with_a_finite_scale():
    keys = jnp.zeros((3, 16), jnp.bfloat16).at[1].set(jnp.arange(16, dtype=jnp.bfloat16) - 8)
    q, scales = quantize_keys(keys)
    assert np.isfinite(np.asarray(scales)).all() and (np.asarray(scales) > 0).all()
    back = np.asarray(dequantize_keys(q, scales))
    assert (back[[0, 2]] == 0).all() and not np.isnan(back).any()
    np.testing.assert_allclose(back[1], np.arange(16) - 8, rtol=2.0**-4)  # a zero row beside it changes nothing
    assert back[1, 0] == -8  # the key's amax maps to -448 exactly and back


def test_scores_on_fp8_keys_are_the_scores_of_the_dequantized_keys():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((3, 4, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    k8, s = quantize_keys(jnp.asarray(rng.standard_normal((50, 32)) * 7, jnp.float32))
    fp8 = index_scores(q, w, k8, s)  # scale_s x (q . k8_s)
    plain = index_scores(q, w, dequantize_keys(k8, s))
    np.testing.assert_allclose(fp8, plain, rtol=1e-5, atol=1e-5 * np.abs(plain).max())


def test_bf16_scores_accumulate_in_f32():
    # The speed fix: bf16 operands, f32 accumulation; bf16 x bf16 products are exact in f32, so
    # the scores equal those of the same values computed in f32 up to summation order.
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 4, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((300, 128)), jnp.bfloat16)
    scores = index_scores(q, w, keys)
    exact = index_scores(q.astype(jnp.float32), w, keys.astype(jnp.float32))
    assert scores.dtype == jnp.float32
    np.testing.assert_allclose(scores, exact, rtol=0, atol=1e-5 * np.abs(exact).max())


# ---- the cache ------------------------------------------------------------------------------------


def test_cache_holds_fp8_keys_and_one_scale_per_key():
    config = DSAModelConfig.tiny_glm()
    J, I = len(config.full_indexer_layers), config.index_head_dim
    fp8 = create_cache(config, num_requests=2, max_context=40, dtype=jnp.bfloat16, kv_cache_dtype=FP8)
    assert fp8.index_keys.dtype == jnp.float8_e4m3fn and fp8.index_keys.shape == (J, 2, 40, I)
    assert fp8.index_key_scales.dtype == jnp.float32 and fp8.index_key_scales.shape == (J, 2, 40)
    auto = create_cache(config, num_requests=2, max_context=40, dtype=jnp.bfloat16)
    assert auto.index_keys.dtype == jnp.bfloat16 and auto.index_key_scales.shape == (J, 2, 0)  # no bytes
    assert create_cache(config, num_requests=2, max_context=40, dtype=jnp.float32, kv_cache_dtype="bfloat16").index_keys.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype.*'int4'"):
        create_cache(config, num_requests=2, max_context=40, dtype=jnp.bfloat16, kv_cache_dtype="int4")


def test_kv_cache_dtype_names_agree_with_the_row_layouts():
    from hisparse_jax import row_layout

    assert KV_CACHE_DTYPES == getattr(row_layout, "KV_CACHE_DTYPES", KV_CACHE_DTYPES)
    assert set(validation.KV_CACHE_DTYPE_NAMES) <= set(KV_CACHE_DTYPES)


# ---- decoding the GLM fixture with fp8 keys --------------------------------------------------------


def assert_hisparse_decodes_as_the_full_cache(on, off) -> None:
    """HiSparse's decode (`on`, with misses) has the full-KV decode's tokens, and its logits bit
    for bit on the CPU (the GPU kernels may differ in the last bit)."""
    assert on.num_misses.sum() > 0 and np.isfinite(on.logits).all()
    np.testing.assert_array_equal(on.tokens, off.tokens)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(on.logits, off.logits)
    else:
        np.testing.assert_allclose(on.logits, off.logits, rtol=0, atol=1e-5 * np.abs(off.logits).max())


def test_fp8_keys_decode_identically_with_hisparse_on_and_off(glm):
    prompts = np.random.default_rng(1).integers(0, glm.config.vocab_size, (2, 33)).astype(np.int32)
    runner = ModelRunner(glm, kv_cache_dtype=FP8)
    assert runner.kv_cache_dtype == FP8
    off = generate(runner, prompts, 10, fill_value=np.nan)
    on = generate(runner, prompts, 10, hisparse=HiSparseConfig(top_k=8, device_buffer_size=9), page_size=8, fill_value=np.nan)
    assert_hisparse_decodes_as_the_full_cache(on, off)


def test_fp8_keys_select_nearly_the_same_top_k_as_f32_keys(glm, golden):
    # Measured on the fixture's 2 golden prompts (48 tokens, 16 greedy tokens each): greedy tokens
    # with fp8 keys match the f32-key tokens in 0 of 32 (both first tokens differ; bf16 keys: 16
    # of 32, deepseek_v32_tiny: fp8 4 / 48, bf16 10 / 48). As tests/test_models.py notes for bf16,
    # the tiny fixtures' sparse selection turns any round-off into O(1) logit changes (first-token
    # logits move by 1.2x the largest |logit| with fp8 keys), so tokens are not a usable measure
    # here. What fp8 keys change is the indexer's choice; in the first full-indexer layer (the
    # same inputs either way, only the key format differs) the top-k sets overlap 97.1% and 98.4%
    # on average over the 48 queries of each prompt, and no query loses more than 1 of its 8
    # positions (deepseek_v32_tiny: 98.6% / 98.5%, at most 2 of 16). Bound: >= 95% on average,
    # >= 6 of 8 for every query.
    layer = glm.layers[0]
    assert layer.self_attn.indexer is not None
    K, prompts = glm.config.index_topk, golden["input_ids"]
    for tokens in prompts:
        h = glm.embed_tokens(jnp.asarray(tokens))
        exact = np.asarray(layer.prefill(h, None, chunk=len(tokens)).topk)
        out = layer.prefill(h, None, chunk=len(tokens), key_dtype=jnp.dtype(jnp.float8_e4m3fn))
        assert out.index_keys.dtype == jnp.float8_e4m3fn and out.index_key_scales.shape == (len(tokens),)
        fp8 = np.asarray(out.topk)
        overlap = np.array([len(set(a[a >= 0]) & set(b[b >= 0])) / len(set(a[a >= 0])) for a, b in zip(exact, fp8)])
        assert overlap.mean() >= 0.95 and overlap.min() >= 6 / K, (overlap.mean(), overlap.min())


def test_pd_hand_over_of_fp8_keys_equals_a_colocated_prefill(glm, golden):
    # prefill_kv (a prefill instance) -> admit_prefilled (a decode instance) stores the same fp8
    # keys and scales as the colocated prefill; an f32-key decode instance dequantises them.
    prompt = golden["input_ids"][0, :30]
    runner = ModelRunner(glm, kv_cache_dtype=FP8)
    colocated, _ = runner.prefill(runner.create_cache(num_requests=1, max_context=40, fill_value=np.nan), 0, prompt)
    kv = runner.prefill_kv(prompt)
    J = len(glm.config.full_indexer_layers)
    assert len(kv.index_key_scales) == J and all(k.dtype == jnp.float8_e4m3fn for k in kv.index_keys)
    # The rows travel as the decode side stores them: fp8 rows packed on the prefill side (FlashMLA's
    # 656 B rows at DeepSeek-V3.2's 512 + 64; here the tiny model's width), not their float values.
    layout = runner.row_layout
    assert kv.row_layout == layout and layout.kind == FP8 and KVRowLayout(512, 64, FP8).bytes_per_row == 656
    assert all(r.dtype == jnp.uint32 and r.shape[-1] == layout.width for r in kv.rows)
    handed = runner.admit_prefilled(runner.create_cache(num_requests=1, max_context=40, fill_value=np.nan), 0, 30, kv)
    for a, b in ((colocated.index_keys, handed.index_keys), (colocated.index_key_scales, handed.index_key_scales)):
        np.testing.assert_array_equal(np.asarray(a[:, :, :30], np.float32), np.asarray(b[:, :, :30], np.float32))
    np.testing.assert_array_equal(np.asarray(handed.kv.kv[:, :, :30]), np.asarray(colocated.kv.kv[:, :, :30]))  # the same bits
    f32 = ModelRunner(glm)
    plain = f32.admit_prefilled(f32.create_cache(num_requests=1, max_context=40), 0, 30, kv)
    expected = dequantize_keys(colocated.index_keys[:, :, :30], colocated.index_key_scales[:, :, :30])
    np.testing.assert_array_equal(np.asarray(plain.index_keys[:, :, :30]), np.asarray(expected))
    # an f32 decode instance stores the fp8 rows' values (dequantised): what the fp8 cache holds, unpacked
    latent, rope = layout.unpack(colocated.kv.kv[:, :, :30])
    np.testing.assert_array_equal(np.asarray(plain.kv.kv[:, :, :30]), np.asarray(jnp.concatenate([latent, rope], -1)))


@pytest.mark.slow  # ~80 s on 2 cores; fp8 keys through the engine stay covered by the other cases here
def test_engine_serves_fp8_keys_on_one_device_and_over_data_parallel_groups():
    # The same tokens with HiSparse, the baseline, and data-parallel attention (the scales are
    # split over the groups like the keys); synthetic contexts fill fp8 keys too.
    config = DSAModelConfig.tiny()
    model = DSAForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(4)
    requests = [Request(i, rng.integers(0, config.vocab_size, t).astype(np.int32), n) for i, (t, n) in enumerate([(40, 6), (9, 8), (30, 5), (20, 7)])]
    setup = EngineConfig(max_running_requests=4, context_length=48, page_size=8, fill_value=np.nan,
                         hisparse=HiSparseConfig(top_k=16, device_buffer_size=20, host_to_device_ratio=8))  # fmt: skip
    engine = Engine(ModelRunner(model, prefill_chunk=16, kv_cache_dtype=FP8), setup)
    assert engine.cache.index_keys.dtype == jnp.float8_e4m3fn and engine.footprint.key_bytes == 32 + 4
    hisparse = engine.run(requests)
    assert hisparse.summary["misses"] > 0
    baseline = Engine(engine.runner, dataclasses.replace(setup, hisparse=None)).run(requests)
    parallel = ParallelConfig(tp_size=4, dp_size=2, enable_dp_attention=True)
    grouped = Engine(ModelRunner(model, prefill_chunk=16, kv_cache_dtype=FP8, parallel=parallel), setup).run(requests)
    for request in requests:
        np.testing.assert_array_equal(baseline.tokens[request.id], hisparse.tokens[request.id])
        np.testing.assert_array_equal(grouped.tokens[request.id], hisparse.tokens[request.id])
    synthetic = Engine(engine.runner, dataclasses.replace(setup, synthetic_context=True))
    synthetic.run([Request(0, requests[0].prompt, 3)])
    scales = np.asarray(synthetic.cache.index_key_scales[:, 0, :40])
    assert np.isfinite(scales).all() and (scales > 0).all()  # every filled position has its key's scale


# ---- device bytes ----------------------------------------------------------------------------------


def test_device_footprint_counts_fp8_keys_and_rows_by_hand():
    # DeepSeek-V3.2: 61 layers, all with a full indexer; I = 128; rows 512 latent + 64 rope.
    # bf16: rows 576 x 2 = 1152 B, keys 128 x 2 = 256 B. fp8 (FlashMLA / SGLang): rows 512 x 1 +
    # 4 scales x 4 + 64 rope x 2 = 656 B, keys 128 x 1 + one 4 B scale = 132 B.
    config, hisparse = DSAModelConfig.deepseek_v32(), HiSparseConfig(top_k=2048, device_buffer_size=4096)
    expected = {"bfloat16": (1152, 256), "auto": (1152, 256), FP8: (656, 132)}
    for name, (row, key) in expected.items():
        footprint = DeviceFootprint.of(config, jnp.bfloat16, hisparse, name)
        assert (footprint.row_bytes, footprint.key_bytes) == (row, key), name
    fp8_hisparse = DeviceFootprint.of(config, jnp.bfloat16, hisparse, FP8)
    fp8_baseline = DeviceFootprint.of(config, jnp.bfloat16, None, FP8)
    # 32k tokens: the buffer (4096 + 1 rows) per layer plus every token's key per layer.
    assert fp8_hisparse.request_bytes(32768) == 61 * 2_687_632 + 61 * 4_325_376  # 4097 x 656, 32768 x 132
    assert fp8_baseline.request_bytes(32768) == 61 * 25_821_184  # 32768 x (656 + 132)
    budget = int(0.62e9) * 61  # bench_serving's budget: 0.62 GB per layer
    assert (fp8_hisparse.capacity(budget, 32768), fp8_baseline.capacity(budget, 32768)) == (88, 24)
    bf16 = DeviceFootprint.of(config, jnp.bfloat16, hisparse, "bfloat16"), DeviceFootprint.of(config, jnp.bfloat16, None, "bfloat16")
    assert [f.capacity(budget, 32768) for f in bf16] == [47, 13]  # 37.82e9 / (61 x 13,108,352), / (61 x 46,137,344)
    # tiny_glm: 5 layers, 3 with a full indexer (their keys only), I = 16, rows 32 + 8: fp8 rows
    # 32 + 4 + 8 x 2 = 52 B, keys 16 + 4 = 20 B; HiSparse B = 16 at 100 tokens.
    tiny = DeviceFootprint.of(DSAModelConfig.tiny_glm(), jnp.float32, HiSparseConfig(top_k=8, device_buffer_size=16), FP8)
    assert tiny.request_bytes(100) == 5 * 17 * 52 + 3 * 100 * 20
    tiny_f32 = DeviceFootprint.of(DSAModelConfig.tiny_glm(), jnp.float32, None, "auto")
    assert tiny_f32.request_bytes(100) == 5 * 100 * 40 * 4 + 3 * 100 * 16 * 4


# ---- the flag -------------------------------------------------------------------------------------


def test_kv_cache_dtype_flag_is_checked_in_both_modes():
    for mode in (validation.SERVING, validation.CHECKPOINT_DECODING):
        validation.check_flags(mode, {"kv_cache_dtype": FP8, "checkpoint": None, "model": "tiny"}, {"kv_cache_dtype"})
        with pytest.raises(UsageError, match=r"--kv_cache_dtype='int4': use one of \('auto', 'bfloat16', 'fp8_e4m3'\)"):
            validation.check_flags(mode, {"kv_cache_dtype": "int4", "checkpoint": None, "model": "tiny"}, {"kv_cache_dtype"})
    from serving.cli import ServingArgs

    assert ServingArgs(kv_cache_dtype=FP8).kv_cache_dtype == FP8
    with pytest.raises(UsageError, match="--kv_cache_dtype"):
        ServingArgs(kv_cache_dtype="fp8_e5m2")


@pytest.mark.slow  # ~20 s; the flag checks and the in-process fp8-key tests stay in the default run
def test_run_decode_decodes_a_checkpoint_with_fp8_keys(tmp_path, glm, golden):
    output = tmp_path / "out.npz"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "run_decode.py"), f"--checkpoint={GLM}", f"--prompts={os.path.join(GLM, 'golden.npz')}",
         "--max_new_tokens=4", f"--output={output}", "--dtype=float32", "--kv_cache_dtype=fp8_e4m3",
         '--hisparse_config={"device_buffer_size": 10}'],
        capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    expected = generate(glm, golden["input_ids"], 4, kv_cache_dtype=FP8).tokens
    assert not np.array_equal(expected, golden["greedy_tokens"][:, :4])  # f32 keys choose otherwise: the flag took
    with np.load(output) as data:
        np.testing.assert_array_equal(data["tokens"], expected)


# ---- w8a8: fp8 queries over fp8 keys --------------------------------------------------------------


def test_w8a8_scores_fp8_queries_over_fp8_keys_and_decodes_identically_with_hisparse_on_and_off():
    """With fp8_activations the indexer quantises its queries over fp8 keys only (DeepSeek's
    act_quant + fp8_index); the scores move by q's rounding, and HiSparse still decodes exactly
    what the full-KV cache decodes."""
    from models.dsa.indexer import quantize_queries
    from pallas_kernels.indexer_scores.base import operand_dtype

    f8, bf16 = jnp.float8_e4m3fn, jnp.bfloat16
    assert (operand_dtype(f8, f8), operand_dtype(bf16, f8), operand_dtype(f8, bf16)) == (f8, bf16, bf16)
    config = DSAModelConfig.tiny().replace(weight_block_size=(16, 16), fp8_activations=True)
    model = DSAForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    indexer = model.layers[0].self_attn.indexer
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, config.hidden_size)), jnp.float32)
    q_resid = jnp.asarray(rng.standard_normal((3, config.q_lora_rank)), jnp.float32)
    cos = sin = jnp.zeros((3, config.qk_rope_head_dim // 2), jnp.float32)
    q, w = indexer.queries(x, q_resid, cos, sin)
    q8, w8 = indexer.queries(x, q_resid, cos, sin, jnp.dtype(f8))
    assert q.dtype == jnp.float32 and q8.dtype == f8
    assert indexer.queries(x, q_resid, cos, sin, jnp.dtype(bf16))[0].dtype == jnp.float32  # bf16 keys: q as it is
    np.testing.assert_array_equal(np.asarray(q8, np.float32), np.asarray(quantize_queries(q, w)[0], np.float32))
    keys, scales = quantize_keys(jnp.asarray(rng.standard_normal((40, config.index_head_dim)), jnp.float32))
    exact, rounded = np.asarray(index_scores(q, w, keys, scales)), np.asarray(index_scores(q8, w8, keys, scales))
    error = np.abs(rounded - exact).max() / np.abs(exact).max()
    assert 1e-4 < error < 0.1  # q's fp8 rounding: not zero, a few percent at most

    runner = ModelRunner(model, kv_cache_dtype=FP8)
    prompts = rng.integers(0, config.vocab_size, (2, 40)).astype(np.int32)
    off = generate(runner, prompts, 6, fill_value=np.nan)
    on = generate(runner, prompts, 6, hisparse=HiSparseConfig(top_k=16, device_buffer_size=17), page_size=8, fill_value=np.nan)
    assert_hisparse_decodes_as_the_full_cache(on, off)


def test_w8a8_lifts_the_attention_output_in_the_weights_dtype():
    """With fp8_activations over bf16 weights the value lift multiplies bf16 operands (tensor cores)
    and stays within bf16 rounding of the f32 lift; without it, or in an f32 model, the lift is f32."""

    def lift(fp8_activations: bool, dtype):
        config = DSAModelConfig.tiny().replace(weight_block_size=(16, 16), fp8_activations=fp8_activations)
        attn_module = DSAForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)).layers[0].self_attn
        _, w_uv = attn_module._kv_b()
        attn = jnp.asarray(np.random.default_rng(0).standard_normal((3, config.num_heads, config.kv_lora_rank)), jnp.float32)
        dots = [e for e in jax.make_jaxpr(attn_module.output)(attn).jaxpr.eqns if e.primitive.name == "dot_general"]
        (lifted,) = [e for e in dots if tuple(w_uv.shape) in [tuple(v.aval.shape) for v in e.invars]]  # W_UV's product, not o_proj's
        return [v.aval.dtype for v in lifted.invars], attn_module, attn

    (bf16_dtypes, module, attn), (f32_dtypes, _, _) = lift(True, jnp.bfloat16), lift(False, jnp.bfloat16)
    assert bf16_dtypes == [jnp.bfloat16, jnp.bfloat16] and f32_dtypes == [jnp.float32, jnp.float32]
    assert lift(True, jnp.float32)[0] == [jnp.float32, jnp.float32]
    _, w_uv = module._kv_b()
    exact = np.asarray(jnp.einsum("tha,hva->thv", attn, w_uv.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST))
    rounded = np.asarray(jnp.einsum("tha,hva->thv", attn.astype(jnp.bfloat16), w_uv, preferred_element_type=jnp.float32))
    assert np.abs(rounded - exact).max() < 2**-7 * np.abs(exact).max()
