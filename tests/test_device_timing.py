"""benchmarks/device_timing.py: launches and busy time read off a device trace (synthetic events;
the CPU records no device plane, so record() itself gives no events here)."""

import jax.numpy as jnp

from benchmarks import device_timing
from benchmarks.device_timing import Event

PLAN, COPY = "hisparse_swap_in_plan", "hisparse_copy_host_rows"


def loop_trace(calls=3, iters=4):
    """What one jit of the benchmark launches per call: flush, restore, plan, copy, checksum."""
    events, t = [], 0.0
    for _ in range(calls):
        for i in range(iters):
            for name, ns in [("loop_add_fusion", 100e3), ("loop_xor_fusion", 2e3), (PLAN, 10e3), (COPY, 5e3 + i * 1e3), ("fusion", 1e3)]:
                events.append(Event(t, ns, name, "Stream #14(Compute)"))
                t += ns + 500  # a 0.5 us gap between kernels
        t += 1e6
    return events


def test_launch_spans_run_from_the_plan_start_to_the_copy_end():
    launches = device_timing.launches(loop_trace(), PLAN, COPY)
    assert len(launches) == 12
    assert launches[0] == device_timing.Launch(span_us=15.5, first_us=10.0, last_us=5.0)  # 10 + 0.5 gap + 5
    assert launches[3] == device_timing.Launch(span_us=18.5, first_us=10.0, last_us=8.0)
    single = device_timing.launches(loop_trace(), COPY, COPY)
    assert [x.span_us for x in single[:2]] == [5.0, 6.0]


def test_busy_time_splits_per_call_and_summary_reports_the_spread():
    per_call = device_timing.busy_per_call(loop_trace(), 3)
    assert per_call == [4 * (100 + 2 + 10 + 1) + 5 + 6 + 7 + 8] * 3
    assert device_timing.busy_per_call(loop_trace()[:-1], 3) == [sum(e.duration_ns for e in loop_trace()[:-1]) / 1e3 / 3]
    stats = device_timing.summary([1.0, 2.0, 3.0, 10.0], "swap_in")
    assert stats["swap_in_us"] == 2.5 and stats["swap_in_min_us"] == 1.0 and stats["swap_in_max_us"] == 10.0
    assert stats["swap_in_samples"] == 4 and device_timing.summary([], "x") == {}


def test_record_on_cpu_finds_no_device_kernels():
    events, info = device_timing.record(lambda: jnp.ones(4).block_until_ready(), 2)
    assert events == [] and not any(p.startswith("/device:") for p in info["planes"])
