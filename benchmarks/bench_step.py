"""The decode step against the weight-bandwidth roofline (issue 20): the MoE's grouped GEMMs at one
EP8 rank's shapes, and the whole decode step of the serving benchmark's model vs running requests.

    python benchmarks/bench_step.py --out=$OUT          # H200, one call (~5 min)
    python benchmarks/bench_step.py --smoke --out=/tmp/bench_step   # CPU, tiny sizes

MoE: the routed experts of one EP8 rank (32 of 256 experts, top-8, uniform random routing over
the 32; DeepSeek-V3.2: hidden 7168, moe_intermediate 2048; GLM-5.1: 6144, 2048) as the model runs
them (models.common.moe.Experts: sort by expert, gate / up / down grouped matmuls, weighted sum),
bf16 and block-FP8 weights, for each implementation of pallas_kernels.grouped_matmul; every
output checked against the XLA reference on the same inputs (relative error). Device busy time per
call from the profiler (benchmarks/device_timing.py), median of --calls; floor = the touched
experts' weight bytes (+ fp8 scales) / 4.8 TB/s.

Step: the serving benchmark's model (benchmarks/helpers.bench_model_config: 4 layers, 16 experts,
DeepSeek-V3.2 attention, random weights), fp8 KV, SYNTHETIC 32k contexts (random KV, no prefill),
the model's own selection, every row on the device (--step_mode baseline: the model's step alone,
what the roofline is about; hisparse adds the swap-in), one engine with the overlap schedule whose
batch buckets are the --running sizes; per size, --steps timed decode steps after --warm_steps
(ITL: StepRecord durations, median and spread). At the largest size a profiler trace of the run
gives the GPU's idle share over its decode steps: 1 - (kernel time, overlaps merged) / (the window
from the first timed step's first indexer kernel to the last step's).

Writes $OUT/bench_step.json: "moe": [{model, tokens, weights_dtype, implementation, us, floor_us,
ratio, max_rel_err, ...}], "step": [{running, ms, ...}], "host_idle_fraction", and step_time.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

PARSER = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
PARSER.add_argument("--out", default=os.environ.get("OUT", "outputs/bench_step"))
PARSER.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (the script runs end to end)")
PARSER.add_argument("--sections", default="moe,step")
PARSER.add_argument("--tokens", default="1,8,24,64,88,128,256")
PARSER.add_argument("--moe_models", default="deepseek_v32,glm_5_1")
PARSER.add_argument("--later_model_tokens", default="8,88,256", help="tokens for the MoE models after the first (compiles are the cost)")
PARSER.add_argument("--moe_weights", default="bfloat16,fp8_e4m3", help="the MoE table's weight dtypes")
PARSER.add_argument("--moe_impls", default="", help="the MoE table's implementations (comma list; empty: all that run here)")
PARSER.add_argument(
    "--w8a8_tunings", default=os.environ.get("W8A8_TUNINGS", ""),
    help='JSON list of {"name": ..., <TritonConfig field>: value, ...}: the w8a8 kernel with the default config so changed,'
         ' each an implementation "w8a8:<name>" of the fp8 MoE rows (the sweep for 64+ rows per expert)')  # fmt: skip
PARSER.add_argument("--calls", type=int, default=10)
PARSER.add_argument("--running", default="1,4,16,24,64,88")
PARSER.add_argument("--context", type=int, default=32768)
PARSER.add_argument("--num_layers", type=int, default=4)
PARSER.add_argument("--num_experts", type=int, default=16)
PARSER.add_argument("--weights_dtype", default="bfloat16", help="the step model's weights: bfloat16 or fp8_e4m3")
PARSER.add_argument("--warm_steps", type=int, default=3)
PARSER.add_argument("--steps", type=int, default=10)
PARSER.add_argument("--step_mode", default="baseline", choices=("baseline", "hisparse"),
                    help="the step sweep's KV: all on the device (the model's step alone) or HiSparse")
PARSER.add_argument("--overlap", type=float, default=-1.0,
                    help="SYNTHETIC selection overlap for the step sweep; negative: the model's own selection.")
PARSER.add_argument("--time_budget_s", type=float, default=480.0)
ARGS = PARSER.parse_args()
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "100")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import device_timing  # noqa: E402
from benchmarks.helpers import HBM_BYTES_PER_S, T0, attempt, bench_model_config, ep8_rank_config, log, stats, valid_tile, write_json  # noqa: E402
from configs.model import DSAModelConfig  # noqa: E402
from hisparse_jax.config import HiSparseConfig  # noqa: E402
from models.common.layers import matmul_implementation  # noqa: E402
from models.common.moe import Experts  # noqa: E402
from models.dsa.model import DSAForCausalLM  # noqa: E402
from models.dsa.runner import ModelRunner  # noqa: E402
from pallas_kernels.grouped_matmul import pallas_triton, tokamax_mosaic  # noqa: E402
from serving.engine import Engine, EngineConfig  # noqa: E402
from serving.workload import Request  # noqa: E402

RESULTS: dict = {"args": vars(ARGS), "device": None, "moe": [], "step": [], "host_idle_fraction": None, "errors": []}


def save():
    write_json(os.path.join(ARGS.out, "bench_step.json"), RESULTS)


def over_budget() -> bool:
    return time.perf_counter() - T0 > ARGS.time_budget_s


# ---- MoE ------------------------------------------------------------------------------------------


def rank_config(name: str, block) -> DSAModelConfig:
    """One EP8 rank's experts of a released model: 32 local experts, top-8."""
    if ARGS.smoke:
        return DSAModelConfig.tiny().replace(weight_block_size=None if block is None else (16, 16))
    return ep8_rank_config(name, weight_block_size=block)


def moe_floor_us(config: DSAModelConfig, touched: int, fp8: bool) -> float:
    D, F = config.hidden_size, config.moe_intermediate_size
    weights = 3 * D * F * (1 if fp8 else 2)
    scales = 0 if not fp8 else 3 * 4 * -(-D // config.weight_block_size[1]) * -(-F // config.weight_block_size[0])
    return touched * (weights + scales) / HBM_BYTES_PER_S * 1e6


def tuned_config(default_config, fields: dict, M: int, G: int, K: int, N: int, fp8: bool, **kwargs):
    """default_config with a tuning's fields; split_k back to 1 where the new block_k does not
    divide K into split_k slices, block_n halved to a divisor of N."""
    return valid_tile(default_config(M, G, K, N, fp8, **kwargs).replace(**fields), K, N)


def moe_case(model_name: str, weights_dtype: str, tokens: list[int]):
    fp8 = weights_dtype == "fp8_e4m3"
    config = rank_config(model_name, (128, 128) if fp8 else None)
    experts = Experts(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(experts)
    # "fp8_activations": the model's own w8a8 switch (DSAModelConfig.fp8_activations), default routing
    # (its structure only: the same params, no second set of random weights)
    w8a8_graphdef = nnx.split(nnx.eval_shape(lambda: Experts(config.replace(fp8_activations=True), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))[0] if fp8 else None
    E, X = config.n_routed_experts, config.num_experts_per_tok
    tunings = {f"w8a8:{t['name']}": {k: v for k, v in t.items() if k != "name"} for t in json.loads(ARGS.w8a8_tunings or "[]")} if fp8 else {}
    pallas_variants = ["pallas_f16", "pallas_w8a8", *tunings] if fp8 else []
    impls = ["reference", "pallas", *pallas_variants] + (["tokamax"] if tokamax_mosaic.available() and not ARGS.smoke else [])
    impls += ["fp8_activations"] if fp8 else []
    if ARGS.moe_impls:  # the reference always: every row is checked against it
        impls = ["reference"] + [i for i in impls if i in ARGS.moe_impls.split(",") or i in tunings]

    def run(impl):
        def f(params, x, w, ids):
            # "pallas_f16" / "pallas_w8a8" / "w8a8:<tuning>": the Pallas kernel with pallas_triton's
            # "f16" / "w8a8" conversion ("pallas" alone: "native"), a tuning's fields over the
            # default config; set at trace time, the jit keeps them
            default, default_config = pallas_triton.DEFAULT_FP8_CONVERSION, pallas_triton.default_config
            pallas_triton.DEFAULT_FP8_CONVERSION = "w8a8" if impl in tunings else impl.split("_")[1] if impl in pallas_variants else "native"
            if impl in tunings:
                pallas_triton.default_config = functools.partial(tuned_config, default_config, tunings[impl])
            try:
                if impl == "fp8_activations":  # the default implementation, as the model runs it
                    return nnx.merge(w8a8_graphdef, params)(x, w, ids)
                with matmul_implementation("pallas" if impl in pallas_variants else impl):
                    return nnx.merge(graphdef, params)(x, w, ids)
            finally:  # the model's defaults again for whatever traces next
                pallas_triton.DEFAULT_FP8_CONVERSION, pallas_triton.default_config = default, default_config

        return jax.jit(f)

    fns = {impl: run(impl) for impl in impls}
    for T in tokens:
        if over_budget():
            RESULTS["errors"].append(f"moe {model_name} {weights_dtype} T={T}: skipped, over --time_budget_s")
            return
        k1, k2, k3 = jax.random.split(jax.random.key(T), 3)
        x = jax.random.normal(k1, (T, config.hidden_size), jnp.float32).astype(jnp.bfloat16)  # bf16[T, D]
        ids = jnp.argsort(jax.random.uniform(k2, (T, E)), axis=1)[:, :X].astype(jnp.int32)  # i32[T, X]: distinct experts
        w = jax.nn.softmax(jax.random.normal(k3, (T, X)), axis=-1)  # f32[T, X]
        touched = int(np.unique(np.asarray(ids)).size)
        floor = moe_floor_us(config, touched, fp8)
        ref = np.asarray(fns["reference"](params, x, w, ids), np.float32)
        outputs = {}  # impl -> its output: a tuning is checked against the default w8a8 too

        def rel_err(out, ref):
            return float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-6))

        for impl in impls:
            def one(impl=impl):
                out = outputs[impl] = np.asarray(fns[impl](params, x, w, ids), np.float32)
                err = rel_err(out, ref)
                events, _ = device_timing.record(lambda: fns[impl](params, x, w, ids).block_until_ready(), ARGS.calls)
                busy = device_timing.busy_per_call(events, ARGS.calls)
                row = dict(model=model_name, tokens=T, weights_dtype=weights_dtype, implementation=impl, touched_experts=touched,
                           floor_us=floor, max_rel_err=err, **device_timing.summary(busy, "busy"))  # fmt: skip
                row["us"] = row.get("busy_us")
                row["ratio"] = None if row["us"] is None else row["us"] / floor
                if (impl in tunings or impl == "fp8_activations") and "pallas_w8a8" in outputs:  # same arithmetic: f32 order only
                    row["max_rel_err_vs_w8a8"] = rel_err(out, outputs["pallas_w8a8"])
                RESULTS["moe"].append(row)
                log(f"moe {model_name} {weights_dtype} T={T} {impl}: {row['us']} us (floor {floor:.0f}, x{row['ratio'] or 0:.2f}) err {err:.1e}")

            attempt(RESULTS["errors"], f"moe {model_name} {weights_dtype} T={T} {impl}", one)
        save()


# ---- the whole step -------------------------------------------------------------------------------


def window_idle_fraction(events, num_layers: int, first_step: int) -> dict:
    """GPU idle share over the decode steps from `first_step` on: the window runs from that
    step's first swap-in plan to the last step's first plan; kernel intervals merged."""
    plans = [e for e in events if "indexer_scores" in e.name]  # one per layer and step (every layer has its indexer)
    starts = [plans[i].start_ns for i in range(0, len(plans), num_layers)]
    if len(starts) < first_step + 2:
        return {"error": f"{len(starts)} steps seen in the trace"}
    lo, hi = starts[first_step], starts[-1]
    spans = sorted((max(e.start_ns, lo), min(e.start_ns + e.duration_ns, hi)) for e in events if e.start_ns < hi and e.start_ns + e.duration_ns > lo)
    busy, end = 0.0, lo
    for s, t in spans:
        s = max(s, end)
        if t > s:
            busy += t - s
            end = t
    return {"window_ms": (hi - lo) / 1e6, "busy_ms": busy / 1e6, "idle_fraction": 1.0 - busy / (hi - lo), "steps": len(starts) - 1 - first_step}


def step_section():
    block = (128, 128) if ARGS.weights_dtype == "fp8_e4m3" else None
    config = bench_model_config(smoke=ARGS.smoke, num_layers=ARGS.num_layers, num_experts=ARGS.num_experts)
    config = config.replace(weight_block_size=None if block is None else ((16, 16) if ARGS.smoke else block))
    context = 256 if ARGS.smoke else ARGS.context
    sizes = [int(r) for r in ARGS.running.split(",")]
    if ARGS.smoke:
        sizes = [s for s in sizes if s <= 4] or [1]
    R = max(sizes)
    log(f"step: building the model ({config.num_layers} layers, {config.n_routed_experts} experts, weights {ARGS.weights_dtype})")
    model = DSAForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    runner = ModelRunner(model, kv_cache_dtype="fp8_e4m3" if not ARGS.smoke else "auto")
    top_k = config.index_topk
    hisparse = None
    if ARGS.step_mode == "hisparse":
        hisparse = HiSparseConfig(top_k=top_k, device_buffer_size=2 * top_k, host_to_device_ratio=2)
    new_tokens = ARGS.warm_steps + ARGS.steps + 1
    engine_config = EngineConfig(
        max_running_requests=R, context_length=context + new_tokens, hisparse=hisparse, synthetic_context=True,
        synthetic_topk_overlap=ARGS.overlap if ARGS.overlap >= 0 else None, batch_buckets=tuple(sizes),
        num_host_pages=None if hisparse is None else R * -(-(context + new_tokens) // 16),
    )  # fmt: skip
    RESULTS["step_setup"] = dict(mode=ARGS.step_mode, selection="model" if ARGS.overlap < 0 else f"SYNTHETIC({ARGS.overlap})",
                                 context=context, kv_cache_dtype="fp8_e4m3", layers=config.num_layers,
                                 experts=config.n_routed_experts, weights=ARGS.weights_dtype, overlap_schedule=True)  # fmt: skip
    engine = Engine(runner, engine_config)
    engine.compile_buckets()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, context).astype(np.int32)
    for n in sizes:
        if over_budget():
            RESULTS["errors"].append(f"step running={n}: skipped, over --time_budget_s")
            break
        requests = [Request(i, prompt, new_tokens) for i in range(n)]
        trace = n == R and not ARGS.smoke
        if trace:
            events, _ = device_timing.record(lambda: engine.run(requests), 1)
            result = engine.last_result if hasattr(engine, "last_result") else None
            RESULTS["host_idle"] = window_idle_fraction(events, config.num_layers, ARGS.warm_steps)
            RESULTS["host_idle_fraction"] = RESULTS["host_idle"].get("idle_fraction")
            result = engine.run(requests)  # the timed run, untraced
        else:
            result = engine.run(requests)
        durations = [s.step_s * 1e3 for s in result.steps[ARGS.warm_steps :]]
        row = dict(running=n, ms=float(np.median(durations)), **{f"ms_{k}": v for k, v in stats(durations).items()})
        RESULTS["step"].append(row)
        log(f"step running={n}: {row['ms']:.2f} ms")
        save()


def plot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not RESULTS["step"]:
        return
    x = [r["running"] for r in RESULTS["step"]]
    y = [r["ms"] for r in RESULTS["step"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, y, "o-", label="decode step (median)")
    ax.axhline(1.3 * y[0], color="gray", ls="--", label="1.3 x the step at 1 running")
    ax.set_xlabel("running requests")
    ax.set_ylabel("ms per step")
    ax.set_title(f"bench model step time vs running ({RESULTS['device']}, {ARGS.weights_dtype} weights)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(ARGS.out, "step_time.png"), dpi=120)
    plt.close(fig)


def main():
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    log(f"jax {jax.__version__} on {jax.devices()}; tokamax {'available' if tokamax_mosaic.available() else 'absent'}")
    for section in ARGS.sections.split(","):  # in the order given
        if section == "moe":
            models = ["tiny"] if ARGS.smoke else ARGS.moe_models.split(",")
            for i, name in enumerate(models):
                tokens = [int(t) for t in (ARGS.tokens if i == 0 else ARGS.later_model_tokens).split(",")]
                for dtype in ARGS.moe_weights.split(","):
                    attempt(RESULTS["errors"], f"moe {name} {dtype}", lambda name=name, dtype=dtype, tokens=tokens: moe_case(name, dtype, tokens))
        elif section == "step":
            attempt(RESULTS["errors"], "step", step_section)
    save()
    plot()
    log("done; errors:", len(RESULTS["errors"]))
    for row in RESULTS["moe"]:
        print(f"{row['model']:>12} {row['weights_dtype']:>9} T={row['tokens']:>3} {row['implementation']:>9} "
              f"{row['us'] or 0:8.1f} us floor {row['floor_us']:7.1f} x{row['ratio'] or 0:5.2f} err {row['max_rel_err']:.1e}")  # fmt: skip
    for row in RESULTS["step"]:
        print(f"step running={row['running']:>3}: {row['ms']:.2f} ms")
    print("host idle fraction:", RESULTS["host_idle_fraction"])


if __name__ == "__main__":
    main()
