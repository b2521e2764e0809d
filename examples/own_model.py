"""Using HiSparse from your own model: a few decode steps, HiSparse vs keeping all KV on the device.

    python examples/own_model.py                           # jnp reference kernels (CPU: seconds)
    python examples/own_model.py --implementation=pallas   # Pallas kernels (interpreted on CPU)

A DSA model's decode step, per sparse layer, produces an absorbed query, the new token's KV row
and the indexer's top-k positions; `attention_layer` does the rest. This script stands in random
numbers for the model (prompt KV rows, queries, rows, top-k), runs the same steps over a
HiSparseState (KV offloaded to pinned host memory, a small hot buffer per request on the device)
and over a FullKVState (every row on the device), and checks the outputs are equal: HiSparse
changes where rows live, never what attention computes.

The library's API with shapes, and the swap-in contract, are in docs/contract.md.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax.numpy as jnp
import numpy as np

from hisparse_jax.attention_layer import jit_attention_layer
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.host_pages import HostPageAllocator
from hisparse_jax.kv_cache_ops import advance, begin_request, end_request, store_prefill_rows
from hisparse_jax.row_layout import KVRowLayout
from hisparse_jax.state import FullKVState, HiSparseState, jit_donating_state

# Your model's attention dimensions (tiny here; DeepSeek-V3.2 has latent 512, rope 64, 128 heads).
NUM_LAYERS = 2  # L: sparse (DSA) layers
NUM_HEADS = 4  # H
LATENT, ROPE = 32, 16  # a stored KV row is [latent | rope], W = 48 values
SM_SCALE = (LATENT + ROPE) ** -0.5

# HiSparse sizes: the indexer picks TOP_K positions per step; each request keeps BUFFER rows per
# layer on the device (BUFFER >= TOP_K), the rest in pinned host memory, in pages of PAGE_SIZE.
TOP_K, BUFFER, PAGE_SIZE = 8, 16, 8
MAX_CONTEXT = 64  # C: positions per request slot
NUM_SLOTS = 3  # R: request slots, the fixed decode batch; a free slot decodes at position -1

# Two requests: one prompt longer than the buffer (the buffer starts empty; every step swaps
# rows in and evicts least recently used ones), one that fits (its rows stay on the device).
PROMPT_LENS = {0: 24, 1: 5}  # slot -> prompt tokens; slot 2 stays free
DECODE_STEPS = 6


def make_inputs(seed: int = 0) -> dict:
    """Random stand-ins for what a model computes: prompt KV rows, and per step and layer the
    query, the new token's KV row and the indexer's top-k."""
    rng = np.random.default_rng(seed)
    W = LATENT + ROPE
    prompt_rows = {r: rng.standard_normal((NUM_LAYERS, n, W)).astype(np.float32) for r, n in PROMPT_LENS.items()}
    steps = []
    for t in range(DECODE_STEPS):
        # i32[R]: the position each slot's new token takes (= tokens stored so far), -1 if free.
        positions = np.array([PROMPT_LENS[r] + t if r in PROMPT_LENS else -1 for r in range(NUM_SLOTS)], np.int32)
        layers = []
        for _ in range(NUM_LAYERS):
            topk = np.full((NUM_SLOTS, TOP_K), -1, np.int32)  # -1 is padding
            for r, p in enumerate(positions):
                if p >= 0:  # any positions in [0, p] (p is the new token itself), some repeated
                    count = min(TOP_K, p + 1)
                    topk[r, :count] = rng.integers(0, p + 1, count)
            layers.append(
                dict(
                    query=rng.standard_normal((NUM_SLOTS, NUM_HEADS, W)).astype(np.float32),  # [R, H, W]
                    new_row=rng.standard_normal((NUM_SLOTS, W)).astype(np.float32),  # row[R, W]
                    topk=topk,  # i32[R, K]
                )
            )
        steps.append(dict(positions=positions, layers=layers))
    return dict(prompt_rows=prompt_rows, steps=steps)


def run(state, inputs, implementation, allocator=None) -> dict:
    """Admits the requests, stores their prompts, decodes DECODE_STEPS steps, releases them.

    The same code runs over a HiSparseState or a FullKVState: the state's type picks the mode.
    Returns the attention outputs f32[steps, L, R, H, LATENT] and the swap-in counters.
    """
    # Every function that returns the state is jitted with the state donated (its buffers are
    # updated in place) and output shardings that keep the host pool in pinned host memory.
    begin = jit_donating_state(begin_request, state)
    store = jit_donating_state(functools.partial(store_prefill_rows, implementation=implementation), state)
    finish_step = jit_donating_state(advance, state)
    release = jit_donating_state(end_request, state)
    # One compiled layer step for every layer (the layer index is traced). A model that jits its
    # whole decode step calls attention_layer itself, inside that jit, with the same arguments.
    layer_step = jit_attention_layer(state, latent_dim=LATENT, sm_scale=SM_SCALE, implementation=implementation)

    # 1. Admission: HiSparse needs host pages for every token the request will store (prompt and
    #    generated); the allocator is plain Python, the state only records the page numbers.
    pages = {}
    for slot, prompt_len in PROMPT_LENS.items():
        page_row = None
        if allocator is not None:
            pages[slot] = allocator.allocate(prompt_len + DECODE_STEPS)
            assert pages[slot] is not None, "host pool too small"
            page_row = jnp.asarray(HostPageAllocator.page_table_row(pages[slot], state.host_page_table.shape[1]))  # i32[P]
        state = begin(state, jnp.int32(slot), jnp.int32(prompt_len), page_row)
        # 2. Prefill: your model computes the prompt's KV rows layer by layer; store each layer's
        #    rows row[T, W] (HiSparse writes them straight to the host pool; a prompt that fits
        #    in the buffer is also preloaded there). Chunks may be padded: rows at positions
        #    >= prompt_len are dropped.
        for layer in range(NUM_LAYERS):
            rows = jnp.asarray(inputs["prompt_rows"][slot][layer])
            state = store(state, jnp.int32(layer), jnp.int32(slot), jnp.int32(0), rows, jnp.int32(prompt_len))

    # 3. Decode: per step, every sparse layer calls attention_layer with its query, the new
    #    token's row and the indexer's top-k; then `advance` counts the new token.
    outputs, hits, misses = [], [], []
    for step in inputs["steps"]:
        positions = jnp.asarray(step["positions"])  # i32[R]
        step_out, step_hits, step_misses = [], [], []
        for layer, x in enumerate(step["layers"]):
            state, out, info = layer_step(
                state, jnp.int32(layer), jnp.asarray(x["query"]), jnp.asarray(x["new_row"]), positions, jnp.asarray(x["topk"])
            )  # out: f32[R, H, LATENT]; info.num_hits / num_misses: i32[R]
            step_out.append(np.asarray(out))
            step_hits.append(np.asarray(info.num_hits))
            step_misses.append(np.asarray(info.num_misses))
        state = finish_step(state, positions >= 0)
        outputs.append(step_out)
        hits.append(step_hits)
        misses.append(step_misses)

    # 4. Release: free the slot, then give its host pages back.
    for slot in PROMPT_LENS:
        state = release(state, jnp.int32(slot))
        if allocator is not None:
            allocator.free(pages[slot])
    return dict(outputs=np.asarray(outputs), hits=np.asarray(hits), misses=np.asarray(misses))


def main(argv=None) -> dict:
    """Runs both memory modes; returns their results and whether the outputs are equal."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--implementation", choices=["reference", "pallas"], default="reference",
        help="kernels: the jnp references, or Pallas (interpreted on CPU, Triton on GPU)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    layout = KVRowLayout(LATENT, ROPE, "float32")  # "bfloat16" for real models
    config = HiSparseConfig(top_k=TOP_K, device_buffer_size=BUFFER, host_to_device_ratio=2)
    hisparse = HiSparseState.create(
        num_layers=NUM_LAYERS, num_requests=NUM_SLOTS, max_context=MAX_CONTEXT, config=config, layout=layout,
        page_size=PAGE_SIZE,  # num_host_pages defaults to host_to_device_ratio x the device buffers
    )  # fmt: skip
    allocator = HostPageAllocator(hisparse.num_host_pages, PAGE_SIZE)
    full = FullKVState.create(num_layers=NUM_LAYERS, num_requests=NUM_SLOTS, max_context=MAX_CONTEXT, layout=layout)

    inputs = make_inputs()
    with_hisparse = run(hisparse, inputs, args.implementation, allocator)
    all_on_device = run(full, inputs, args.implementation)

    equal = bool(np.array_equal(with_hisparse["outputs"], all_on_device["outputs"]))
    print(
        f"{DECODE_STEPS} steps x {NUM_LAYERS} layers ({args.implementation}): HiSparse swapped in"
        f" {int(with_hisparse['misses'].sum())} rows, {int(with_hisparse['hits'].sum())} hits;"
        f" outputs {'equal' if equal else 'DIFFER'} to the full-KV run"
    )
    return dict(equal=equal, hisparse=with_hisparse, full=all_on_device)


if __name__ == "__main__":
    sys.exit(0 if main()["equal"] else 1)
