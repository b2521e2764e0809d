"""Checkpoint loading: safetensors (sharded, bf16, block FP8) -> params, orbax round trip, errors."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from configs.model import UnsupportedModelError
from models.common.checkpoint import Checkpoint, CheckpointError
from models.dsa.loading import load_hf_checkpoint
from models.registry import restore_params, save_params

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "deepseek_v32_tiny")
_DTYPE_NAMES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}


def write_safetensors(path, tensors):
    """A minimal safetensors writer (the `safetensors` package's numpy API has no bf16/fp8)."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": _DTYPE_NAMES[array.dtype], "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def fixture_tensors():
    return safetensors.numpy.load_file(os.path.join(FIXTURE, "model.safetensors"))


def make_checkpoint(directory, tensors, *, config_changes=None, shards=1, index=True):
    """A checkpoint dir: the fixture's config.json (with changes) and `tensors` in `shards` files."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(FIXTURE, "config.json")) as f:
        config = json.load(f)
    config.update(config_changes or {})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        write_safetensors(os.path.join(directory, file), {n: tensors[n] for n in part})
        weight_map.update({n: file for n in part})
    if shards > 1 and index:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return directory


def flat_params(model):
    return {k: np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]}


@pytest.fixture(scope="module")
def reference_params():
    return flat_params(load_hf_checkpoint(FIXTURE, dtype=jnp.float32))


def test_reader_agrees_with_the_safetensors_package():
    ours = Checkpoint(FIXTURE)
    theirs = fixture_tensors()
    assert ours.names() == set(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours.read(name), value)


def test_params_are_the_checkpoint_tensors():
    tensors = fixture_tensors()
    model = load_hf_checkpoint(FIXTURE, dtype=jnp.float32)
    layer = model.layers[1]
    np.testing.assert_array_equal(layer.self_attn.q_b_proj.weight[...], tensors["model.layers.1.self_attn.q_b_proj.weight"])
    np.testing.assert_array_equal(
        layer.mlp.gate.e_score_correction_bias[...], tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    )
    for e in range(8):  # experts are stacked and stored [in, out]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            np.testing.assert_array_equal(
                getattr(layer.mlp.experts, proj)[e], tensors[f"model.layers.1.mlp.experts.{e}.{proj}.weight"].T
            )
    np.testing.assert_array_equal(model.lm_head.weight[...], tensors["lm_head.weight"])


def test_bfloat16_load_keeps_the_reference_float32_modules():
    model = load_hf_checkpoint(FIXTURE, dtype=jnp.bfloat16)
    assert model.embed_tokens.weight.dtype == jnp.bfloat16
    assert model.layers[1].mlp.experts.gate_proj.dtype == jnp.bfloat16
    assert model.layers[1].mlp.gate.weight.dtype == jnp.float32
    assert model.layers[1].mlp.gate.e_score_correction_bias.dtype == jnp.float32
    assert model.layers[0].self_attn.indexer.weights_proj.weight.dtype == jnp.float32


def test_bf16_checkpoint(tmp_path, reference_params):
    tensors = {n: v.astype(ml_dtypes.bfloat16) for n, v in fixture_tensors().items()}
    loaded = flat_params(load_hf_checkpoint(make_checkpoint(tmp_path, tensors), dtype=jnp.float32))
    for path, value in reference_params.items():
        np.testing.assert_array_equal(loaded[path], value.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("index", [True, False], ids=["with_index", "without_index"])
def test_sharded_checkpoint(tmp_path, reference_params, index):
    directory = make_checkpoint(tmp_path, fixture_tensors(), shards=3, index=index)
    assert len([f for f in os.listdir(directory) if f.endswith(".safetensors")]) == 3
    loaded = flat_params(load_hf_checkpoint(directory, dtype=jnp.float32))
    assert loaded.keys() == reference_params.keys()
    for path, value in reference_params.items():
        np.testing.assert_array_equal(loaded[path], value)


def _quantize_fp8(weight, block):
    """Per-block absmax scaling to float8_e4m3fn, as DeepSeek publishes: w ~ fp8 * scale_inv."""
    rows, cols = weight.shape
    nb0, nb1 = -(-rows // block[0]), -(-cols // block[1])
    scale = np.zeros((nb0, nb1), np.float32)
    quant = np.zeros(weight.shape, ml_dtypes.float8_e4m3fn)
    for i in range(nb0):
        for j in range(nb1):
            tile = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scale[i, j] = np.abs(tile).max() / 448.0
            quant[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (tile / scale[i, j]).astype(
                ml_dtypes.float8_e4m3fn
            )
    return quant, scale


def test_fp8_block_quantized_checkpoint_is_dequantized(tmp_path):
    block = (16, 16)  # smaller than the published 128 so the tiny weights span several blocks
    tensors = fixture_tensors()
    expected = {}
    for name in list(tensors):
        if name.endswith("proj.weight") and "weights_proj" not in name and "mlp.gate." not in name:
            quant, scale = _quantize_fp8(tensors[name], block)
            tensors[name], tensors[name + "_scale_inv"] = quant, scale
            # dequantised: each element times the scale of its block
            rows = np.arange(quant.shape[0]) // block[0]
            cols = np.arange(quant.shape[1]) // block[1]
            expected[name] = quant.astype(np.float32) * scale[rows[:, None], cols[None, :]]
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    directory = make_checkpoint(tmp_path, tensors, config_changes={"quantization_config": quantization})
    model = load_hf_checkpoint(directory, dtype=jnp.float32, weights_dtype="float32")  # dequantised at load
    np.testing.assert_array_equal(model.layers[2].self_attn.kv_b_proj.weight[...], expected["model.layers.2.self_attn.kv_b_proj.weight"])
    np.testing.assert_array_equal(model.layers[1].mlp.experts.down_proj[3], expected["model.layers.1.mlp.experts.3.down_proj.weight"].T)
    np.testing.assert_array_equal(model.lm_head.weight[...], fixture_tensors()["lm_head.weight"])  # not quantised


def test_mtp_layers_are_skipped_on_request_and_tied_embeddings_load(tmp_path):
    tensors = fixture_tensors()
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)  # a (partial) MTP layer
    directory = make_checkpoint(tmp_path / "mtp", tensors, config_changes={"num_nextn_predict_layers": 1})
    model = load_hf_checkpoint(directory, load_mtp=False)
    assert len(model.layers) == 3 and model.mtp is None and model.config.num_nextn_predict_layers == 0
    with pytest.raises(CheckpointError, match=r"lacks .* tensor\(s\) the model needs: .*model.layers.3.enorm.weight"):
        load_hf_checkpoint(directory)  # loaded by default: the rest of the layer is missing
    with pytest.raises(CheckpointError, match="model.layers.3.eh_proj.weight"):
        load_hf_checkpoint(make_checkpoint(tmp_path / "no_mtp", tensors))

    tied = fixture_tensors()
    del tied["lm_head.weight"]
    model = load_hf_checkpoint(make_checkpoint(tmp_path / "tied", tied, config_changes={"tie_word_embeddings": True}), dtype=jnp.float32)
    assert model.lm_head is None
    h = jnp.ones((2, 64))
    expected = np.asarray(model.norm(h)) @ np.asarray(model.embed_tokens.weight[...]).T  # on the host: no TF32
    np.testing.assert_allclose(model.logits(h), expected, rtol=1e-5, atol=1e-5)  # f32 sums of 64 terms: near-zero logits differ by ~1e-6


# ---- MTP layers (tests/fixtures/*_mtp: a source fixture + one random MTP layer) ---------------

MTP_FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "deepseek_v32_tiny_mtp")
MTP_FP8_FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "deepseek_v32_tiny_fp8_mtp")


def test_mtp_layer_is_decoder_layer_num_layers(reference_params):
    checkpoint = Checkpoint(MTP_FIXTURE)
    model = load_hf_checkpoint(MTP_FIXTURE, dtype=jnp.float32)
    assert model.config.num_nextn_predict_layers == 1 and model.config.mtp_own_head
    mtp = model.mtp[0]
    for attribute, name in (
        (mtp.enorm.weight, "enorm.weight"), (mtp.hnorm.weight, "hnorm.weight"), (mtp.eh_proj.weight, "eh_proj.weight"),
        (mtp.shared_head.norm.weight, "shared_head.norm.weight"), (mtp.shared_head.head.weight, "shared_head.head.weight"),
        (mtp.self_attn.indexer.wk.weight, "self_attn.indexer.wk.weight"), (mtp.input_layernorm.weight, "input_layernorm.weight"),
        (mtp.mlp.gate.e_score_correction_bias, "mlp.gate.e_score_correction_bias"),
    ):  # fmt: skip
        np.testing.assert_array_equal(attribute[...], checkpoint.read(f"model.layers.3.{name}"))
    np.testing.assert_array_equal(mtp.mlp.experts.up_proj[5], checkpoint.read("model.layers.3.mlp.experts.5.up_proj.weight").T)
    # The main model is the source fixture's, untouched; the MTP layer's embed_tokens copy is not read.
    loaded = flat_params(model)
    for path, value in reference_params.items():
        np.testing.assert_array_equal(loaded[path], value)
    assert not any("embed_tokens" in ".".join(map(str, p)) for p in loaded if p[0].key == "mtp")


def test_fp8_mtp_layer_stays_fp8():
    checkpoint = Checkpoint(MTP_FP8_FIXTURE)
    mtp = load_hf_checkpoint(MTP_FP8_FIXTURE, dtype=jnp.float32).mtp[0]
    assert mtp.self_attn.q_b_proj.weight.dtype == jnp.float8_e4m3fn and mtp.mlp.experts.gate_proj.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(
        mtp.self_attn.q_b_proj.weight_scale_inv[...], checkpoint.read("model.layers.3.self_attn.q_b_proj.weight_scale_inv")
    )
    assert mtp.eh_proj.weight.dtype == jnp.float32  # not quantised (DeepSeek's checkpoints neither)
    dequantised = load_hf_checkpoint(MTP_FP8_FIXTURE, dtype=jnp.float32, weights_dtype="float32").mtp[0]
    assert dequantised.self_attn.q_b_proj.weight.dtype == jnp.float32


def test_bf16_mtp_checkpoint_and_one_without_its_own_head(tmp_path):
    tensors = {n: Checkpoint(MTP_FIXTURE).read(n) for n in Checkpoint(MTP_FIXTURE).names()}
    bf16 = {n: v.astype(ml_dtypes.bfloat16) for n, v in tensors.items()}
    model = load_hf_checkpoint(make_checkpoint(tmp_path / "bf16", bf16, config_changes={"num_nextn_predict_layers": 1}))
    assert model.mtp[0].eh_proj.weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(model.mtp[0].eh_proj.weight[...], bf16["model.layers.3.eh_proj.weight"])
    del tensors["model.layers.3.shared_head.head.weight"]  # then the main lm_head serves the MTP layer
    model = load_hf_checkpoint(make_checkpoint(tmp_path / "headless", tensors, config_changes={"num_nextn_predict_layers": 1}), dtype=jnp.float32)
    assert not model.config.mtp_own_head and model.mtp[0].shared_head.head is None
    from models.dsa.mtp import mtp_head

    g, logits = mtp_head(model, model.mtp[0], jnp.ones((2, 64)))
    np.testing.assert_array_equal(logits, model.lm_head(g))
    # Stripped of its MTP tensors, a checkpoint whose config still counts one loads without it.
    plain = {n: v for n, v in tensors.items() if not n.startswith("model.layers.3.")}
    model = load_hf_checkpoint(make_checkpoint(tmp_path / "stripped", plain, config_changes={"num_nextn_predict_layers": 1}))
    assert model.mtp is None and model.config.num_nextn_predict_layers == 0


def test_orbax_round_trip_with_mtp(tmp_path):
    model = load_hf_checkpoint(MTP_FIXTURE, dtype=jnp.float32)
    save_params(tmp_path / "converted", model)
    restored = restore_params(tmp_path / "converted")
    assert restored.config == model.config
    np.testing.assert_array_equal(restored.mtp[0].shared_head.head.weight[...], model.mtp[0].shared_head.head.weight[...])


def test_orbax_round_trip(tmp_path, reference_params):
    model = load_hf_checkpoint(FIXTURE, dtype=jnp.float32)
    save_params(tmp_path / "converted", model)
    restored = restore_params(tmp_path / "converted")
    assert restored.config == model.config and restored.dtype == jnp.float32
    loaded = flat_params(restored)
    assert loaded.keys() == reference_params.keys()
    for path, value in reference_params.items():
        np.testing.assert_array_equal(loaded[path], value)
    with pytest.raises(CheckpointError, match="does not exist"):
        restore_params(tmp_path / "nothing_here")


# ---- errors -------------------------------------------------------------------------------------


def _drop(name):
    def mutate(tensors, directory):
        del tensors[name]

    return mutate


def _add(name, value):
    def mutate(tensors, directory):
        tensors[name] = value

    return mutate


def _write_file(file, content):
    def mutate(tensors, directory):
        with open(os.path.join(directory, file), "wb") as f:
            f.write(content)

    return mutate


def _config(**changes):
    def mutate(tensors, directory):
        path = os.path.join(directory, "config.json")
        with open(path) as f:
            config = json.load(f)
        config.update(changes)
        with open(path, "w") as f:
            json.dump(config, f)

    return mutate


def _truncate(tensors, directory):
    path = os.path.join(directory, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)


def _remove(file):
    def mutate(tensors, directory):
        os.remove(os.path.join(directory, file))

    return mutate


def _index(weight_map_change):
    def mutate(tensors, directory):
        path = os.path.join(directory, "model.safetensors.index.json")
        with open(path) as f:
            index = json.load(f)
        weight_map_change(index["weight_map"])
        with open(path, "w") as f:
            json.dump(index, f)

    return mutate


def _fp8(scale_shape):
    """Quantises q_a_proj of layer 0 (FP8 config); scale_shape None leaves the scale out."""

    def mutate(tensors, directory):
        name = "model.layers.0.self_attn.q_a_proj.weight"
        tensors[name] = tensors[name].astype(ml_dtypes.float8_e4m3fn)
        if scale_shape is not None:
            tensors[name + "_scale_inv"] = np.ones(scale_shape, np.float32)

    return mutate


_FP8_CONFIG = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
_Q_A = "model.layers.0.self_attn.q_a_proj.weight"

# (id, mutation of the tensors before writing, mutation of the written dir, shards, error, message)
ERROR_CASES = [
    ("missing_tensor", _drop("model.layers.2.self_attn.indexer.wk.weight"), None, 1, CheckpointError,
     r"lacks 1 tensor\(s\) the model needs: model.layers.2.self_attn.indexer.wk.weight"),
    ("missing_expert", _drop("model.layers.1.mlp.experts.5.up_proj.weight"), None, 1, CheckpointError,
     "model.layers.1.mlp.experts.5.up_proj.weight"),
    ("unexpected_tensor", _add("model.layers.0.self_attn.extra.weight", np.zeros(3, np.float32)), None, 1,
     CheckpointError, r"1 tensor\(s\) this deepseek_v32 config has no place for .*model.layers.0.self_attn.extra.weight"),
    ("shape_mismatch", _add(_Q_A, np.zeros((64, 48), np.float32)), None, 1, CheckpointError,
     r"shape\(s\) differ from config.json: model.layers.0.self_attn.q_a_proj.weight: checkpoint \(64, 48\), model \(48, 64\)"),
    ("wrong_config_layers", None, _config(num_hidden_layers=2, mlp_layer_types=None, layer_types=None), 1,
     CheckpointError, "no place for .*model.layers.2"),
    ("unsupported_model_type", None, _config(model_type="qwen3_moe"), 1, UnsupportedModelError,
     "model_type 'qwen3_moe' is not supported"),
    ("unsupported_quantization", None, _config(quantization_config={"quant_method": "awq"}), 1, UnsupportedModelError,
     "quant_method 'awq'"),
    ("no_config", None, _remove("config.json"), 1, CheckpointError, "no config.json"),
    ("unreadable_config", None, _write_file("config.json", b"{oops"), 1, CheckpointError, "config.json: unreadable"),
    ("no_safetensors", None, _remove("model.safetensors"), 1, CheckpointError, r"no \*.safetensors files"),
    ("garbage_file", None, _write_file("model.safetensors", b"\xff" * 64), 1, CheckpointError,
     "model.safetensors: not a safetensors file"),
    ("corrupt_header", None, _write_file("model.safetensors", (12).to_bytes(8, "little") + b"not json!!!!"), 1,
     CheckpointError, "model.safetensors: corrupt safetensors header"),
    ("truncated_file", None, _truncate, 1, CheckpointError, r"does not fit .*truncated\?"),
    ("index_names_missing_shard", None, _remove("model-00002-of-00002.safetensors"), 2, CheckpointError,
     "lists shard file.* that do not exist: model-00002-of-00002.safetensors"),
    ("index_maps_wrong_shard", None,
     _index(lambda m: m.update({n: "model-00002-of-00002.safetensors" for n in m if m[n].startswith("model-00001")})),
     2, CheckpointError, "maps tensor.* to shards that do not hold them"),
    ("unreadable_index", None, _write_file("model.safetensors.index.json", b"[]"), 2, CheckpointError,
     "unreadable shard index"),
    ("fp8_without_scale", _fp8(None), _config(**_FP8_CONFIG), 1, CheckpointError, f"FP8 tensor {_Q_A} has no {_Q_A}_scale_inv"),
    ("fp8_bad_scale_shape", _fp8((2, 2)), _config(**_FP8_CONFIG), 1, CheckpointError,
     r"q_a_proj.weight_scale_inv has shape \(2, 2\), expected \(1, 1\)"),
    ("fp8_without_quantization_config", _fp8((1, 1)), None, 1, CheckpointError, "has no quantization_config"),
]  # fmt: skip


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_checkpoints_name_the_problem(tmp_path, case):
    _, mutate_tensors, mutate_dir, shards, error, message = case
    tensors = fixture_tensors()
    if mutate_tensors:
        mutate_tensors(tensors, tmp_path)
    make_checkpoint(tmp_path, tensors, shards=shards)
    if mutate_dir:
        mutate_dir(tensors, tmp_path)
    with pytest.raises(error, match=message):
        load_hf_checkpoint(tmp_path, dtype=jnp.float32)


def test_duplicate_tensor_and_missing_directory(tmp_path):
    tensors = fixture_tensors()
    make_checkpoint(tmp_path, tensors)
    shutil.copy(tmp_path / "model.safetensors", tmp_path / "model-copy.safetensors")
    with pytest.raises(CheckpointError, match="is stored twice"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "absent")
