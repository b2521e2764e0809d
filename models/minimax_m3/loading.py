"""Hugging Face MiniMax-M3 checkpoints -> MiniMaxM3ForCausalLM.

Two key-name schemes are read (docs/models.md, MiniMax-M3):

  module names (what transformers 5.24.0's `save_pretrained` writes for `minimax_m3_vl_text`,
  the tiny fixture): `model.layers.i.self_attn.indexer.q_proj.weight`, packed routed experts
  `mlp.experts.gate_up_proj` [E, 2F, D] (rows [:F] gate, [F:] up) and `mlp.experts.down_proj`
  [E, D, F], `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`, dense / shared MLPs as
  `gate_up_proj.weight` [2F, D] and `down_proj.weight`;

  released (MiniMax-style) names: a `language_model.model.` prefix (`language_model.lm_head.`
  for the head; vision-tower tensors of a VL checkpoint are skipped), `block_sparse_moe.` for
  `mlp.`, one tensor per routed expert `block_sparse_moe.experts.e.w1 / w3 / w2.weight` (gate,
  up, down; `gate_proj / up_proj / down_proj` also accepted), the router bias as
  `block_sparse_moe.e_score_correction_bias`, the indexer as `self_attn.index_q_proj /
  index_k_proj / index_q_norm / index_k_norm`, and split `gate_proj` / `up_proj` for dense and
  shared MLPs.

Both schemes may not mix within one parameter (a tensor stored both ways is an error). Every
failure is a CheckpointError (or UnsupportedModelError) naming the tensors at fault.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.minimax_m3 import MiniMaxM3Config
from configs.model import UnsupportedModelError, fp8_weight_block
from models.common.checkpoint import (
    _SCALE_SUFFIX,
    Checkpoint,
    CheckpointError,
    _names,
    _read_raw_config,
    _set_expert,
    _tensor,
)
from models.minimax_m3.model import MiniMaxM3ForCausalLM

# Released-name prefixes -> module-name prefixes, tried in order.
_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
# Vision-side tensors of a VL checkpoint: not part of the text model, skipped.
_VISION = re.compile(r"^(model\.)?(vision_tower|visual|vision_model|multi_modal_projector|mm_projector)\.")
_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.mlp\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.self_attn\.index_(q_proj|k_proj|q_norm|k_norm)\."), r".self_attn.indexer.\1."),
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
)


def canonical_name(name: str) -> str | None:
    """A checkpoint tensor name in module-name form (per-expert / split-MLP names stay split);
    None for a vision-side tensor the text model skips."""
    for old, new in _PREFIXES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    if _VISION.match(name):
        return None
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


def abstract_model(config: MiniMaxM3Config, dtype) -> MiniMaxM3ForCausalLM:
    return nnx.eval_shape(lambda: MiniMaxM3ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))


class _Plan:
    """Checkpoint tensors by canonical name; records which ones the model consumed."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.by_name: dict[str, str] = {}
        for original in sorted(checkpoint.names()):
            if original.endswith(_SCALE_SUFFIX):
                continue
            canonical = canonical_name(original)
            if canonical is None:
                continue
            if canonical in self.by_name:
                raise CheckpointError(
                    f"checkpoint {checkpoint.directory} stores {canonical!r} twice: as {self.by_name[canonical]!r}"
                    f" and {original!r}"
                )
            self.by_name[canonical] = original
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.wrong_shape: list[str] = []

    def has(self, canonical: str) -> bool:
        return canonical in self.by_name

    def take(self, canonical: str, shape: tuple[int, ...]) -> str | None:
        """The original name of a tensor the model needs, its shape checked; None if absent."""
        original = self.by_name.get(canonical)
        if original is None:
            self.missing.append(canonical)
            return None
        self.used.add(canonical)
        if (got := self.checkpoint.info(original).shape) != tuple(shape):
            self.wrong_shape.append(f"{original}: checkpoint {got}, model expects {tuple(shape)}")
        return original


def _recipes(plan: _Plan, pure: dict, config: MiniMaxM3Config) -> list:
    """(target path, kind, args) for every parameter; records missing / misshaped tensors."""
    recipes = []
    E = config.num_experts
    for path, leaf in jax.tree_util.tree_flatten_with_path(pure)[0]:
        keys = tuple(p.key for p in path)
        dotted = ".".join(str(k) for k in keys)
        name = dotted if keys[0] == "lm_head" else f"model.{dotted}"
        shape = tuple(leaf.shape)
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            prefix, proj = name.rsplit(".", 1)
            packed_shape = (E, shape[2], shape[1])  # checkpoint [E, out, in], model [E, in, out]
            per_expert = [f"{prefix}.0.{p}.weight" for p in (("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",))]
            both = plan.has(name) and any(plan.has(n) for n in per_expert)
            if both:
                raise CheckpointError(f"{prefix}: routed experts stored both packed ({plan.by_name[name]}) and per expert")
            if plan.has(name) or not any(plan.has(n) for n in per_expert):
                recipes.append((keys, "packed_experts", plan.take(name, packed_shape)))
            elif proj == "gate_up_proj":
                F = shape[2] // 2
                names = [
                    (plan.take(f"{prefix}.{e}.gate_proj.weight", (F, shape[1])), plan.take(f"{prefix}.{e}.up_proj.weight", (F, shape[1])))
                    for e in range(E)
                ]
                recipes.append((keys, "expert_gate_up", names))
            else:
                names = [plan.take(f"{prefix}.{e}.down_proj.weight", (shape[2], shape[1])) for e in range(E)]
                recipes.append((keys, "expert_down", names))
        elif name.endswith(".gate_up_proj.weight"):
            prefix = name[: -len(".gate_up_proj.weight")]
            split = (f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight")
            if plan.has(name) and any(plan.has(n) for n in split):
                raise CheckpointError(f"{prefix}: MLP stored both packed (gate_up_proj) and split (gate_proj / up_proj)")
            if plan.has(name) or not any(plan.has(n) for n in split):
                recipes.append((keys, "plain", plan.take(name, shape)))
            else:
                half = (shape[0] // 2, shape[1])
                recipes.append((keys, "concat", [plan.take(n, half) for n in split]))
        else:
            recipes.append((keys, "plain", plan.take(name, shape)))
    return recipes


def load_hf_checkpoint(directory: str | os.PathLike, *, dtype=jnp.bfloat16, device: jax.Device | None = None) -> MiniMaxM3ForCausalLM:
    """A MiniMax-M3 checkpoint directory (config.json + safetensors) -> MiniMaxM3ForCausalLM in
    `dtype`; the router weight and bias stay float32. Block-FP8 weights are dequantised."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    raw = _read_raw_config(directory)
    try:
        config = MiniMaxM3Config.from_hf_config(raw)
    except UnsupportedModelError:
        raise
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointError(f"{directory}/config.json: invalid MiniMax-M3 config ({error})") from None
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    block = fp8_weight_block({"quantization_config": quant}) if quant else None
    checkpoint = Checkpoint(directory)
    graphdef, abstract_state = nnx.split(abstract_model(config, dtype))
    pure = nnx.to_pure_dict(abstract_state)

    plan = _Plan(checkpoint)
    recipes = _recipes(plan, pure, config)
    if plan.missing:
        raise CheckpointError(f"checkpoint {directory} lacks {len(plan.missing)} tensor(s) the model needs: {_names(plan.missing)}")
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected := set(plan.by_name) - plan.used - ignorable:
        raise CheckpointError(
            f"checkpoint {directory} holds {len(unexpected)} tensor(s) this config has no place for"
            f" (wrong config.json?): {_names(plan.by_name[n] for n in unexpected)}"
        )
    if plan.wrong_shape:
        raise CheckpointError(f"{len(plan.wrong_shape)} tensor shape(s) differ from config.json: {'; '.join(plan.wrong_shape[:6])}")
    for original in plan.by_name.values():
        info = checkpoint.info(original)
        if info.dtype.kind in "iub":
            raise CheckpointError(f"tensor {original} has dtype {info.dtype.name}; weights must be floating point")
        if "float8" in info.dtype.name and (block is None or original + _SCALE_SUFFIX not in checkpoint.names()):
            raise CheckpointError(f"FP8 tensor {original} needs a quantization_config and {original + _SCALE_SUFFIX}")

    device = device or jax.local_devices()[0]
    for keys, kind, source in recipes:
        node = pure
        for key in keys[:-1]:
            node = node[key]
        target = node[keys[-1]]
        if kind == "plain":
            value = _tensor(checkpoint, source, target.dtype, device, block)
        elif kind == "concat":
            value = jnp.concatenate([_tensor(checkpoint, n, target.dtype, device, block) for n in source], axis=0)
        elif kind == "packed_experts":  # [E, out, in] -> [E, in, out]
            value = jnp.swapaxes(_tensor(checkpoint, source, target.dtype, device, block), 1, 2)
        else:  # one expert at a time into the stacked [E, in, out] array, on the device
            value = jnp.zeros(target.shape, target.dtype, device=device)
            for e, names in enumerate(source):
                names = names if isinstance(names, tuple) else (names,)
                weight = jnp.concatenate([_tensor(checkpoint, n, target.dtype, device, block) for n in names], axis=0)
                value = _set_expert(value, e, weight.T)
        node[keys[-1]] = value
    nnx.replace_by_pure_dict(abstract_state, pure)
    return nnx.merge(graphdef, abstract_state)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray]) -> None:
    """Minimal safetensors writer (float32 / int32 numpy arrays), for tests and conversions."""
    import json

    codes = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32", np.dtype(np.float16): "F16"}
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        data = array.tobytes()
        header[name] = {"dtype": codes[array.dtype], "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)
