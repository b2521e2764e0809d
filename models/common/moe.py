"""DeepSeek MoE: sigmoid router with grouped top-k, routed experts, shared experts.

Letters: T tokens, D hidden, F moe_intermediate_size, E routed experts, G expert groups,
X experts per token (num_experts_per_tok), M = T * X token-expert assignments.

Routing follows transformers' DeepseekV32TopkRouter exactly: scores = sigmoid(x W^T) in f32;
`e_score_correction_bias` is added for *choosing* only (groups by the sum of their two best
biased scores, the best `topk_group` groups, then the best X experts in them); the weights are
the unbiased scores of the chosen experts, normalised to sum 1 when `norm_topk_prob`, times
`routed_scaling_factor`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from configs.model import DSAModelConfig
from models.common import fp8
from models.common.layers import MLP, current_matmul_implementation, einsum, fan_in_normal
from pallas_kernels.grouped_matmul import grouped_matmul


class Router(nnx.Module):
    def __init__(self, config: DSAModelConfig, *, rngs: nnx.Rngs):
        E = config.n_routed_experts
        self.num_groups = config.n_group
        self.topk_group = config.topk_group
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        # Both stay float32 whatever the model dtype, as in the reference.
        self.weight = fan_in_normal(rngs, (E, config.hidden_size), jnp.float32, config.hidden_size)  # f32[E, D]
        self.e_score_correction_bias = nnx.Param(jnp.zeros((E,), jnp.float32))  # f32[E]

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (weights f32[T, X], expert ids i32[T, X])."""
        T, E, G = x.shape[0], self.weight.shape[0], self.num_groups
        scores = jax.nn.sigmoid(einsum("td,ed->te", x.astype(jnp.float32), self.weight[...]))  # f32[T, E]
        choice = scores + self.e_score_correction_bias[...]
        group_scores = jax.lax.top_k(choice.reshape(T, G, E // G), 2)[0].sum(-1)  # f32[T, G]
        _, groups = jax.lax.top_k(group_scores, self.topk_group)  # i32[T, topk_group]
        group_mask = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], groups].set(True)
        expert_mask = jnp.repeat(group_mask, E // G, axis=-1)  # bool[T, E]
        _, experts = jax.lax.top_k(jnp.where(expert_mask, choice, -jnp.inf), self.top_k)  # i32[T, X]
        weights = jnp.take_along_axis(scores, experts, axis=-1)  # f32[T, X]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts.astype(jnp.int32)


class Experts(nnx.Module):
    """Routed expert weights stacked per expert, stored [in, out] for the grouped matmul.

    Checkpoints hold one [out, in] tensor per expert; the loader stacks and transposes them. With
    config.weight_block_size (b0, b1) they are block FP8 and keep the checkpoint's layout: f8
    values [E, out, in] and `<name>_scale_inv` f32[E, out/b0, in/b1] (each expert's
    weight_scale_inv, stacked), multiplied with transpose_rhs (what tokamax's fp8 kernel reads).
    """

    def __init__(self, config: DSAModelConfig, *, dtype, rngs: nnx.Rngs):
        E, D, F = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.dtype = dtype  # the activations' dtype
        block = config.weight_block_size
        self.fp8_activations = config.fp8_activations  # w8a8 over the block-FP8 experts
        for name, (fan_in, fan_out) in (("gate_proj", (D, F)), ("up_proj", (D, F)), ("down_proj", (F, D))):
            if block is None:
                setattr(self, name, fan_in_normal(rngs, (E, fan_in, fan_out), dtype, fan_in))  # [E, in, out]
                setattr(self, f"{name}_scale_inv", None)
            else:
                values, scale = fp8.random_fp8(rngs.params(), (E, fan_out, fan_in), fan_in, block)
                setattr(self, name, nnx.Param(values))  # f8[E, out, in]
                setattr(self, f"{name}_scale_inv", nnx.Param(scale))  # f32[E, out/b0, in/b1]

    def _weight(self, name: str) -> tuple[jax.Array, jax.Array | None]:
        scale = getattr(self, f"{name}_scale_inv")
        return getattr(self, name)[...], None if scale is None else scale[...]

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """x [T, D], weights f32[T, X], experts i32[T, X] -> [T, D]: sum of weighted expert outputs."""
        T, X = experts.shape
        E = self.gate_proj.shape[0]
        # Group the M assignments by expert so each expert runs one dense matmul over its tokens.
        order = jnp.argsort(experts.reshape(-1), stable=True)  # i32[M]
        token = order // X  # i32[M]: token of each sorted assignment
        group_sizes = jnp.bincount(experts.reshape(-1), length=E).astype(jnp.int32)  # i32[E]
        xs = x[token].astype(self.dtype)  # [M, D]

        def grouped(lhs, name):
            rhs, scale = self._weight(name)
            return grouped_matmul(
                lhs, rhs, group_sizes, rhs_scale=scale, transpose_rhs=scale is not None, implementation=current_matmul_implementation(),
                fp8_activations=self.fp8_activations,
            )

        h = jax.nn.silu(grouped(xs, "gate_proj")) * grouped(xs, "up_proj")  # [M, F]
        out = grouped(h, "down_proj").astype(jnp.float32)  # f32[M, D]
        out = out * weights.reshape(-1)[order][:, None]
        # Back to (token, choice) order, then a fixed-order sum over the X choices. A scatter-add
        # into [T, D] would sum in whatever order the GPU's atomics land: on the H200 two
        # identical runs then differed in their logits from the first decode step.
        unsorted = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # f32[M, D]
        return unsorted.reshape(T, X, -1).sum(axis=1).astype(x.dtype)


class MoE(nnx.Module):
    def __init__(self, config: DSAModelConfig, *, dtype, rngs: nnx.Rngs):
        self.gate = Router(config, rngs=rngs)
        self.experts = Experts(config, dtype=dtype, rngs=rngs)
        shared = config.moe_intermediate_size * config.n_shared_experts
        block = config.weight_block_size
        self.shared_experts = MLP(
            config.hidden_size, shared, dtype=dtype, rngs=rngs, block=block, fp8_activations=config.fp8_activations
        ) if shared else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [T, D] -> [T, D]."""
        with jax.named_scope("moe"):  # the router, routed and shared experts (benchmarks/step_split.py reads it)
            weights, experts = self.gate(x)
            y = self.experts(x, weights, experts)
            if self.shared_experts is not None:
                y = y + self.shared_experts(x)
            return y
