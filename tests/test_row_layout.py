"""KVRowLayout: the plain layouts and FlashMLA's fp8 row (656 B for 512 + 64), pack / unpack.

fp8 rows are uint32 words: D/4 words of fp8_e4m3 latent bytes, D/G f32 scales, rope/2 words of
bf16 pairs, little-endian, so the row's bytes are FlashMLA's: 512 fp8, 4 x f32, 64 x bf16.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hisparse_jax.row_layout import FP8_MAX, KVRowLayout

FP8 = "fp8_e4m3"


def random_values(rng, shape, latent_dim):
    """f32 values whose latent groups span many magnitudes (a scale per row, one zero group)."""
    values = rng.standard_normal(shape).astype(np.float32)
    values[..., :latent_dim] *= np.exp(rng.uniform(-12, 12, shape[:-1] + (1,))).astype(np.float32)
    return values


@pytest.mark.parametrize(
    "latent, rope, kind, width, dtype, row_bytes",
    [
        (512, 64, "bfloat16", 576, np.dtype(jnp.bfloat16), 1152),
        (512, 64, "float32", 576, np.float32, 2304),
        (512, 64, FP8, 164, np.uint32, 656),  # 128 words fp8 + 4 scales + 32 words of bf16 pairs
        (32, 16, FP8, 17, np.uint32, 68),  # tiny: one group of 32
        (256, 64, FP8, 98, np.uint32, 392),
    ],
)
def test_widths_and_bytes(latent, rope, kind, width, dtype, row_bytes):
    layout = KVRowLayout(latent, rope, kind)
    assert (layout.width, layout.dtype, layout.bytes_per_row) == (width, np.dtype(dtype), row_bytes)
    assert layout.logical_width == latent + rope
    assert layout.quantized == (kind == FP8)


def test_for_kv_cache_dtype():
    make = KVRowLayout.for_kv_cache_dtype
    assert make(512, 64, jnp.bfloat16, "auto") == KVRowLayout(512, 64, "bfloat16")
    assert make(512, 64, jnp.float32, "auto") == KVRowLayout(512, 64, "float32")
    assert make(512, 64, jnp.float32, "bfloat16") == KVRowLayout(512, 64, "bfloat16")
    assert make(512, 64, jnp.bfloat16, "float32") == KVRowLayout(512, 64, "float32")
    assert make(512, 64, jnp.bfloat16, FP8) == KVRowLayout(512, 64, FP8)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        make(512, 64, jnp.bfloat16, "fp8_e5m2")


@pytest.mark.parametrize(
    "latent, rope, message",
    [
        (200, 64, "latent_dim a multiple of 128"),
        (30, 16, "latent_dim a multiple of 128"),
        (32, 15, "rope_dim must be even"),
    ],
)
def test_fp8_refuses_unsupported_dims(latent, rope, message):
    with pytest.raises(ValueError, match=message):
        KVRowLayout(latent, rope, FP8)


@pytest.mark.parametrize("latent, rope", [(512, 64), (32, 16), (32, 8)])
@pytest.mark.parametrize("jit", [False, True])
def test_fp8_round_trip(latent, rope, jit):
    layout = KVRowLayout(latent, rope, FP8)
    rng = np.random.default_rng(latent + rope)
    values = random_values(rng, (64, latent + rope), latent)
    values[3, : layout.group_size] = 0.0  # an all-zero group
    pack = jax.jit(layout.pack) if jit else layout.pack
    unpack = jax.jit(layout.unpack) if jit else layout.unpack
    rows = pack(jnp.asarray(values[:, :latent]), jnp.asarray(values[:, latent:]))
    assert rows.shape == (64, layout.width) and rows.dtype == jnp.uint32
    got_latent, got_rope = map(np.asarray, unpack(rows))
    assert got_latent.dtype == got_rope.dtype == np.float32
    # Rope: bf16, exactly.
    np.testing.assert_array_equal(got_rope, values[:, latent:].astype(ml_dtypes.bfloat16).astype(np.float32))
    # Latent: within fp8_e4m3's rounding of each group (3 mantissa bits: half a step is 1/16 of
    # the value; subnormals: half of 2^-9 of the scale), relative to the group's amax.
    groups = values[:, :latent].reshape(64, -1, layout.group_size)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    error = np.abs(got_latent.reshape(groups.shape) - groups)
    bound = np.abs(groups) * 2.0**-4 + amax / FP8_MAX * 2.0**-10 + amax * 1e-6
    assert np.all(error <= bound), float(np.max(error / np.maximum(bound, 1e-30)))
    assert np.all(got_latent[3, : layout.group_size] == 0.0)
    # Each group's largest value is fp8's largest, 448, times the stored scale.
    scales = np.asarray(rows)[:, layout.scale_offset : layout.rope_offset].view(np.float32)
    np.testing.assert_array_equal(np.abs(got_latent.reshape(groups.shape)).max(axis=-1), scales * FP8_MAX)
    # Re-packing the unpacked row gives the stored bits back.
    np.testing.assert_array_equal(np.asarray(pack(jnp.asarray(got_latent), jnp.asarray(got_rope))), np.asarray(rows))


def test_fp8_scale_is_amax_over_448():
    layout = KVRowLayout(512, 64, FP8)
    values = random_values(np.random.default_rng(1), (256, 576), 512)
    rows = np.asarray(layout.pack(jnp.asarray(values[:, :512]), jnp.asarray(values[:, 512:])))
    scales = rows[:, 128:132].view(np.float32).astype(np.float64)
    amax = np.abs(values[:, :512].reshape(256, 4, 128)).max(axis=-1).astype(np.float64)
    ratio = scales * FP8_MAX / amax
    assert np.all((ratio > 1 - 2.0**-22) & (ratio < 1 + 2.0**-20)), (ratio.min(), ratio.max())
    assert np.all(rows[:, 128:132] & 0b111 == 0)  # 21 significant bits: 448 x scale is exact


def test_fp8_bytes_are_flashmla_layout():
    """The row's bytes, little-endian: 512 fp8 latent values, 4 f32 scales, 64 bf16 rope values."""
    layout = KVRowLayout(512, 64, FP8)
    values = random_values(np.random.default_rng(2), (5, 576), 512)
    rows = np.asarray(layout.pack(jnp.asarray(values[:, :512]), jnp.asarray(values[:, 512:])))
    raw = rows.astype("<u4").view(np.uint8)  # [5, 656]
    assert raw.shape == (5, 656)
    scales = raw[:, 512:528].copy().view("<f4")  # [5, 4]
    expected_q = (values[:, :512].reshape(5, 4, 128) / scales[..., None]).reshape(5, 512).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(raw[:, :512], expected_q.view(np.uint8))
    rope = raw[:, 528:].copy().view("<u2").view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(rope, values[:, 512:].astype(ml_dtypes.bfloat16))


def test_fp8_zero_rows():
    layout = KVRowLayout(512, 64, FP8)
    rows = layout.pack(jnp.zeros((3, 512)), jnp.zeros((3, 64)))
    np.testing.assert_array_equal(np.asarray(rows), 0)
    latent, rope = layout.unpack(rows)
    np.testing.assert_array_equal(np.asarray(latent), 0.0)
    np.testing.assert_array_equal(np.asarray(rope), 0.0)


def test_fp8_fill_elements_decode_as_the_fill():
    layout = KVRowLayout(32, 16, FP8)
    nan_rows = jnp.full((2, layout.width), layout.fill_element(float("nan")), layout.dtype)
    assert all(np.all(np.isnan(np.asarray(part))) for part in layout.unpack(nan_rows))
    zero_rows = jnp.full((2, layout.width), layout.fill_element(0.0), layout.dtype)
    assert all(np.all(np.asarray(part) == 0) for part in layout.unpack(zero_rows))
    with pytest.raises(ValueError, match="filled with 0 or NaN only"):
        layout.fill_element(1.0)
    assert KVRowLayout(32, 16, "bfloat16").fill_element(1.5) == 1.5


def test_to_stored_packs_values_and_keeps_stored_rows():
    layout = KVRowLayout(32, 16, FP8)
    values = jnp.asarray(random_values(np.random.default_rng(3), (4, 48), 32))
    stored = layout.to_stored(values)
    np.testing.assert_array_equal(np.asarray(stored), np.asarray(layout.pack(values[:, :32], values[:, 32:])))
    assert layout.to_stored(stored) is stored
    with pytest.raises(ValueError, match=r"rows \(float32, width 17\) must be stored rows \(uint32, width 17\) or row values"):
        layout.to_stored(values[:, :17])
    with pytest.raises(ValueError, match=r"rows \(int32, width 48\)"):
        layout.to_stored(jnp.zeros((4, 48), jnp.int32))
    plain = KVRowLayout(32, 16, "bfloat16")
    assert plain.to_stored(values).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"rows width \(47\) must equal the state's row width \(48\)"):
        plain.to_stored(values[:, :47])


def test_plain_pack_unpack_unchanged():
    layout = KVRowLayout(32, 16, "float32")
    values = random_values(np.random.default_rng(4), (4, 48), 32)
    rows = layout.pack(jnp.asarray(values[:, :32]), jnp.asarray(values[:, 32:]))
    np.testing.assert_array_equal(np.asarray(rows), values)
    latent, rope = layout.unpack(rows)
    np.testing.assert_array_equal(np.asarray(latent), values[:, :32])
    np.testing.assert_array_equal(np.asarray(rope), values[:, 32:])
