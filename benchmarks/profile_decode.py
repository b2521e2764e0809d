"""Where does a decode step's time go, with the model's selection vs the SYNTHETIC selector?

    python benchmarks/profile_decode.py --dump_hlo --out=$OUT      # H200 (one call, ~1.5 min)
    python benchmarks/profile_decode.py --smoke --out=/tmp/pd      # CPU, tiny sizes

The serving benchmark's setup (benchmarks/bench_serving.py: DeepSeek-V3.2-shaped attention,
RANDOM weights, SYNTHETIC 32k contexts written straight into the host pool, no prefill) at a
chosen size: --num_layers layers, --slots HiSparse request slots, --baseline_slots full-KV ones
(every slot running; no KV budget). Each phase of --plan (mode:selection) runs
--warm_steps + --steps decode steps through Engine.run, timing each step from the engine's
decode call (dispatch: until ModelRunner.greedy_step returns; total: until its outputs are
ready) and the synthetic selector alone, and records a jax.profiler trace of --trace_steps
steps, summarised as device time per kernel name (top 15). Waiting for each step's outputs
(total, logits) would stop the engine's overlap schedule (the next step dispatched while this one
runs), so with it on (the default) only dispatch times are taken; --disable_overlap_schedule
takes all three, one step at a time. It found the synthetic-selection
slowdown (1.9 s per step: XLA copied the whole pinned pool twice per step, see
HiSparseState.replay_swap_in; tests/test_models.py guards it). Phases with the same selection are
compared: tokens per request, and the first (step, request) whose sum of logits differs (on the
GPU the decode step is not bit-deterministic run to run, so equal configurations can differ).
With --dump_hlo the optimised HLO of every decode compile is summarised (instructions that
produce buffers of 64 MB or more: a copy of the pinned host pool shows as `copy ... HOST`).

Writes $OUT/profile_decode.json (rewritten after every phase), hlo_decode.tar.gz with --dump_hlo.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import io
import json
import os
import re
import shutil
import sys
import tarfile
import time
import traceback

PARSER = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
PARSER.add_argument("--out", default=os.environ.get("OUT", "outputs/profile_decode"))
PARSER.add_argument("--smoke", action="store_true", help="tiny model and context, CPU")
PARSER.add_argument("--num_layers", type=int, default=2)
PARSER.add_argument("--num_experts", type=int, default=16)
PARSER.add_argument("--slots", type=int, default=32, help="HiSparse request slots, all running")
PARSER.add_argument("--baseline_slots", type=int, default=8, help="0: no baseline runs")
PARSER.add_argument("--context", type=int, default=32768)
PARSER.add_argument("--overlap", type=float, default=0.9)
PARSER.add_argument("--warm_steps", type=int, default=2)
PARSER.add_argument("--steps", type=int, default=6)
PARSER.add_argument("--trace_steps", type=int, default=3, help="0: no profiler trace")
PARSER.add_argument("--dump_hlo", action="store_true", help="dump + summarise the optimised decode HLO")
PARSER.add_argument("--plan", default="hisparse:model,hisparse:synthetic,baseline:model,baseline:synthetic",
                    help="phases in order, mode:selection (mode: hisparse | baseline; selection: model | synthetic)")
PARSER.add_argument("--running", type=int, default=0, help="requests per phase (0: every slot), on their own batch bucket")
PARSER.add_argument("--kv_cache_dtype", default="auto", help="auto (bf16) | fp8_e4m3, as SGLang's --kv-cache-dtype")
PARSER.add_argument("--time_budget_s", type=float, default=420.0, help="skip phases past this")
PARSER.add_argument("--disable_overlap_schedule", action="store_true",
                    help="as SGLang's: read each step's tokens before dispatching the next (then total times and logits are taken)")
ARGS = PARSER.parse_args()

HLO_DIR = "/tmp/profile_decode_hlo"
TRACE_ROOT = "/tmp/profile_decode_traces"
for _stale in (HLO_DIR, TRACE_ROOT):  # this run's files only
    shutil.rmtree(_stale, ignore_errors=True)
if ARGS.dump_hlo:  # before JAX starts its backend
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_dump_to={HLO_DIR} --xla_dump_hlo_module_re=.*decode_step.* --xla_dump_hlo_as_text"
    )
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "100")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.helpers import bench_model_config, log, stats, write_json  # noqa: E402
from configs.model import DSAModelConfig  # noqa: E402
from hisparse_jax.config import HiSparseConfig, ResidencyConfig  # noqa: E402
from models.dsa.model import DSAForCausalLM  # noqa: E402
from models.dsa.runner import ModelRunner  # noqa: E402
from serving.engine import Engine, EngineConfig  # noqa: E402
from serving.workload import Request  # noqa: E402

T0 = time.perf_counter()
RESULTS: dict = {"args": vars(ARGS), "phases": [], "errors": []}
TOP = 15


def save():
    write_json(os.path.join(ARGS.out, "profile_decode.json"), RESULTS)


def model_config() -> DSAModelConfig:
    return bench_model_config(smoke=ARGS.smoke, num_layers=ARGS.num_layers, num_experts=ARGS.num_experts)


# ---- per-step timing ---------------------------------------------------------------------------


class StepProbe:
    """Wraps runner.greedy_step and the engine's selector: per decode step, the selector's time
    (to its result being ready), the decode dispatch time (until greedy_step returns) and, with
    the engine's overlap schedule off, the total (until its outputs are ready) and a few logit
    figures; starts/stops a profiler trace around chosen steps."""

    def __init__(self, engine: Engine, trace_dir: str | None, trace_from: int, trace_steps: int):
        self.engine, self.runner = engine, engine.runner
        self.trace_dir, self.trace_from, self.trace_to = trace_dir, trace_from, trace_from + trace_steps
        self.records: list[dict] = []
        self.logits: list[dict] = []  # per step: request id -> [position, sum of logits, top1 - top2]
        self.select_s: list[float] = []
        self.tracing = False
        self._orig_decode = self.runner.greedy_step
        self.runner.greedy_step = self._decode  # instance attribute shadows the method
        self.wait = not engine.config.overlap_schedule  # waiting per step would serialise the steps
        self._orig_select = None
        if engine.selector is not None:
            self._orig_select = engine.selector.select
            engine.selector.select = self._select

    def _select(self, positions, request_ids):
        t = time.perf_counter()
        out = jax.block_until_ready(self._orig_select(positions, request_ids))
        self.select_s.append((time.perf_counter() - t) * 1e3)
        return out

    def _decode(self, cache, tokens, positions, topk=None, feed=None):
        i = len(self.records)
        if self.trace_dir is not None and i == self.trace_from:
            jax.profiler.start_trace(self.trace_dir)
            self.tracing = True
        t0 = time.perf_counter()
        out = self._orig_decode(cache, tokens, positions, topk, feed)
        t1 = time.perf_counter()
        if not self.wait:
            self.records.append(dict(dispatch_ms=(t1 - t0) * 1e3))
            self._stop_trace_after(i, out)
            return out
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        self.records.append(dict(dispatch_ms=(t1 - t0) * 1e3, total_ms=(t2 - t0) * 1e3))
        logits = out[1].astype(jnp.float32)  # f32[b, V]; after the timing
        sums = np.asarray(jnp.sum(logits, axis=-1), np.float64)
        top2 = np.asarray(jax.lax.top_k(logits, 2)[0], np.float64)
        step = {}
        for slot in np.flatnonzero(np.asarray(positions) >= 0):
            rid = self.engine.scheduler.running_request(int(slot)).id
            step[str(rid)] = [int(positions[slot]), float(sums[slot]), float(top2[slot, 0] - top2[slot, 1])]
        self.logits.append(step)
        self._stop_trace_after(i, out)
        return out

    def _stop_trace_after(self, i: int, out) -> None:
        if self.tracing and i + 1 == self.trace_to:
            jax.block_until_ready(out)
            jax.profiler.stop_trace()
            self.tracing = False

    def close(self):
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
        del self.runner.greedy_step
        if self._orig_select is not None:
            del self.engine.selector.select


# ---- trace summary -----------------------------------------------------------------------------


def summarize_trace(trace_dir: str, num_steps: int) -> dict:
    """Device time per name (ms per step) from the .xplane.pb under trace_dir: kernels (stream
    lines), XLA ops, XLA modules of each GPU plane; the busiest host events too."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return dict(error=f"no .xplane.pb under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(sorted(paths)[-1])
    groups: dict[str, dict[str, list]] = {}
    lines_seen = []

    def add(group, name, ns):
        entry = groups.setdefault(group, {}).setdefault(name, [0, 0])
        entry[0] += ns
        entry[1] += 1

    for plane in data.planes:
        is_device = plane.name.startswith("/device:")
        for line in plane.lines:
            lines_seen.append(f"{plane.name} | {line.name}")
            if is_device:
                if line.name == "XLA Ops":
                    group = "device_xla_ops"
                elif line.name == "XLA Modules":
                    group = "device_xla_modules"
                elif line.name.startswith("Stream") or "stream" in line.name.lower():
                    group = "device_kernels"
                else:
                    group = f"device_other:{line.name}"
            elif plane.name.startswith("/host:"):
                group = "host"
            else:
                continue
            for event in line.events:
                add(group, event.name, event.duration_ns)
    out = dict(file=os.path.basename(sorted(paths)[-1]), traced_steps=num_steps, lines=sorted(set(lines_seen))[:60])
    for group, names in groups.items():
        total = sum(ns for ns, _ in names.values())
        top = sorted(names.items(), key=lambda kv: -kv[1][0])[:TOP]
        out[group] = dict(
            total_ms_per_step=total / 1e6 / max(num_steps, 1),
            top=[dict(name=name[:160], ms_per_step=ns / 1e6 / max(num_steps, 1), count=count) for name, (ns, count) in top],
        )
    return out


# ---- HLO summary -------------------------------------------------------------------------------

_DTYPE_BYTES = dict(pred=1, s8=1, u8=1, s16=2, u16=2, bf16=2, f16=2, s32=4, u32=4, f32=4, s64=8, u64=8, f64=8)
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\(")


def hlo_files() -> list[str]:
    return sorted(glob.glob(os.path.join(HLO_DIR, "*decode_step*after_optimizations.txt")))


def summarize_hlo(path: str, min_bytes: int) -> dict:
    """Instructions (outside fused computations' parameters) whose result holds an array of at
    least min_bytes: opcode, shape, whether it lives in host memory (S(5))."""
    big, opcodes = {}, {}
    computation = None
    with open(path) as f:
        for line in f:
            if line and not line[0].isspace() and "{" in line:
                computation = line.split()[0] if not line.startswith("ENTRY") else "ENTRY"
            m = _INSTR.match(line)
            if not m:
                continue
            shape, opcode = m.group(3), m.group(4)
            opcodes[opcode] = opcodes.get(opcode, 0) + 1
            if opcode in ("parameter", "get-tuple-element", "tuple", "bitcast", "constant"):
                continue
            for dtype, dims, layout in _ARRAY.findall(shape):
                n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
                nbytes = n * _DTYPE_BYTES.get(dtype, 4)
                if nbytes >= min_bytes:
                    host = "S(5)" in (layout or "")
                    key = f"{opcode} {dtype}[{dims}]{' HOST' if host else ''} in {'ENTRY' if computation == 'ENTRY' else 'sub'}"
                    entry = big.setdefault(key, dict(count=0, gb=nbytes / 1e9, example=m.group(2)))
                    entry["count"] += 1
    copies = {k: v for k, v in opcodes.items() if "copy" in k}
    return dict(file=os.path.basename(path), big_buffers=big, copy_opcodes=copies, instructions=sum(opcodes.values()))


# ---- phases ------------------------------------------------------------------------------------


def run_phase(name: str, engine: Engine, overlap, prompt, slots: int) -> dict:
    t = time.perf_counter()
    engine.use_selection(overlap)
    hlo_before = set(hlo_files())
    engine.warmup([Request(0, prompt, 2)])  # one decode compile for this selection
    warm_s = time.perf_counter() - t
    decode_fn = engine.runner._jitted(engine.cache)["decode"]
    trace_dir = None
    if ARGS.trace_steps > 0:
        trace_dir = os.path.join(TRACE_ROOT, name)
    probe = StepProbe(engine, trace_dir, ARGS.warm_steps, ARGS.trace_steps)
    running = min(slots, ARGS.running or slots)  # --running: fewer requests than slots (one batch bucket)
    requests = [Request(i, prompt, ARGS.warm_steps + ARGS.steps) for i in range(running)]
    try:
        t = time.perf_counter()
        result = engine.run(requests, max_concurrency=slots)
        run_s = time.perf_counter() - t
    finally:
        probe.close()
    steps = result.steps
    hits, misses = sum(s.hits for s in steps[ARGS.warm_steps:]), sum(s.misses for s in steps[ARGS.warm_steps:])
    timed = probe.records[ARGS.warm_steps:]
    phase = dict(
        name=name, mode=engine.config.mode, selection=engine.config.selection, slots=slots,
        warmup_s=warm_s, run_s=run_s,
        engine_step_ms=stats([s.step_s * 1e3 for s in steps[ARGS.warm_steps:]]),
        engine_step_ms_all=[round(s.step_s * 1e3, 2) for s in steps],
        decode_total_ms=stats([r["total_ms"] for r in timed if "total_ms" in r]),
        decode_dispatch_ms=stats([r["dispatch_ms"] for r in timed]),
        decode_all=[{k: round(v, 2) for k, v in r.items()} for r in probe.records],
        select_ms=stats(probe.select_s[ARGS.warm_steps:]),  # the selector, to its result ready
        miss_rate=misses / (hits + misses) if hits + misses else 0.0,
        misses_per_step=[s.misses for s in steps],
        running=[s.running for s in steps],
        decode_compiles=decode_fn._cache_size() if hasattr(decode_fn, "_cache_size") else None,
        measured_topk_overlap=result.summary.get("measured_topk_overlap"),
        new_hlo=[os.path.basename(p) for p in sorted(set(hlo_files()) - hlo_before)],
        tokens={str(i): [int(t) for t in result.tokens[i]] for i in sorted(result.tokens)},
        logits=probe.logits,
    )  # fmt: skip
    if trace_dir is not None:
        try:
            phase["trace"] = summarize_trace(trace_dir, min(ARGS.trace_steps, len(probe.records) - ARGS.warm_steps))
        except Exception as error:  # the timings stand without it
            phase["trace"] = dict(error=repr(error), trace=traceback.format_exc()[-2000:])
    log(f"{name}: step total {phase['decode_total_ms'].get('p50', float('nan')):.2f} ms p50"
        f" (dispatch {phase['decode_dispatch_ms'].get('p50', float('nan')):.2f} ms), engine step"
        f" {phase['engine_step_ms'].get('p50', float('nan')):.2f} ms, select {phase['select_ms'].get('p50', float('nan')):.2f} ms,"
        f" miss rate {phase['miss_rate']:.3f}, compiles {phase['decode_compiles']}")  # fmt: skip
    for group in ("device_kernels", "device_xla_ops"):
        top = phase.get("trace", {}).get(group)
        if top:
            log(f"  {group}: {top['total_ms_per_step']:.2f} ms/step; top:")
            for row in top["top"][:8]:
                log(f"    {row['ms_per_step']:9.3f} ms/step x{row['count']:<5d} {row['name'][:110]}")
    return phase


def token_checks(phases) -> list[dict]:
    """Per pair of phases with the same selection: requests (ids in both) whose tokens agree."""
    done = [p for p in phases if not p.get("skipped") and "tokens" in p]
    out = []
    for i, a in enumerate(done):
        for b in done[i + 1:]:
            if a["selection"] != b["selection"]:
                continue
            ids = sorted(set(a["tokens"]) & set(b["tokens"]), key=int)
            same = sum(a["tokens"][r] == b["tokens"][r] for r in ids)
            check = dict(a=a["name"], b=b["name"], compared_requests=len(ids), identical_requests=same)
            # Logits: the first (step, request) whose sum of logits differs at all, and how many do.
            differing, first = 0, None
            for step, (la, lb) in enumerate(zip(a.get("logits", []), b.get("logits", []))):
                for rid in sorted(set(la) & set(lb), key=int):
                    if la[rid] != lb[rid]:
                        differing += 1
                        if first is None:
                            first = dict(step=step, request=int(rid), a=la[rid], b=lb[rid])
            if not (a.get("logits") and b.get("logits")):  # the overlap schedule: none taken
                differing = None
            check.update(logit_rows_differing=differing, first_logit_difference=first)
            out.append(check)
    return out


def main():
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    RESULTS["jax"] = jax.__version__
    log(f"jax {jax.__version__} on {jax.devices()}")
    config = model_config()
    dtype = jnp.bfloat16
    if ARGS.smoke:
        hisparse = HiSparseConfig(top_k=config.index_topk, device_buffer_size=2 * config.index_topk, host_to_device_ratio=8)
        context, slots, baseline_slots = 256, min(ARGS.slots, 4), min(ARGS.baseline_slots, 2)
    else:
        hisparse = HiSparseConfig(top_k=2048, device_buffer_size=4096, host_to_device_ratio=8)
        context, slots, baseline_slots = ARGS.context, ARGS.slots, ARGS.baseline_slots
    prompt = np.zeros(context - ARGS.warm_steps - ARGS.steps, np.int32)
    t = time.perf_counter()
    model = DSAForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    runner = ModelRunner(model, kv_cache_dtype=ARGS.kv_cache_dtype)
    log(f"model ({config.num_layers} layers, hidden {config.hidden_size}) built in {time.perf_counter() - t:.1f}s")
    RESULTS["setup"] = dict(layers=config.num_layers, hidden=config.hidden_size, heads=config.num_heads, top_k=config.index_topk,
                            context=context, slots=slots, baseline_slots=baseline_slots,
                            hisparse=json.loads(hisparse.to_json()), contexts="SYNTHETIC", weights="random",
                            kv_cache_dtype=ARGS.kv_cache_dtype)  # fmt: skip
    save()

    # residency: HiSparse with dynamic_residency adaptive (requests resident while the pool has room)
    hisparse_of = dict(hisparse=hisparse, residency=dataclasses.replace(hisparse, dynamic_residency=ResidencyConfig()), baseline=None)

    def make_engine(mode, n):
        return Engine(runner, EngineConfig(max_running_requests=n, context_length=context,
                                           hisparse=hisparse_of[mode],
                                           page_size=64, synthetic_context=True, seed=0,
                                           overlap_schedule=not ARGS.disable_overlap_schedule,
                                           # one compile: all slots, or the --running bucket
                                           batch_buckets=(min(n, ARGS.running),) if ARGS.running else False))  # fmt: skip

    plan = []  # (mode, slots, overlap or None)
    for item in ARGS.plan.split(","):
        mode, selection = item.strip().split(":")
        n = baseline_slots if mode == "baseline" else slots
        if n <= 0:
            continue
        plan.append((mode, n, None if selection == "model" else ARGS.overlap))
    engines = {}
    longest = 0.0
    names = set()
    for mode, n, overlap in plan:
        name = f"{mode}_{'model' if overlap is None else f'synthetic{overlap:g}'}"
        while name in names:
            name += "_again"
        names.add(name)
        if time.perf_counter() - T0 + 1.2 * longest > ARGS.time_budget_s:
            log(f"skip {name}: time budget")
            RESULTS["phases"].append(dict(name=name, skipped=True))
            save()
            continue
        start = time.perf_counter()
        try:
            if (mode, n) not in engines:
                for other in list(engines):  # one engine at a time on the device
                    del engines[other]
                engines[mode, n] = make_engine(mode, n)
            RESULTS["phases"].append(run_phase(name, engines[mode, n], overlap, prompt, n))
        except Exception as error:
            RESULTS["errors"].append(dict(phase=name, error=repr(error), trace=traceback.format_exc()[-3000:]))
            log(f"{name} failed: {error!r}")
        longest = max(longest, time.perf_counter() - start)
        save()

    RESULTS["token_checks"] = token_checks(RESULTS["phases"])
    for check in RESULTS["token_checks"]:
        log(f"tokens {check['a']} vs {check['b']}: {check['identical_requests']}/{check['compared_requests']} requests identical;"
            f" logit rows differing {check['logit_rows_differing']}, first {check['first_logit_difference']}")
    if ARGS.dump_hlo:
        files = hlo_files()
        min_bytes = 1 << 20 if ARGS.smoke else 64 << 20
        RESULTS["hlo"] = [summarize_hlo(p, min_bytes) for p in files]
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for p in files:
                tar.add(p, arcname=os.path.basename(p))
        with open(os.path.join(ARGS.out, "hlo_decode.tar.gz"), "wb") as f:
            f.write(buf.getvalue())
        for h in RESULTS["hlo"]:
            log(f"HLO {h['file']}: copies {h['copy_opcodes']}")
            for key, v in h["big_buffers"].items():
                log(f"    {v['count']:3d} x {key} ({v['gb']:.3f} GB) e.g. {v['example']}")
    save()
    log("summary (decode total p50 ms / dispatch p50 ms / miss rate):")
    for p in RESULTS["phases"]:
        if not p.get("skipped"):
            log(f"  {p['name']:28s} {p['decode_total_ms'].get('p50', float('nan')):9.2f} {p['decode_dispatch_ms'].get('p50', float('nan')):9.2f}"
                f" {p['miss_rate']:.3f}")  # fmt: skip
    log("wrote", os.path.join(ARGS.out, "profile_decode.json"))


if __name__ == "__main__":
    main()
