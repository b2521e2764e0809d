"""Hugging Face checkpoints of the DSA family -> DSAForCausalLM. The safetensors reader, the
loading loop and FP8 block dequantisation are models.common.checkpoint's; here is what is the
family's own: which checkpoint tensor fills which parameter (MTP layer i, the model's
`mtp.i.*`, is the checkpoint's `model.layers.{num_layers + i}.*`), and what may be left unused.
"""

from __future__ import annotations

import dataclasses
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

_EXPERT = re.compile(r"^(model\.(?:layers|mtp)\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)(_scale_inv)?$")
_MTP_PARAM = re.compile(r"^model\.mtp\.(\d+)\.")  # the model's path of MTP layer i (DSAForCausalLM.mtp)


def _sources(abstract_state: dict, config: DSAModelConfig) -> list[_ParamSource]:
    sources = param_sources(abstract_state, config.n_routed_experts, head="lm_head", expert_pattern=_EXPERT)
    # MTP layer i is decoder layer num_layers + i in the checkpoint (models.dsa.mtp).
    to_layer = lambda name: _MTP_PARAM.sub(lambda m: f"model.layers.{config.num_layers + int(m.group(1))}.", name)  # noqa: E731
    return [dataclasses.replace(s, hf_names=tuple(to_layer(n) for n in s.hf_names)) for s in sources]


def _mtp_layer_of(name: str, config: DSAModelConfig, mtp_in_checkpoint: int) -> int | None:
    """The MTP layer (0, 1, ...) a checkpoint tensor belongs to, None for any other tensor."""
    layer = re.match(r"^model\.layers\.(\d+)\.", name)
    if layer and config.num_layers <= int(layer.group(1)) < config.num_layers + mtp_in_checkpoint:
        return int(layer.group(1)) - config.num_layers
    return None


def _ignorable(name: str, config: DSAModelConfig, mtp_in_checkpoint: int = 0) -> bool:
    """Checkpoint tensors the model has no place for, as transformers ignores them too: MTP layers
    the model does not hold (load_hf_checkpoint(load_mtp=False)) and, in those it holds, the
    copy of the embeddings (the main model's are used, as SGLang does)."""
    mtp = _mtp_layer_of(name, config, mtp_in_checkpoint)
    if mtp is not None:
        return mtp >= config.num_nextn_predict_layers or name.endswith(".embed_tokens.weight")
    return config.tie_word_embeddings and name == "lm_head.weight"


def _check(
    checkpoint: Checkpoint, sources: list[_ParamSource], config: DSAModelConfig, block: tuple[int, int] | None, mtp_in_checkpoint: int = 0
):
    present = checkpoint.names()
    expected = {n for s in sources for n in s.hf_names}
    scales = {n + _SCALE_SUFFIX for n in expected if n + _SCALE_SUFFIX in present}
    derived = derived_scale_names(sources) - present  # an unquantised checkpoint's, made at load
    expected -= derived
    if missing := expected - present:
        raise CheckpointError(f"checkpoint {checkpoint.directory} lacks {len(missing)} tensor(s) the model needs: {_names(missing)}")
    if unexpected := {n for n in present - expected - scales if not _ignorable(n, config, mtp_in_checkpoint)}:
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
    """The model's weight_block_size for `weights_dtype` (serving.validation.WEIGHTS_DTYPE_NAMES):
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


def _mtp_layers(directory, config: DSAModelConfig, load_mtp: bool) -> tuple[int, bool]:
    """(MTP layers the model will hold, whether they have their own shared_head.head): the
    checkpoint's num_nextn_predict_layers when asked to and the checkpoint holds them (a
    conversion may strip them: then 0, and their absence is no error), else 0."""
    count = config.num_nextn_predict_layers
    if not load_mtp or count == 0:
        return 0, True
    names = Checkpoint(directory).names()  # headers only
    first = f"model.layers.{config.num_layers}."
    if not any(n.startswith(first) for n in names):
        return 0, True
    return count, f"{first}shared_head.head.weight" in names


def load_hf_checkpoint(
    directory: str | os.PathLike,
    *,
    dtype=jnp.bfloat16,
    device: jax.Device | None = None,
    weights_dtype: str = "auto",
    load_mtp: bool = True,
    fp8_activations: bool = False,
) -> DSAForCausalLM:
    """A Hugging Face checkpoint directory -> DSAForCausalLM with params in `dtype`.

    weights_dtype: "auto" (default) keeps an FP8 checkpoint's linear layers and experts in block
    FP8 on the device (config.weight_block_size; their products equal the dequantised weights'),
    "fp8_e4m3" makes them block FP8 whatever the checkpoint holds, `dtype`'s name dequantises
    everything at load. The router and the indexer's weights_proj stay float32 whatever `dtype`,
    as in transformers.

    load_mtp: the checkpoint's MTP layers (num_nextn_predict_layers, decoder layers num_layers +
    i) become model.mtp (models.dsa.mtp), in the same formats as the other layers; False (or a
    checkpoint without them) skips them and the model's config says 0.

    fp8_activations: with block-FP8 weights, w8a8 (DSAModelConfig.fp8_activations); a ValueError
    when the weights load dequantised.
    """
    weight_block(weights_dtype, None, dtype)  # a ValueError for an unknown name, before any file is read
    in_checkpoint = {}  # the config.json's MTP layer count, for _check (the model may hold fewer)

    def configure(config: DSAModelConfig, block):
        in_checkpoint["mtp"] = config.num_nextn_predict_layers
        mtp, own_head = _mtp_layers(directory, config, load_mtp)
        return config.replace(
            weight_block_size=weight_block(weights_dtype, block, dtype), num_nextn_predict_layers=mtp, mtp_own_head=own_head,
            fp8_activations=fp8_activations,
        )

    def check(checkpoint, sources, config, block):
        _check(checkpoint, sources, config, block, in_checkpoint["mtp"])

    return load_model_from_checkpoint(
        directory, config_class=DSAModelConfig, abstract_model=abstract_model, sources=_sources, check=check,
        dtype=dtype, device=device, configure=configure,
    )  # fmt: skip
