"""Request lifecycle on the KV state: admit, store prompt rows, advance, release.

Each works on a HiSparseState or a FullKVState alike and is traceable (the engine jits them
with the state donated and `state_shardings` as output shardings). Host pages themselves are
handed out by hisparse_jax.host_pages.HostPageAllocator; these functions only record them.

Shape letters: L layers, R requests, T prompt rows in one call, W row width, P pages per request.
"""

from __future__ import annotations

import jax.numpy as jnp

from hisparse_jax.state import FullKVState
from pallas_kernels.row_copy import write_rows_to_host
from pallas_kernels.swap_in import host_slots_of


def begin_request(state, request, prompt_len, host_pages=None):
    """Claims request slot `request` for a prompt of `prompt_len` tokens.

    host_pages: i32[P] host pages backing the request's positions in order, -1 past the end
    (HiSparse only). The buffer starts empty with the LRU in slot order; store_prefill_rows
    then preloads it when the prompt fits. seq_lens counts the prompt from here on: store every
    prompt row before the first decode step.
    """
    if isinstance(state, FullKVState):
        return state.replace(seq_lens=state.seq_lens.at[request].set(prompt_len))
    if host_pages is None:
        raise ValueError("begin_request on a HiSparseState needs the request's host_pages")
    B = state.buffer_size
    return state.replace(
        host_page_table=state.host_page_table.at[request].set(host_pages.astype(jnp.int32)),
        buffer_tokens=state.buffer_tokens.at[:, request].set(-1),
        lru_slots=state.lru_slots.at[:, request].set(jnp.arange(B, dtype=jnp.int32)),
        seq_lens=state.seq_lens.at[request].set(prompt_len),
    )


def store_prefill_rows(state, layer, request, start, rows, prompt_len, *, implementation=None):
    """Stores prompt rows [T, W] of positions start .. start+T-1 of `request` for `layer`.

    Rows at positions >= prompt_len are padding of the last chunk and are dropped.
    HiSparse: rows go straight to the host pool (direct-to-host; the device never holds the
    whole context); when the whole prompt fits in the buffer (prompt_len <= B) they are also
    preloaded into slots 0..prompt_len-1, as the decode fast path expects.
    """
    T = rows.shape[0]
    positions = start + jnp.arange(T, dtype=jnp.int32)  # i32[T]
    valid = positions < prompt_len
    if isinstance(state, FullKVState):
        target = jnp.where(valid, positions, state.max_context)
        return state.replace(kv=state.kv.at[layer, request, target].set(rows.astype(state.kv.dtype), mode="drop"))

    page_row = state.host_page_table[request]  # i32[P]
    host_slot = jnp.where(valid, host_slots_of(page_row, positions, state.page_size), -1)
    pool = write_rows_to_host(state.host_pool, layer, rows, host_slot, implementation=implementation)

    B = state.buffer_size
    preload = valid & (prompt_len <= B)
    target = jnp.where(preload, positions, B + 1)  # dropped unless preloading
    device_buffer = state.device_buffer.at[layer, request, target].set(rows.astype(state.device_buffer.dtype), mode="drop")
    buffer_tokens = state.buffer_tokens.at[layer, request, target].set(positions, mode="drop")
    return state.replace(host_pool=pool, device_buffer=device_buffer, buffer_tokens=buffer_tokens)


def advance(state, active):
    """After all layers of a decode step: each active request (bool[R]) stored one more token."""
    return state.replace(seq_lens=state.seq_lens + active.astype(jnp.int32))


def end_request(state, request):
    """Frees request slot `request` (its host pages go back to the allocator separately)."""
    if isinstance(state, FullKVState):
        return state.replace(seq_lens=state.seq_lens.at[request].set(0))
    return state.replace(
        host_page_table=state.host_page_table.at[request].set(-1),
        buffer_tokens=state.buffer_tokens.at[:, request].set(-1),
        seq_lens=state.seq_lens.at[request].set(0),
    )
