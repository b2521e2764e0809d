"""The DSA family (DeepSeek-V3.2, GLM-5.x: model_type deepseek_v32, glm_moe_dsa) as the registry
sees it: models.dsa.loading.load_hf_checkpoint + models.dsa.generate.generate (HiSparse: every
full-indexer layer's MLA rows offloaded). Its serving runner is models.dsa.runner.ModelRunner,
built by the serving CLI. Nothing here imports JAX at module level; the decode function imports
the model code when called.
"""

from __future__ import annotations

from configs.model import SUPPORTED_MODEL_TYPES, DSAModelConfig
from models.common.family import DecodeOutput, Family
from models.dsa.checks import check_hisparse


def _decode(checkpoint, prompts, max_new_tokens, *, dtype, hisparse, kv_cache_dtype, speculative=None) -> DecodeOutput:
    from models.dsa import loading  # its load_hf_checkpoint, looked up when called (tests patch it)
    from models.dsa.generate import generate

    # The MTP layer is loaded only to speculate with it (configs.speculative.SpeculativeConfig).
    model = loading.load_hf_checkpoint(checkpoint, dtype=dtype, load_mtp=speculative is not None)
    out = generate(model, prompts, max_new_tokens, hisparse=hisparse, kv_cache_dtype=kv_cache_dtype, speculative=speculative)
    return DecodeOutput(out.tokens, out.logits, out.num_misses if hisparse is not None else None, out.num_accepted)


def _abstract(config, dtype):
    from models.dsa.loading import abstract_model

    return abstract_model(config, dtype)


FAMILY = Family(
    "dsa", SUPPORTED_MODEL_TYPES, DSAModelConfig.from_hf_config, lambda c: c.index_topk, False, check_hisparse,
    _decode, True, _abstract,
)  # fmt: skip
