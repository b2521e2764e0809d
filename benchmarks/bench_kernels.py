"""GPU benchmark of the HiSparse kernels: check against the references, then time.

    python benchmarks/bench_kernels.py --out=/tmp/bench.json

1. Checks, on fresh random inputs at the benchmark sizes: swap-in plan kernel == jnp reference
   (bit-exact, every field), copy kernels == reference (bf16 rows and packed fp8 rows),
   attention kernel vs f32 reference (bf16 and fp8 rows); and that the compiled swap-in holds no
   copy of the pinned host pool.
2. Swap-in per layer: batch {1, 16, 64, 256}, top_k 2048, B 4096, bf16 576-wide rows (1152 B),
   context 32768, misses {0, 5%, 20%, 100%} of top_k and the fast path. Pool = batch x 32768 rows
   in pinned host memory, hosts pages randomly permuted. Before each launch: L2 flushed (a
   256 MB read-modify-write), state restored, a different top-k.
3. Sparse MLA attention: batch {16, 64, 128}, heads {64, 128}, top_k 2048, bf16 rows; fp8 rows
   (FlashMLA's 656 B layout, dequantised in the kernel) at --fp8_sizes (batch 128 x 128 heads),
   with the same FLOP count and the kernel checked against the reference on the timed inputs;
   XLA's jnp reference timed the same way as the in-run baseline.

Timing: N launches unrolled in one jit, separated by optimisation barriers; the same jit
without the measured op is timed too and subtracted, so dispatch, the L2 flush and the restore
cancel. Each figure is the median of --reps such differences divided by N.
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

from benchmarks.swap_in_workload import make_workload  # noqa: E402
from hisparse_jax import memory  # noqa: E402
from hisparse_jax.row_layout import KVRowLayout  # noqa: E402
from pallas_kernels import row_copy, sparse_mla_attention, swap_in  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_kernels.json", "Where to write the results JSON.")
flags.DEFINE_integer("reps", 7, "Timed repetitions per configuration (median reported).")
flags.DEFINE_integer("iters", 8, "Launches unrolled per timed jit.")
flags.DEFINE_list("batches", ["1", "16", "64", "256"], "Swap-in batch sizes.")
flags.DEFINE_bool("tune", True, "Also time alternative launch shapes.")
flags.DEFINE_list("sections", ["check", "swap_in", "attention"], "What to run.")
flags.DEFINE_bool("smoke", False, "Tiny sizes, to try the script itself on a CPU (interpret mode).")
flags.DEFINE_list("fp8_sizes", ["128x128"], "batch x heads at which attention over fp8 rows is timed too.")
flags.DEFINE_list("attention_batches", ["16", "64", "128"], "Attention batch sizes (bf16 rows).")

TOP_K, BUFFER, CONTEXT, LATENT, ROPE = 2048, 4096, 32768, 512, 64
WIDTH = LATENT + ROPE
ROW_BYTES = WIDTH * 2
GATHER_FLOOR_GBPS = (42.0, 51.0)  # docs/background.md: UVA gather of random 1152 B rows, 2k .. 131k rows
FLUSH_WORDS = 64 * 1024 * 1024  # 256 MB of int32: over 4x the H200's 60 MB L2

RESULTS: dict = {"device": None, "checks": {}, "swap_in": [], "attention": [], "errors": []}


def log(*args):
    print(*args, flush=True)


def save():
    with open(FLAGS.out, "w") as f:
        json.dump(RESULTS, f, indent=1)


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
    run_full()  # both compiled and warm before the clock starts
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


def check_swap_in(rng, R, B, K, context, misses):
    w = make_workload(rng, requests=R, buffer_size=B, top_k=K, context=context, misses=misses, num_sets=1)
    topk = w.topk_sets[0].copy()
    # Add duplicates, padding and the newest token to the exact-miss selection.
    topk[:, 1] = topk[:, 0]
    topk[:, 2] = -1
    topk[:, 3] = context - 1
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
    rows = jnp.asarray(rng.standard_normal((R, WIDTH)), jnp.bfloat16)
    slots = jnp.asarray(rng.choice(S, R, replace=False), jnp.int32).at[3].set(-1)
    write = lambda impl: jax.jit(  # noqa: E731
        functools.partial(row_copy.write_rows_to_host, implementation=impl),
        static_argnums=1, donate_argnums=0, out_shardings=memory.sharding(memory.PINNED_HOST),
    )
    w_ref = np.asarray(write("reference")(pinned(jnp.asarray(np.asarray(pool))), 0, rows, slots))
    w_got = np.asarray(write("pallas")(pinned(jnp.asarray(np.asarray(pool))), 0, rows, slots))
    return bool(np.array_equal(ref, got)) and bool(np.array_equal(w_ref, w_got))


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


def attention_error(q, kv, slots, layout, scale):
    """Relative L2 error of the Pallas kernel against the f32 reference, and whether the output
    is finite (slots row 1 is all -1: zeros expected there)."""
    attend = lambda impl: jax.jit(  # noqa: E731
        functools.partial(sparse_mla_attention.sparse_mla_attention, latent_dim=LATENT, sm_scale=scale, layout=layout, implementation=impl),
        static_argnums=2,
    )(q, kv, 0, slots)
    got, ref = np.asarray(attend("pallas")), np.asarray(attend("reference"))
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

    shapes = [(8, BUFFER, TOP_K, CONTEXT, 300), (5, 6144, TOP_K, CONTEXT, 2048), (6, 24, 16, 400, 5), (64, BUFFER, TOP_K, CONTEXT, 100)]
    if FLAGS.smoke:
        shapes = [(3, BUFFER, TOP_K, CONTEXT, 5), (2, 24, 16, 400, 5)]
    for R, B, K, context, m in shapes:
        def plan_check(R=R, B=B, K=K, context=context, m=m):
            ok, copied = check_swap_in(rng, R, B, K, context, m)
            return {"ok": ok, "rows_copied": copied}
        attempt(f"swap_in_plan R{R} B{B} K{K} misses{m}", plan_check)
    attempt("row_copies", lambda: {"ok": check_copy(rng)})
    attempt("row_copies fp8_e4m3", lambda: {"ok": check_fp8_copy(rng)})
    for rows in ("bfloat16", "fp8_e4m3"):
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


def swap_in_loop(kind, iters, page_size, plan_kw, copy_kw):
    """One jit running `iters` launches of `kind` ('base', 'plan', 'swap_in', 'reference_plan+copy')."""

    def loop(buf, scratch, flush, bt0, lru0, topk_sets, lengths, page_table, pool, zero):
        checksum = jnp.int32(0)
        for i in range(iters):
            flush = flush + 1  # evicts L2
            bt, lru = bt0 ^ zero, lru0 ^ zero  # restore the state (an opaque op XLA cannot elide)
            topk = topk_sets[i % topk_sets.shape[0]] ^ zero
            flush, bt, lru, topk, buf, scratch = jax.lax.optimization_barrier((flush, bt, lru, topk, buf, scratch))
            if kind != "base":
                if kind == "reference_plan+copy":
                    plan, bt, lru, scratch = swap_in.swap_in_plan(bt, lru, scratch, 0, topk, lengths, page_table, page_size=page_size, implementation="reference")
                else:
                    plan, bt, lru, scratch = swap_in.swap_in_plan_pallas(bt, lru, scratch, jnp.int32(0), topk, lengths, page_table, page_size=page_size, **plan_kw)
                if kind != "plan":
                    buf = row_copy.copy_host_rows_to_buffer_pallas(
                        pool, buf, jnp.int32(0), plan.miss_host_slots, plan.miss_device_slots, plan.num_misses, **copy_kw
                    )
                checksum += plan.num_misses[0] + plan.slots[0, 0]
            flush, buf, scratch, bt, lru, checksum = jax.lax.optimization_barrier((flush, buf, scratch, bt, lru, checksum))
            checksum += bt[0, 0, 0] + lru[0, 0, 0]
        return buf, scratch, flush, checksum

    return jax.jit(loop, donate_argnums=(0, 1, 2))


class Carry:
    """Device buffers threaded through the timed calls (donated each call, never re-allocated)."""

    def __init__(self, R, context):
        self.buf = jnp.zeros((1, R, BUFFER + 1, WIDTH), jnp.bfloat16)
        self.scratch = jnp.full((R, context), swap_in.SCRATCH_EMPTY, jnp.int32)
        self.flush = jnp.zeros((FLUSH_WORDS,), jnp.int32)

    def run(self, fn, *args):
        self.buf, self.scratch, self.flush, checksum = fn(self.buf, self.scratch, self.flush, *args)
        checksum.block_until_ready()


def time_swap_in_case(entry, w, carry, pool, kinds, plan_kw, copy_kw):
    iters = FLAGS.iters
    args = tuple(jnp.asarray(a) for a in (w.buffer_tokens, w.lru_slots, w.topk_sets, w.lengths, w.page_table))
    args += (pool, jnp.int32(0))
    base = swap_in_loop("base", iters, w.page_size, {}, {})
    R, misses = entry["batch"], entry["misses_per_request"]
    try:
        for kind in kinds:
            fn = swap_in_loop(kind, iters, w.page_size, plan_kw, copy_kw)
            med, diffs = median_difference(lambda: carry.run(fn, *args), lambda: carry.run(base, *args), FLAGS.reps)
            entry[f"{kind}_us"] = med / iters * 1e6
            entry[f"{kind}_spread_us"] = (max(diffs) - min(diffs)) / iters * 1e6
        if misses:
            entry["miss_GBps"] = R * misses * ROW_BYTES / (entry[f"{kinds[0]}_us"] * 1e-6) / 1e9
            entry["floor_us"] = R * misses * ROW_BYTES / (GATHER_FLOOR_GBPS[1] * 1e9) * 1e6
    except Exception as e:  # keep timing the other cases
        entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        RESULTS["errors"].append(traceback.format_exc()[-2000:])
    RESULTS["swap_in"].append(entry)
    log("  " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in entry.items()}))
    save()


def bench_swap_in_batch(rng, R, key):
    pool_rows = R * CONTEXT
    log(f"[swap-in] batch {R}: pool {pool_rows} rows = {pool_rows * ROW_BYTES / 1e9:.2f} GB pinned ...")
    t0 = time.perf_counter()
    pool = random_pool(key, pool_rows)
    pool.block_until_ready()
    log(f"  pool ready in {time.perf_counter() - t0:.1f} s")
    carry = Carry(R, CONTEXT)
    variants = [("pallas", {}, {}, "contiguous"), ("pallas, fragmented pool", {}, {}, "random")]
    if FLAGS.tune:
        variants += [("pallas copy rows32 w8", {}, dict(rows=32, num_warps=8), "contiguous")]
    miss_counts = (0, 102, 410, 2048) if not FLAGS.smoke else (0, 2, 16)
    cases = [("fast path", 0, True)] + [(f"{m} misses", m, False) for m in miss_counts]
    for label, misses, fast in cases:
        for name, plan_kw, copy_kw, layout in variants:
            if layout != "contiguous" and misses == 0:
                continue  # nothing is copied: the page layout cannot matter
            w = make_workload(
                rng, requests=R, buffer_size=BUFFER, top_k=TOP_K, context=CONTEXT if not fast else TOP_K, misses=misses,
                fast_path=fast, page_layout=layout,
            )
            entry = {"batch": R, "case": label, "misses_per_request": misses, "variant": name}
            time_swap_in_case(entry, w, carry, pool, ["swap_in", "plan"] if name == "pallas" else ["swap_in"], plan_kw, copy_kw)
    # XLA's own plan (the jnp reference) with the Pallas copy: the in-run baseline for the plan kernel.
    if R <= 64:
        w = make_workload(rng, requests=R, buffer_size=BUFFER, top_k=TOP_K, context=CONTEXT, misses=min(102, TOP_K // 4))
        entry = {"batch": R, "case": "102 misses", "misses_per_request": min(102, TOP_K // 4), "variant": "xla reference plan + pallas copy"}
        time_swap_in_case(entry, w, carry, pool, ["reference_plan+copy"], {}, {})
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
    tunings = [{}]
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
        tunings = [{}, dict(block_h=64, block_k=64, num_warps=8, num_stages=1)]
    kv = random_kv(jax.random.key(R), R, rows)
    for H in heads:
        q = jnp.asarray(rng.standard_normal((R, H, WIDTH)), jnp.bfloat16)
        flops = 2 * R * H * TOP_K * (WIDTH + LATENT)  # the same for every row layout
        bytes_moved = R * TOP_K * layout.bytes_per_row + R * H * (WIDTH * 2 + LATENT * 4)
        try:
            rel, sane = attention_error(q, kv, slots_sets[0].at[1].set(-1), layout, scale)
            check = {"check_ok": sane and rel < 1e-2, "relative_error_vs_reference": rel}
        except Exception as e:
            check = {"check_ok": False, "check_error": f"{type(e).__name__}: {str(e)[:300]}"}
            RESULTS["errors"].append(traceback.format_exc()[-2000:])
        base = attention_loop("base", FLAGS.iters, scale, {})
        flush, _ = base(flush, q, kv, slots_sets, zero)
        for kind, tuning in [("pallas", t) for t in tunings] + [("reference", {})]:
            entry = {"batch": R, "heads": H, "rows": rows, "row_bytes": layout.bytes_per_row, "implementation": kind, "tuning": tuning}
            if kind == "pallas":
                entry.update(check)
            try:
                fn = attention_loop(kind, FLAGS.iters, scale, tuning, layout)
                flush, c = fn(flush, q, kv, slots_sets, zero)
                c.block_until_ready()
                box = {"flush": flush}

                def run(f):
                    box["flush"], c = f(box["flush"], q, kv, slots_sets, zero)
                    c.block_until_ready()

                med, diffs = median_difference(lambda: run(fn), lambda: run(base), FLAGS.reps)
                flush = box["flush"]
                t = med / FLAGS.iters
                entry.update(us=t * 1e6, TFLOPs=flops / t / 1e12, GBps=bytes_moved / t / 1e9, spread_us=(max(diffs) - min(diffs)) / FLAGS.iters * 1e6)
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                RESULTS["errors"].append(traceback.format_exc()[-2000:])
                flush = jnp.zeros((FLUSH_WORDS,), jnp.int32)  # the failed call may have consumed (donated) it
            RESULTS["attention"].append(entry)
            log("  " + json.dumps({k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in entry.items()}))
            save()
    return flush


def main(_):
    if FLAGS.smoke:
        global TOP_K, BUFFER, CONTEXT, LATENT, ROPE, WIDTH, ROW_BYTES, FLUSH_WORDS
        TOP_K, BUFFER, CONTEXT, LATENT, ROPE, FLUSH_WORDS = 16, 24, 256, 32, 16, 1024
        WIDTH = LATENT + ROPE
        ROW_BYTES = WIDTH * 2
        FLAGS.fp8_sizes, FLAGS.attention_batches = ["2x4"], ["2"]
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    RESULTS["jax"] = jax.__version__
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
        for R in map(int, FLAGS.batches):
            try:
                bench_swap_in_batch(np.random.default_rng(R), R, jax.random.fold_in(key, R))
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
    save()
    log(f"wrote {FLAGS.out}; {len(RESULTS['errors'])} errors")


if __name__ == "__main__":
    app.run(main)
