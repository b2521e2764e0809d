"""Kernel time on the device, read from JAX's profiler (CUPTI on a GPU): what the benchmarks report.

    events = record(run, calls)          # every kernel the device ran during `calls` calls of run()
    spans = launches(events, "hisparse_swap_in_plan", "hisparse_copy_host_rows")
    summary([s.span_us for s in spans])  # median, p10, p90, min, max

Why: a host wall-clock difference of two jits carries the host's noise (dispatch, Python, the
allocator; spreads of hundreds of ms were seen on the H200), while a kernel's own start and end
on the device carry none of it. Pallas kernels keep their `name=` as the GPU kernel's name, so
they are found by name; XLA's own kernels (the jnp references) are measured as device busy time,
the summed kernel durations of a call minus those of the same jit without the measured op.
Where the backend records no device plane (CPU) every function returns empty results and the
caller keeps its wall-clock figure.
"""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import tempfile
from typing import NamedTuple

import jax
import numpy as np


class Event(NamedTuple):
    start_ns: float
    duration_ns: float
    name: str
    line: str  # the device plane's line (a stream) it ran on


class Launch(NamedTuple):
    span_us: float  # start of the first kernel to the end of the last: what the stream spends
    first_us: float  # the first kernel's own duration
    last_us: float  # the last kernel's own duration


def record(run, calls: int) -> tuple[list[Event], dict]:
    """Calls run() `calls` times under the profiler. Returns the device's kernel events sorted by
    start, and what the trace held (plane and line names, a few kernel names) for the log."""
    directory = tempfile.mkdtemp(prefix="hisparse_profile_")
    try:
        jax.profiler.start_trace(directory)
        try:
            for _ in range(calls):
                run()
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return [], {"error": "no xplane.pb written"}
        return device_events(jax.profiler.ProfileData.from_file(paths[0]))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def device_events(data) -> tuple[list[Event], dict]:
    """The kernel events of every device plane ("/device:GPU:0", ...), from its stream lines
    (lines XLA derives from them, such as "XLA Ops", would count each kernel twice)."""
    events, info = [], {"planes": [], "lines": []}
    for plane in data.planes:
        info["planes"].append(plane.name)
        if not plane.name.startswith("/device:"):
            continue
        lines = list(plane.lines)
        info["lines"] += [line.name for line in lines]
        streams = [line for line in lines if line.name.startswith("Stream")] or lines
        for line in streams:
            events += [Event(e.start_ns, e.duration_ns, e.name, line.name) for e in line.events]
    events.sort()
    info["kernel_names"] = sorted({e.name for e in events})[:40]
    return events, info


def launches(events: list[Event], first: str, last: str) -> list[Launch]:
    """One Launch per kernel whose name contains `first`, ended by the next kernel whose name
    contains `last` (the same kernel when first == last)."""
    out, start = [], None
    for event in events:
        if first in event.name and (start is None or first != last):
            start = event
        if start is not None and last in event.name:
            end = event.start_ns + event.duration_ns
            out.append(Launch((end - start.start_ns) / 1e3, start.duration_ns / 1e3, event.duration_ns / 1e3))
            start = None
    return out


def busy_per_call(events: list[Event], calls: int) -> list[float]:
    """Device busy time (summed kernel durations, us) of each of `calls` calls of one jit, which
    launches the same kernels every call: the events split evenly in start order. One mean
    figure when they do not split evenly."""
    if not events:
        return []
    durations = np.array([e.duration_ns for e in events]) / 1e3
    if len(events) % calls:
        return [float(durations.sum()) / calls]
    return [float(chunk.sum()) for chunk in np.split(durations, calls)]


def summary(values: list[float], prefix: str) -> dict:
    """{prefix}_us (median), {prefix}_p10_us, _p90_us, _min_us, _max_us, and the sample count."""
    if not values:
        return {}
    v = np.asarray(values, float)
    return {
        f"{prefix}_us": float(statistics.median(v)),
        f"{prefix}_p10_us": float(np.percentile(v, 10)),
        f"{prefix}_p90_us": float(np.percentile(v, 90)),
        f"{prefix}_min_us": float(v.min()),
        f"{prefix}_max_us": float(v.max()),
        f"{prefix}_samples": int(v.size),
    }
