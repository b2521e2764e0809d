"""MTP speculative decoding on the H200 (issue 24): decode throughput with the MTP layer's drafts
vs without, at c = 1 and at capacity, with the acceptance length, and the machinery's ceiling
(drafts that copy the target's own next tokens, so every draft is accepted).

    OUT=/tmp/out bash benchmarks/mtp_h200.sh                                  # H200, one device call (~6-8 min)
    python benchmarks/bench_mtp.py --output_dir=$OUT --time_budget_s=430      # the same, without the wrapper
    python benchmarks/bench_mtp.py --smoke --output_dir=/tmp/bench_mtp        # CPU, tiny sizes (~2 min)

Model: the serving benchmark's (benchmarks/helpers.bench_model_config: DeepSeek-V3.2's attention
and MoE shapes, --num_layers 4, --num_experts 16) with one MTP layer (num_nextn_predict_layers=1),
RANDOM bf16 weights built on the device; fp8_e4m3 KV (656 B rows, fp8 indexer keys). KV: HiSparse
(top_k = index_topk 2048, device_buffer_size 4096), then the full-KV baseline (--kv_modes).
Contexts: SYNTHETIC, --context tokens of random KV rows and indexer keys per request (the MTP
layer's too), written straight into the cache by serving.synthetic_fill (no prefill; its draws do
not depend on the layer count, so the plain and the speculative caches hold the same contexts).

Per KV mode and running count b (--running: 1 and "capacity" = the requests of --context tokens
that bench_serving's device KV budget, --kv_budget_gb_per_layer (0.62) x num_layers, holds with
the speculative footprint: MTP layer's KV and speculative slots counted; ~70 with HiSparse, ~19
for the baseline at 32k; --capacity overrides), three modes, each from freshly filled slots and
the same first tokens, driving the ModelRunners directly (the engine refuses synthetic contexts
with speculation):
  no_mtp          a plain runner's greedy_step on a cache without the MTP layer: one token per
                  request and step (Q x S steps are run: their tokens are what mtp_copy_draft copies);
  mtp             speculative_greedy_step, SpeculativeConfig(num_steps=--num_steps): the MTP layer
                  drafts num_steps tokens (EAGLE chain, topk 1), the target verifies num_steps + 1
                  per request in one forward; random weights accept little. No prefill, so the
                  first step's d_1 is token 0 (a warm step);
  mtp_copy_draft  speculative_step with draft_override = no_mtp's tokens by position: every draft
                  accepted, the machinery's ceiling. In bf16 a 4-token verify can round a near tie
                  the other way from a 1-token step; from there the copied tokens are another
                  path's and drafts are rejected, so the run is repeated copying its own emitted
                  tokens (--copy_passes; checks say how many and what each accepted).
Each mode runs --warm_steps untimed steps (the first compiles and demand-loads) then --steps timed
ones (no_mtp: all its Q x S - warm steps). Every step is timed on the host from dispatch to its
tokens and acceptance read back (the engine's speculative loop waits for them each step; no_mtp
is read back the same way: no overlap schedule in any mode). Per row: ms per step (mean, p50,
p90), tokens/s = tokens emitted (sum over requests of accepted + 1) / the timed steps' time,
tokens_per_s_all_accepted = b x Q per step (a step's cost does not depend on what it accepts),
acceptance length = mean accepted + 1 (tokens per request and step), speedup vs no_mtp at the
same KV mode and b, miss rate (HiSparse; the speculative modes count the MTP layer's lookups
too), first_step_ms (compile + demand-load).

Checks (JSON "checks", recorded, never a crash: the GPU step is not bit-deterministic run to run,
and bf16 rounds a 4-token verify differently from a 1-token step): mtp_copy_draft accepted
num_steps at every step, its emitted tokens (first pass) and mtp's equal no_mtp's. --smoke runs
float32 (--dtype), where all of them hold exactly, at capacity 2 only (one compile set per KV mode).

--profile_steps N traces N steps of no_mtp and of mtp at the first running count and splits them
(benchmarks/step_split.py: attention, indexer, MoE, dense GEMMs, swap-in, other, host idle; the
speculative step also by phase, from the mtp_draft / mtp_verify / mtp_commit / mtp_extend scopes,
found through XLA's HLO dump, which the script turns on and deletes): JSON "step_split".

Writes $OUT/bench_mtp.json after every point (device, jax version, config, rows, checks, errors)
and mtp_throughput.png, accepted_per_step.png (skipped without matplotlib).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import textwrap
import time

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
from benchmarks.helpers import T0, attempt, bench_model_config, log, write_json  # noqa: E402
from configs.speculative import SpeculativeConfig  # noqa: E402
from hisparse_jax.config import HiSparseConfig  # noqa: E402
from hisparse_jax.host_pages import HostPageAllocator  # noqa: E402
from hisparse_jax.kv_cache_ops import end_request  # noqa: E402
from hisparse_jax.state import state_shardings  # noqa: E402
from models.common.runner import TokenFeed  # noqa: E402
from models.dsa.model import DSAForCausalLM  # noqa: E402
from models.dsa.runner import ModelRunner  # noqa: E402
from serving.synthetic_fill import SyntheticFill  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", os.environ.get("OUT", "outputs/bench_mtp"), "Where bench_mtp.json and the plots go.")
flags.DEFINE_bool("smoke", False, "Tiny model (DSAModelConfig.tiny + an MTP layer) and context, to try the script on a CPU.")
flags.DEFINE_integer("context", 32768, "Tokens of SYNTHETIC context per request before the first step.")
flags.DEFINE_list("running", ["1", "capacity"], "Running requests per point; 'capacity': see --capacity.")
flags.DEFINE_integer("capacity", 0, "Requests at capacity; 0: what the KV budget holds (DeviceFootprint, per KV mode).")
flags.DEFINE_float("kv_budget_gb_per_layer", 0.62, "Device KV budget per model layer, bench_serving's (its KV_BUDGET_NOTE).")
flags.DEFINE_list("kv_modes", ["hisparse", "baseline"], "KV modes, in this order: hisparse (offload), baseline (full KV).")
flags.DEFINE_integer("num_steps", 3, "Draft steps per verification (SGLang's --speculative_num_steps; topk 1).")
flags.DEFINE_integer("num_layers", 4, "Model layers (the first dense, the rest MoE), plus the MTP layer.")
flags.DEFINE_integer("num_experts", 16, "Routed experts per MoE layer.")
flags.DEFINE_enum("weights_dtype", "bfloat16", ["bfloat16", "fp8_e4m3"], "Random weights: bf16, or block FP8 (128 x 128).")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "Params and activations; default bfloat16 (--smoke: float32, so the checks are exact).")
flags.DEFINE_integer("warm_steps", 3, "Untimed steps per mode (the first compiles and demand-loads the buffer).")
flags.DEFINE_integer("steps", 10, "Timed speculative steps per mode.")
flags.DEFINE_integer("copy_passes", 8, "Most runs of the copying draft (each copies the last one's tokens: see copy_draft).")
flags.DEFINE_integer("page_size", 64, "Tokens per host page (HiSparse).")
flags.DEFINE_float("time_budget_s", 430.0, "Skip points and modes that would start past this many seconds.")
flags.DEFINE_integer("seed", 0, "Weights, first tokens and synthetic contexts.")
flags.DEFINE_string("replot", None, "Only redraw the plots of this bench_mtp.json into --output_dir (no JAX work).")
flags.DEFINE_integer("profile_steps", 0, "Trace this many steps (after the warm ones) of no_mtp and mtp at the first running count,"
                     " split per step by benchmarks/step_split.py (0: off).")

MODES = ("no_mtp", "mtp", "mtp_copy_draft")
RESULTS: dict = {"device": None, "jax": jax.__version__, "config": {}, "rows": [], "checks": {}, "errors": []}


class StepProfile:
    """A profiler trace over steps warm .. warm + n - 1 of one run (the first of each (KV mode, mode)),
    summarised by step_split into RESULTS["step_split"]. Steps here are synchronous (each reads
    its tokens back), so the trace window is those steps' wall time."""

    def __init__(self, label: str, mode: str, b: int):
        self.on = FLAGS.profile_steps > 0 and mode != "mtp_copy_draft" and (label, mode) not in PROFILED
        self.label, self.mode, self.b = label, mode, b
        self.dir = os.path.join(FLAGS.output_dir, f"trace_{label.split()[0]}_{mode}")
        self.started = None

    def before(self, k: int) -> None:
        if self.on and k == FLAGS.warm_steps:
            jax.profiler.start_trace(self.dir)
            self.started = time.perf_counter()

    def after(self, k: int) -> None:
        if self.on and self.started is not None and k == FLAGS.warm_steps + FLAGS.profile_steps - 1:
            window_ms = (time.perf_counter() - self.started) * 1e3
            jax.profiler.stop_trace()
            PROFILED.add((self.label, self.mode))  # the first running count only
            op_names = step_split.hlo_op_names(hlo_dump_dir())  # the step's fusions -> their scopes (and phases)
            split = step_split.summarize(self.dir, FLAGS.profile_steps, window_ms, op_names)
            entry = dict(kv=self.label, mode=self.mode, running=self.b, **split)
            RESULTS.setdefault("step_split", []).append(entry)
            cats = entry.get("categories_ms", {})
            log(f"  step split {self.label} {self.mode} running={self.b}: " + ", ".join(f"{c} {v:.2f}" for c, v in cats.items()) + " ms/step")
            self.started = None


PROFILED: set = set()


def hlo_dump_dir() -> str:
    return os.path.join(FLAGS.output_dir, "hlo_dump")


def save():
    write_json(os.path.join(FLAGS.output_dir, "bench_mtp.json"), RESULTS)


def over_budget() -> bool:
    return time.perf_counter() - T0 > FLAGS.time_budget_s


def step_stats(seconds) -> dict:
    ms = np.asarray(seconds, float) * 1e3
    if ms.size == 0:
        return {}
    return dict(mean=float(ms.mean()), p50=float(np.percentile(ms, 50)), p90=float(np.percentile(ms, 90)), n=int(ms.size))


class Slots:
    """One runner's cache of R slots (max_context tokens each) and what refills its first b
    with the same SYNTHETIC contexts every time (the fill's key is per slot)."""

    def __init__(self, runner: ModelRunner, hisparse: HiSparseConfig | None, R: int, max_context: int, context: int):
        self.runner, self.context = runner, context
        pages_per_request = -(-max_context // FLAGS.page_size)
        self.cache = runner.create_cache(
            num_requests=R, max_context=max_context, hisparse=hisparse, page_size=FLAGS.page_size,
            num_host_pages=None if hisparse is None else R * pages_per_request,
        )  # fmt: skip
        self.pages = [None] * R  # per slot: i32[P] its host page-table row (HiSparse)
        if hisparse is not None:  # slot s owns pages s x P' .. (s + 1) x P' - 1, for the whole run
            P = self.cache.kv.host_page_table.shape[1]
            self.pages = [HostPageAllocator.page_table_row(list(range(s * pages_per_request, (s + 1) * pages_per_request)), P)
                          for s in range(R)]  # fmt: skip
        # serving.synthetic_fill: the same model-layer contexts in the plain cache (no_mtp) and the
        # speculative one (+ the MTP layer's KV and key row), so all three modes decode the same tokens
        self._fill = SyntheticFill(self.cache, implementation=runner.implementation)
        self._end = jax.jit(end_request, donate_argnums=0, out_shardings=state_shardings(self.cache.kv))
        self.filled = set()  # slots holding a request now

    def refill(self, b: int) -> None:
        """Slots 0 .. b - 1 hold fresh contexts of `context` tokens (those of any earlier fill)."""
        cache = self.cache
        for s in range(b):
            if s in self.filled:
                cache = dataclasses.replace(cache, kv=self._end(cache.kv, jnp.int32(s)))
            pages = None if self.pages[s] is None else jnp.asarray(self.pages[s])
            key = jax.random.fold_in(jax.random.key(FLAGS.seed), s)
            cache = self._fill(cache, jnp.int32(s), jnp.int32(self.context), pages, key)
            self.filled.add(s)
        self.cache = jax.block_until_ready(cache)


@dataclasses.dataclass
class KVSetup:
    """One KV mode's caches: the plain runner's (no_mtp) and the speculative runner's (mtp modes)."""

    name: str
    capacity: int
    plain: Slots
    speculative: Slots


class Bench:
    def __init__(self):
        config = bench_model_config(smoke=FLAGS.smoke, num_layers=FLAGS.num_layers, num_experts=FLAGS.num_experts)
        block = (16, 16) if FLAGS.smoke else (128, 128)
        config = config.replace(num_nextn_predict_layers=1, weight_block_size=block if FLAGS.weights_dtype == "fp8_e4m3" else None)
        self.config = config
        self.dtype = FLAGS.dtype or ("float32" if FLAGS.smoke else "bfloat16")
        self.spec = SpeculativeConfig(num_steps=FLAGS.num_steps)
        self.Q = self.spec.tokens_per_step  # tokens verified per request and step
        self.S = FLAGS.warm_steps + FLAGS.steps  # speculative steps per mode
        self.context = 200 if FLAGS.smoke else FLAGS.context  # T: stored tokens before the first step
        # Every mode's writes fit: no_mtp runs Q x S steps, a speculative step writes up to c + N.
        self.max_context = self.context + self.Q * (self.S + 2)
        t = time.perf_counter()
        model = DSAForCausalLM(config, dtype=jnp.dtype(self.dtype), rngs=nnx.Rngs(FLAGS.seed))
        jax.block_until_ready(nnx.state(model))
        log(f"model: {config.num_layers} layers + 1 MTP, {config.num_heads} heads, hidden {config.hidden_size},"
            f" {config.n_routed_experts} experts, random {FLAGS.weights_dtype} weights ({self.dtype} activations) built in {time.perf_counter() - t:.1f}s")  # fmt: skip
        # Two runners on the same parameters: the plain one (no_mtp, its cache without the MTP
        # layer: a plain step refuses a cache with it) and the speculative one (mtp modes).
        self.plain_runner = ModelRunner(model, kv_cache_dtype="fp8_e4m3")
        self.runner = ModelRunner(model, kv_cache_dtype="fp8_e4m3", speculative=self.spec)
        self.budget = int(FLAGS.kv_budget_gb_per_layer * 1e9 * config.num_layers)
        rng = np.random.default_rng(FLAGS.seed)
        self.first_tokens = rng.integers(0, config.vocab_size, 4096).astype(np.int32)  # i32[4096]: x_T per slot
        RESULTS["config"] = dict(
            model=dict(base="deepseek_v32" if not FLAGS.smoke else "tiny", num_layers=config.num_layers, mtp_layers=1,
                       num_heads=config.num_heads, hidden_size=config.hidden_size, n_routed_experts=config.n_routed_experts,
                       vocab_size=config.vocab_size, index_topk=config.index_topk, weights=f"random, {FLAGS.weights_dtype}",
                       dtype=self.dtype),
            kv_cache_dtype="fp8_e4m3", speculative=dict(algorithm="EAGLE", num_steps=self.spec.num_steps, eagle_topk=1,
                                                         num_draft_tokens=self.Q),
            context=self.context, max_context=self.max_context,
            contexts="SYNTHETIC: random KV rows (the MTP layer's too) and indexer keys, no prefill (serving.synthetic_fill)",
            kv_budget=dict(bytes=self.budget, gb_per_layer=FLAGS.kv_budget_gb_per_layer,
                           counts="fp8 KV rows + indexer keys of the model's layers and the MTP layer, + speculative slots"),
            warm_steps=FLAGS.warm_steps, timed_steps=FLAGS.steps,
            timing="host wall time per step, dispatch to tokens read back (no overlap schedule in any mode)",
            flags={name: getattr(FLAGS, name) for name in KNOWN_FLAGS},
        )  # fmt: skip

    def hisparse_of(self, kv: str) -> HiSparseConfig | None:
        if kv == "baseline":
            return None
        top_k = self.config.index_topk
        return HiSparseConfig(top_k=top_k, device_buffer_size=2 * top_k) if FLAGS.smoke else HiSparseConfig(top_k=top_k)

    def capacity(self, hisparse) -> int:
        if FLAGS.capacity:
            return FLAGS.capacity
        if FLAGS.smoke:
            return 2
        return self.runner.device_footprint(hisparse).capacity(self.budget, self.max_context)

    def kv_setup(self, kv: str) -> KVSetup:
        hisparse = self.hisparse_of(kv)
        R = self.capacity(hisparse)
        if R < 1:
            raise ValueError(f"{kv}: the KV budget holds no request of {self.max_context} tokens")
        footprint = self.runner.device_footprint(hisparse)  # the speculative runner's: MTP layer + speculative slots
        RESULTS["config"].setdefault("kv_modes", {})[kv] = dict(
            capacity=R, capacity_rule="--capacity" if FLAGS.capacity else ("smoke" if FLAGS.smoke else
                                                                             "KV budget // speculative request bytes (every mode runs it)"),
            request_device_bytes=footprint.request_bytes(self.max_context), request_host_bytes=footprint.host_request_bytes(self.max_context),
            hisparse=None if hisparse is None else dict(top_k=hisparse.top_k, device_buffer_size=hisparse.device_buffer_size),
        )  # fmt: skip
        log(f"{kv}: capacity {R} requests of {self.max_context} tokens"
            f" ({footprint.request_bytes(self.max_context) / 1e6:.1f} MB device each, speculative)")  # fmt: skip
        plain = Slots(self.plain_runner, hisparse, R, self.max_context, self.context)
        return KVSetup(kv, R, plain, Slots(self.runner, hisparse, R, self.max_context, self.context))

    # ---- the three modes ----------------------------------------------------------------------------

    def run_greedy(self, setup: KVSetup, b: int, num_steps: int) -> dict:
        """no_mtp: `num_steps` greedy steps of slots 0 .. b - 1 from x_T at position T -> the
        per-step times, tokens i32[num_steps, b] (token k: the one at position T + 1 + k), counts."""
        slots = setup.plain
        slots.refill(b)
        runner, cache = slots.runner, slots.cache
        x0 = self.first_tokens[:b]  # i32[b]
        positions = np.full(b, self.context, np.int32)  # i32[b]
        src = np.arange(b, dtype=np.int32)  # i32[b]: after the first step, each slot's input is its last token
        times, tokens, hits, misses = [], [], 0, 0
        previous = None
        profile = StepProfile(setup.name, "no_mtp", b)
        for k in range(num_steps):
            feed = None if previous is None else TokenFeed(previous, src)  # the engine's device-side feed
            profile.before(k)
            t = time.perf_counter()
            cache, _, result = runner.greedy_step(cache, x0, positions, feed=feed)
            next_tokens, h, m = jax.device_get(result)  # i32[R], i32[], i32[]
            times.append(time.perf_counter() - t)
            profile.after(k)
            previous = result.next_tokens
            tokens.append(next_tokens[:b])
            positions = positions + 1
            if k >= FLAGS.warm_steps:
                hits, misses = hits + int(h), misses + int(m)
        slots.cache = cache
        return dict(times=times, tokens=np.stack(tokens), accepted=np.zeros((num_steps, b), np.int32), hits=hits, misses=misses)

    def run_speculative(self, setup: KVSetup, b: int, override) -> dict:
        """mtp (override None) or mtp_copy_draft (override i32[b, C], tokens by position): S
        speculative steps -> per-step times, accepted i32[S, b], the emitted tokens per request."""
        slots = setup.speculative
        slots.refill(b)
        runner, cache = slots.runner, slots.cache
        # x_T as bonus; no prefill, so no MTP proposal yet: the first step's d_1 is token 0 from g = 0
        carry = runner.empty_draft_state(b)._replace(bonus=jnp.asarray(self.first_tokens[:b]))
        committed = np.full(b, self.context, np.int32)  # i32[b]: c, tokens stored per request
        times, accepted, emitted, hits, misses = [], [], [[] for _ in range(b)], 0, 0
        profile = StepProfile(setup.name, "mtp" if override is None else "mtp_copy_draft", b)
        for k in range(self.S):
            profile.before(k)
            t = time.perf_counter()
            if override is None:
                cache, result, carry = runner.speculative_greedy_step(cache, carry, committed)
                tokens, acc, h, m = jax.device_get(result)  # i32[b, Q], i32[b], i32[], i32[]
            else:
                cache, out = runner.speculative_step(cache, carry, committed, override)
                carry = out.carry
                tokens, acc, h, m = jax.device_get((out.tokens, out.num_accepted, out.num_hits, out.num_misses))  # .., i32[L + 1, b] x 2
            times.append(time.perf_counter() - t)
            profile.after(k)
            h, m = np.sum(h), np.sum(m)  # as speculative_greedy_step sums them
            for r in range(b):
                emitted[r].extend(tokens[r, : acc[r] + 1].tolist())
            committed = committed + acc + 1
            accepted.append(acc)
            if k >= FLAGS.warm_steps:
                hits, misses = hits + int(h), misses + int(m)
        slots.cache = cache
        return dict(times=times, accepted=np.stack(accepted), emitted=emitted, hits=hits, misses=misses)

    def row(self, setup: KVSetup, mode: str, b: int, run: dict, timed_from: int) -> dict:
        times = np.asarray(run["times"][timed_from:])  # s per timed step
        accepted = run["accepted"][timed_from:]  # i32[steps, b]
        tokens = float((accepted + 1).sum())  # every running request emits accepted + 1 per step
        lookups = run["hits"] + run["misses"]
        # A step's shapes (and so its cost) do not depend on what it accepts: the same steps with
        # every draft accepted would emit Q tokens per request (the mtp modes' ceiling).
        ceiling = None if mode == "no_mtp" else accepted.size * self.Q / float(times.sum())
        return dict(
            mode=mode, kv=setup.name, running=b, context=self.context, step_ms=step_stats(times),
            tokens_per_s=tokens / float(times.sum()), acceptance_length=float(accepted.mean()) + 1.0,
            tokens_per_s_all_accepted=ceiling, miss_rate=run["misses"] / lookups if lookups else 0.0,
            first_step_ms=run.get("first_step_s", run["times"][0]) * 1e3,  # compile + demand-load
            accepted_per_step=run["accepted"].mean(axis=1).tolist(), speedup_vs_no_mtp=None,
        )  # fmt: skip

    def point(self, setup: KVSetup, b: int) -> None:
        label = f"{setup.name} running={b}"
        rows, checks = {}, RESULTS["checks"].setdefault(label, {})

        def add(mode, run, timed_from):
            row = self.row(setup, mode, b, run, timed_from)
            if "no_mtp" in rows:
                row["speedup_vs_no_mtp"] = row["tokens_per_s"] / rows["no_mtp"]["tokens_per_s"]
            rows[mode] = row
            RESULTS["rows"].append(row)
            save()
            s, ceiling = row["step_ms"], row["tokens_per_s_all_accepted"]
            log(f"  {label:22s} {mode:15s}: {s['mean']:8.2f} ms/step (p50 {s['p50']:.2f}, p90 {s['p90']:.2f}),"
                f" {row['tokens_per_s']:9.1f} tok/s, acceptance {row['acceptance_length']:.2f},"
                f"{'' if ceiling is None else f' ({ceiling:.0f} tok/s if all accepted),'}"
                f" x{row['speedup_vs_no_mtp'] or 1:.2f} vs no_mtp, first step {row['first_step_ms'] / 1e3:.1f}s")  # fmt: skip

        # no_mtp first: its tokens are the copying draft. Q x S steps cover every position a
        # copy-draft step reads (up to T + Q x S - 1).
        greedy = self.run_greedy(setup, b, self.Q * self.S)
        add("no_mtp", greedy, FLAGS.warm_steps)
        reference = greedy["tokens"].T  # i32[b, Q x S]: the token at position T + 1 + k
        sequence = np.zeros((b, self.max_context), np.int32)  # i32[b, C]: tokens by position
        sequence[:, self.context] = self.first_tokens[:b]
        sequence[:, self.context + 1 : self.context + 1 + reference.shape[1]] = reference

        def matches(emitted) -> dict:
            """Emitted tokens vs no_mtp's, per request: equal over the common length?"""
            mismatched = []
            for r, toks in enumerate(emitted):
                n = min(len(toks), reference.shape[1])
                diff = np.flatnonzero(np.asarray(toks[:n]) != reference[r, :n])
                if diff.size:
                    mismatched.append(dict(request=r, first_position=int(diff[0]), compared=n))
            return dict(equal=not mismatched, mismatched_requests=len(mismatched), first=mismatched[:4])

        def copy_draft():
            """Copying drafts, from no_mtp's tokens. In bf16 a 4-token verify can round a near tie
            the other way from a 1-token step, and from there no draft matches; then the next
            pass copies what this pass emitted (the speculative path's own greedy tokens), up
            to --copy_passes passes (each gets at least one more draft accepted where the last
            one first rejected). The last pass is the row."""
            fractions, lengths = [], []
            for p in range(FLAGS.copy_passes):
                run = self.run_speculative(setup, b, jnp.asarray(sequence))
                full = run["accepted"] == self.spec.num_steps  # bool[S, b]
                fractions.append(float(full.mean()))
                lengths.append(float(run["accepted"].mean()) + 1.0)
                if p == 0:
                    first_step_s = run["times"][0]
                    checks["copy_draft_tokens_equal_no_mtp"] = matches(run["emitted"])
                if full.all() or over_budget():
                    break
                for r, toks in enumerate(run["emitted"]):  # i32[len]: the tokens at T + 1 ..
                    sequence[r, self.context + 1 : self.context + 1 + len(toks)] = toks
            checks["copy_draft_all_accepted"] = bool(full.all())
            checks["copy_draft_passes"] = len(fractions)
            checks["copy_draft_accepted_fraction"] = fractions  # per pass: steps x requests that accepted every draft
            checks["copy_draft_acceptance_length"] = lengths  # per pass, warm steps included
            if not full.all():
                log(f"  WARNING {label}: the copying draft left drafts rejected after {len(fractions)} passes:"
                    f" all-accepted fraction {fractions}")  # fmt: skip
            return dict(run, first_step_s=first_step_s)

        for mode in ("mtp_copy_draft", "mtp"):
            if over_budget():
                RESULTS["errors"].append(f"{label} {mode}: skipped, over --time_budget_s")
                log(f"  {label} {mode}: skipped, over --time_budget_s")
                continue

            def one(mode=mode):
                run = copy_draft() if mode == "mtp_copy_draft" else self.run_speculative(setup, b, None)
                add(mode, run, FLAGS.warm_steps)
                if mode == "mtp":
                    checks["mtp_tokens_equal_no_mtp"] = matches(run["emitted"])
                save()

            attempt(RESULTS["errors"], f"{label} {mode}", one)


COLORS = {"no_mtp": "tab:blue", "mtp": "tab:orange", "mtp_copy_draft": "tab:green"}


def plot() -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plots (the JSON holds every figure)")
        return
    rows = RESULTS["rows"]
    if not rows:
        return
    config = RESULTS["config"]
    points = list(dict.fromkeys((r["kv"], r["running"]) for r in rows))  # (kv mode, b), in run order
    title = (f"MTP speculative decoding ({config['speculative']['num_steps']} steps, topk 1), bench model, random weights, fp8 KV,"
             f" SYNTHETIC {config['context']}-token contexts, {RESULTS['device']}")  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(points)), 4.2))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        xs, ys = [], []
        for j, p in enumerate(points):
            found = [r for r in rows if (r["kv"], r["running"]) == p and r["mode"] == mode]
            if found:
                xs.append(j + (i - 1) * width)
                ys.append(found[0]["tokens_per_s"])
        bars = ax.bar(xs, ys, width, label=mode, color=COLORS[mode])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(points)), [f"{kv}\nrunning={b}" for kv, b in points])
    ax.set_ylabel("tokens / s (emitted)")
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(FLAGS.output_dir, "mtp_throughput.png"), dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(points), figsize=(4 * len(points), 3.6), squeeze=False)
    num_steps, S = config["speculative"]["num_steps"], config["warm_steps"] + config["timed_steps"]
    for ax, p in zip(axes[0], points):
        for r in rows:
            if (r["kv"], r["running"]) == p:
                ys = np.asarray(r["accepted_per_step"])[:S]  # no_mtp runs Q x S steps, all accepting 0: its first S
                style = "--" if r["mode"] == "no_mtp" else ".-"  # dashed: mtp's zeros show through it
                ax.plot(np.arange(ys.size), ys, style, label=r["mode"], color=COLORS[r["mode"]])
        ax.axhline(num_steps, color="gray", ls="--", lw=0.8)
        ax.axvline(config["warm_steps"] - 0.5, color="gray", ls=":", lw=0.8)
        ax.set_ylim(-0.2, num_steps + 0.3)
        ax.set_title(f"{p[0]}, running={p[1]}", fontsize=9)
        ax.set_xlabel("step (left of the dotted line: warm)")
        ax.set_ylabel("accepted drafts per request (mean)")
        ax.legend(fontsize=7)
    fig.suptitle("\n".join(textwrap.wrap(title, 140)), fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(FLAGS.output_dir, "accepted_per_step.png"), dpi=120)
    plt.close(fig)


KNOWN_FLAGS = ("context", "running", "capacity", "kv_budget_gb_per_layer", "kv_modes", "num_steps", "num_layers", "num_experts",
               "weights_dtype", "dtype", "warm_steps", "copy_passes", "steps", "page_size", "time_budget_s", "seed", "smoke")  # fmt: skip


def main(argv):
    del argv
    if FLAGS.replot:  # e.g. here, from a GPU run's JSON (the device run keeps only its JSON)
        with open(FLAGS.replot) as f:
            RESULTS.update(json.load(f))
        os.makedirs(FLAGS.output_dir, exist_ok=True)
        plot()
        log("plots written to", FLAGS.output_dir)
        return
    if FLAGS.warm_steps < 1 or FLAGS.steps < 1:
        raise app.UsageError("--warm_steps and --steps must be >= 1 (the first step compiles)")
    if FLAGS.profile_steps > 0:  # the decode programs' HLO, so the profile's kernels find their scopes
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {step_split.dump_flags(hlo_dump_dir())}".strip()
    RESULTS["device"] = str(jax.devices()[0].device_kind)  # the backend starts here, with those flags
    log(f"jax {jax.__version__} on {jax.devices()}")
    bench = attempt(RESULTS["errors"], "build", Bench)
    save()
    if bench is None:
        return
    for kv in FLAGS.kv_modes:
        if over_budget():
            RESULTS["errors"].append(f"{kv}: skipped, over --time_budget_s")
            log(f"{kv}: skipped, over --time_budget_s")
            continue
        setup = attempt(RESULTS["errors"], f"{kv} cache", lambda kv=kv: bench.kv_setup(kv))
        if setup is None:
            continue
        running = FLAGS.running if FLAGS["running"].present or not FLAGS.smoke else ["capacity"]  # smoke: one compile set per KV mode
        sizes = list(dict.fromkeys(setup.capacity if r == "capacity" else min(int(r), setup.capacity) for r in running))
        for b in sizes:
            if over_budget():
                RESULTS["errors"].append(f"{kv} running={b}: skipped, over --time_budget_s")
                log(f"{kv} running={b}: skipped, over --time_budget_s")
                continue
            attempt(RESULTS["errors"], f"{kv} running={b}", lambda setup=setup, b=b: bench.point(setup, b))
            attempt(RESULTS["errors"], "plot", plot)
        setup.plain.cache = setup.speculative.cache = None  # the next mode's caches take their place
    save()
    attempt(RESULTS["errors"], "plot", plot)
    shutil.rmtree(hlo_dump_dir(), ignore_errors=True)  # read by the profiles; large
    log(f"done in {time.perf_counter() - T0:.0f}s; errors: {len(RESULTS['errors'])}")
    for r in RESULTS["rows"]:
        print(f"{r['kv']:>8} running={r['running']:>3} {r['mode']:>15}: {r['step_ms']['mean']:8.2f} ms/step"
              f" {r['tokens_per_s']:9.1f} tok/s acceptance {r['acceptance_length']:.2f} x{r['speedup_vs_no_mtp'] or 1:.2f}")  # fmt: skip
    for label, c in RESULTS["checks"].items():
        print(f"checks {label}: copy all accepted {c.get('copy_draft_all_accepted')},"
              f" copy tokens = no_mtp {c.get('copy_draft_tokens_equal_no_mtp', {}).get('equal')},"
              f" mtp tokens = no_mtp {c.get('mtp_tokens_equal_no_mtp', {}).get('equal')}")  # fmt: skip


if __name__ == "__main__":
    app.run(main)
