"""DSAModelConfig: the architecture of a DeepSeek-Sparse-Attention model, frozen and validated.

Two Hugging Face model types are supported, with the semantics of transformers 5.24.0:
  deepseek_v32  DeepSeek-V3.2: every layer runs its own lightning indexer, whose RoPE is the
                half-split (non-interleaved) form; YaRN RoPE.
  glm_moe_dsa   GLM-5.x: `indexer_types` marks layers "full" (own indexer) or "shared" (reuse
                the previous full layer's top-k); the indexer's RoPE is interleaved.

    DSAModelConfig.deepseek_v32()          # real sizes, from the public config.json files
    DSAModelConfig.from_hf_config(path)    # a checkpoint's config.json (file, dir or dict)
    DSAModelConfig.tiny()                  # test sizes
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

from configs.hf_json import read_config_json

SUPPORTED_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
_ROPE_TYPES = ("default", "yarn")


class UnsupportedModelError(ValueError):
    """A config.json describes a model or a feature this package does not implement."""


def fp8_weight_block(raw_config: Mapping[str, Any]) -> tuple[int, int] | None:
    """A config.json's block-FP8 weights: (b0, b1) from its quantization_config (128 x 128 when
    it names none), None without one; an UnsupportedModelError for another quant_method."""
    quant = raw_config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise UnsupportedModelError(
            f"quantization_config.quant_method {method!r} is not supported; only block FP8 ('fp8') checkpoints load"
        )
    block = quant.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies (transformers `rope_parameters`); only theta matters for "default"."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0  # YaRN: context extension factor
    original_max_position_embeddings: int = 4096  # YaRN: pretraining context
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # YaRN cos/sin scale; derived from mscale when None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in _ROPE_TYPES:
            raise UnsupportedModelError(f"rope_type {self.rope_type!r} is not supported; use one of {_ROPE_TYPES}")
        if self.theta <= 0:
            raise ValueError(f"{self.theta=} must be positive")
        if self.rope_type == "yarn" and self.factor <= 0:
            raise ValueError(f"{self.factor=} must be positive for YaRN")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class DSAModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int  # each routed / shared expert
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int  # the latent: value part of each KV row
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]  # per layer: "dense" or "sparse" (MoE)
    indexer_types: tuple[str, ...]  # per layer: "full" or "shared"
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_rope_interleave: bool  # False: half-split RoPE (DeepSeek), True: interleaved (GLM)
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # MTP (multi-token prediction) layers: stored after the model's layers (decoder layer
    # num_layers + i), held by the model (models.dsa.mtp) and loaded with it; 0: none.
    num_nextn_predict_layers: int = 0
    # Whether each MTP layer has its own output head (`shared_head.head`); False: it uses the main
    # lm_head (a checkpoint that leaves it out, as transformers and SGLang allow).
    mtp_own_head: bool = True
    # None: weights in the model dtype. (b0, b1): block FP8 (DeepSeek's FP8 checkpoints: float8_e4m3fn
    # values, one f32 scale per b0 x b1 block of each [out, in] weight) for the linear layers and
    # routed experts, kept fp8 on the device (models.common.fp8); kv_b_proj (absorbed into the
    # queries), the indexer's weights_proj, the router, embeddings and lm_head stay in the model dtype.
    weight_block_size: tuple[int, int] | None = None
    # With block-FP8 weights: quantise the activations to e4m3 (per row and 128-wide block) before
    # each fp8-weight matmul and multiply on fp8 tensor cores (w8a8: the checkpoints'
    # "activation_scheme": "dynamic", as DeepSeek's inference code and SGLang run them; ~3% per
    # activation). False: the numbers of the weights dequantised at load, the reference
    # implementation's (pallas_kernels.grouped_matmul, "fp8_activations"). Over fp8 indexer keys
    # (--kv_cache_dtype=fp8_e4m3) the indexer's queries are quantised too, one scale per (token,
    # head), and q . k runs fp8 x fp8, as DeepSeek's inference code scores (act_quant, fp8_index);
    # and in a 16-bit model MLA's value lift multiplies in that dtype (models.dsa.mla.output).
    fp8_activations: bool = False

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
            )
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_layers",
            "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
            "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.n_shared_experts < 0 or self.num_nextn_predict_layers < 0:
            raise ValueError(f"{self.n_shared_experts=} and {self.num_nextn_predict_layers=} must be >= 0")
        for name, allowed in (("mlp_layer_types", ("dense", "sparse")), ("indexer_types", ("full", "shared"))):
            types = getattr(self, name)
            if len(types) != self.num_layers:
                raise ValueError(f"{name} has {len(types)} entries, expected num_layers={self.num_layers}")
            if bad := sorted(set(types) - set(allowed)):
                raise ValueError(f"{name} holds {bad}; allowed values are {allowed}")
        if self.indexer_types[0] != "full":
            raise ValueError("indexer_types[0] must be 'full': a shared layer reuses an earlier full layer")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{self.qk_rope_head_dim=} must be even (RoPE rotates pairs)")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"{self.index_head_dim=} must be >= {self.qk_rope_head_dim=}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"{self.n_routed_experts=} must be divisible by {self.n_group=}")
        if self.n_routed_experts // self.n_group < 2:
            # The reference scores a group by the sum of its two best experts.
            raise ValueError(f"each of {self.n_group=} expert groups needs >= 2 experts")
        if not self.topk_group <= self.n_group:
            raise ValueError(f"{self.topk_group=} must be <= {self.n_group=}")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError(f"{self.num_experts_per_tok=} exceeds the experts of {self.topk_group=} groups")
        block = self.weight_block_size
        if block is not None and (len(block) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)):
            raise ValueError(f"weight_block_size={block!r} must be None or two positive integers")
        if self.fp8_activations and block is None:
            raise ValueError("fp8_activations needs block-FP8 weights (weight_block_size)")

    # ---- derived sizes -------------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_width(self) -> int:
        """Elements of an absorbed-MLA KV row: latent then rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA logit scale: qk_head_dim^-0.5, times YaRN's mscale(mscale_all_dim)^2 when set."""
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            mscale = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * mscale * mscale
        return scale

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        """Layers that run their own indexer, in order; their keys fill the indexer cache."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    def shared_layers_after(self, layer: int) -> tuple[int, ...]:
        """The shared-index layers that follow full layer `layer` and reuse its top-k (IndexShare)."""
        shared = []
        for l in range(layer + 1, self.num_layers):
            if self.indexer_types[l] != "shared":
                break
            shared.append(l)
        return tuple(shared)

    def indexer_cache_index(self, layer: int) -> int:
        """Row of the indexer key cache [L_full, ...] that full layer `layer` owns."""
        return self.full_indexer_layers.index(layer)

    def anchor_layer(self, layer: int) -> int:
        """The full layer whose top-k `layer` uses: itself if full, else the previous full one."""
        return max(i for i in self.full_indexer_layers if i <= layer)

    # ---- construction --------------------------------------------------------------------------

    def replace(self, **changes) -> "DSAModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "DSAModelConfig":
        """Inverse of to_dict (e.g. the copy stored next to converted params)."""
        values = dict(values)
        values["rope"] = RopeConfig(**values["rope"])
        for name in ("mlp_layer_types", "indexer_types"):
            values[name] = tuple(values[name])
        if values.get("weight_block_size") is not None:
            values["weight_block_size"] = tuple(values["weight_block_size"])
        return cls(**values)

    @classmethod
    def from_hf_config(cls, source: str | os.PathLike | Mapping[str, Any]) -> "DSAModelConfig":
        """From a Hugging Face config.json: a dict, the file, or the checkpoint directory.

        Missing fields take the defaults of transformers' config class for the model type, as
        `from_pretrained` would.
        """
        raw = read_config_json(source)
        return _from_hf_dict(raw)

    # ---- named configs -------------------------------------------------------------------------

    @classmethod
    def deepseek_v32(cls) -> "DSAModelConfig":
        """deepseek-ai/DeepSeek-V3.2 (config.json of the -Exp and final releases)."""
        return cls.from_hf_config(
            dict(
                model_type="deepseek_v32", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
                num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True,
                routed_scaling_factor=2.5, first_k_dense_replace=3, index_n_heads=64,
                index_head_dim=128, index_topk=2048, rms_norm_eps=1e-6, max_position_embeddings=163840,
                rope_theta=10000,
                rope_scaling=dict(
                    type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                    beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
                ),
                num_nextn_predict_layers=1, tie_word_embeddings=False,
            )
        )  # fmt: skip

    @classmethod
    def deepseek_v32_bench(cls, num_layers: int = 4, num_experts: int = 16) -> "DSAModelConfig":
        """DeepSeek-V3.2's attention at full width (128 heads, 576-wide latent rows, indexer 64 x 128,
        top_k 2048), hidden 7168, vocab 129,280, on `num_layers` layers (one dense, then MoE with
        `num_experts` routed experts, top-8), no MTP layer: the serving benchmarks' model, ~6 GB of
        bf16 weights at 4 x 16. Real KV row sizes on one GPU (the full model needs hundreds of GB)."""
        L = num_layers
        return cls.deepseek_v32().replace(
            num_layers=L, mlp_layer_types=("dense",) + ("sparse",) * (L - 1), indexer_types=("full",) * L,
            n_routed_experts=num_experts, n_group=8, topk_group=4, num_nextn_predict_layers=0,
        )  # fmt: skip

    @classmethod
    def glm_5_1(cls) -> "DSAModelConfig":
        """zai-org/GLM-5.1 (GLM-5 architecture): every layer runs its indexer."""
        return cls.from_hf_config(
            dict(
                _GLM5_COMMON,
                max_position_embeddings=202752,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            )
        )

    @classmethod
    def glm_5_2(cls) -> "DSAModelConfig":
        """zai-org/GLM-5.2: IndexShare, a full indexer every 4th layer from layer 2 (21 of 78)."""
        return cls.from_hf_config(
            dict(
                _GLM5_COMMON,
                max_position_embeddings=1048576,
                rope_parameters=dict(rope_type="default", rope_theta=8000000.0),
                index_topk_freq=4,
                index_skip_topk_offset=3,
            )
        )

    @classmethod
    def tiny(cls) -> "DSAModelConfig":
        """DeepSeek-style test model: the dims of tests/fixtures/deepseek_v32_tiny."""
        return cls.from_hf_config(
            dict(
                model_type="deepseek_v32", vocab_size=512, hidden_size=64, intermediate_size=128,
                moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=48,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, first_k_dense_replace=1, index_n_heads=4, index_head_dim=32,
                index_topk=16, max_position_embeddings=512, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            )
        )  # fmt: skip

    @classmethod
    def tiny_glm(cls) -> "DSAModelConfig":
        """GLM-style test model (tests/fixtures/glm_moe_dsa_tiny): shared indexer layers
        (full, full, shared, full, shared), YaRN with a cos/sin attention factor != 1."""
        return cls.from_hf_config(
            dict(
                model_type="glm_moe_dsa", vocab_size=384, hidden_size=64, intermediate_size=96,
                moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4, q_lora_rank=32,
                kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=32,
                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                routed_scaling_factor=2.5, first_k_dense_replace=2, index_n_heads=2, index_head_dim=16,
                index_topk=8, index_topk_freq=2, index_skip_topk_offset=2, max_position_embeddings=256,
                rope_parameters=dict(
                    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                    mscale=1.0, mscale_all_dim=0.8,
                ),
            )
        )  # fmt: skip


_GLM5_COMMON = dict(
    model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
    moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64,
    q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3, index_n_heads=32,
    index_head_dim=128, index_topk=2048, indexer_rope_interleave=True, rms_norm_eps=1e-5,
    num_nextn_predict_layers=1, tie_word_embeddings=False,
)  # fmt: skip

# transformers 5.24.0 config-class defaults, applied to fields a config.json leaves out.
_HF_DEFAULTS = {
    "deepseek_v32": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6, index_topk=2048,
        index_head_dim=128, index_n_heads=64, first_k_dense_replace=3,
    ),
    "glm_moe_dsa": dict(
        vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=78, num_attention_heads=64, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64,
        v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=202752, rms_norm_eps=1e-5, index_topk=2048,
        index_head_dim=128, index_n_heads=32, first_k_dense_replace=3,
    ),
}  # fmt: skip


def _from_hf_dict(raw: dict[str, Any]) -> DSAModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
        )
    if "q_lora_rank" in raw and raw["q_lora_rank"] is None:
        raise UnsupportedModelError("q_lora_rank null (no query LoRA) is not supported")
    c = dict(_HF_DEFAULTS[model_type])
    c.update({k: v for k, v in raw.items() if v is not None})

    # Features the reference has but no released DSA checkpoint uses are refused, not guessed.
    if c.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {c['hidden_act']!r} is not supported; only 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag, False):
            raise UnsupportedModelError(f"{flag}=true is not supported")
    if c.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedModelError(f"scoring_func {c['scoring_func']!r} is not supported; only 'sigmoid'")
    heads = c["num_attention_heads"]
    if c.get("num_key_value_heads", heads) != heads:
        raise UnsupportedModelError(f"MLA needs num_key_value_heads == num_attention_heads ({heads})")

    layers = c["num_hidden_layers"]
    mlp_types = c.get("mlp_layer_types")
    if mlp_types is None:
        n_dense = min(c["first_k_dense_replace"], layers)
        mlp_types = ["dense"] * n_dense + ["sparse"] * (layers - n_dense)

    if model_type == "glm_moe_dsa":
        indexer_types = c.get("indexer_types")
        if indexer_types is None:
            pattern = c.get("index_topk_pattern")
            if pattern is not None:
                if isinstance(pattern, str):
                    if bad := sorted(set(pattern) - {"F", "S"}):
                        raise ValueError(f"index_topk_pattern holds {bad}; use 'F' (full) and 'S' (shared)")
                    indexer_types = [{"F": "full", "S": "shared"}[ch] for ch in pattern]
                else:
                    indexer_types = list(pattern)
            else:
                freq = max(c.get("index_topk_freq", 1), 1)
                offset = c.get("index_skip_topk_offset", 2)
                indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
        interleave_default = True
    else:
        indexer_types = ["full"] * layers  # deepseek_v32 has no index sharing
        interleave_default = False

    return DSAModelConfig(
        model_type=model_type,
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        moe_intermediate_size=c["moe_intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        q_lora_rank=c["q_lora_rank"],
        kv_lora_rank=c["kv_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        n_routed_experts=c.get("num_experts", c["n_routed_experts"]),
        n_shared_experts=c["n_shared_experts"],
        num_experts_per_tok=c["num_experts_per_tok"],
        n_group=c["n_group"],
        topk_group=c["topk_group"],
        norm_topk_prob=bool(c["norm_topk_prob"]),
        routed_scaling_factor=float(c["routed_scaling_factor"]),
        mlp_layer_types=tuple(mlp_types),
        indexer_types=tuple(indexer_types),
        index_n_heads=c["index_n_heads"],
        index_head_dim=c["index_head_dim"],
        index_topk=c["index_topk"],
        indexer_rope_interleave=bool(c.get("indexer_rope_interleave", interleave_default)),
        rms_norm_eps=float(c["rms_norm_eps"]),
        rope=_rope_from_hf(c),
        max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=c.get("num_nextn_predict_layers", 0),
    )


def _rope_from_hf(c: Mapping[str, Any]) -> RopeConfig:
    """transformers' RoPE standardisation: `rope_parameters`, else legacy `rope_scaling` + `rope_theta`."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig(rope_type="default", theta=theta)
    if rope_type != "yarn":
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported; use one of {_ROPE_TYPES}")
    original = params.get("original_max_position_embeddings", c["max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        factor = c["max_position_embeddings"] / original
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
