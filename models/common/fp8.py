"""Block-FP8 weights, DeepSeek's published format: float8_e4m3fn values and one float32 scale per
block of the last two dimensions (128 x 128 in the released checkpoints), `w ~ values x
scale_inv` (the checkpoints name the scale `<name>.weight_scale_inv`).

Letters: R rows, C columns of a weight's last two dimensions (any leading dims, e.g. experts),
b0 x b1 the block.

The model keeps such weights in fp8 on the device (half the bytes of bf16: what lets a rank of
DeepSeek-V3.2 fit one H200) and multiplies through pallas_kernels.grouped_matmul, which
dequantises one tile at a time; dequantize() (the op's own) is the reference those kernels equal.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from hisparse_jax.row_layout import FP8_MAX
from pallas_kernels.grouped_matmul.base import FP8, dequantize, expand_scale, is_fp8  # noqa: F401  (this module's API too)

DEFAULT_BLOCK = (128, 128)


def quantize(weight: jax.Array, block: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """weight [..., R, C] -> (f8[..., R, C], scale_inv f32[..., R/b0, C/b1]): per block, absmax / 448
    (as DeepSeek quantises; an all-zero block gets scale 1)."""
    *lead, rows, cols = weight.shape
    b0, b1 = block
    nr, nc = math.ceil(rows / b0), math.ceil(cols / b1)
    w = jnp.pad(weight.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, nr * b0 - rows), (0, nc * b1 - cols)])
    tiles = w.reshape(*lead, nr, b0, nc, b1)
    absmax = jnp.max(jnp.abs(tiles), axis=(-3, -1))  # f32[..., nr, nc]
    scale = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
    values = (tiles / scale[..., :, None, :, None]).astype(FP8).reshape(*lead, nr * b0, nc * b1)
    return values[..., :rows, :cols], scale


def random_fp8(key: jax.Array, shape: tuple[int, ...], fan_in: int, block: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """N(0, 1/fan_in) weights quantised to block fp8 (random-weight models, on whatever device
    the key is: benchmarks build them on the GPU, no host copy). One compiled program per
    (shape, fan_in, block), shared by every layer of that shape."""
    return _random_fp8(key, tuple(shape), fan_in, tuple(block))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random_fp8(key: jax.Array, shape: tuple[int, ...], fan_in: int, block: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    return quantize(jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in), block)


def dequantize_params(params: dict, dtype) -> dict:
    """A block-FP8 model's params (nnx.to_pure_dict) -> those of the same model without
    weight_block_size: every fp8 weight dequantised to `dtype` (stacked experts back to their
    [E, in, out] layout), its `*_scale_inv` dropped. What loading with the model dtype's
    weights_dtype gives; tests compare an fp8 model with it."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = dequantize_params(value, dtype)
        elif isinstance(key, str) and key.endswith("_scale_inv"):
            continue
        elif value is not None and hasattr(value, "dtype") and is_fp8(value.dtype):
            scale = params[f"{key}_scale_inv"]
            w = dequantize(value, scale, dtype)
            out[key] = jnp.swapaxes(w, -1, -2) if w.ndim == 3 else w  # experts: [E, out, in] -> [E, in, out]
        else:
            out[key] = value
    return out
