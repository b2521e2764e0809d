"""MiniMaxM3Config: the architecture of MiniMax-M3's text model, frozen and validated.

Semantics of transformers 5.24.0 (`minimax_m3_vl` package, model_type `minimax_m3_vl_text`;
the VL wrapper `minimax_m3_vl` carries it as `text_config`). See
docs/models.md, MiniMax-M3 section:

  - GQA attention with per-head Gemma RMSNorm q_norm / k_norm, half-split RoPE on the first
    `rotary_dim` channels of each head;
  - `layer_types[i]`: "full_attention" (every causal key) or "minimax_m3_sparse" (only keys in
    the blocks a max-pooled block indexer selects, one selection per indexer head = KV group);
  - `mlp_layer_types[i]`: "dense" (SwiGLU-OAI MLP) or "sparse" (sigmoid-routed MoE + one shared
    expert).

    MiniMaxM3Config.from_hf_config(path_or_dict)
    MiniMaxM3Config.tiny()        # tests/fixtures/minimax_m3_tiny
    MiniMaxM3Config.released()    # the released sizes (transformers' config defaults)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from configs.hf_json import read_config_json
from configs.model import UnsupportedModelError

TEXT_MODEL_TYPE = "minimax_m3_vl_text"
VL_MODEL_TYPE = "minimax_m3_vl"
LAYER_TYPES = ("full_attention", "minimax_m3_sparse")
MLP_LAYER_TYPES = ("dense", "sparse")


@dataclasses.dataclass(frozen=True)
class MiniMaxM3Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # channels of each head that RoPE rotates (half-split), the first ones
    rope_theta: float
    layer_types: tuple[str, ...]  # per layer: "full_attention" or "minimax_m3_sparse"
    mlp_layer_types: tuple[str, ...]  # per layer: "dense" or "sparse" (MoE)
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # each routed expert
    shared_intermediate_size: int  # the shared expert (0: none)
    dense_intermediate_size: int  # dense MLP layers
    routed_scaling_factor: float
    swiglu_limit: float
    swiglu_alpha: float
    index_n_heads: int
    index_head_dim: int
    index_block_size: int  # keys per block
    index_topk_blocks: int  # blocks each query keeps (local ones included)
    index_local_blocks: int  # the query's own block and the index_local_blocks - 1 before it are forced in
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    model_type: str = TEXT_MODEL_TYPE

    def __post_init__(self):
        if self.model_type != TEXT_MODEL_TYPE:
            raise UnsupportedModelError(f"model_type {self.model_type!r} is not {TEXT_MODEL_TYPE!r}")
        for name in (
            "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "rotary_dim", "num_experts", "num_experts_per_tok", "intermediate_size",
            "dense_intermediate_size", "index_n_heads", "index_head_dim", "index_block_size",
            "index_topk_blocks", "index_local_blocks", "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if isinstance(self.shared_intermediate_size, bool) or not isinstance(self.shared_intermediate_size, int) or self.shared_intermediate_size < 0:
            raise ValueError(f"shared_intermediate_size={self.shared_intermediate_size!r} must be an integer >= 0")
        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            types = getattr(self, name)
            if not isinstance(types, tuple) or len(types) != self.num_layers:
                raise ValueError(f"{name} must be a tuple of num_layers={self.num_layers} entries, got {types!r}")
            if bad := sorted(set(types) - set(allowed)):
                raise UnsupportedModelError(f"{name} holds {bad}; supported values are {allowed}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
        if self.num_heads % self.index_n_heads:
            raise ValueError(f"{self.num_heads=} must be a multiple of {self.index_n_heads=} (each indexer head gates H / index_n_heads heads)")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"{self.rotary_dim=} must be even and <= {self.head_dim=}")
        if self.rotary_dim > self.index_head_dim:
            # The indexer rotates with cos[..., :index_head_dim]; a narrower index head would mix halves.
            raise UnsupportedModelError(f"{self.rotary_dim=} > {self.index_head_dim=} is not supported")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{self.num_experts_per_tok=} exceeds {self.num_experts=}")
        if self.index_local_blocks > self.index_topk_blocks:
            raise ValueError(f"{self.index_local_blocks=} must be <= {self.index_topk_blocks=}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(f"{self.rope_theta=} and {self.rms_norm_eps=} must be positive")
        if self.swiglu_limit <= 0:
            raise ValueError(f"{self.swiglu_limit=} must be positive")

    # ---- derived -------------------------------------------------------------------------------

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """Layers with a block indexer (minimax_m3_sparse attention), in order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "minimax_m3_sparse")

    @property
    def dense_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def selected_keys(self) -> int:
        """Keys a sparse layer's query may attend to at most: index_topk_blocks x index_block_size."""
        return self.index_topk_blocks * self.index_block_size

    # ---- construction --------------------------------------------------------------------------

    def replace(self, **changes) -> "MiniMaxM3Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "MiniMaxM3Config":
        values = dict(values)
        for name in ("layer_types", "mlp_layer_types"):
            values[name] = tuple(values[name])
        return cls(**values)

    @classmethod
    def from_hf_config(cls, source: str | os.PathLike | Mapping[str, Any]) -> "MiniMaxM3Config":
        """From a config.json (dict, file or checkpoint directory) of model_type
        `minimax_m3_vl_text`, or of the VL wrapper `minimax_m3_vl` (its `text_config` is used).
        Missing fields take transformers 5.24.0's config-class defaults."""
        raw = read_config_json(source)
        return _from_hf_dict(raw)

    # ---- named configs -------------------------------------------------------------------------

    @classmethod
    def tiny(cls) -> "MiniMaxM3Config":
        """The dims of tests/fixtures/minimax_m3_tiny (layers: full/dense, sparse/sparse,
        full/sparse, sparse/sparse)."""
        return cls.from_hf_config(
            dict(
                model_type=TEXT_MODEL_TYPE, vocab_size=512, hidden_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
                layer_types=["full_attention", "minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_local_experts=8,
                num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=32,
                dense_intermediate_size=128, routed_scaling_factor=2.0, swiglu_limit=2.0,
                swiglu_alpha=1.702, index_n_heads=2, index_head_dim=32, index_block_size=4,
                index_topk_blocks=4, index_local_blocks=1, rms_norm_eps=1e-6, max_position_embeddings=512,
            )
        )  # fmt: skip

    @classmethod
    def released(cls, layer_types: tuple[str, ...] | None = None, mlp_layer_types: tuple[str, ...] | None = None) -> "MiniMaxM3Config":
        """The released sizes (transformers' MiniMaxM3VLTextConfig defaults, MC:80-117): hidden 6144,
        60 layers, 64 heads / 4 KV heads of 128, rotary_dim 64, 128 experts top-4 of width 3072,
        shared 3072, dense 12288, indexer 4 heads x 128, block 128, 16 blocks, 1 local, vocab 200064.

        The layer pattern is not part of the defaults (transformers: every layer full_attention and
        sparse MoE unless the checkpoint's config.json says otherwise): pass the real one, or take
        the released checkpoint's config.json through from_hf_config.
        """
        raw = dict(model_type=TEXT_MODEL_TYPE)
        if layer_types is not None:
            raw["layer_types"] = list(layer_types)
        if mlp_layer_types is not None:
            raw["mlp_layer_types"] = list(mlp_layer_types)
        return cls.from_hf_config(raw)


# transformers 5.24.0 MiniMaxM3VLTextConfig defaults (reference: MC:80-117), for fields a
# config.json leaves out.
_HF_DEFAULTS = dict(
    vocab_size=200064, hidden_size=6144, num_hidden_layers=60, num_attention_heads=64,
    num_key_value_heads=4, head_dim=128, rotary_dim=64, rope_theta=5000000.0, num_local_experts=128,
    num_experts_per_tok=4, intermediate_size=3072, shared_intermediate_size=3072,
    dense_intermediate_size=12288, routed_scaling_factor=1.0, swiglu_limit=7.0, swiglu_alpha=1.702,
    index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16,
    index_local_blocks=1, rms_norm_eps=1e-6, max_position_embeddings=196608, tie_word_embeddings=False,
)  # fmt: skip
# NOTE routed_scaling_factor, swiglu_limit and max_position_embeddings above are not given in the
# reference summary; a real checkpoint's config.json sets them (the tiny fixture does).


def _rotary_dim(c: Mapping[str, Any], head_dim: int) -> int:
    """The rotated width. `partial_rotary_factor` (in rope_parameters, or top level) when the
    config has it, as transformers 5.24.0 reads it; otherwise `rotary_dim`, i.e. the factor
    rotary_dim / head_dim, as MiniMax-M2's config conversion and MiniMax's own code do.
    transformers 5.24.0 itself never reads `rotary_dim` and would rotate all head_dim channels of
    a config that only has rotary_dim; this project follows rotary_dim there (docs/models.md).
    A config with neither takes the config class's default rotary_dim (64), like any field."""
    params = c.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    if factor is not None:
        rotary = head_dim * float(factor)
        if not float(rotary).is_integer() or not 0 < factor <= 1:
            raise ValueError(f"partial_rotary_factor {factor} x head_dim {head_dim} is not a whole number of channels in (0, head_dim]")
        return int(rotary)
    if c.get("rotary_dim") is not None:
        return int(c["rotary_dim"])
    return head_dim


def _from_hf_dict(raw: dict[str, Any]) -> MiniMaxM3Config:
    model_type = raw.get("model_type")
    if model_type == VL_MODEL_TYPE:
        text = raw.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError(f"a {VL_MODEL_TYPE!r} config needs a text_config object, got {text!r}")
        raw = dict(text)
        raw.setdefault("model_type", TEXT_MODEL_TYPE)
        model_type = raw["model_type"]
    if model_type != TEXT_MODEL_TYPE:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported here; use {TEXT_MODEL_TYPE!r} or {VL_MODEL_TYPE!r}")
    c = dict(_HF_DEFAULTS)
    c.update({k: v for k, v in raw.items() if v is not None})

    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if c.get(flag, False):
            raise UnsupportedModelError(f"{flag}=true is not supported (MiniMax-M3 has none)")
    if c.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedModelError(f"scoring_func {c['scoring_func']!r} is not supported; only 'sigmoid'")
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported for MiniMax-M3; only 'default'")
    if "quantization_config" in c:
        method = (c["quantization_config"] or {}).get("quant_method")
        if method != "fp8":
            raise UnsupportedModelError(f"quantization_config.quant_method {method!r} is not supported; only block FP8 ('fp8')")

    layers = c["num_hidden_layers"]
    layer_types = c.get("layer_types")
    if layer_types is None:
        sparse_cfg = c.get("sparse_attention_config")
        if sparse_cfg:
            freq = sparse_cfg.get("sparse_attention_freq") if isinstance(sparse_cfg, Mapping) else None
            if not (isinstance(freq, (list, tuple)) and len(freq) == layers and set(freq) <= {0, 1}):
                raise UnsupportedModelError(
                    f"sparse_attention_config.sparse_attention_freq {freq!r} is not understood (expected one 0/1 per"
                    " layer); give layer_types in config.json instead"
                )
            layer_types = ["minimax_m3_sparse" if f else "full_attention" for f in freq]
        else:
            layer_types = ["full_attention"] * layers  # transformers' default (MC:137-145)
    mlp_types = c.get("mlp_layer_types")
    if mlp_types is None:
        freq = c.get("moe_layer_freq")
        if freq is None or freq == 1:
            mlp_types = ["sparse"] * layers  # transformers' default (MC:147-151)
        elif isinstance(freq, (list, tuple)) and len(freq) == layers and set(freq) <= {0, 1}:
            mlp_types = ["sparse" if f else "dense" for f in freq]
        else:
            raise UnsupportedModelError(f"moe_layer_freq {freq!r} is not understood; give mlp_layer_types in config.json instead")

    head_dim = c["head_dim"]
    return MiniMaxM3Config(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        num_layers=layers,
        num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"],
        head_dim=head_dim,
        rotary_dim=_rotary_dim(c, head_dim),
        rope_theta=float(params.get("rope_theta", c["rope_theta"])),
        layer_types=tuple(layer_types),
        mlp_layer_types=tuple(mlp_types),
        num_experts=c["num_local_experts"],
        num_experts_per_tok=c["num_experts_per_tok"],
        intermediate_size=c["intermediate_size"],
        shared_intermediate_size=c["shared_intermediate_size"],
        dense_intermediate_size=c["dense_intermediate_size"],
        routed_scaling_factor=float(c["routed_scaling_factor"]),
        swiglu_limit=float(c["swiglu_limit"]),
        swiglu_alpha=float(c["swiglu_alpha"]),
        index_n_heads=c["index_n_heads"],
        index_head_dim=c["index_head_dim"],
        index_block_size=c["index_block_size"],
        index_topk_blocks=c["index_topk_blocks"],
        index_local_blocks=c["index_local_blocks"],
        rms_norm_eps=float(c["rms_norm_eps"]),
        max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
    )
