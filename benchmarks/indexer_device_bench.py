"""The DSA indexer section of benchmarks/bench_kernels.py: check, then time by device time.

    entries = run(sizes=[(47, 32768), ...], log=print, save=callback, budget_s=150)

Per size (DeepSeek-V3.2's indexer: 64 heads x 128, bf16 keys, top_k 2048; key cache
[1, b, C, 128], every request at the full context for the timing):
1. Checks on the GPU, fresh random inputs, key rows past each position NaN, one slot inactive
   and one shorter than K: the scoring kernel against its jnp reference (-inf exactly where
   masked, no NaN, max |error| <= 1e-4 x max |score|: different summation orders), and every
   timed top-k variant EXACTLY equal to the jnp reference (topk_reference: lax.top_k with -0 =
   +0) on the kernel's own scores; at the first size also on tie-heavy scores (9 values, +0 and
   -0 mixed, so thresholds fall inside large tie groups).
2. Timing: each op's own jit called `calls` times (inputs rotating among 3 sets) under JAX's
   profiler (benchmarks/device_timing.py). Per call: `span` = first kernel's start to last
   kernel's end on the device (what the stream spends, launch gaps between the op's kernels
   included) and `busy` = the kernels' summed durations; medians with p10-p90. `score_us` /
   `topk_us` are the kernels' spans; the same-run baselines are XLA's: `reference_score_us`
   (models/dsa/indexer.py's einsum path + mask) and `reference_topk_us` (lax.top_k). Each
   multi-kernel op also reports its kernels' own median durations (`*_kernels`).
The top-k is timed on the kernel's own scores (L2-warm as in a decode step, where it follows
the scoring); the scoring reads >= 109 MB of keys, over the 60 MB L2.
"""

from __future__ import annotations

import functools
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import device_timing
from pallas_kernels import indexer_scores, topk

HEADS, HEAD_DIM, TOP_K = 64, 128, 2048
COPY_TBPS = 4.2  # device-to-device copy, read + write (docs/background.md, GPU_FACTS.md)
# Other launch shapes: checked and timed at every size (ALWAYS_*), or at one size (VARIANTS_AT).
# The 2026-12-01 defaults (8 x 128-key blocks; method "radix" everywhere) stay as the comparison.
ALWAYS_SCORE = [{"block_c": 128, "blocks_per_program": 8}]
ALWAYS_TOPK = [{"method": "bisect"}, {"method": "radix"}]
VARIANTS_AT = {
    (47, 32768): ([{"block_c": 64, "blocks_per_program": 32}, {"block_c": 64, "blocks_per_program": 8}], []),
    (13, 32768): ([{"block_c": 64, "blocks_per_program": 2}, {"block_c": 32, "blocks_per_program": 8}], []),
}


@functools.cache
def _jitted(kind: str, tuning_json: str, k: int):
    tuning = json.loads(tuning_json)
    if kind == "score":
        return jax.jit(lambda q, w, keys, scales, pos: indexer_scores.index_scores_masked_pallas(q, w, keys, scales, jnp.int32(0), pos, **tuning))
    if kind == "reference_score":
        return jax.jit(lambda q, w, keys, scales, pos: indexer_scores.index_scores_masked_reference(q, w, keys, scales, 0, pos))
    if kind == "topk":
        return jax.jit(lambda scores: topk.topk_indices_pallas(scores, k, **tuning))
    return jax.jit(lambda scores: topk.topk_reference(scores, k))


def op(kind: str, tuning=None):
    """One compiled op per (kind, tuning, shape), shared by the checks and the timing."""
    return _jitted(kind, json.dumps(tuning or {}, sort_keys=True), TOP_K)


def make_cache(seed: int, b: int, context: int, positions):
    """keys bf16[1, b, C, I] random, made on the device, rows past each position NaN."""

    @jax.jit
    def make(key, positions):
        keys = jax.random.normal(key, (1, b, context, HEAD_DIM), jnp.bfloat16)
        stale = jnp.arange(context)[None, :, None] > positions[:, None, None]  # bool[b, C, 1]
        return jnp.where(stale[None], jnp.nan, keys).astype(jnp.bfloat16)

    return make(jax.random.key(seed), jnp.asarray(positions, jnp.int32)), jnp.zeros((1, b, 0), jnp.float32)


def make_queries(rng, b: int, sets: int):
    """`sets` (q bf16[b, G, I], w f32[b, G]) pairs; weights scaled as the model's (G**-0.5)."""
    return [
        (jnp.asarray(rng.standard_normal((b, HEADS, HEAD_DIM)), jnp.bfloat16), jnp.asarray(rng.standard_normal((b, HEADS)) * HEADS**-0.5, jnp.float32))
        for _ in range(sets)
    ]


def tie_heavy(scores):
    """Scores rounded to 9 values, masks kept, every 7th position's value negated-and-zeroed
    (-0.0 mixed with +0.0)."""
    rounded = jnp.round(jnp.clip(scores, -2.0, 2.0) * 2.0) / 2.0  # f32[b, C]
    return jnp.where(jnp.arange(scores.shape[1]) % 7 == 0, -rounded * 0.0, rounded)


def check_scores(got, ref, positions, terms=None) -> dict:
    """-inf exactly where masked, no NaN, and max |error| <= 1e-4 x max |score|; with `terms` (the
    scores of |q|, |w|, |keys|: fp8 x fp8 dots accumulating on the fp8 tensor cores, ~14
    significant bits) each score within 2**-8 of its own terms' absolute sum instead."""
    got, ref = np.asarray(got), np.asarray(ref)
    visible = np.arange(got.shape[1])[None, :] <= np.asarray(positions)[:, None]
    scale = float(np.abs(ref[visible]).max())
    error = np.abs(got[visible] - ref[visible])
    bound = 1e-4 * scale if terms is None else 2.0**-8 * np.asarray(terms)[visible]
    masked_ok = bool(np.all(got[~visible] == -np.inf) and np.all(np.isfinite(got[visible])))
    ok = masked_ok and not np.isnan(got).any() and bool(np.all(error <= bound))
    return {"ok": ok, "max_abs_error": float(error.max()), "max_abs_score": scale}


def check_topk(scores, tunings) -> dict:
    """{variant: exactly equal to topk_reference on these scores}, and where a mismatch is."""
    expected = np.asarray(op("reference_topk")(scores))
    out = {}
    for tuning in tunings:
        name = json.dumps(tuning, sort_keys=True)
        got = _guard(lambda: np.asarray(op("topk", tuning)(scores)))
        if isinstance(got, str):  # this variant failed to build or run: recorded, not timed
            out[name], out[name + " mismatch"] = False, got
            continue
        out[name] = bool(np.array_equal(got, expected))
        if not out[name]:
            r = int(np.nonzero(np.any(got != expected, axis=1))[0][0])
            j = int(np.nonzero(got[r] != expected[r])[0][0])
            out[name + " mismatch"] = {"row": r, "slot": j, "got": got[r, j : j + 4].tolist(), "expected": expected[r, j : j + 4].tolist()}
    out["ok"] = all(v for n, v in out.items() if not n.endswith("mismatch"))
    return out


def checks(rng, b: int, context: int, topk_tunings, first: bool, score_tunings) -> dict:
    positions = rng.integers(context // 2, context, b).astype(np.int32)
    positions[0], positions[1] = -1, TOP_K // 4  # inactive; fewer visible keys than K
    keys, scales = make_cache(int(rng.integers(1 << 30)), b, context, positions)
    ((q, w),) = make_queries(rng, b, 1)
    args = (q, w, keys, scales, jnp.asarray(positions))
    ref = op("reference_score")(*args)
    got = op("score")(*args)
    entry = {"scores": check_scores(got, ref, positions)}
    entry["scores_variants"] = {json.dumps(t, sort_keys=True): _guard(lambda t=t: check_scores(op("score", t)(*args), ref, positions)["ok"]) for t in score_tunings}
    entry["scores_variants_ok"] = all(v is True for v in entry["scores_variants"].values())
    entry["topk"] = check_topk(got, topk_tunings)
    if first:
        entry["topk_tie_heavy"] = check_topk(tie_heavy(got), topk_tunings)
    entry["ok"] = entry["scores"]["ok"] and entry["scores_variants_ok"] and entry["topk"]["ok"] and entry.get("topk_tie_heavy", {"ok": True})["ok"]
    return entry


def _guard(fn):
    """fn(), or the error's text (a variant that fails is recorded; the run goes on)."""
    try:
        return fn()
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:300]}"


def _per_call(events, calls: int):
    """(span us, busy us) of each call, the events split evenly in start order (each call runs
    the same kernels); None when they do not split evenly."""
    if not events or len(events) % calls:
        return None
    n = len(events) // calls
    spans, busy = [], []
    for i in range(calls):
        chunk = events[i * n : (i + 1) * n]
        spans.append((max(e.start_ns + e.duration_ns for e in chunk) - chunk[0].start_ns) / 1e3)
        busy.append(sum(e.duration_ns for e in chunk) / 1e3)
    return spans, busy


def device_time(fn, sets, calls: int) -> dict:
    """Span and busy time per call of fn(*sets[i % len(sets)]), and its kernels' own medians."""
    for args in sets:  # compiled and warm
        jax.block_until_ready(fn(*args))
    counter = iter(range(10**9))

    def run():
        jax.block_until_ready(fn(*sets[next(counter) % len(sets)]))

    events, _ = device_timing.record(run, calls)
    kernels = {}
    for e in events:
        kernels.setdefault(e.name[:60], []).append(e.duration_ns / 1e3)
    kernels = {name: round(float(np.median(v)), 2) for name, v in kernels.items()}
    split = _per_call(events, calls)
    if split is None:  # no device trace (CPU), or stray events: the mean busy time only
        busy = [sum(e.duration_ns for e in events) / 1e3 / calls] if events else []
        return {**device_timing.summary(busy, "busy"), "kernels": kernels, "error": f"{len(events)} kernel events for {calls} calls"}
    spans, busy = split
    return {**device_timing.summary(spans, "span"), **device_timing.summary(busy, "busy"), "kernels": kernels}


def _put(entry, prefix: str, t: dict):
    entry[f"{prefix}_us"] = t.get("span_us")
    entry[f"{prefix}_p10_us"], entry[f"{prefix}_p90_us"] = t.get("span_p10_us"), t.get("span_p90_us")
    entry[f"{prefix}_spread_us"] = (t["span_p90_us"] - t["span_p10_us"]) if "span_us" in t else None
    entry[f"{prefix}_busy_us"] = t.get("busy_us")
    entry[f"{prefix}_kernels"] = t.get("kernels", t.get("error"))


def time_size(rng, b: int, context: int, calls: int, score_tunings, topk_tunings) -> dict:
    positions = jnp.full((b,), context - 1, jnp.int32)
    keys, scales = make_cache(int(rng.integers(1 << 30)), b, context, positions)
    fixed = (keys, scales, positions)
    sets = [(q, w, *fixed) for q, w in make_queries(rng, b, 3)]
    entry = {"batch": b, "context": context, "keys": "bfloat16", "heads": HEADS, "head_dim": HEAD_DIM, "top_k": TOP_K, "timing": "device span per call (profiler)"}
    _put(entry, "score", device_time(op("score"), sets, calls))
    _put(entry, "reference_score", device_time(op("reference_score"), sets, calls))
    key_bytes = b * context * (HEAD_DIM * 2 + 4)  # keys read once, one f32 score written
    entry["score_floor_us"] = key_bytes / (COPY_TBPS * 1e12) * 1e6
    if entry["score_us"]:
        entry["score_over_floor"] = entry["score_us"] / entry["score_floor_us"]
    for tuning in score_tunings:
        t = _guard(lambda: device_time(op("score", tuning), sets, calls))
        t = {"error": t} if isinstance(t, str) else t
        entry.setdefault("score_variants", []).append({"tuning": tuning, "us": t.get("span_us"), "p10_us": t.get("span_p10_us"), "p90_us": t.get("span_p90_us"), "error": t.get("error")})
    score_sets = [(op("score")(*args),) for args in sets]
    _put(entry, "topk", device_time(op("topk"), score_sets, calls))
    _put(entry, "reference_topk", device_time(op("reference_topk"), score_sets, calls))
    for tuning in topk_tunings:
        t = _guard(lambda: device_time(op("topk", tuning), score_sets, calls))
        t = {"error": t} if isinstance(t, str) else t
        entry.setdefault("topk_variants", []).append(
            {"tuning": tuning, "us": t.get("span_us"), "p10_us": t.get("span_p10_us"), "p90_us": t.get("span_p90_us"), "busy_us": t.get("busy_us"), "kernels": t.get("kernels"), "error": t.get("error")}
        )
    return entry


def run(sizes, *, log=print, save=lambda entries: None, budget_s: float = 0.0, calls: int = 20, seed: int = 0) -> list[dict]:
    """Checks and times every (batch, context) of `sizes`, the ALWAYS_* variants too, and
    VARIANTS_AT's at their size; the tie-heavy check at the first size.
    Stops starting new sizes once `budget_s` (> 0) seconds have passed. Returns the entries."""
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    entries = []
    for n, (b, context) in enumerate(sizes):
        if budget_s and time.perf_counter() - start > budget_s:
            entries.append({"batch": b, "context": context, "error": "skipped: over the time budget"})
            continue
        first = n == 0
        score_more, topk_more = VARIANTS_AT.get((b, context), ([], []))
        score_tunings = ALWAYS_SCORE + score_more
        topk_tunings = [{}] + ALWAYS_TOPK + topk_more
        try:
            check = checks(rng, b, context, topk_tunings, first, score_tunings)
            entry = time_size(rng, b, context, calls, score_tunings, topk_tunings[1:])
            entry["check"] = check
            entry["checked_bit_exact"] = check["ok"]
        except Exception as e:  # keep the other sizes
            entry = {"batch": b, "context": context, "error": f"{type(e).__name__}: {str(e)[:400]}", "traceback": traceback.format_exc()[-2000:]}
        entry["elapsed_s"] = round(time.perf_counter() - start, 1)
        entries.append(entry)
        log("  indexer " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in entry.items() if not isinstance(v, (dict, list))}))
        save(entries)
    return entries
