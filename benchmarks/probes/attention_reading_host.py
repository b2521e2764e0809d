"""Device time of one layer's miss copy + attention against the attention kernel reading the
misses from the pinned pool itself (HiSparseConfig miss_read "copy" vs "attention"), fp8 rows.

    python benchmarks/probes/attention_reading_host.py --out=/tmp/reading_host.json

Per (requests R, heads H) and miss fraction: a device buffer of R x (B + 1) fp8 rows (656 B), a
pinned host pool of R x 32768 rows, K = 2048 distinct selected slots per request, the first
`fraction x K` of them misses (their host rows random; their slots hold NaN-free stale rows).
Variants, each checked bit for bit against "copy" (outputs and the buffer after the call):
  copy       hisparse_copy_host_rows, then the default attention (dequantize_first: an XLA
             gather + dequantise fusion, then the plain-rows kernel): what miss_read "copy" runs;
  copy_il    the same copy, then the kernel's interleave form (what "attention" computes with);
  attention  the host-reading kernel (interleave form), no copy.
Device time per call: the summed kernel durations of one call (benchmarks/device_timing.py),
median over --reps calls, with p10 / p90. Writes one JSON row per (R, H, fraction, variant).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks import device_timing  # noqa: E402
from hisparse_jax import memory  # noqa: E402
from hisparse_jax.row_layout import KVRowLayout  # noqa: E402
from pallas_kernels.row_copy import copy_host_rows_to_buffer  # noqa: E402
from pallas_kernels.sparse_mla_attention import sparse_mla_attention, sparse_mla_attention_reading_host  # noqa: E402

flags.DEFINE_string("out", "outputs/attention_reading_host.json", "Where the JSON goes.")
flags.DEFINE_list("sizes", ["1x64", "23x64", "1x128", "50x128", "88x128"], "R x H cases.")
flags.DEFINE_list("fractions", ["0.0", "0.1"], "Miss fractions of K.")
flags.DEFINE_integer("reps", 20, "Timed calls per variant.")
FLAGS = flags.FLAGS

K, B, LATENT, ROPE, HOST_ROWS_PER_REQUEST = 2048, 4096, 512, 64, 32768
SCALE = 0.0417


def case(R: int, H: int, fraction: float, rng) -> dict:
    layout = KVRowLayout(LATENT, ROPE, "fp8_e4m3")
    kv = layout.to_stored(jnp.asarray(rng.standard_normal((1, R, B + 1, LATENT + ROPE), np.float32), jnp.bfloat16))
    pool = layout.to_stored(jnp.asarray(rng.standard_normal((1, R * HOST_ROWS_PER_REQUEST, LATENT + ROPE), np.float32), jnp.bfloat16))
    pool = jax.device_put(pool, memory.sharding(memory.PINNED_HOST))
    slots = np.stack([rng.permutation(B)[:K] for _ in range(R)]).astype(np.int32)  # i32[R, K]
    misses = int(fraction * K)
    host = np.full((R, K), -1, np.int32)
    for r in range(R):
        host[r, :misses] = r * HOST_ROWS_PER_REQUEST + rng.permutation(HOST_ROWS_PER_REQUEST)[:misses]
    miss_host = np.full((R, K), -1, np.int32)
    miss_device = np.full((R, K), -1, np.int32)
    miss_host[:, :misses], miss_device[:, :misses] = host[:, :misses], slots[:, :misses]
    query = jnp.asarray(rng.standard_normal((R, H, LATENT + ROPE), np.float32), jnp.bfloat16)
    args = dict(slots=jnp.asarray(slots), host=jnp.asarray(host), miss_host=jnp.asarray(miss_host), miss_device=jnp.asarray(miss_device),
                counts=jnp.full((R,), misses, jnp.int32))  # fmt: skip
    return dict(layout=layout, kv=kv, pool=pool, query=query, **args)


def variants(c: dict) -> dict:
    layout, kw = c["layout"], dict(latent_dim=LATENT, sm_scale=SCALE)

    def copy_then(form):
        def run(kv, pool, query):
            kv = copy_host_rows_to_buffer(pool, kv, 0, c["miss_host"], c["miss_device"], c["counts"])
            out = sparse_mla_attention(query, kv, 0, c["slots"], layout=layout, **kw, **({"fp8_form": form} if form else {}))
            return out, kv
        return run

    def reading_host(kv, pool, query):
        return sparse_mla_attention_reading_host(query, kv, 0, c["slots"], c["host"], pool, layout=layout, **kw)

    return {"copy": copy_then(None), "copy_il": copy_then("interleave"), "attention": reading_host}


def main(_):
    rng = np.random.default_rng(0)
    rows = []
    for size in FLAGS.sizes:
        R, H = (int(x) for x in size.split("x"))
        for fraction in (float(f) for f in FLAGS.fractions):
            c = case(R, H, fraction, rng)
            results = {}
            for name, fn in variants(c).items():
                jitted = jax.jit(fn)  # kv not donated: every call starts from the same buffer
                out, kv = jax.block_until_ready(jitted(c["kv"], c["pool"], c["query"]))
                results[name] = (np.asarray(out), np.asarray(kv))
                events, _ = device_timing.record(lambda: jax.block_until_ready(jitted(c["kv"], c["pool"], c["query"])), FLAGS.reps)
                busy = device_timing.busy_per_call(events, FLAGS.reps)
                row = dict(requests=R, heads=H, miss_fraction=fraction, variant=name, **device_timing.summary(busy, "device"))
                row["kernels"] = sorted({e.name for e in events})[:8]
                if name != "copy":  # the copy path is what the others are checked against
                    ref_out, ref_kv = results["copy"]
                    row["equal_to_copy"] = bool(np.array_equal(results[name][1].view(np.uint8), ref_kv.view(np.uint8)))
                    row["out_max_abs_diff_vs_copy"] = float(np.max(np.abs(results[name][0] - ref_out)))
                if name == "attention":
                    row["out_equal_to_copy_il"] = bool(np.array_equal(results[name][0], results["copy_il"][0]))
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(dict(device=str(jax.devices()[0]), rows=rows), f, indent=1)


if __name__ == "__main__":
    app.run(main)
