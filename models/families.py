"""Model families a checkpoint can be, keyed by config.json's `model_type`: the one place that maps
a checkpoint to its config class, its selection width under HiSparse and its decode function
(what models.decoding.decode_checkpoint, models.inputs and run_decode.py's checks use).

    family = family_of(raw_config)                   # raw: config.json as a dict
    config = family.parse(raw)                       # DSAModelConfig / DeepseekV4Config / MiniMaxM3Config
    out = family.decode(checkpoint, prompts, max_new_tokens, dtype=jnp.float32, hisparse=hs)

Families:
  dsa           deepseek_v32, glm_moe_dsa: models.loading.load_hf_checkpoint + models.decoding.generate
                (HiSparse: every full-indexer layer's MLA rows offloaded).
  deepseek_v4   models.deepseek_v4_loading.load_deepseek_v4 + models.deepseek_v4_decoding.generate
                (HiSparse off) / generate_hisparse (on: the CSA "C4" entries offloaded;
                device_buffer_size = the device entry buffer per request and CSA layer).
  minimax_m3    minimax_m3_vl_text, minimax_m3_vl: models.minimax_m3_loading.load_hf_checkpoint +
                models.minimax_m3.generate (off) / models.minimax_m3_hisparse.generate_hisparse (on:
                the sparse layers' K/V offloaded; device_buffer_size = the working set per request,
                KV group and sparse layer, >= the selection width).

Selection width (HiSparse's top_k): DSA and V4 select index_topk entries; --hisparse_config's
top_k defaults to it and any other value is refused. MiniMax-M3 selects whole blocks, so its
width is fixed by the model (index_topk_blocks x index_block_size): a top_k is not applied to it;
it defaults to that width and a different value is refused with one line saying so.

Serving (run_decode.py --model=deepseek_v4_tiny|minimax_m3_tiny; hisparse_jax.serving.engine):
a family other than DSA names its random-weight model, its engine runner (models/family_runner.py:
V4Runner, M3Runner) and its device footprint per request; the DSA family's are
models.decoding.ModelRunner and models.footprint.DeviceFootprint, built by the CLI.

Nothing here imports JAX at module level (run_decode.py checks its inputs before JAX starts); the
decode functions import their model code when called.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from configs.deepseek_v4 import DeepseekV4Config
from configs.hf_json import read_config_json
from configs.minimax_m3 import TEXT_MODEL_TYPE, VL_MODEL_TYPE, MiniMaxM3Config
from configs.model import SUPPORTED_MODEL_TYPES, DSAModelConfig, UnsupportedModelError


class DecodeOutput(NamedTuple):
    tokens: np.ndarray  # i32[B, N]: greedy tokens
    logits: np.ndarray  # f32[B, N, V]: the logits each token was chosen from
    num_misses: np.ndarray | None  # rows copied host -> device per decode step (None without HiSparse)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    parse: Callable[[Mapping[str, Any]], Any]  # raw config.json dict -> config
    selection_width: Callable[[Any], int]  # config -> HiSparse top_k (rows one query selects)
    top_k_is_fixed_by_model: bool  # a user top_k is not applied (refused unless equal)
    check_hisparse: Callable[[Any, Any], None]  # (config, HiSparseConfig) -> raises ValueError
    decode: Callable[..., DecodeOutput]  # (checkpoint, prompts, max_new_tokens, *, dtype, hisparse, kv_cache_dtype)
    kv_cache_dtypes_other_than_auto: bool  # takes --kv_cache_dtype values other than auto
    abstract_model: Callable[[Any, Any], Any]  # (config, dtype) -> the model with ShapeDtypeStruct leaves
    # Serving through the engine, for families other than DSA (None: DSA, whose runner the CLI builds):
    random_model: Callable[[Any, Any, int], Any] | None = None  # (config, dtype, seed) -> model with random weights
    make_runner: Callable[..., Any] | None = None  # (model, *, implementation) -> the engine's runner
    footprint: Callable[[Any, Any, Any], Any] | None = None  # (config, dtype, HiSparseConfig or None) -> RequestFootprint

    @property
    def config_class(self) -> type:
        return self.parse.__self__  # parse is the config class's from_hf_config


# ---- HiSparse checks per family (no JAX) ---------------------------------------------------------


def _check_dsa(config: DSAModelConfig, hisparse) -> None:
    if hisparse.top_k != config.index_topk:
        raise ValueError(f"HiSparse top_k ({hisparse.top_k}) must equal the model's index_topk ({config.index_topk})")


def _check_v4(config: DeepseekV4Config, hisparse) -> None:
    if hisparse.top_k != config.index_topk:
        raise ValueError(f"HiSparse top_k ({hisparse.top_k}) must equal the model's index_topk ({config.index_topk})")
    if not config.csa_layers:
        raise ValueError("the model has no compressed_sparse_attention layer: there is no C4 pool to offload")


def _check_m3(config: MiniMaxM3Config, hisparse) -> None:
    width = config.selected_keys
    if hisparse.top_k != width:
        raise ValueError(
            f"HiSparse top_k ({hisparse.top_k}) is not applied to MiniMax-M3: its selection width is fixed by the model,"
            f" index_topk_blocks x index_block_size = {config.index_topk_blocks} x {config.index_block_size} = {width};"
            f" drop top_k or set it to {width}"
        )
    if config.index_n_heads != config.num_kv_heads:
        raise ValueError(
            f"HiSparse maps one selection per KV group: index_n_heads ({config.index_n_heads}) must equal"
            f" num_key_value_heads ({config.num_kv_heads})"
        )
    if hisparse.device_buffer_size < width:
        raise ValueError(
            f"device_buffer_size ({hisparse.device_buffer_size}) must be >= the keys one MiniMax-M3 query selects,"
            f" index_topk_blocks x index_block_size = {config.index_topk_blocks} x {config.index_block_size} = {width}"
        )


# ---- decode functions (import JAX when called) ---------------------------------------------------


def _decode_dsa(checkpoint, prompts, max_new_tokens, *, dtype, hisparse, kv_cache_dtype) -> DecodeOutput:
    from models import decoding  # its load_hf_checkpoint, looked up when called (tests patch it)

    model = decoding.load_hf_checkpoint(checkpoint, dtype=dtype)
    out = decoding.generate(model, prompts, max_new_tokens, hisparse=hisparse, kv_cache_dtype=kv_cache_dtype)
    return DecodeOutput(out.tokens, out.logits, out.num_misses if hisparse is not None else None)


def _decode_v4(checkpoint, prompts, max_new_tokens, *, dtype, hisparse, kv_cache_dtype) -> DecodeOutput:
    import jax.numpy as jnp

    from models.deepseek_v4_decoding import generate, generate_hisparse
    from models.deepseek_v4_loading import load_deepseek_v4

    model = load_deepseek_v4(checkpoint, dtype=dtype)
    ids = jnp.asarray(prompts, jnp.int32)
    if hisparse is None:
        tokens, logits, _ = generate(model, ids, max_new_tokens)
        misses = None
    else:
        tokens, logits, misses = generate_hisparse(model, ids, max_new_tokens, hisparse, page_size=16)
    return DecodeOutput(np.asarray(tokens, np.int32), np.asarray(logits, np.float32), misses)


def _decode_m3(checkpoint, prompts, max_new_tokens, *, dtype, hisparse, kv_cache_dtype) -> DecodeOutput:
    import jax.numpy as jnp

    from models.minimax_m3 import generate
    from models.minimax_m3_hisparse import generate_hisparse
    from models.minimax_m3_loading import load_hf_checkpoint

    model = load_hf_checkpoint(checkpoint, dtype=dtype)
    ids = jnp.asarray(prompts, jnp.int32)
    if hisparse is None:
        tokens, logits = generate(model, ids, max_new_tokens)
        misses = None
    else:
        tokens, logits, misses = generate_hisparse(model, ids, max_new_tokens, hisparse)
    return DecodeOutput(np.asarray(tokens, np.int32), np.asarray(logits, np.float32), misses)


def _abstract_dsa(config, dtype):
    from models.loading import abstract_model

    return abstract_model(config, dtype)


def _abstract_v4(config, dtype):
    from models.deepseek_v4_loading import abstract_model

    return abstract_model(config, dtype)


def _abstract_m3(config, dtype):
    from models.minimax_m3_loading import abstract_model

    return abstract_model(config, dtype)


# ---- serving (import JAX when called) -------------------------------------------------------------


def _random_v4(config, dtype, seed):
    from flax import nnx

    from models.deepseek_v4 import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))


def _random_m3(config, dtype, seed):
    from flax import nnx

    from models.minimax_m3 import MiniMaxM3ForCausalLM

    return MiniMaxM3ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))


def _runner_v4(model, **kwargs):
    from models.deepseek_v4_runner import V4Runner

    return V4Runner(model, **kwargs)


def _runner_m3(model, **kwargs):
    from models.minimax_m3_runner import M3Runner

    return M3Runner(model, **kwargs)


def _footprint_v4(config, dtype, hisparse):
    from models.deepseek_v4_runner import footprint

    return footprint(config, dtype, hisparse)


def _footprint_m3(config, dtype, hisparse):
    from models.minimax_m3_runner import footprint

    return footprint(config, dtype, hisparse)


FAMILIES = (
    Family(
        "dsa", SUPPORTED_MODEL_TYPES, DSAModelConfig.from_hf_config, lambda c: c.index_topk, False, _check_dsa,
        _decode_dsa, True, _abstract_dsa,
    ),
    Family(
        "deepseek_v4", ("deepseek_v4",), DeepseekV4Config.from_hf_config, lambda c: c.index_topk, False, _check_v4,
        _decode_v4, False, _abstract_v4, _random_v4, _runner_v4, _footprint_v4,
    ),
    Family(
        "minimax_m3", (TEXT_MODEL_TYPE, VL_MODEL_TYPE), MiniMaxM3Config.from_hf_config, lambda c: c.selected_keys, True,
        _check_m3, _decode_m3, False, _abstract_m3, _random_m3, _runner_m3, _footprint_m3,
    ),
)  # fmt: skip
MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)


def family_of(raw: Mapping[str, Any]) -> Family:
    """The family of a raw config.json dict, by its model_type; UnsupportedModelError otherwise."""
    model_type = raw.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise UnsupportedModelError(f"model_type {model_type!r} is not supported; use one of {MODEL_TYPES}")


def family_of_config(config) -> Family:
    """The family of a parsed config (any of the config classes)."""
    for family in FAMILIES:
        if isinstance(config, family.config_class):
            return family
    raise TypeError(f"not a model config of a known family: {type(config).__name__}")


def parse_config(source: str | os.PathLike | Mapping[str, Any]):
    """config.json (a dict, the file or the checkpoint directory) -> its family's config."""
    raw = read_config_json(source)
    return family_of(raw).parse(raw)


def check_hisparse(config, hisparse) -> None:
    """HiSparse settings (a HiSparseConfig, or None for no offload) the config's family can take;
    ValueError naming the value at fault."""
    if hisparse is not None:
        family_of_config(config).check_hisparse(config, hisparse)


