"""Exact top-k over masked indexer scores (lax.top_k's choice and order).

One folder per op: api.py (the public entry, `implementation=` "reference" | "pallas" | "tpu"),
base.py (types, constants, input checks), reference.py (the jnp reference the tests compare
against), pallas_triton.py (the GPU kernel), pallas_tpu.py (the TPU kernel, imported only when
asked for). Files here: api.py, reference.py, pallas_triton.py.
"""

from pallas_kernels.topk.api import topk_indices
from pallas_kernels.topk.reference import topk_reference
from pallas_kernels.topk.pallas_triton import DIGITS, INVALID, METHODS, ORDERS, default_method, topk_indices_pallas

__all__ = ['DIGITS', 'INVALID', 'METHODS', 'ORDERS', 'default_method', 'topk_indices', 'topk_indices_pallas', 'topk_reference']
