"""How a DSA model's weights are split over a ("dp", "tp") mesh (hisparse_jax.sharding).

Attention (MLA): heads over "tp" — q_b_proj and kv_b_proj by their output (per-head) rows,
o_proj by its input columns; the latent/rope projections, norms and the indexer are small and
replicated. Dense MLPs and MoE experts: the intermediate dimension over the parallel config's
ffn axes ("tp", or ("dp", "tp") with data-parallel attention, so every device holds 1/T of
them). Embeddings, lm_head and the router: replicated. XLA inserts the collectives these imply;
the Pallas attention kernels run per device in shard_map (hisparse_jax.sharding).

Weights keep the Hugging Face [out, in] layout (models/common/layers.py); experts are [E, in, out].
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hisparse_jax.sharding import HEAD_AXIS, ParallelConfig

# (path regex, spec builder given the ffn axes); first match wins, no match = replicated.
_RULES = [
    (r"self_attn\.(q_b_proj|kv_b_proj)\.weight$", lambda ffn: P(HEAD_AXIS, None)),
    (r"self_attn\.o_proj\.weight$", lambda ffn: P(None, HEAD_AXIS)),
    (r"mlp\.experts\.(gate_proj|up_proj)$", lambda ffn: P(None, None, ffn)),
    (r"mlp\.experts\.down_proj$", lambda ffn: P(None, ffn, None)),
    (r"mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight$", lambda ffn: P(ffn, None)),
    (r"mlp\.(shared_experts\.)?down_proj\.weight$", lambda ffn: P(None, ffn)),
]


def param_spec(path: str, parallel: ParallelConfig) -> P:
    ffn = parallel.ffn_axes if len(parallel.ffn_axes) > 1 else parallel.ffn_axes[0]
    for pattern, spec in _RULES:
        if re.search(pattern, path):
            return spec(ffn)
    return P()


def _block_fp8_spec(name: str, leaf, parallel: ParallelConfig, mesh: Mesh) -> P:
    """Block-FP8 experts keep the checkpoint's [E, out, in] (the rules above are for [E, in, out]):
    the same split on the swapped axes; a `*_scale_inv` is split as its weight where its block
    count divides, else replicated."""
    weight = name[: -len("_scale_inv")] if name.endswith("_scale_inv") else name
    spec = param_spec(weight, parallel)
    if ".experts." in f"{weight}." and len(spec) == 3:
        spec = P(spec[0], spec[2], spec[1])
    for axis, names in enumerate(spec):
        if names is not None and leaf.shape[axis] % math.prod(mesh.shape[n] for n in (names if isinstance(names, tuple) else (names,))):
            return P()
    return spec


def shard_params(params: nnx.State, mesh: Mesh, parallel: ParallelConfig) -> nnx.State:
    """Places every parameter of `params` (from nnx.split) on `mesh` by the rules above."""

    def place(path, leaf):
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]  # drops the Variable's `.value`
        name = ".".join(map(str, keys))
        if name.endswith("_scale_inv") or np.dtype(leaf.dtype) == np.dtype(jnp.float8_e4m3fn):
            return jax.device_put(leaf, NamedSharding(mesh, _block_fp8_spec(name, leaf, parallel, mesh)))
        return jax.device_put(leaf, NamedSharding(mesh, param_spec(name, parallel)))

    return jax.tree_util.tree_map_with_path(place, params)
