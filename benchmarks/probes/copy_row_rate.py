"""The miss copy's rate from the pinned pool, as the rank runs it against the bench's: does the copy
slow down with the pool's size, with L2 and TLBs cold from other work, or with fp8 rows?

    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=100 python benchmarks/probes/copy_row_rate.py --out=$OUT/copy_row_rate.json   # ~3 min

Why: in DeepSeek-V3.2's rank at 40,960 tokens (50 running, fp8 rows of 656 B, 61 layers) the copy
took 14.4 ms a step: ~42 rows/us, 27.7 GB/s (PERFORMANCE.md, fourteenth session). The kernel bench
moved 43.6 rows/us of 1152 B rows (50 GB/s, a 9.66 GB pool) and the attention probe ~68 rows/us
of fp8 rows (~45 GB/s, a 1 GB pool, the same rows every call). Same kernel, same grid; what differs in the rank is the pool
(~100 GB over 61 layers) and the work between two layers' copies (the MoE streams GBs of weights).

Per case (row kind, R requests x M misses, pool layers L) one pinned pool of L x R x C rows (C
tokens a request); the copied layer is the last. The calls take --miss_sets miss lists in turn
(no row in two lists: each step of a run misses rows it has not read lately, which a repeated
list would leave in L2). The rows read hold random bytes, every buffer slot starts as 0xFF..
bytes; after the last call the buffer must equal that with its list's rows in their slots, bit
for bit (checked on the host for every case and launch shape). Between calls,
--sweep_mb of HBM is read and written when > 0 (what a layer's other work does to L2 and TLBs).
Device time per call: the copy kernel's own duration (benchmarks/device_timing.py), median over
--reps calls, p10 / p90; rows/us and GB/s of row bytes. --smoke: tiny sizes on the CPU.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks import device_timing  # noqa: E402
from benchmarks.helpers import checks_exit_status  # noqa: E402
from hisparse_jax import memory  # noqa: E402
from hisparse_jax.row_layout import KVRowLayout  # noqa: E402
from pallas_kernels.row_copy import copy_host_rows_to_buffer_pallas, write_rows_to_host  # noqa: E402

flags.DEFINE_string("out", "outputs/copy_row_rate.json", "Where the JSON goes.")
flags.DEFINE_list("kinds", ["fp8_e4m3", "bfloat16"], "Row layouts (KVRowLayout kinds): 656 B and 1152 B rows.")
flags.DEFINE_list("cases", ["50x199", "9x203"], "R requests x M misses each (DeepSeek-V3.2's capacity at 40,960, GLM-5.1's at 131,072).")
flags.DEFINE_list("layers", ["1", "61"], "Pool layers L (the pool: L x R x C rows).")
flags.DEFINE_integer("context", 40960, "C: pool rows per request and layer.")
flags.DEFINE_list("rows", ["16", "32"], "Rows per work item (HiSparseConfig.copy_rows_per_program).")
flags.DEFINE_list("programs_per_sm", ["4", "8"], "Copy programs per SM.")
flags.DEFINE_list("sweep_mb", ["0", "1024"], "HBM read and written between calls (0: none).")
flags.DEFINE_integer("reps", 20, "Timed calls per launch shape.")
flags.DEFINE_integer("miss_sets", 4, "Distinct miss lists the calls take in turn (a run misses new rows each step).", lower_bound=1)
flags.DEFINE_float("max_pool_gb", 90, "Cases whose pool is larger are skipped (the H200 machine has 128 GB of RAM).")
flags.DEFINE_float("time_budget_s", 240, "Start no new case after this many seconds (the JSON is written after each case).")
flags.DEFINE_bool("smoke", False, "Tiny sizes (CPU, interpret mode): the script's own test.")
FLAGS = flags.FLAGS

LATENT, ROPE, K, BUFFER_SLOTS = 512, 64, 2048, 4096
COPY_KERNEL = "hisparse_copy_host_rows"


def make_case(kind: str, R: int, M: int, L: int, C: int, sets: int, rng) -> dict:
    """The pool (zeros but for the rows the miss lists read, random, in layer L - 1), the device
    buffer of every layer (0xFF.. bytes, as the engine's [L, R, B, W]) and `sets` miss lists of
    M distinct rows per request (no row in two sets, as each step of a run misses new rows),
    with what the copied layer's buffer must hold after a copy of each set."""
    layout = KVRowLayout(LATENT, ROPE, kind)
    W, dtype = layout.width, layout.dtype
    pool = memory.allocate((L, R * C, W), dtype, 0, memory.PINNED_HOST)  # row[L, S, W]
    miss_host = np.full((sets, R, K), -1, np.int32)  # i32[sets, R, K]
    miss_device = np.full((R, K), -1, np.int32)  # i32[R, K]: every set fills the same slots
    for r in range(R):
        miss_host[:, r, :M] = (r * C + rng.choice(C, sets * M, replace=False)).reshape(sets, M)
        miss_device[r, :M] = rng.choice(BUFFER_SLOTS, M, replace=False)
    rows = rng.integers(0, 256, (sets, R, M, W * dtype.itemsize), np.uint8).view(dtype)  # row[sets, R, M, W]: random bytes
    pool = write_rows_to_host(pool, L - 1, jnp.asarray(rows.reshape(-1, W)), jnp.asarray(miss_host[:, :, :M].reshape(-1)))
    full = np.frombuffer(b"\xff" * dtype.itemsize, dtype)[0]
    expected = np.full((sets, R, BUFFER_SLOTS, W), full, dtype)  # row[sets, R, B, W]: layer L - 1 after each set's copy
    for r in range(R):
        expected[:, r, miss_device[r, :M]] = rows[:, r]
    return dict(pool=pool, buffer=memory.allocate((L, R, BUFFER_SLOTS, W), dtype, full, memory.DEVICE), expected=expected,
                layer=L - 1, row_bytes=W * dtype.itemsize, rows=R * M, miss_host=[jnp.asarray(m) for m in miss_host],
                miss_device=jnp.asarray(miss_device), counts=jnp.full((R,), M, jnp.int32))  # fmt: skip


def time_shape(c: dict, rows: int, programs: int, sweep_mb: int, reps: int) -> dict:
    """Copies layer L - 1's misses `reps` times, each call the next miss set (the buffer donated,
    as in a step), a sweep of sweep_mb of HBM before each; -> the copy kernel's device time and
    the check of the buffer after the last call."""
    copy = jax.jit(
        lambda pool, buffer, miss_host: copy_host_rows_to_buffer_pallas(pool, buffer, c["layer"], miss_host, c["miss_device"], c["counts"], rows=rows, programs=programs),
        donate_argnums=1,
    )  # fmt: skip
    sweep = jax.jit(lambda x: x + 1, donate_argnums=0)
    scratch = [jnp.zeros(max(sweep_mb, 1) << 18, jnp.uint32)]  # u32[sweep_mb MB / 4]
    calls = [0]

    def call():
        if sweep_mb:
            scratch[0] = sweep(scratch[0])
        c["buffer"] = copy(c["pool"], c["buffer"], c["miss_host"][calls[0] % len(c["miss_host"])])
        calls[0] += 1
        jax.block_until_ready(c["buffer"])

    call()  # compile
    events, _ = device_timing.record(call, reps)
    got = np.asarray(c["buffer"][c["layer"]])
    expected = c["expected"][(calls[0] - 1) % len(c["miss_host"])]
    row = dict(rows_per_item=rows, programs=programs, sweep_mb=sweep_mb, exact=bool(np.array_equal(got.view(np.uint8), expected.view(np.uint8))))
    durations = [e.duration_ns / 1e3 for e in events if COPY_KERNEL in e.name]
    if durations:
        row.update(device_timing.summary(durations, "copy"))
        row["rows_per_us"] = c["rows"] / row["copy_us"]
        row["GB_per_s"] = c["rows"] * c["row_bytes"] / row["copy_us"] / 1e3
    return row


def main(_):
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    smoke = FLAGS.smoke
    cases = ["2x5"] if smoke else FLAGS.cases
    layers = ["1", "2"] if smoke else FLAGS.layers
    context, reps = (64, 2) if smoke else (FLAGS.context, FLAGS.reps)
    shapes = list(itertools.product([int(x) for x in FLAGS.rows], [int(x) for x in FLAGS.programs_per_sm], [int(x) for x in FLAGS.sweep_mb]))
    sms = getattr(jax.devices()[0], "core_count", None) or 2
    results = []

    def save():
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), context=context, miss_sets=FLAGS.miss_sets, rows=results), f, indent=1)

    for kind, case, L in itertools.product(FLAGS.kinds, cases, (int(x) for x in layers)):
        R, M = (int(x) for x in case.split("x"))
        pool_bytes = L * R * context * KVRowLayout(LATENT, ROPE, kind).bytes_per_row
        if pool_bytes > FLAGS.max_pool_gb * 1e9:
            print(f"skipped {kind} {case} at {L} layers: a {pool_bytes / 1e9:.0f} GB pool (--max_pool_gb={FLAGS.max_pool_gb:g})", flush=True)
            continue
        if time.perf_counter() - start > FLAGS.time_budget_s:
            print(f"skipped {kind} {case} at {L} layers: past --time_budget_s={FLAGS.time_budget_s:g}", flush=True)
            continue
        c = make_case(kind, R, M, L, context, FLAGS.miss_sets, rng)
        pool_gb = c["pool"].size * c["pool"].dtype.itemsize / 1e9
        for rows, per_sm, sweep_mb in shapes:
            row = dict(kind=kind, requests=R, misses=M, layers=L, pool_gb=pool_gb, programs_per_sm=per_sm,
                       **time_shape(c, rows, per_sm * sms, 1 if smoke and sweep_mb else sweep_mb, reps))  # fmt: skip
            results.append(row)
            print(json.dumps(row), flush=True)
        c["pool"].delete()  # ~82 GB pinned at 61 layers: freed before the next case's
        c["buffer"].delete()
        del c
        save()
    save()
    return checks_exit_status([r for r in results if not r["exact"]], len(results), "copies differ from the expected buffer")


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
