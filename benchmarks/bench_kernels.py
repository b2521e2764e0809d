"""GPU benchmark of the HiSparse kernels: check against the references, then time.

    python benchmarks/bench_kernels.py --out=/tmp/bench.json

1. Checks, on fresh random inputs at the benchmark sizes: swap-in plan kernel == jnp reference
   (bit-exact, every field; long-path batches, and one mixing fast-path, free and long-path
   requests), copy kernels == reference (bf16 rows and packed fp8 rows, the default grid and a
   7-program one that loops over many work items), attention kernel vs f32 reference (bf16 and
   fp8 rows; --nocheck_attention skips it); and that the compiled swap-in holds no copy of the
   pinned host pool.
2. Swap-in per layer: batch {1, 16, 64, 256} (or --cases), top_k 2048, B 4096, bf16 576-wide rows
   (1152 B), context 32768, misses {0, 5%, 20%, 100%} of top_k and the fast path. Pool = batch x
   32768 rows in pinned host memory. Before each launch: L2 flushed (a 256 MB read-modify-write),
   state restored, a different top-k. Each row also times XLA's jnp plan with the same copy (the
   in-JAX baseline), and with --tune the plan's and the copy's other launch shapes.
3. Sparse MLA attention: batch {16, 64, 128}, heads {64, 128}, top_k 2048, bf16 rows; fp8 rows
   (FlashMLA's 656 B layout, dequantised in the kernel) at --fp8_sizes (batch 128 x 128 heads),
   with the same FLOP count and the kernel checked against the reference on the timed inputs;
   XLA's jnp reference timed the same way as the in-run baseline.
4. DSA indexer (section "indexer", benchmarks/indexer_device_bench.py): scoring and top-k
   kernels at --indexer_sizes, checked against their jnp references on the GPU (top-k exactly),
   timed by device span per call from the profiler with XLA's path as the same-run baseline.

Timing: N (--iters) launches unrolled in one jit, separated by optimisation barriers, called
--reps times under JAX's profiler (benchmarks/device_timing.py). Swap-in: per launch, the device
time from the plan kernel's start to the copy kernel's end (`swap_in_us`, the median over
iters x reps launches, with p10 / p90 / min / max), and each kernel's own time (`plan_us`,
`copy_us`); the XLA reference: device busy time per launch (its kernels' summed durations minus
those of the same jit without the swap-in). Also kept: the old host wall-clock difference of
the two jits (`wall_us`), which carries the host's noise. Attention: the wall-clock difference.
Without a device trace (CPU) swap_in_us is the wall-clock figure; `timing` says which it is.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks import device_timing, indexer_device_bench  # noqa: E402
from benchmarks.helpers import log, write_json  # noqa: E402
from benchmarks.swap_in_workload import make_workload  # noqa: E402
from hisparse_jax import memory  # noqa: E402
from hisparse_jax.row_layout import KVRowLayout  # noqa: E402
from pallas_kernels import common, row_copy, sparse_mla_attention, swap_in  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_kernels.json", "Where to write the results JSON.")
flags.DEFINE_integer("reps", 7, "Timed repetitions per configuration (median reported).")
flags.DEFINE_integer("iters", 8, "Launches unrolled per timed jit.")
flags.DEFINE_list("batches", ["1", "16", "64", "256"], "Swap-in batch sizes.")
flags.DEFINE_bool("tune", True, "Also time alternative launch shapes.")
flags.DEFINE_list("sections", ["check", "swap_in", "attention", "indexer"], "What to run.")
flags.DEFINE_list("indexer_sizes", ["47x32768", "13x32768", "190x32768", "47x65536", "47x131072"], "Indexer batch x context (variants at the first).")
flags.DEFINE_float("indexer_budget_s", 0, "Indexer: start no new size after this many seconds of the section (0: never).")
flags.DEFINE_bool("smoke", False, "Tiny sizes, to try the script itself on a CPU (interpret mode).")
flags.DEFINE_list("fp8_sizes", ["128x128"], "batch x heads at which attention over fp8 rows is timed too.")
flags.DEFINE_list("attention_batches", ["16", "64", "128"], "Attention batch sizes (bf16 rows).")
flags.DEFINE_string("bf16_tunings", "", "JSON list of extra Pallas tunings timed (and checked) over bf16 rows.")
flags.DEFINE_string("fp8_tunings", "", 'JSON list of extra Pallas tunings timed (and checked) over fp8 rows, e.g. [{"fp8_form": "planes"}].')
flags.DEFINE_list("cases", [], "Swap-in cases as batch:case (case: fast or a miss count per request); default: every batch of --batches with every case.")
flags.DEFINE_bool("check_attention", True, "Section check: check the attention kernel too.")
flags.DEFINE_bool("device_timing", True, "Swap-in: device time from JAX's profiler (else host wall-clock differences only).")
flags.DEFINE_float("time_budget_s", 0, "Skip the optional swap-in timings once the run is this old (0: never).")

TOP_K, BUFFER, CONTEXT, LATENT, ROPE = 2048, 4096, 32768, 512, 64
WIDTH = LATENT + ROPE
ROW_BYTES = WIDTH * 2
GATHER_FLOOR_GBPS = (42.0, 51.0)  # docs/background.md: UVA gather of random 1152 B rows, 2k .. 131k rows
FLUSH_WORDS = 64 * 1024 * 1024  # 256 MB of int32: over 4x the H200's 60 MB L2

RESULTS: dict = {"device": None, "checks": {}, "swap_in": [], "attention": [], "indexer": [], "errors": []}
START = [time.perf_counter()]  # the run's start, for --time_budget_s


def save():
    write_json(FLAGS.out, RESULTS)


def pinned(x):
    return jax.device_put(x, memory.sharding(memory.PINNED_HOST))


def device(x):
    return jax.device_put(x, memory.sharding(memory.DEVICE))


def random_pool(key, rows):
    """bf16[1, rows, W] of random values, created on device and moved to pinned host."""
    make = jax.jit(
        lambda k: jax.random.normal(k, (1, rows, WIDTH), jnp.bfloat16), out_shardings=memory.sharding(memory.PINNED_HOST)
    )
    return make(key)


def median_difference(run_full, run_base, reps):
    for _ in range(2):  # both compiled and warm before the clock starts (twice: donated outputs
        run_full()  # come back as the next call's inputs, whose placement the first call fixes)
        run_base()
    diffs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run_full()
        t1 = time.perf_counter()
        run_base()
        t2 = time.perf_counter()
        diffs.append((t1 - t0) - (t2 - t1))
    return statistics.median(diffs), diffs


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------


def mix_in_short_requests(rng, w, topk, B):
    """Turns every third request into a free slot (n = 0, no selection) and every third into a
    fast-path one (n <= B: slot j holds token j; a selection with repeats, padding, the newest)."""
    for r in range(1, len(w.lengths), 3):
        w.lengths[r], topk[r] = 0, -1
    for r in range(2, len(w.lengths), 3):
        n = int(rng.integers(1, B + 1))
        w.lengths[r] = n
        w.buffer_tokens[0, r] = np.where(np.arange(B) < n, np.arange(B), -1)
        topk[r] = rng.integers(-1, n, topk.shape[1])


def check_swap_in(rng, R, B, K, context, misses, mixed=False):
    w = make_workload(rng, requests=R, buffer_size=B, top_k=K, context=context, misses=misses, num_sets=1)
    topk = w.topk_sets[0].copy()
    # Add duplicates, padding and the newest token to the exact-miss selection.
    topk[:, 1] = topk[:, 0]
    topk[:, 2] = -1
    topk[:, 3] = context - 1
    if mixed:
        mix_in_short_requests(rng, w, topk, B)
    scratch = jnp.full((R, context), swap_in.SCRATCH_EMPTY, jnp.int32)
    args = (jnp.asarray(topk), jnp.asarray(w.lengths), jnp.asarray(w.page_table))

    @functools.partial(jax.jit, static_argnames="implementation")
    def plan(bt, lru, scratch, topk, lengths, page_table, implementation):
        return swap_in.swap_in_plan(bt, lru, scratch, 0, topk, lengths, page_table, page_size=w.page_size, implementation=implementation)

    ref = plan(jnp.asarray(w.buffer_tokens), jnp.asarray(w.lru_slots), scratch, *args, implementation="reference")
    got = plan(jnp.asarray(w.buffer_tokens), jnp.asarray(w.lru_slots), scratch, *args, implementation="pallas")
    ok = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ref[:3]), jax.tree.leaves(got[:3])))
    ok &= bool(np.all(np.asarray(got[3]) == swap_in.SCRATCH_EMPTY))
    return ok, int(np.asarray(got[0].num_misses).sum())


def check_copy(rng):
    R, K, S = (8, 256, 50_000) if not FLAGS.smoke else (2, 8, 300)
    pool = pinned(jnp.asarray(rng.standard_normal((1, S, WIDTH)), jnp.bfloat16))
    buf0 = jnp.asarray(rng.standard_normal((1, R, BUFFER + 1, WIDTH)), jnp.bfloat16)
    num = jnp.asarray(rng.integers(0, K + 1, R), jnp.int32)
    host = jnp.asarray(np.stack([rng.choice(S, K, replace=False) for _ in range(R)]), jnp.int32)
    dev = jnp.asarray(np.stack([rng.choice(BUFFER + 1, K, replace=False) for _ in range(R)]), jnp.int32)
    ref = jax.jit(functools.partial(row_copy.copy_host_rows_to_buffer, implementation="reference"), static_argnums=2)(
        pool, buf0, 0, host, dev, num
    )
    got = jax.jit(functools.partial(row_copy.copy_host_rows_to_buffer, implementation="pallas"), static_argnums=2)(
        pool, jnp.copy(buf0), 0, host, dev, num
    )
    # 7 programs: each loops over many (request, 16 misses) work items.
    looped = jax.jit(functools.partial(row_copy.copy_host_rows_to_buffer_pallas, programs=7), static_argnums=2)(
        pool, jnp.copy(buf0), 0, host, dev, num
    )
    rows = jnp.asarray(rng.standard_normal((R, WIDTH)), jnp.bfloat16)
    slots = jnp.asarray(rng.choice(S, R, replace=False), jnp.int32).at[3].set(-1)
    write = lambda impl: jax.jit(  # noqa: E731
        functools.partial(row_copy.write_rows_to_host, implementation=impl),
        static_argnums=1, donate_argnums=0, out_shardings=memory.sharding(memory.PINNED_HOST),
    )
    w_ref = np.asarray(write("reference")(pinned(jnp.asarray(np.asarray(pool))), 0, rows, slots))
    w_got = np.asarray(write("pallas")(pinned(jnp.asarray(np.asarray(pool))), 0, rows, slots))
    return bool(np.array_equal(ref, got)) and bool(np.array_equal(ref, looped)) and bool(np.array_equal(w_ref, w_got))


def layout_of(rows: str) -> KVRowLayout:
    return KVRowLayout(LATENT, ROPE, rows)


def random_kv(key, R, rows: str):
    """row[1, R, B + 1, W] of random values in the `rows` layout ("bfloat16" or "fp8_e4m3"),
    made on the device (fp8: quantised from f32 values)."""
    layout = layout_of(rows)

    @jax.jit
    def make(k):
        values = jax.random.normal(k, (1, R, BUFFER + 1, WIDTH), jnp.float32)
        return layout.pack(values[..., :LATENT], values[..., LATENT:])

    return make(key)


def attention_error(q, kv, slots, layout, scale, tuning=None):
    """Relative L2 error of the Pallas kernel (launched with `tuning`) against the f32 reference,
    and whether the output is finite (slots row 1 is all -1: zeros expected there)."""
    attend = lambda impl, **kw: jax.jit(  # noqa: E731
        functools.partial(sparse_mla_attention.sparse_mla_attention, latent_dim=LATENT, sm_scale=scale, layout=layout, implementation=impl, **kw),
        static_argnums=2,
    )(q, kv, 0, slots)
    got, ref = np.asarray(attend("pallas", **(tuning or {}))), np.asarray(attend("reference"))
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    return rel, bool(np.all(np.isfinite(got))) and not np.any(got[1])


def check_attention(rng, R, H, rows="bfloat16"):
    kv = random_kv(jax.random.key(int(rng.integers(1 << 30))), R, rows)
    q = jnp.asarray(rng.standard_normal((R, H, WIDTH)), jnp.bfloat16)
    slots = np.stack([rng.choice(BUFFER + 1, TOP_K, replace=False) for _ in range(R)]).astype(np.int32)
    slots[0, 100:] = -1
    slots[1, :] = -1
    rel, sane = attention_error(q, kv, jnp.asarray(slots), layout_of(rows), 1.0 / np.sqrt(192.0))
    return sane and rel < 1e-2, rel


def check_fp8_copy(rng):
    """Packed fp8 rows (uint32 words, W = 164 for 512 + 64) copied by both kernels, bit-exact."""
    layout = layout_of("fp8_e4m3")
    R, K, S = (8, 256, 50_000) if not FLAGS.smoke else (2, 8, 300)
    pack = jax.jit(lambda v: layout.pack(v[..., :LATENT], v[..., LATENT:]))
    pool = pinned(pack(jnp.asarray(rng.standard_normal((1, S, WIDTH)), jnp.float32)))
    buf0 = jnp.full((1, R, BUFFER + 1, layout.width), 0xFFFFFFFF, jnp.uint32)
    num = jnp.asarray(rng.integers(1, K + 1, R), jnp.int32)
    host = jnp.asarray(np.stack([rng.choice(S, K, replace=False) for _ in range(R)]), jnp.int32)
    dev = jnp.asarray(np.stack([rng.choice(BUFFER + 1, K, replace=False) for _ in range(R)]), jnp.int32)
    copy = lambda impl, buf: jax.jit(  # noqa: E731
        functools.partial(row_copy.copy_host_rows_to_buffer, implementation=impl), static_argnums=2
    )(pool, buf, 0, host, dev, num)
    ok = bool(np.array_equal(np.asarray(copy("reference", buf0)), np.asarray(copy("pallas", jnp.copy(buf0)))))
    rows = pack(jnp.asarray(rng.standard_normal((R, WIDTH)), jnp.float32))
    slots = jnp.asarray(rng.choice(S, R, replace=False), jnp.int32)
    write = jax.jit(
        functools.partial(row_copy.write_rows_to_host, implementation="pallas"),
        static_argnums=1, donate_argnums=0, out_shardings=memory.sharding(memory.PINNED_HOST),
    )
    written = np.asarray(write(pinned(jnp.asarray(np.asarray(pool))), 0, rows, slots))
    return ok and bool(np.array_equal(written[0, np.asarray(slots)], np.asarray(rows)))


def check_no_pool_copy(rng):
    """The compiled swap-in (plan + copy) must read the pinned pool in place."""
    R = 16 if not FLAGS.smoke else 2
    w = make_workload(rng, requests=R, buffer_size=BUFFER, top_k=TOP_K, context=CONTEXT, misses=TOP_K // 4, num_sets=1)
    pool = jax.ShapeDtypeStruct((1, w.pool_rows, WIDTH), jnp.bfloat16, sharding=memory.sharding(memory.PINNED_HOST))

    def step(buf, bt, lru, scratch, topk, lengths, page_table, pool):
        plan, bt, lru, scratch = swap_in.swap_in_plan_pallas(bt, lru, scratch, jnp.int32(0), topk, lengths, page_table, page_size=w.page_size)
        buf = row_copy.copy_host_rows_to_buffer_pallas(pool, buf, jnp.int32(0), plan.miss_host_slots, plan.miss_device_slots, plan.num_misses)
        return buf, bt, lru, scratch, plan.slots

    spec = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    text = jax.jit(step, donate_argnums=(0, 1, 2, 3)).lower(
        spec((1, R, BUFFER + 1, WIDTH), jnp.bfloat16), spec((1, R, BUFFER)), spec((1, R, BUFFER)), spec((R, CONTEXT)),
        spec((R, TOP_K)), spec((R,)), spec(w.page_table.shape), pool,
    ).compile().as_text()
    pool_shape = f"bf16[1,{w.pool_rows},{WIDTH}]"
    offending = memory.hlo_copy_lines(text, pool_shape)
    mentions = sum(pool_shape in line for line in text.splitlines())
    return not offending, {"pool_shape": pool_shape, "offending": offending[:3], "lines_mentioning_pool": mentions}


def run_checks():
    rng = np.random.default_rng(int(time.time()))
    checks = RESULTS["checks"]

    def attempt(name, fn):
        try:
            checks[name] = fn()
        except Exception as e:
            checks[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            RESULTS["errors"].append(traceback.format_exc()[-2500:])
        log(f"check {name}: {checks[name]}")
        save()

    # (R, B, K, context, misses per long request, mixed: every third request free, every third fast-path)
    shapes = [(5, 6144, TOP_K, CONTEXT, 2048, False), (6, 24, 16, 400, 5, True), (64, BUFFER, TOP_K, CONTEXT, 300, True)]
    if FLAGS.smoke:
        shapes = [(3, BUFFER, TOP_K, CONTEXT, 5, False), (6, 24, 16, 400, 5, True)]
    for R, B, K, context, m, mixed in shapes:
        def plan_check(R=R, B=B, K=K, context=context, m=m, mixed=mixed):
            ok, copied = check_swap_in(rng, R, B, K, context, m, mixed)
            return {"ok": ok, "rows_copied": copied}
        attempt(f"swap_in_plan R{R} B{B} K{K} misses{m}{' mixed' if mixed else ''}", plan_check)
    attempt("row_copies", lambda: {"ok": check_copy(rng)})
    attempt("row_copies fp8_e4m3", lambda: {"ok": check_fp8_copy(rng)})
    for rows in ("bfloat16", "fp8_e4m3") if FLAGS.check_attention else ():
        for R, H in [(4, 128), (3, 64)]:
            def attention_check(R=R, H=H, rows=rows):
                ok, rel = check_attention(rng, R, H, rows)
                return {"ok": ok, "relative_error": rel}
            attempt(f"attention {rows} R{R} H{H}", attention_check)

    def hlo_check():
        ok, info = check_no_pool_copy(rng)
        return {"ok": ok, **info}
    attempt("no_pool_copy_in_hlo", hlo_check)


# ----------------------------------------------------------------------------------------------
# swap-in timing
# ----------------------------------------------------------------------------------------------

PLAN_KERNEL, COPY_KERNEL = "hisparse_swap_in_plan", "hisparse_copy_host_rows"  # the GPU kernels' names
MISS_COUNTS = [0, 102, 410, 2048]  # per request: 0, 5%, 20%, 100% of top_k (--smoke: 0, 2, 16)


def over_budget() -> bool:
    """Whether the optional timings (sweeps, fragmented pool) are to be skipped (--time_budget_s)."""
    return FLAGS.time_budget_s > 0 and time.perf_counter() - START[0] > FLAGS.time_budget_s


@functools.lru_cache(maxsize=None)
def swap_in_loop(kind, iters, page_size, plan_kw=(), copy_kw=()):
    """One jit running `iters` launches of `kind`: "base" (no swap-in), "pallas" (what
    attention_layer runs) or "reference" (XLA's jnp plan + the Pallas copy). Cached: the cases of
    a batch share their shapes, so one compile serves them all. plan_kw, copy_kw: launch-shape
    overrides as tuples of (name, value)."""

    def loop(buf, scratch, flush, bt0, lru0, topk_sets, lengths, page_table, pool, zero):
        checksum = jnp.int32(0)
        for i in range(iters):
            flush = flush + 1  # evicts L2
            bt, lru = bt0 ^ zero, lru0 ^ zero  # restore the state (an opaque op XLA cannot elide)
            topk = topk_sets[i % topk_sets.shape[0]] ^ zero
            flush, bt, lru, topk, buf, scratch = jax.lax.optimization_barrier((flush, bt, lru, topk, buf, scratch))
            slots, misses = topk, lengths
            if kind != "base":
                if kind == "reference":
                    plan, bt, lru, scratch = swap_in.swap_in_plan(bt, lru, scratch, 0, topk, lengths, page_table, page_size=page_size, implementation="reference")
                else:
                    plan, bt, lru, scratch = swap_in.swap_in_plan_pallas(bt, lru, scratch, jnp.int32(0), topk, lengths, page_table, page_size=page_size, **dict(plan_kw))
                buf = row_copy.copy_host_rows_to_buffer_pallas(
                    pool, buf, jnp.int32(0), plan.miss_host_slots, plan.miss_device_slots, plan.num_misses, **dict(copy_kw)
                )
                slots, misses = plan.slots, plan.num_misses
            # Consumers of the plan come after this barrier, so nothing sits between the kernels.
            flush, buf, scratch, bt, lru, slots, misses = jax.lax.optimization_barrier((flush, buf, scratch, bt, lru, slots, misses))
            checksum += bt[0, 0, 0] + lru[0, 0, 0] + slots[0, 0] + misses[0]
        return buf, scratch, flush, checksum

    return jax.jit(loop, donate_argnums=(0, 1, 2))


class Carry:
    """Device buffers threaded through the timed calls (donated each call, never re-allocated),
    and the device busy time of one call of the batch's base loop (measured once)."""

    def __init__(self, R, context):
        # Committed to the device like the jit's outputs that replace them: an uncommitted first
        # input would make the second call compile again, inside the timed repetitions.
        self.buf = device(jnp.zeros((1, R, BUFFER + 1, WIDTH), jnp.bfloat16))
        self.scratch = device(jnp.full((R, context), swap_in.SCRATCH_EMPTY, jnp.int32))
        self.flush = device(jnp.zeros((FLUSH_WORDS,), jnp.int32))
        self.base_busy_us = None

    def run(self, fn, *args):
        self.buf, self.scratch, self.flush, checksum = fn(self.buf, self.scratch, self.flush, *args)
        checksum.block_until_ready()


def record_profile_info(info):
    """Keeps the first trace's plane / line / kernel names in the JSON (to read the trace by)."""
    if "profile" not in RESULTS:
        RESULTS["profile"] = info


def device_figures(entry, run_full, run_base, carry, kind):
    """Adds device-time figures to `entry`: per launch (pallas) the span from the plan kernel's
    start to the copy kernel's end and each kernel's own time; per call the device busy time
    minus the base loop's, per launch (every kind). `swap_in_us` becomes the span's median, or
    for the reference (XLA kernels without one name) the busy time's."""
    iters, reps = FLAGS.iters, FLAGS.reps
    if carry.base_busy_us is None:
        events, info = device_timing.record(run_base, reps)
        record_profile_info(info)
        busy = device_timing.busy_per_call(events, reps)
        carry.base_busy_us = statistics.median(busy) if busy else float("nan")
    events, info = device_timing.record(run_full, reps)
    record_profile_info(info)
    busy = [(b - carry.base_busy_us) / iters for b in device_timing.busy_per_call(events, reps)]
    entry.update(device_timing.summary(busy, "busy"))
    launches = device_timing.launches(events, PLAN_KERNEL, COPY_KERNEL)
    entry.update(device_timing.summary([e.duration_ns / 1e3 for e in events if COPY_KERNEL in e.name], "copy"))
    if kind == "pallas" and len(launches) == iters * reps:
        entry.update(device_timing.summary([x.span_us for x in launches], "swap_in"))
        entry.update(device_timing.summary([x.first_us for x in launches], "plan"))
        entry.update(device_timing.summary([x.last_us for x in launches], "copy"))
        entry.update(device_timing.summary([x.first_us + x.last_us for x in launches], "kernels"))
        entry["timing"] = "device: plan kernel start to copy kernel end, per launch"
    elif busy and np.isfinite(busy[0]):
        entry["swap_in_us"] = entry["busy_us"]
        entry["timing"] = "device: busy time per launch (summed kernels, minus the base loop)"
    if "swap_in_p10_us" in entry:
        entry["swap_in_spread_us"] = entry["swap_in_p90_us"] - entry["swap_in_p10_us"]
    elif "busy_p10_us" in entry and entry.get("timing", "").startswith("device"):
        entry["swap_in_spread_us"] = entry["busy_p90_us"] - entry["busy_p10_us"]


def time_swap_in_case(entry, w, carry, pool, kind="pallas", plan_kw=(), copy_kw=()):
    """Times one (batch, case, variant): wall-clock difference always, device time if enabled."""
    iters = FLAGS.iters
    args = tuple(jnp.asarray(a) for a in (w.buffer_tokens, w.lru_slots, w.topk_sets, w.lengths, w.page_table))
    args += (pool, jnp.int32(0))
    base = swap_in_loop("base", iters, w.page_size)
    fn = swap_in_loop(kind, iters, w.page_size, plan_kw, copy_kw)
    run_full, run_base = lambda: carry.run(fn, *args), lambda: carry.run(base, *args)
    R, misses = entry["batch"], entry["misses_per_request"]
    try:
        med, diffs = median_difference(run_full, run_base, FLAGS.reps)
        entry.update(wall_us=med / iters * 1e6, wall_spread_us=(max(diffs) - min(diffs)) / iters * 1e6)
        entry.update(swap_in_us=entry["wall_us"], swap_in_spread_us=entry["wall_spread_us"], timing="wall-clock difference")
        if FLAGS.device_timing:
            device_figures(entry, run_full, run_base, carry, kind)
        if misses:
            entry["miss_GBps"] = R * misses * ROW_BYTES / (entry["swap_in_us"] * 1e-6) / 1e9
            if entry.get("copy_us"):
                entry["copy_GBps"] = R * misses * ROW_BYTES / (entry["copy_us"] * 1e-6) / 1e9
            entry["floor_us"] = R * misses * ROW_BYTES / (GATHER_FLOOR_GBPS[1] * 1e9) * 1e6
    except Exception as e:  # keep timing the other cases
        entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        RESULTS["errors"].append(traceback.format_exc()[-2000:])
    RESULTS["swap_in"].append(entry)
    keys = ("batch", "case", "variant", "swap_in_us", "swap_in_p10_us", "swap_in_p90_us", "plan_us", "copy_us", "kernels_us", "busy_us", "wall_us", "miss_GBps", "error")
    log("  " + json.dumps({k: (round(entry[k], 2) if isinstance(entry[k], float) else entry[k]) for k in keys if k in entry}))
    save()


def parse_cases(batches, cases):
    """{batch: [case, ...]}: --cases entries "batch:case" (case "fast" or a miss count), else
    every batch of --batches with the fast path and every miss count."""
    if not cases:
        return {int(b): ["fast", *map(str, MISS_COUNTS)] for b in batches}
    out: dict[int, list[str]] = {}
    for item in cases:
        batch, case = item.split(":")
        out.setdefault(int(batch), []).append(case)
    return out


def workload(rng, R, case, page_layout="contiguous"):
    """(label, misses per request, workload) of one case; the fast path (n = K <= B) keeps the
    long path's page-table shape so that every case of a batch runs the same compiled loop."""
    fast = case == "fast"
    misses = 0 if fast else min(int(case), TOP_K)
    w = make_workload(
        rng, requests=R, buffer_size=BUFFER, top_k=TOP_K, context=CONTEXT, misses=misses, fast_path=fast, page_layout=page_layout
    )
    return ("fast path" if fast else f"{misses} misses"), misses, w


def bench_swap_in_batch(rng, R, key, cases, sweep_copy=False):
    pool_rows = R * CONTEXT
    log(f"[swap-in] batch {R}: pool {pool_rows} rows = {pool_rows * ROW_BYTES / 1e9:.2f} GB pinned ...")
    t0 = time.perf_counter()
    pool = random_pool(key, pool_rows)
    pool.block_until_ready()
    log(f"  pool ready in {time.perf_counter() - t0:.1f} s")
    carry = Carry(R, CONTEXT)
    most_misses = max((c for c in cases if c != "fast"), key=int, default=None)
    for case in cases:
        label, misses, w = workload(rng, R, case)
        entry = lambda variant: {"batch": R, "case": label, "misses_per_request": misses, "variant": variant}  # noqa: E731
        time_swap_in_case(entry("pallas"), w, carry, pool)
        # The in-JAX baseline on every row: XLA's own (sort-based) plan with the same copy.
        time_swap_in_case(entry("xla reference plan + pallas copy"), w, carry, pool, kind="reference")
        if FLAGS.tune and not over_budget() and case == "0":
            for warps in (4, 8):  # the plan's launch shape (default 16 warps)
                time_swap_in_case(entry(f"pallas, plan {warps} warps"), w, carry, pool, plan_kw=(("num_warps", warps),))
        if case == most_misses and misses and not over_budget():
            _, _, fragmented = workload(rng, R, case, page_layout="random")
            time_swap_in_case(entry("pallas, fragmented pool"), fragmented, carry, pool)
            if FLAGS.tune and sweep_copy:  # the copy's launch shapes, at the largest batch only
                for name, copy_kw in copy_shapes():
                    if not over_budget():
                        time_swap_in_case(entry(f"pallas, copy {name}"), w, carry, pool, copy_kw=copy_kw)
    # The link ceiling in the same run: one contiguous host -> device copy of 2048 rows per request.
    contiguous = jax.jit(lambda p: jax.device_put(p[:, : R * TOP_K], memory.sharding(memory.DEVICE)))
    try:
        contiguous(pool).block_until_ready()
        times = []
        for _ in range(FLAGS.reps):
            t0 = time.perf_counter()
            contiguous(pool).block_until_ready()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        RESULTS["swap_in"].append({"batch": R, "variant": "contiguous device_put of the same bytes", "us": t * 1e6, "GBps": R * TOP_K * ROW_BYTES / t / 1e9})
        log(f"  contiguous copy of {R * TOP_K} rows: {t * 1e6:.1f} us, {R * TOP_K * ROW_BYTES / t / 1e9:.1f} GB/s")
    except Exception as e:
        RESULTS["errors"].append(f"contiguous copy: {e}"[:500])
    del pool, carry
    save()


def copy_shapes():
    """Copy launch shapes timed beside the default (16 rows per item, 4 warps, 4 programs per SM)."""
    sms = common.num_sms()
    return [
        ("32 rows, 8 warps", (("rows", 32), ("num_warps", 8))),
        ("16 rows, 8 programs per SM", (("programs", 8 * sms),)),
        ("evict_first", (("eviction_policy", "evict_first"),)),
    ]


# ----------------------------------------------------------------------------------------------
# attention timing
# ----------------------------------------------------------------------------------------------


def attention_loop(kind, iters, scale, tuning, layout=None):
    def loop(flush, q, kv, slots_sets, zero):
        checksum = jnp.float32(0)
        for i in range(iters):
            flush = flush + 1
            slots = slots_sets[i % slots_sets.shape[0]] ^ zero
            flush, slots, q = jax.lax.optimization_barrier((flush, slots, q))
            if kind != "base":
                out = sparse_mla_attention.sparse_mla_attention(
                    q, kv, 0, slots, latent_dim=LATENT, sm_scale=scale, layout=layout, implementation=kind, **tuning
                )
                checksum += out[0, 0, 0]
            flush, checksum = jax.lax.optimization_barrier((flush, checksum))
        return flush, checksum

    return jax.jit(loop, donate_argnums=(0,))


def run_attention():
    rng = np.random.default_rng(1)
    scale = 1.0 / np.sqrt(192.0)
    flush = jnp.zeros((FLUSH_WORDS,), jnp.int32)
    zero = jnp.int32(0)
    # The default splits the keys of small grids (flash-decoding); num_splits=1 is the unsplit kernel.
    tunings = [{}, dict(num_splits=1)]
    if FLAGS.tune:
        tunings += [dict(block_h=64, block_k=64, num_warps=8, num_stages=2)]
    fp8_sizes = {tuple(map(int, size.split("x"))) for size in FLAGS.fp8_sizes}
    bf16_batches = set(map(int, FLAGS.attention_batches))
    for R in sorted(bf16_batches | {R for R, _ in fp8_sizes}):
        slots_sets = jnp.asarray(np.stack([[rng.choice(BUFFER + 1, TOP_K, replace=False) for _ in range(R)] for _ in range(3)]), jnp.int32)
        for rows in ("bfloat16", "fp8_e4m3"):
            # bf16 rows at every size, fp8 rows at fp8_sizes (with the bf16 row beside each).
            heads = [H for H in ((64, 128) if not FLAGS.smoke else (4,)) if (R, H) in fp8_sizes or (rows == "bfloat16" and R in bf16_batches)]
            if heads:
                flush = attention_cases(rng, R, heads, rows, slots_sets, tunings, scale, zero, flush)


def attention_cases(rng, R, heads, rows, slots_sets, tunings, scale, zero, flush):
    """Times the attention over `rows` rows ("bfloat16" / "fp8_e4m3") at batch R for each of
    `heads` (Pallas per tuning, then the jnp reference), after checking the kernel against the
    reference on the same inputs. Returns the (donated, re-made) flush buffer."""
    layout = layout_of(rows)
    if layout.quantized and FLAGS.tune:  # 64 x 64 blocks with 2 stages exceed shared memory for fp8 rows
        tunings = [{}, dict(num_splits=1), dict(block_h=64, block_k=64, num_warps=8, num_stages=1)]
    extra = FLAGS.fp8_tunings if layout.quantized else FLAGS.bf16_tunings
    if extra:
        tunings = tunings + json.loads(extra)
    kv = random_kv(jax.random.key(R), R, rows)
    for H in heads:
        q = jnp.asarray(rng.standard_normal((R, H, WIDTH)), jnp.bfloat16)
        flops = 2 * R * H * TOP_K * (WIDTH + LATENT)  # the same for every row layout
        bytes_moved = R * TOP_K * layout.bytes_per_row + R * H * (WIDTH * 2 + LATENT * 4)
        # One request selects nothing (its output must be zeros), when there is more than one.
        masked = slots_sets[0].at[1].set(-1) if R > 1 else slots_sets[0]
        base = attention_loop("base", FLAGS.iters, scale, {})
        flush, _ = base(flush, q, kv, slots_sets, zero)
        for kind, tuning in [("pallas", t) for t in tunings] + [("reference", {})]:
            entry = {"batch": R, "heads": H, "rows": rows, "row_bytes": layout.bytes_per_row, "implementation": kind, "tuning": tuning}
            if kind == "pallas":  # each tuning checked against the reference on the same inputs
                try:
                    first = time.perf_counter()
                    rel, sane = attention_error(q, kv, masked, layout, scale, tuning)
                    # check_s: compiling this tuning's kernel (and the same reference every time) and one run of each
                    entry.update(check_ok=sane and rel < 1e-2, relative_error_vs_reference=rel, check_s=time.perf_counter() - first)
                except Exception as e:
                    entry.update(check_ok=False, check_error=f"{type(e).__name__}: {str(e)[:300]}")
                    RESULTS["errors"].append(traceback.format_exc()[-2000:])
            try:
                fn = attention_loop(kind, FLAGS.iters, scale, tuning, layout)
                first = time.perf_counter()
                flush, c = fn(flush, q, kv, slots_sets, zero)
                c.block_until_ready()
                entry["first_call_s"] = time.perf_counter() - first  # the timed loop's compile and one run
                box = {"flush": flush}

                def run(f):
                    box["flush"], c = f(box["flush"], q, kv, slots_sets, zero)
                    c.block_until_ready()

                med, diffs = median_difference(lambda: run(fn), lambda: run(base), FLAGS.reps)
                flush = box["flush"]
                t = med / FLAGS.iters
                entry.update(wall_us=t * 1e6, wall_spread_us=(max(diffs) - min(diffs)) / FLAGS.iters * 1e6)
                # Device time (the figure reported): per call, the kernels' busy time minus the
                # base loop's (flush, barriers), per launch; the attention kernel's own launches.
                if FLAGS.device_timing:
                    base_events, _ = device_timing.record(lambda: run(base), FLAGS.reps)
                    events, _ = device_timing.record(lambda: run(fn), FLAGS.reps)
                    base_busy = device_timing.busy_per_call(base_events, FLAGS.reps)
                    busy = device_timing.busy_per_call(events, FLAGS.reps)
                    if busy and base_busy:
                        per_launch = [(b - statistics.median(base_busy)) / FLAGS.iters for b in busy]
                        entry.update(device_timing.summary(per_launch, "busy"))
                        t = statistics.median(per_launch) / 1e6
                    kernel = [e.duration_ns / 1e3 for e in events if "sparse_mla_attention" in e.name]
                    entry.update(device_timing.summary(kernel, "kernel"))
                flush = box["flush"]
                entry.update(us=t * 1e6, TFLOPs=flops / t / 1e12, GBps=bytes_moved / t / 1e9,
                             timing="device busy per launch" if "busy_us" in entry else "host wall-clock difference")
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                RESULTS["errors"].append(traceback.format_exc()[-2000:])
                flush = jnp.zeros((FLUSH_WORDS,), jnp.int32)  # the failed call may have consumed (donated) it
            RESULTS["attention"].append(entry)
            log("  " + json.dumps({k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in entry.items()}))
            save()
    return flush


def run_indexer():
    """Section "indexer": benchmarks/indexer_device_bench.py (checks + device timing per size)."""
    if FLAGS.smoke:  # tiny sizes; the interpreter runs the kernels
        indexer_device_bench.HEADS, indexer_device_bench.HEAD_DIM, indexer_device_bench.TOP_K = 8, 32, 64
        indexer_device_bench.ALWAYS_SCORE = [{"block_c": 64, "blocks_per_program": 2}]
        indexer_device_bench.VARIANTS_AT = {(3, 512): ([], [{"slice_len": 128, "sub": 32, "chunk": 64, "onehot": "int8"}])}
        FLAGS.indexer_sizes = ["3x512", "2x1024"]
    sizes = [tuple(map(int, size.split("x"))) for size in FLAGS.indexer_sizes]

    def keep(entries):
        RESULTS["indexer"] = entries
        save()

    try:
        indexer_device_bench.run(sizes, log=log, save=keep, budget_s=FLAGS.indexer_budget_s, calls=3 if FLAGS.smoke else 20)
    except Exception:
        RESULTS["errors"].append(traceback.format_exc()[-3000:])
        log(traceback.format_exc())
    log("batch context | score us (XLA) | top-k us (lax.top_k) | checked")
    for e in RESULTS["indexer"]:
        cell = lambda name: f"{e[name]:.1f}" if isinstance(e.get(name), float) else "-"  # noqa: E731
        log(f"{e['batch']:5d} {e['context']:6d} | {cell('score_us')} ({cell('reference_score_us')}) | {cell('topk_us')} ({cell('reference_topk_us')}) | {e.get('checked_bit_exact', e.get('error'))}")


def main(_):
    if FLAGS.smoke:
        global TOP_K, BUFFER, CONTEXT, LATENT, ROPE, WIDTH, ROW_BYTES, FLUSH_WORDS
        TOP_K, BUFFER, CONTEXT, LATENT, ROPE, FLUSH_WORDS = 16, 24, 256, 32, 16, 1024
        WIDTH = LATENT + ROPE
        ROW_BYTES = WIDTH * 2
        FLAGS.fp8_sizes, FLAGS.attention_batches = ["2x4"], ["2"]
        MISS_COUNTS[:] = [0, 2, 16]
    START[0] = time.perf_counter()
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    RESULTS["jax"] = jax.__version__
    RESULTS["sms"] = common.num_sms()
    log(f"devices: {jax.devices()}  jax {jax.__version__}")
    if "check" in FLAGS.sections:
        try:
            run_checks()
        except Exception:
            RESULTS["errors"].append(traceback.format_exc()[-3000:])
            log(traceback.format_exc())
            save()
    if "swap_in" in FLAGS.sections:
        key = jax.random.key(0)
        batches = parse_cases(FLAGS.batches, FLAGS.cases)
        for R, cases in batches.items():
            try:
                bench_swap_in_batch(np.random.default_rng(R), R, jax.random.fold_in(key, R), cases, sweep_copy=R == max(batches))
            except Exception:
                RESULTS["errors"].append(traceback.format_exc()[-3000:])
                log(traceback.format_exc())
                save()
    if "attention" in FLAGS.sections:
        try:
            run_attention()
        except Exception:
            RESULTS["errors"].append(traceback.format_exc()[-3000:])
            log(traceback.format_exc())
    if "indexer" in FLAGS.sections:
        run_indexer()
    save()
    log(f"wrote {FLAGS.out}; {len(RESULTS['errors'])} errors")


if __name__ == "__main__":
    app.run(main)
