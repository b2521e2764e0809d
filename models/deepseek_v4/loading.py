"""Hugging Face DeepSeek-V4 checkpoints -> DeepseekV4ForCausalLM.

transformers 5.24.0 saves V4 under its upstream-style names (its conversion mapping run in
reverse): `model.layers.<i>.attn.wq_a.weight`, `...ffn.experts.<e>.w1.weight`, `...ffn.gate.bias`,
`model.hc_head.hc_fn`, `head.weight` (the lm head). The model's attribute paths are those names,
so the plan is: `model.` + the parameter path, `head.weight` as is, and routed experts stacked
from one tensor per expert (transposed to [in, out]). Files are read through
`models.common.checkpoint.Checkpoint` (memory-mapped safetensors, sharded or not); FP8 tensors with a
`weight_scale_inv` are dequantised per `weight_block_size` block as in the DSA loader.

Every failure raises CheckpointError (or UnsupportedModelError) naming the tensors at fault:
missing, unexpected, wrong shape, FP8 without scales, a hash table (`tid2eid`) out of range.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.deepseek_v4 import DeepseekV4Config
from models.common.checkpoint import (
    _FP8,
    _SCALE_SUFFIX,
    Checkpoint,
    CheckpointError,
    _names,
    _ParamSource,
    load_model_from_checkpoint,
    param_sources,
)
from models.deepseek_v4.model import DeepseekV4ForCausalLM

_EXPERT = re.compile(r"^(model\.layers\.\d+\.ffn\.experts)\.(w1|w2|w3)$")
_MTP = re.compile(r"^(model\.)?mtp\.")


def _sources(pure: dict, config: DeepseekV4Config) -> list[_ParamSource]:
    return param_sources(pure, config.n_routed_experts, head="head", expert_pattern=_EXPERT)


def _ignorable(name: str, config: DeepseekV4Config) -> bool:
    """Tensors the model has no place for and transformers ignores: MTP modules, a tied head."""
    if _MTP.match(name):
        return True
    layer = re.match(r"^model\.layers\.(\d+)\.", name)
    if layer and config.num_layers <= int(layer.group(1)) < config.num_layers + config.num_nextn_predict_layers:
        return True
    return config.tie_word_embeddings and name == "head.weight"


def _check(checkpoint: Checkpoint, sources: list[_ParamSource], config: DeepseekV4Config, block) -> None:
    present = checkpoint.names()
    expected = {n for s in sources for n in s.hf_names}
    scales = {n + _SCALE_SUFFIX for n in expected if n + _SCALE_SUFFIX in present}
    if missing := expected - present:
        raise CheckpointError(
            f"checkpoint {checkpoint.directory} lacks {len(missing)} tensor(s) the deepseek_v4 model needs: {_names(missing)}"
        )
    if unexpected := {n for n in present - expected - scales if not _ignorable(n, config)}:
        raise CheckpointError(
            f"checkpoint {checkpoint.directory} holds {len(unexpected)} tensor(s) this deepseek_v4 config has no place"
            f" for (wrong config.json?): {_names(unexpected)}"
        )
    wrong = [
        f"{n}: checkpoint {checkpoint.info(n).shape}, model {s.hf_shape}"
        for s in sources for n in s.hf_names if checkpoint.info(n).shape != s.hf_shape
    ]  # fmt: skip
    if wrong:
        raise CheckpointError(f"{len(wrong)} tensor shape(s) differ from config.json: {'; '.join(wrong[:6])}")
    for n in expected:
        if checkpoint.info(n).dtype in _FP8:
            if n + _SCALE_SUFFIX not in present:
                raise CheckpointError(f"FP8 tensor {n} has no {n + _SCALE_SUFFIX}")
            if block is None:
                raise CheckpointError(f"FP8 tensor {n} but config.json has no quantization_config")
        if n.endswith(".tid2eid"):
            table = np.asarray(checkpoint.read(n))
            if table.dtype.kind not in "iu" or table.min() < 0 or table.max() >= config.n_routed_experts:
                raise CheckpointError(
                    f"{n}: hash-routing table must hold expert ids in [0, {config.n_routed_experts}),"
                    f" got {table.dtype} in [{table.min()}, {table.max()}]"
                )


def abstract_model(config: DeepseekV4Config, dtype) -> DeepseekV4ForCausalLM:
    return nnx.eval_shape(lambda: DeepseekV4ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))


def load_deepseek_v4(directory: str | os.PathLike, *, dtype=jnp.bfloat16, device: jax.Device | None = None) -> DeepseekV4ForCausalLM:
    """A Hugging Face deepseek_v4 checkpoint directory -> DeepseekV4ForCausalLM in `dtype`.

    Routers, attention sinks, compressor position biases, mHC parameters and the norms stay
    float32 whatever `dtype`, as transformers keeps them."""
    return load_model_from_checkpoint(
        directory, config_class=DeepseekV4Config, abstract_model=abstract_model, sources=_sources, check=_check,
        dtype=dtype, device=device,
    )  # fmt: skip
