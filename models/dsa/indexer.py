"""The DSA lightning indexer: scores every earlier position, keeps the top-k.

Letters: T query tokens, S key positions, D hidden, Q q_lora_rank, G indexer heads,
I index_head_dim, P rotated dims (qk_rope_head_dim, the first P of I), K top-k entries.

score[t, s] = sum_g w[t, g] * relu(q[t, g] . k[s] / sqrt(I)),  w = weights_proj(x) / sqrt(G),
as transformers' DeepseekV32Indexer computes it (the checkpoint's Hadamard rotation and FP8
scoring are accuracy-neutral kernels there and here).

The key cache holds keys in the model dtype, or (--kv_cache_dtype=fp8_e4m3, as SGLang stores
them) each key as I fp8_e4m3 values plus one float32 scale: quantize_keys / dequantize_keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.model import DSAModelConfig
from models.common import rope
from models.common.layers import LayerNorm, Linear
from pallas_kernels import common, indexer_scores, topk


class Indexer(nnx.Module):
    """Weights of one layer's indexer; keys and queries come out, the cache stays outside."""

    def __init__(self, config: DSAModelConfig, *, dtype, rngs: nnx.Rngs):
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.interleaved = config.indexer_rope_interleave
        fp8_linear = functools.partial(
            Linear, dtype=dtype, rngs=rngs, block=config.weight_block_size, fp8_activations=config.fp8_activations
        )
        self.wq_b = fp8_linear(config.q_lora_rank, self.num_heads * self.head_dim)  # [G*I, Q]
        self.wk = fp8_linear(config.hidden_size, self.head_dim)  # [I, D]
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)  # eps fixed in the reference
        # transformers keeps weights_proj in float32 whatever the model dtype.
        self.weights_proj = Linear(config.hidden_size, self.num_heads, dtype=jnp.float32, rngs=rngs)  # [G, D]
        self.fp8_queries = config.fp8_activations  # w8a8: fp8 queries over fp8 keys (queries())

    def _rotate(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        # x: [..., I]; the first P dims are rotated, the rest pass through
        apply = rope.apply_interleaved if self.interleaved else rope.apply_half_split
        return jnp.concatenate([apply(x[..., : self.rope_dim], cos, sin), x[..., self.rope_dim :]], axis=-1)

    def keys(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [T, D] (normed hidden), cos/sin f32[T, P/2] -> keys [T, I] (what the key cache holds)."""
        return self._rotate(self.k_norm(self.wk(x)), cos, sin)

    def queries(
        self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array, key_dtype=None
    ) -> tuple[jax.Array, jax.Array]:
        """x [T, D], q_resid [T, Q] (MLA's normed query LoRA) -> (q [T, G, I], head weights f32[T, G]).

        key_dtype: the key cache's element type. With w8a8 (config.fp8_activations) and fp8 keys
        the queries come back quantised (quantize_queries), for an fp8 x fp8 q . k."""
        q = self.wq_b(q_resid).reshape(*q_resid.shape[:-1], self.num_heads, self.head_dim)  # [T, G, I]
        q = self._rotate(q, cos[..., None, :], sin[..., None, :])
        weights = self.weights_proj(x).astype(jnp.float32) * self.num_heads**-0.5  # f32[T, G]
        if self.fp8_queries and key_dtype is not None and is_fp8(key_dtype):
            return quantize_queries(q, weights)
        return q, weights


# ---- the key cache's formats ------------------------------------------------------------------

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_e4m3")  # SGLang's --kv-cache-dtype names (+ float32)
FP8_KEY_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_NAMED_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "fp8_e4m3": FP8_KEY_DTYPE}


def index_key_dtype(kv_cache_dtype: str, model_dtype) -> np.dtype:
    """The element type the indexer key cache holds for a kv_cache_dtype: "auto" is the model
    dtype; "fp8_e4m3" is float8_e4m3fn (with one float32 scale per key, quantize_keys)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of {KV_CACHE_DTYPES}")
    return np.dtype(model_dtype if kv_cache_dtype == "auto" else _NAMED_DTYPES[kv_cache_dtype])


def is_fp8(dtype) -> bool:
    """Whether keys of `dtype` are the fp8 format (values + a per-key scale)."""
    return np.dtype(dtype) == np.dtype(FP8_KEY_DTYPE)


def index_key_bytes(index_head_dim: int, key_dtype) -> int:
    """Device bytes of one cached key of one layer: I values, + a float32 scale with fp8."""
    return index_head_dim * np.dtype(key_dtype).itemsize + (4 if is_fp8(key_dtype) else 0)


def quantize_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """keys [..., I] (any float dtype) -> (f8e4m3[..., I], f32[...]): each key vector scaled by
    its own scale = amax / 448 (amax: its largest |value|, in float32) so it spans fp8_e4m3's
    range, as SGLang stores DSA indexer keys. An all-zero key gets the smallest normal float32
    as its scale (not 0: no division by zero) and stays all zero. Round to nearest: each value
    is within 2^-4 of itself (8 mantissa steps per octave), plus 2^-10 x scale near zero."""
    keys = keys.astype(jnp.float32)
    amax = jnp.max(jnp.abs(keys), axis=-1)
    scales = jnp.maximum(amax / FP8_MAX, jnp.finfo(jnp.float32).tiny)  # f32[...]
    scaled = jnp.clip(keys / scales[..., None], -FP8_MAX, FP8_MAX)  # division round-off past 448 stays finite
    return scaled.astype(FP8_KEY_DTYPE), scales


def dequantize_keys(keys: jax.Array, scales: jax.Array) -> jax.Array:
    """quantize_keys' inverse up to its rounding: f8e4m3[..., I], f32[...] -> f32[..., I]."""
    return keys.astype(jnp.float32) * scales[..., None]


def quantize_queries(q: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q [T, G, I], weights f32[T, G] -> (f8e4m3[T, G, I], f32[T, G]): each head's query
    quantised as quantize_keys quantises a key (DeepSeek's act_quant over one 128-wide block),
    its scale folded into the head's weight. The score is unchanged up to q's rounding: a
    positive scale commutes with the relu, w x relu(s x q8 . k) = (w x s) x relu(q8 . k)."""
    q8, scales = quantize_keys(q)  # f8e4m3[T, G, I], f32[T, G]
    return q8, weights * scales


# ---- scoring ------------------------------------------------------------------------------------


def index_scores(q: jax.Array, weights: jax.Array, keys: jax.Array, key_scales: jax.Array | None = None) -> jax.Array:
    """q [T, G, I], weights f32[T, G], keys [S, I] -> f32[T, S].

    fp8 keys come with key_scales f32[S] (quantize_keys): score = scale_s x (q . k8_s), exact
    since the scale is per key (a positive scale commutes with the relu, so it is applied after
    the head sum, on [T, S] rather than [T, G, S])."""
    # The formula lives beside its kernel (pallas_kernels/indexer_scores/; pallas_kernels may
    # not import models/). q . k runs with its operands in their stored dtype (bf16 in a bf16
    # model; fp8 keys cast to q's dtype, which is exact) accumulating in f32. Measured on the
    # H200: casting both to f32 first made XLA convert them and run an f32 GEMM on the CUDA
    # cores, ~58 us per request per decode step, half of a request's per-step cost; bf16 x bf16
    # -> f32 runs on the tensor cores. This function alone (64 heads x 128, 32k keys, vmapped
    # over requests): 39.7 -> 13.4 us per request at 16 requests, 29.1 -> 10.5 at 64 (fp8 keys:
    # 13.6, 8.6), scores within 3e-7. f32 models keep f32 operands at HIGHEST precision (TF32
    # would flip top-k choices).
    return indexer_scores.score_keys(q, weights, keys, key_scales)


def select_topk(scores: jax.Array, allowed: jax.Array, k: int) -> jax.Array:
    """scores f32[T, S], allowed bool[T, S] -> i32[T, K]: best allowed positions, -1 padded.

    Fewer than k allowed positions (a short context) leave the tail -1; the reference picks
    arbitrary masked positions there, which its mask then ignores. Ties (-0.0 and +0.0 too)
    go to the lower position, on every platform (pallas_kernels/topk/).
    """
    return topk.topk_reference(jnp.where(allowed, scores, -jnp.inf), k)


# decode_topk's default: the scoring kernel counts the top-k's histograms (one pass over the
# scores fewer, one kernel fewer a layer). Off until timed on the GPU: the scoring kernel then
# runs programs of >= 2048 keys and a small dot per key block
# (benchmarks/probes/indexer_fp8_tiling.py --fused; benchmarks/per_request_cost_h200.sh).
FUSED_TOPK_HISTOGRAM = False


def decode_topk(
    q: jax.Array,
    weights: jax.Array,
    index_keys: jax.Array,
    key_scales: jax.Array,
    j,
    positions: jax.Array,
    k: int,
    *,
    implementation: str | None = None,
    fused_histogram: bool | None = None,
) -> jax.Array:
    """One decode step's indexer selection for the first b request slots -> i32[b, K].

    q [b, G, I], weights f32[b, G] (Indexer.queries); index_keys [J, R, C, I] and key_scales
    f32[J, R, C] (fp8 keys) or f32[J, R, 0]: the whole key cache, read in place; j: int or i32[]
    (indexer layer); positions i32[b]: slot i sees keys 0..positions[i], -1 = inactive (all -1
    out). Equals select_topk(index_scores(...), allowed, k) per request.

    implementation: "pallas" runs the fused scoring kernel and the top-k kernel
    (pallas_kernels/indexer_scores/, topk.py); "reference" is the XLA path (einsum, lax.top_k);
    None picks "pallas" on GPU, "reference" elsewhere. "tpu" (the attention's TPU kernels) has no
    indexer kernel and runs the XLA path here.

    fused_histogram (with "pallas"): the scoring kernel also counts the radix top-k's slice
    histograms as it writes the scores, and the top-k skips its histogram pass (the same
    selection). None: FUSED_TOPK_HISTOGRAM, for batches whose scoring then still fills the GPU
    (indexer_scores.histogram_fills_the_gpu).
    """
    if implementation == "tpu":
        implementation = "reference"  # no TPU indexer kernel: XLA's path on TPU
    b, C = q.shape[0], index_keys.shape[2]
    if fused_histogram is None:
        fused_histogram = FUSED_TOPK_HISTOGRAM and indexer_scores.histogram_fills_the_gpu(b, C)
    if fused_histogram and common.resolve_gpu_implementation(implementation, "the indexer") == "pallas":
        scores, hist = indexer_scores.index_scores_masked(
            q, weights, index_keys, key_scales, j, positions, implementation="pallas", histogram=True
        )  # f32[b, C], i32[b, S, 256]
        span = indexer_scores.histogram_span(b, C, is_fp8(index_keys.dtype))
        return topk.topk_indices(scores, k, implementation="pallas", method="radix", hist=hist, slice_len=span)
    scores = indexer_scores.index_scores_masked(
        q, weights, index_keys, key_scales, j, positions, implementation=implementation
    )  # f32[b, C], -inf past each position
    return topk.topk_indices(scores, k, implementation=implementation)
