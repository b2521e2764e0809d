"""The model registry: config.json's `model_type` -> the family that loads, decodes and serves it.
The one place that dispatches over families; it imports every family package, and no family
imports it.

    family = family_of(raw_config)                   # raw: config.json as a dict
    config = family.parse(raw)                       # DSAModelConfig / DeepseekV4Config / MiniMaxM3Config
    out = family.decode(checkpoint, prompts, max_new_tokens, dtype=jnp.float32, hisparse=hs)
    decode_checkpoint("ckpt/", "prompts.npz", "out.npz", max_new_tokens=8)   # any family

Families (each declares its FAMILY in models/<family>/family.py):
  dsa           deepseek_v32, glm_moe_dsa (models/dsa)
  deepseek_v4   deepseek_v4 (models/deepseek_v4)
  minimax_m3    minimax_m3_vl_text, minimax_m3_vl (models/minimax_m3)

Selection width (HiSparse's top_k): DSA and V4 select index_topk entries; --hisparse_config's
top_k defaults to it and any other value is refused. MiniMax-M3 selects whole blocks, so its
width is fixed by the model (index_topk_blocks x index_block_size): a top_k is not applied to it;
it defaults to that width and a different value is refused with one line saying so.

Also here: the checks that depend on the family (HiSparse settings, kv_cache_dtype, a checkpoint's
config.json) and orbax save/restore of any family's converted params. Nothing here imports JAX at
module level (run_decode.py checks its inputs before JAX starts); the decode functions import
their model code when called.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import numpy as np

from configs.hf_json import read_config_json
from configs.model import UnsupportedModelError
from models.common import inputs
from models.common.family import DecodeOutput, Family
from models.common.inputs import InputError, check_hisparse_with
from models.deepseek_v4.family import FAMILY as DEEPSEEK_V4
from models.dsa.family import FAMILY as DSA
from models.minimax_m3.family import FAMILY as MINIMAX_M3

FAMILIES = (DSA, DEEPSEEK_V4, MINIMAX_M3)
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



# ---- checks that depend on the family (no JAX) ---------------------------------------------------


def check_hisparse(hisparse, config) -> None:
    """HiSparse (a HiSparseConfig, or None for no offload) swaps in what the model selects: its
    top_k must be the model's selection width (DSA, DeepSeek-V4: index_topk; MiniMax-M3: fixed by
    the model, index_topk_blocks x index_block_size), plus the family's own limits
    (models.families)."""
    if hisparse is not None:
        check_hisparse_with(family_of_config(config).check_hisparse, hisparse, config)


def check_kv_cache_dtype(kv_cache_dtype: str, config, dtype: str) -> None:
    """DeepSeek-V4 and MiniMax-M3 keep their caches in the model dtype: only kv_cache_dtype "auto"
    (or the model dtype's own name) is taken; DSA models take every create_cache format (checked
    there)."""
    if family_of_config(config).kv_cache_dtypes_other_than_auto or kv_cache_dtype in ("auto", dtype):
        return
    raise InputError(
        f"kv_cache_dtype {kv_cache_dtype!r} is not supported for model_type {config.model_type!r}:"
        f" its caches are kept in the model dtype ({dtype}); use auto"
    )


def check_decode_options(config, parallel, implementation: str | None, *, num_prompts: int | None = None) -> dict:
    """Checkpoint decoding's mesh and kernels -> the keywords of the family's decode: a mesh
    (parallel over several devices) or an implementation only for a family that decodes on a
    mesh (DSA); the mesh must split the model and the prompts evenly."""
    family = family_of_config(config)
    mesh = parallel is not None and not parallel.is_single_device
    if not family.decodes_on_a_mesh:
        if mesh:
            raise InputError(f"{config.model_type} checkpoint decoding runs on one device (tp_size = dp_size = 1)")
        if implementation is not None:
            raise InputError(f"{config.model_type} checkpoint decoding runs its default kernels; implementation {implementation!r} is not taken")
        return {}
    inputs.check_parallel(config, parallel if mesh else None, num_requests=num_prompts, requests="prompts")
    return dict(parallel=parallel if mesh else None, implementation=implementation)


def load_config(checkpoint: str | os.PathLike):
    """The architecture of a Hugging Face checkpoint directory (its config.json), weights untouched:
    the config class of its model_type's family (models.families: DSAModelConfig,
    DeepseekV4Config or MiniMaxM3Config; each has vocab_size and max_position_embeddings)."""
    path = os.fspath(checkpoint)
    if not os.path.exists(path):
        raise InputError(f"checkpoint directory {path} does not exist")
    if not os.path.isdir(path):
        raise InputError(f"checkpoint {path} is a file, not a directory (config.json + *.safetensors)")
    config_path = os.path.join(path, "config.json")
    try:
        return parse_config(path)
    except (OSError, ValueError) as error:  # unreadable, not JSON, unsupported or invalid values
        message = str(error)
        raise InputError(message if config_path in message else f"{config_path}: {message}") from error
    except (TypeError, KeyError) as error:  # a field of the wrong type or shape
        raise InputError(f"{config_path}: malformed config ({type(error).__name__}: {error})") from error


# ---- any family's checkpoint ----------------------------------------------------------------------


def decode_checkpoint(
    checkpoint: str | os.PathLike,
    prompts_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    max_new_tokens: int,
    dtype=None,
    hisparse=None,
    kv_cache_dtype: str = "auto",
    parallel=None,
    implementation: str | None = None,
    speculative=None,
    weights_dtype: str = "auto",
    fp8_activations: bool = False,
) -> DecodeOutput:
    """Loads a Hugging Face checkpoint, greedy-decodes the prompts of an .npz (`input_ids`
    int32 [B, T]) and writes `tokens` int32 [B, N] and `logits` float32 [B, N, V] to output_path
    (which must end in .npz: it is the file written). dtype: the params' dtype (None:
    bfloat16); hisparse: a HiSparseConfig, or None for no offload. kv_cache_dtype: as create_cache's (DSA
    models; DeepSeek-V4 and MiniMax-M3 keep their caches in `dtype` and take "auto" only).
    parallel (a hisparse_jax.sharding.ParallelConfig: a tensor / data-parallel mesh) and
    implementation (the kernels: "reference", "pallas", "tpu"; None: the backend's default) are
    taken by families with decodes_on_a_mesh (DSA); others refuse them (InputError).

    The model family comes from config.json's model_type (deepseek_v32 /
    glm_moe_dsa, deepseek_v4, minimax_m3_vl_text / minimax_m3_vl), which picks the loader and the
    decode function (HiSparse on or off). Every input (config.json, the prompts against it,
    max_new_tokens, hisparse, the output path) is checked before the weights load
    (models.common.inputs.InputError); the output appears whole or not at all (written aside, then renamed).

    speculative: a configs.speculative.SpeculativeConfig decodes with the model's MTP layer (DSA
    models with one; the same tokens); the output then also holds `num_accepted` int32 [S, B],
    drafts accepted per decode step and prompt (-1 once a prompt had its tokens)."""
    import jax.numpy as jnp

    from models.dsa.indexer import index_key_dtype  # the kv_cache_dtype names every family's check uses

    dtype = jnp.bfloat16 if dtype is None else dtype
    config = load_config(checkpoint)
    family = family_of_config(config)
    prompts = inputs.check_prompts(
        inputs.read_prompts(prompts_path), config, max_new_tokens=max_new_tokens, name=f"{os.fspath(prompts_path)} input_ids"
    )
    check_hisparse(hisparse, config)
    check_kv_cache_dtype(kv_cache_dtype, config, np.dtype(dtype).name)
    index_key_dtype(kv_cache_dtype, dtype)  # a ValueError for an unknown name, before the weights load
    output_path = inputs.check_output_path(output_path)
    options = check_decode_options(config, parallel, implementation, num_prompts=prompts.shape[0])
    if speculative is not None:
        if family.name != "dsa" or config.num_nextn_predict_layers < 1:
            raise InputError(f"speculative decoding needs a DSA model with an MTP layer; {checkpoint} has none")
        options = dict(options, speculative=speculative)
    if weights_dtype != "auto" and family.name == "dsa":  # block FP8 or dequantised (models.dsa.loading); others load in dtype
        options = dict(options, weights_dtype=weights_dtype)
    if fp8_activations:  # w8a8 over block-FP8 weights (DSA: DSAModelConfig.fp8_activations)
        if family.name != "dsa":
            raise InputError(f"fp8_activations: {config.model_type} checkpoints load in dtype (no block-FP8 weights)")
        options = dict(options, fp8_activations=True)
    out = family.decode(checkpoint, prompts, max_new_tokens, dtype=dtype, hisparse=hisparse, kv_cache_dtype=kv_cache_dtype, **options)
    logging.info("decoded %s: %s (%s family), params %s", checkpoint, config.model_type, family.name, np.dtype(dtype).name)
    partial = f"{output_path}.partial-{os.getpid()}"
    try:
        accepted = {} if out.num_accepted is None else dict(num_accepted=out.num_accepted)
        with open(partial, "wb") as f:  # a file object: np.savez appends no suffix
            np.savez(f, tokens=out.tokens, logits=out.logits, **accepted)
        os.replace(partial, output_path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    if out.num_misses is not None and np.size(out.num_misses):
        logging.info("hisparse: %d misses over %d decode steps", np.sum(out.num_misses), len(out.num_misses))
    if out.num_accepted is not None and np.any(out.num_accepted >= 0):
        steps = out.num_accepted[out.num_accepted >= 0]
        logging.info("speculative: acceptance length %.3f over %d request steps", 1 + steps.mean(), steps.size)
    return out


def save_params(directory: str | os.PathLike, model) -> None:
    """Converted params + config to an orbax checkpoint at `directory` (must not exist). Any
    family's model (DSA, DeepSeek-V4, MiniMax-M3); restore_params picks the family back from the
    saved config's model_type."""
    import orbax.checkpoint as ocp
    from flax import nnx

    meta = {"config": model.config.to_dict(), "dtype": np.dtype(model.dtype).name}
    params = nnx.to_pure_dict(nnx.state(model))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(
            os.path.abspath(os.fspath(directory)),
            ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
        )


def restore_params(directory: str | os.PathLike):
    """The model saved by save_params, in the dtype it was saved in, of its family's class."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx

    from models.common.checkpoint import CheckpointError

    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise CheckpointError(f"orbax checkpoint {directory} does not exist")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        meta = checkpointer.restore(directory, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        family = family_of(meta["config"])
        config = family.config_class.from_dict(meta["config"])
        graphdef, state = nnx.split(family.abstract_model(config, jnp.dtype(meta["dtype"])))
        target = nnx.to_pure_dict(state)
        params = checkpointer.restore(directory, ocp.args.Composite(params=ocp.args.StandardRestore(target))).params
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
