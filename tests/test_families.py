"""models.registry: config.json's model_type -> config class, loader and decode function, and the
orbax round trip (models.registry.save_params / restore_params) of the DeepSeek-V4 and MiniMax-M3
fixtures' params. (Decoding the fixtures through run_decode.py: tests/test_run_decode_families.py.)"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.deepseek_v4 import DeepseekV4Config
from configs.minimax_m3 import MiniMaxM3Config
from configs.model import DSAModelConfig, UnsupportedModelError
from hisparse_jax.config import HiSparseConfig
from models import registry
from models.common import inputs
from models.deepseek_v4.loading import load_deepseek_v4
from models.registry import restore_params, save_params
from models.minimax_m3.loading import load_hf_checkpoint as load_m3

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def test_model_type_picks_the_family(tmp_path):
    expected = {
        "deepseek_v32_tiny": ("dsa", DSAModelConfig, 16),
        "glm_moe_dsa_tiny": ("dsa", DSAModelConfig, None),
        "deepseek_v4_tiny": ("deepseek_v4", DeepseekV4Config, 8),
        "minimax_m3_tiny": ("minimax_m3", MiniMaxM3Config, 16),  # 4 blocks x 4 keys
    }
    for name, (family_name, config_class, width) in expected.items():
        config = registry.load_config(os.path.join(FIXTURES, name))
        family = registry.family_of_config(config)
        assert isinstance(config, config_class) and family.name == family_name
        if width is not None:
            assert family.selection_width(config) == width
    with open(os.path.join(FIXTURES, "minimax_m3_tiny", "config.json")) as f:
        text = json.load(f)
    assert registry.family_of({"model_type": "minimax_m3_vl", "text_config": text}).name == "minimax_m3"
    with pytest.raises(UnsupportedModelError, match="'llama' is not supported; use one of .*deepseek_v4.*minimax_m3_vl"):
        registry.family_of({"model_type": "llama"})


def test_hisparse_top_k_per_family():
    m3 = MiniMaxM3Config.tiny()
    registry.check_hisparse(HiSparseConfig(top_k=16, device_buffer_size=20), m3)
    with pytest.raises(inputs.InputError, match=r"top_k \(8\) is not applied to MiniMax-M3: .* 4 x 4 = 16"):
        registry.check_hisparse(HiSparseConfig(top_k=8, device_buffer_size=20), m3)
    v4 = DeepseekV4Config.tiny()
    registry.check_hisparse(HiSparseConfig(top_k=v4.index_topk, device_buffer_size=10), v4)
    with pytest.raises(inputs.InputError, match="must equal the model's index_topk"):
        registry.check_hisparse(HiSparseConfig(top_k=v4.index_topk + 1, device_buffer_size=20), v4)


def _flat(model) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]}


@pytest.mark.parametrize("name, load", [("deepseek_v4_tiny", load_deepseek_v4), ("minimax_m3_tiny", load_m3)])
def test_orbax_round_trip(tmp_path, name, load):
    model = load(os.path.join(FIXTURES, name), dtype=jnp.float32)
    save_params(tmp_path / "converted", model)
    restored = restore_params(tmp_path / "converted")
    assert type(restored) is type(model) and restored.config == model.config and restored.dtype == jnp.float32
    expected, loaded = _flat(model), _flat(restored)
    assert loaded.keys() == expected.keys()
    for path, value in expected.items():
        np.testing.assert_array_equal(loaded[path], value, err_msg=path)
