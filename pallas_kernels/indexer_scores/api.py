"""DSA indexer scores of a batch of decoding requests over the key cache, masked to each context.

For request i of the batch (slot i of the cache) and key position c of layer `layer`:
    score[i, c] = sum_g w[i, g] * relu(q[i, g] . k[c] * I**-0.5)   (x the key's scale, fp8 keys)
where c <= positions[i], and -inf elsewhere (positions[i] = -1: an inactive slot, all -inf).
This is models/dsa/indexer.py's formula (score_keys below is its body; models/ cannot be imported
from here, so the model calls this module).

fp8 keys (float8_e4m3fn) carry one f32 scale per key: the dot runs on the fp8 values cast to the
query's dtype (exact) and the scale multiplies the head sum, as a positive scale commutes with
the relu.

The kernel (grid: requests x runs of key blocks) reads the whole key cache [J, R, C, I] in
place, a few blocks of one request's keys per program: q [G, I] . keys [block, I]^T (fp8 keys:
keys . q^T, the keys-major form) on the tensor cores (bf16 operands, f32 accumulation; f32 at
full precision for f32 models), relu, head-weight sum and mask in registers, one f32 per key
written. No [b, G, C] intermediate reaches memory, and keys past a request's position are never
read (masked loads), so stale or NaN rows there cannot leak into a score.

Shape letters: b requests in the batch (the first b slots of the cache), G indexer heads,
I index_head_dim, J indexer layers, R request slots, C key positions per slot.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.indexer_scores.base import check_inputs
from pallas_kernels.indexer_scores.pallas_triton import index_scores_masked_pallas
from pallas_kernels.indexer_scores.reference import index_scores_masked_reference


def index_scores_masked(q, weights, index_keys, key_scales, layer, positions, *, implementation=None, **tuning):
    """Indexer scores of b decoding requests over their slots' cached keys, -inf past each position.

    q [b, G, I] (bf16 or f32); weights f32[b, G]; index_keys [J, R, C, I] (the whole key cache:
    bf16 / f32, or float8_e4m3fn); key_scales f32[J, R, C] for fp8 keys, f32[J, R, 0] otherwise;
    layer: int or i32[] (which of J); positions i32[b]: request i (slot i, b <= R) sees keys
    0..positions[i], -1 none -> f32[b, C]. Raises ValueError on inconsistent static shapes.
    """
    check_inputs(q, weights, index_keys, key_scales, layer, positions)
    if common.resolve_gpu_implementation(implementation, "the indexer") == "pallas":
        return index_scores_masked_pallas(q, weights, index_keys, key_scales, jnp.asarray(layer, jnp.int32), positions, **tuning)
    return index_scores_masked_reference(q, weights, index_keys, key_scales, layer, positions)
