"""Small weight-holding building blocks shared by the DSA modules.

Letters: T tokens (any leading shape), I input features, O output features, F MLP intermediate.

Weights keep Hugging Face's layout ([out, in] for linear layers, block-FP8 ones with their
weight_scale_inv: models.common.fp8) so a checkpoint tensor becomes a parameter without a transpose. Every matmul runs at Precision.HIGHEST: in float32 on a GPU the
default would use TF32 and flip the indexer's and router's discrete choices. Results come out in
the operands' dtype (bf16 in a bf16 model, as torch's bf16 matmuls do); where the reference works
in float32 (router, indexer scores, softmax) the operands are cast to float32 first.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.common import fp8
from pallas_kernels.grouped_matmul import fp8_matmul

HIGHEST = jax.lax.Precision.HIGHEST
einsum = functools.partial(jnp.einsum, precision=HIGHEST)

# The grouped / fp8 matmul implementation the layers trace with (pallas_kernels.grouped_matmul's
# `implementation=`; None: the best for the backend). Over a mesh the runners set "reference":
# XLA partitions jax.lax.ragged_dot over sharded weights, a Pallas call would gather them whole.
_MATMUL_IMPLEMENTATION: contextvars.ContextVar[str | None] = contextvars.ContextVar("matmul_implementation", default=None)


@contextlib.contextmanager
def matmul_implementation(implementation: str | None):
    """Traces the layers inside with this grouped / fp8 matmul implementation."""
    token = _MATMUL_IMPLEMENTATION.set(implementation)
    try:
        yield
    finally:
        _MATMUL_IMPLEMENTATION.reset(token)


def current_matmul_implementation() -> str | None:
    return _MATMUL_IMPLEMENTATION.get()


def fan_in_normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, fan_in: int) -> nnx.Param:
    """N(0, 1/fan_in): keeps activations O(1) in randomly initialised test models."""
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) / jnp.sqrt(fan_in).astype(dtype))


class Linear(nnx.Module):
    """y = x W^T, no bias (no released DSA model has one).

    block None: weight [O, I] in `dtype`. block (b0, b1): block FP8, as DeepSeek's FP8 checkpoints
    hold it: weight f8[O, I] and weight_scale_inv f32[O/b0, I/b1], multiplied by
    pallas_kernels.grouped_matmul's fp8 matmul, whose result equals the dequantised weight's
    (models.common.fp8.dequantize, cast to `dtype`).
    """

    def __init__(
        self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, block: tuple[int, int] | None = None,
        fp8_activations: bool = False,
    ):  # fmt: skip
        self.dtype = dtype  # the activations' and results' dtype (fp8 weights are dequantised to it)
        self.fp8_activations = fp8_activations  # block FP8 only: w8a8 (DSAModelConfig.fp8_activations)
        if block is None:
            self.weight = fan_in_normal(rngs, (out_features, in_features), dtype, in_features)  # [O, I]
            self.weight_scale_inv = None
            return
        values, scale = fp8.random_fp8(rngs.params(), (out_features, in_features), in_features, block)
        self.weight = nnx.Param(values)  # f8[O, I]
        self.weight_scale_inv = nnx.Param(scale)  # f32[O/b0, I/b1]

    def __call__(self, x: jax.Array) -> jax.Array:
        # x: [..., I] -> [..., O] in the layer's dtype
        weight = self.weight[...]
        if self.weight_scale_inv is None:
            return einsum("...i,oi->...o", x.astype(weight.dtype), weight)
        lead = x.shape[:-1]
        y = fp8_matmul(
            x.reshape(-1, x.shape[-1]).astype(self.dtype), weight, self.weight_scale_inv[...],
            implementation=current_matmul_implementation(), fp8_activations=self.fp8_activations,
        )  # [T, O]
        return y.reshape(*lead, y.shape[-1])


class RMSNorm(nnx.Module):
    """transformers' DeepseekV3RMSNorm: normalise in f32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))  # [I]

    def __call__(self, x: jax.Array) -> jax.Array:
        # x: [..., I] -> [..., I] in x's dtype
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * h.astype(x.dtype)


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm with weight and bias (the indexer's k_norm), computed in f32."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))  # [I]
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))  # [I]

    def __call__(self, x: jax.Array) -> jax.Array:
        # x: [..., I] -> [..., I] in x's dtype
        h = x.astype(jnp.float32)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        return (h * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward: the dense layers' MLP and the MoE's shared experts."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, dtype, rngs: nnx.Rngs, block: tuple[int, int] | None = None,
        fp8_activations: bool = False,
    ):  # fmt: skip
        linear = functools.partial(Linear, dtype=dtype, rngs=rngs, block=block, fp8_activations=fp8_activations)
        self.gate_proj = linear(hidden_size, intermediate_size)  # [F, I]
        self.up_proj = linear(hidden_size, intermediate_size)  # [F, I]
        self.down_proj = linear(intermediate_size, hidden_size)  # [I, F]

    def __call__(self, x: jax.Array) -> jax.Array:
        # x: [..., I] -> [..., I]
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab_size, hidden_size), jnp.float32).astype(dtype))  # [V, D]

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # tokens i32[...] -> [..., D]
        return jnp.take(self.weight[...], tokens, axis=0)
