"""Sparse MLA decode attention over the K selected rows of each request (bf16 or fp8 rows).

One folder per op: api.py (the public entry, `implementation=` "reference" | "pallas" | "tpu"),
base.py (types, constants, input checks), reference.py (the jnp reference the tests compare
against), pallas_triton.py (the GPU kernel), pallas_tpu.py (the TPU kernel, imported only when
asked for). Files here: api.py, base.py, reference.py, pallas_triton.py, pallas_tpu.py.
"""

from pallas_kernels.sparse_mla_attention.api import sparse_mla_attention, sparse_mla_attention_reading_host
from pallas_kernels.sparse_mla_attention.base import MASKED, check_inputs, is_quantized
from pallas_kernels.sparse_mla_attention.reference import sparse_mla_attention_reference
from pallas_kernels.sparse_mla_attention.pallas_triton import FP8_LAUNCH, MAX_SPLITS, TARGET_PROGRAMS, combine_splits, default_launch_shape, default_num_splits, sparse_mla_attention_pallas

__all__ = ['FP8_LAUNCH', 'MASKED', 'MAX_SPLITS', 'TARGET_PROGRAMS', 'check_inputs', 'combine_splits', 'default_launch_shape', 'default_num_splits', 'is_quantized', 'sparse_mla_attention', 'sparse_mla_attention_reading_host', 'sparse_mla_attention_pallas', 'sparse_mla_attention_reference']
