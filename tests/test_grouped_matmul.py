"""pallas_kernels.grouped_matmul: the Pallas kernel (interpret mode on the CPU) against the jnp
reference, bf16 and block-FP8 weights in both layouts, empty groups, a group larger than one
pass, tail rows zero, NaN-poisoned outputs fully written. tokamax's Mosaic route needs a GPU
(benchmarks/bench_step.py checks it there against the same reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.common.fp8 import quantize
from pallas_kernels import common
from pallas_kernels.grouped_matmul import TritonConfig, dequantize, fp8_matmul, grouped_matmul, grouped_matmul_triton

TOLERANCE = {jnp.dtype(jnp.bfloat16): (1e-2, 1e-2), jnp.dtype(jnp.float32): (1e-5, 1e-5)}  # (relative to max |ref|, floor)


def w8a8_tolerance():
    """The dtype whose tolerance a w8a8 kernel's f32 output meets against its reference: f32 in
    the interpreter; on a GPU each fp8 dot (one K step of <= 128) accumulates on the fp8 tensor
    cores (~14 significant bits on Hopper, pallas_kernels.common.FP8_TENSOR_CORE_DOTS), so bf16's."""
    return jnp.bfloat16 if common.fp8_dots_round_in_mma() else jnp.float32
G, K, N = 4, 256, 256
BLOCK = (128, 128)


def random_case(seed, sizes, *, M=None, fp8=False, transpose=False):
    """lhs bf16[M, K], rhs ([G, K, N] or [G, N, K]), its scale or None, group_sizes i32[G]."""
    sizes = np.asarray(sizes, np.int32)
    M = int(sizes.sum()) if M is None else M
    k1, k2 = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(k1, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k2, (len(sizes), N, K) if transpose else (len(sizes), K, N), jnp.float32) / np.sqrt(K)
    if fp8:
        values, scale = quantize(w, BLOCK)
        return lhs, values, scale, jnp.asarray(sizes)
    return lhs, w.astype(jnp.bfloat16), None, jnp.asarray(sizes)


def assert_close(out, ref, dtype):
    rel, floor = TOLERANCE[jnp.dtype(dtype)]
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape and np.all(np.isfinite(out))
    err = np.max(np.abs(out - ref)) if out.size else 0.0
    assert err <= max(rel * np.max(np.abs(ref)), floor), f"max abs err {err}, max |ref| {np.max(np.abs(ref))}"


SIZES = [[3, 0, 40, 5], [1, 1, 1, 1], [0, 0, 0, 0]]  # empty group and one over 32 rows; decode; nothing routed
CONFIGS = [
    TritonConfig(block_m=16, block_n=128, block_k=128, m_subtiles=2),
    TritonConfig(block_m=16, block_n=64, block_k=64, swap_ab=True, n_fastest=False),
    TritonConfig(block_m=16, block_n=128, block_k=128, split_k=2),
]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("config", CONFIGS, ids=["subtiles", "swap_ab", "split_k"])
def test_pallas_bf16_equals_reference(sizes, config):
    lhs, rhs, _, gs = random_case(0, sizes, M=sum(sizes) + 5)  # 5 tail rows must come out 0
    ref = grouped_matmul(lhs, rhs, gs, implementation="reference", preferred_element_type=jnp.float32)
    out = grouped_matmul(lhs, rhs, gs, implementation="pallas", config=config, preferred_element_type=jnp.float32)
    assert_close(out, ref, jnp.bfloat16)  # the reference rounds its bf16 operands' products in another order
    assert np.all(np.asarray(out)[sum(sizes):] == 0)


def fp8_kernel_and_reference(lhs, values, scale, gs, config, transpose, rows: int):
    """The kernel (interpret mode) into a NaN-poisoned output and the w8a16 reference -> (out
    f32[M, N], ref f32[M, N]); asserts the `rows` grouped rows were all written and the rest 0."""
    M = lhs.shape[0]
    poison = jnp.full((config.split_k, M, N) if config.split_k > 1 else (M, N), jnp.nan, jnp.float32)
    out = grouped_matmul_triton(
        lhs, values, scale, gs, out_dtype=jnp.float32, config=config, interpret=True, transpose_rhs=transpose, output_init=poison
    )  # fmt: skip
    ref = grouped_matmul(lhs, values, gs, rhs_scale=scale, transpose_rhs=transpose, implementation="reference",
                         preferred_element_type=jnp.float32)  # fmt: skip
    out = np.asarray(out)
    assert np.all(np.isfinite(out[:rows])), "a row of some group was not written"
    assert np.all(out[rows:] == 0)
    return out, ref


@pytest.mark.parametrize("transpose", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("config", CONFIGS, ids=["subtiles", "swap_ab", "split_k"])
def test_pallas_fp8_writes_every_row_and_equals_reference(transpose, config):
    """Output poisoned with NaN: every row of a group is written and equals the reference (which
    multiplies the same dequantised weights), rows past the groups are zero."""
    sizes = [3, 0, 40, 5]
    lhs, values, scale, gs = random_case(2, sizes, M=sum(sizes) + 6, fp8=True, transpose=transpose)
    out, ref = fp8_kernel_and_reference(lhs, values, scale, gs, config, transpose, sum(sizes))
    assert_close(out, ref, jnp.bfloat16)


@pytest.mark.parametrize(
    "transpose, config", [(False, CONFIGS[0]), (True, CONFIGS[2]), (True, CONFIGS[1])], ids=["kn_subtiles", "nk_split_k", "nk_swap_ab"]
)  # both layouts, both output paths (direct, f32 partials), the swapped dot (rows' scales across columns)
def test_pallas_w8a8_equals_reference_over_quantised_rows(transpose, config):
    """fp8_conversion "w8a8" (activations quantised per row and K block, the dot on fp8): every row
    written (NaN-poisoned output), equal to the reference over the same quantised activations
    (f32 accumulation order aside), within the activations' quantisation error of the w8a16
    reference, and each row's K blocks scaled by their own scales (one row's block scaled 2**6
    times the others)."""
    from pallas_kernels.grouped_matmul.pallas_triton import quantize_rows

    sizes = [3, 0, 40, 5]
    lhs, values, scale, gs = random_case(3, sizes, M=sum(sizes) + 6, fp8=True, transpose=transpose)
    lhs = lhs.at[1, : BLOCK[0]].multiply(64.0)  # row 1's first K block: its own scale
    M = lhs.shape[0]
    out, ref = fp8_kernel_and_reference(lhs, values, scale, gs, config.replace(fp8_conversion="w8a8"), transpose, sum(sizes))
    q, q_scale = quantize_rows(lhs, BLOCK[0])  # f8[M, K], f32[M, K / 128]
    lhs_q = (q.astype(jnp.float32).reshape(M, -1, BLOCK[0]) * q_scale[..., None]).reshape(M, K)  # f32[M, K]
    ref_q = grouped_matmul(lhs_q, values, gs, rhs_scale=scale, transpose_rhs=transpose, implementation="reference",
                           preferred_element_type=jnp.float32)  # fmt: skip
    assert_close(out, ref_q, w8a8_tolerance())
    rel = np.max(np.abs(out - np.asarray(ref))) / np.max(np.abs(np.asarray(ref)))
    assert 1e-4 < rel < 0.05, rel  # e4m3 activations: a few percent at most, and not the w8a16 numbers


def test_each_block_scale_lands_on_its_block():
    lhs, values, scale, gs = random_case(3, [5, 9, 0, 2], fp8=True, transpose=True)
    scale = scale * 2.0 ** (jnp.arange(scale.size, dtype=jnp.float32).reshape(scale.shape) % 11)
    ref = grouped_matmul(lhs, values, gs, rhs_scale=scale, transpose_rhs=True, implementation="reference", preferred_element_type=jnp.float32)
    for bn in (64, 128, 256):
        cfg = TritonConfig(block_n=bn, block_k=64)
        out = grouped_matmul(lhs, values, gs, rhs_scale=scale, transpose_rhs=True, implementation="pallas", config=cfg,
                             preferred_element_type=jnp.float32)  # fmt: skip
        assert_close(out, ref, jnp.bfloat16)


def test_reference_fp8_is_the_dequantised_weights_product():
    """An fp8 model computes what the same model with its weights dequantised at load computes."""
    lhs, values, scale, gs = random_case(4, [2, 3, 0, 1], fp8=True)
    dense = dequantize(values, scale, jnp.bfloat16)
    np.testing.assert_array_equal(
        grouped_matmul(lhs, values, gs, rhs_scale=scale, implementation="reference"),
        jax.lax.ragged_dot(lhs, dense, gs, precision=jax.lax.Precision.HIGHEST),
    )


@pytest.mark.parametrize("M", [1, 20])
def test_fp8_matmul(M):
    x = jax.random.normal(jax.random.key(8), (M, K), jnp.float32).astype(jnp.bfloat16)
    w, w_scale = quantize(jax.random.normal(jax.random.key(9), (N, K), jnp.float32) / 16, BLOCK)  # [out, in]
    ref = fp8_matmul(x, w, w_scale, implementation="reference")
    np.testing.assert_array_equal(ref, jnp.einsum("mk,nk->mn", x, dequantize(w, w_scale, x.dtype), precision=jax.lax.Precision.HIGHEST))
    out = fp8_matmul(x, w, w_scale, implementation="pallas", config=TritonConfig(block_m=16, block_n=128, block_k=128))
    assert_close(out, ref, jnp.bfloat16)


def test_bad_inputs_are_refused():
    lhs, rhs, _, gs = random_case(10, [1, 2, 0, 1])
    with pytest.raises(ValueError, match="block_n"):
        grouped_matmul(lhs, rhs, gs, implementation="pallas", config=TritonConfig(block_n=512))
    with pytest.raises(ValueError, match="group_sizes G"):
        grouped_matmul(lhs, rhs, gs[:3])
    with pytest.raises(ValueError, match="needs rhs_scale"):
        grouped_matmul(lhs, quantize(rhs.astype(jnp.float32), BLOCK)[0], gs)
    with pytest.raises(ValueError, match="implementation"):
        grouped_matmul(lhs, rhs, gs, implementation="cuda")
    with pytest.raises(ValueError, match="power of two"):
        TritonConfig(block_m=24)


# ---- fp8_activations (w8a8): the api, its configs, a model ----------------------------------------


def test_fp8_activations_pallas_equals_its_reference_and_refuses_what_it_cannot_run():
    """grouped_matmul / fp8_matmul with fp8_activations: the kernel (w8a8_config, interpret mode)
    equals the reference over the same rounded activations; not the w8a16 numbers; tokamax and
    bf16 weights are refused by name."""
    sizes = [3, 0, 40, 5]
    lhs, values, scale, gs = random_case(5, sizes, M=sum(sizes) + 2, fp8=True, transpose=True)
    ref = grouped_matmul(lhs, values, gs, rhs_scale=scale, transpose_rhs=True, implementation="reference",
                         preferred_element_type=jnp.float32, fp8_activations=True)  # fmt: skip
    out = grouped_matmul(lhs, values, gs, rhs_scale=scale, transpose_rhs=True, implementation="pallas",
                         preferred_element_type=jnp.float32, fp8_activations=True)  # fmt: skip
    assert_close(out, ref, w8a8_tolerance())
    assert np.all(np.asarray(out)[sum(sizes):] == 0)
    w8a16 = grouped_matmul(lhs, values, gs, rhs_scale=scale, transpose_rhs=True, implementation="reference", preferred_element_type=jnp.float32)
    rel = np.max(np.abs(np.asarray(ref) - np.asarray(w8a16))) / np.max(np.abs(np.asarray(w8a16)))
    assert 1e-4 < rel < 0.05, rel
    dense_ref = fp8_matmul(lhs, values[2], scale[2], implementation="reference", fp8_activations=True)
    dense = fp8_matmul(lhs, values[2], scale[2], implementation="pallas", fp8_activations=True)
    assert_close(dense, dense_ref, jnp.bfloat16)
    with pytest.raises(ValueError, match="tokamax"):
        grouped_matmul(lhs, values, gs, rhs_scale=scale, transpose_rhs=True, implementation="tokamax", fp8_activations=True)
    bf16_lhs, bf16_rhs, _, bf16_gs = random_case(5, sizes)
    with pytest.raises(ValueError, match="fp8_activations needs fp8 weights"):
        grouped_matmul(bf16_lhs, bf16_rhs, bf16_gs, fp8_activations=True)


@pytest.mark.parametrize("tokens, expected", [(8, dict(swap_ab=False, m_subtiles=1, block_m=16)),
                                              (88, dict(swap_ab=True, block_m=32, m_subtiles=1)),
                                              (256, dict(swap_ab=False, block_m=64, m_subtiles=1))])  # fmt: skip
def test_w8a8_config_follows_the_measured_tilings(tokens, expected):
    """DeepSeek-V3.2's EP8 rank (32 experts, top-8): the tiling of each rows-per-expert range."""
    from pallas_kernels.grouped_matmul import w8a8_config

    cfg = w8a8_config(8 * tokens, 32, 7168, 4096)
    assert cfg.fp8_conversion == "w8a8"
    assert {k: getattr(cfg, k) for k in expected} == expected


def test_a_model_with_fp8_activations_runs_w8a8_everywhere():
    """The tiny DeepSeek model with block-FP8 weights: fp8_activations changes its logits by the
    activations' rounding (a few percent, not zero), and its Pallas matmuls (interpret mode) equal
    the reference's over the same rounding."""
    from flax import nnx

    from configs.model import DSAModelConfig
    from models.common.layers import matmul_implementation
    from models.dsa.model import DSAForCausalLM, forward

    base = DSAModelConfig.tiny().replace(weight_block_size=(16, 16))
    with pytest.raises(ValueError, match="fp8_activations needs block-FP8"):
        DSAModelConfig.tiny().replace(fp8_activations=True)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, base.vocab_size, (1, 12)), jnp.int32)

    def logits(config, implementation):
        model = DSAForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))  # same seed: the same weights
        with matmul_implementation(implementation):
            return np.asarray(forward(model, tokens)[0], np.float32)

    w8a16 = logits(base, "reference")
    w8a8 = logits(base.replace(fp8_activations=True), "reference")
    w8a8_pallas = logits(base.replace(fp8_activations=True), "pallas")
    scale = np.abs(w8a16).max()
    assert 1e-4 < np.abs(w8a8 - w8a16).max() / scale < 0.1
    assert np.abs(w8a8_pallas - w8a8).max() / scale < (1e-4 if w8a8_tolerance() == jnp.float32 else 1e-2)
