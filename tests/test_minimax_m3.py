"""MiniMax-M3 (minimax_m3_vl_text) against transformers 5.24.0's outputs (tests/fixtures/
minimax_m3_tiny): forward logits, the block indexer's selections, greedy tokens; the config
parser; both checkpoint name schemes and the loader's errors.

Float32 throughout: the fixture's README shows every discrete choice (indexer blocks, routing,
greedy argmax) has a margin >= 74x float32 round-off, so they must all match exactly.
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.minimax_m3 import MiniMaxM3Config
from configs.model import UnsupportedModelError
from models.common.checkpoint import Checkpoint, CheckpointError
from hisparse_jax.config import HiSparseConfig, HiSparseConfigError
from models.minimax_m3.model import create_cache, decode_step, forward, forward_with_selections, generate, greedy_generate, prefill, sorted_selection
from models.minimax_m3.hisparse import create_hisparse_cache, hisparse_decode_step, hisparse_plan, hisparse_prefill
from models.minimax_m3.loading import load_hf_checkpoint, write_safetensors

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "minimax_m3_tiny")
RTOL = 1e-4  # relative to the largest |logit|, as the fixture's README suggests


@pytest.fixture(scope="module")
def golden():
    with np.load(os.path.join(FIXTURE, "golden.npz")) as data:
        return dict(data)


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(FIXTURE, dtype=jnp.float32)


@pytest.fixture(scope="module")
def prompt_pass(model, golden):
    """(logits, sorted block selections [J, B, n, T, K]) of the no-cache forward over the prompts."""
    logits, picks = jax.jit(forward_with_selections)(model, jnp.asarray(golden["input_ids"]))
    return np.asarray(logits), np.asarray(sorted_selection(picks))


def relative_error(actual, expected):
    return float(np.abs(np.asarray(actual) - expected).max() / np.abs(expected).max())


# ---- against the reference -----------------------------------------------------------------------


def test_forward_logits_match_reference(prompt_pass, golden):
    logits, _ = prompt_pass
    assert logits.shape == golden["logits"].shape and logits.dtype == np.float32
    error = relative_error(logits, golden["logits"])
    assert error < RTOL, f"max error {error:.2e} of the largest |logit|"


def test_block_indexer_selects_the_reference_blocks(model, prompt_pass, golden):
    _, selections = prompt_pass
    assert tuple(golden["indexer_topk_layers"]) == model.config.sparse_layers == (1, 3)
    np.testing.assert_array_equal(selections, golden["indexer_topk_all"])
    np.testing.assert_array_equal(selections[0], golden["indexer_topk"])
    # The indexer does drop blocks here (else the test would not test it): 16 blocks, 4 kept.
    assert (selections[..., -1] >= 0).any() and selections.shape[-1] == 4


def test_forward_is_causal(model, golden):
    """A prefix's logits are the full prompt's first positions (to round-off: other shapes)."""
    tokens = jnp.asarray(golden["input_ids"])
    prefix = np.asarray(jax.jit(forward)(model, tokens[:1, :20]))
    assert relative_error(prefix, golden["logits"][:1, :20]) < RTOL


def test_greedy_tokens_match_reference(model, golden):
    tokens, step_logits = greedy_generate(model, jnp.asarray(golden["input_ids"]), golden["greedy_tokens"].shape[1])
    np.testing.assert_array_equal(np.asarray(tokens), golden["greedy_tokens"])
    assert relative_error(step_logits, golden["greedy_logits"]) < RTOL


def test_cached_generate_matches_reference(model, golden):
    """Prefill + decode steps with the K/V + index-key cache == the no-cache loop."""
    tokens, step_logits = generate(model, jnp.asarray(golden["input_ids"]), golden["greedy_tokens"].shape[1])
    np.testing.assert_array_equal(np.asarray(tokens), golden["greedy_tokens"])
    assert relative_error(step_logits, golden["greedy_logits"]) < RTOL


def test_decode_steps_equal_the_forward_at_every_position(model, golden):
    """Prefill 40 prompt tokens, then feed the other 24 one by one (sequences at different
    positions in one step: the second one lags by 3): each step's logits == the forward's."""
    ids = jnp.asarray(golden["input_ids"])
    cache, last = jax.jit(prefill)(model, create_cache(model, 2, 64), ids[:, :40])
    assert relative_error(last, golden["logits"][:, 39]) < RTOL
    step = jax.jit(decode_step)
    for p in range(40, 64):
        positions = jnp.asarray([p, max(p - 3, 40)], jnp.int32)
        cache, logits = step(model, cache, ids[jnp.arange(2), positions], positions)
        assert relative_error(logits, golden["logits"][np.arange(2), np.asarray(positions)]) < RTOL, p


# ---- HiSparse mapping ----------------------------------------------------------------------------


def test_hisparse_plan_released_model():
    config = MiniMaxM3Config.released(layer_types=("full_attention", "minimax_m3_sparse") * 30)
    plan = hisparse_plan(config, HiSparseConfig(top_k=16, device_buffer_size=2048))
    assert plan.selection_width == 2048  # the model's 16 blocks x 128, not top_k
    assert plan.device_kv_layers == tuple(range(0, 60, 2)) and plan.offloaded_kv_layers == tuple(range(1, 60, 2))
    assert plan.index_key_layers == plan.offloaded_kv_layers
    assert (plan.groups_per_token, plan.row_width) == (4, 256)
    with pytest.raises(HiSparseConfigError, match="device_buffer_size \\(2047\\) must be >= .* 2048"):
        hisparse_plan(config, HiSparseConfig(top_k=16, device_buffer_size=2047))


def test_hisparse_decoding_matches_reference(model, golden):
    """Sparse layers' K/V in the HiSparse state (host pool + a 20-row working set per request,
    KV group and layer, just above the 16 keys one selection takes, so steps miss and evict):
    greedy tokens and step logits == the reference's no-cache loop."""
    prompts, steps = golden["input_ids"], golden["greedy_tokens"].shape[1]
    cache = create_hisparse_cache(model, 2, prompts.shape[1] + steps, HiSparseConfig(top_k=16, device_buffer_size=20))
    cache, last = jax.jit(hisparse_prefill)(model, cache, jnp.asarray(prompts))
    step = jax.jit(hisparse_decode_step, donate_argnums=1)
    tokens, logits, misses = [np.argmax(np.asarray(last), -1)], [np.asarray(last)], 0
    for j in range(1, steps):
        positions = jnp.full((2,), prompts.shape[1] + j - 1, jnp.int32)
        cache, last, step_misses = step(model, cache, jnp.asarray(tokens[-1], jnp.int32), positions)
        tokens.append(np.argmax(np.asarray(last), -1))
        logits.append(np.asarray(last))
        misses += int(np.asarray(step_misses).sum())
    np.testing.assert_array_equal(np.stack(tokens, 1), golden["greedy_tokens"])
    assert relative_error(np.stack(logits, 1), golden["greedy_logits"]) < RTOL
    assert misses > 0  # the working set is too small to hold everything: rows did come from the host


def test_hisparse_plan_tiny_model():
    plan = hisparse_plan(MiniMaxM3Config.tiny(), HiSparseConfig(top_k=8, device_buffer_size=16))
    assert plan.device_kv_layers == (0, 2) and plan.offloaded_kv_layers == (1, 3) and plan.selection_width == 16
    one_indexer_head = MiniMaxM3Config.tiny().replace(index_n_heads=1)  # valid model, but no selection per KV group
    with pytest.raises(HiSparseConfigError, match="index_n_heads"):
        hisparse_plan(one_indexer_head, HiSparseConfig(top_k=8, device_buffer_size=16))


# ---- config --------------------------------------------------------------------------------------


def _fixture_config() -> dict:
    with open(os.path.join(FIXTURE, "config.json")) as f:
        return json.load(f)


def test_config_from_fixture_equals_tiny():
    config = MiniMaxM3Config.from_hf_config(FIXTURE)
    assert config == MiniMaxM3Config.tiny()
    assert config.rotary_dim == 16 and config.rope_theta == 10000.0
    assert config.sparse_layers == (1, 3) and config.dense_attention_layers == (0, 2)
    assert config.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    assert config.selected_keys == 16
    assert MiniMaxM3Config.from_dict(config.to_dict()) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 1


def test_config_vl_wrapper_reads_text_config():
    text = _fixture_config()
    del text["model_type"]
    config = MiniMaxM3Config.from_hf_config({"model_type": "minimax_m3_vl", "text_config": text, "vision_config": {}})
    assert config == MiniMaxM3Config.tiny()


def test_config_rotated_width():
    raw = _fixture_config()
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}  # no partial_rotary_factor
    assert MiniMaxM3Config.from_hf_config(raw).rotary_dim == 16  # rotary_dim / head_dim
    raw["rope_parameters"]["partial_rotary_factor"] = 0.25
    assert MiniMaxM3Config.from_hf_config(raw).rotary_dim == 8  # partial_rotary_factor wins
    del raw["rope_parameters"]["partial_rotary_factor"], raw["rotary_dim"]
    raw.update(head_dim=128, index_head_dim=128)
    assert MiniMaxM3Config.from_hf_config(raw).rotary_dim == 64  # neither: the class default rotary_dim 64


def test_config_released_sizes():
    config = MiniMaxM3Config.released()
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (6144, 60, 64, 4, 128)
    assert (config.num_experts, config.num_experts_per_tok, config.intermediate_size) == (128, 4, 3072)
    assert (config.index_n_heads, config.index_head_dim, config.index_block_size, config.index_topk_blocks) == (4, 128, 128, 16)
    assert config.rotary_dim == 64 and config.vocab_size == 200064 and config.selected_keys == 2048
    sparse = MiniMaxM3Config.released(layer_types=("full_attention",) + ("minimax_m3_sparse",) * 59)
    assert len(sparse.sparse_layers) == 59


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(model_type="minimax_m2"), UnsupportedModelError, "model_type"),
        (dict(layer_types=["full_attention", "sliding_attention", "full_attention", "full_attention"]), UnsupportedModelError, "layer_types"),
        (dict(layer_types=["full_attention"]), ValueError, "num_layers"),
        (dict(index_n_heads=3), ValueError, "index_n_heads"),
        (dict(num_key_value_heads=3), ValueError, "num_key_value_heads|num_kv_heads"),
        (dict(rope_parameters=dict(rope_type="yarn", factor=4.0)), UnsupportedModelError, "rope_type"),
        (dict(rope_parameters=dict(rope_type="default", partial_rotary_factor=0.3)), ValueError, "partial_rotary_factor"),
        (dict(attention_bias=True), UnsupportedModelError, "attention_bias"),
        (dict(num_experts_per_tok=9), ValueError, "num_experts_per_tok"),
        (dict(index_head_dim=8), UnsupportedModelError, "index_head_dim"),
        (dict(hidden_size=0), ValueError, "hidden_size"),
    ],
)
def test_config_errors(change, error, match):
    raw = _fixture_config()
    raw.update(change)
    with pytest.raises(error, match=match):
        MiniMaxM3Config.from_hf_config(raw)


# ---- checkpoints ---------------------------------------------------------------------------------


def _fixture_tensors() -> dict[str, np.ndarray]:
    checkpoint = Checkpoint(FIXTURE)
    return {n: np.array(checkpoint.read(n)) for n in checkpoint.names()}


def _write_checkpoint(directory, tensors, config=None):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config or _fixture_config(), f)
    write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
    return directory


def _released_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The fixture's tensors under MiniMax-style names: `language_model.model.` prefix,
    per-expert block_sparse_moe w1/w2/w3, index_* indexer names, split shared-expert MLPs."""
    out = {}
    for name, value in tensors.items():
        new = name.replace("model.", "language_model.model.", 1) if name.startswith("model.") else "language_model." + name
        new = new.replace(".self_attn.indexer.", ".self_attn.index_")
        new = new.replace(".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias")
        new = new.replace(".mlp.", ".block_sparse_moe.")
        if new.endswith(".experts.gate_up_proj"):
            prefix = new[: -len(".gate_up_proj")]
            F = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}.{e}.w1.weight"] = value[e, :F]
                out[f"{prefix}.{e}.w3.weight"] = value[e, F:]
        elif new.endswith(".experts.down_proj"):
            prefix = new[: -len(".down_proj")]
            for e in range(value.shape[0]):
                out[f"{prefix}.{e}.w2.weight"] = value[e]
        elif new.endswith("shared_experts.gate_up_proj.weight"):
            prefix = new[: -len(".gate_up_proj.weight")]
            F = value.shape[0] // 2
            out[f"{prefix}.gate_proj.weight"], out[f"{prefix}.up_proj.weight"] = value[:F], value[F:]
        else:
            out[new] = value
    out["vision_tower.patch_embed.weight"] = np.zeros((4, 4), np.float32)  # skipped
    return out


def test_released_name_scheme_loads_the_same_model(tmp_path, model, golden):
    tensors = _released_names(_fixture_tensors())
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight" in tensors
    assert "language_model.model.layers.1.self_attn.index_q_proj.weight" in tensors
    vl_config = {"model_type": "minimax_m3_vl", "text_config": _fixture_config(), "vision_config": {}}
    other = load_hf_checkpoint(_write_checkpoint(tmp_path / "released", tensors, vl_config), dtype=jnp.float32)
    tokens = jnp.asarray(golden["input_ids"][:, :32])
    np.testing.assert_array_equal(np.asarray(jax.jit(forward)(other, tokens)), np.asarray(jax.jit(forward)(model, tokens)))


def _drop(name):
    def change(tensors):
        del tensors[name]

    return change


def _reshape(name):
    def change(tensors):
        tensors[name] = tensors[name][:-1]

    return change


def _add(name, value):
    def change(tensors):
        tensors[name] = value

    return change


@pytest.mark.parametrize(
    "change, match",
    [
        (_drop("model.layers.1.self_attn.indexer.k_proj.weight"), r"lacks 1 tensor\(s\).*indexer\.k_proj"),
        (_drop("model.layers.2.mlp.experts.down_proj"), r"lacks 1 tensor\(s\).*layers\.2\.mlp\.experts\.down_proj"),
        (_reshape("model.layers.0.self_attn.q_proj.weight"), r"shape.*q_proj\.weight: checkpoint \(127, 64\)"),
        (_add("model.layers.0.self_attn.indexer.q_proj.weight", np.zeros((64, 64), np.float32)), r"no place for.*layers\.0\.self_attn\.indexer"),
        (_add("model.layers.1.mlp.experts.0.w1.weight", np.zeros((32, 64), np.float32)), r"both packed"),
        (_add("model.layers.1.mlp.gate.int_weight", np.zeros((8,), np.int32)), r"no place for"),
        (_add("language_model.model.norm.weight", np.zeros((64,), np.float32)), r"stores 'model\.norm\.weight' twice"),
    ],
    ids=["missing", "missing-experts", "shape", "unexpected", "packed-and-per-expert", "unexpected-int", "stored-twice"],
)
def test_bad_checkpoint_errors(tmp_path, change, match):
    tensors = _fixture_tensors()
    change(tensors)
    with pytest.raises(CheckpointError, match=match):
        load_hf_checkpoint(_write_checkpoint(tmp_path / "bad", tensors), dtype=jnp.float32)


def test_bad_checkpoint_directories(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nowhere")
    shutil.copytree(FIXTURE, tmp_path / "noconfig")
    os.remove(tmp_path / "noconfig" / "config.json")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_checkpoint(tmp_path / "noconfig")
    raw = _fixture_config()
    raw["model_type"] = "deepseek_v32"
    with pytest.raises(UnsupportedModelError, match="model_type"):
        load_hf_checkpoint(_write_checkpoint(tmp_path / "wrongtype", _fixture_tensors(), raw))
    raw = _fixture_config()
    raw["num_hidden_layers"] = 5  # layer_types still lists 4
    with pytest.raises(CheckpointError, match="invalid MiniMax-M3 config.*num_layers"):
        load_hf_checkpoint(_write_checkpoint(tmp_path / "badconfig", _fixture_tensors(), raw))
