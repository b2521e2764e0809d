"""The indexer's scoring kernel over fp8 keys (the rank's key format), launch shapes side by side.

    python benchmarks/probes/indexer_fp8_tiling.py --out=$OUT/indexer_fp8.json
        [--sizes=37x61440x64,23x40960x32,47x32768x64,1x61440x64] [--calls=20] [--queries=bfloat16,fp8] [--variants=default]

Why: at DeepSeek-V3.2's rank (37 running, 61,440 tokens) `hisparse_indexer_scores` took 218 us a
layer, 13.3 ms of a 96.8 ms step (docs/PERFORMANCE.md, 2026-12-04), ~3.5x the bytes' floor. fp8
keys run one 128-key block per program (default_blocking), so the grid is b x C / 128 short
programs with no load pipelining; this probe times that default against longer programs
(blocks_per_program, num_stages) and the keys-major dot (keys [block_c, I] . q^T).

Per size (batch x context x heads; head dim 128, top_k 2048, every request at the full context):
- each variant's scores checked against the jnp reference on the same inputs (rows past each
  position NaN, one slot inactive, one shorter than K): -inf exactly where masked, no NaN,
  max |error| <= 1e-4 x max |score| (indexer_device_bench.check_scores);
- device time per call (the profiler's span, median of `calls`, p10 / p90), the XLA reference's,
  and the floor: fp8 keys + scales read once, one f32 score written, at 4.2 TB/s;
- with --fused, the whole selection (decode_topk: scores, then the top-k) per query format,
  with the scoring kernel counting the top-k's histograms (fused_histogram) and without, the
  two selections equal;
- with --queries=bfloat16,fp8, each variant with fp8 queries too (w8a8: quantize_queries, an
  fp8 x fp8 dot), checked against the reference on the same fp8 queries;
- the top-k kernels (default, radix, bisect) on the default kernel's scores, each checked
  exactly against lax.top_k, and lax.top_k's own time.
Writes JSON after every size.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks import indexer_device_bench as bench  # noqa: E402
from benchmarks.helpers import checks_exit_status  # noqa: E402
from models.dsa.indexer import decode_topk, quantize_keys, quantize_queries  # noqa: E402
from pallas_kernels import common  # noqa: E402

flags.DEFINE_string("out", "indexer_fp8_tiling.json", "Where the JSON goes.")
flags.DEFINE_list("sizes", ["37x61440x64", "23x40960x32", "47x32768x64", "1x61440x64"], "batch x context x heads.")
flags.DEFINE_integer("calls", 20, "Timed calls per variant.")
flags.DEFINE_list("queries", ["bfloat16"], "Query formats, each variant timed with each: bfloat16, and fp8 (w8a8: "
                  "models.dsa.indexer.quantize_queries, the dot fp8 x fp8).")
flags.DEFINE_enum("variants", "all", ["all", "default"], "all: every launch shape in VARIANTS; default: the default shape only.")
flags.DEFINE_bool("fused", False, "Also time the whole selection (scores + top-k, models.dsa.indexer.decode_topk) with and "
                  "without fused_histogram, per query format; the two selections must be equal.")
flags.DEFINE_bool("smoke", False, "Tiny sizes and variants (CPU, interpret mode): the script's own test.")
FLAGS = flags.FLAGS

HEAD_DIM, TOP_K = 128, 2048
# The default first (the comparison), then longer programs, then the keys-major dot.
VARIANTS = [
    {},
    {"block_c": 128, "blocks_per_program": 8, "num_stages": 3},
    {"block_c": 64, "blocks_per_program": 16, "num_stages": 3},
    {"block_c": 256, "blocks_per_program": 4, "num_warps": 8, "num_stages": 3},
    {"keys_major": True},
    {"keys_major": True, "block_c": 128, "blocks_per_program": 8, "num_stages": 3},
    {"keys_major": True, "block_c": 128, "blocks_per_program": 16, "num_stages": 4},
    {"keys_major": True, "block_c": 64, "blocks_per_program": 16, "num_stages": 3},
    {"keys_major": True, "block_c": 256, "blocks_per_program": 4, "num_warps": 8, "num_stages": 3},
    {"keys_major": True, "block_c": 256, "blocks_per_program": 8, "num_warps": 8, "num_stages": 3},
    {"keys_major": True, "block_c": 128, "blocks_per_program": 8, "num_warps": 8, "num_stages": 3},
]
TOPK_VARIANTS = [{}, {"method": "radix", "row_plan": True}, {"method": "radix", "row_plan": False}, {"method": "bisect"}]  # planned once a row, or in every program
SMOKE_VARIANTS = [{}, {"keys_major": True, "block_c": 32, "blocks_per_program": 2}]


def make_inputs(seed: int, b: int, context: int, heads: int, positions):
    """fp8 keys [1, b, C, I] + scales f32[1, b, C] made on the device (rows past each position
    NaN: their scales are NaN too, never read), and 3 query sets (q bf16[b, G, I], w f32[b, G])."""

    @jax.jit
    def make(key, positions):
        keys = jax.random.normal(key, (1, b, context, HEAD_DIM), jnp.float32)
        stale = jnp.arange(context)[None, :, None] > positions[:, None, None]  # bool[b, C, 1]
        return quantize_keys(jnp.where(stale[None], jnp.nan, keys))

    keys, scales = make(jax.random.key(seed), jnp.asarray(positions, jnp.int32))
    rng = np.random.default_rng(seed)
    queries = [
        (jnp.asarray(rng.standard_normal((b, heads, HEAD_DIM)), jnp.bfloat16), jnp.asarray(rng.standard_normal((b, heads)) * heads**-0.5, jnp.float32))
        for _ in range(3)
    ]
    return keys, scales, queries


def scorer(tuning):
    """The scoring op (None: the jnp reference), compiled once per tuning (indexer_device_bench.op)."""
    return bench.op("reference_score") if tuning is None else bench.op("score", tuning)


def topker(tuning):
    """The top-k op (None: lax.top_k), k = bench.TOP_K, compiled once per tuning."""
    return bench.op("reference_topk") if tuning is None else bench.op("topk", tuning)


def timing(fn, sets, calls: int) -> dict:
    t = bench.device_time(fn, sets, calls)
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in t.items() if k != "kernels"} | {"kernels": t.get("kernels")}


QUERY_FORMATS = ("bfloat16", "fp8")


def in_format(queries, fmt: str):
    """(q bf16[b, G, I], w f32[b, G]) pairs as `fmt` queries: fp8 ones quantised per head, the
    scale in w (what a w8a8 model's indexer scores with)."""
    return queries if fmt == "bfloat16" else [quantize_queries(q, w) for q, w in queries]


@functools.cache
def selection(fused: bool):
    """The decode step's selection (scores + top-k kernels, k = TOP_K), with or without the
    scoring kernel counting the top-k's histograms; compiled once per shape."""
    return jax.jit(lambda q, w, keys, scales, positions: decode_topk(
        q, w, keys, scales, 0, positions, TOP_K, implementation="pallas", fused_histogram=fused))


def time_selection(sets, calls: int) -> list:
    """Rows {queries, fused, exact, timing} for both forms on `sets`; exact: the fused selection
    equals the unfused one on the first set."""
    unfused = np.asarray(selection(False)(*sets[0]))
    rows = []
    for fused in (False, True):
        got = bench._guard(lambda: np.asarray(selection(fused)(*sets[0])))
        row = {"fused": fused, "exact": got if isinstance(got, str) else bool(np.array_equal(got, unfused))}
        t = bench._guard(lambda: timing(selection(fused), sets, calls))
        rows.append(row | ({"error": t} if isinstance(t, str) else t))
    return rows


def run_size(b: int, context: int, heads: int, variants, calls: int, seed: int, formats=("bfloat16",), fused=False) -> dict:
    entry = {"batch": b, "context": context, "heads": heads, "head_dim": HEAD_DIM, "keys": "float8_e4m3fn + f32 scale"}
    floor_bytes = b * context * (HEAD_DIM + 4 + 4)  # fp8 key + its scale read, one f32 score written
    entry["floor_us"] = round(floor_bytes / 4.2e12 * 1e6, 2)
    # Checks: a context with an inactive slot and one shorter than K.
    positions = np.random.default_rng(seed).integers(context // 2, context, b).astype(np.int32)
    positions[0] = min(TOP_K // 4, context - 1)
    if b > 1:
        positions[1] = -1
    keys, scales, queries = make_inputs(seed, b, context, heads, positions)
    checks = {}  # (query format, tuning JSON) -> check, each format against the reference on its own queries
    for fmt in formats:
        q, w = in_format(queries[:1], fmt)[0]
        args = (q, w, keys, scales, jnp.asarray(positions))
        reference = scorer(None)(*args)
        terms = None
        if fmt == "fp8" and common.fp8_dots_round_in_mma():  # the fp8 tensor cores' accumulation
            terms = scorer(None)(*(jnp.abs(x.astype(jnp.float32)).astype(x.dtype) for x in args[:3]), scales, args[4])
        for tuning in variants:
            got = bench._guard(lambda: scorer(tuning)(*args))
            checks[fmt, json.dumps(tuning, sort_keys=True)] = got if isinstance(got, str) else bench.check_scores(got, reference, positions, terms)
        del reference, terms
    entry["checks"] = {f"{fmt} {tuning}": check for (fmt, tuning), check in checks.items()}
    del keys, scales
    # Timing: every request at the full context.
    full = jnp.full((b,), context - 1, jnp.int32)
    keys, scales, queries = make_inputs(seed + 1, b, context, heads, np.full(b, context - 1))
    entry["reference_score"], entry["variants"] = {}, []
    for fmt in formats:
        sets = [(q, w, keys, scales, full) for q, w in in_format(queries, fmt)]
        entry["reference_score"][fmt] = bench._guard(lambda: timing(scorer(None), sets, calls))
        for tuning in variants:
            ok = checks[fmt, json.dumps(tuning, sort_keys=True)]
            row = {"queries": fmt, "tuning": tuning, "checked": ok if isinstance(ok, str) else ok["ok"]}
            t = bench._guard(lambda: timing(scorer(tuning), sets, calls))
            row.update({"error": t} if isinstance(t, str) else t)
            if isinstance(t, dict) and t.get("span_us"):
                row["over_floor"] = round(t["span_us"] / entry["floor_us"], 2)
            entry["variants"].append(row)
        if fused:
            entry.setdefault("selection", []).extend({"queries": fmt} | row for row in time_selection(sets, calls))
    sets = [(q, w, keys, scales, full) for q, w in in_format(queries, formats[0])]
    score_sets = [(scorer({})(*args),) for args in sets]
    expected = np.asarray(topker(None)(score_sets[0][0]))
    entry["reference_topk"] = bench._guard(lambda: timing(topker(None), score_sets, calls))
    entry["topk"] = []
    for tuning in TOPK_VARIANTS:
        got = bench._guard(lambda: np.asarray(topker(tuning)(score_sets[0][0])))
        row = {"tuning": tuning, "exact": got if isinstance(got, str) else bool(np.array_equal(got, expected))}
        t = bench._guard(lambda: timing(topker(tuning), score_sets, calls))
        row.update({"error": t} if isinstance(t, str) else t)
        entry["topk"].append(row)
    return entry


def main(argv):
    del argv
    global HEAD_DIM, TOP_K
    sizes, variants = [tuple(map(int, s.split("x"))) for s in FLAGS.sizes], VARIANTS if FLAGS.variants == "all" else VARIANTS[:1]
    formats = tuple(FLAGS.queries)
    if not formats or any(fmt not in QUERY_FORMATS for fmt in formats):
        raise app.UsageError(f"--queries must name one or more of {QUERY_FORMATS}, got {FLAGS.queries}")
    if FLAGS.smoke:
        HEAD_DIM, TOP_K, sizes, variants = 32, 16, [(3, 256, 16)], (SMOKE_VARIANTS if FLAGS.variants == "all" else SMOKE_VARIANTS[:1])
    bench.TOP_K = TOP_K  # the k of bench.op's top-k ops
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "sizes": []}
    start = time.perf_counter()
    for n, (b, context, heads) in enumerate(sizes):
        try:
            entry = run_size(b, context, heads, variants, 3 if FLAGS.smoke else FLAGS.calls, seed=n, formats=formats, fused=FLAGS.fused)
        except Exception as e:  # keep the other sizes
            entry = {"batch": b, "context": context, "heads": heads, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        entry["elapsed_s"] = round(time.perf_counter() - start, 1)
        results["sizes"].append(entry)
        brief = [(v["queries"], json.dumps(v["tuning"]), v.get("span_us"), v.get("checked")) for v in entry.get("variants", [])]
        print(f"[{entry['elapsed_s']} s] {b}x{context}x{heads}: floor {entry.get('floor_us')} us; ref {entry.get('reference_score', {})}", flush=True)
        for line in brief:
            print("   ", *line, flush=True)
        for v in entry.get("topk", []):
            print("    topk", json.dumps(v["tuning"]), v.get("span_us"), "exact" if v.get("exact") is True else v.get("exact"), flush=True)
        for v in entry.get("selection", []):
            print("    selection", v["queries"], "fused" if v["fused"] else "unfused", v.get("span_us"), "exact" if v.get("exact") is True else v.get("exact"), flush=True)
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=1)
    checked = [(v, v.get("checked")) for s in results["sizes"] for v in s.get("variants", [])]
    checked += [(v, v.get("exact")) for s in results["sizes"] for v in s.get("topk", []) + s.get("selection", [])]
    bad = [v for v, ok in checked if ok is not True] + [s for s in results["sizes"] if "error" in s]
    print(f"wrote {FLAGS.out}")
    return checks_exit_status(bad, len(checked) + len(results["sizes"]), "variants or sizes failed a check or errored")


if __name__ == "__main__":
    app.run(main)
