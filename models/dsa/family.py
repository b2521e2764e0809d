"""The DSA family (DeepSeek-V3.2, GLM-5.x: model_type deepseek_v32, glm_moe_dsa) as the registry
sees it: models.dsa.loading.load_hf_checkpoint + models.dsa.generate.generate (HiSparse: every
full-indexer layer's MLA rows offloaded). Its serving runner is models.dsa.runner.ModelRunner,
built by the serving CLI; checkpoint decoding runs generate through one too, so it takes a mesh
(tensor / data-parallel) and the kernels' implementation as serving does. Nothing here imports JAX at module level; the decode function imports
the model code when called.
"""

from __future__ import annotations

from configs.model import SUPPORTED_MODEL_TYPES, DSAModelConfig
from models.common.family import DecodeOutput, Family
from models.dsa.checks import check_hisparse


def _decode(checkpoint, prompts, max_new_tokens, *, dtype, hisparse, kv_cache_dtype, parallel=None, implementation=None,
            speculative=None, weights_dtype="auto", fp8_activations=False) -> DecodeOutput:
    from models.common.progress import load_logged
    from models.dsa import loading  # its load_hf_checkpoint, looked up when called (tests patch it)
    from models.dsa.generate import generate
    from models.dsa.runner import ModelRunner

    # The MTP layer is loaded only to speculate with it (configs.speculative.SpeculativeConfig).
    model = load_logged(checkpoint, lambda: loading.load_hf_checkpoint(
        checkpoint, dtype=dtype, load_mtp=speculative is not None, weights_dtype=weights_dtype, fp8_activations=fp8_activations
    ))  # fmt: skip
    # parallel: a mesh (DP attention x TP, or TP replicas), the weights sharded over it as served
    prefetch = None if hisparse is None else hisparse.shared_prefetch  # --hisparse_config's key, else the default
    runner = ModelRunner(
        model, parallel=parallel, implementation=implementation, kv_cache_dtype=kv_cache_dtype, speculative=speculative, shared_prefetch=prefetch
    )  # fmt: skip
    out = generate(runner, prompts, max_new_tokens, hisparse=hisparse, kv_cache_dtype=kv_cache_dtype, speculative=speculative)
    return DecodeOutput(out.tokens, out.logits, out.num_misses if hisparse is not None else None, out.num_accepted)


def _abstract(config, dtype):
    from models.dsa.loading import abstract_model

    return abstract_model(config, dtype)


FAMILY = Family(
    "dsa", SUPPORTED_MODEL_TYPES, DSAModelConfig.from_hf_config, lambda c: c.index_topk, False, check_hisparse,
    _decode, True, _abstract, decodes_on_a_mesh=True,
)  # fmt: skip
