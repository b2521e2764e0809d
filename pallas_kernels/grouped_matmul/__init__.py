"""Grouped (ragged) matmul for the MoE experts, bf16 or block-FP8 weights, and the fp8 dense matmul.

One folder per op: api.py (the public entry, `implementation=`), base.py (checks, block-scale
helpers), reference.py (jnp: jax.lax.ragged_dot over dequantised weights), pallas_triton.py (the
GPU weight-streaming kernel), tokamax_mosaic.py (tokamax's Mosaic GPU kernels, the fp8 route).
"""

from pallas_kernels.grouped_matmul.api import IMPLEMENTATIONS, fp8_matmul, grouped_matmul, resolve_implementation
from pallas_kernels.grouped_matmul.base import FP8, check_inputs, check_scale, dequantize, expand_scale, is_fp8, scale_block
from pallas_kernels.grouped_matmul.pallas_triton import TritonConfig, default_config, grouped_matmul_triton, w8a8_config
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference, matmul_reference
from pallas_kernels.grouped_matmul.tokamax_mosaic import MosaicConfig

__all__ = [
    "FP8", "IMPLEMENTATIONS", "MosaicConfig", "TritonConfig", "check_inputs", "check_scale", "default_config", "dequantize",
    "expand_scale", "fp8_matmul", "grouped_matmul", "grouped_matmul_reference", "grouped_matmul_triton", "is_fp8",
    "matmul_reference", "resolve_implementation", "scale_block", "w8a8_config",
]  # fmt: skip
