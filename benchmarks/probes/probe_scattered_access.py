"""Probe: how fast one Pallas (Triton) program gathers scattered 4-byte words from global memory.

    python benchmarks/probes/probe_scattered_access.py --out=probe.json

The swap-in plan kernel (pallas_kernels/swap_in/) is one program per request whose time is
mostly passes of scattered 4-byte loads and stores over a position-indexed scratch row (SGLang
keeps the same table in shared memory, which Pallas' Triton lowering cannot allocate). This
probe isolates that cost: each program holds `lanes` indices and makes `passes` dependent gather
passes over its own 128 KB table (next index = f(loaded word), so no pass can start early), at
1 program and at 1 or 2 programs per SM; a pass of consecutive indices is the coalesced
contrast. Time per pass = (t(9 passes) - t(1 pass)) / 8, kernel device time from the profiler
(benchmarks/device_timing.py), L2 warm (the tables fit in it).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from benchmarks import device_timing  # noqa: E402
from pallas_kernels import common  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "probe_scattered_access.json", "Where to write the results JSON.")
flags.DEFINE_integer("reps", 10, "Timed calls per configuration (median reported).")
flags.DEFINE_bool("smoke", False, "Tiny sizes, interpret mode (CPU).")

TABLE = 32768  # words per program: one request's scratch row at a 32k context


def _probe_kernel(start_ref, table_ref, out_ref, *, lanes, passes, coalesced):
    # start_ref: i32[P, lanes]; table_ref: i32[P, TABLE] (random words in [0, TABLE)); out_ref: i32[P, lanes]
    p = pl.program_id(0)
    lane = jnp.arange(lanes, dtype=jnp.int32)
    index = start_ref[p, :] if not coalesced else lane  # i32[lanes]
    acc = jnp.zeros((lanes,), jnp.int32)
    for step in range(passes):
        word = common.gather(table_ref, (p, index), lane >= 0, 0)  # i32[lanes]: one 4-byte load per lane
        acc = acc + word
        # Scattered: the next pass's addresses depend on this pass's words (a chain, as in the
        # plan kernel). Coalesced: the next `lanes` consecutive words (16-byte vector loads).
        index = (word ^ index) & (TABLE - 1) if not coalesced else lane + (step + 1) * lanes % (TABLE - lanes + 1)
    out_ref[p, :] = acc


@functools.lru_cache(maxsize=None)
def probe(programs, lanes, passes, coalesced, num_warps):
    kernel = functools.partial(_probe_kernel, lanes=lanes, passes=passes, coalesced=coalesced)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((programs, lanes), jnp.int32),
        grid=(programs,),
        in_specs=[common.any_spec()] * 2,
        out_specs=common.any_spec(),
        compiler_params=common.triton_params(num_warps=num_warps),
        interpret=common.interpret_mode(),
        name="probe_scattered_access",
    )
    return jax.jit(call)


def time_probe(programs, lanes, passes, coalesced, num_warps, start, table):
    fn = probe(programs, lanes, passes, coalesced, num_warps)
    fn(start, table).block_until_ready()
    events, _ = device_timing.record(lambda: fn(start, table).block_until_ready(), FLAGS.reps)
    times = [e.duration_ns / 1e3 for e in events if "probe_scattered_access" in e.name]
    return statistics.median(times) if times else float("nan")


def main(_):
    global TABLE
    programs_list, lanes, num_warps = [1, 132, 264], 4096, 16
    if FLAGS.smoke:
        TABLE, programs_list, lanes, num_warps = 256, [1, 2], 64, 4
    rng = np.random.default_rng(0)
    results = {"device": str(jax.devices()[0].device_kind), "lanes": lanes, "table_words": TABLE, "num_warps": num_warps, "rows": []}
    for programs in programs_list:
        table = jnp.asarray(rng.integers(0, TABLE, (programs, TABLE)), jnp.int32)
        start = jnp.asarray(rng.integers(0, TABLE, (programs, lanes)), jnp.int32)
        for coalesced in (False, True):
            t1 = time_probe(programs, lanes, 1, coalesced, num_warps, start, table)
            t9 = time_probe(programs, lanes, 9, coalesced, num_warps, start, table)
            per_pass = (t9 - t1) / 8
            row = {
                "programs": programs, "access": "coalesced" if coalesced else "scattered", "t_1pass_us": t1, "t_9pass_us": t9,
                "us_per_pass": per_pass, "loads_per_ns_per_program": lanes / (per_pass * 1e3) if per_pass > 0 else None,
            }
            results["rows"].append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    with open(FLAGS.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
