"""Hugging Face checkpoints of the DSA family -> DSAForCausalLM. The safetensors reader, the
loading loop and FP8 block dequantisation are models.common.checkpoint's; here is what is the
family's own: which checkpoint tensor fills which parameter, and what may be left unused.
"""

from __future__ import annotations

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.model import DSAModelConfig
from models.common import fp8
from models.common.checkpoint import (
    _FP8,
    _SCALE_SUFFIX,
    Checkpoint,
    CheckpointError,
    _names,
    _ParamSource,
    derived_scale_names,
    load_model_from_checkpoint,
    param_sources,
)
from models.dsa.model import DSAForCausalLM

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)(_scale_inv)?$")


def _sources(abstract_state: dict, config: DSAModelConfig) -> list[_ParamSource]:
    return param_sources(abstract_state, config.n_routed_experts, head="lm_head", expert_pattern=_EXPERT)


def _ignorable(name: str, config: DSAModelConfig) -> bool:
    """Checkpoint tensors the model has no place for, as transformers ignores them too."""
    layer = re.match(r"^model\.layers\.(\d+)\.", name)
    # MTP (next-token prediction) layers follow the model's layers; decoding does not use them.
    if layer and config.num_layers <= int(layer.group(1)) < config.num_layers + config.num_nextn_predict_layers:
        return True
    return config.tie_word_embeddings and name == "lm_head.weight"


def _check(checkpoint: Checkpoint, sources: list[_ParamSource], config: DSAModelConfig, block: tuple[int, int] | None):
    present = checkpoint.names()
    expected = {n for s in sources for n in s.hf_names}
    scales = {n + _SCALE_SUFFIX for n in expected if n + _SCALE_SUFFIX in present}
    derived = derived_scale_names(sources) - present  # an unquantised checkpoint's, made at load
    expected -= derived
    if missing := expected - present:
        raise CheckpointError(f"checkpoint {checkpoint.directory} lacks {len(missing)} tensor(s) the model needs: {_names(missing)}")
    if unexpected := {n for n in present - expected - scales if not _ignorable(n, config)}:
        raise CheckpointError(
            f"checkpoint {checkpoint.directory} holds {len(unexpected)} tensor(s) this {config.model_type} config has no"
            f" place for (wrong config.json?): {_names(unexpected)}"
        )
    wrong = [
        f"{n}: checkpoint {checkpoint.info(n).shape}, model {s.hf_shape}"
        for s in sources for n in s.hf_names
        if n in expected and not n.endswith(_SCALE_SUFFIX) and checkpoint.info(n).shape != s.hf_shape  # scales: below
    ]  # fmt: skip
    if wrong:
        raise CheckpointError(f"{len(wrong)} tensor shape(s) differ from config.json: {'; '.join(wrong[:6])}")
    for n in expected:
        if checkpoint.info(n).dtype in _FP8:
            if n + _SCALE_SUFFIX not in present:
                raise CheckpointError(f"FP8 tensor {n} has no {n + _SCALE_SUFFIX}")
            if block is None:
                raise CheckpointError(f"FP8 tensor {n} but config.json has no quantization_config")
            rows, cols = checkpoint.info(n).shape
            want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
            if (got := checkpoint.info(n + _SCALE_SUFFIX).shape) != want:
                raise CheckpointError(f"{n + _SCALE_SUFFIX} has shape {got}, expected {want} for {block} blocks")


def abstract_model(config: DSAModelConfig, dtype) -> DSAForCausalLM:
    """The model's structure with ShapeDtypeStruct leaves: no memory, sizes exact."""
    return nnx.eval_shape(lambda: DSAForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))


def weight_block(weights_dtype: str, checkpoint_block: tuple[int, int] | None, dtype) -> tuple[int, int] | None:
    """The model's weight_block_size for `weights_dtype` (models.common.fp8.WEIGHTS_DTYPES):
    "auto" keeps the checkpoint's own format (block FP8 stays FP8), "fp8_e4m3" block FP8 (the
    checkpoint's blocks, or 128 x 128 quantised at load), the model dtype's name dequantises."""
    if weights_dtype == "auto":
        return checkpoint_block
    if weights_dtype == "fp8_e4m3":
        return checkpoint_block or fp8.DEFAULT_BLOCK
    if weights_dtype == np.dtype(dtype).name:
        return None
    raise ValueError(
        f"weights_dtype {weights_dtype!r} must be one of auto, fp8_e4m3 or the model dtype ({np.dtype(dtype).name})"
    )


def load_hf_checkpoint(
    directory: str | os.PathLike, *, dtype=jnp.bfloat16, device: jax.Device | None = None, weights_dtype: str = "auto"
) -> DSAForCausalLM:
    """A Hugging Face checkpoint directory -> DSAForCausalLM with params in `dtype`.

    weights_dtype: "auto" (default) keeps an FP8 checkpoint's linear layers and experts in block
    FP8 on the device (config.weight_block_size; their products equal the dequantised weights'),
    "fp8_e4m3" makes them block FP8 whatever the checkpoint holds, `dtype`'s name dequantises
    everything at load. The router and the indexer's weights_proj stay float32 whatever `dtype`,
    as in transformers.
    """
    weight_block(weights_dtype, None, dtype)  # a ValueError for an unknown name, before any file is read
    return load_model_from_checkpoint(
        directory, config_class=DSAModelConfig, abstract_model=abstract_model, sources=_sources, check=_check,
        dtype=dtype, device=device,
        configure=lambda config, block: config.replace(weight_block_size=weight_block(weights_dtype, block, dtype)),
    )  # fmt: skip
