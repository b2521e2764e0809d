"""The MiniMax-M3 family (model_type minimax_m3_vl_text, minimax_m3_vl) as the registry sees it:
models.minimax_m3.loading.load_hf_checkpoint + models.minimax_m3.model.generate (off) /
models.minimax_m3.hisparse.generate_hisparse (on: the sparse layers' K/V offloaded;
device_buffer_size = the working set per request, KV group and sparse layer, >= the selection
width); served through models.minimax_m3.runner.M3Runner. Its selection width is fixed by the
model (index_topk_blocks x index_block_size). Nothing here imports JAX at module level.
"""

from __future__ import annotations

import numpy as np

from configs.minimax_m3 import TEXT_MODEL_TYPE, VL_MODEL_TYPE, MiniMaxM3Config
from models.common.family import DecodeOutput, Family


def check_hisparse(config: MiniMaxM3Config, hisparse) -> None:
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


def _decode(checkpoint, prompts, max_new_tokens, *, dtype, hisparse, kv_cache_dtype) -> DecodeOutput:
    import jax.numpy as jnp

    from models.minimax_m3.hisparse import generate_hisparse
    from models.minimax_m3.loading import load_hf_checkpoint
    from models.minimax_m3.model import generate
    from models.common.progress import load_logged

    model = load_logged(checkpoint, lambda: load_hf_checkpoint(checkpoint, dtype=dtype))
    ids = jnp.asarray(prompts, jnp.int32)
    if hisparse is None:
        tokens, logits = generate(model, ids, max_new_tokens)
        misses = None
    else:
        tokens, logits, misses = generate_hisparse(model, ids, max_new_tokens, hisparse)
    return DecodeOutput(np.asarray(tokens, np.int32), np.asarray(logits, np.float32), misses)


def _abstract(config, dtype):
    from models.minimax_m3.loading import abstract_model

    return abstract_model(config, dtype)


def _random(config, dtype, seed):
    from flax import nnx

    from models.minimax_m3.model import MiniMaxM3ForCausalLM

    return MiniMaxM3ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))


def _runner(model, **kwargs):
    from models.minimax_m3.runner import M3Runner

    return M3Runner(model, **kwargs)


def _footprint(config, dtype, hisparse):
    from models.minimax_m3.runner import footprint

    return footprint(config, dtype, hisparse)


FAMILY = Family(
    "minimax_m3", (TEXT_MODEL_TYPE, VL_MODEL_TYPE), MiniMaxM3Config.from_hf_config, lambda c: c.selected_keys, True,
    check_hisparse, _decode, False, _abstract, _random, _runner, _footprint,
)  # fmt: skip
