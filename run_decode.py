"""Greedy decoding of a Hugging Face DSA checkpoint (DeepSeek-V3.2, GLM-5.x), HiSparse on or off.

    python run_decode.py --checkpoint=DIR --prompts=prompts.npz --max_new_tokens=32 \
        --output=out.npz --dtype=bfloat16 --enable_hisparse \
        --hisparse_config='{"top_k": 2048, "device_buffer_size": 4096}'

prompts.npz holds `input_ids` int32 [B, T]; out.npz gets `tokens` int32 [B, N] and `logits`
float32 [B, N, vocab] (the logits each token was chosen from). Intentionally thin: flags, logs,
one library call (models.decoding.decode_checkpoint).
"""

import logging

import jax
import jax.numpy as jnp
from absl import app, flags

from hisparse_jax.config import HiSparseConfig
from models.decoding import decode_checkpoint

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Hugging Face checkpoint directory (config.json + *.safetensors).")
_PROMPTS = flags.DEFINE_string("prompts", None, ".npz with input_ids int32 [B, T].")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 16, "Tokens to generate per prompt.")
_OUTPUT = flags.DEFINE_string("output", None, ".npz to write tokens and logits to.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Param and KV dtype.")
_ENABLE_HISPARSE = flags.DEFINE_bool("enable_hisparse", False, "Offload the KV cache to pinned host memory.")
_HISPARSE_CONFIG = flags.DEFINE_string("hisparse_config", "", "HiSparse settings as JSON, as SGLang's --hisparse-config.")

flags.mark_flags_as_required(["checkpoint", "prompts", "output"])


def main(argv):
    del argv
    logging.info("jax %s on %s", jax.__version__, jax.devices())
    hisparse = HiSparseConfig.from_json(_HISPARSE_CONFIG.value) if _ENABLE_HISPARSE.value else None
    logging.info("hisparse: %s", hisparse.to_json() if hisparse else "off")
    decode_checkpoint(
        _CHECKPOINT.value,
        _PROMPTS.value,
        _OUTPUT.value,
        max_new_tokens=_MAX_NEW_TOKENS.value,
        dtype=jnp.dtype(_DTYPE.value),
        hisparse=hisparse,
    )
    logging.info("wrote %s", _OUTPUT.value)


if __name__ == "__main__":
    app.run(main)
