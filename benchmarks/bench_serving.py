"""H200 serving benchmark: HiSparse vs the full-KV baseline, decode throughput under one budget.

    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=100 python benchmarks/bench_serving.py --output_dir=OUT
    python benchmarks/bench_serving.py --smoke --output_dir=/tmp/bs     # CPU, tiny sizes

Model: DeepSeek-V3.2's attention exactly (576-wide latent rows, 128 heads, indexer 64 x 128,
top_k 2048, hidden 7168, vocab 129,280) with --num_layers layers (the first dense) and
--num_experts routed experts, RANDOM weights.
Contexts: SYNTHETIC. Each request's 32k-token context is random KV rows written straight into
the host pool (HiSparse) or the device KV (baseline) and random indexer keys into the device
key cache (serving.synthetic_fill), as a PD decode instance receives finished KV, so
prefill stays out of the timing. Selection: the random-weight indexers' own top-k ("model"),
then, labelled apart, the SYNTHETIC selector with --synthetic_topk_overlap.
Budget: both modes get the same device KV budget (rows + indexer keys), by default that of an
H200 serving DeepSeek-V3.2 FP8 at TP8 (see KV_BUDGET_NOTE), pro rata for our layers, counted in
--kv_cache_dtype's bytes (fp8_e4m3: 656 B rows, 128 + 4 B keys); `setup.capacity_at_32k` reports,
without running anything, how many 32k-token requests that budget holds with bf16 and with fp8
rows and keys (DeviceFootprint). Each mode
runs with as many request slots as its budget holds (its capacity); HiSparse's host pool is
host_to_device_ratio (8) x its device pool (slots x B rows per layer).

Per point: requests = min(concurrency, capacity) run together for --warm_steps untimed decode
steps (the first one demand-loads every selected row) then --steps timed ones. Above capacity
extra requests would queue, so the figure is the capacity's, measured once and reported for
each such concurrency (`running` says so). Concurrencies below capacity run in the same
compiled engine with the other slots masked (static shapes, one compile per engine and
selection); masked slots still cost the indexer's work, so those points are pessimistic, and
more so for HiSparse (more slots): the `equal_slots` segment reruns HiSparse with the baseline's
slot count for a like-for-like low-concurrency comparison. Segments run most important first
(benchmarks/README.md); the results JSON is rewritten after every point, and a time guard skips
segments that would not finish within --time_budget_s.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import glob
import json
import math
import os
import shutil
import tarfile
import sys
import time
import traceback

os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "100")  # pinned pool past JAX's 64 GB default
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hisparse_jax.memory import add_host_pool_xla_flags  # noqa: E402

add_host_pool_xla_flags()  # before JAX starts: XLA's remat must not count the pinned pool

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import step_split  # noqa: E402
from benchmarks.probes import state_copies  # noqa: E402
from benchmarks.helpers import bench_model_config, capacity_ratio, ep8_rank_config, log  # noqa: E402
from configs.model import DSAModelConfig  # noqa: E402
from hisparse_jax.config import HiSparseConfig, ResidencyConfig  # noqa: E402
from models.common.buffer_addresses import BufferAddressLog  # noqa: E402
from models.dsa.footprint import DeviceFootprint  # noqa: E402
from models.dsa.model import DSAForCausalLM  # noqa: E402
from models.dsa.runner import ModelRunner  # noqa: E402
from serving.engine import Engine, EngineConfig  # noqa: E402
from serving.telemetry import write_json  # noqa: E402
from serving.validation import KV_CACHE_DTYPE_NAMES  # noqa: E402
from serving.workload import Request  # noqa: E402

# One EP8 rank of the seeds' deployment (`--tp-size 8 --dp-size 8 --enable-dp-attention`): every
# rank serves its own requests with all heads, holds 32 of the 256 routed experts, and its share
# of device memory (0.85) minus the weights is its KV pool.
PRESETS = {"glm-5.1-fp8-dp8-rank": "glm_5_1", "deepseek-v3.2-dp8-rank": "deepseek_v32"}
NVLINK_BYTES_PER_S = 450e9  # H200 NVLink per direction: the expert all-to-all's link (a stated model, not measured)

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", "outputs/bench_serving", "Where bench_serving.json and the plots go.")
flags.DEFINE_list("concurrency", ["1", "4", "16", "64", "128", "256"], "Max concurrencies to report.")
flags.DEFINE_integer("num_layers", 4, "Model layers (the first dense, the rest MoE).")
flags.DEFINE_integer("num_experts", 16, "Routed experts per MoE layer (top-8 of them, 8 groups).")
flags.DEFINE_integer(
    "num_heads", 128,
    "Attention heads (DeepSeek-V3.2: 128; one rank of TP8, the sharding the KV budget assumes, runs 16;"
    " the indexer keeps its 64 heads).",
)
flags.DEFINE_integer("context", 32768, "Tokens per request at the end of the run (prompt + decoded).")
flags.DEFINE_integer("warm_steps", 4, "Untimed decode steps per point (the first demand-loads the buffer).")
flags.DEFINE_integer("steps", 12, "Timed decode steps per point.")
flags.DEFINE_string("hisparse_config", '{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 8}', "As SGLang.")
flags.DEFINE_enum("kv_cache_dtype", "auto", list(KV_CACHE_DTYPE_NAMES), "As SGLang's --kv-cache-dtype (auto: bf16, the model's).")
flags.DEFINE_float("kv_budget_gb_per_layer", None, "Device KV budget per layer (default: KV_BUDGET_NOTE; smoke: 0.00025).")
flags.DEFINE_float("synthetic_topk_overlap", 0.9, "Overlap of the SYNTHETIC selection phase (negative: skip it).")
flags.DEFINE_list(
    "phases", ["model", "synthetic", "equal_slots", "arrivals"],
    "What to run, in this order after the headline; also: residency (the synthetic points again with"
    " dynamic_residency adaptive, mode 'residency').",
)
flags.DEFINE_float("time_budget_s", 180.0, "Skip a phase that would end past this many seconds from the start.")
flags.DEFINE_integer("arrivals_prompt", 4096, "Phase arrivals: prompt tokens (prefilled by the model).")
flags.DEFINE_integer("arrivals_new_tokens", 24, "Phase arrivals: shortest output (others up to 3 x slots more).")
flags.DEFINE_integer("arrivals_slots", 8, "Phase arrivals: request slots (3 x as many requests pass through).")
flags.DEFINE_float("arrivals_reserve_s", 90.0, "Phase arrivals runs only if this much of --time_budget_s is left.")
flags.DEFINE_bool("smoke", False, "Tiny model and context, to try the script on a CPU.")
flags.DEFINE_enum(
    "preset", None, list(PRESETS),
    "One data-parallel-attention rank of a released model at full depth (all heads, 32 of 256 routed experts under"
    " EP8, uniform routing over them, block-FP8 weights): its KV budget is --mem_fraction_static of the device minus"
    " the weights (replaces --num_layers, --num_experts, --num_heads, --kv_budget_gb_per_layer).",
)
flags.DEFINE_float("mem_fraction_static", 0.85, "With --preset: the share of device memory for weights + KV (SGLang's flag).")
flags.DEFINE_bool(
    "fp8_activations", False,
    "fp8 weights: quantise the activations to e4m3 per 128-block before each fp8 matmul (w8a8, the checkpoints'"
    " activation_scheme 'dynamic' as SGLang runs them; DSAModelConfig.fp8_activations). Default: the w8a16 numbers.",
)  # fmt: skip
flags.DEFINE_enum("weights_dtype", "bfloat16", ["bfloat16", "fp8_e4m3"], "Random weights: bf16, or block FP8 (128 x 128) as the FP8 checkpoints.")
flags.DEFINE_bool(
    "disable_overlap_schedule", False,
    "As SGLang's: read each step's tokens before dispatching the next (default: the overlap schedule, EngineConfig.overlap_schedule).",
)
flags.DEFINE_integer(
    "profile_steps", 0,
    "After each engine's SYNTHETIC point at capacity: this many more steps (after --warm_steps warm ones, in a run of"
    " their own) under jax.profiler into OUTPUT_DIR/trace_<mode>, split per category (benchmarks/step_split.py); 0: off.",
)
flags.DEFINE_bool(
    "profile_command_buffers", True,
    "With --profile_steps: keep XLA's command buffers (CUDA graphs) on under the profiler"
    " (--xla_enable_command_buffers_during_profiling), so the split's host_idle is the host time of the"
    " step as it runs unprofiled; XLA's default, off, profiles op by op, whose launches cost more host time.",
)
flags.DEFINE_list(
    "profile_running", [],
    "With --profile_steps: also split the step at these running counts (e.g. 1), not only at capacity; the"
    " ratios' per-token split keeps using the capacity ones.",
)
flags.DEFINE_list(
    "modes", ["hisparse", "baseline"],
    "Engines to run. A preset whose two engines do not fit one device call runs one mode per call, the"
    " second with --merge_from pointing at the first's bench_serving.json.",
)
flags.DEFINE_string(
    "merge_from", None,
    "A bench_serving.json of the same setup (model, context, KV dtype, capacities) from another run, e.g. the"
    " other mode's: its points and step splits for modes this run did not measure join this run's before"
    " the ratios and the summary are computed (recorded under merged_from).",
)
flags.DEFINE_string(
    "decode_xla_options", "",
    'XLA options for the decode step\'s compile alone, as JSON (jax.jit compiler_options), e.g. '
    '\'{"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"}\'; recorded in the JSON\'s setup.',
)
flags.DEFINE_string(
    "hisparse_decode_xla_options", None,
    "The same for HiSparse's decode step alone (unset: --decode_xla_options), e.g."
    ' \'{"xla_gpu_enable_command_buffer": ""}\' (no command buffers: at 61 layers HiSparse\'s step is faster'
    " without them and the baseline's slower); recorded in the JSON's setup.",
)
flags.DEFINE_integer(
    "cuda_graph_max_bs", None,
    "SGLang's --cuda-graph-max-bs: decode buckets of more slots compile without command buffers (both engines"
    " unless --hisparse_cuda_graph_max_bs; unset: every bucket as the options above); recorded in the JSON's setup.",
    lower_bound=0,
)
flags.DEFINE_integer(
    "decode_program_copies", 1,
    "ModelRunner(decode_program_copies): each decode program that keeps its graphs compiled this many times and"
    " run in turn (with two the baseline's c = 1 graph stops re-recording); recorded in the JSON's setup.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "hisparse_cuda_graph_max_bs", None, "--cuda_graph_max_bs for HiSparse's decode step alone (unset: the same).", lower_bound=0
)
flags.DEFINE_integer(
    "hisparse_decode_program_copies", None, "--decode_program_copies for HiSparse's decode step alone (unset: the same).", lower_bound=1
)
flags.DEFINE_integer(
    "compile_threads", 0,
    "EngineConfig(compile_threads): decode programs an engine's warm-up compiles at once (0: all of them, up to one"
    " per 4 CPU cores and one per 8 GiB of available host memory; 1: one after another). GLM-5.1's 78-layer baseline compiled in 133.5 s with two at once, 261 s before.",
    lower_bound=0,
)
flags.DEFINE_bool(
    "log_buffer_addresses", False,
    "Record the device address of each decode step's fresh inputs and outputs; each point then says how many"
    " times each one moved between runs of the same program (which buffers make XLA re-record a CUDA graph).",
)
flags.DEFINE_string("replot", None, "Only redraw the plots of this bench_serving.json into --output_dir (no JAX work).")

# The budget assumption, stated in the output. An H200 has 141 GB of HBM. DeepSeek-V3.2 in FP8
# (~690 GB of weights) at TP8 holds ~86 GB of them per GPU; SGLang's static memory fraction
# (~0.88) leaves ~38 GB for the KV pool, which with MLA (one KV head, replicated over the TP
# ranks) holds every running request's KV for all 61 layers: ~0.62 GB per layer.
KV_BUDGET_NOTE = (
    "0.62 GB per layer: an H200 (141 GB) serving DeepSeek-V3.2 FP8 at TP8 holds ~86 GB of weights per GPU;"
    " a static memory fraction of 0.88 leaves ~38 GB for the KV pool of all 61 layers"
)
KV_BUDGET_GB_PER_LAYER = 0.62
SMOKE_KV_BUDGET_GB_PER_LAYER = 0.00025

RESULTS: dict = {"device": None, "setup": {}, "points": [], "phases": [], "errors": [], "step_split": []}
HLO_DUMP_DIR: str | None = None  # with --profile_steps: where XLA dumps the decode programs' HLO
T0 = time.perf_counter()


def save():
    write_json(os.path.join(FLAGS.output_dir, "bench_serving.json"), RESULTS)


def model_config() -> DSAModelConfig:
    block = (128, 128) if FLAGS.weights_dtype == "fp8_e4m3" or FLAGS.preset else None
    if FLAGS.fp8_activations and block is None:
        raise app.UsageError("--fp8_activations needs fp8 weights: --weights_dtype=fp8_e4m3 or a --preset")
    if FLAGS.preset and not FLAGS.smoke:
        return ep8_rank_config(PRESETS[FLAGS.preset], weight_block_size=block).replace(fp8_activations=FLAGS.fp8_activations)
    config = bench_model_config(smoke=FLAGS.smoke, num_layers=FLAGS.num_layers, num_experts=FLAGS.num_experts, num_heads=FLAGS.num_heads)
    block = None if block is None else ((16, 16) if FLAGS.smoke else block)
    return config.replace(weight_block_size=block, fp8_activations=FLAGS.fp8_activations)


def all_to_all_bytes_per_token(config: DSAModelConfig) -> int:
    """The EP8 expert all-to-all per token and step (a model): each MoE layer dispatches the token's
    hidden state (fp8, as DeepEP does) to its top-k experts and combines their bf16 outputs, 7 of
    every 8 experts on another rank."""
    moe_layers = sum(t == "sparse" for t in config.mlp_layer_types)
    return int(moe_layers * config.num_experts_per_tok * config.hidden_size * (1 + 2) * 7 / 8)


@dataclasses.dataclass
class Setup:
    runner: ModelRunner
    hisparse: HiSparseConfig
    context: int
    prompt_len: int
    budget: int  # device KV bytes, both modes
    capacity: dict  # mode -> request slots the budget holds at `context` tokens


def build() -> Setup:
    config = model_config()
    dtype = jnp.bfloat16
    # A malformed flag stops the run before any JAX work
    xla_options = decode_xla_options("decode_xla_options")
    hisparse_xla_options = xla_options if FLAGS.hisparse_decode_xla_options is None else decode_xla_options("hisparse_decode_xla_options")
    hisparse = HiSparseConfig.from_json(FLAGS.hisparse_config)
    context = 256 if FLAGS.smoke else FLAGS.context  # = host_to_device_ratio x B: one context per slot
    if FLAGS.smoke:
        hisparse = dataclasses.replace(hisparse, top_k=config.index_topk, device_buffer_size=2 * config.index_topk, host_to_device_ratio=8)
    elif FLAGS.preset and hisparse.host_to_device_ratio * hisparse.device_buffer_size < context:
        # A rank's capacity is every slot at `context` tokens: the host pool must hold that many
        # contexts (at 40k and B = 4096 the default ratio 8 held 40 of 50: 2026-12-03).
        ratio = math.ceil(context / hisparse.device_buffer_size)
        log(f"preset: host_to_device_ratio {hisparse.host_to_device_ratio} -> {ratio}, so every slot's {context}-token context fits")
        hisparse = dataclasses.replace(hisparse, host_to_device_ratio=ratio)
    per_layer_gb = FLAGS.kv_budget_gb_per_layer or (SMOKE_KV_BUDGET_GB_PER_LAYER if FLAGS.smoke else KV_BUDGET_GB_PER_LAYER)
    budget = int(per_layer_gb * 1e9 * config.num_layers)
    kv_cache_dtype = FLAGS.kv_cache_dtype
    model = None
    if FLAGS.preset:  # the budget is what the weights leave of the memory fraction
        t = time.perf_counter()
        model = DSAForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))  # built on the device, param by param
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
        jax.block_until_ready(nnx.state(model))
        stats = jax.devices()[0].memory_stats() or {}
        # SGLang's fraction is of the whole device; JAX's bytes_limit is XLA_PYTHON_CLIENT_MEM_FRACTION
        # (default 0.75) of it, and must itself hold the weights: run presets with that near 1
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
        total = int(stats["bytes_limit"] / fraction) if "bytes_limit" in stats else int(141e9)
        if not FLAGS.smoke:  # the CPU has no device memory to share out: the smoke budget stays
            budget = int(FLAGS.mem_fraction_static * total) - weight_bytes
            per_layer_gb = budget / config.num_layers / 1e9
        RESULTS["preset"] = dict(
            name=FLAGS.preset, weight_bytes=weight_bytes, device_bytes=total, mem_fraction_static=FLAGS.mem_fraction_static,
            kv_budget_bytes=budget, all_to_all_bytes_per_token=all_to_all_bytes_per_token(config),
            build_s=time.perf_counter() - t,
        )  # fmt: skip
        log(f"preset {FLAGS.preset}: weights {weight_bytes / 1e9:.1f} GB, KV budget {budget / 1e9:.1f} GB"
            f" ({FLAGS.mem_fraction_static} x {total / 1e9:.1f} GB - weights)")  # fmt: skip
        if budget <= 0:
            raise ValueError(f"the weights ({weight_bytes / 1e9:.1f} GB) leave no KV budget")
    capacity = {
        "hisparse": DeviceFootprint.of(config, dtype, hisparse, kv_cache_dtype).capacity(budget, context),
        "baseline": DeviceFootprint.of(config, dtype, None, kv_cache_dtype).capacity(budget, context),
    }
    if min(capacity.values()) < 1:
        raise ValueError(f"the budget holds no request: {capacity}")
    log(f"model: {config.num_layers} layers, {config.num_heads} heads, hidden {config.hidden_size}, {config.n_routed_experts} experts")
    t = time.perf_counter()
    if model is None:
        model = DSAForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))
        jax.block_until_ready(nnx.state(model))
    log(f"random weights built in {time.perf_counter() - t:.1f}s")
    B = hisparse.device_buffer_size
    footprint = DeviceFootprint.of(config, dtype, None, kv_cache_dtype)
    row_bytes, key_bytes = footprint.row_bytes, footprint.key_bytes
    RESULTS["setup"] = dict(
        model=dict(base=PRESETS.get(FLAGS.preset, "deepseek_v32"), weights=f"random, {FLAGS.weights_dtype if not FLAGS.preset else 'fp8_e4m3'}", fp8_activations=FLAGS.fp8_activations,
                   num_layers=config.num_layers, num_heads=config.num_heads,
                   hidden_size=config.hidden_size, kv_row_width=config.kv_row_width, index_n_heads=config.index_n_heads,
                   index_head_dim=config.index_head_dim, index_topk=config.index_topk,
                   n_routed_experts=config.n_routed_experts, vocab_size=config.vocab_size, dtype="bfloat16",
                   kv_cache_dtype=kv_cache_dtype,
                   # w8a8 over fp8 keys: the indexer scores fp8 queries (models.dsa.indexer.Indexer.queries; since 2026-12-04)
                   indexer_queries="fp8" if FLAGS.fp8_activations and kv_cache_dtype == "fp8_e4m3" else "model dtype",
                   # w8a8 in a bf16 model: MLA's value lift with bf16 operands (models.dsa.mla.MLAttention.output; since 2026-12-04)
                   value_lift="bfloat16" if FLAGS.fp8_activations else "float32"),
        contexts=(f"SYNTHETIC: {context}-token contexts ({context - FLAGS.warm_steps - FLAGS.steps} prompt tokens of random KV"
                  " rows written straight into the host pool / the baseline's device KV, random indexer keys; no prefill)"),
        hisparse_config=json.loads(hisparse.to_json()),
        kv_budget=dict(bytes=budget, gb_per_layer=per_layer_gb, note="smoke" if FLAGS.smoke else KV_BUDGET_NOTE,
                       counts=f"{kv_cache_dtype} KV rows ({row_bytes} B) + indexer keys ({key_bytes} B), per token and layer"),
        capacity=capacity,
        capacity_at_32k=capacity_at(config, dtype, hisparse, budget, 32768),
        host_pool=dict(rows_per_layer=hisparse.host_to_device_ratio * capacity["hisparse"] * B,
                       bytes=hisparse.host_to_device_ratio * capacity["hisparse"] * B * row_bytes * config.num_layers,
                       rule="host_to_device_ratio x HiSparse's device pool (slots x device_buffer_size rows per layer)"),
        warm_steps=FLAGS.warm_steps, timed_steps=FLAGS.steps, decode_xla_options=xla_options,
        hisparse_decode_xla_options=hisparse_xla_options, cuda_graph_max_bs=FLAGS.cuda_graph_max_bs,
        decode_program_copies=FLAGS.decode_program_copies, hisparse_cuda_graph_max_bs=FLAGS.hisparse_cuda_graph_max_bs,
        hisparse_decode_program_copies=FLAGS.hisparse_decode_program_copies,
    )  # fmt: skip
    log("capacity under the budget:", capacity)
    log("at 32k tokens:", {k: {m: v[m] for m in ("hisparse", "baseline")} for k, v in RESULTS["setup"]["capacity_at_32k"].items() if isinstance(v, dict)})
    save()
    runner = ModelRunner(
        model, kv_cache_dtype=kv_cache_dtype, decode_compiler_options=xla_options, hisparse_decode_compiler_options=hisparse_xla_options,
        cuda_graph_max_bs=FLAGS.cuda_graph_max_bs, decode_program_copies=FLAGS.decode_program_copies,
        hisparse_cuda_graph_max_bs=FLAGS.hisparse_cuda_graph_max_bs, hisparse_decode_program_copies=FLAGS.hisparse_decode_program_copies,
    )
    if FLAGS.log_buffer_addresses:
        runner.buffer_addresses = BufferAddressLog()
    return Setup(runner, hisparse, context, context - FLAGS.warm_steps - FLAGS.steps, budget, capacity)


def decode_xla_options(flag: str) -> dict:
    """--<flag> (a JSON object of XLA options) parsed; a malformed value stops the run with its message."""
    value = getattr(FLAGS, flag)
    if not value:
        return {}
    try:
        options = json.loads(value)
    except json.JSONDecodeError as e:
        raise app.UsageError(f"--{flag} is not JSON: {e}") from None
    if not isinstance(options, dict):
        raise app.UsageError(f"--{flag} must be a JSON object of XLA option -> value")
    return options


def capacity_at(config: DSAModelConfig, dtype, hisparse: HiSparseConfig, budget: int, tokens: int) -> dict:
    """Requests of `tokens` tokens the budget holds, per kv_cache_dtype and mode (DeviceFootprint:
    no run), with the bytes per token and layer that decide it."""
    out = dict(tokens=tokens, budget_bytes=budget)
    for name in ("bfloat16", "fp8_e4m3"):
        modes = {"hisparse": DeviceFootprint.of(config, dtype, hisparse, name), "baseline": DeviceFootprint.of(config, dtype, None, name)}
        out[name] = dict(row_bytes=modes["baseline"].row_bytes, key_bytes=modes["baseline"].key_bytes,
                         **{mode: f.capacity(budget, tokens) for mode, f in modes.items()},
                         request_bytes={mode: f.request_bytes(tokens) for mode, f in modes.items()})  # fmt: skip
    return out


def point_metrics(result, warm: int) -> dict:
    steps = result.steps[warm:]
    step_s = np.array([s.step_s for s in steps])
    running = np.array([s.running for s in steps])
    hits, misses = sum(s.hits for s in steps), sum(s.misses for s in steps)
    h2d = sum(s.h2d_bytes for s in steps)
    return dict(
        decode_throughput=float(running.sum() / step_s.sum()),  # tokens/s over the timed steps
        itl_ms=dict(mean=float(step_s.mean() * 1e3), p50=float(np.percentile(step_s, 50) * 1e3),
                    p99=float(np.percentile(step_s, 99) * 1e3)),  # every running request gets a token per step
        miss_rate=misses / (hits + misses) if hits + misses else 0.0,
        misses_per_step=misses / len(steps),
        h2d_gb_per_s=h2d / step_s.sum() / 1e9,
        running=int(running.max()),  # requests decoded together (all of them, unless a pool held fewer)
        cold_step_ms=result.steps[0].step_s * 1e3,  # the first step: every selected row demand-loaded
        misses_per_step_all=[s.misses for s in result.steps],
        timed_steps=len(steps),
    )  # fmt: skip


class Engines:
    """The benchmark's engines, created on first use and kept (both modes fit the GPU at once:
    the bench model's budgets are small; a preset's budget is all the memory its weights leave,
    so there the previous engine is dropped first), each warmed once per selection (one decode
    compile each)."""

    def __init__(self, setup: Setup, concurrency: list[int]):
        self.setup = setup
        self.concurrency = concurrency  # the points' max concurrencies: each engine's batch buckets
        self.prompt = np.zeros(setup.prompt_len, np.int32)
        self._engines: dict[tuple[str, int], Engine] = {}
        self._warm: set[tuple[str, int, float | None]] = set()

    def hisparse_of(self, mode: str) -> HiSparseConfig | None:
        """baseline: None; hisparse: the run's config; residency: it with dynamic_residency adaptive."""
        if mode == "baseline":
            return None
        if mode == "residency":
            return dataclasses.replace(self.setup.hisparse, dynamic_residency=ResidencyConfig())
        return self.setup.hisparse

    def needs_compile(self, mode: str, slots: int, overlap: float | None) -> bool:
        return (mode, slots, overlap) not in self._warm

    def get(self, mode: str, slots: int, overlap: float | None) -> Engine:
        setup = self.setup
        if (mode, slots) not in self._engines:
            if FLAGS.preset and self._engines:  # a rank's budget is what its weights leave: one engine's KV at a time
                self._engines.clear()
                self._warm = set()
                gc.collect()
            self._engines[mode, slots] = engine = Engine(
                setup.runner,
                EngineConfig(max_running_requests=slots, context_length=setup.context,
                             hisparse=self.hisparse_of(mode), kv_budget_bytes=setup.budget,
                             page_size=64, synthetic_context=True, seed=0,
                             overlap_schedule=not FLAGS.disable_overlap_schedule, compile_threads=FLAGS.compile_threads,
                             # the buckets the points run (min(c, slots) requests each), not every
                             # power of two: each is a decode compile
                             batch_buckets=tuple(min(c, slots) for c in self.concurrency)),
            )  # fmt: skip
            if engine.capacity(setup.context) < slots:  # e.g. a host pool too small for `slots` contexts
                log(f"  warning: only {engine.capacity(setup.context)} of {slots} contexts fit at once")
        engine = self._engines[mode, slots]
        if engine.config.synthetic_topk_overlap != overlap:
            engine.use_selection(overlap)
        if (mode, slots, overlap) not in self._warm:
            engine.warmup([Request(0, self.prompt, 2)])  # compiles this selection's decode step
            self._warm.add((mode, slots, overlap))
        return engine


def run_segment(engines: Engines, name: str, mode: str, slots: int, overlap: float | None, concurrencies: list[int]) -> None:
    """Points of one (engine, selection): requests = min(c, slots) decode together."""
    t = time.perf_counter()
    warms = engines.needs_compile(mode, slots, overlap)  # get() warms this engine up for this selection
    engine = engines.get(mode, slots, overlap)
    ready_s = time.perf_counter() - t  # the engine's build and compiles (0 when an earlier segment made it)
    compiles = engine.decode_compiles if warms else None  # only the segment whose warm-up compiled reports it
    plan = "" if not compiles else f" ({compiles['programs']} decode programs, {compiles['threads']} at once" + (
        "" if compiles["host_available_gb"] is None else f", {compiles['host_available_gb']:.1f} GB of host memory available") + ")"
    log(f"{name}: {mode} engine with {slots} slots ready in {ready_s:.1f}s{plan}")
    selection = "model" if overlap is None else f"SYNTHETIC(overlap={overlap:g})"
    measured, run_s = {}, {}
    for c in concurrencies:
        running = min(c, slots)
        if running not in measured:
            requests = [Request(i, engines.prompt, FLAGS.warm_steps + FLAGS.steps) for i in range(running)]
            addresses = getattr(engine.runner, "buffer_addresses", None)
            if addresses is not None:
                addresses.clear()
            t = time.perf_counter()
            result = engine.run(requests, max_concurrency=running)
            run_s[running] = time.perf_counter() - t
            measured[running] = point_metrics(result, FLAGS.warm_steps)
            if addresses is not None:  # this point's steps, warm ones included
                measured[running]["buffer_moves"] = addresses.moves()
            if overlap is not None:
                measured[running]["measured_topk_overlap"] = result.summary.get("measured_topk_overlap")
            if "residency" in result.summary:
                measured[running]["residency"] = result.summary["residency"]
        metrics = measured[running]
        if FLAGS.preset:  # the expert all-to-all a real EP8 rank adds: a stated model, in columns of its own
            a2a_ms = running * RESULTS["preset"]["all_to_all_bytes_per_token"] / NVLINK_BYTES_PER_S * 1e3
            metrics = dict(metrics, nvlink_a2a_model_ms=a2a_ms,
                           decode_throughput_with_a2a_model=running / ((metrics["itl_ms"]["mean"] + a2a_ms) / 1e3))  # fmt: skip
        RESULTS["points"].append(dict(phase=name, selection=selection, mode=mode, slots=slots, max_concurrency=c, engine_ready_s=ready_s,
                                      decode_compiles=compiles, **metrics))  # fmt: skip
        log(f"  {name:11s} {mode:8s} c={c:4d} running={metrics['running']:4d}: {metrics['decode_throughput']:10.1f} tok/s,"
            f" ITL {metrics['itl_ms']['mean']:.2f} ms (p99 {metrics['itl_ms']['p99']:.2f}),"
            f" miss rate {metrics['miss_rate']:.3f}, {metrics['h2d_gb_per_s']:.1f} GB/s host->device")  # fmt: skip
        save()
    if FLAGS.profile_steps > 0 and name == "synthetic":  # after every measured point
        for running in sorted(run_s):
            if running == slots or running in {int(r) for r in FLAGS.profile_running}:
                profile_point(engines, mode, slots, running, overlap, run_s[running])


def profile_point(engines: Engines, mode: str, slots: int, running: int, overlap: float | None, point_s: float) -> None:
    """The step split at `running` requests (capacity, or --profile_running) of the `slots`
    engine: a run of its own, --warm_steps untimed steps then --profile_steps under the profiler,
    summarised by benchmarks/step_split.py into RESULTS["step_split"]. Skipped when it would end
    past --time_budget_s (its cost: 1.5 x the measured point's run, whose synthetic fill of every
    context it repeats, + the trace's parse)."""
    steps = FLAGS.warm_steps + FLAGS.profile_steps + 1  # + 1: the trace stops inside the run, not at its end
    estimate = 1.5 * point_s
    if time.perf_counter() - T0 + estimate > FLAGS.time_budget_s:
        log(f"  skip step split of {mode}: ~{estimate:.0f}s would pass --time_budget_s")
        RESULTS["step_split"].append(dict(mode=mode, running=running, skipped=True))
        return
    trace_dir = os.path.join(FLAGS.output_dir, f"trace_{mode}" + ("" if running == slots else f"_running{running}"))
    shutil.rmtree(trace_dir, ignore_errors=True)  # this run's trace only
    engine = engines.get(mode, slots, overlap)  # warm already: no compile
    requests = [Request(i, engines.prompt, steps) for i in range(running)]
    t = time.perf_counter()
    try:
        with step_split.DecodeTrace(engine, trace_dir, FLAGS.warm_steps, FLAGS.profile_steps) as probe:
            engine.run(requests, max_concurrency=running)
        op_names = step_split.hlo_op_names(HLO_DUMP_DIR) if HLO_DUMP_DIR else None  # the step's fusions -> their scopes
        entry = step_split.summarize(trace_dir, probe.traced_steps, probe.window_ms, op_names)
    except Exception as error:  # the split is an extra: keep the points
        entry = dict(error=repr(error), trace=traceback.format_exc()[-2000:])
    entry = dict(mode=mode, running=running, context=engines.setup.context, trace_dir=trace_dir,
                 seconds=time.perf_counter() - t, **entry)  # fmt: skip
    RESULTS["step_split"].append(entry)
    ms = entry.get("categories_ms", {})
    log(f"  step split {mode} running={running}: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items())
        + f" ms/step{' (error: ' + entry['error'] + ')' if 'error' in entry else ''}")  # fmt: skip
    save()


def split_per_token() -> list[dict]:
    """Per category, ms per generated token (a step's ms / running) of each mode's split and
    hisparse - baseline: the parts that hold the throughput ratio, largest first."""
    by_mode = {}  # mode -> its split at the most running requests (capacity)
    for e in RESULTS["step_split"]:
        if e.get("categories_ms") and e.get("running") and e["running"] >= by_mode.get(e["mode"], {}).get("running", 0):
            by_mode[e["mode"]] = e
    if not {"hisparse", "baseline"} <= set(by_mode):
        return []
    per_token = {m: {k: v / e["running"] for k, v in e["categories_ms"].items()} for m, e in by_mode.items()}
    rows = [dict(category=k, hisparse_ms_per_token=per_token["hisparse"][k], baseline_ms_per_token=per_token["baseline"][k],
                 delta_ms_per_token=per_token["hisparse"][k] - per_token["baseline"][k],
                 hisparse_ms_per_step=by_mode["hisparse"]["categories_ms"][k], baseline_ms_per_step=by_mode["baseline"]["categories_ms"][k])
            for k in per_token["hisparse"]]  # fmt: skip
    return sorted(rows, key=lambda r: -r["delta_ms_per_token"])


def _series_mode(p) -> str:
    return f"hisparse ({p['slots']} slots, the baseline's)" if p["phase"] == "equal_slots" else p["mode"]


def draw() -> None:
    """One throughput plot and one misses plot per selection; synthetic ones apart."""
    try:
        from serving import plots  # matplotlib: the JSON holds everything if it is missing
    except ImportError as error:
        log(f"no plots ({error}); the JSON holds every figure")
        return
    for phases, tag in ((("model", "equal_slots"), "model_selection"), (("synthetic", "residency"), "synthetic_selection")):
        points = [dict(p, mode=_series_mode(p)) for p in RESULTS["points"] if p["phase"] in phases]
        if not points:
            continue
        label = f"{points[0]['selection']} selection, SYNTHETIC contexts, random weights"
        plots.throughput_vs_concurrency(
            points, os.path.join(FLAGS.output_dir, f"throughput_{tag}.png"), label=label, metric="decode_throughput",
            linear=True,
        )
        series = {f"{p['mode']}, running {p['running']}": p["misses_per_step_all"] for p in points if p["mode"].startswith("hisparse")}
        plots.misses_over_time(series, os.path.join(FLAGS.output_dir, f"misses_{tag}.png"), label=label, window=4)
    splits = [e for e in RESULTS.get("step_split", []) if e.get("categories_ms")]
    if splits:
        step_split.plot(splits, os.path.join(FLAGS.output_dir, "step_split.png"),
                        label=f"{(RESULTS.get('preset') or {}).get('name') or 'bench model'}, SYNTHETIC selection, random weights")  # fmt: skip


def ratios() -> list[dict]:
    """HiSparse / baseline decode throughput at the same concurrency and selection (equal_slots:
    against the baseline at the same number of running requests)."""
    out = []
    for p in RESULTS["points"]:
        if p["mode"] not in ("hisparse", "residency"):
            continue
        key = "running" if p["phase"] == "equal_slots" else "max_concurrency"
        twin_phase = {"equal_slots": "model", "residency": "synthetic"}.get(p["phase"], p["phase"])
        for b in RESULTS["points"]:
            if b["mode"] == "baseline" and b["phase"] == twin_phase and b[key] == p[key]:
                out.append(dict(phase=p["phase"], max_concurrency=p["max_concurrency"], running=(p["running"], b["running"]),
                                ratio=p["decode_throughput"] / b["decode_throughput"]))  # fmt: skip
                break
    return out


def rank_summary(setup: Setup) -> list[dict]:
    """The headline per context: capacities and the SYNTHETIC-selection throughput ratios at
    capacity and at c = 1 (issue 21's summary rows)."""
    synthetic = [r for r in RESULTS.get("ratios", []) if r["phase"] == "synthetic"]
    c1 = next((r["ratio"] for r in synthetic if r["max_concurrency"] == 1), None)
    capacity = {mode: setup.capacity[mode] for mode in ("hisparse", "baseline")}
    return [dict(preset=FLAGS.preset, kv_cache_dtype=FLAGS.kv_cache_dtype, context=setup.context, capacity_hisparse=capacity["hisparse"],
                 capacity_baseline=capacity["baseline"], ratio_at_capacity=capacity_ratio(RESULTS["points"], capacity), ratio_c1=c1)]  # fmt: skip


def step_cost_fit() -> list[dict]:
    """Per (phase, mode): a step's time ~ F + n x c over the points' (running n, mean ITL), by
    least squares; F is what a step costs whatever runs, c what each running request adds."""
    out = []
    for phase in sorted({p["phase"] for p in RESULTS["points"]}):
        for mode in ("hisparse", "residency", "baseline"):
            seen = {p["running"]: p["itl_ms"]["mean"] for p in RESULTS["points"] if p["phase"] == phase and p["mode"] == mode}
            if len(seen) < 2:
                continue
            n = np.array(sorted(seen), np.float64)
            c, F = np.polyfit(n, np.array([seen[k] for k in sorted(seen)]), 1)
            out.append(dict(phase=phase, mode=mode, F_ms=float(F), c_ms=float(c), running=[int(k) for k in n]))
    return out


def arrivals_phase(setup: Setup) -> None:
    """ITL under arrivals: real prompts (prefilled by the model, not synthetic) reach a HiSparse
    engine while others decode; each finished request lets the next one in. Run once with whole
    prefills (prompt-long stalls of every running request) and once with a per-step prefill
    budget (one layer of a prompt per step), same requests, same engine."""
    prompt_len, new_tokens, slots = FLAGS.arrivals_prompt, FLAGS.arrivals_new_tokens, FLAGS.arrivals_slots
    if FLAGS.smoke:
        prompt_len, new_tokens, slots = 48, 4, 2
    total = 3 * slots
    rng = np.random.default_rng(1)
    vocab = setup.runner.config.vocab_size
    # Staggered lengths so requests finish, and new ones arrive, at different steps.
    requests = [Request(i, rng.integers(0, vocab, prompt_len).astype(np.int32), new_tokens + 3 * (i % slots)) for i in range(total)]
    engine = Engine(setup.runner, EngineConfig(
        max_running_requests=slots, context_length=prompt_len + new_tokens + 3 * slots, hisparse=setup.hisparse,
        page_size=64, batch_buckets=False, seed=0, overlap_schedule=not FLAGS.disable_overlap_schedule,
    ))  # fmt: skip
    t = time.perf_counter()
    engine.warmup(requests[:1])
    log(f"arrivals: engine ready in {time.perf_counter() - t:.1f}s ({slots} slots, {prompt_len}-token prompts)")
    for budget in (None, prompt_len):
        engine.config = dataclasses.replace(engine.config, prefill_token_budget=budget)
        result = engine.run(requests, max_concurrency=slots)
        itl = result.summary["itl_ms"]
        RESULTS.setdefault("arrivals", []).append(dict(
            prefill_token_budget=budget, prompt_len=prompt_len, slots=slots, requests=total, selection="model",
            contexts="prefilled by the model (random weights)", itl_ms=itl, ttft_ms=result.summary.get("ttft_ms"),
            output_throughput=result.summary.get("output_throughput"),
        ))  # fmt: skip
        log(f"  arrivals prefill_token_budget={budget}: ITL mean {itl['mean']:.2f} ms p99 {itl['p99']:.2f} ms")
        save()


def merge_from(path: str) -> None:
    """Adds another run's points and step splits (modes this run did not measure) to RESULTS,
    after checking that both runs measured the same setup."""
    with open(path) as f:
        other = json.load(f)
    other_setup = dict(other.get("setup", {}))
    if "model" in other_setup:  # runs before --fp8_activations / fp8 indexer queries existed ran without them
        other_setup["model"] = {"fp8_activations": False, "indexer_queries": "model dtype", "value_lift": "float32", **other_setup["model"]}
    ours = {p["mode"] for p in RESULTS["points"]}
    merged_modes = {p["mode"] for p in other.get("points", [])} - ours
    ours_setup = RESULTS["setup"]
    if merged_modes <= {"baseline"}:
        # miss_read is how HiSparse reads its misses: it does not touch the baseline's points,
        # which merge whatever its value (runs before the key existed read "copy").
        normalise = lambda setup: {**setup, "hisparse_config": {**setup.get("hisparse_config", {}), "miss_read": None}}  # noqa: E731
        other_setup, ours_setup = normalise(other_setup), normalise(ours_setup)
    for key in ("model", "capacity", "hisparse_config"):
        if other_setup.get(key) != ours_setup.get(key):
            raise app.UsageError(f"--merge_from={path}: its setup's {key} differs from this run's")
    if other.get("setup", {}).get("contexts") != RESULTS["setup"].get("contexts"):
        raise app.UsageError(f"--merge_from={path}: its contexts differ from this run's")
    RESULTS["points"] += [p for p in other.get("points", []) if p["mode"] not in ours]
    RESULTS["step_split"] += [e for e in other.get("step_split", []) if e.get("mode") not in ours]
    RESULTS["merged_from"] = dict(path=path, modes=sorted(merged_modes),
                                  device=other.get("device"))  # fmt: skip
    log(f"merged {RESULTS['merged_from']['modes']} points from {path}")


def main(_):
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    if os.environ.get("ALLOW_PTRACE") and sys.platform == "linux":  # rank_h200.sh SPY_AT: py-spy dump may attach
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(2**64 - 1), 0, 0, 0)  # PR_SET_PTRACER, PR_SET_PTRACER_ANY
    if FLAGS.replot:  # e.g. on a machine with matplotlib, from a GPU run's JSON
        with open(FLAGS.replot) as f:
            RESULTS.update(json.load(f))
        draw()
        log("plots written to", FLAGS.output_dir)
        return
    if FLAGS.profile_steps > 0:  # the decode programs' HLO, so the profile's kernels find their scopes
        global HLO_DUMP_DIR
        HLO_DUMP_DIR = os.path.join(FLAGS.output_dir, "hlo_dump")
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {step_split.dump_flags(HLO_DUMP_DIR)}".strip()
        if FLAGS.profile_command_buffers:
            os.environ["XLA_FLAGS"] += " --xla_enable_command_buffers_during_profiling=true"
    RESULTS["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    RESULTS["device"] = str(jax.devices()[0].device_kind)  # the backend starts here, with those flags
    RESULTS["jax"] = jax.__version__
    log(f"jax {jax.__version__} on {jax.devices()}")
    setup = build()
    concurrency = sorted(int(c) for c in FLAGS.concurrency)
    if FLAGS.smoke:
        concurrency = [c for c in concurrency if c <= 16]
    cap_h, cap_b = setup.capacity["hisparse"], setup.capacity["baseline"]

    def headline(cap):  # concurrencies at or above capacity: one run at capacity stands for them
        return [c for c in concurrency if c >= cap] or [cap]

    def below(cap):
        return [c for c in concurrency if c < cap]

    overlap = FLAGS.synthetic_topk_overlap if FLAGS.synthetic_topk_overlap >= 0 else None
    unknown = set(FLAGS.modes) - {"hisparse", "baseline"}
    if unknown or not FLAGS.modes:
        raise app.UsageError(f"--modes takes hisparse and/or baseline, got {FLAGS.modes}")
    modes = tuple((mode, cap) for mode, cap in (("hisparse", cap_h), ("baseline", cap_b)) if mode in FLAGS.modes)
    if FLAGS.preset:  # the baseline's (cheaper) point and split first: a ratio needs both within one device call
        modes = modes[::-1]
    plan = []  # (phase, mode, slots, overlap, concurrencies), most important first
    # The headline first: SYNTHETIC selection at capacity and below it (c = 1, 4, ...) in the
    # same engines, then the model's (random-weight) selection as the pessimistic bound.
    if "synthetic" in FLAGS.phases and overlap is not None:
        plan += [("synthetic", mode, cap, overlap, below(cap) + headline(cap)) for mode, cap in modes]
    if "residency" in FLAGS.phases and overlap is not None:  # the synthetic points with dynamic residency
        plan.append(("residency", "residency", cap_h, overlap, below(cap_h) + headline(cap_h)))
    if "model" in FLAGS.phases:
        plan += [("model", mode, cap, None, headline(cap)) for mode, cap in modes]
    if "model" in FLAGS.phases:
        plan += [("model", mode, cap, None, below(cap)) for mode, cap in modes if below(cap)]
    if "equal_slots" in FLAGS.phases and cap_h > cap_b and "hisparse" in FLAGS.modes:
        plan.append(("equal_slots", "hisparse", cap_b, None, below(cap_b) + [cap_b]))
    engines = Engines(setup, concurrency)
    cost = {True: 0.0, False: 0.0}  # longest segment so far, with / without a compile
    for name, mode, slots, phase_overlap, points in plan:
        compiles = engines.needs_compile(mode, slots, phase_overlap)
        elapsed = time.perf_counter() - T0
        if elapsed + 1.2 * cost[compiles] > FLAGS.time_budget_s:
            log(f"skip {name}/{mode} ({slots} slots): {elapsed:.0f}s elapsed + ~{cost[compiles]:.0f}s > --time_budget_s")
            RESULTS["phases"].append(dict(name=name, mode=mode, slots=slots, points=points, skipped=True))
            save()
            continue
        start = time.perf_counter()
        try:
            run_segment(engines, name, mode, slots, phase_overlap, points)
            RESULTS["phases"].append(dict(name=name, mode=mode, slots=slots, points=points, seconds=time.perf_counter() - start))
        except Exception as error:  # keep the other segments' results
            RESULTS["errors"].append(dict(phase=name, mode=mode, slots=slots, error=repr(error), trace=traceback.format_exc()[-3000:]))
            log(f"{name}/{mode} ({slots} slots) failed: {error!r}")
        cost[compiles] = max(cost[compiles], time.perf_counter() - start)
        save()
        draw()
    if "arrivals" in FLAGS.phases:
        if time.perf_counter() - T0 + FLAGS.arrivals_reserve_s > FLAGS.time_budget_s:
            log("skip arrivals: not enough of --time_budget_s left")
            RESULTS["phases"].append(dict(name="arrivals", skipped=True))
        else:
            try:
                arrivals_phase(setup)
            except Exception as error:  # keep the other phases' results
                RESULTS["errors"].append(dict(phase="arrivals", error=repr(error), trace=traceback.format_exc()[-3000:]))
                log(f"arrivals failed: {error!r}")
    if FLAGS.merge_from:
        merge_from(FLAGS.merge_from)
    RESULTS["ratios"] = ratios()
    RESULTS["step_cost_fit"] = step_cost_fit()
    RESULTS["summary"] = rank_summary(setup)
    RESULTS["step_split_per_token"] = split_per_token()
    for row in RESULTS["step_split_per_token"]:
        log(f"split per token {row['category']:10s}: hisparse {row['hisparse_ms_per_token']:.4f} ms, baseline"
            f" {row['baseline_ms_per_token']:.4f} ms, delta {row['delta_ms_per_token']:+.4f} ms")  # fmt: skip
    for fit in RESULTS["step_cost_fit"]:
        log(f"step ~ F + n x c: {fit['phase']:9s} {fit['mode']:8s} F {fit['F_ms']:.2f} ms, c {fit['c_ms']:.3f} ms per request"
            f" (from running {fit['running']})")
    for r in RESULTS["ratios"]:
        log(f"{r['phase']:11s} c={r['max_concurrency']:4d} running (hisparse, baseline) {r['running']}: hisparse / baseline = {r['ratio']:.2f}x")
    draw()
    save()
    if HLO_DUMP_DIR and os.path.isdir(HLO_DUMP_DIR):  # keep XLA's memory reports and the state copies (small), drop the dump
        with open(os.path.join(FLAGS.output_dir, "state_copies.txt"), "w") as f, contextlib.redirect_stdout(f):
            state_copies.main([HLO_DUMP_DIR])  # the parameters each decode program copies: a copied state array moves every step
        reports = sorted(glob.glob(os.path.join(HLO_DUMP_DIR, "*memory-usage-report.txt")))
        with tarfile.open(os.path.join(FLAGS.output_dir, "hlo_memory_reports.tar.gz"), "w:gz") as tar:
            for path in reports:
                tar.add(path, arcname=os.path.basename(path))
        shutil.rmtree(HLO_DUMP_DIR, ignore_errors=True)
    log("done; wrote", os.path.join(FLAGS.output_dir, "bench_serving.json"))


if __name__ == "__main__":
    app.run(main)
