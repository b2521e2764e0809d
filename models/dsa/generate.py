"""Greedy generation with a DSA model, one request slot per prompt, through its ModelRunner
(what checkpoint decoding and the tests call).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from hisparse_jax import sharding as dp_sharding
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.host_pages import HostPageAllocator
from models.common import inputs
from models.common.inputs import check_hisparse_with
from models.common.progress import DecodeProgress
from models.dsa.checks import check_hisparse as check_dsa_hisparse
from models.dsa.model import DSAForCausalLM
from models.dsa.runner import ModelRunner


class GenerateOutput(NamedTuple):
    tokens: np.ndarray  # i32[B, N]: greedy tokens
    logits: np.ndarray  # f32[B, N, V]: the logits each token was chosen from
    num_hits: np.ndarray  # i32[N - 1, L, B]: per decode step (the first token comes from prefill)
    num_misses: np.ndarray  # i32[N - 1, L, B]


def generate(
    model: DSAForCausalLM | ModelRunner,
    prompts,
    max_new_tokens: int,
    *,
    hisparse: HiSparseConfig | None = None,
    page_size: int = 64,
    fill_value: float = 0.0,
    kv_cache_dtype: str | None = None,
) -> GenerateOutput:
    """Greedy decoding of prompts i32[B, T], one request slot per prompt; EOS does not stop it.
    kv_cache_dtype: the cache's format (create_cache); None: the runner's (a model: "auto").

    Raises models.common.inputs.InputError (a ValueError) for prompts the model cannot take: non-integer
    ids, ids outside the vocabulary, an empty array, T + max_new_tokens beyond
    max_position_embeddings, a HiSparse top_k other than the model's, prompts that do not split
    over the runner's data-parallel groups."""
    config = model.config
    max_new_tokens = inputs.check_max_new_tokens(max_new_tokens)
    prompts = inputs.check_prompts(prompts, config, max_new_tokens=max_new_tokens)
    check_hisparse_with(check_dsa_hisparse, hisparse, config)
    runner = model if isinstance(model, ModelRunner) else ModelRunner(model, kv_cache_dtype=kv_cache_dtype or "auto")
    kv_cache_dtype = kv_cache_dtype or runner.kv_cache_dtype
    B, T = prompts.shape
    inputs.check_parallel(config, runner.parallel if runner.mesh is not None else None, num_requests=B, requests="prompts")
    max_context = T + max_new_tokens
    num_host_pages = None
    # With data-parallel attention each group pages its own block of the pool (page ids local to it).
    groups = 1 if runner.mesh is None else runner.mesh.shape[dp_sharding.REQUEST_AXIS]
    if hisparse is not None:
        num_host_pages = B * -(-max_context // page_size)
        allocators = [HostPageAllocator(num_host_pages // groups, page_size) for _ in range(groups)]
    cache = runner.create_cache(
        num_requests=B, max_context=max_context, hisparse=hisparse, num_host_pages=num_host_pages,
        page_size=page_size, fill_value=fill_value, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip

    progress = DecodeProgress(max_new_tokens - 1, config.model_type)
    progress.prefill(B, T)
    first = []
    for b in range(B):
        pages = None
        if hisparse is not None:
            allocator = allocators[b // (B // groups)]
            pages = allocator.page_table_row(allocator.allocate(max_context), cache.kv.host_page_table.shape[1])
        cache, logits = runner.prefill(cache, b, prompts[b], host_pages=pages)
        first.append(logits)
    logits = jnp.stack(first)  # f32[B, V]
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    progress.prefilled(wait_for=tokens)
    out_tokens, out_logits, hits, misses = [tokens], [logits], [], []
    positions = jnp.full((B,), T, jnp.int32)
    for step in range(1, max_new_tokens):
        cache, logits, telemetry = runner.decode_step(cache, tokens, positions)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        progress.step(step, wait_for=tokens)
        positions = positions + 1
        out_tokens.append(tokens)
        out_logits.append(logits)
        hits.append(telemetry.num_hits)
        misses.append(telemetry.num_misses)
    L = runner.config.num_layers
    stack = lambda xs: np.stack(xs) if xs else np.zeros((0, L, B), np.int32)  # noqa: E731
    return GenerateOutput(
        np.stack(out_tokens, axis=1), np.stack(out_logits, axis=1).astype(np.float32), stack(hits), stack(misses)
    )
