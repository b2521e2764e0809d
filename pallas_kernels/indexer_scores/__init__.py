"""DSA indexer scores over a request's cached keys, masked past its position.

One folder per op: api.py (the public entry, `implementation=` "reference" | "pallas" | "tpu"),
base.py (types, constants, input checks), reference.py (the jnp reference the tests compare
against), pallas_triton.py (the GPU kernel), pallas_tpu.py (the TPU kernel, imported only when
asked for). Files here: api.py, base.py, reference.py, pallas_triton.py.
"""

from pallas_kernels.indexer_scores.api import index_scores_masked
from pallas_kernels.indexer_scores.base import FP8_KEY_DTYPE, MASKED, check_inputs, is_fp8, operand_dtype
from pallas_kernels.indexer_scores.reference import index_scores_masked_reference, score_keys
from pallas_kernels.indexer_scores.pallas_triton import HISTOGRAM_SPAN, default_blocking, histogram_blocking, histogram_fills_the_gpu, histogram_span, index_scores_masked_pallas

__all__ = ['FP8_KEY_DTYPE', 'HISTOGRAM_SPAN', 'MASKED', 'check_inputs', 'default_blocking', 'histogram_blocking', 'histogram_fills_the_gpu', 'histogram_span', 'index_scores_masked',
           'index_scores_masked_pallas', 'index_scores_masked_reference', 'is_fp8', 'operand_dtype', 'score_keys']
