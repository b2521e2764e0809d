"""The per-step programs as lowered for the H200 hold no control flow outside their kernels.

A while / case / if on a device value in a program the engine dispatches every step is read back
on the host: the host then waits for every step queued before it, and the overlap schedule
(dispatch step t + 1 while step t runs) is lost. The SYNTHETIC selector's lax.cond did exactly
this on the H200 (both engines' steps serialised; docs/PERFORMANCE.md, 2026-12-03 seventh
session), and a CPU-interpreted test cannot see it. benchmarks/probes/gpu_lowering.py exports
the programs for "cuda" against an abstract H200 in its own process (it patches the kernels'
lowering choice, which must not leak into this process's traces).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_per_step_programs_lowered_for_the_h200_hold_no_control_flow():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "probes", "gpu_lowering.py")],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    programs = json.loads(done.stdout)
    assert set(programs) == {*(f"decode_step/{e}/b{b}" for e in ("hisparse", "baseline") for b in (1, 4)),
                             "synthetic_select/steady=False", "synthetic_select/steady=True"}  # fmt: skip
    for name, program in programs.items():
        assert program["control_flow"] == {}, (name, program)
    for name in ("decode_step/hisparse/b1", "decode_step/baseline/b1"):
        # Lowered as the GPU runs them: Triton kernels, not the CPU interpreter's loops.
        assert programs[name]["custom_calls"].get("__gpu$xla.gpu.triton", 0) > 0, programs[name]
