"""The DeepSeek-V4 family (model_type deepseek_v4) as the registry sees it:
models.deepseek_v4.loading.load_deepseek_v4 + models.deepseek_v4.decoding.generate (HiSparse off)
/ generate_hisparse (on: the CSA "C4" entries offloaded; device_buffer_size = the device entry
buffer per request and CSA layer); served through models.deepseek_v4.runner.V4Runner. Nothing here
imports JAX at module level.
"""

from __future__ import annotations

import numpy as np

from configs.deepseek_v4 import DeepseekV4Config
from models.common.family import DecodeOutput, Family


def check_hisparse(config: DeepseekV4Config, hisparse) -> None:
    if hisparse.top_k != config.index_topk:
        raise ValueError(f"HiSparse top_k ({hisparse.top_k}) must equal the model's index_topk ({config.index_topk})")
    if not config.csa_layers:
        raise ValueError("the model has no compressed_sparse_attention layer: there is no C4 pool to offload")


def _decode(checkpoint, prompts, max_new_tokens, *, dtype, hisparse, kv_cache_dtype) -> DecodeOutput:
    import jax.numpy as jnp

    from models.deepseek_v4.decoding import generate, generate_hisparse
    from models.common.progress import load_logged
    from models.deepseek_v4.loading import load_deepseek_v4

    model = load_logged(checkpoint, lambda: load_deepseek_v4(checkpoint, dtype=dtype))
    ids = jnp.asarray(prompts, jnp.int32)
    if hisparse is None:
        tokens, logits, _ = generate(model, ids, max_new_tokens)
        misses = None
    else:
        tokens, logits, misses = generate_hisparse(model, ids, max_new_tokens, hisparse, page_size=16)
    return DecodeOutput(np.asarray(tokens, np.int32), np.asarray(logits, np.float32), misses)


def _abstract(config, dtype):
    from models.deepseek_v4.loading import abstract_model

    return abstract_model(config, dtype)


def _random(config, dtype, seed):
    from flax import nnx

    from models.deepseek_v4.model import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))


def _runner(model, **kwargs):
    from models.deepseek_v4.runner import V4Runner

    return V4Runner(model, **kwargs)


def _footprint(config, dtype, hisparse):
    from models.deepseek_v4.runner import footprint

    return footprint(config, dtype, hisparse)


FAMILY = Family(
    "deepseek_v4", ("deepseek_v4",), DeepseekV4Config.from_hf_config, lambda c: c.index_topk, False, check_hisparse,
    _decode, False, _abstract, _random, _runner, _footprint,
)  # fmt: skip
