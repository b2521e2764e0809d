"""Checks on what a caller hands the model: prompts, generation lengths, the HiSparse and parallel
settings against the architecture, and checkpoint decoding's files. One place, so the library
(models.dsa.generate.generate, decode_checkpoint) and the command line (serving.validation,
which names the flag at fault) refuse the same inputs with the same words.

    config = load_config("ckpt/")                              # the architecture alone, no weights
    prompts = check_prompts(read_prompts("p.npz"), config, max_new_tokens=32)   # i32[B, T]

Every check raises InputError (a ValueError) with a message naming the value and the limit it
breaks. Nothing here imports JAX: a command can refuse its inputs before building anything.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from typing import Any

import numpy as np

from configs.model import DSAModelConfig


class InputError(ValueError):
    """A prompt, length, file or setting the model cannot take; the message says which and why."""


def check_max_new_tokens(max_new_tokens: Any) -> int:
    """A positive integer (bool refused: True is not a length)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    return int(max_new_tokens)


def check_prompts(prompts: Any, config: DSAModelConfig, *, max_new_tokens: int | None = None, name: str = "prompts") -> np.ndarray:
    """prompts -> i32[B, T]: integer token ids in [0, vocab_size), at least one prompt of at least
    one token, and (given max_new_tokens) T + max_new_tokens within max_position_embeddings.

    Ids outside the vocabulary are refused rather than clamped: the embedding gather would clamp
    them silently, so two different prompts would decode identically."""
    try:
        array = np.asarray(prompts)
    except ValueError as error:  # ragged nested lists
        raise InputError(f"{name} must be a rectangular [B, T] array of token ids ({error})") from None
    if array.dtype.kind not in "iu":  # refuses bool, float, complex, str and object arrays
        raise InputError(f"{name} must hold integer token ids, got dtype {array.dtype}")
    if array.ndim != 2:
        raise InputError(f"{name} must be a [B, T] array (B prompts of T tokens), got shape {array.shape}")
    if array.size == 0:
        raise InputError(f"{name} is empty (shape {array.shape}): needs at least one prompt of at least one token")
    vocab = config.vocab_size
    outside = (array < 0) | (array >= vocab)
    if outside.any():
        b, t = (int(i) for i in np.argwhere(outside)[0])
        raise InputError(
            f"{name} holds token id {int(array[b, t])} outside the vocabulary [0, {vocab})"
            f" (prompt {b}, position {t}; {int(outside.sum())} such ids in all)"
        )
    if max_new_tokens is not None:
        check_context(array.shape[1], max_new_tokens, config)
    return array.astype(np.int32)


def check_context(prompt_len: int, max_new_tokens: Any, config: DSAModelConfig) -> None:
    """A prompt of prompt_len tokens and max_new_tokens more fit the model's max_position_embeddings."""
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    total, limit = prompt_len + max_new_tokens, config.max_position_embeddings
    if total > limit:
        raise InputError(
            f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} = {total} tokens exceeds"
            f" the model's max_position_embeddings ({limit})"
        )


def check_parallel(config: DSAModelConfig, parallel, *, num_requests: int | None = None, requests: str = "requests") -> None:
    """The model splits over `parallel` (a hisparse_jax.sharding.ParallelConfig) as models/common/parallel.py
    splits it: attention heads over attention_tp devices, dense and expert intermediate sizes over
    tp_size devices; `num_requests` request slots over dp_size groups. Checked before any weight
    is placed (jax would refuse an uneven split with a long IndivisibleError)."""
    if parallel is None or parallel.is_single_device:
        return
    tp, dp, heads_tp = parallel.tp_size, parallel.dp_size, parallel.attention_tp
    layout = f"tp_size={tp}, dp_size={dp}, enable_dp_attention={parallel.enable_dp_attention}"
    if config.num_heads % heads_tp:
        raise InputError(f"the model's {config.num_heads} attention heads do not split over {heads_tp} devices ({layout})")
    sizes = []
    if "dense" in config.mlp_layer_types:
        sizes.append(("intermediate_size", config.intermediate_size))
    if "sparse" in config.mlp_layer_types:
        sizes.append(("moe_intermediate_size", config.moe_intermediate_size))
    for field, size in sizes:
        if size % tp:
            raise InputError(f"the model's {field} ({size}) does not split over tp_size={tp} devices ({layout})")
    if num_requests is not None and num_requests % dp:
        raise InputError(f"{num_requests} {requests} do not split over {dp} data-parallel groups ({layout})")


def read_prompts(path: str | os.PathLike) -> np.ndarray:
    """`input_ids` of an .npz file, as stored (check_prompts checks its contents)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise InputError(f"no file {path}")
    if os.path.isdir(path):
        raise InputError(f"{path} is a directory, not an .npz file")
    if not path.endswith(".npz"):
        raise InputError(f"{path} is not an .npz file: save prompts with np.savez(PATH.npz, input_ids=...)")
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as error:
        raise InputError(f"cannot read {path}: {error}") from None
    if magic == b"\x93NUMPY":
        raise InputError(f"{path} holds a single .npy array, not an .npz archive with input_ids")
    if not zipfile.is_zipfile(path):
        raise InputError(f"{path} is not an .npz archive (np.savez(PATH.npz, input_ids=...) writes one)")
    unreadable = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)
    try:
        data = np.load(path, allow_pickle=False)
    except unreadable as error:
        raise InputError(f"{path} is not a readable .npz file ({error})") from None
    with data:
        if "input_ids" not in data.files:
            raise InputError(f"{path} has no input_ids array (found {sorted(data.files)})")
        try:
            return data["input_ids"]
        except ValueError as error:
            if "allow_pickle" in str(error):
                raise InputError(f"{path}: input_ids is an object array; token ids must be integers") from None
            raise InputError(f"{path}: input_ids is unreadable ({error})") from None
        except unreadable as error:
            raise InputError(f"{path}: input_ids is unreadable ({error})") from None


def check_output_path(path: str | os.PathLike) -> str:
    """Where decoding writes its .npz: the name must end in .npz (np.savez would append it, so the
    file written would not be the one named) in an existing, writable directory."""
    path = os.fspath(path)
    if not path.endswith(".npz"):
        raise InputError(f"{path} must end in .npz")
    if os.path.isdir(path):
        raise InputError(f"{path} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise InputError(f"directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"directory {parent} is not writable")
    return path


def check_hisparse_with(check, hisparse, config) -> None:
    """Runs a family's HiSparse check (check(config, hisparse) raising ValueError) as an input
    check: None (no offload) passes, a refusal becomes an InputError with the same words."""
    if hisparse is None:
        return
    try:
        check(config, hisparse)
    except ValueError as error:
        raise InputError(str(error)) from None
