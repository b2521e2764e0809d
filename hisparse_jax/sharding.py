"""Data-parallel attention and tensor parallelism on jax.sharding meshes (SGLang's flags).

SGLang's meaning of the flags, which we keep so settings carry over:
  --tp_size T                     tensor parallelism over T devices (the model's dense and MoE
                                  weights are split T ways);
  --dp_size D --enable_dp_attention  the same T devices, but attention is data-parallel over D
                                  groups of T/D devices: each group owns its requests (its own
                                  device buffers, its own block of pinned host memory) and splits
                                  the attention heads T/D ways; dense/MoE weights stay split over
                                  all T devices;
  --dp_size D (without dp attention)  D independent replicas of a T-way tensor-parallel model
                                  (D x T devices).
Either way the mesh is ("dp", "tp") = (D, attention TP). Request slots, the HiSparse state and the
host pool are split over "dp" (hisparse_jax.state.partition_specs); attention heads over "tp".
XLA partitions the model's dense work from the weights' shardings; the Pallas kernels, which XLA
cannot partition, run per device inside shard_map, each on its group's requests and heads.
Within a group every device keeps the same replica of the group's KV state: MLA has one latent
KV head that all heads read, so splitting heads cannot split the KV.

Letters: R request slots, H heads, W row width, K top-k entries, T prompt rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hisparse_jax import attention_layer as layers
from hisparse_jax import kv_cache_ops
from hisparse_jax.state import REQUEST_AXIS, partition_specs

HEAD_AXIS = "tp"
AXES = (REQUEST_AXIS, HEAD_AXIS)


class ParallelConfigError(ValueError):
    """An inconsistent --tp_size / --dp_size / --enable_dp_attention combination."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """SGLang's --tp_size / --dp_size / --enable_dp_attention, validated (see the module docstring)."""

    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False

    def __post_init__(self):
        for name in ("tp_size", "dp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParallelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.enable_dp_attention and self.tp_size % self.dp_size:
            raise ParallelConfigError(
                f"with enable_dp_attention, tp_size ({self.tp_size}) must be a multiple of dp_size ({self.dp_size})"
            )

    @property
    def num_devices(self) -> int:
        """Devices the configuration uses."""
        return self.tp_size if self.enable_dp_attention else self.tp_size * self.dp_size

    @property
    def attention_tp(self) -> int:
        """Devices splitting the heads within one data-parallel group."""
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    @property
    def ffn_axes(self) -> tuple[str, ...]:
        """Mesh axes the dense and MoE weights are split over."""
        return AXES if self.enable_dp_attention else (HEAD_AXIS,)

    @property
    def is_single_device(self) -> bool:
        """Whether no mesh is needed."""
        return self.num_devices == 1

    def make_mesh(self, devices=None) -> Mesh:
        """The ("dp", "tp") = (dp_size, attention_tp) mesh over the first num_devices of `devices`
        (default jax.devices()); raises ParallelConfigError when too few are given."""
        devices = list(devices if devices is not None else jax.devices())
        if len(devices) < self.num_devices:
            raise ParallelConfigError(
                f"tp_size={self.tp_size}, dp_size={self.dp_size}, enable_dp_attention={self.enable_dp_attention}"
                f" needs {self.num_devices} devices; {len(devices)} available"
            )
        grid = np.asarray(devices[: self.num_devices]).reshape(self.dp_size, self.attention_tp)
        return Mesh(grid, AXES)


def _info_specs(record_plan: bool) -> layers.LayerStepInfo:
    per_request = P(REQUEST_AXIS)
    plan = None
    if record_plan:
        plan = layers.SwapInPlan(*(P(REQUEST_AXIS),) * len(layers.SwapInPlan._fields))
    return layers.LayerStepInfo(per_request, per_request, plan)


def _query_spec() -> P:
    return P(REQUEST_AXIS, HEAD_AXIS, None)


def _per_group(fn, mesh: Mesh, state, query, new_row, positions, selection, selection_spec, info_spec):
    """Runs a layer function fn(state, query, new_row, positions, selection) on every device with
    its group's requests and its heads (the last argument is the top-k or the anchor's info)."""
    specs = partition_specs(state)
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(specs, _query_spec(), P(REQUEST_AXIS), P(REQUEST_AXIS), selection_spec),
        out_specs=(specs, _query_spec(), info_spec),
        check_vma=False,  # the tp devices of a group compute the same state: replicated by construction
    )(state, query, new_row, positions, selection)


def attention_layer(mesh: Mesh, state, layer, query, new_row, positions, topk, *, record_plan=False, **kwargs):
    """hisparse_jax.attention_layer.attention_layer, each data-parallel group on its own requests.

    Same arguments and results as the single-device layer, global shapes (query [R, H, W],
    new_row row[R, W], positions i32[R], topk i32[R, K] -> (state, f32[R, H, D], LayerStepInfo));
    R must divide by the "dp" axis size and H by the "tp" axis size.
    """
    fn = lambda st, q, row, pos, sel: layers.attention_layer(st, layer, q, row, pos, sel, record_plan=record_plan, **kwargs)  # noqa: E731
    return _per_group(fn, mesh, state, query, new_row, positions, topk, P(REQUEST_AXIS), _info_specs(record_plan))


def shared_attention_layer(mesh: Mesh, state, layer, query, new_row, positions, anchor, **kwargs):
    """hisparse_jax.attention_layer.shared_attention_layer per data-parallel group (global
    shapes as there; `anchor` is the LayerStepInfo this module's attention_layer returned)."""
    fn = lambda st, q, row, pos, sel: layers.shared_attention_layer(st, layer, q, row, pos, sel, **kwargs)  # noqa: E731
    return _per_group(fn, mesh, state, query, new_row, positions, anchor, _info_specs(True), _info_specs(True))


def store_prefill_rows(mesh: Mesh, state, layer, request, start, rows, prompt_len, **kwargs):
    """kv_cache_ops.store_prefill_rows where `request` is a global slot: only its group writes,
    into its own pool block, at its local slot index. rows: row[T, W], replicated."""
    specs = partition_specs(state)
    local_requests = state.seq_lens.shape[0] // mesh.shape[REQUEST_AXIS]

    def body(state, request, start, rows, prompt_len):
        group = jax.lax.axis_index(REQUEST_AXIS)
        mine = request // local_requests == group
        # Other groups store nothing: their "prompt" is empty, so every row is padding.
        local_len = jnp.where(mine, prompt_len, 0)
        local_request = jnp.where(mine, request % local_requests, 0)
        return kv_cache_ops.store_prefill_rows(state, layer, local_request, start, rows, local_len, **kwargs)

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, P(), P(), P(), P()),
        out_specs=specs,
        check_vma=False,
    )(state, request, start, rows, prompt_len)
