"""Shared-index prefetch on a GLM-5.2-shaped model: how much of HiSparse's copy time is hidden.

    python benchmarks/bench_overlap.py --out=$OUT            # H200, one call (~3-4 min)
    python benchmarks/bench_overlap.py --smoke --out=/tmp/bo # CPU, tiny sizes

Model: GLM-5.2's attention and indexer dims (64 heads, 512 + 64 latent rows, indexer 32 x 128,
top_k 2048, hidden 6144, vocab 154,880), --num_layers layers in GLM-5.2's IndexShare pattern
(one full indexer layer, then three that reuse its top-k: F S S S ...), MoE layers of
--num_experts routed experts (top-8), RANDOM weights. SYNTHETIC 32k contexts written straight
into the host pool / device KV (no prefill), fp8 KV rows (656 B) and fp8 indexer keys, the
engine's SYNTHETIC selection with top-k overlap 0.9 between steps. Every phase runs the same
--slots requests at once on one batch bucket (all slots running).

Phases, one engine per memory mode, one process (the model is built once):
  tiny_check: tiny_glm on the real kernels, NaN-filled memory: HiSparse "stream" == no offload;
  baseline:   no offload (FullKVState), every row on the device;
  off:        HiSparse, shared layers copy their rows in line (no overlap);
  stream:     HiSparse, shared layers' copies start once the anchor's plan exists, on a second
              GPU stream (compute_on "gpu_stream:1", XLA stream annotation);
  early:      HiSparse, the same prefetch on the main stream (what XLA's scheduling alone gives);
  ffi_stream: HiSparse, the shared layers' gathers on a CUDA stream of our own through two XLA
              FFI calls (pallas_kernels.side_stream_gather), started staggered (each before the
              attention before its layer); ffi_stream_<point> (mlp, attention) starts them
              elsewhere, ffi_stream_b<N> runs them on N blocks; <phase>_run<n> repeats a phase;
  eager:      "off" with the old per-layer eager backup (item 4's before), if time allows.
Each phase times --steps engine steps after --warm_steps (ITL = the engine's step time, from the
decode call until its tokens are on the host) and records a profiler trace of --trace_steps
steps: the decode module's device time, per-stream busy time, the copy kernels' time
(hisparse_copy_host_rows in line, hisparse_prefetch_host_rows prefetched) and how much of the
prefetch kernels' time other streams' kernels ran beside them.

Hidden fraction = (ITL off - ITL stream) / (ITL off - ITL baseline) (SGLang's reading of its
+7.2 ms -> +3.2 ms), and the same with device module times; plus the copy time exposed.

XLA flags (set before JAX starts): --xla_gpu_experimental_stream_annotation=true
--xla_gpu_enable_latency_hiding_scheduler=true, and an HLO dump of the decode step (summarised:
async call-start ops, copies of the host pool / device buffer). Writes $OUT/bench_overlap.json
after every phase, $OUT/hlo_<phase>.txt.gz (the stream phases' optimised decode HLO) and
$OUT/timeline_<phase>.json (one traced step's kernels, per stream).
"""

from __future__ import annotations

import argparse
import functools
import glob
import gzip
import json
import os
import re
import shutil
import sys
import time
import traceback

PARSER = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
PARSER.add_argument("--out", default=os.environ.get("OUT", "outputs/bench_overlap"))
PARSER.add_argument("--smoke", action="store_true", help="tiny model and context, CPU")
PARSER.add_argument("--num_layers", type=int, default=4, help="a multiple of 4: (F S S S) groups")
PARSER.add_argument("--num_experts", type=int, default=16)
PARSER.add_argument("--slots", type=int, default=160, help="requests, all running")
PARSER.add_argument("--context", type=int, default=32768)
PARSER.add_argument("--overlap", type=float, default=0.9)
PARSER.add_argument("--kv_cache_dtype", default="fp8_e4m3")
PARSER.add_argument("--warm_steps", type=int, default=3)
PARSER.add_argument("--steps", type=int, default=10)
PARSER.add_argument("--trace_steps", type=int, default=3)
PARSER.add_argument("--phases", default="tiny_check,baseline,off,stream,early,eager")
PARSER.add_argument("--lhs", type=int, default=1, help="--xla_gpu_enable_latency_hiding_scheduler")
PARSER.add_argument("--time_budget_s", type=float, default=300.0, help="skip phases past this")
PARSER.add_argument("--tiny_modes", default="stream", help="phases tiny_check compares with no offload")
ARGS = PARSER.parse_args()

HLO_DIR = "/tmp/bench_overlap_hlo"
TRACE_ROOT = "/tmp/bench_overlap_traces"
for _stale in (HLO_DIR, TRACE_ROOT):
    shutil.rmtree(_stale, ignore_errors=True)
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""),
    "--xla_gpu_experimental_stream_annotation=true",
    f"--xla_gpu_enable_latency_hiding_scheduler={'true' if ARGS.lhs else 'false'}",
    f"--xla_dump_to={HLO_DIR} --xla_dump_hlo_module_re=.*decode_step.* --xla_dump_hlo_as_text",
])  # fmt: skip
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "100")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.device_timing import device_events  # noqa: E402
from benchmarks.helpers import log, stats, write_json  # noqa: E402
from configs.model import DSAModelConfig  # noqa: E402
from hisparse_jax import memory  # noqa: E402
from hisparse_jax.config import HiSparseConfig  # noqa: E402
from models.dsa.decoding import decode_step
from models.dsa.generate import generate
from models.dsa.model import DSAForCausalLM  # noqa: E402
from models.dsa.runner import ModelRunner  # noqa: E402
from serving.engine import Engine, EngineConfig  # noqa: E402
from serving.workload import Request  # noqa: E402

T0 = time.perf_counter()
RESULTS: dict = {"args": vars(ARGS), "xla_flags": os.environ["XLA_FLAGS"], "phases": {}, "errors": []}
# in-line copy, XLA-stream prefetch (Pallas), FFI side-stream prefetch (csrc/side_stream_gather.cu)
COPY_KERNELS = ("hisparse_copy_host_rows", "hisparse_prefetch_host_rows", "GatherRowsKernel")
# phase -> (prefetch mode, backups after the last layer, XLA compile options of the decode step)
PHASE_MODES = {
    "off": ("off", True, None), "stream": ("stream", True, None), "early": ("early", True, None),
    "ffi_stream": ("ffi_stream", True, None),  # our own CUDA stream through two FFI calls
    "eager": ("off", False, None),
    "stream_nocb": ("stream", True, {"xla_gpu_enable_command_buffer": ""}),
    # the side-stream fetch with the latency-hiding scheduler off (XLA's memory scheduler then
    # moves async starts as early and dones as late as it can) or with the approximate
    # latency estimator in place of the speed-of-light one (which prices a non-collective
    # async call at a kernel launch)
    "stream_nolhs": ("stream", True, {"xla_gpu_enable_latency_hiding_scheduler": False}),
    "stream_nosol": ("stream", True, {"xla_gpu_enable_analytical_sol_latency_estimator": False}),
}  # fmt: skip


def phase_setup(name: str) -> tuple:
    """(prefetch mode, backups after the last layer, compile options) of phase `name`, with the
    environment its variants read set: "<phase>_run<n>" repeats a phase; "ffi_stream_b<N>"
    runs the side gather on N blocks; "ffi_stream_<point>" starts the gathers at <point>
    (models.dsa.decoding.prefetch_start_point: attention, staggered)."""
    base = name.split("_run")[0]
    os.environ.pop("HISPARSE_SIDE_GATHER_BLOCKS", None)
    os.environ.pop("HISPARSE_PREFETCH_START", None)
    if base.startswith("ffi_stream_"):
        variant = base.removeprefix("ffi_stream_")
        if variant[:1] == "b" and variant[1:].isdigit():
            os.environ["HISPARSE_SIDE_GATHER_BLOCKS"] = variant[1:]
        else:
            os.environ["HISPARSE_PREFETCH_START"] = variant
        return ("ffi_stream", True, None)
    return PHASE_MODES.get(base, ("off", True, None))


def save():
    write_json(os.path.join(ARGS.out, "bench_overlap.json"), RESULTS)


# ---- model -------------------------------------------------------------------------------------


def model_config() -> DSAModelConfig:
    """GLM-5.2's dims, --num_layers layers of (full, shared, shared, shared), all MoE."""
    base = DSAModelConfig.tiny_glm() if ARGS.smoke else DSAModelConfig.glm_5_2()
    L = ARGS.num_layers
    pattern = tuple(("full", "shared", "shared", "shared")[l % 4] for l in range(L))
    changes = dict(num_layers=L, mlp_layer_types=("sparse",) * L, indexer_types=pattern, num_nextn_predict_layers=0)  # no MTP layer
    if not ARGS.smoke:
        changes.update(n_routed_experts=ARGS.num_experts)
    return base.replace(**changes)


def runner_for(model, mode: str, defer_backup: bool, kv_cache_dtype: str, implementation=None, compiler_options=None) -> ModelRunner:
    """A ModelRunner whose jitted decode step runs with this prefetch mode and backup placement
    (the engine calls runner.greedy_step; the jit is rebuilt by ModelRunner.jit_decode)."""
    runner = ModelRunner(model, kv_cache_dtype=kv_cache_dtype, implementation=implementation, shared_prefetch=mode)
    original = runner._jitted

    def jitted(cache):
        fns = original(cache)
        if not fns.get("_patched"):
            step = functools.partial(
                decode_step, runner.graphdef, implementation=runner.implementation, mesh=None,
                shared_prefetch=mode, defer_backup=defer_backup,
            )  # fmt: skip
            fns["decode"] = runner.jit_decode(cache, step, compiler_options=compiler_options)
            fns["_patched"] = True
        return fns

    runner._jitted = jitted
    return runner


# ---- trace analysis -----------------------------------------------------------------------------


def _union_us(intervals) -> float:
    """Total length (us) of the union of (start_ns, end_ns) intervals."""
    total, end = 0.0, -np.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e3


def _covered_us(start, end, others) -> float:
    """How much of [start, end) (ns) the intervals `others` cover, in us."""
    return _union_us([(max(s, start), min(e, end)) for s, e in others if e > start and s < end])


def trace_summary(trace_dir: str, num_steps: int) -> tuple[dict, list]:
    """Device figures per step from the trace under trace_dir, and one step's kernel timeline."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return dict(error=f"no .xplane.pb under {trace_dir}"), []
    data = jax.profiler.ProfileData.from_file(sorted(paths)[-1])
    events, info = device_events(data)
    modules = []  # (start, end) ns of each decode module run on the device
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                if line.name == "XLA Modules":
                    modules += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events if "decode_step" in e.name]
    modules.sort()
    kernels = [e for e in events if not e.name.startswith("Memcpy") and not e.name.startswith("Memset")]
    lines = sorted({e.line for e in kernels})
    out_all = _union_us([(e.start_ns, e.start_ns + e.duration_ns) for e in kernels]) / max(num_steps, 1)
    per_line = {line: _union_us([(e.start_ns, e.start_ns + e.duration_ns) for e in kernels if e.line == line]) / max(num_steps, 1) for line in lines}
    out = dict(
        lines=lines, traced_steps=num_steps,
        decode_module_us=stats([(e - s) / 1e3 for s, e in modules]),
        busy_us_per_step_by_stream=per_line, busy_us_per_step=out_all,
        kernel_names=info.get("kernel_names", [])[:40],
    )  # fmt: skip
    for name in COPY_KERNELS:
        mine = [e for e in kernels if name in e.name]
        if not mine:
            continue
        by_line = {}
        covered = covered_any = 0.0
        for e in mine:
            by_line[e.line] = by_line.get(e.line, 0) + 1
            others = [(o.start_ns, o.start_ns + o.duration_ns) for o in kernels if o.line != e.line]
            covered += _covered_us(e.start_ns, e.start_ns + e.duration_ns, others)
            # Kernels of a CUDA graph may be reported on the stream that launched it: any
            # other kernel (not a copy) running meanwhile counts too.
            rest = [(o.start_ns, o.start_ns + o.duration_ns) for o in kernels if o is not e and not any(c in o.name for c in COPY_KERNELS)]
            covered_any += _covered_us(e.start_ns, e.start_ns + e.duration_ns, rest)
        total = sum(e.duration_ns for e in mine) / 1e3
        out[name] = dict(
            us_per_step=total / max(num_steps, 1), launches_per_step=len(mine) / max(num_steps, 1),
            streams=by_line, overlapped_by_other_streams_fraction=covered / total if total else None,
            overlapped_by_any_kernel_fraction=covered_any / total if total else None,
        )  # fmt: skip
    timeline = []
    if len(modules) < 2 and kernels:  # no module line: steps are the busy stretches between idle gaps
        ends = np.array([k.start_ns + k.duration_ns for k in kernels])
        cuts = [0] + [i + 1 for i in range(len(kernels) - 1) if kernels[i + 1].start_ns - np.max(ends[: i + 1]) > 300e3] + [len(kernels)]
        spans = [(kernels[a].start_ns, float(np.max(ends[a:b]))) for a, b in zip(cuts, cuts[1:])]
        modules = sorted(spans, key=lambda ab: ab[1] - ab[0])[-max(num_steps, 1):]
        modules.sort()
        out["step_spans_us"] = [round((b - a) / 1e3, 1) for a, b in modules]
    if modules:
        s, e = modules[len(modules) // 2]
        timeline = [
            dict(stream=k.line, kernel=k.name[:90], start_us=round((k.start_ns - s) / 1e3, 2), dur_us=round(k.duration_ns / 1e3, 2))
            for k in kernels if s <= k.start_ns < e
        ][:4000]  # fmt: skip
    return out, timeline


# ---- HLO summary ---------------------------------------------------------------------------------


def hlo_files() -> set[str]:
    return set(glob.glob(os.path.join(HLO_DIR, "*decode_step*after_optimizations.txt")))


_TRIVIAL_OPS = {"parameter", "constant", "get-tuple-element", "bitcast", "tuple", "opt-barrier"}


def async_schedule(text: str) -> list[dict]:
    """Per async-start of the scheduled HLO: its stream annotation, scheduling group, and how
    many instructions (and fusions / custom calls) the schedule puts between it and its done."""
    out, comp, lines = [], None, []
    blocks = []
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            comp, lines = line.split("(")[0].split()[-1], []
        elif line.startswith("}") and comp is not None:
            blocks.append((comp, lines))
            comp = None
        elif comp is not None and " = " in line:
            lines.append(line.strip().removeprefix("ROOT "))
    for comp, body in blocks:
        names = [b.split(" = ")[0] for b in body]
        ops = []
        for b in body:
            m = re.search(r"\s([a-z][a-z0-9\-]*)\(", b.split(" = ", 1)[1] if " = " in b else b)
            ops.append(m.group(1) if m else "?")
        for i, (name, op) in enumerate(zip(names, ops)):
            if op != "async-start":
                continue
            done = next((j for j in range(i + 1, len(body)) if ops[j] == "async-done" and f"({name})" in body[j].replace(" ", "")), None)
            if done is None:
                continue
            between = ops[i + 1 : done]
            attr = lambda key: (re.search(key + r'="([^"]*)"', body[i]) or [None, None])[1]  # noqa: E731
            out.append(dict(
                computation=comp, start=name, stream=attr("_xla_stream_annotation"), group=attr("_scheduling_group_id"),
                between=sum(o not in _TRIVIAL_OPS for o in between),
                kernels_between=sum(o in ("fusion", "custom-call", "call", "async-start", "while") for o in between),
            ))  # fmt: skip
    return out


def side_gather_schedule(text: str) -> list[dict]:
    """Per FFI side-stream gather (ffi_stream) in the scheduled HLO: how many instructions (and
    fusions / custom calls) run on XLA's stream between its start and its wait."""
    body = [line.strip() for line in text.splitlines() if " = " in line]
    marks = []  # (index, kind, tag)
    for i, line in enumerate(body):
        for kind in ("start", "wait"):
            if f'custom_call_target="hisparse_side_gather_{kind}"' in line:
                tag = re.search(r"tag\s*=\s*(\d+)", line)
                marks.append((i, kind, tag.group(1) if tag else "?"))
    out = []
    for i, kind, tag in marks:
        if kind != "start":
            continue
        j = next((j for j, k, t in marks if k == "wait" and t == tag and j > i), None)
        if j is None:
            continue
        ops = [(re.search(r"\s([a-z][a-z0-9\-]*)\(", b.split(" = ", 1)[1]) or [None, "?"])[1] for b in body[i + 1 : j]]
        out.append(dict(tag=tag, between=sum(o not in _TRIVIAL_OPS for o in ops),
                        kernels_between=sum(o in ("fusion", "custom-call", "call", "async-start", "while") for o in ops)))  # fmt: skip
    return out


def hlo_summary(path: str, cache) -> dict:
    """What the optimised decode HLO holds: async stream ops, copies of the pool / buffer."""
    text = open(path).read()
    out = dict(file=os.path.basename(path))
    out["call_start"] = text.count("call-start(")
    out["async_start"] = text.count("async-start(")
    out["stream_annotated_lines"] = sum("_xla_stream_annotation" in line for line in text.splitlines())
    out["operation_queue_id_nonzero"] = sum('"operation_queue_id":"1"' in line or "operation_queue_id\":1" in line for line in text.splitlines())
    out["scheduling_group_lines"] = sum("_scheduling_group_id" in line for line in text.splitlines())
    try:
        out["side_gather_schedule"] = side_gather_schedule(text)
    except Exception as error:
        out["side_gather_schedule"] = repr(error)
    try:
        out["async_schedule"] = async_schedule(text)
    except Exception as error:  # the summary stands without it
        out["async_schedule"] = repr(error)
    kv = cache.kv
    for name in ("host_pool", "device_buffer", "kv"):
        array = getattr(kv, name, None)
        if array is None:
            continue
        shape = f"{jnp.dtype(array.dtype).name.replace('float', 'f')}[{','.join(map(str, array.shape))}]"
        out[f"copies_of_{name}"] = len(memory.hlo_copy_lines(text, shape))
    return out


# ---- phases --------------------------------------------------------------------------------------


class StepProbe:
    """Wraps runner.greedy_step (the engine's decode step): starts / stops a profiler trace
    around chosen steps."""

    def __init__(self, runner, trace_dir, trace_from, trace_steps):
        self.runner, self.trace_dir = runner, trace_dir
        self.trace_from, self.trace_to = trace_from, trace_from + trace_steps
        self.count, self.tracing = 0, False
        self._orig = runner.greedy_step
        runner.greedy_step = self._decode

    def _decode(self, cache, tokens, positions, topk=None, feed=None):
        if self.trace_dir is not None and self.count == self.trace_from:
            jax.profiler.start_trace(self.trace_dir)
            self.tracing = True
        out = self._orig(cache, tokens, positions, topk, feed)
        self.count += 1
        if self.tracing and self.count == self.trace_to:
            jax.block_until_ready(out)
            jax.profiler.stop_trace()
            self.tracing = False
        return out

    def close(self):
        if self.tracing:
            jax.profiler.stop_trace()
        del self.runner.greedy_step


def plot_timeline(timeline: list, path: str, title: str) -> None:
    """One traced step's kernels as bars per CUDA stream, the copy kernels in orange."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = sorted({k["stream"] for k in timeline}, key=lambda name: -sum(k["dur_us"] for k in timeline if k["stream"] == name))
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(streams)))
    for row, stream in enumerate(streams):
        mine = [k for k in timeline if k["stream"] == stream]
        for copy in (False, True):
            bars = [(k["start_us"] / 1e3, max(k["dur_us"], 1.0) / 1e3) for k in mine if any(c in k["kernel"] for c in COPY_KERNELS) == copy]
            ax.broken_barh(bars, (row - 0.4, 0.8), color="tab:orange" if copy else "tab:blue", label=("copy kernels" if copy else "other kernels") if row == 0 else None)
    ax.set_yticks(range(len(streams)), [s.split("(")[0] for s in streams])
    ax.set_xlabel("ms into the step")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_phase(name, engine: Engine, prompt) -> dict:
    t = time.perf_counter()
    before = hlo_files()
    engine.warmup([Request(0, prompt, 2)])
    warm_s = time.perf_counter() - t
    trace_dir = os.path.join(TRACE_ROOT, name) if ARGS.trace_steps else None
    probe = StepProbe(engine.runner, trace_dir, ARGS.warm_steps, ARGS.trace_steps)
    requests = [Request(i, prompt, ARGS.warm_steps + ARGS.steps + 1) for i in range(ARGS.slots)]
    try:
        t = time.perf_counter()
        result = engine.run(requests, max_concurrency=ARGS.slots)
        run_s = time.perf_counter() - t
    finally:
        probe.close()
    timed = [s for s in result.steps[ARGS.warm_steps:] if s.running == ARGS.slots]
    phase = dict(
        warmup_s=warm_s, run_s=run_s, running=ARGS.slots,
        itl_ms=stats([s.step_s * 1e3 for s in timed]),
        itl_ms_all=[round(s.step_s * 1e3, 3) for s in result.steps],
        misses_per_step=[s.misses for s in result.steps],
        miss_rate=sum(s.misses for s in timed) / max(1, sum(s.hits + s.misses for s in timed)),
        measured_topk_overlap=result.summary.get("measured_topk_overlap"),
        tokens={str(i): [int(x) for x in result.tokens[i]] for i in sorted(result.tokens)[:16]},
        new_hlo=sorted(os.path.basename(p) for p in hlo_files() - before),
    )  # fmt: skip
    if trace_dir is not None:
        try:
            phase["trace"], timeline = trace_summary(trace_dir, ARGS.trace_steps)
            if "stream" in name and timeline:
                with open(os.path.join(ARGS.out, f"timeline_{name}.json"), "w") as f:
                    json.dump(timeline, f)
                try:
                    itl = phase["itl_ms"].get("p50", float("nan"))
                    plot_timeline(timeline, os.path.join(ARGS.out, f"timeline_{name}.png"), f"{name}: one decode step's kernels per stream (ITL p50 {itl:.2f} ms)")
                except Exception as error:  # the JSON holds the timeline
                    log(f"timeline plot skipped: {error!r}")
        except Exception as error:  # the timings stand without it
            phase["trace"] = dict(error=repr(error), trace=traceback.format_exc()[-2000:])
    new = sorted(hlo_files() - before)
    if new:
        phase["hlo"] = hlo_summary(new[-1], engine.cache)
        if name in ("stream", "ffi_stream"):
            with open(new[-1], "rb") as src, gzip.open(os.path.join(ARGS.out, f"hlo_{name}.txt.gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
    trace = phase.get("trace", {})
    log(f"{name}: ITL p50 {phase['itl_ms'].get('p50', float('nan')):.3f} ms, device module p50"
        f" {trace.get('decode_module_us', {}).get('p50', float('nan')):.1f} us, miss rate {phase['miss_rate']:.3f},"
        f" copies {[(k, round(trace[k]['us_per_step'], 1), trace[k]['overlapped_by_other_streams_fraction']) for k in COPY_KERNELS if k in trace]},"
        f" hlo {phase.get('hlo')}")  # fmt: skip
    return phase


def tiny_check() -> dict:
    """tiny_glm with the real kernels: HiSparse with the side-stream prefetch vs no offload, NaN
    in every unwritten row (a stray read or a missed backup shows as NaN)."""
    config = DSAModelConfig.tiny_glm()
    model = DSAForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(1).integers(0, config.vocab_size, (2, 33)).astype(np.int32)
    out = {}
    base = generate(ModelRunner(model), prompts, 8, fill_value=np.nan)
    for phase in [m.strip() for m in ARGS.tiny_modes.split(",") if m.strip()]:
        mode, _, options = phase_setup(phase)
        got = generate(runner_for(model, mode, True, "auto", compiler_options=options), prompts, 8,
                       hisparse=HiSparseConfig(top_k=8, device_buffer_size=10), page_size=8, fill_value=np.nan)  # fmt: skip
        out[phase] = dict(
            finite=bool(np.isfinite(got.logits).all()), tokens_equal=bool(np.array_equal(got.tokens, base.tokens)),
            logits_bit_equal=bool(np.array_equal(got.logits, base.logits)),
            logits_max_abs_diff=float(np.abs(got.logits - base.logits).max()), misses=int(got.num_misses.sum()),
        )  # fmt: skip
    log("tiny_check:", out)
    return out


def derived(phases: dict) -> dict:
    """The hidden fractions, from ITL and from device module time."""
    out = {}
    for key, get in (("itl", lambda p: p["itl_ms"].get("p50")), ("device_busy", lambda p: p.get("trace", {}).get("busy_us_per_step"))):
        vals = {n: get(p) for n, p in phases.items() if "itl_ms" in p}
        if "baseline" in vals and "off" in vals and vals["baseline"] and vals["off"]:
            overhead = vals["off"] - vals["baseline"]
            out[f"{key}_values"] = vals
            out[f"{key}_hisparse_overhead"] = overhead
            for mode in vals:
                if mode not in ("baseline", "off") and vals.get(mode):
                    out[f"{key}_hidden_fraction_{mode}"] = (vals["off"] - vals[mode]) / overhead if overhead else None
    return out


def token_agreement(phases: dict) -> dict:
    """Per phase, requests whose tokens equal the "off" phase's (same SYNTHETIC selection)."""
    ref = phases.get("off", {}).get("tokens")
    if not ref:
        return {}
    return {n: sum(p["tokens"].get(r) == t for r, t in ref.items()) for n, p in phases.items() if "tokens" in p}


def main():
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    RESULTS["jax"] = jax.__version__
    log(f"jax {jax.__version__} on {jax.devices()}; XLA_FLAGS={os.environ['XLA_FLAGS']}")
    phases = [p.strip() for p in ARGS.phases.split(",") if p.strip()]
    if "tiny_check" in phases:
        try:
            RESULTS["tiny_check"] = tiny_check()
        except Exception as error:
            RESULTS["errors"].append(dict(phase="tiny_check", error=repr(error), trace=traceback.format_exc()[-3000:]))
            log(f"tiny_check failed: {error!r}")
        save()
    config = model_config()
    if ARGS.smoke:
        hisparse = HiSparseConfig(top_k=config.index_topk, device_buffer_size=2 * config.index_topk, host_to_device_ratio=8)
        context, slots = 128, min(ARGS.slots, 4)
        ARGS.slots = slots
    else:
        hisparse = HiSparseConfig(top_k=2048, device_buffer_size=4096, host_to_device_ratio=8)
        context = ARGS.context
    page_size = 64
    prompt = np.zeros(context - ARGS.warm_steps - ARGS.steps - 2, np.int32)
    t = time.perf_counter()
    model = DSAForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    log(f"model: {config.num_layers} layers {config.indexer_types}, hidden {config.hidden_size}, built in {time.perf_counter() - t:.1f}s")
    RESULTS["default_shared_prefetch"] = ModelRunner(model).shared_prefetch  # what a runner picks unless told
    RESULTS["setup"] = dict(
        layers=config.num_layers, indexer_types=config.indexer_types, hidden=config.hidden_size, heads=config.num_heads,
        experts=config.n_routed_experts, top_k=config.index_topk, context=context, slots=ARGS.slots,
        hisparse=json.loads(hisparse.to_json()), kv_cache_dtype=ARGS.kv_cache_dtype, selection=f"SYNTHETIC overlap {ARGS.overlap}",
        contexts="SYNTHETIC", weights="random",
    )  # fmt: skip
    save()
    pages = ARGS.slots * -(-context // page_size) + 8  # every request's whole context, host side
    engines = {}
    longest = 0.0
    for name in phases:
        if name == "tiny_check":
            continue
        if time.perf_counter() - T0 + 1.2 * longest > ARGS.time_budget_s:
            log(f"skip {name}: time budget")
            RESULTS["phases"][name] = dict(skipped=True)
            save()
            continue
        start = time.perf_counter()
        try:
            mode, defer, options = phase_setup(name)
            runner = runner_for(model, mode, defer, ARGS.kv_cache_dtype, compiler_options=options)
            kind = "baseline" if name.split("_run")[0] == "baseline" else "hisparse"
            if kind not in engines:
                engines.clear()  # one engine's memory at a time
                engines[kind] = Engine(runner, EngineConfig(
                    max_running_requests=ARGS.slots, context_length=context, hisparse=None if kind == "baseline" else hisparse,
                    page_size=page_size, num_host_pages=pages if kind == "hisparse" else None, synthetic_context=True,
                    synthetic_topk_overlap=ARGS.overlap, seed=0, batch_buckets=False,
                ))  # fmt: skip
            engine = engines[kind]
            engine.runner = runner
            RESULTS["phases"][name] = run_phase(name, engine, prompt)
        except Exception as error:
            RESULTS["errors"].append(dict(phase=name, error=repr(error), trace=traceback.format_exc()[-3000:]))
            log(f"{name} failed: {error!r}")
        longest = max(longest, time.perf_counter() - start)
        RESULTS["derived"] = derived(RESULTS["phases"])
        RESULTS["token_agreement_with_off"] = token_agreement(RESULTS["phases"])
        save()
    log("derived:", json.dumps(RESULTS.get("derived"), default=str))
    log("tokens equal to 'off' (requests):", RESULTS.get("token_agreement_with_off"))
    log("wrote", os.path.join(ARGS.out, "bench_overlap.json"))


if __name__ == "__main__":
    main()
