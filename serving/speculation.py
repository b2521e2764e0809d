"""run_decode.py's speculative-decoding flags (SGLang's): --speculative_algorithm=EAGLE,
--speculative_num_steps, --speculative_eagle_topk (1 only), --speculative_num_draft_tokens
-> configs.speculative.SpeculativeConfig, and what the model and the run must be for it. Each
refusal is a UsageError naming the flag (one `error:` line from run_decode.py). No JAX here.

    spec = speculative_config(values)      # values: run_decode.py's flags; None without --speculative_algorithm
    check_model(spec, config)              # a DSA model with an MTP layer
    check_serving(spec, values)            # what serving runs with it (no PD, no SYNTHETIC selection, ...)
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from configs.model import DSAModelConfig
from configs.speculative import SpeculativeConfig, SpeculativeConfigError
from serving.errors import UsageError

FLAGS = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
DEFAULT_NUM_STEPS = 3  # SGLang's choice for DeepSeek-V3 / GLM MTP (3 steps, topk 1, 4 draft tokens)


def speculative_config(values: Mapping[str, Any]) -> SpeculativeConfig | None:
    """The SpeculativeConfig the flags ask for (None: no --speculative_algorithm). Steps default
    to 3, topk to 1, draft tokens to steps + 1 (the only value with topk 1)."""
    algorithm = values.get("speculative_algorithm")
    if algorithm is None:
        if given := [name for name in FLAGS[1:] if values.get(name) is not None]:
            raise UsageError(f"--{given[0]} is not used without --speculative_algorithm=EAGLE; drop it")
        return None
    steps = values.get("speculative_num_steps")
    topk = values.get("speculative_eagle_topk")
    try:
        return SpeculativeConfig(
            num_steps=DEFAULT_NUM_STEPS if steps is None else steps, eagle_topk=1 if topk is None else topk,
            num_draft_tokens=values.get("speculative_num_draft_tokens"), algorithm=algorithm,
        )  # fmt: skip
    except SpeculativeConfigError as error:
        raise UsageError(f"--{error}") from None


def check_model(spec: SpeculativeConfig | None, config) -> None:
    """Speculation drafts with the model's MTP layer: DSA models (DeepSeek-V3.2, GLM-5.x) whose
    config counts one (num_nextn_predict_layers)."""
    if spec is None:
        return
    if not isinstance(config, DSAModelConfig):
        raise UsageError(f"--speculative_algorithm: model_type {config.model_type!r} has no MTP drafting here; DSA models only")
    if config.num_nextn_predict_layers < 1:
        raise UsageError("--speculative_algorithm=EAGLE needs the model's MTP layer; its config.json has num_nextn_predict_layers 0")


def check_serving(spec: SpeculativeConfig | None, values: Mapping[str, Any]) -> None:
    """What a serving run with speculation cannot do yet, refused by flag. values: run_decode.py's
    flags or ServingArgs' fields."""
    if spec is None:
        return
    if values["disaggregation_mode"] != "null":
        raise UsageError("--speculative_algorithm does not run with --disaggregation_mode yet; drop one of them")
    if values["tp_size"] != 1 or values["dp_size"] != 1 or values["enable_dp_attention"]:
        raise UsageError("--speculative_algorithm runs on one device yet; drop --tp_size/--dp_size/--enable_dp_attention")
    if values["synthetic_topk_overlap"] is not None:
        raise UsageError("--speculative_algorithm does not run with --synthetic_topk_overlap yet; drop one of them")
    text = values["hisparse_config"]
    if values["enable_hisparse"] and text and text.strip() and "dynamic_residency" in (json.loads(text) or {}):
        raise UsageError("--speculative_algorithm does not run with dynamic_residency (--hisparse_config) yet; drop one of them")
