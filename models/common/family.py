"""What the registry knows of a model family (models/registry.py holds the table): its config
class, its selection width under HiSparse, its checks, its checkpoint decode function, and, for
serving, its random-weight model, engine runner and device footprint. Each family package
(models/dsa, models/deepseek_v4, models/minimax_m3) declares one `FAMILY = Family(...)` in its
family.py; nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np


class DecodeOutput(NamedTuple):
    tokens: np.ndarray  # i32[B, N]: greedy tokens
    logits: np.ndarray  # f32[B, N, V]: the logits each token was chosen from
    num_misses: np.ndarray | None  # rows copied host -> device per decode step (None without HiSparse)
    num_accepted: np.ndarray | None = None  # speculative decoding: i32[S, B] drafts accepted per step (DSA)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    parse: Callable[[Mapping[str, Any]], Any]  # raw config.json dict -> config
    selection_width: Callable[[Any], int]  # config -> HiSparse top_k (rows one query selects)
    top_k_is_fixed_by_model: bool  # a user top_k is not applied (refused unless equal)
    check_hisparse: Callable[[Any, Any], None]  # (config, HiSparseConfig) -> raises ValueError
    # (checkpoint, prompts, max_new_tokens, *, dtype, hisparse, kv_cache_dtype[, parallel, implementation])
    decode: Callable[..., DecodeOutput]
    kv_cache_dtypes_other_than_auto: bool  # takes --kv_cache_dtype values other than auto
    abstract_model: Callable[[Any, Any], Any]  # (config, dtype) -> the model with ShapeDtypeStruct leaves
    # Serving through the engine, for families other than DSA (None: DSA, whose runner the CLI builds):
    random_model: Callable[[Any, Any, int], Any] | None = None  # (config, dtype, seed) -> model with random weights
    make_runner: Callable[..., Any] | None = None  # (model, *, implementation) -> the engine's runner
    footprint: Callable[[Any, Any, Any], Any] | None = None  # (config, dtype, HiSparseConfig or None) -> RequestFootprint
    # Checkpoint decoding takes decode's `parallel` (a hisparse_jax.sharding.ParallelConfig: a mesh
    # of tensor / data-parallel devices) and `implementation` (the kernels); False: one device, the
    # default kernels.
    decodes_on_a_mesh: bool = False

    @property
    def config_class(self) -> type:
        return self.parse.__self__  # parse is the config class's from_hf_config
