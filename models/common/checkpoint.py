"""Hugging Face checkpoints: the safetensors reader and the loading loop every family shares.

A checkpoint directory holds config.json and one or more *.safetensors files, listed by
model.safetensors.index.json when sharded. Files are memory-mapped and converted one tensor at a
time, so the host never holds a second full copy of the weights. FP8 checkpoints (DeepSeek-V3.2,
GLM-5.x-FP8: float8_e4m3fn weights with a float32 `weight_scale_inv` per 128 x 128 block) are
dequantised to the requested dtype as each tensor is loaded.

Safetensors files are parsed here rather than through the `safetensors` package because its
numpy reader has no bfloat16 or float8 (the dtypes real checkpoints use); the format is an 8-byte
header length, a JSON header, then raw little-endian tensor data.

Each family supplies its model's structure and its plan of which tensor fills which parameter
(models/<family>/loading.py); orbax save/restore of converted params is models.registry's.

Every failure raises CheckpointError (or UnsupportedModelError for a model/quantisation this
package does not implement) with a message naming the file or tensors at fault.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from configs.model import fp8_weight_block
from models.common import fp8

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 2**20
_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip
_FP8 = {np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)}
_SCALE_SUFFIX = "_scale_inv"  # `<name>.weight_scale_inv` quantises `<name>.weight`


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message names the file or tensors at fault."""


def _names(names: Iterable[str], limit: int = 6) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file


def _read_header(path: str) -> dict[str, _TensorInfo]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, too short for a header)")
            header_len = int.from_bytes(prefix, "little")
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: not a safetensors file (header length {header_len} > file size {size})")
            header = json.loads(f.read(header_len))
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: corrupt safetensors header ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]])
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except KeyError as error:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported or missing {error} in its header") from None
        except (TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {entry!r}") from None
        if end - begin != math.prod(shape) * dtype.itemsize or 8 + header_len + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} data [{begin}, {end}) does not fit its shape {shape} {dtype.name}"
                f" or the file ({size} bytes; truncated?)"
            )
        infos[name] = _TensorInfo(path, dtype, shape, 8 + header_len + begin)
    return infos


class Checkpoint:
    """The tensors of a Hugging Face checkpoint directory by name, across its shards."""

    def __init__(self, directory: str | os.PathLike):
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise CheckpointError(f"checkpoint directory {directory} does not exist")
        self.directory = directory
        index_path = os.path.join(directory, INDEX_FILE)
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index_path}: unreadable shard index ({error!r})") from None
            files = sorted(set(weight_map.values()))
            if missing := [f for f in files if not os.path.exists(os.path.join(directory, f))]:
                raise CheckpointError(f"{index_path} lists shard file(s) that do not exist: {_names(missing)}")
        else:
            weight_map = None
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {directory}")
        self._tensors: dict[str, _TensorInfo] = {}
        for file in files:
            for name, info in _read_header(os.path.join(directory, file)).items():
                if name in self._tensors:
                    raise CheckpointError(f"tensor {name!r} is stored twice: in {self._tensors[name].file} and {file}")
                self._tensors[name] = info
        if weight_map is not None:
            wrong = [n for n, f in weight_map.items() if n not in self._tensors or self._tensors[n].file != os.path.join(directory, f)]
            if wrong:
                raise CheckpointError(f"{index_path} maps tensor(s) to shards that do not hold them: {_names(wrong)}")
        self._maps: dict[str, np.memmap] = {}

    def names(self) -> set[str]:
        return set(self._tensors)

    def info(self, name: str) -> _TensorInfo:
        return self._tensors[name]

    def read(self, name: str) -> np.ndarray:
        """A read-only view of the tensor's bytes in the memory-mapped file (no copy yet)."""
        info = self._tensors[name]
        if info.file not in self._maps:
            self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        count = math.prod(info.shape)
        return np.frombuffer(self._maps[info.file], info.dtype, count, info.offset).reshape(info.shape)


@dataclasses.dataclass(frozen=True)
class _ParamSource:
    """Where one model parameter comes from in the checkpoint."""

    path: tuple  # the parameter's path in the model state
    hf_names: tuple[str, ...]  # one tensor, or one per routed expert (stacked)
    hf_shape: tuple[int, ...]  # shape of each checkpoint tensor
    transpose: bool  # unquantised expert tensors are [out, in] in the checkpoint, [in, out] here
    # "tensor": read in the parameter's dtype (FP8 tensors dequantised); "fp8": block FP8 values,
    # kept as stored (quantised at load from an unquantised checkpoint); "scale": their
    # weight_scale_inv (derived from the weight when the checkpoint has none).
    kind: str = "tensor"


def param_sources(abstract_state: dict, num_experts: int, *, head: str, expert_pattern: re.Pattern) -> list[_ParamSource]:
    """Which checkpoint tensors fill each parameter: `model.` + its path (the lm head, named
    `head`, as is); parameters matching `expert_pattern` (groups: prefix, projection, and
    optionally `_scale_inv`) stack one tensor per routed expert, transposed to [in, out] unless
    block FP8 (models.common.fp8: values and scales keep the checkpoint's [out, in])."""
    sources = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        keys = tuple(p.key for p in path)
        dotted = ".".join(str(k) for k in keys)
        name = dotted if keys[0] == head else f"model.{dotted}"
        scale = name.endswith(_SCALE_SUFFIX)
        kind = "scale" if scale else "fp8" if np.dtype(leaf.dtype) in _FP8 else "tensor"
        if expert := expert_pattern.match(name):
            prefix, proj, *suffix = expert.groups()
            names = tuple(f"{prefix}.{e}.{proj}.weight{suffix[0] if suffix and suffix[0] else ''}" for e in range(num_experts))
            if kind == "tensor":
                sources.append(_ParamSource(keys, names, tuple(reversed(leaf.shape[1:])), True))
            else:
                sources.append(_ParamSource(keys, names, tuple(leaf.shape[1:]), False, kind))
        else:
            sources.append(_ParamSource(keys, (name,), tuple(leaf.shape), False, kind))
    return sources


def derived_scale_names(sources: list[_ParamSource]) -> set[str]:
    """Scale tensors a checkpoint may lack: an unquantised checkpoint loaded as block FP8 gets
    its scales from quantising the weights at load."""
    return {n for s in sources if s.kind == "scale" for n in s.hf_names}


@functools.partial(jax.jit, static_argnums=2)
def _dequantize(weight: jax.Array, scale_inv: jax.Array, block: tuple[int, int] | None) -> jax.Array:
    """weight fp8[O, I], scale_inv f32[ceil(O/b0), ceil(I/b1)] -> f32[O, I]: each block times its
    scale. block: the checkpoint's weight_block_size (a partial last block makes it ambiguous from
    the counts: DeepSeek-V3.2's kv_a_proj_with_mqa is 576 rows in 5 blocks of 128)."""
    return fp8.dequantize(weight, scale_inv, jnp.float32, block)


@functools.partial(jax.jit, donate_argnums=0)
def _set_expert(stacked: jax.Array, expert: int, weight: jax.Array) -> jax.Array:
    # stacked [E, ...], weight [...]
    return stacked.at[expert].set(weight)


def _tensor(checkpoint: Checkpoint, name: str, dtype, device, block: tuple[int, int] | None = None) -> jax.Array:
    """A checkpoint tensor on `device` in `dtype`; an FP8 one dequantised with its `block`s."""
    data = jax.device_put(checkpoint.read(name), device)
    if checkpoint.info(name).dtype in _FP8:
        data = _dequantize(data, jax.device_put(checkpoint.read(name + _SCALE_SUFFIX), device), block)
    return data.astype(dtype)


def _source_tensor(checkpoint: Checkpoint, name: str, kind: str, dtype, block, device, checkpoint_block=None) -> jax.Array:
    """One checkpoint tensor as the parameter kind wants it, in the checkpoint's [out, in]; block:
    the model's weight_block_size (quantising at load), checkpoint_block the checkpoint's."""
    if kind == "tensor":
        return _tensor(checkpoint, name, dtype, device, checkpoint_block)
    weight = name[: -len(_SCALE_SUFFIX)] if kind == "scale" else name
    if checkpoint.info(weight).dtype in _FP8:  # kept as published (the model's block is the checkpoint's)
        return jax.device_put(checkpoint.read(name), device)
    values, scale = _quantize(_tensor(checkpoint, weight, jnp.float32, device), tuple(block))
    return scale if kind == "scale" else values


@functools.partial(jax.jit, static_argnums=1)
def _quantize(weight: jax.Array, block: tuple[int, int]):
    return fp8.quantize(weight, block)


def _read_raw_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"no config.json in {directory}") from None
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None


def load_model_from_checkpoint(directory, *, config_class, abstract_model, sources, check, dtype, device=None, configure=None):
    """The loading loop every family shares: config.json -> `config_class`, the model's abstract
    structure, the family's plan of which checkpoint tensors fill which parameter
    (`sources(pure_params, config)`), its checks (`check(checkpoint, sources, config, block)`),
    then each parameter read straight onto `device` in its target dtype (block FP8 parameters as
    published, or quantised at load). configure(config, checkpoint block or None) -> the config
    the model is built with (e.g. its weight_block_size)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    raw = _read_raw_config(directory)
    config = config_class.from_hf_config(raw)
    block = fp8_weight_block(raw)
    if configure is not None:
        config = configure(config, block)
    checkpoint = Checkpoint(directory)
    graphdef, abstract_state = nnx.split(abstract_model(config, dtype))
    pure = nnx.to_pure_dict(abstract_state)
    plan = sources(pure, config)
    check(checkpoint, plan, config, block)

    device = device or jax.local_devices()[0]
    model_block = getattr(config, "weight_block_size", None)
    for source in plan:
        node = pure
        for key in source.path[:-1]:
            node = node[key]
        target = node[source.path[-1]]
        read = lambda name: _source_tensor(checkpoint, name, source.kind, target.dtype, model_block, device, block)  # noqa: E731
        if len(target.shape) == len(source.hf_shape) + 1:  # one tensor per expert
            # Stacked on the device one expert at a time, in place: no host-side [E, ...] copy.
            value = jnp.zeros(target.shape, target.dtype, device=device)
            for e, name in enumerate(source.hf_names):
                value = _set_expert(value, e, read(name).T if source.transpose else read(name))
        else:
            value = read(source.hf_names[0])
        node[source.path[-1]] = value
    nnx.replace_by_pure_dict(abstract_state, pure)
    return nnx.merge(graphdef, abstract_state)
