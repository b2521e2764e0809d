"""Sparse MLA attention's constants and input checks, shared by its implementations."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.common import check_equal, check_layer_index, check_rank

MASKED = -float("inf")


def check_inputs(query, kv, layer, slots, latent_dim, layout=None) -> None:
    """Static shape checks shared by the reference and the kernel. layout: a KVRowLayout or
    None (plain rows: kv's own float dtype, W = latent + rope)."""
    check_rank("query", query, 3, "[R, H, W]")
    check_rank("kv", kv, 4, "[L, R, S, W]")
    check_rank("slots", slots, 2, "[R, K]")
    R, W = query.shape[0], kv.shape[3]
    # A batch of R <= the cache's slots attends over slots 0 .. R - 1 (the engine's batch buckets).
    # kv with one request slot is a pool shared by the whole batch (hisparse_jax.paged_state):
    # slots then index its rows directly.
    if kv.shape[1] < R and kv.shape[1] != 1:
        raise ValueError(f"query batch (R = {R}) must not exceed the kv request slots ({kv.shape[1]})")
    check_equal("slots batch", slots.shape[0], "query batch (R)", R)
    if layout is None:
        if not jnp.issubdtype(kv.dtype, jnp.floating):
            raise ValueError(f"kv rows of {jnp.dtype(kv.dtype).name} are packed: pass their layout=")
        check_equal("query width", query.shape[2], "kv row width (W)", W)
        if not 0 < latent_dim <= W:
            raise ValueError(f"latent_dim ({latent_dim}) must be in [1, row width ({W})]")
    else:
        check_equal("kv row width", W, f"the {layout.kind} layout's row width (W)", layout.width)
        check_equal("kv dtype", jnp.dtype(kv.dtype).name, f"the {layout.kind} layout's dtype", layout.dtype.name)
        check_equal("latent_dim", latent_dim, "the layout's latent_dim", layout.latent_dim)
        check_equal("query width", query.shape[2], "the layout's latent + rope width", layout.logical_width)
    check_layer_index(layer, kv.shape[0])


def check_host_inputs(kv, slots, host_slots, pool) -> None:
    """Static checks of the misses read from the host pool: host_slots i32[R, K] like slots, pool
    row[L, S_host, W] with kv's layers, row width and dtype."""
    check_rank("host_slots", host_slots, 2, "[R, K]")
    check_equal("host_slots shape", tuple(host_slots.shape), "slots shape", tuple(slots.shape))
    check_rank("pool", pool, 3, "[L, S_host, W]")
    check_equal("pool layers", pool.shape[0], "kv layers (L)", kv.shape[0])
    check_equal("pool row width", pool.shape[2], "kv row width (W)", kv.shape[3])
    check_equal("pool dtype", jnp.dtype(pool.dtype).name, "kv dtype", jnp.dtype(kv.dtype).name)


def is_quantized(layout) -> bool:
    return layout is not None and layout.quantized
