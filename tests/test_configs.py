"""DSAModelConfig: real-model dims and sizes (docs/background.md), HF config.json parsing."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.model import DSAModelConfig, UnsupportedModelError
from hisparse_jax.row_layout import KVRowLayout
from models.common import rope
from models.dsa.loading import abstract_model

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "deepseek_v32_tiny")

# docs/background.md, model dimensions.
TABLE = {
    "deepseek_v32": dict(
        num_layers=61, hidden_size=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, vocab_size=129280,
    ),
    "glm_5_1": dict(
        num_layers=78, hidden_size=6144, num_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, vocab_size=154880,
    ),
}  # fmt: skip
TABLE["glm_5_2"] = TABLE["glm_5_1"]


@pytest.mark.parametrize("name", sorted(TABLE))
def test_named_config_dims_match_the_public_configs(name):
    config = getattr(DSAModelConfig, name)()
    for field, value in TABLE[name].items():
        assert getattr(config, field) == value, field
    if name.startswith("glm"):
        assert config.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
        assert config.indexer_rope_interleave


def test_glm_5_2_index_share_schedule():
    config = DSAModelConfig.glm_5_2()
    full = config.full_indexer_layers
    assert len(full) == 21 and config.indexer_types.count("shared") == 57
    assert full == (0, 1, 2) + tuple(range(6, 78, 4))
    assert config.anchor_layer(5) == 2 and config.anchor_layer(6) == 6 and config.anchor_layer(77) == 74
    assert config.indexer_cache_index(74) == 20
    assert DSAModelConfig.glm_5_1().full_indexer_layers == tuple(range(78))


def test_deepseek_v32_kv_bytes_per_token_match_hisparse_md():
    config = DSAModelConfig.deepseek_v32()
    L = config.num_layers
    bf16 = KVRowLayout.for_dtype(config.kv_lora_rank, config.qk_rope_head_dim, jnp.bfloat16)
    assert bf16.bytes_per_row == 1152
    assert L * bf16.bytes_per_row == 70272  # "70 KB" per token
    assert 128 * 1024 * L * bf16.bytes_per_row / 1e9 == pytest.approx(9.2, abs=0.05)  # 128K-token request
    # FlashMLA's FP8 row: 512 fp8 + one f32 scale per 128 latent values + 64 bf16 rope values.
    fp8_row = config.kv_lora_rank + 4 * config.kv_lora_rank // 128 + 2 * config.qk_rope_head_dim
    assert fp8_row == 656 and L * fp8_row == 40016  # "40 KB"
    # Indexer keys in production: 128 fp8 values + one f32 scale.
    assert L * (config.index_head_dim + 4) == 8052  # "8 KB"


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_5_1", "glm_5_2"])
def test_real_size_models_build_as_shapes_only(name):
    config = getattr(DSAModelConfig, name)()
    model = abstract_model(config, jnp.bfloat16)
    leaves = jax.tree.leaves(model)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    total = sum(math.prod(x.shape) for x in leaves)
    attn = model.layers[5].self_attn
    H, N, V = config.num_heads, config.qk_nope_head_dim, config.v_head_dim
    assert attn.kv_b_proj.weight.shape == (H * (N + V), config.kv_lora_rank)
    assert model.layers[5].mlp.experts.gate_proj.shape == (256, config.hidden_size, 2048)
    assert model.layers[5].mlp.gate.weight.dtype == jnp.float32  # the router stays f32
    indexers = sum(layer.self_attn.indexer is not None for layer in model.layers)
    assert indexers == len(config.full_indexer_layers)
    assert len(model.mtp) == config.num_nextn_predict_layers == 1  # the MTP layer, held with the model
    mtp = sum(math.prod(x.shape) for x in jax.tree.leaves(model.mtp))
    if name == "deepseek_v32":
        # DeepSeek-V3's 671B without its MTP layer (685B with it), plus 61 (+ 1) lightning indexers.
        assert 671e9 < total - mtp < 673e9 and 684e9 < total < 686e9
    else:
        assert 742e9 < total - mtp < 746e9  # "744B" published for GLM-5 (without its MTP layer)


def test_fixture_config_json_is_the_tiny_config():
    parsed = DSAModelConfig.from_hf_config(FIXTURE)
    assert parsed == DSAModelConfig.tiny()
    assert DSAModelConfig.from_hf_config(f"{FIXTURE}/config.json") == parsed
    with open(f"{FIXTURE}/config.json") as f:
        assert DSAModelConfig.from_hf_config(json.load(f)) == parsed
    assert DSAModelConfig.from_dict(parsed.to_dict()) == parsed
    assert not parsed.indexer_rope_interleave and parsed.indexer_types == ("full",) * 3


def test_deepseek_yarn_softmax_scale_and_frequencies():
    config = DSAModelConfig.deepseek_v32()
    mscale = 0.1 * math.log(40) + 1
    assert config.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    inv_freq, attention_factor = rope.inverse_frequencies(config.rope, 64)
    assert attention_factor == 1.0  # mscale / mscale_all_dim
    original = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    # Correction range for beta_fast 32 / beta_slow 1 over 4096 original positions: dims [10, 23].
    np.testing.assert_allclose(inv_freq[:10], original[:10], rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(inv_freq[23:], original[23:] / 40, rtol=1e-6, atol=1e-12)
    assert np.all((inv_freq[10:23] < original[10:23]) & (inv_freq[10:23] > original[10:23] / 40))


def test_glm_index_schedule_sources():
    base = dict(model_type="glm_moe_dsa", num_hidden_layers=6)
    by_freq = DSAModelConfig.from_hf_config(dict(base, index_topk_freq=2, index_skip_topk_offset=2))
    assert by_freq.indexer_types == ("full", "full", "shared", "full", "shared", "full")
    by_pattern = DSAModelConfig.from_hf_config(dict(base, index_topk_pattern="FSSFFS", index_topk_freq=2))
    assert by_pattern.indexer_types == ("full", "shared", "shared", "full", "full", "shared")
    explicit = DSAModelConfig.from_hf_config(dict(base, indexer_types=["full"] * 5 + ["shared"], index_topk_pattern="F" * 6))
    assert explicit.indexer_types[-1] == "shared"
    assert DSAModelConfig.from_hf_config(base).indexer_types == ("full",) * 6  # freq defaults to 1


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(model_type="llama"), UnsupportedModelError, "model_type 'llama'"),
        (dict(model_type=None), UnsupportedModelError, "model_type None"),
        (dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4)), UnsupportedModelError, "rope_type 'llama3'"),
        (dict(hidden_act="gelu"), UnsupportedModelError, "hidden_act"),
        (dict(attention_bias=True), UnsupportedModelError, "attention_bias"),
        (dict(q_lora_rank=None), UnsupportedModelError, "q_lora_rank"),
        (dict(num_key_value_heads=2), UnsupportedModelError, "num_key_value_heads"),
        (dict(mlp_layer_types=["dense", "sparse"]), ValueError, "mlp_layer_types has 2 entries"),
        (dict(n_group=3), ValueError, "divisible by self.n_group=3"),
        (dict(topk_group=3), ValueError, "topk_group=3"),
        (dict(qk_rope_head_dim=15), ValueError, "must be even"),
        (dict(index_topk=0), ValueError, "index_topk=0"),
    ],
)
def test_bad_hf_configs_name_the_problem(changes, error, match):
    with open(f"{FIXTURE}/config.json") as f:
        raw = json.load(f)
    raw.update(changes)
    with pytest.raises(error, match=match):
        DSAModelConfig.from_hf_config(raw)


def test_shared_first_layer_and_missing_file_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="indexer_types\\[0\\] must be 'full'"):
        DSAModelConfig.from_hf_config(dict(model_type="glm_moe_dsa", num_hidden_layers=2, index_topk_pattern="SF"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        DSAModelConfig.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read model config"):
        DSAModelConfig.from_hf_config(tmp_path)


def test_deepseek_v32_bench_is_the_full_attention_on_few_layers():
    """The built-in the benchmarks and PD's H200 run use: DeepSeek-V3.2's attention and indexer
    widths (real KV row sizes), 4 layers (one dense), 16 routed experts, no MTP layer."""
    bench, full = DSAModelConfig.deepseek_v32_bench(), DSAModelConfig.deepseek_v32()
    for field in ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "index_n_heads", "index_head_dim", "index_topk", "hidden_size"):
        assert getattr(bench, field) == getattr(full, field), field
    assert (bench.num_layers, bench.n_routed_experts, bench.num_nextn_predict_layers) == (4, 16, 0)
    assert bench.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    assert DSAModelConfig.deepseek_v32_bench(8, 32).n_routed_experts == 32
