"""Per-decode-step time split from a jax.profiler trace: where a step's milliseconds go.

    split = step_split.summarize(trace_dir, steps=4, window_ms=wall_ms_of_the_4_steps)
    split["categories_ms"]  # per step: attention, indexer, moe, dense_gemm, swap_in, other, host_idle
    split["top_kernels"]    # the 20 busiest kernels, ms per step, with the category each got

    with DecodeTrace(engine, trace_dir, warm=4, steps=4) as probe:   # trace steps 4..7 of a run
        engine.run(requests, max_concurrency=n)
    probe.window_ms                                                    # host wall time they took

Input: the .xplane.pb that jax.profiler writes under trace_dir (read with
benchmarks/device_timing.device_events, as the other benchmarks read GPU traces). Device events
are the kernels and memcpys of the device planes' stream lines. On a CPU there is no device
plane: the XLA thunks the CPU runtime records on host threads (events with an "hlo_op" stat)
stand in for them, so the split still runs there (mostly "other" / "dense_gemm").

Classification, first match wins (the rules are ordered; see `classify`):
  1. our Pallas kernels by their pallas_call `name=` (hisparse_sparse_mla_attention, ...);
  2. the HLO op's scope path, where the trace carries one (stats such as tf_op / long_name /
     hlo_op on the kernel, or on the "XLA Ops" line event of the same hlo_op): jax.named_scope
     names and source files (attention, indexer, moe, ...);
  3. generic kernel names: gemm / cutlass / nvjet / cublas -> dense_gemm, sort / topk -> indexer,
     memcpy host-to-device -> swap_in; everything else -> other.
host_idle = window - the union of device busy intervals (kernels overlapping on several streams
count once). The top kernels list is raw, so a wrong rule is visible in the JSON.
"""

from __future__ import annotations

import glob
import os
import re
import time
from typing import NamedTuple

import jax

from benchmarks.device_timing import Event, device_events

CATEGORIES = ("attention", "indexer", "moe", "dense_gemm", "swap_in", "other")
TOP_KERNELS = 20
TOP_HOST_EVENTS = 25

# 1. Our Pallas kernels (pallas_kernels/*/pallas_triton.py `name=`) and names that say it all.
KERNEL_RULES = [
    ("swap_in", r"hisparse_(swap_in_plan|copy_host_rows|prefetch_host_rows|write_rows_to_host)|side_stream_gather"),
    ("attention", r"hisparse_sparse_mla_attention|sparse_mla|flash_?att|fmha"),
    ("indexer", r"hisparse_indexer_(scores|topk)"),
    ("moe", r"hisparse_grouped_matmul|ragged_dot|ragged_all_to_all|grouped_gemm|\bgmm\b"),
]
# 2. The HLO op's scope path / source file (jax.named_scope names; models/dsa/*.py files).
SCOPE_RULES = [
    ("swap_in", r"swap_in|copy_host_rows|row_copy|host_pages|kv_cache_ops|paged_state"),
    ("indexer", r"indexer|index_scores|decode_topk|select_topk"),
    ("attention", r"attention|sparse_mla|/mla\b|mla\.py|attention_layer"),
    ("moe", r"\bmoe\b|/moe|moe\.py|expert|ragged_dot|grouped_matmul|router"),
]
# 3. Generic kernel names: cuBLAS / CUTLASS / XLA's Triton gemms, CUB sorts, copies.
GENERIC_RULES = [
    ("swap_in", r"memcpy\s*(h2d|htod)|memcpyhtod|host.?to.?device"),
    ("indexer", r"topk|top_k|radixsort|radix_sort|\bsort\b|sort\."),
    ("dense_gemm", r"gemm|xmma|cutlass|nvjet|cublas|matmul|\bdot\b|^dot|cudnn|wgmma|f8f8"),
]
_COMPILED = {key: [(c, re.compile(p, re.IGNORECASE)) for c, p in rules]
             for key, rules in (("kernel", KERNEL_RULES), ("scope", SCOPE_RULES), ("generic", GENERIC_RULES))}  # fmt: skip
# Stats whose values carry an op's name, scope path or HLO text.
SCOPE_STATS = ("hlo_op", "tf_op", "long_name", "name", "scope_range_id", "hlo_category", "source", "source_file", "op_name")


class Kernel(NamedTuple):
    event: Event  # start / duration / name / line (stream)
    scope: str  # what the trace says of its HLO op ("" when nothing)


def classify(name: str, scope: str = "") -> str:
    """The category of one kernel: Pallas names, then its scope path, then generic names."""
    for key, text in (("kernel", name), ("scope", scope), ("generic", name)):
        for category, pattern in _COMPILED[key]:
            if text and pattern.search(text):
                return category
    return "other"


def _stats(event) -> dict:
    """An xplane event's stats as {name: value}; {} where the binding gives none."""
    try:
        return {k: v for k, v in event.stats}
    except Exception:  # an odd stat type: the event is still timed, only not scoped
        return {}


def _scope_text(stats: dict) -> str:
    return " ".join(str(stats[k]) for k in SCOPE_STATS if k in stats and isinstance(stats[k], str))


def _xla_op_scopes(data) -> dict[str, str]:
    """hlo_op name -> the scope text of its "XLA Ops" line events (the op_name metadata xprof
    derives there), to scope kernels that only carry their hlo_op."""
    out: dict[str, str] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            for event in line.events:
                text = _scope_text(_stats(event))
                if text and event.name not in out:
                    out[event.name] = text
    return out


DUMP_MODULES = "greedy_decode_step|speculative_step"  # the decode programs whose HLO is dumped (XLA_FLAGS)
_HLO_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"")


def dump_flags(dump_dir: str) -> str:
    """XLA_FLAGS that dump the decode programs' optimised HLO as text into dump_dir (set before
    JAX starts its backend): what hlo_op_names reads."""
    return (f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
            f" --xla_dump_hlo_module_re=.*({DUMP_MODULES}).*")  # fmt: skip


def hlo_op_names(dump_dir: str) -> dict:
    """HLO instruction -> its op_name metadata (the jax.named_scope path), from the optimised HLO
    dumps under dump_dir: a trace's kernel names its hlo_op (a fusion, say) and its program_id
    (the dump file's module_NNNN), the dump says which scope that fusion came from. Keys:
    (program_id, name), and the bare name for a trace without program ids (the first dump's)."""
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))):
        module = re.match(r"module_(\d+)\.", os.path.basename(path))
        program_id = int(module.group(1)) if module else None
        with open(path, errors="replace") as f:
            for line in f:
                if match := _HLO_LINE.match(line):
                    name, op_name = match.groups()
                    out[program_id, name] = op_name
                    out.setdefault(name, op_name)
                    kernel = kernel_name(name)  # how the fusion's kernel is named in a trace
                    out.setdefault((program_id, kernel), op_name)
                    out.setdefault(kernel, op_name)
    return out


def kernel_name(hlo_name: str) -> str:
    """An HLO instruction's name as XLA names its kernel ("input_concatenate_fusion.241" ->
    "input_concatenate_fusion_241"): a trace names kernels inside a command buffer by the
    kernel, and their hlo_op stat by the command buffer."""
    return re.sub(r"[.\-]", "_", hlo_name)


def _op_name(op_names: dict, stats: dict, fallback: str = "") -> str:
    """The dumped op_name of the event with these stats (by program_id and hlo_op, else hlo_op)."""
    hlo_op = str(stats.get("hlo_op", fallback))
    try:
        program_id = int(stats["program_id"])
    except (KeyError, TypeError, ValueError):
        program_id = None
    return op_names.get((program_id, hlo_op)) or op_names.get(hlo_op, "")


def _plane_events(data, prefix: str):
    """(line, event, its stats) of every event on the planes whose name starts with `prefix`."""
    for plane in data.planes:
        if plane.name.startswith(prefix):
            for line in plane.lines:
                for event in line.events:
                    yield line, event, _stats(event)


def _kernel_scopes(data, op_names: dict) -> dict[tuple[float, str], tuple[str, str, object]]:
    """(start_ns, name) -> (hlo_op, scope text incl. the dumped op_name, program_id), for the
    device planes' events that carry stats."""
    out = {}
    for _, event, stats in _plane_events(data, "/device:"):
        if text := _scope_text(stats):
            out[event.start_ns, event.name] = (
                str(stats.get("hlo_op", "")), f"{text} {_op_name(op_names, stats)}".strip(), stats.get("program_id")
            )
    return out


def kernel_scope(name: str, hlo_op: str, own: str, program_id, op_names: dict, by_op: dict) -> str:
    """A device kernel's scope text: its own stats' (own), its hlo_op's "XLA Ops" event's, and
    the dumped op_name of the kernel's own name. The last is what scopes a fusion run inside a
    command buffer, whose hlo_op is the command buffer ("command_buffer_1"), not the fusion."""
    dumped = _op_name(op_names, {"hlo_op": name, "program_id": program_id}) if name != hlo_op else ""
    return " ".join(t for t in (own, by_op.get(hlo_op or name, ""), dumped) if t)


def _cpu_thunks(data, op_names: dict[str, str]) -> list[Kernel]:
    """No device plane (CPU backend): the XLA thunks run on host threads, known by their hlo_op."""
    out = [
        Kernel(Event(event.start_ns, event.duration_ns, event.name, line.name),
               f"{_scope_text(stats)} {_op_name(op_names, stats)}".strip())  # fmt: skip
        for line, event, stats in _plane_events(data, "/host:")
        if "hlo_op" in stats and event.duration_ns > 0
    ]
    out.sort(key=lambda k: k.event.start_ns)
    return out


def host_events(data) -> list[dict]:
    """The host threads' busiest event names, ms over the whole trace (nested events each count: a parent
    spans its children), with the threads they ran on: where a host-bound step's time goes
    (Python, XLA's thunk launches, command-buffer updates, transfers)."""
    per_name: dict[str, list] = {}  # name -> [ns, count, {thread}]
    for line, event, _ in _plane_events(data, "/host:"):
        entry = per_name.setdefault(event.name, [0.0, 0, set()])
        entry[0] += event.duration_ns
        entry[1] += 1
        entry[2].add(re.sub(r"/-?\d+$", "", line.name))  # thread pools' numbered lines as one
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:TOP_HOST_EVENTS]
    return [dict(name=n[:160], ms=ns / 1e6, count=c, threads=sorted(t)[:4]) for n, (ns, c, t) in top]


def load_kernels(trace_dir: str, op_names: dict | None = None) -> tuple[list[Kernel], dict]:
    """The device's kernels (or the CPU's thunks) of the newest .xplane.pb under trace_dir, each
    with what the trace says of its op, plus its op_name from `op_names` (hlo_op_names)."""
    op_names = op_names or {}
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
    path = max(paths, key=os.path.getmtime)
    data = jax.profiler.ProfileData.from_file(path)
    events, info = device_events(data)
    host = host_events(data)
    info = dict(file=os.path.relpath(path, trace_dir), planes=info.get("planes", []), lines=sorted(set(info.get("lines", [])))[:40],
                hlo_op_names=len(op_names), host_events=host)  # fmt: skip
    if events:
        by_kernel, by_op = _kernel_scopes(data, op_names), _xla_op_scopes(data)

        kernels = [Kernel(e, kernel_scope(e.name, *by_kernel.get((e.start_ns, e.name), ("", "", None)), op_names, by_op))
                   for e in events]  # fmt: skip
        info["source"] = "device stream lines"
    else:
        kernels = _cpu_thunks(data, op_names)
        info["source"] = "host XLA thunks (no device plane)"
        info["note"] = "CPU: a while/call thunk spans its body's thunks, so category sums can exceed the busy time"
    return kernels, info


def busy_ns(events: list[Event]) -> float:
    """The union of [start, start + duration) over events: device time with anything running."""
    total, end = 0.0, None
    for e in sorted(events, key=lambda e: e.start_ns):
        s, t = e.start_ns, e.start_ns + e.duration_ns
        if end is None or s > end:
            total += t - s
            end = t
        elif t > end:
            total += t - end
            end = t
    return total


# Phases of a speculative step (models/dsa/speculative.py's named scopes), a second split of the same
# kernels: where the MTP machinery's time goes.
PHASES = ("mtp_draft", "mtp_verify", "mtp_commit", "mtp_extend")
_PHASE = re.compile("|".join(PHASES))


def split(kernels: list[Kernel], steps: int, window_ms: float | None) -> dict:
    """ms per step per category (+ host_idle), and the top kernels by time, from classified kernels."""
    steps = max(steps, 1)
    per_category = dict.fromkeys(CATEGORIES, 0.0)
    # (name, category) -> [ns, count, scope]: one kernel (a cuBLAS gemm, say) can serve ops of
    # several categories, each event is classified by its own scope
    per_name: dict[tuple[str, str], list] = {}
    per_phase: dict[str, float] = {}
    for k in kernels:
        if k.scope and (phase := _PHASE.search(k.scope)):
            per_phase[phase.group(0)] = per_phase.get(phase.group(0), 0.0) + k.event.duration_ns
        category = classify(k.event.name, k.scope)
        entry = per_name.setdefault((k.event.name, category), [0.0, 0, k.scope])
        entry[0] += k.event.duration_ns
        entry[1] += 1
        per_category[category] += k.event.duration_ns
    busy = busy_ns([k.event for k in kernels])
    span = (max(k.event.start_ns + k.event.duration_ns for k in kernels) - min(k.event.start_ns for k in kernels)) if kernels else 0.0
    window_ns = window_ms * 1e6 if window_ms else span  # the host's wall time of the steps, else the device span
    categories = {c: ns / 1e6 / steps for c, ns in per_category.items()}
    categories["host_idle"] = max(window_ns - busy, 0.0) / 1e6 / steps
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return dict(
        steps=steps, window_ms_per_step=window_ns / 1e6 / steps, device_busy_ms_per_step=busy / 1e6 / steps,
        device_span_ms_per_step=span / 1e6 / steps, kernel_sum_ms_per_step=sum(per_category.values()) / 1e6 / steps,
        kernels=len(kernels), categories_ms=categories, phases_ms={p: ns / 1e6 / steps for p, ns in per_phase.items()},
        top_kernels=[dict(name=n[:160], ms_per_step=ns / 1e6 / steps, count=c, category=cat, scope=scope[:240])
                     for (n, cat), (ns, c, scope) in top],
    )  # fmt: skip


def summarize(trace_dir: str, steps: int, window_ms: float | None = None, op_names: dict | None = None) -> dict:
    """split() of the trace under trace_dir; never raises: a failure is returned as {"error": ...}
    with zeroed categories, so a benchmark's JSON keeps its shape."""
    try:
        kernels, info = load_kernels(trace_dir, op_names)
        host = [dict(name=e["name"], ms_per_step=e["ms"] / max(steps, 1), count=e["count"], threads=e["threads"])
                for e in info.pop("host_events")]  # fmt: skip
        return dict(split(kernels, steps, window_ms), host_events=host, trace=info)
    except Exception as error:  # a missing or unreadable trace must not end the benchmark
        zeros = {c: 0.0 for c in (*CATEGORIES, "host_idle")}
        return dict(steps=steps, categories_ms=zeros, top_kernels=[], error=repr(error))


class DecodeTrace:
    """Wraps engine.runner.greedy_step for one engine.run: decode steps [warm, warm + steps) run
    under jax.profiler, started once step warm - 1's outputs are ready and stopped once the last
    traced step's are, so the trace holds exactly those steps (with their selections) at steady
    state. Waiting at the edges touches only this run, never a measured one."""

    def __init__(self, engine, trace_dir: str, warm: int, steps: int):
        self.runner, self.trace_dir = engine.runner, trace_dir
        self.first, self.last = warm, warm + steps - 1  # traced decode step indices, inclusive
        self.calls, self.tracing, self.window_ms = 0, False, None
        self._t0 = 0.0

    def __enter__(self):
        original = self.runner.greedy_step

        def step(*args, **kwargs):
            i = self.calls
            if i == self.first == 0:
                self._start()
            out = original(*args, **kwargs)
            self.calls += 1
            if i == self.first - 1:
                jax.block_until_ready(out)
                self._start()
            elif i == self.last and self.tracing:  # i - first + 1 steps traced
                jax.block_until_ready(out)
                self._stop()
            return out

        self.runner.greedy_step = step  # an instance attribute shadows the method
        return self

    def _start(self):
        jax.profiler.start_trace(self.trace_dir)
        self.tracing, self._t0 = True, time.perf_counter()

    @property
    def traced_steps(self) -> int:
        return max(min(self.calls, self.last + 1) - self.first, 0)

    def _stop(self):
        self.window_ms = (time.perf_counter() - self._t0) * 1e3
        jax.profiler.stop_trace()
        self.tracing = False

    def __exit__(self, *exc):
        if self.tracing:  # the run ended early (fewer steps than asked): keep what was traced
            self._stop()
        self.runner.__dict__.pop("greedy_step", None)
        return False


def plot(entries: list[dict], path: str, *, label: str) -> None:
    """One stacked bar per entry ({mode, running, categories_ms}): a step's ms per category."""
    from serving import plots  # matplotlib (Agg) and the figures' title / whole-file save

    order = (*CATEGORIES, "host_idle")
    names = [f"{e['mode']}\nrunning {e.get('running')}" for e in entries]
    fig, ax = plots.plt.subplots(figsize=(max(6.0, 2.5 + 1.4 * len(entries)), 4.5))
    bottom = [0.0] * len(entries)  # f[entries]: the stack so far
    for category in order:
        heights = [e["categories_ms"].get(category, 0.0) for e in entries]  # f[entries]: ms per step
        ax.bar(names, heights, bottom=bottom, label=category, hatch="//" if category == "host_idle" else None)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("ms per decode step")
    plots._title(ax, f"Decode step time split [{label}]")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    plots._save(fig, path)
