"""run_decode.py's input checks, in one place: every flag's value, which flags each mode reads,
and checkpoint decoding's files. Each refusal is a UsageError naming the flag; run_decode.py
prints it as one `error: ...` line and exits with status 2.

    check_flags(SERVING, values, present)                 # values: every flag; present: those set
    job = check_checkpoint_decode("ckpt/", "p.npz", "o.npz", max_new_tokens=32, dtype="bfloat16",
                                  enable_hisparse=True, hisparse_config="", kv_cache_dtype="fp8_e4m3")

Checks on the model's own inputs (prompt ids against the vocabulary, lengths against
max_position_embeddings, HiSparse top_k, the tensor/data-parallel split, the .npz files) live in
models.common.inputs, which the library calls too (models.dsa.generate.generate, decode_checkpoint); here
they are applied to the flags and their InputError becomes a UsageError naming the flag.
Nothing here imports JAX, so run_decode.py refuses bad input before starting it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import types
from typing import Any, Collection, Mapping

import numpy as np

from configs.deepseek_v4 import DeepseekV4Config
from configs.hf_json import read_config_json
from configs.minimax_m3 import MiniMaxM3Config
from configs.model import DSAModelConfig, fp8_weight_block
from hisparse_jax import config as hisparse_config
from hisparse_jax.config import HiSparseConfig, HiSparseConfigError
from models import registry
from models.common import inputs
from serving import speculation
from serving.errors import UsageError

MODELS = {
    "tiny": DSAModelConfig.tiny,
    "tiny_glm": DSAModelConfig.tiny_glm,
    "deepseek_v32": DSAModelConfig.deepseek_v32,
    "deepseek_v32_bench": DSAModelConfig.deepseek_v32_bench,  # its attention at full width, 4 layers x 16 experts (~6 GB)
    "glm_5_1": DSAModelConfig.glm_5_1,
    "glm_5_2": DSAModelConfig.glm_5_2,
    # served through their families' runners (models/common/runner.py), tiny sizes only
    "deepseek_v4_tiny": DeepseekV4Config.tiny,
    "minimax_m3_tiny": MiniMaxM3Config.tiny,
}
DTYPE_NAMES = ("bfloat16", "float32")
# SGLang's --kv-cache-dtype values offered here (models.dsa.decoding.create_cache also takes float32).
KV_CACHE_DTYPE_NAMES = ("auto", "bfloat16", "fp8_e4m3")
IMPLEMENTATIONS = ("reference", "pallas", "tpu")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
# --hisparse_config keys the user's JSON leaves out take these (then HiSparseConfig's, SGLang's):
# run_decode serves colocated, SGLang's host_to_device_ratio 8 (docs/background.md).
HISPARSE_DEFAULTS = {"host_to_device_ratio": 8}

# What a PD instance does not read (serving/cli.py): the decode instance serves what arrives (the
# prefill side's workload: its count, EOS and first tokens), one mode, no sweep; its context
# length comes from --random_input_len + --random_output_len (or --context_length). The prefill
# instance builds the workload and ships KV; it writes nothing and runs no engine.
PD_DECODE_UNUSED = frozenset({"num_prompts", "eos_token_id", "compare_baseline", "device_buffer_sweep"})
PD_PREFILL_UNUSED = frozenset(
    {"output_dir", "enable_hisparse", "hisparse_config", "compare_baseline", "device_buffer_sweep", "max_concurrency",
     "max_running_requests", "kv_budget_gb", "page_size", "batch_buckets", "prefill_token_budget",
     "disable_overlap_schedule", "disable_cuda_graph", "cuda_graph_max_bs",
     "synthetic_topk_overlap"}
)  # fmt: skip

# run_decode.py's modes and the flags each reads. Serving (colocated or a PD instance) reads every
# flag but checkpoint decoding's own; a flag set on the command line that the mode does not read
# is refused rather than silently ignored.
SERVING = "serving (no --prompts/--output)"
CHECKPOINT_DECODING = "checkpoint decoding (--prompts/--output)"
CHECKPOINT_DECODING_FLAGS = frozenset(
    {"checkpoint", "prompts", "output", "max_new_tokens", "dtype", "kv_cache_dtype", "enable_hisparse", "hisparse_config",
     "tp_size", "dp_size", "enable_dp_attention", "implementation", "weights_dtype", "fp8_activations"}
) | frozenset(speculation.FLAGS)  # fmt: skip
CHECKPOINT_DECODING_ONLY = frozenset({"prompts", "output", "max_new_tokens", "weights_dtype", "fp8_activations"})
WEIGHTS_DTYPE_NAMES = ("auto", "bfloat16", "float32", "fp8_e4m3")  # --weights_dtype: auto = the checkpoint's own


@contextlib.contextmanager
def flag_errors(flag: str):
    """Turns models.common.inputs' InputError into a UsageError naming `flag`."""
    try:
        yield
    except inputs.InputError as error:
        raise UsageError(f"{flag}: {error}") from None


def parse_int_list(name: str, text: str) -> tuple[int, ...]:
    """"1,4,16" -> (1, 4, 16); every entry a positive integer."""
    try:
        values = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{name} must be a comma-separated list of integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise UsageError(f"{name} entries must be positive, got {text!r}")
    return values


# ---- one rule per flag value, the same in every mode ----------------------------------------------


def _is_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _positive_int(name: str, value) -> None:
    if not _is_int(value) or value < 1:
        raise UsageError(f"--{name} must be a positive integer, got {value!r}")


def _optional_positive_int(name: str, value) -> None:
    if value is not None:
        _positive_int(name, value)


def _bool(name: str, value) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise UsageError(f"--{name} must be true or false, got {value!r}")


def _non_negative_int(name: str, value) -> None:
    if value is not None and (not _is_int(value) or value < 0):
        raise UsageError(f"--{name} must be a non-negative integer, got {value!r}")


def _fraction(name: str, value) -> None:
    if value is not None and not 0.0 <= value <= 1.0:  # NaN fails too
        raise UsageError(f"--{name} must be in [0, 1], got {value}")


def _one_of(options):
    def check(name: str, value) -> None:
        if value is not None and value not in options:
            raise UsageError(f"--{name}={value!r}: use one of {tuple(options)}")

    return check


def _model(name: str, value) -> None:
    if value not in MODELS:
        raise UsageError(f"--model={value!r} is not a built-in config; use one of {sorted(MODELS)} or --checkpoint")


def _context_length(name: str, value) -> None:
    if value is not None and (not _is_int(value) or value < 2):
        raise UsageError(f"--context_length must be an integer >= 2, got {value!r}")


def _kv_budget_gb(name: str, value) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UsageError(f"--{name} must be a positive number, got {value}")


def _int_list(name: str, value) -> None:
    if value is None:  # the flag's default, resolved later (--device_buffer_sweep: from top_k)
        return
    if isinstance(value, str):
        parse_int_list(f"--{name}", value)
    elif not all(_is_int(v) and v >= 1 for v in value):
        raise UsageError(f"--{name} entries must be positive integers, got {value!r}")


def _hisparse_json(name: str, value) -> None:
    dynamic_residency(value)  # valid JSON, an object, SGLang's spellings read


_RULES = {
    "model": _model,
    "dtype": _one_of(DTYPE_NAMES),
    "kv_cache_dtype": _one_of(KV_CACHE_DTYPE_NAMES),
    "weights_dtype": _one_of(WEIGHTS_DTYPE_NAMES),
    "implementation": _one_of(IMPLEMENTATIONS),
    "disaggregation_mode": _one_of(DISAGGREGATION_MODES),
    **dict.fromkeys(
        ("max_new_tokens", "max_running_requests", "num_prompts", "random_input_len", "random_output_len", "page_size",
         "tp_size", "dp_size"),
        _positive_int,
    ),  # fmt: skip
    **dict.fromkeys(
        ("enable_hisparse", "compare_baseline", "progress", "batch_buckets", "enable_dp_attention", "disable_overlap_schedule",
         "disable_cuda_graph"),
        _bool,
    ),  # fmt: skip
    "prefill_token_budget": _optional_positive_int,
    "cuda_graph_max_bs": _optional_positive_int,
    "seed": _non_negative_int,
    "eos_token_id": _non_negative_int,
    "context_length": _context_length,
    "kv_budget_gb": _kv_budget_gb,
    "disaggregation_timeout_s": _kv_budget_gb,  # a positive number too
    "random_range_ratio": _fraction,
    "synthetic_topk_overlap": _fraction,
    "max_concurrency": _int_list,
    "device_buffer_sweep": _int_list,
    "hisparse_config": _hisparse_json,
}


def check_flag(name: str, value) -> None:
    """The value rule of flag `name` (a run_decode.py flag or ServingArgs field); no rule, no check."""
    rule = _RULES.get(name)
    if rule is not None:
        rule(name, value)


def check_flags(mode: str, values: Mapping[str, Any], present: Collection[str]) -> None:
    """run_decode.py's flags before anything runs: every flag set on the command line (`present`)
    has a valid value whatever the mode, and is one the mode reads. values: every flag's value."""
    for name in sorted(present):
        check_flag(name, values[name])
    if mode == CHECKPOINT_DECODING:
        unused = sorted(set(present) - CHECKPOINT_DECODING_FLAGS)
        if "hisparse_config" in present and not values["enable_hisparse"]:
            raise UsageError("--hisparse_config is not used with --noenable_hisparse; drop one of them")
    else:
        unused = sorted(set(present) & CHECKPOINT_DECODING_ONLY)
        if "model" in present and values["checkpoint"] is not None:
            raise UsageError("--model is not used with --checkpoint (its config.json is the model); drop one of them")
        pd = values.get("disaggregation_mode", "null")  # values: every flag's, or (tests) the ones that matter
        for name in ("disaggregation_address", "disaggregation_timeout_s"):
            if name in present and pd == "null":
                raise UsageError(f"--{name} is not used without --disaggregation_mode=prefill|decode")
        if pd != "null":
            unused = sorted(set(unused) | (set(present) & (PD_DECODE_UNUSED if pd == "decode" else PD_PREFILL_UNUSED)))
            mode = f"a PD {pd} instance (--disaggregation_mode={pd})"
        if pd == "decode" and "max_concurrency" in present and len(parse_int_list("--max_concurrency", values["max_concurrency"])) > 1:
            raise UsageError("--max_concurrency: a PD decode instance takes one value (requests in flight at most), not a sweep")
        if "device_buffer_sweep" in present and not values.get("enable_hisparse", True):
            raise UsageError("--device_buffer_sweep needs --enable_hisparse (it sweeps HiSparse's buffer); drop one of them")
        check_residency_serving(values)
        if values["checkpoint"] is None:
            check_family_serving(MODELS[values["model"]](), values)
    if unused:
        names = ", ".join(f"--{name}" for name in unused)
        raise UsageError(f"{names} {'is' if len(unused) == 1 else 'are'} not used by {mode}; drop {'it' if len(unused) == 1 else 'them'}")


# ---- settings that depend on the model ------------------------------------------------------------

_FAMILY_NAMES = {"deepseek_v4": "DeepSeek-V4", "minimax_m3": "MiniMax-M3"}


def check_family_serving(config, values: Mapping[str, Any]) -> None:
    """Serving flags a DeepSeek-V4 / MiniMax-M3 runner (models/common/runner.py) cannot honour,
    refused by name; DSA configs pass. values: run_decode.py's flag values or ServingArgs' fields."""
    family = registry.family_of_config(config)
    if family.make_runner is None:
        return
    name = _FAMILY_NAMES.get(family.name, family.name)
    with flag_errors("--kv_cache_dtype"):
        registry.check_kv_cache_dtype(values["kv_cache_dtype"], config, values["dtype"])
    if values["tp_size"] != 1 or values["dp_size"] != 1 or values["enable_dp_attention"]:
        raise UsageError(f"--tp_size/--dp_size/--enable_dp_attention: {name} serving runs on one device; drop them")
    if values["disaggregation_mode"] != "null":
        raise UsageError(f"--disaggregation_mode={values['disaggregation_mode']}: {name} serving is colocated only; drop it")
    if values["synthetic_topk_overlap"] is not None:
        raise UsageError(f"--synthetic_topk_overlap: SYNTHETIC selection drives DSA indexers only, not {name}'s; drop it")
    if values["prefill_token_budget"] is not None:
        raise UsageError(f"--prefill_token_budget: {name} serving prefills each prompt whole (one forward pass); drop it")
    if values["batch_buckets"]:
        raise UsageError(f"--batch_buckets: {name} serving decodes all --max_running_requests slots each step; drop it")
    if values["enable_hisparse"] and dynamic_residency(values["hisparse_config"]):
        raise UsageError(f"--hisparse_config: dynamic_residency is not supported by {name} serving yet; drop it")


def dynamic_residency(text: str) -> bool:
    """Whether --hisparse_config asks for dynamic residency (either spelling); no model needed."""
    try:
        return hisparse_config.normalized(_hisparse_values(text)).get("dynamic_residency") is not None
    except HiSparseConfigError as error:
        raise UsageError(f"--hisparse_config: {error}") from None


def check_residency_serving(values: Mapping[str, Any]) -> None:
    """Dynamic residency keeps one device pool of pages per engine: one device only, for now."""
    if not values.get("enable_hisparse", True) or not dynamic_residency(values.get("hisparse_config", "")):
        return
    if values["tp_size"] != 1 or values["dp_size"] != 1 or values["enable_dp_attention"]:
        raise UsageError("--hisparse_config: dynamic_residency runs on one device only yet; drop --tp_size/--dp_size/--enable_dp_attention")


def _hisparse_values(text: str) -> dict:
    try:
        values = json.loads(text) if text and text.strip() else {}
    except json.JSONDecodeError as error:
        raise UsageError(f"--hisparse_config is not valid JSON: {error}") from None
    if not isinstance(values, dict):
        raise UsageError(f"--hisparse_config must be a JSON object, got {text!r}")
    return values


def resolve_hisparse_config(text: str, model) -> HiSparseConfig:
    """`--hisparse_config` JSON with top_k defaulting to the model's selection width (and
    device_buffer_size to 2 x top_k, as SGLang), host_to_device_ratio to run_decode's 8
    (HISPARSE_DEFAULTS: a key the JSON leaves out keeps it); a top_k other than the model's is
    refused. SGLang's flat dynamic_residency_* keys are read too (hisparse_jax.config.normalized).

    The selection width is the family's (models.registry): index_topk for DSA models and
    DeepSeek-V4; for MiniMax-M3 it is fixed by the model (index_topk_blocks x index_block_size)
    and a top_k is not applied to it. device_buffer_size is the family's device buffer: DSA, the
    hot rows per request and layer; DeepSeek-V4, the C4 entry buffer per request and CSA layer;
    MiniMax-M3, the working set per request, KV group and sparse layer."""
    values = {**HISPARSE_DEFAULTS, **_hisparse_values(text)}
    values.setdefault("top_k", registry.family_of_config(model).selection_width(model))
    try:
        hisparse = HiSparseConfig.from_dict(values)
    except HiSparseConfigError as error:
        raise UsageError(f"--hisparse_config: {error}") from None
    with flag_errors("--hisparse_config"):
        registry.check_hisparse(hisparse, model)
    return hisparse


def checkpoint_config(checkpoint: str, *, decoding: bool = False):
    """The architecture of --checkpoint (its config.json), no weights. Serving (decoding False)
    takes DSA checkpoints only: DeepSeek-V4 and MiniMax-M3 decode through checkpoint decoding."""
    with flag_errors("--checkpoint"):
        config = registry.load_config(checkpoint)
    if not decoding and not isinstance(config, DSAModelConfig):
        raise UsageError(
            f"--checkpoint: model_type {config.model_type!r} is served only by checkpoint decoding"
            " (--prompts=FILE.npz --output=FILE.npz); serving runs DSA models (deepseek_v32, glm_moe_dsa)"
        )
    return config


# ---- checkpoint decoding --------------------------------------------------------------------------


def checkpoint_is_fp8(checkpoint: str) -> bool:
    """Whether --checkpoint's config.json declares block-FP8 weights (configs.model.fp8_weight_block)."""
    try:
        return fp8_weight_block(read_config_json(checkpoint)) is not None
    except (OSError, ValueError) as error:  # checkpoint_config read it already: a file changed since
        raise UsageError(f"--checkpoint: {error}") from None


def parallel_split(tp_size: int, dp_size: int, enable_dp_attention: bool) -> types.SimpleNamespace:
    """hisparse_jax.sharding.ParallelConfig's arithmetic without importing JAX (what
    inputs.check_parallel reads); an inconsistent combination is a UsageError."""
    if enable_dp_attention and tp_size % dp_size:
        raise UsageError(f"--tp_size/--dp_size/--enable_dp_attention: with enable_dp_attention, tp_size ({tp_size}) must be a multiple of dp_size ({dp_size})")
    devices = tp_size if enable_dp_attention else tp_size * dp_size
    return types.SimpleNamespace(
        tp_size=tp_size, dp_size=dp_size, enable_dp_attention=enable_dp_attention, num_devices=devices,
        attention_tp=tp_size // dp_size if enable_dp_attention else tp_size, is_single_device=devices == 1,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CheckpointDecode:
    """Checkpoint decoding's inputs, checked (check_checkpoint_decode); the weights not yet loaded."""

    checkpoint: str
    prompts: str  # .npz with input_ids [B, T], ids within the model's vocabulary
    output: str  # .npz to write, exactly this path
    max_new_tokens: int
    dtype: str
    hisparse: HiSparseConfig | None
    config: Any  # the family's config class (models.registry)
    prompts_shape: tuple[int, int]
    kv_cache_dtype: str = "auto"
    tp_size: int = 1  # a mesh as serving's (hisparse_jax.sharding.ParallelConfig); DSA checkpoints only
    dp_size: int = 1
    enable_dp_attention: bool = False
    implementation: str | None = None  # the kernels (None: the backend's default); DSA checkpoints only
    speculative: Any = None  # a configs.speculative.SpeculativeConfig (serving.speculation), None: plain greedy
    weights_dtype: str = "auto"  # DSA: models.dsa.loading.load_hf_checkpoint's (block FP8 or dequantised)
    fp8_activations: bool = False  # DSA with block-FP8 weights: w8a8 (DSAModelConfig.fp8_activations)

    @property
    def num_devices(self) -> int:
        return parallel_split(self.tp_size, self.dp_size, self.enable_dp_attention).num_devices


def check_checkpoint_decode(
    checkpoint: str | None,
    prompts: str | None,
    output: str | None,
    *,
    max_new_tokens: int,
    dtype: str,
    enable_hisparse: bool,
    hisparse_config: str,
    kv_cache_dtype: str = "auto",
    tp_size: int = 1,
    dp_size: int = 1,
    enable_dp_attention: bool = False,
    implementation: str | None = None,
    speculative=None,
    weights_dtype: str = "auto",
    fp8_activations: bool = False,
) -> CheckpointDecode:
    """Everything checkpoint decoding reads, checked against the checkpoint's config.json before
    any weight is loaded (or JAX started). A mesh (tp_size, dp_size, enable_dp_attention, as
    serving's) and implementation are taken by DSA checkpoints (registry: decodes_on_a_mesh);
    speculative: serving.speculation.speculative_config's (one device only)."""
    if checkpoint is None:
        raise UsageError(f"{CHECKPOINT_DECODING} needs --checkpoint=DIR")
    if prompts is None or output is None:
        raise UsageError("checkpoint decoding needs --prompts=FILE.npz and --output=FILE.npz (or drop them to serve a random workload)")
    checked = (("max_new_tokens", max_new_tokens), ("dtype", dtype), ("kv_cache_dtype", kv_cache_dtype), ("hisparse_config", hisparse_config),
               ("tp_size", tp_size), ("dp_size", dp_size), ("enable_dp_attention", enable_dp_attention), ("implementation", implementation),
               ("weights_dtype", weights_dtype))  # fmt: skip
    for name, value in checked:
        check_flag(name, value)
    with flag_errors("--output"):
        inputs.check_output_path(output)
    config = checkpoint_config(checkpoint, decoding=True)
    with flag_errors("--kv_cache_dtype"):
        registry.check_kv_cache_dtype(kv_cache_dtype, config, dtype)
    if weights_dtype not in ("auto", dtype) and (registry.family_of_config(config).name != "dsa" or weights_dtype != "fp8_e4m3"):
        raise UsageError(
            f"--weights_dtype={weights_dtype}: DSA checkpoints take auto, fp8_e4m3 or --dtype's name ({dtype});"
            " DeepSeek-V4 and MiniMax-M3 checkpoints load in --dtype (auto)"
        )
    if fp8_activations:
        fp8_weights = weights_dtype == "fp8_e4m3" or (weights_dtype == "auto" and checkpoint_is_fp8(checkpoint))
        if registry.family_of_config(config).name != "dsa" or not fp8_weights:
            raise UsageError(
                "--fp8_activations needs a DSA checkpoint with block-FP8 weights: an FP8 checkpoint with --weights_dtype=auto,"
                " or --weights_dtype=fp8_e4m3"
            )
    with flag_errors("--prompts"):
        ids = inputs.check_prompts(inputs.read_prompts(prompts), config, name=f"{prompts} input_ids")
    with flag_errors("--max_new_tokens"):
        inputs.check_context(ids.shape[1], max_new_tokens, config)
    hisparse = resolve_hisparse_config(hisparse_config, config) if enable_hisparse else None
    split = parallel_split(tp_size, dp_size, enable_dp_attention)
    if not registry.family_of_config(config).decodes_on_a_mesh:
        name = _FAMILY_NAMES.get(registry.family_of_config(config).name, config.model_type)
        if not split.is_single_device:
            raise UsageError(f"--tp_size/--dp_size/--enable_dp_attention: {name} checkpoint decoding runs on one device; drop them")
        if implementation is not None:
            raise UsageError(f"--implementation: {name} checkpoint decoding runs its default kernels; drop it")
    with flag_errors("--tp_size/--dp_size/--enable_dp_attention"):
        inputs.check_parallel(config, split, num_requests=ids.shape[0], requests=f"prompts (rows of {prompts} input_ids)")
    speculation.check_model(speculative, config)
    if speculative is not None and not split.is_single_device:
        raise UsageError("--speculative_algorithm: speculative decoding runs on one device yet; drop --tp_size/--dp_size/--enable_dp_attention")
    return CheckpointDecode(
        checkpoint, prompts, output, max_new_tokens, dtype, hisparse, config, ids.shape, kv_cache_dtype, tp_size, dp_size,
        enable_dp_attention, implementation, speculative, weights_dtype, fp8_activations,
    )  # fmt: skip
