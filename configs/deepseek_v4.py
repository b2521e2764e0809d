"""DeepseekV4Config: the architecture of a DeepSeek-V4 model, frozen and validated.

Hugging Face model type `deepseek_v4`, with the semantics of transformers 5.24.0
(`models/deepseek_v4/configuration_deepseek_v4.py`): per-layer attention types

    sliding_attention             window of `sliding_window` keys only
    compressed_sparse_attention   CSA: window + the lightning indexer's top-k of the entries that
                                  compress 4 tokens each (overlapping windows of 2 x 4)
    heavily_compressed_attention  HCA: window + every causal entry of m' = 128 tokens each

(or the legacy per-layer `compress_ratios` 0 / 4 / 128), per-layer MoE routing (`hash_moe`: a
token-id -> experts table; `moe`: sqrt-softplus scores, top-k), two RoPE parameter sets (`main`
for sliding layers, `compress` for CSA/HCA attention, compressors and the indexer).

    DeepseekV4Config.v4_flash()          # released size (config-class defaults)
    DeepseekV4Config.from_hf_config(p)   # a checkpoint's config.json (file, dir or dict)
    DeepseekV4Config.tiny()              # tests/fixtures/deepseek_v4_tiny
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from configs.hf_json import read_config_json
from configs.model import RopeConfig, UnsupportedModelError

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
SLIDING, CSA, HCA = LAYER_TYPES
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
_COMPRESS_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads; one shared K=V head of head_dim
    head_dim: int
    qk_rope_head_dim: int  # trailing channels of every head (and indexer head) that RoPE rotates
    q_lora_rank: int
    o_groups: int  # grouped output projection: o_groups blocks of num_heads*head_dim/o_groups ...
    o_lora_rank: int  # ... each projected to o_lora_rank, then o_b mixes o_groups*o_lora_rank
    sliding_window: int
    layer_types: tuple[str, ...]  # per layer, one of LAYER_TYPES
    mlp_layer_types: tuple[str, ...]  # per layer, one of MLP_LAYER_TYPES
    csa_rate: int  # m: tokens per CSA entry (entries pool 2m tokens, stride m)
    hca_rate: int  # m': tokens per HCA entry (non-overlapping)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int  # mHC residual streams
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # each routed expert and the one shared expert
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    rope_main: RopeConfig  # sliding layers
    rope_compress: RopeConfig  # CSA/HCA attention, compressors, indexer
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # MTP layers in the checkpoint; not loaded
    model_type: str = "deepseek_v4"

    def __post_init__(self):
        if self.model_type != "deepseek_v4":
            raise UnsupportedModelError(f"model_type {self.model_type!r} is not 'deepseek_v4'")
        for name in (
            "vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "qk_rope_head_dim",
            "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "csa_rate", "hca_rate",
            "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            types = getattr(self, name)
            if len(types) != self.num_layers:
                raise ValueError(f"{name} has {len(types)} entries, expected num_layers={self.num_layers}")
            if bad := sorted(set(types) - set(allowed)):
                raise ValueError(f"{name} holds {bad}; allowed values are {allowed}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{self.qk_rope_head_dim=} must be even (RoPE rotates pairs)")
        if self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(f"{self.qk_rope_head_dim=} must be <= {self.head_dim=} and {self.index_head_dim=}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"{self.num_heads=} x {self.head_dim=} must be divisible by {self.o_groups=}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"{self.num_experts_per_tok=} must be <= {self.n_routed_experts=}")
        if self.scoring_func not in SCORING_FUNCS:
            raise UnsupportedModelError(f"scoring_func {self.scoring_func!r} is not supported; use one of {SCORING_FUNCS}")
        if self.swiglu_limit <= 0 or self.hc_eps < 0 or self.rms_norm_eps < 0:
            raise ValueError(f"{self.swiglu_limit=} must be > 0, {self.hc_eps=} and {self.rms_norm_eps=} >= 0")

    # ---- derived -------------------------------------------------------------------------------

    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed entry of `layer` (0 for a sliding-only layer)."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[layer]]

    def rope(self, layer: int) -> RopeConfig:
        """The RoPE of `layer`'s attention: `main` for sliding layers, `compress` otherwise."""
        return self.rope_main if self.layer_types[layer] == SLIDING else self.rope_compress

    @property
    def csa_layers(self) -> tuple[int, ...]:
        """Layers with a lightning indexer (their entries are the C4 pool HiSparse offloads)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == CSA)

    @property
    def hca_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == HCA)

    # ---- construction --------------------------------------------------------------------------

    def replace(self, **changes) -> "DeepseekV4Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "DeepseekV4Config":
        """Inverse of to_dict."""
        values = dict(values)
        for name in ("rope_main", "rope_compress"):
            values[name] = RopeConfig(**values[name])
        for name in ("layer_types", "mlp_layer_types"):
            values[name] = tuple(values[name])
        return cls(**values)

    @classmethod
    def from_hf_config(cls, source: str | os.PathLike | Mapping[str, Any]) -> "DeepseekV4Config":
        """From a Hugging Face config.json: a dict, the file, or the checkpoint directory.

        Missing fields take transformers 5.24.0's DeepseekV4Config defaults, legacy fields
        (`compress_ratios`, `compress_rate_csa/hca`, `num_hash_layers`, `qk_rope_head_dim`, a flat
        YaRN `rope_parameters`) are folded in as its `__post_init__` does.
        """
        raw = read_config_json(source)
        return _from_hf_dict(raw)

    # ---- named configs -------------------------------------------------------------------------

    @classmethod
    def v4_flash(cls) -> "DeepseekV4Config":
        """DeepSeek-V4-Flash's size as transformers 5.24.0's config-class defaults give it: hidden
        4096, 43 layers, 64 heads of 512 (RoPE 64), 256 experts top-6 of 2048, window 128, CSA 4 /
        HCA 128, indexer 64 x 128 top-512. The defaults' layer schedule (2 x HCA, then HCA/CSA
        alternating, 3 hash layers) and the compress YaRN (factor 16 over 65536 positions, the
        config class's comment) stand in for the released config.json, which this repo does not
        have: load a real checkpoint through from_hf_config."""
        return cls.from_hf_config(
            {
                "model_type": "deepseek_v4",
                "rope_parameters": {
                    "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                    "beta_fast": 32, "beta_slow": 1,
                },
            }
        )  # fmt: skip

    @classmethod
    def tiny(cls) -> "DeepseekV4Config":
        """tests/fixtures/deepseek_v4_tiny's config.json."""
        return cls.from_hf_config(
            {
                "model_type": "deepseek_v4", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "partial_rotary_factor": 0.25,
                "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 16,
                "layer_types": [SLIDING, CSA, HCA, CSA], "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
                "compress_rates": {CSA: 4, HCA: 16}, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8,
                "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                "routed_scaling_factor": 1.5, "swiglu_limit": 2.0, "max_position_embeddings": 512,
                "num_nextn_predict_layers": 0,
                "rope_parameters": {
                    "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                    "compress": {
                        "rope_type": "yarn", "rope_theta": 160000.0, "factor": 4.0, "attention_factor": 1.0,
                        "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
                        "partial_rotary_factor": 0.25,
                    },
                },
            }
        )  # fmt: skip


# transformers 5.24.0 DeepseekV4Config defaults, applied to fields a config.json leaves out.
_HF_DEFAULTS = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
    num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024, num_experts_per_tok=6,
    n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
    max_position_embeddings=1048576, rope_theta=10000.0, compress_rope_theta=160000.0, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024,
    index_n_heads=64, index_head_dim=128, index_topk=512, num_nextn_predict_layers=1, hidden_act="silu",
    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
)  # fmt: skip
_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_DEFAULT_NUM_HASH_LAYERS = 3
_DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512


def _from_hf_dict(raw: dict[str, Any]) -> DeepseekV4Config:
    if raw.get("model_type") != "deepseek_v4":
        raise UnsupportedModelError(f"model_type {raw.get('model_type')!r} is not 'deepseek_v4'")
    c = dict(_HF_DEFAULTS)
    c.update({k: v for k, v in raw.items() if v is not None})

    # Features the reference has no code for (or ignores) are refused, not guessed.
    if c["hidden_act"] != "silu":
        raise UnsupportedModelError(f"hidden_act {c['hidden_act']!r} is not supported; only 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if c[flag]:
            raise UnsupportedModelError(f"{flag}=true is not supported (DeepSeek-V4 has no biases)")
    if c["n_shared_experts"] != 1:
        raise UnsupportedModelError(
            f"n_shared_experts={c['n_shared_experts']} is not supported: transformers' V4 always builds exactly one"
            " shared expert of moe_intermediate_size"
        )
    if c.get("q_lora_rank") is None:
        raise UnsupportedModelError("q_lora_rank null (no query LoRA) is not supported")

    n = c["num_hidden_layers"]
    rates = dict(_DEFAULT_COMPRESS_RATES)
    rates.update(c.get("compress_rates") or {})
    if "compress_rate_csa" in c:
        rates[CSA] = c["compress_rate_csa"]
    if "compress_rate_hca" in c:
        rates[HCA] = c["compress_rate_hca"]
    if bad := sorted(set(rates) - {CSA, HCA}):
        raise ValueError(f"compress_rates holds unknown layer type(s) {bad}; use {CSA!r} and {HCA!r}")

    layer_types = c.get("layer_types")
    if layer_types is None and c.get("compress_ratios") is not None:
        ratios = c["compress_ratios"]
        if bad := sorted({r for r in ratios if r not in _COMPRESS_RATIO_TO_LAYER_TYPE}):
            raise UnsupportedModelError(f"compress_ratios holds {bad}; only 0 (sliding), 4 (CSA), 128 (HCA) are known")
        layer_types = [_COMPRESS_RATIO_TO_LAYER_TYPE[r] for r in ratios]
    if layer_types is None:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    mlp_types = c.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = c.get("num_hash_layers", _DEFAULT_NUM_HASH_LAYERS)
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    # transformers truncates longer lists to num_hidden_layers (MTP layers' entries ride along).
    layer_types, mlp_types = tuple(layer_types[:n]), tuple(mlp_types[:n])

    head_dim = c["head_dim"]
    partial = c.get("partial_rotary_factor")
    if partial is None:
        partial = c["qk_rope_head_dim"] / head_dim if "qk_rope_head_dim" in c else _DEFAULT_PARTIAL_ROTARY_FACTOR
    rope_main, rope_compress = _ropes(c, partial)
    rope_dim = int(head_dim * partial)
    if "qk_rope_head_dim" in c and c["qk_rope_head_dim"] != rope_dim:
        raise ValueError(f"qk_rope_head_dim={c['qk_rope_head_dim']} disagrees with head_dim x partial_rotary_factor = {rope_dim}")

    return DeepseekV4Config(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        num_layers=n,
        num_heads=c["num_attention_heads"],
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=c["q_lora_rank"],
        o_groups=c["o_groups"],
        o_lora_rank=c["o_lora_rank"],
        sliding_window=c["sliding_window"],
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        csa_rate=rates[CSA],
        hca_rate=rates[HCA],
        index_n_heads=c["index_n_heads"],
        index_head_dim=c["index_head_dim"],
        index_topk=c["index_topk"],
        hc_mult=c["hc_mult"],
        hc_sinkhorn_iters=c["hc_sinkhorn_iters"],
        hc_eps=float(c["hc_eps"]),
        n_routed_experts=c["n_routed_experts"],
        num_experts_per_tok=c["num_experts_per_tok"],
        moe_intermediate_size=c["moe_intermediate_size"],
        scoring_func=c["scoring_func"],
        routed_scaling_factor=float(c["routed_scaling_factor"]),
        swiglu_limit=float(c["swiglu_limit"]),
        rms_norm_eps=float(c["rms_norm_eps"]),
        rope_main=rope_main,
        rope_compress=rope_compress,
        max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=bool(c["tie_word_embeddings"]),
        num_nextn_predict_layers=c["num_nextn_predict_layers"],
    )


def _rope(params: Mapping[str, Any], theta: float, max_positions: int, label: str) -> RopeConfig:
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", theta))
    if rope_type == "default":
        return RopeConfig(rope_type="default", theta=theta)
    if rope_type != "yarn":
        raise UnsupportedModelError(f"rope_parameters.{label}.rope_type {rope_type!r} is not supported; use default or yarn")
    original = params.get("original_max_position_embeddings", max_positions)
    factor = params.get("factor") or max_positions / original
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        # V4 never rescales cos/sin: transformers forces attention_factor 1.0 on a YaRN compress rope.
        attention_factor=float(params.get("attention_factor", 1.0)),
        truncate=bool(params.get("truncate", True)),
    )


def _ropes(c: Mapping[str, Any], partial: float) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress) as transformers nests them: explicit `main`/`compress` sub-dicts, else a
    flat `rope_parameters` (or legacy `rope_scaling`) that only the compress rope takes."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    max_positions = c["max_position_embeddings"]
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
        for label, sub in (("main", main), ("compress", compress)):
            if "partial_rotary_factor" in sub and abs(sub["partial_rotary_factor"] - partial) > 1e-9:
                raise UnsupportedModelError(
                    f"rope_parameters.{label}.partial_rotary_factor={sub['partial_rotary_factor']} differs from"
                    f" {partial}: one rotated width for all RoPEs is supported"
                )
    else:
        main = {"rope_type": "default", "rope_theta": c["rope_theta"]}
        compress = {k: v for k, v in params.items() if k not in ("main", "compress")}
        compress["rope_theta"] = c["compress_rope_theta"]
    return (
        _rope(main, c["rope_theta"], max_positions, "main"),
        _rope(compress, c["compress_rope_theta"], max_positions, "compress"),
    )
