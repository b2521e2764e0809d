"""Request lifecycle on the KV state: admit, store prompt rows, back up a step's newest rows,
advance, release.

Each works on any KVState (HiSparseState or FullKVState; the state's own methods do what its
memory mode needs) and is traceable: the engine jits them with the state donated and
`state_shardings` as output shardings. Host pages themselves are handed out by
hisparse_jax.host_pages.HostPageAllocator; these functions only record them.

Shape letters (hisparse_jax.state): L layers, R requests, T prompt rows in one call, W row
width, P pages per request.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hisparse_jax.state import KVState
from pallas_kernels.common import check_layer_index, check_rank


def begin_request(state: KVState, request, prompt_len, host_pages=None) -> KVState:
    """Claims request slot `request` (int or i32[]) for a prompt of `prompt_len` (int or i32[]) tokens.

    host_pages: i32[P] host pages backing the request's positions in order, -1 past the end
    (HiSparse only; a FullKVState ignores it). The buffer starts empty with the LRU in slot
    order; store_prefill_rows then preloads it when the prompt fits. seq_lens counts the prompt
    from here on: store every prompt row before the first decode step.
    """
    return state.begin_request(request, prompt_len, host_pages)


def store_prefill_rows(state: KVState, layer, request, start, rows, prompt_len, *, implementation=None) -> KVState:
    """Stores prompt rows of positions start .. start+T-1 of `request` for `layer`.

    rows: stored rows row[T, W], or their values [T, latent + rope] in any float dtype, which
    the state's layout packs (quantised once, here, for fp8 rows; a cast for plain layouts).

    layer, request, start, prompt_len: int or i32[]. Rows at positions >= prompt_len are padding
    of the last chunk and are dropped. HiSparse: rows go straight to the host pool
    (direct-to-host; the device never holds the whole context); when the whole prompt fits in
    the buffer (prompt_len <= B) they are also preloaded into slots 0..prompt_len-1, as the
    decode fast path expects. FullKV: rows go to their positions of the on-device KV.
    """
    check_layer_index(layer, state.num_layers)
    check_rank("rows", rows, 2, "[T, W]")
    state.layout.check_rows("rows", rows)
    return state.store_prefill_rows(layer, request, start, rows, prompt_len, implementation=implementation)


def backup_newest_rows(state: KVState, rows, positions, *, implementation=None) -> KVState:
    """Backs up every layer's newest row after the last layer of a decode step (the layers ran
    with backup=False): rows is a sequence of L stored rows row[b, W] (layer l's at rows[l]) or
    row[L, b, W]; positions i32[b], -1 inactive (skipped).

    Why after the last layer: each backup writes the pinned pool in place, and XLA must order an
    in-place write after every read of the pool it overwrites; per layer, the next layer's copy
    (or a shared layer's prefetch) would wait for it. Here one barrier over the whole state orders
    all of this step's copies and prefetches first, and nothing of this step waits for the
    backups. The contract holds: the newest row stays in its device slot (the reserved slot B
    once n > B) until the next step's write_newest, which comes after these writes. All L
    layers' rows go in one launch (state.backup_all_newest), not one kernel per layer.
    """
    check_rank("positions", positions, 1, "[b]")
    if len(rows) != state.num_layers:
        raise ValueError(f"rows holds {len(rows)} layers, expected the state's L = {state.num_layers}")
    state = jax.lax.optimization_barrier(state)
    rows = rows if isinstance(rows, jax.Array) else jnp.stack(list(rows))  # row[L, b, W]
    return state.backup_all_newest(rows, positions, implementation=implementation)  # one launch, not L


def advance(state: KVState, active) -> KVState:
    """After all layers of a decode step: each active request (bool[b], slots 0 .. b - 1 of a
    batch of b <= R) stored one more token."""
    check_rank("active", active, 1, "[b]")
    if active.shape[0] > state.num_requests:
        raise ValueError(f"active length ({active.shape[0]}) must not exceed the state's request slots ({state.num_requests})")
    grown = jnp.zeros_like(state.seq_lens).at[: active.shape[0]].set(active.astype(jnp.int32))  # i32[R]
    return state.replace(seq_lens=state.seq_lens + grown)


def move_request(state: KVState, source, target) -> KVState:
    """Moves the request in slot `source` to the free slot `target` (ints or i32[]), leaving
    `source` free: the engine keeps its running requests in the first slots this way, so a
    decode step over a batch of b slots covers them all. Its host pages stay where they are."""
    return state.move_request(source, target)


def end_request(state: KVState, request) -> KVState:
    """Frees request slot `request` (int or i32[]); its host pages go back to the allocator separately."""
    return state.end_request(request)
