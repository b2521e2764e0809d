import dataclasses

import pytest

from hisparse_jax.config import HiSparseConfig, HiSparseConfigError, ResidencyConfig


def test_sglang_json_round_trip():
    text = '{"top_k": 2048, "device_buffer_size": 6144, "host_to_device_ratio": 10, "swap_in_block_size": 960}'
    config = HiSparseConfig.from_json(text)
    assert (config.top_k, config.device_buffer_size, config.host_to_device_ratio) == (2048, 6144, 10)
    assert HiSparseConfig.from_json(config.to_json()) == config


def test_defaults_follow_sglang():
    assert HiSparseConfig.from_json(None) == HiSparseConfig(2048, 4096, 2, 960)
    assert HiSparseConfig.from_json('{"top_k": 16}').device_buffer_size == 32  # 2 x the given top_k


@pytest.mark.parametrize(
    "text, field",
    [
        ('{"top_k": 8, "device_buffer_size": 4}', "device_buffer_size"),
        ('{"top_k": 0}', "top_k"),
        ('{"top_k": true}', "top_k"),
        ('{"host_to_device_ratio": "8"}', "host_to_device_ratio"),
        ('{"swap_in_block_size": 2048}', "swap_in_block_size"),
        ('{"swap_in_block_size": -1}', "swap_in_block_size"),
        ('{"topk": 2048}', "topk"),
        ("[1, 2]", "JSON object"),
        ("{not json", "not valid JSON"),
    ],
)
def test_errors_name_the_field(text, field):
    with pytest.raises(HiSparseConfigError, match=field):
        HiSparseConfig.from_json(text)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        HiSparseConfig().top_k = 1


@pytest.mark.parametrize("block, rows", [(960, 16), (1024, 32), (512, 16), (64, 2), (1, 1)])
def test_swap_in_block_size_sets_copy_rows_per_program(block, rows):
    # SGLang: one warp per row, so a block of `block` threads copies block // 32 rows at once.
    assert HiSparseConfig(swap_in_block_size=block).copy_rows_per_program == rows


def test_sglang_flat_residency_keys_read_as_the_nested_object():
    flat = HiSparseConfig.from_json(
        '{"top_k": 16, "dynamic_residency": true, "dynamic_residency_mode": "forced_resident",'
        ' "dynamic_residency_promote_watermark": 0.3, "dynamic_residency_demote_watermark": 0.2}'
    )
    nested = HiSparseConfig.from_json(
        '{"top_k": 16, "dynamic_residency": {"mode": "forced_resident", "promote_watermark": 0.3, "demote_watermark": 0.2}}'
    )
    assert flat == nested and flat.dynamic_residency.mode == "forced_resident"
    assert HiSparseConfig.from_json('{"dynamic_residency": true}').dynamic_residency == ResidencyConfig()
    assert HiSparseConfig.from_json('{"dynamic_residency": false}').dynamic_residency is None
    assert HiSparseConfig.from_json(flat.to_json()) == flat


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"dynamic_residency_mode": "adaptive"}', 'needs "dynamic_residency": true'),
        ('{"dynamic_residency": false, "dynamic_residency_mode": "adaptive"}', "dynamic_residency is false"),
        ('{"dynamic_residency": true, "dynamic_residency_mode": "admission_once"}', "dynamic_residency.mode must be one of"),
        ('{"dynamic_residency": true, "dynamic_residency_max_tokens": 8}', r"SGLang's hisparse_config field\(s\) \['dynamic_residency_max_tokens'\]"),
        ('{"backend": "fa3"}', r"\['backend'\] are not supported here"),
        ('{"dynamic_residency": true, "dynamic_residency_colour": 1}', r"unknown dynamic_residency field\(s\) \['colour'\]"),
    ],
    ids=["flat_without_switch", "flat_switched_off", "sglang_only_mode", "sglang_only_limit", "sglang_only_key", "unknown_flat"],
)
def test_sglang_spellings_refused_by_name(text, message):
    with pytest.raises(HiSparseConfigError, match=message):
        HiSparseConfig.from_json(text)


def test_shared_prefetch_key():
    """--hisparse_config's "shared_prefetch" (the side-stream gather was an environment variable):
    read, written back, None when left out (the default decides), refused by value."""
    config = HiSparseConfig.from_json('{"top_k": 16, "shared_prefetch": "ffi_stream"}')
    assert config.shared_prefetch == "ffi_stream" and HiSparseConfig.from_json(config.to_json()) == config
    assert HiSparseConfig.from_json('{"top_k": 16}').shared_prefetch is None
    with pytest.raises(HiSparseConfigError, match=r"shared_prefetch must be one of .* got 'sideways'"):
        HiSparseConfig.from_json('{"shared_prefetch": "sideways"}')
