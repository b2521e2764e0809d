"""SYNTHETIC top-k selection for the miss-rate study: not what any model selects.

A random-weight model's indexer does not select like a trained one (its consecutive top-k sets
overlap far less), so its miss rates say little about a real deployment. This selector replaces
the indexer's choice in the decode step with sets whose step-to-step overlap is a parameter:
each step keeps `round(overlap * K)` entries of the previous set (a random subset) and draws the
rest uniformly from the context positions outside it. Everything measured with it is labelled
synthetic and kept apart from real-model figures (engine, run_decode, plots).

Letters: J full-indexer layers, R request slots, K top-k entries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from serving.errors import UsageError


def _uniform(keys, shape):
    """keys [R] -> f32[J, R, N] (shape = (J, N)): each slot's draws come from its own key."""
    return jnp.moveaxis(jax.vmap(lambda k: jax.random.uniform(k, shape))(keys), 0, 1)


def _draws(keys, num_layers: int, m: int):
    """keys [R] -> f32[J, R, m] uniform draws, draw i of each (layer, slot) the same whatever m:
    threefry's counters run over an [m, J] shape (jax_threefry_partitionable, JAX's default), so
    a shorter run of draws is a prefix of a longer one. synthetic_topk's two forms then pick a
    steady request's fresh positions alike, so its selections do not depend on its neighbours."""
    return jnp.transpose(jax.vmap(lambda k: jax.random.uniform(k, (m, num_layers)))(keys), (2, 0, 1))


def _member(values, sorted_set):
    """values i32[..., N], sorted_set i32[..., S] (ascending) -> bool[..., N]: each value in the set."""
    flat_values, flat_set = values.reshape(-1, values.shape[-1]), sorted_set.reshape(-1, sorted_set.shape[-1])
    # "scan_unrolled": the binary search unrolled, so the program holds no while loop (a loop's
    # trip test can be read back on the host; the default "scan" method is a fori_loop).
    index = jax.vmap(functools.partial(jnp.searchsorted, method="scan_unrolled"))(flat_set, flat_values)  # i32[rows, N]
    found = jnp.take_along_axis(flat_set, jnp.minimum(index, flat_set.shape[-1] - 1), axis=-1) == flat_values
    return found.reshape(values.shape)


def fresh_positions(key_fresh, previous_sorted, n, count: int):
    """`count` distinct positions in [0, n) outside the previous selection, a uniform random
    subset in random order, per (layer, request); -1 where too few were found (a context
    barely longer than K: the caller keeps more previous entries then).

    Sequential sampling with rejection: 4 x count + 64 uniform draws, each kept if it is not in
    the previous selection and no earlier draw had its value. O(count log count) per row, where a
    top-k over the whole context (the earlier form) cost the rank benchmark 8 ms per step.
    key_fresh: key[R]; previous_sorted: i32[J, R, K] ascending, invalid entries as a value >= n;
    n: i32[1, R, 1] context lengths -> i32[J, R, count]."""
    J = previous_sorted.shape[0]
    m = 4 * count + 64
    draws = jnp.minimum((_draws(key_fresh, J, m) * n).astype(jnp.int32), jnp.maximum(n - 1, 0))  # i32[J, R, m]
    order = jnp.argsort(draws, axis=-1, stable=True)  # equal values: the earliest draw first
    by_value = jnp.take_along_axis(draws, order, axis=-1)
    first_sorted = jnp.concatenate([jnp.ones_like(by_value[..., :1], bool), by_value[..., 1:] != by_value[..., :-1]], axis=-1)
    first = jnp.zeros_like(first_sorted).at[
        jnp.arange(J)[:, None, None], jnp.arange(draws.shape[1])[None, :, None], order
    ].set(first_sorted)  # bool[J, R, m]: no earlier draw had this value
    ok = first & ~_member(draws, previous_sorted)
    pick = jnp.argsort(jnp.where(ok, 0, 1), axis=-1, stable=True)[..., :count]  # the first `count` ok draws, in draw order
    return jnp.where(jnp.take_along_axis(ok, pick, axis=-1), jnp.take_along_axis(draws, pick, axis=-1), -1)


def synthetic_topk(keys, previous, lengths, *, overlap: float, steady: bool):
    """The next synthetic selection of every (layer, request).

    keys: key[R], one per slot (the engine derives it from the request and position, so a
    request's selections do not depend on what else runs);
    previous: i32[J, R, K] last step's selection, -1 none (a fresh request);
    lengths: i32[R] context incl. this step's token (0: inactive slot);
    steady (static): every slot longer than K has a whole previous selection (the caller's
    bookkeeping, SyntheticSelector), so K - keep fresh positions per slot suffice; else K.
    -> i32[J, R, K]: distinct positions in [0, length), -1 padding. A context of at most K
    positions is selected whole, as the indexer's top-k does. When fewer than K - keep fresh
    positions are found, more previous entries are kept instead.
    """
    J, R, K = previous.shape
    keep = round(overlap * K)
    n = lengths[None, :, None]  # i32[1, R, 1]
    k_order, k_fresh = jax.vmap(jax.random.split, out_axes=1)(keys)  # key[R] each
    valid = (previous >= 0) & (previous < n)  # bool[J, R, K]
    # A random order of the previous selection, valid entries first.
    order = jnp.argsort(jnp.where(valid, _uniform(k_order, (J, K)), 2.0), axis=-1)
    shuffled = jnp.take_along_axis(jnp.where(valid, previous, -1), order, axis=-1)  # i32[J, R, K]
    previous_sorted = jnp.sort(jnp.where(valid, previous, jnp.iinfo(jnp.int32).max), axis=-1)  # i32[J, R, K]
    # K - keep fresh positions once every running request has a whole previous selection (the
    # steady state: cheap); K while some request starts (its first selection is all fresh). A
    # static choice, not a lax.cond: a cond's predicate is read back to the host, which would make
    # every step wait for the one before it (the engine dispatches the next step ahead).
    count = max(K - keep, 1) if steady else K
    fresh = fresh_positions(k_fresh, previous_sorted, n, count)
    fresh = jnp.pad(fresh, ((0, 0), (0, 0), (0, K - count)), constant_values=-1)  # i32[J, R, K]
    # Priority: `keep` previous entries, then fresh ones, then the other previous ones; first K valid win.
    pool = jnp.concatenate([shuffled[..., :keep], fresh, shuffled[..., keep:]], axis=-1)  # i32[J, R, 2K]
    rank = jnp.where(pool >= 0, jnp.arange(pool.shape[-1]), pool.shape[-1])
    picked = jnp.take_along_axis(pool, jnp.argsort(rank, axis=-1)[..., :K], axis=-1)  # i32[J, R, K]
    whole = jnp.where(jnp.arange(K) < n, jnp.arange(K), -1)  # i32[1, R, K]: short contexts
    return jnp.where(n <= K, whole, picked).astype(jnp.int32)


def overlap_counts(previous, current):
    """(entries of `current` also in `previous`, valid entries of `current`), each i32[J, R].

    previous, current: i32[J, R, K], -1 padding. The measured overlap is their ratio.
    """
    valid = current >= 0
    previous_sorted = jnp.sort(jnp.where(previous >= 0, previous, jnp.iinfo(jnp.int32).max), axis=-1)
    shared = _member(current, previous_sorted) & valid
    return jnp.sum(shared, axis=-1, dtype=jnp.int32), jnp.sum(valid, axis=-1, dtype=jnp.int32)


def _step(key, previous, positions, request_ids, *, overlap: float, steady: bool):
    """positions, request_ids i32[R] (position -1: inactive) -> synthetic_topk plus its measured
    overlap against `previous`, over (layer, request) pairs whose previous and current sets are
    both full -> (i32[J, R, K], shared i32[], compared i32[])."""
    K = previous.shape[-1]
    lengths = jnp.where(positions >= 0, positions + 1, 0)  # i32[R]
    keys = jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(key, r), p))(request_ids, positions)
    current = synthetic_topk(keys, previous, lengths, overlap=overlap, steady=steady)
    shared, valid = overlap_counts(previous, current)
    full = (valid == K) & (jnp.sum(previous >= 0, axis=-1) == K)  # bool[J, R]
    return current, jnp.sum(jnp.where(full, shared, 0)), jnp.sum(jnp.where(full, valid, 0))


def _select(key, previous, counts, positions, request_ids, *, overlap: float, steady: bool):
    """One jitted call per step: the selection of slots 0 .. b - 1 (b = positions' length), written
    back into `previous` (donated), and the running overlap counts -> (previous i32[J, R, K],
    counts i32[2], current i32[J, b, K])."""
    b = positions.shape[0]
    current, shared, compared = _step(key, previous[:, :b], positions, request_ids, overlap=overlap, steady=steady)
    previous = jax.lax.dynamic_update_slice(previous, current, (0, 0, 0))
    return previous, counts + jnp.stack([shared, compared]), current


class SyntheticSelector:
    """Per-slot synthetic selection state, stepped once per decode step (all slots at once)."""

    def __init__(self, *, num_index_layers: int, num_requests: int, top_k: int, overlap: float, seed: int = 0):
        if not 0.0 <= overlap <= 1.0:
            raise UsageError(f"synthetic_topk_overlap must be in [0, 1], got {overlap}")
        self.overlap = overlap
        self.previous = jnp.full((num_index_layers, num_requests, top_k), -1, jnp.int32)  # i32[J, R, K]
        # i64[R]: the context length of each slot's last selection (0: none since its reset). The
        # host's copy of what `previous` holds, so that a step never reads the device to choose
        # its form (synthetic_topk's `steady`).
        self._selected_length = np.zeros(num_requests, np.int64)
        self._key = jax.random.key(seed)
        self._select = jax.jit(functools.partial(_select, overlap=overlap), static_argnames="steady", donate_argnums=(1, 2))
        self._reset = jax.jit(lambda previous, slot: previous.at[:, slot].set(-1), donate_argnums=0)
        self._move = jax.jit(lambda previous, source, target: previous.at[:, target].set(previous[:, source]), donate_argnums=0)
        self.reset_counts()

    def reset_counts(self) -> None:
        """Starts the measured overlap afresh (the engine does at each run)."""
        # i32[2] device counters (shared, compared): summed on the device so a step never waits for the host.
        self._counts = jnp.zeros((2,), jnp.int32)

    @property
    def shared_entries(self) -> int:
        """Sum over steps of |S_t & S_t-1| (full sets only)."""
        return int(self._counts[0])

    @property
    def compared_entries(self) -> int:
        """Sum over the same pairs of K."""
        return int(self._counts[1])

    def reset(self, slot: int) -> None:
        """A new request starts in `slot`: no previous selection."""
        self.previous = self._reset(self.previous, jnp.int32(slot))
        self._selected_length[slot] = 0

    def move(self, source: int, target: int) -> None:
        """The request in slot `source` moved to `target` (the engine's compaction): so does its
        previous selection."""
        self.previous = self._move(self.previous, jnp.int32(source), jnp.int32(target))
        self._selected_length[target] = self._selected_length[source]

    def select(self, positions, request_ids) -> jax.Array:
        """positions i32[b] (-1 inactive), request_ids i32[b] of slots 0 .. b - 1 (b <= R) ->
        this step's top-k i32[J, b, K].

        The draws depend on (seed, request id, position) and on whether every request of the
        batch is past its first selection (the step's form, `steady`): a request gets the same
        selections whatever runs beside it once no neighbour is starting, and whichever slot it
        runs in, so HiSparse and the baseline stay token-identical.

        A slot longer than K whose last selection was at the position before has a whole one
        (min(K, n - 1) = K entries), so the host knows the form without reading the device. (A
        first selection of a context barely longer than K can come out short, as its fresh draws
        run out: the next step's fresh draws fill it up.)"""
        positions = np.asarray(positions, np.int64)  # i64[b]
        lengths = np.where(positions >= 0, positions + 1, 0)  # i64[b]
        b = len(lengths)
        K = self.previous.shape[-1]
        steady = bool(np.all((lengths <= K) | (self._selected_length[:b] == lengths - 1)))
        self.previous, self._counts, current = self._select(
            self._key, self.previous, self._counts, positions.astype(np.int32), np.asarray(request_ids, np.int32), steady=steady
        )
        self._selected_length[:b] = lengths
        return current

    def warm(self, b: int) -> jax.Array:
        """Compiles both forms of a b-slot step, so a timed run compiles nothing; on an idle
        engine (it clears slots 0 .. b - 1). -> the (all -1) selection i32[J, b, K]."""
        positions, request_ids = np.full(b, -1, np.int32), np.zeros(b, np.int32)
        for steady in (False, True):
            self.previous, self._counts, current = self._select(self._key, self.previous, self._counts, positions, request_ids, steady=steady)
        self._selected_length[:b] = 0
        return current

    @property
    def measured_overlap(self) -> float | None:
        """Mean |S_t & S_t-1| / K over every full-to-full step so far; None before any."""
        compared = self.compared_entries
        return self.shared_entries / compared if compared else None
