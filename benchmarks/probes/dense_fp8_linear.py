"""Each block-FP8 projection outside the routed experts (attention, indexer, shared expert, dense
MLP), w8a8 as the rank presets run it, by rows: what a request adds to the step through them.

    python benchmarks/probes/dense_fp8_linear.py --out=$OUT/dense_fp8_linear.json   # ~4 min on the H200 (estimated)

Why: at DeepSeek-V3.2's rank (40,960 tokens) the "moe" category, which counts every
hisparse_grouped_matmul kernel, took 29.14 ms a step at the baseline's 12 running and 37.81 ms
at HiSparse's 50 (PERFORMANCE.md, fourteenth session), though both touch all 32 experts: ~0.23 ms
per request of a cost that grows with rows, not weights. w8a8_config gives more than 24 rows
per group a 64-row tile, measured 2.2-4.5x the fp8 floor on the experts (thirteenth session's
"w8a8 tilings"); a dense projection has all the step's rows in its one group. The MLA value
lift (einsum "tha,hva->thv" in f32, the "dense_gemm" category: 2.12 ms a step at 50 running) is
timed too, beside the same product with bf16 operands and f32 accumulation.

Per model (the rank presets' DSAModelConfig, one EP8 rank), per projection (every fp8 Linear of
one MoE layer and of the first, dense, layer, found by walking the abstract model), per row count
(--rows): device busy time of fp8_matmul (benchmarks/device_timing.py, median of --calls, p10 /
p90), its fp8 floor (weight + scale bytes / 4.8 TB/s), for w8a8_config's tile and each
--tunings variant; every output checked against the current tile's (equal bit for bit, or not)
and the jnp reference (max error over the output's largest magnitude). --smoke: the tiny config
on the CPU (interpret mode), the script's own test.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import device_timing  # noqa: E402
from benchmarks.helpers import HBM_BYTES_PER_S, checks_exit_status, ep8_rank_config, valid_tile  # noqa: E402
from configs.model import DSAModelConfig  # noqa: E402
from models.common import fp8  # noqa: E402
from models.common.layers import Linear  # noqa: E402
from models.dsa.loading import abstract_model  # noqa: E402
from pallas_kernels import common  # noqa: E402
from pallas_kernels.grouped_matmul import fp8_matmul, w8a8_config  # noqa: E402

flags.DEFINE_string("out", "outputs/dense_fp8_linear.json", "Where the JSON goes.")
flags.DEFINE_list("models", ["deepseek_v32", "glm_5_1"], "Released configs (benchmarks.helpers.ep8_rank_config).")
flags.DEFINE_list("rows", ["1", "12", "50"], "Rows (running requests) per call.")
flags.DEFINE_string(
    "tunings", '[{"name": "m16", "block_m": 16, "m_subtiles": 1}, {"name": "swap16", "block_m": 16, "m_subtiles": 1, "swap_ab": true},'
    ' {"name": "swap32", "block_m": 32, "swap_ab": true}, {"name": "swap64", "block_m": 64, "swap_ab": true}, {"name": "n64", "block_n": 64}]',
    "JSON list of {name, <TritonConfig field>: value}: w8a8_config's tile so changed, timed beside it.",
)
flags.DEFINE_integer("tune_above", 24, "Time the --tunings only at more rows than this (where w8a8_config leaves 16-row tiles).")
flags.DEFINE_bool("dense_mlp", False, "Also the dense MLP's projections (the first 3 layers only).")
flags.DEFINE_integer("calls", 10, "Timed calls per variant.")
flags.DEFINE_float("time_budget_s", 240, "Start no new projection after this many seconds (the JSON is written after each).")
flags.DEFINE_bool("smoke", False, "The tiny config on the CPU (interpret mode): the script's own test.")
FLAGS = flags.FLAGS



def fp8_projections(config: DSAModelConfig, dense_mlp: bool) -> list[tuple[str, int, int]]:
    """(name, K in, N out) of every block-FP8 Linear in the first MoE layer (and with dense_mlp
    layer 0's dense MLP), once per name: the model's own modules, so nothing is listed by hand."""
    model = abstract_model(config, jnp.bfloat16)
    moe_layer = next(i for i, kind in enumerate(config.mlp_layer_types) if kind != "dense")
    seen, out = set(), []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, Linear) or node.weight_scale_inv is None:
            continue
        keys = [str(p) for p in path]
        if "layers" not in keys or int(keys[keys.index("layers") + 1]) not in ((0, moe_layer) if dense_mlp else (moe_layer,)):
            continue
        name = ".".join(keys[keys.index("layers") + 2 :])
        N, K = node.weight.shape  # [out, in]
        if name not in seen:
            seen.add(name)
            out.append((name, K, N))
    return out


def tile(M: int, K: int, N: int, fields: dict, block: tuple[int, int]):
    """w8a8_config(M, 1, K, N) with `fields`, kept valid for K, N and the scale block as
    grouped_matmul keeps its own (one scale per K step: the tiny config's 16 x 16 blocks)."""
    cfg = w8a8_config(M, 1, K, N).replace(**fields)
    if block[0] % cfg.block_k:
        cfg = cfg.replace(block_k=max(16, block[0]), split_k=1)
    if cfg.block_n > block[1]:
        cfg = cfg.replace(block_n=max(16, block[1]))
    return valid_tile(cfg, K, N)


def busy_us(fn, args, calls: int) -> dict:
    """Device busy time per call (summed kernel durations), median / p10 / p90; {} on the CPU."""
    jax.block_until_ready(fn(*args))
    events, _ = device_timing.record(lambda: jax.block_until_ready(fn(*args)), calls)
    return device_timing.summary(device_timing.busy_per_call(events, calls), "busy")


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-6))


def projection_rows(model: str, config, name: str, K: int, N: int, M: int, tunings: list[dict], calls: int, key) -> list[dict]:
    block = config.weight_block_size
    kx, kw = jax.random.split(key)
    w, scale = fp8.random_fp8(kw, (N, K), K, block)  # f8[N, K], f32[N / b0, K / b1]
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)  # [M, K]
    reference = fp8_matmul(x, w, scale, implementation="reference", fp8_activations=True)
    floor_us = (w.size + scale.size * 4) / HBM_BYTES_PER_S * 1e6
    rows, current = [], None
    for tuning in [{"name": "current"}, *(tunings if M > FLAGS.tune_above else [])]:
        fields = {k: v for k, v in tuning.items() if k != "name"}
        cfg = None if tuning["name"] == "current" else tile(M, K, N, fields, block)
        fn = jax.jit(lambda x, w, s, cfg=cfg: fp8_matmul(x, w, s, implementation="pallas", config=cfg, fp8_activations=True))
        out = fn(x, w, scale)
        current = out if current is None else current
        row = dict(model=model, projection=name, K=K, N=N, rows=M, variant=tuning["name"], floor_us=floor_us,
                   config=str(cfg or w8a8_config(M, 1, K, N)), equal_to_current=bool(np.array_equal(np.asarray(out), np.asarray(current))),
                   max_rel_err_vs_current=relative_error(out, current), max_rel_err_vs_reference=relative_error(out, reference), **busy_us(fn, (x, w, scale), calls))  # fmt: skip
        if "busy_us" in row:
            row["x_floor"] = row["busy_us"] / floor_us
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
    return rows


def value_lift_rows(model: str, config, M: int, calls: int, key) -> list[dict]:
    """The MLA value lift o[t, h, v] = sum_a attn[t, h, a] w_uv[h, v, a], as mla.output runs it
    (f32) and with bf16 operands accumulating in f32."""
    H, A, V = config.num_heads, config.kv_lora_rank, config.v_head_dim
    ka, kw = jax.random.split(key)
    attn = jax.random.normal(ka, (M, H, A), jnp.float32)  # f32[T, H, A]
    w_uv = (jax.random.normal(kw, (H, V, A), jnp.float32) / np.sqrt(A)).astype(jnp.bfloat16)  # [H, V, A]
    forms = {
        "f32": jax.jit(lambda a, w: jnp.einsum("tha,hva->thv", a, w.astype(jnp.float32))),
        "bf16_operands": jax.jit(lambda a, w: jnp.einsum("tha,hva->thv", a.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)),
    }
    want = forms["f32"](attn, w_uv)
    rows = []
    for form, fn in forms.items():
        row = dict(model=model, projection="mla.value_lift", rows=M, variant=form, floor_us=w_uv.size * 2 / HBM_BYTES_PER_S * 1e6,
                   max_rel_err_vs_f32=relative_error(fn(attn, w_uv), want), **busy_us(fn, (attn, w_uv), calls))  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(_):
    start = time.perf_counter()
    tunings = json.loads(FLAGS.tunings)
    if FLAGS.smoke:
        configs = {"tiny": DSAModelConfig.tiny().replace(weight_block_size=(16, 16), fp8_activations=True)}
        rows_list, calls, tunings = [1, 3], 2, tunings[:1]
        FLAGS.tune_above, FLAGS.dense_mlp = 2, True
    else:
        configs = {m: ep8_rank_config(m, num_layers=4) for m in FLAGS.models}
        rows_list, calls = [int(r) for r in FLAGS.rows], FLAGS.calls
    results, key = [], jax.random.key(0)

    def save():
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), hbm_bytes_per_s=HBM_BYTES_PER_S, rows=results), f, indent=1)

    for model, config in configs.items():
        for M in rows_list:
            key, sub = jax.random.split(key)
            results += value_lift_rows(model, config, M, calls, sub)
        for name, K, N in fp8_projections(config, FLAGS.dense_mlp):
            if time.perf_counter() - start > FLAGS.time_budget_s:
                print(f"skipped {model} {name}: past --time_budget_s={FLAGS.time_budget_s:g}", flush=True)
                continue
            for M in rows_list:
                key, sub = jax.random.split(key)
                results += projection_rows(model, config, name, K, N, M, tunings, calls, sub)
            save()
    save()
    # Every tile must compute what the current one does (the same K-block promotions: bit for bit
    # while the dots run on f16 mma.sync; within 2**-8 when they accumulate on the fp8 tensor
    # cores, whose rounding follows the MMA shape) and the reference within the activations' e4m3 rounding.
    fp8_cores = common.fp8_dots_round_in_mma()
    bad = [r for r in results if (r.get("equal_to_current") is False and not fp8_cores) or r.get("max_rel_err_vs_current", 0) > 2.0**-8
           or r.get("max_rel_err_vs_reference", 0) > 0.1]  # fmt: skip
    return checks_exit_status(bad, len(results), "outputs differ from the current tile's or the reference")


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
