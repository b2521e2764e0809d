"""One sparse layer's decode step: write newest -> swap-in -> backup -> sparse MLA attention.

`attention_layer` is what a model calls in each DSA layer. The same signature serves both
memory modes, chosen by the state it is given (hisparse_jax.state.KVState):
  HiSparseState: the full KV in pinned host memory, a B-slot hot buffer per request on device;
  FullKVState:   the no-offload baseline, every row on the device.
Both run the same attention kernel over rows in the same top-k order, so with the same inputs
their outputs are bit-identical (tests/test_attention_layer.py).

Order inside a step, and why (each stage is a KVState method; FullKV's swap-in and backup move
nothing):
  1. write_newest: the newest row goes to its device slot (HiSparse: slot = position while
     n <= B, else the reserved slot B), so attention can read it without a host round trip;
  2. swap_in: the swap-in plan, then the copy of the missed rows host -> device (pallas_kernels;
     with HiSparseConfig.miss_read "attention" the copy is deferred to step 4's kernel);
  3. backup_newest: eager backup of the newest row device -> its host slot, after the copy
     (which never needs it: the newest position resolves to a device slot); the next step's
     swap-in reads the pool XLA returns here, which orders the backup before any read of that
     row from the host. With backup=False the caller backs the rows up itself, after its last
     layer (models/dsa/decoding.py: kv_cache_ops.backup_newest_rows), so that no copy of a later
     layer waits for an in-place pool write;
  4. attend: attention over the resolved slots of state.device_rows (miss_read "attention": the
     kernel reads the misses from the host pool and writes them to their slots as it goes).

Shared-index layers (GLM IndexShare) replay their anchor's plan. prefetch_shared_rows fetches a
shared layer's missed rows as soon as the anchor's plan exists, into a fresh array on a second
GPU stream (mode "ffi_stream": a CUDA stream of our own, two XLA FFI calls; "stream": XLA's
stream annotation), so the PCIe copy runs beside the attention kernels of the layers between;
shared_attention_layer(prefetched=...) then only places them (device to device).
docs/architecture.md ("Overlap") says which mode overlaps and what the H200 profile shows.

Shape letters (hisparse_jax.state): L layers, R requests, H heads, K top-k entries, W stored row
width, D latent width (latent_dim). The query is D + rope wide (the row's values); W is that too
for plain rows and 164 words for 512 + 64 fp8 rows (hisparse_jax.row_layout), which attention
dequantises as it reads them.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

from hisparse_jax.config import SHARED_PREFETCH_MODES
from hisparse_jax.state import KVState, jit_donating_state
from pallas_kernels.common import check_equal, check_layer_index, check_rank, resolve_implementation
from pallas_kernels.side_stream_gather import PendingGather, can_build_gpu
from pallas_kernels.swap_in import SwapInPlan


class LayerStepInfo(NamedTuple):
    """What a layer step reports besides its output."""

    num_hits: jax.Array  # i32[R]: distinct selected positions already on the device
    num_misses: jax.Array  # i32[R]: distinct positions copied host -> device
    plan: SwapInPlan | None  # the swap-in plan, for shared-index layers to replay (record_plan)


def lengths_from_positions(positions: jax.Array) -> jax.Array:
    """positions i32[R] (-1 inactive) -> i32[R] tokens stored once this step's row is written; 0 inactive."""
    return jnp.where(positions >= 0, positions + 1, 0)


def _check_step_inputs(state: KVState, layer, query, new_row, positions, selection_name, selection) -> None:
    """Static shape checks shared by attention_layer and shared_attention_layer."""
    check_layer_index(layer, state.num_layers)
    check_rank("query", query, 3, "[R, H, W]")
    check_rank("new_row", new_row, 2, "[R, W]")
    check_rank("positions", positions, 1, "[R]")
    check_rank(selection_name, selection, 2, "[R, K]")
    # A batch of b <= R requests runs in slots 0 .. b - 1 (the engine's batch buckets).
    b, layout = positions.shape[0], state.layout
    if b > state.num_requests:
        raise ValueError(f"positions batch ({b}) must not exceed the state's request slots (R = {state.num_requests})")
    for name, array in (("query", query), ("new_row", new_row), (selection_name, selection)):
        check_equal(f"{name} batch", array.shape[0], "positions batch (b)", b)
    # The query meets the row's values (latent + rope), whatever width the stored row has.
    check_equal("query width", query.shape[2], "the state's latent + rope width", layout.logical_width)
    layout.check_rows("new_row", new_row)


def attention_layer(
    state: KVState,
    layer,  # int or i32[]: which sparse layer
    query,  # [R, H, latent + rope]: absorbed query in the row's order (latent part, then rope part)
    new_row,  # row[R, W]: this step's KV row of every request (or its values [R, latent + rope])
    positions,  # i32[R]: position of the new token (= tokens already stored), -1 inactive
    topk,  # i32[R, K]: selected positions in [0, positions], -1 padding; K <= B for HiSparse
    *,
    latent_dim: int,
    sm_scale: float,
    implementation: str | None = None,
    record_plan: bool = False,
    backup: bool = True,
    before_attention=None,  # (state, plan, query) -> query: work to issue after the swap-in
):
    """One DSA layer's decode attention -> (state, f32[R, H, D], LayerStepInfo); D = latent_dim.

    R here may be any batch b <= the state's slots: the step then covers slots 0 .. b - 1.

    state: HiSparseState or FullKVState; layer: int or i32[]; query: [R, H, latent + rope], any
    float dtype; new_row: the stored row row[R, W] (state.layout.pack(latent, rope)) or its values
    [R, latent + rope] (packed here); positions: i32[R], -1 inactive; topk: i32[R, K], -1
    padding, K <= B.
    Writes the newest row, swaps in the selected rows (HiSparseState), backs the newest row up
    to the host, and attends over the selected rows. record_plan keeps the swap-in plan in the
    info, for a following shared_attention_layer. backup=False leaves the backup of new_row to
    the caller, who must run kv_cache_ops.backup_newest_rows before the next step (the reserved
    slot holds the row until then). before_attention(state, plan, query) -> query runs once the
    layer's rows are in place, before its attention (e.g. starting shared layers' side-stream
    gathers, threaded through the query). Traceable; call it inside the model's jitted,
    state-donating decode step. Raises ValueError on inconsistent static shapes.
    """
    _check_step_inputs(state, layer, query, new_row, positions, "topk", topk)
    new_row = state.layout.to_stored(new_row)  # packed once: the device slot and the backup get the same bits
    state = state.write_newest(layer, new_row, positions)
    with jax.named_scope("swap_in"):  # scope names: where a profile's kernels belong (benchmarks/step_split.py)
        # defer_copy: with miss_read "attention" the attention kernel reads the misses itself.
        state, plan = state.swap_in(layer, topk, lengths_from_positions(positions), implementation=implementation, defer_copy=True)
        if backup:
            state = state.backup_newest(layer, new_row, positions, implementation=implementation)
    if before_attention is not None:
        query = before_attention(state, plan, query)
    with jax.named_scope("attention"):
        state, out = state.attend(layer, query, plan, deferred_topk=topk, latent_dim=latent_dim, sm_scale=sm_scale, implementation=implementation)
    return state, out, LayerStepInfo(plan.num_hits, plan.num_misses, plan if record_plan else None)


def jit_attention_layer(state: KVState, *, latent_dim: int, sm_scale: float, implementation: str | None = None):
    """attention_layer as one jitted function for every layer (the layer index is traced, so
    it compiles once), the state donated: `step(state, layer, query, new_row, positions, topk)
    -> (state, out, info)` with the shapes of attention_layer. `state` only gives the output
    shardings. A model that runs all its layers in one jitted step (models/dsa/decoding.py) calls
    attention_layer directly instead."""
    fn = functools.partial(attention_layer, latent_dim=latent_dim, sm_scale=sm_scale, implementation=implementation)
    return jit_donating_state(fn, state, extra_outputs=2)


def shared_attention_layer(
    state: KVState,
    layer,  # int or i32[]
    query,  # [R, H, W]
    new_row,  # row[R, W]
    positions,  # i32[R]
    anchor: LayerStepInfo,  # the anchor (full indexer) layer's info, recorded with record_plan=True
    *,
    latent_dim: int,
    sm_scale: float,
    implementation: str | None = None,
    prefetched: jax.Array | PendingGather | None = None,  # prefetch_shared_rows(state, layer, anchor)[0]
    backup: bool = True,
    before_attention=None,  # as attention_layer's
):
    """A layer that reuses its anchor's top-k (GLM IndexShare) -> (state, f32[R, H, D], LayerStepInfo).

    Arguments as attention_layer, with the anchor's LayerStepInfo (its plan: i32[R, K] slots)
    in place of topk. The anchor's swap-in decisions hold for it too, so it replays the anchor's
    miss plan into its own buffer: from `prefetched` rows (fetched early, see
    prefetch_shared_rows) when given, else as a copy-only kernel from the host pool now. Its own
    buffer_tokens / lru_slots rows are not consulted: the anchor's govern both layers. backup and
    before_attention as attention_layer's. The returned info carries the anchor's plan and counters.
    """
    if anchor.plan is None:
        raise ValueError("shared_attention_layer needs the anchor's plan: call attention_layer(..., record_plan=True)")
    plan = anchor.plan
    _check_step_inputs(state, layer, query, new_row, positions, "anchor plan slots", plan.slots)
    new_row = state.layout.to_stored(new_row)
    # write_newest first: it depends on this layer's input, which orders the in-place updates of
    # the buffer after the previous layer's attention read it (else XLA would copy the buffer).
    state = state.write_newest(layer, new_row, positions)
    if isinstance(prefetched, PendingGather):  # this layer's compute (its query) waits, not earlier work
        prefetched, query = prefetched.wait(query)
    with jax.named_scope("swap_in"):
        if prefetched is not None:
            state = state.replay_prefetched(layer, plan, prefetched)
        else:
            state = state.replay_swap_in(layer, plan, implementation=implementation)
        if backup:
            state = state.backup_newest(layer, new_row, positions, implementation=implementation)
    if before_attention is not None:
        query = before_attention(state, plan, query)
    with jax.named_scope("attention"):  # the anchor's misses are placed by now: no topk
        state, out = state.attend(layer, query, plan, latent_dim=latent_dim, sm_scale=sm_scale, implementation=implementation)
    return state, out, LayerStepInfo(plan.num_hits, plan.num_misses, plan)


# ---- shared-index prefetch ---------------------------------------------------------------------

# The A/B switch (HISPARSE.md section 6): "ffi_stream" (opt-in, see shared_prefetch_mode) gathers
# on a CUDA stream of our own through two XLA FFI calls (pallas_kernels.side_stream_gather),
# "stream" through XLA's stream annotation (compute_on "gpu_stream:1"), "early" in the main stream
# (XLA alone orders it), "off" replays in line.
SHARED_PREFETCH_ENV = "HISPARSE_SHARED_PREFETCH"
SIDE_STREAM = "gpu_stream:1"  # XLA's stream annotation (compute_on); the main stream is 0


def shared_prefetch_mode(mode: str | None = None, implementation: str | None = None) -> str:
    """The prefetch mode: `mode` (HiSparseConfig.shared_prefetch), else $HISPARSE_SHARED_PREFETCH,
    else the default: "ffi_stream" on a CUDA GPU where nvcc is found (the GPU / reference
    kernels), "off" (in-line copies) elsewhere.

    "ffi_stream" is the mode that overlaps on the H200 (docs/architecture.md, "Overlap"; it
    builds a CUDA library with nvcc on first use); its GPU tests all pass there
    (benchmarks/gpu_tests_h200.sh: the one failing case is the "stream" mode's, XLA's own
    stream annotation). "stream" and "early" are A/B modes: on JAX 0.11.2 XLA schedules
    the annotated call's start right before its done, so they overlap nothing. Every prefetch
    mode holds up to K rows per request of each pending shared layer on the device
    (DeviceFootprint counts them). The TPU kernels have no gather. Raises ValueError for an
    unknown mode."""
    chosen = mode or os.environ.get(SHARED_PREFETCH_ENV) or None
    if chosen is None:
        default_on = jax.default_backend() == "gpu" and resolve_implementation(implementation) != "tpu" and can_build_gpu()
        return "ffi_stream" if default_on else "off"
    if chosen != "off" and resolve_implementation(implementation) == "tpu":
        raise ValueError(f"shared prefetch mode {chosen!r} needs the GPU / reference kernels: the TPU path has no gather yet")
    if chosen not in SHARED_PREFETCH_MODES:
        raise ValueError(f"shared prefetch mode must be one of {SHARED_PREFETCH_MODES}, got {chosen!r} (${SHARED_PREFETCH_ENV})")
    return chosen


def on_side_stream(fn, *arrays):
    """fn(*arrays) as a computation XLA runs on SIDE_STREAM (an async call-start / call-done pair
    on the GPU, so the main stream's kernels go on meanwhile; needs
    --xla_gpu_experimental_stream_annotation where that flag defaults to false). Outputs land in
    device memory. Elsewhere (CPU) the annotation is ignored and fn runs in line."""
    return compute_on(compute_type=SIDE_STREAM, out_memory_spaces=jax.memory.Space.Device)(fn)(*arrays)


def _in_line(fn, *arrays):
    return fn(*arrays)


def prefetch_shared_rows(state: KVState, layer, anchor: LayerStepInfo, *, implementation: str | None = None, mode: str = "stream", tie=None):
    """The rows shared-index `layer` will replay from `anchor`'s plan, fetched from now on ->
    (prefetched, tie). Pass `prefetched` to shared_attention_layer(prefetched=...).

    mode "ffi_stream": a PendingGather on a CUDA stream of its own (`layer` a static int); the
    compute that uses the returned `tie` (e.g. the anchor's attention output) is issued after
    the start, so it runs beside the copy. "stream": row[R, K, W] gathered on SIDE_STREAM;
    "early": the same in the main stream; both return `tie` untouched. None for a FullKVState
    (nothing to copy). The state's pool must see no in-place write between this and that layer
    (call both with backup=False and back up after the last layer); the state itself is
    unchanged, so nothing waits for the fetch until the shared layer places its rows."""
    if anchor.plan is None:
        raise ValueError("prefetch_shared_rows needs the anchor's plan: call attention_layer(..., record_plan=True)")
    if mode not in ("ffi_stream", "stream", "early"):
        raise ValueError(f"prefetch_shared_rows mode must be 'ffi_stream', 'stream' or 'early', got {mode!r}")
    check_layer_index(layer, state.num_layers)
    if mode == "ffi_stream":
        if tie is None:
            raise ValueError("prefetch_shared_rows mode 'ffi_stream' needs `tie`: a value the compute after the start uses")
        return state.start_side_prefetch(layer, anchor.plan, tie)
    launch = on_side_stream if mode == "stream" else _in_line
    return state.prefetch_misses(layer, anchor.plan, implementation=implementation, launch=launch), tie
