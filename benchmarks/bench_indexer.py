"""GPU benchmark of the DSA indexer kernels: check against the references, then time, per layer.

    python benchmarks/bench_indexer.py --out=/tmp/bench_indexer.json      (H200)
    python benchmarks/bench_indexer.py --smoke --out=/tmp/smoke.json      (CPU, interpret mode)

Sizes: DeepSeek-V3.2's indexer (64 heads x 128, top_k 2048), batch {13, 47, 88, 190} x context
32768 and batch 47 x 65536 (--sizes), bf16 keys and fp8 keys (+ an f32 scale per key). The key
cache is [1, b, C, 128] with every request at the full context (positions C - 1).

1. Checks, at every size, on fresh random inputs with the key rows past each position NaN and
   one slot inactive, one shorter than K (check inputs only): the scoring kernel against its jnp
   reference (-inf exactly where masked, no NaN, max |error| <= 1e-4 x max |score|); the top-k
   kernel exactly equal to lax.top_k (select_topk) on the kernel's own scores, every variant,
   and on tie-heavy scores (8 distinct values, +0 / -0) at the first size.
   (benchmarks/bench_kernels.py --sections=indexer is the device-timed version of this script.)
2. Timing per layer (one scoring / one top-k of b requests): kernel scoring, XLA's scoring
   (models/dsa/indexer.py's einsum path), the top-k kernels, lax.top_k. Device time by throughput:
   --launches calls of the op's jit queued back to back (asynchronous dispatch keeps the GPU
   busy once an op runs longer than its dispatch), inputs rotating among 3 sets, one block at
   the end; the figure is the median over --reps of that time / launches, with the spread
   (max - min). dispatch_us, the same for a jit without the op (a scalar from the same
   inputs), is the host's cost per launch: a figure near it is dispatch-bound, not device
   time (device_bound says whether it is over 1.5x). Nothing is subtracted: the 2026-12-01
   run subtracted dispatch_us from device-bound figures, which undercounts by about that much
   (docs/PERFORMANCE.md). The checks and the timing share each compiled op (one compile per
   op and shape: compiling unrolled copies of the Triton kernels took minutes). No L2 flush:
   the key cache (>= 109 MB) is over the 60 MB L2, and the top-k reads scores the scoring
   just wrote, as in a decode step.
--tune also times other launch shapes at the first size.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks import helpers  # noqa: E402
from benchmarks.helpers import log, write_json  # noqa: E402
from pallas_kernels import indexer_scores, topk  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_indexer.json", "Where to write the results JSON.")
flags.DEFINE_integer("reps", 5, "Timed repetitions per figure (median reported).")
flags.DEFINE_integer("launches", 20, "Launches queued per timed repetition.")
flags.DEFINE_list("sizes", ["47x32768", "190x32768", "13x32768", "88x32768", "47x65536"], "batch x context, in this order.")
flags.DEFINE_list("keys", ["bfloat16", "fp8_e4m3"], "Key formats.")
flags.DEFINE_bool("tune", True, "Also time other launch shapes at the first size.")
flags.DEFINE_float("time_budget_s", 250.0, "Skip the remaining sizes once this much wall time has passed.")
flags.DEFINE_bool("smoke", False, "Tiny sizes, to try the script itself on a CPU (interpret mode).")

HEADS, HEAD_DIM, TOP_K = 64, 128, 2048
SCORE_OTHER = {"bfloat16": dict(blocks_per_program=1), "fp8_e4m3": dict(blocks_per_program=8, num_stages=3)}  # beside the default
SCORE_TUNINGS = [dict(block_c=256, num_warps=8, blocks_per_program=4, num_stages=3), dict(blocks_per_program=16, num_stages=4)]
TOPK_ORDERS = [dict(method="bisect", order="kernel")]  # checked and timed at every size, beside the default (method="radix")
TOPK_TUNINGS = [dict(method="bisect", order="fused"), dict(method="bisect")]  # first size only
TOPK_STAGES = [dict(stop_after="histogram"), dict(stop_after="resolve")]  # timed only: where the time goes
RESULTS: dict = {"device": None, "sizes": [], "checks": [], "entries": [], "tuning": [], "errors": []}
START = time.perf_counter()


def save():
    write_json(FLAGS.out, RESULTS)


def attempt(where: str, fn):
    """Runs fn(); on an exception records it (the run goes on) and returns None."""
    return helpers.attempt(RESULTS["errors"], where, fn)


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


def make_cache(seed: int, b: int, context: int, key_dtype: str, positions):
    """(keys [1, b, C, I], scales f32[1, b, C or 0]) of random keys made on the device, rows past
    each request's position NaN; fp8 keys quantised per key (amax / 448) as the model does."""

    @jax.jit
    def make(key, positions):
        keys = jax.random.normal(key, (1, b, context, HEAD_DIM), jnp.float32)  # f32 then cast: ~2 GB peak at 190 x 32k x 128 / 2
        stale = jnp.arange(context)[None, :, None] > positions[:, None, None]  # bool[b, C, 1]
        keys = jnp.where(stale[None], jnp.nan, keys)
        if key_dtype == "fp8_e4m3":
            amax = jnp.max(jnp.abs(keys), axis=-1)
            scales = jnp.maximum(amax / 448.0, jnp.finfo(jnp.float32).tiny)  # f32[1, b, C]
            return jnp.clip(keys / scales[..., None], -448.0, 448.0).astype(jnp.float8_e4m3fn), scales
        return keys.astype(jnp.bfloat16), jnp.zeros((1, b, 0), jnp.float32)

    return make(jax.random.key(seed), jnp.asarray(positions, jnp.int32))


def make_queries(rng, b: int, sets: int):
    """`sets` (q bf16[b, G, I], w f32[b, G]) pairs; weights scaled as the model's (G**-0.5)."""
    return [
        (jnp.asarray(rng.standard_normal((b, HEADS, HEAD_DIM)), jnp.bfloat16), jnp.asarray(rng.standard_normal((b, HEADS)) * HEADS**-0.5, jnp.float32))
        for _ in range(sets)
    ]


# ----------------------------------------------------------------------------------------------
# timing: N launches in one jit minus the same jit without them
# ----------------------------------------------------------------------------------------------


@functools.cache
def jitted(kind: str, tuning_json: str = "{}", k: int = 0):
    """One compiled op per (kind, variant): "score" / "reference_score" (q, w, keys, scales,
    positions) -> f32[b, C]; "topk" / "reference_topk" (scores) -> i32[b, K]; "base" (any
    arrays) -> a scalar. Shared by the checks and the timing."""
    tuning = json.loads(tuning_json)
    if kind == "score":
        return jax.jit(lambda q, w, keys, scales, positions: indexer_scores.index_scores_masked_pallas(q, w, keys, scales, jnp.int32(0), positions, **tuning))
    if kind == "reference_score":
        return jax.jit(lambda q, w, keys, scales, positions: indexer_scores.index_scores_masked_reference(q, w, keys, scales, 0, positions))
    if kind == "topk":
        return jax.jit(lambda scores: topk.topk_indices_pallas(scores, k, **tuning))
    if kind == "reference_topk":
        return jax.jit(lambda scores: topk.topk_reference(scores, k))
    return jax.jit(lambda *arrays: arrays[0].ravel()[0].astype(jnp.float32) + 1.0)


def op(kind: str, tuning=None, k: int = 0):
    return jitted(kind, json.dumps(tuning or {}, sort_keys=True), k)


def device_time(fn, sets, fixed=()) -> dict:
    """Per-launch time of fn(*sets[i % 3], *fixed) by throughput (median, spread over --reps),
    and the same for a jit without the op (dispatch_us)."""
    base = op("base")

    def queue(f):
        t0 = time.perf_counter()
        for i in range(FLAGS.launches):
            out = f(*sets[i % len(sets)], *fixed)
        out.block_until_ready()
        return (time.perf_counter() - t0) / FLAGS.launches * 1e6

    queue(fn), queue(base)  # compiled and warm before the clock starts
    times, dispatch = zip(*[(queue(fn), queue(base)) for _ in range(FLAGS.reps)])
    us, dispatch_us = statistics.median(times), statistics.median(dispatch)
    return {"us": us, "spread_us": max(times) - min(times), "dispatch_us": dispatch_us, "device_bound": us > 1.5 * dispatch_us}


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------


def check_scores(got, ref, positions) -> dict:
    got, ref = np.asarray(got), np.asarray(ref)
    visible = np.arange(got.shape[1])[None, :] <= np.asarray(positions)[:, None]
    scale = float(np.abs(ref[visible]).max()) if visible.any() else 1.0
    error = float(np.abs(got[visible] - ref[visible]).max()) if visible.any() else 0.0
    masked_ok = bool(np.all(got[~visible] == -np.inf) and np.all(np.isfinite(got[visible])))
    return {"ok": masked_ok and not np.isnan(got).any() and error <= 1e-4 * scale, "max_abs_error": error, "max_abs_score": scale}


def check_topk(scores, k: int, tunings) -> dict:
    """Each top-k variant exactly equal to select_topk's choice (lax.top_k) on these scores; on
    a mismatch, where and what."""
    expected = np.asarray(op("reference_topk", k=k)(scores))
    result = {}
    for tuning in tunings:
        got = attempt(f"top-k {tuning}", lambda: np.asarray(op("topk", tuning, k)(scores)))
        name = json.dumps(tuning, sort_keys=True)
        result[name] = None if got is None else bool(np.array_equal(got, expected))
        if got is not None and not result[name]:
            rows = np.nonzero(np.any(got != expected, axis=1))[0]
            r = int(rows[0])
            j = int(np.nonzero(got[r] != expected[r])[0][0])
            result[name + " mismatch"] = {
                "rows": rows[:8].tolist(), "row": r, "first_slot": j, "same_set": bool(set(got[r]) == set(expected[r])),
                "got": got[r, max(0, j - 2) : j + 4].tolist(), "expected": expected[r, max(0, j - 2) : j + 4].tolist(),
            }
    result["ok"] = all(v is True for n, v in result.items() if not n.endswith("mismatch"))
    return result


def tie_heavy(scores, signed_zeros: bool):
    """Scores rounded to 9 values (big tie groups at the threshold), masks kept; +0 / -0 mixed."""
    rounded = jnp.round(jnp.clip(scores, -2.0, 2.0) * 2.0) / 2.0  # f32[b, C]
    if not signed_zeros:
        return rounded + 0.0  # -0.0 + 0.0 = +0.0
    return jnp.where(jnp.arange(scores.shape[1]) % 7 == 0, -rounded * 0.0, rounded)  # -0.0 and 0.0


def run_checks(rng, b: int, context: int, key_dtype: str, k: int, first: bool):
    """Checks at (b, context) with NaN rows, an inactive slot and a short one."""
    positions = rng.integers(context // 2, context, b).astype(np.int32)
    positions[0], positions[min(1, b - 1)] = -1, k // 4  # inactive; fewer visible keys than K
    keys, scales = make_cache(int(rng.integers(1 << 30)), b, context, key_dtype, positions)
    (q, w), = make_queries(rng, b, 1)
    args = (q, w, keys, scales, jnp.asarray(positions))
    ref = op("reference_score")(*args)
    got = op("score")(*args)
    entry = {"batch": b, "context": context, "keys": key_dtype, "scores": check_scores(got, ref, positions)}
    entry["scores_other_blocking"] = attempt("other scores", lambda: check_scores(op("score", SCORE_OTHER[key_dtype])(*args), ref, positions))
    tunings = [{}] + TOPK_ORDERS + (TOPK_TUNINGS if first else [])
    entry["topk_on_kernel_scores"] = check_topk(got, k, tunings)
    if first:
        entry["topk_on_tie_heavy_scores"] = check_topk(tie_heavy(got, True), k, tunings)
        entry["topk_on_tie_heavy_scores_no_signed_zeros"] = check_topk(tie_heavy(got, False), k, tunings)
        # lax.top_k itself on +0 / -0 ties: does this platform tie them (as the reference does)?
        mixed = tie_heavy(got, True)
        raw = np.asarray(jax.jit(lambda x: jax.lax.top_k(x, k)[1])(mixed))
        canonical = np.asarray(op("reference_topk", k=k)(mixed))
        entry["raw_lax_top_k_ties_signed_zeros"] = bool(np.array_equal(raw[canonical >= 0], canonical[canonical >= 0]))
    RESULTS["checks"].append(entry)
    log(f"check {json.dumps(entry)}")
    save()


# ----------------------------------------------------------------------------------------------
# timing one size
# ----------------------------------------------------------------------------------------------


def time_size(rng, b: int, context: int, key_dtype: str, k: int, tune: bool):
    positions = jnp.full((b,), context - 1, jnp.int32)  # every request at the full context
    keys, scales = make_cache(int(rng.integers(1 << 30)), b, context, key_dtype, positions)
    sets = make_queries(rng, b, 3)
    fixed = (keys, scales, positions)
    entry = {"batch": b, "context": context, "keys": key_dtype, "top_k": k}
    key_bytes = b * context * (HEAD_DIM * keys.dtype.itemsize + (4 if key_dtype == "fp8_e4m3" else 0))

    def record(name, fn, *args):
        t = attempt(f"{name} b{b} C{context} {key_dtype}", lambda: device_time(fn, *args))
        if t is not None:
            entry[f"{name}_us"], entry[f"{name}_spread_us"] = t["us"], t["spread_us"]
            entry[f"{name}_dispatch_us"], entry[f"{name}_device_bound"] = t["dispatch_us"], t["device_bound"]

    record("score", op("score"), sets, fixed)
    entry["score_other_tuning"] = SCORE_OTHER[key_dtype]
    record("score_other", op("score", SCORE_OTHER[key_dtype]), sets, fixed)
    record("reference_score", op("reference_score"), sets, fixed)
    if "score_us" in entry:
        entry["score_GBps"] = key_bytes / (entry["score_us"] * 1e-6) / 1e9  # keys read once
    score_sets = [(op("score")(q, w, *fixed),) for q, w in sets]  # the kernel's own scores, 3 sets
    record("topk", op("topk", k=k), score_sets)
    for tuning in TOPK_ORDERS:
        record(f"topk_{tuning['method']}_order_{tuning['order']}", op("topk", tuning, k), score_sets)
    record("reference_topk", op("reference_topk", k=k), score_sets)
    RESULTS["entries"].append(entry)
    log("  " + json.dumps({n: (round(v, 2) if isinstance(v, float) else v) for n, v in entry.items()}))
    save()
    if tune:
        variants = [("score", t, sets, fixed) for t in SCORE_TUNINGS] + [("topk", t, score_sets, ()) for t in TOPK_TUNINGS + TOPK_STAGES]
        for kind, tuning, args, more in variants:
            t = attempt(f"{kind} tuning {tuning}", lambda: device_time(op(kind, tuning, k), args, more))
            RESULTS["tuning"].append({"op": kind, "batch": b, "context": context, "keys": key_dtype, "tuning": tuning, **(t or {})})
            log(f"  tuning {kind} {tuning}: {t}")
        save()


def main(argv):
    del argv
    global HEADS, HEAD_DIM, TOP_K, SCORE_TUNINGS, TOPK_TUNINGS, TOPK_STAGES
    if FLAGS.smoke:  # tiny sizes; the interpreter runs the kernels
        HEADS, HEAD_DIM, TOP_K = 8, 32, 64
        FLAGS.sizes, FLAGS.reps, FLAGS.launches = ["3x512", "2x1024"], 2, 2
        SCORE_TUNINGS = [dict(block_c=64, blocks_per_program=2)]
        TOPK_TUNINGS = [dict(method="bisect", order="fused", chunk=128, num_warps=4), dict(slice_len=128, sub=32, chunk=64)]
        TOPK_STAGES = [dict(stop_after="histogram")]
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    RESULTS["config"] = {"heads": HEADS, "head_dim": HEAD_DIM, "top_k": TOP_K, "reps": FLAGS.reps, "launches": FLAGS.launches, "smoke": FLAGS.smoke}
    log(f"device: {RESULTS['device']}")
    rng = np.random.default_rng(int(time.time()))
    for n, size in enumerate(FLAGS.sizes):
        if time.perf_counter() - START > FLAGS.time_budget_s:
            RESULTS["errors"].append(f"skipped {size}: over --time_budget_s")
            log(f"skipped {size}: over the time budget")
            continue
        b, context = map(int, size.split("x"))
        RESULTS["sizes"].append(size)
        for key_dtype in FLAGS.keys:
            log(f"[{size} {key_dtype}] at {time.perf_counter() - START:.0f} s")
            attempt(f"checks {size} {key_dtype}", lambda: run_checks(rng, b, context, key_dtype, TOP_K, first=n == 0 and key_dtype == FLAGS.keys[0]))
            attempt(f"timing {size} {key_dtype}", lambda: time_size(rng, b, context, key_dtype, TOP_K, FLAGS.tune and n == 0 and key_dtype == FLAGS.keys[0]))
    save()
    log("\nbatch context keys | score us (XLA) | top-k us (radix), bisect order=kernel (lax.top_k)")
    for e in RESULTS["entries"]:
        cell = lambda name: f"{e.get(name + '_us', float('nan')):.1f}"  # noqa: E731
        log(f"{e['batch']:5d} {e['context']:6d} {e['keys']:9s} | {cell('score')} ({cell('reference_score')}) | "
            f"{cell('topk')}, {cell('topk_bisect_order_kernel')} ({cell('reference_topk')})")
    log(f"checks ok: {all(c['scores']['ok'] and c['topk_on_kernel_scores']['ok'] for c in RESULTS['checks'])}; "
        f"{len(RESULTS['errors'])} errors; wrote {FLAGS.out} at {time.perf_counter() - START:.0f} s")


if __name__ == "__main__":
    app.run(main)
