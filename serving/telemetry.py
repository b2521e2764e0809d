"""What a serving run measured: one record per decode step and per request, and their summary.

Per decode step: running requests, hits, misses (summed over layers and requests; a shared-index
layer's replayed copies count, they move bytes too), host -> device bytes (misses x row bytes),
wall time of the step (dispatch to sampled tokens on the host; with the engine's overlap
schedule, from the previous step's tokens to this one's, the ITL a client sees). Per request:
submit time and the time of every token. The summary follows SGLang's bench_serving: output tokens/s over the
run's wall time, TTFT and ITL (mean / p50 / p99, ms), plus the miss rate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepRecord:
    time_s: float  # when the step finished, from the start of the run
    step_s: float  # wall time of the step (overlap schedule: since the previous step's results)
    running: int  # requests decoded in this step (overlap schedule: with any running one step past its EOS)
    hits: int  # selected rows found on the device, all layers and requests
    misses: int  # rows copied host -> device, all layers and requests
    h2d_bytes: int  # misses x row bytes
    batch: int = 0  # slots the step computed: the batch bucket holding the running requests
    # Speculative decoding: drafts the step accepted, summed over its requests (it made running +
    # accepted tokens, some maybe past a request's end), and the tokens it emitted. None: a plain step.
    accepted: int | None = None
    emitted: int | None = None


@dataclasses.dataclass
class RequestTrace:
    id: int
    prompt_len: int
    submitted_s: float  # when the client sent it, from the start of the run
    token_times_s: list[float] = dataclasses.field(default_factory=list)  # each output token's time
    admitted_s: float | None = None  # when it got a slot and its prefill began

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.submitted_s

    @property
    def itls_s(self) -> np.ndarray:
        return np.diff(np.asarray(self.token_times_s))


def _stats_ms(values_s) -> dict:
    values = np.asarray(values_s, np.float64) * 1e3
    if values.size == 0:
        return dict(mean=None, p50=None, p99=None)
    return dict(mean=float(values.mean()), p50=float(np.percentile(values, 50)), p99=float(np.percentile(values, 99)))


def summarize(steps: list[StepRecord], traces: list[RequestTrace], duration_s: float, *, measure_ttft: bool = True) -> dict:
    """The run's summary as a JSON-ready dict. measure_ttft False: contexts were not prefilled
    by the model (synthetic fill), so TTFT is not reported."""
    output_tokens = sum(len(t.token_times_s) for t in traces)
    decode_tokens = sum(s.running if s.emitted is None else s.emitted for s in steps)
    decode_s = sum(s.step_s for s in steps)
    hits = sum(s.hits for s in steps)
    misses = sum(s.misses for s in steps)
    return dict(
        num_requests=len(traces),
        duration_s=duration_s,
        output_tokens=output_tokens,
        output_throughput=output_tokens / duration_s if duration_s > 0 else None,  # tokens/s, as bench_serving
        decode_steps=len(steps),
        decode_throughput=decode_tokens / decode_s if decode_s > 0 else None,  # decode-step tokens/s
        mean_running=decode_tokens / len(steps) if steps else 0.0,
        max_running=max((s.running for s in steps), default=0),
        ttft_ms=_stats_ms([t.ttft_s for t in traces if t.token_times_s]) if measure_ttft else None,
        itl_ms=_stats_ms(np.concatenate([t.itls_s for t in traces] or [np.zeros(0)])),
        step_ms=_stats_ms([s.step_s for s in steps]),
        hits=hits,
        misses=misses,
        miss_rate=misses / (hits + misses) if hits + misses else 0.0,
        h2d_bytes=sum(s.h2d_bytes for s in steps),
        **_acceptance(steps),
    )


def _acceptance(steps: list[StepRecord]) -> dict:
    """Speculative runs: acceptance_length, tokens a request's step made on average (accepted
    drafts + 1, SGLang's accept length), and accepted drafts per step. Nothing for plain runs."""
    speculative = [s for s in steps if s.accepted is not None]
    if not speculative:
        return {}
    request_steps = sum(s.running for s in speculative)
    accepted = sum(s.accepted for s in speculative)
    return dict(acceptance_length=(request_steps + accepted) / request_steps if request_steps else None, accepted_drafts=accepted)


def steps_to_json(steps: list[StepRecord]) -> dict:
    """Per-step columns (compact in JSON)."""
    return {f.name: [getattr(s, f.name) for s in steps] for f in dataclasses.fields(StepRecord)}


def format_summary(label: str, summary: dict) -> str:
    """One line: mode, throughput, latency and misses."""
    ttft = summary["ttft_ms"]
    itl = summary["itl_ms"]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    return (
        f"{label:<28} out {fmt(summary['output_throughput']):>9} tok/s  decode {fmt(summary['decode_throughput']):>9} tok/s"
        f"  running {summary['mean_running']:5.1f} (max {summary['max_running']:3d})"
        f"  TTFT mean {fmt(ttft and ttft['mean']):>8} ms  ITL mean/p50/p99 {fmt(itl['mean'])}/{fmt(itl['p50'])}/{fmt(itl['p99'])} ms"
        f"  miss rate {summary['miss_rate']:.3f}  H2D {summary['h2d_bytes'] / 1e6:.2f} MB"
        + _kv_text(summary.get("kv_bytes_per_request"))
        + _residency_text(summary.get("residency"))
        + (f"  acceptance length {fmt(summary['acceptance_length'])}" if "acceptance_length" in summary else "")
    )


def _kv_text(kv: dict | None) -> str:
    """KV bytes per request at the engine's context length: device (as admission counts) and host pool."""
    if kv is None:
        return ""
    return f"  KV/request device {kv['device'] / 1e6:.3f} MB host {kv['host'] / 1e6:.3f} MB"


def _residency_text(residency: dict | None) -> str:
    """Dynamic residency's counts (H2D above counts decode misses; promotions copy rows too)."""
    if residency is None:
        return ""
    return f"  residency {residency['promotions']} up / {residency['demotions']} down ({residency['promoted_rows']} rows copied)"


@contextlib.contextmanager
def written_whole(path: str | os.PathLike):
    """Yields a scratch path beside `path` to write to; renamed onto `path` when the block ends
    normally, removed otherwise (an error, Ctrl-C): `path` is written whole or not at all, and no
    scratch file stays behind."""
    tmp = f"{os.fspath(path)}.partial-{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str | os.PathLike, data) -> None:
    """Writes atomically (a partial file never replaces a good one, nor is left behind)."""
    with written_whole(path) as tmp, open(tmp, "w") as f:
        json.dump(data, f, indent=1)
