"""DeepSeek-V4 (models/deepseek_v4/model.py) against transformers 5.24.0's outputs on
tests/fixtures/deepseek_v4_tiny: per-layer compressed KV entries and indexer keys, the indexer's
selections, prompt logits, greedy tokens (no-cache loop and cached decoding); config parsing;
the loader's errors.

Float32 throughout: the fixture's README shows every discrete choice (indexer top-k, router,
greedy argmax) has a margin >= 102x float32 round-off, so they must all match exactly.
"""

import json
import os
import shutil

import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from configs.deepseek_v4 import CSA, HCA, SLIDING, DeepseekV4Config
from configs.model import UnsupportedModelError
from models.deepseek_v4.model import DeepseekV4ForCausalLM, forward, forward_with_aux, greedy_no_cache
from models.deepseek_v4.decoding import create_cache, decode_step, generate, generate_hisparse, prefill
from hisparse_jax.config import HiSparseConfig
from models.deepseek_v4.loading import load_deepseek_v4
from models.common.checkpoint import CheckpointError

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "deepseek_v4_tiny")
RTOL = 1e-4  # logits, relative to the largest |logit| (the README's suggestion)
ENTRY_ATOL = 2e-5  # entries are RMS-normalised (O(1)); measured max error 3.5e-6


@pytest.fixture(scope="module")
def golden():
    with np.load(os.path.join(FIXTURE, "golden.npz")) as data:
        return dict(data)


@pytest.fixture(scope="module")
def model():
    return load_deepseek_v4(FIXTURE, dtype=jnp.float32)


@pytest.fixture(scope="module")
def prompt_pass(model, golden):
    logits, aux = nnx.jit(forward_with_aux)(model, jnp.asarray(golden["input_ids"]))
    return np.asarray(logits), jax.tree.map(np.asarray, aux)


def test_compressed_entries_and_indexer_keys(model, golden, prompt_pass):
    _, aux = prompt_pass
    config = model.config
    for i, kind in enumerate(config.layer_types):
        if kind == SLIDING:
            assert aux[i].compressed_kv is None and aux[i].indexer_keys is None
            continue
        np.testing.assert_allclose(aux[i].compressed_kv, golden[f"compressed_kv_L{i}"], rtol=0, atol=ENTRY_ATOL)
        if kind == CSA:
            np.testing.assert_allclose(aux[i].indexer_keys, golden[f"indexer_keys_L{i}"], rtol=0, atol=ENTRY_ATOL)
        else:
            assert aux[i].indexer_keys is None and f"indexer_keys_L{i}" not in golden


def test_indexer_selection(model, golden, prompt_pass):
    _, aux = prompt_pass
    layers = [int(i) for i in golden["indexer_topk_layers"]]
    assert layers == list(model.config.csa_layers)
    for j, layer in enumerate(layers):
        np.testing.assert_array_equal(aux[layer].topk, golden["indexer_topk_all"][j], err_msg=f"layer {layer}")


def test_prompt_logits(golden, prompt_pass):
    logits, _ = prompt_pass
    scale = np.abs(golden["logits"]).max()
    assert np.abs(logits - golden["logits"]).max() <= RTOL * scale  # measured 8.4e-7 x scale


@pytest.mark.slow  # CI time, ~24 s; test_cached_decoding checks the same greedy tokens and logits
def test_greedy(model, golden):
    tokens, logits = greedy_no_cache(model, jnp.asarray(golden["input_ids"]), golden["greedy_tokens"].shape[1])
    np.testing.assert_array_equal(tokens, golden["greedy_tokens"])
    assert np.abs(logits - golden["greedy_logits"]).max() <= RTOL * np.abs(golden["greedy_logits"]).max()


@pytest.mark.parametrize("by_steps", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["prefill", "prompt_by_steps"])
def test_cached_decoding(model, golden, by_steps):
    """The cache (window ring, buffered windows, CSA overlap, entries emitted at (p+1) % M == 0),
    filled by one prefill pass or by feeding the prompt one token at a time, gives the full
    forward's prompt logits and then the greedy continuation."""
    steps = golden["greedy_tokens"].shape[1]
    tokens, logits, prompt_logits = generate(model, jnp.asarray(golden["input_ids"]), steps, prefill_by_steps=by_steps)
    assert np.abs(prompt_logits - golden["logits"]).max() <= RTOL * np.abs(golden["logits"]).max()  # measured 1.1e-6 x
    np.testing.assert_array_equal(tokens, golden["greedy_tokens"])
    assert np.abs(logits - golden["greedy_logits"]).max() <= RTOL * np.abs(golden["greedy_logits"]).max()  # 9.5e-7 x


@pytest.mark.slow  # CI time, ~40 s; test_cached_decoding and the run_decode fixture runs cover prefill
def test_prefill_cache_equals_stepped_cache(model, golden):
    prompts = jnp.asarray(golden["input_ids"][:, :45])  # ends mid-window for both CSA and HCA
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, c, tok, p: decode_step(nnx.merge(graphdef, s), c, tok, p))
    stepped = create_cache(model, 2, 48)
    for t in range(prompts.shape[1]):
        stepped, _ = step(state, stepped, prompts[:, t], jnp.int32(t))
    cache, _ = nnx.jit(prefill, static_argnums=2)(model, prompts, 48)
    np.testing.assert_allclose(cache.window, stepped.window, atol=2e-5)
    np.testing.assert_array_equal(cache.window_pos, stepped.window_pos)
    for field in ("entries", "index_keys", "raw_kv", "raw_gate", "index_raw_kv", "index_raw_gate"):
        for i, (a, b) in enumerate(zip(getattr(cache, field), getattr(stepped, field))):
            np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"{field}[{i}]")


@pytest.mark.slow  # CI time, ~48 s; run_decode's fixture run with HiSparse and the engine's NaN-filled serving test cover it
def test_hisparse_c4_offload(model, golden):
    """The CSA entries (C4) in the pinned host pool, a 10-slot device buffer for top-8 (so rows
    are evicted and copied back), unwritten rows and the dropped device copies NaN: the greedy
    continuation is unchanged."""
    hisparse = HiSparseConfig(top_k=model.config.index_topk, device_buffer_size=10)
    steps = golden["greedy_tokens"].shape[1]
    tokens, logits, misses = generate_hisparse(
        model, jnp.asarray(golden["input_ids"]), steps, hisparse, page_size=4, fill_value=float("nan")
    )
    np.testing.assert_array_equal(tokens, golden["greedy_tokens"])
    assert np.abs(logits - golden["greedy_logits"]).max() <= RTOL * np.abs(golden["greedy_logits"]).max()  # 9.9e-7 x
    assert misses.shape == (steps - 1, len(model.config.csa_layers), 2)
    assert misses[0].min() > 0 and misses[1:].sum() > 0  # the first step copies the whole top-k, later ones some


@pytest.mark.slow  # CI time, ~22 s; the serving test builds a random V4 too
def test_random_init_runs():
    config = DeepseekV4Config.tiny().replace(num_layers=3, layer_types=(SLIDING, CSA, HCA), mlp_layer_types=("hash_moe", "moe", "moe"))
    model = DeepseekV4ForCausalLM(config, rngs=nnx.Rngs(0))
    logits = nnx.jit(forward)(model, jnp.zeros((1, 40), jnp.int32))
    assert logits.shape == (1, 40, config.vocab_size) and bool(jnp.isfinite(logits).all())


# ---- config ---------------------------------------------------------------------------------------


def test_config_from_fixture():
    config = DeepseekV4Config.from_hf_config(FIXTURE)
    assert config == DeepseekV4Config.tiny()
    assert config.layer_types == (SLIDING, CSA, HCA, CSA) and (config.csa_rate, config.hca_rate) == (4, 16)
    assert config.qk_rope_head_dim == 8 and config.rope_compress.rope_type == "yarn"
    assert config.rope_compress.attention_factor == 1.0 and config.rope_main.theta == 10000.0
    assert DeepseekV4Config.from_dict(config.to_dict()) == config


def test_config_v4_flash():
    c = DeepseekV4Config.v4_flash()
    assert (c.hidden_size, c.num_layers, c.num_heads, c.head_dim, c.qk_rope_head_dim) == (4096, 43, 64, 512, 64)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (256, 6, 2048)
    assert (c.csa_rate, c.hca_rate, c.sliding_window, c.index_topk) == (4, 128, 128, 512)
    assert c.layer_types[:4] == (HCA, HCA, HCA, CSA) and c.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
    assert c.rope_compress.theta == 160000.0 and c.rope_main.rope_type == "default"


def test_config_legacy_fields():
    raw = {
        "model_type": "deepseek_v4", "num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 4],
        "compress_rate_hca": 64, "num_hash_layers": 1, "qk_rope_head_dim": 64,
        "rope_parameters": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
    }  # fmt: skip
    c = DeepseekV4Config.from_hf_config(raw)
    assert c.layer_types == (SLIDING, CSA, HCA) and c.hca_rate == 64
    assert c.mlp_layer_types == ("hash_moe", "moe", "moe") and c.qk_rope_head_dim == 64
    assert c.rope_compress.factor == 16 and c.rope_compress.attention_factor == 1.0 and c.rope_main.rope_type == "default"


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"model_type": "deepseek_v3"}, UnsupportedModelError, "model_type"),
        ({"scoring_func": "softmax"}, UnsupportedModelError, "scoring_func"),
        ({"n_shared_experts": 2}, UnsupportedModelError, "n_shared_experts"),
        ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act"),
        ({"compress_ratios": [0, 8], "layer_types": None, "num_hidden_layers": 2}, UnsupportedModelError, "compress_ratios"),
        ({"layer_types": ["sliding_attention"] * 3 + ["full_attention"]}, ValueError, "layer_types"),
        ({"mlp_layer_types": ["moe"] * 3}, ValueError, "mlp_layer_types"),
        ({"o_groups": 3}, ValueError, "o_groups"),
        ({"rope_parameters": {"main": {"rope_type": "llama3"}, "compress": {}}}, UnsupportedModelError, "rope_type"),
    ],
)
def test_config_errors(change, error, match):
    with open(os.path.join(FIXTURE, "config.json")) as f:
        raw = json.load(f)
    raw.update(change)
    with pytest.raises(error, match=match):
        DeepseekV4Config.from_hf_config(raw)


# ---- bad checkpoints --------------------------------------------------------------------------------


def _broken_copy(tmp_path, edit):
    target = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, target)
    tensors = load_file(os.path.join(FIXTURE, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.fspath(target / "model.safetensors"))
    return target


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop("model.layers.1.attn.indexer.compressor.ape"), "lacks 1 tensor.*indexer.compressor.ape"),
        (lambda t: t.update({"model.layers.9.attn.wq_a.weight": np.zeros((32, 64), np.float32)}), "no place for.*layers.9"),
        (lambda t: t.update({"model.layers.2.attn.compressor.wkv.weight": np.zeros((64, 64), np.float32)}), "shape.*layers.2.attn.compressor.wkv"),
        (lambda t: t["model.layers.0.ffn.gate.tid2eid"].__setitem__((0, 0), 8), "tid2eid.*expert ids"),
    ],
    ids=["missing", "unexpected", "shape", "tid2eid"],
)
def test_bad_checkpoint(tmp_path, edit, match):
    with pytest.raises(CheckpointError, match=match):
        load_deepseek_v4(_broken_copy(tmp_path, edit), dtype=jnp.float32)


_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}


def _write_safetensors(path, tensors):
    """A minimal safetensors writer (the package's numpy API has no fp8)."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": _ST_DTYPES[array.dtype], "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def _fp8_copy(tmp_path, names, *, block=8, drop_scale=False):
    """The fixture with `names` stored as float8_e4m3fn + per-block weight_scale_inv, and the
    float32 values they stand for."""
    target = tmp_path / "fp8"
    shutil.copytree(FIXTURE, target)
    tensors = load_file(os.path.join(FIXTURE, "model.safetensors"))
    expected = {}
    for name in names:
        w = tensors[name]
        tiles = w.reshape(w.shape[0] // block, block, w.shape[1] // block, block)
        scale = (np.abs(tiles).max(axis=(1, 3)) / 448.0).astype(np.float32)  # f32[rows/b, cols/b]
        full = np.repeat(np.repeat(scale, block, 0), block, 1)
        quant = (w / full).astype(ml_dtypes.float8_e4m3fn)
        tensors[name] = quant
        if not drop_scale:
            tensors[name + "_scale_inv"] = scale
        expected[name] = quant.astype(np.float32) * full
    _write_safetensors(target / "model.safetensors", tensors)
    with open(target / "config.json") as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    with open(target / "config.json", "w") as f:
        json.dump(raw, f)
    return target, expected


def test_fp8_block_scales(tmp_path):
    names = ["model.layers.1.attn.wq_b.weight", "model.layers.2.ffn.experts.3.w2.weight", "model.layers.3.attn.wo_a.weight"]
    directory, expected = _fp8_copy(tmp_path, names)
    loaded = load_deepseek_v4(directory, dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(loaded.layers[1].attn.wq_b.weight[...]), expected[names[0]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(loaded.layers[2].ffn.experts.w2[...][3]).T, expected[names[1]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(loaded.layers[3].attn.wo_a.weight[...]), expected[names[2]], rtol=1e-6)


def test_fp8_without_scales(tmp_path):
    directory, _ = _fp8_copy(tmp_path, ["model.layers.1.attn.wq_b.weight"], drop_scale=True)
    with pytest.raises(CheckpointError, match="FP8 tensor model.layers.1.attn.wq_b.weight has no"):
        load_deepseek_v4(directory, dtype=jnp.float32)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_deepseek_v4(tmp_path / "nope")
