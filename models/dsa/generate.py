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
from models.dsa.speculative import DraftState


class GenerateOutput(NamedTuple):
    tokens: np.ndarray  # i32[B, N]: greedy tokens
    logits: np.ndarray  # f32[B, N, V]: the logits each token was chosen from
    num_hits: np.ndarray  # i32[S, L, B]: per decode step (S = N - 1 without speculation: the first token comes from prefill)
    num_misses: np.ndarray  # i32[S, L, B]; with speculation L + 1 layers (the MTP layer last)
    # Speculative decoding: i32[S, B] drafts accepted per step and request, -1 once the request
    # had its N tokens (it then sits the step out); None without speculation.
    num_accepted: np.ndarray | None = None


def generate(
    model: DSAForCausalLM | ModelRunner,
    prompts,
    max_new_tokens: int,
    *,
    hisparse: HiSparseConfig | None = None,
    page_size: int = 64,
    fill_value: float = 0.0,
    kv_cache_dtype: str | None = None,
    speculative=None,
    draft_override=None,
) -> GenerateOutput:
    """Greedy decoding of prompts i32[B, T], one request slot per prompt; EOS does not stop it.
    kv_cache_dtype: the cache's format (create_cache); None: the runner's (a model: "auto").

    speculative: a configs.speculative.SpeculativeConfig decodes with the model's MTP layer
    (models.dsa.speculative; a runner given here must have been built with it): the same tokens,
    several per step. draft_override i32[B, T + max_new_tokens + num_steps + 1] (tests,
    benchmarks): draft tokens by position instead of the MTP layer's.

    Raises models.common.inputs.InputError (a ValueError) for prompts the model cannot take: non-integer
    ids, ids outside the vocabulary, an empty array, T + max_new_tokens beyond
    max_position_embeddings, a HiSparse top_k other than the model's, prompts that do not split
    over the runner's data-parallel groups."""
    config = model.config
    max_new_tokens = inputs.check_max_new_tokens(max_new_tokens)
    prompts = inputs.check_prompts(prompts, config, max_new_tokens=max_new_tokens)
    check_hisparse_with(check_dsa_hisparse, hisparse, config)
    runner = model if isinstance(model, ModelRunner) else ModelRunner(model, kv_cache_dtype=kv_cache_dtype or "auto", speculative=speculative)
    if speculative is not None and runner.speculative != speculative:
        raise ValueError(f"generate(speculative={speculative}) needs a runner built with it (it has {runner.speculative})")
    kv_cache_dtype = kv_cache_dtype or runner.kv_cache_dtype
    B, T = prompts.shape
    inputs.check_parallel(config, runner.parallel if runner.mesh is not None else None, num_requests=B, requests="prompts")
    # A speculative step writes up to num_steps positions past its last kept one.
    max_context = T + max_new_tokens + (0 if speculative is None else speculative.tokens_per_step)
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
    first, drafts = [], []
    for b in range(B):
        pages = None
        if hisparse is not None:
            allocator = allocators[b // (B // groups)]
            pages = allocator.page_table_row(allocator.allocate(max_context), cache.kv.host_page_table.shape[1])
        job = runner.start_prefill(cache, b, prompts[b], host_pages=pages)
        cache = job.cache
        while not job.done:
            cache = job.advance(cache)
        first.append(job.logits)
        drafts.append(job.draft)
    if speculative is not None:
        return _generate_speculative(runner, cache, prompts, first, drafts, max_new_tokens, draft_override)
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


def _generate_speculative(runner: ModelRunner, cache, prompts, first_logits, drafts, max_new_tokens: int, draft_override) -> GenerateOutput:
    """The decode loop of generate(speculative=...): a speculative step for every request still
    short of max_new_tokens (the others sit it out, inactive), each emitting its accepted drafts
    + 1 tokens; tokens past max_new_tokens are dropped."""
    B, T = prompts.shape
    carry = DraftState(*(jnp.stack(parts) for parts in zip(*drafts)))  # bonus i32[B], draft i32[B], hidden [B, D]
    tokens = [[int(t)] for t in np.asarray(carry.bonus)]
    logits = [[np.asarray(row)] for row in first_logits]  # f32[V] per token
    lengths = np.full(B, T, np.int32)  # committed tokens per request
    override = None if draft_override is None else jnp.asarray(draft_override, jnp.int32)
    hits, misses, accepted_per_step = [], [], []
    while min(len(t) for t in tokens) < max_new_tokens:
        running = np.array([len(t) < max_new_tokens for t in tokens])
        committed = np.where(running, lengths, -1).astype(np.int32)
        cache, out = runner.speculative_step(cache, carry, committed, override)
        carry = out.carry
        step_tokens, accepted, step_logits = np.asarray(out.tokens), np.asarray(out.num_accepted), np.asarray(out.logits)
        for b in np.flatnonzero(running):
            keep = min(int(accepted[b]) + 1, max_new_tokens - len(tokens[b]))
            tokens[b].extend(int(t) for t in step_tokens[b, :keep])
            logits[b].extend(step_logits[b, :keep])
        lengths = np.where(running, lengths + accepted + 1, lengths)
        accepted_per_step.append(np.where(running, accepted, -1).astype(np.int32))
        hits.append(np.asarray(out.num_hits))
        misses.append(np.asarray(out.num_misses))
    L = runner.config.num_layers + 1
    stack = lambda xs: np.stack(xs) if xs else np.zeros((0, L, B), np.int32)  # noqa: E731
    return GenerateOutput(
        np.array(tokens, np.int32), np.array(logits, np.float32), stack(hits), stack(misses),
        np.stack(accepted_per_step) if accepted_per_step else np.zeros((0, B), np.int32),
    )  # fmt: skip
