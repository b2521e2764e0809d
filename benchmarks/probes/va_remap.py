"""Do XLA's command buffers still re-record when a step's fresh buffers move, under VA remapping?

XLA re-records a CUDA graph whenever an allocation its commands use has moved since the last run
(update mode ALWAYS_UPDATE); a decode step's inputs, outputs and temp are fresh buffers each step,
so at 61 layers HiSparse's c = 1 graph is re-recorded every step (22-33 ms, PERFORMANCE.md). jaxlib
0.11.2's GPU plugin has two other modes, SKIP_TEMP and SKIP_PROFILED, that give selected
allocations stable virtual addresses through CUDA VMM remapping (they need, and switch to, the
`vmm` allocator). This probe runs one small step program (a donated state, a fresh input, a
pinned-host read, cuBLAS dots, fusions and a Pallas kernel) for --steps steps under each variant,
each in its own process (the flags are process-wide), and reports per variant: whether it ran,
whether every step's output equals a graph-free reference's bit for bit, the mean step time, and
how many times XLA re-recorded the graph (from its command-buffer log).

    python3 benchmarks/probes/va_remap.py --out=$OUT/va_remap.json        # all variants
    python3 benchmarks/probes/va_remap.py --variant=skip_profiled --child  # one, in this process
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

# name -> (environment, XLA flags); "vmm" alone shows whether the allocator itself works here
VARIANTS = {
    "default": ({}, ""),
    "vmm": ({"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"}, ""),
    "skip_temp": ({"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"}, "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"),
    "skip_profiled": ({"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"}, "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"),
    "skip_profiled_no_prealloc": (
        {"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
        "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED",
    ),
    "va_remapping": ({"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"}, "--xla_gpu_enable_command_buffer_va_remapping=true"),
}


def child(steps: int, same_input: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl

    def add_one_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    def add_one(x):  # f32[256, 256] -> the same, through a Pallas (Triton) kernel
        interpret = jax.default_backend() == "cpu"  # so the probe itself can be tried on a CPU
        return pl.pallas_call(add_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)

    def step(state, x, host, weights):
        # state f32[256, 256] (donated), x f32[256, 256] (fresh each step), host f32[256, 256]
        # (pinned host), weights f32[8, 256, 256] -> (state, out f32[256, 256])
        h = jax.device_put(host, jax.memory.Space.Device)
        y = x + h
        for i in range(weights.shape[0]):  # cuBLAS dots between fusions: a graph of ~20 commands
            y = jnp.tanh(y @ weights[i]) * 0.5 + y * 0.25
        y = add_one(y)
        return state + y, y.sum(axis=0) + state[0]

    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    weights = jax.device_put(rng.standard_normal((8, 256, 256), np.float32) / 16, device)
    host = jax.device_put(rng.standard_normal((256, 256), np.float32), jax.memory.Space.Host)
    inputs = [rng.standard_normal((256, 256), np.float32) for _ in range(steps)]
    graphed = jax.jit(step, donate_argnums=0)
    reference = jax.jit(step, compiler_options={"xla_gpu_enable_command_buffer": ""})

    if same_input:  # one input buffer for every step: only outputs and temp can move
        inputs = [inputs[0]] * steps
    inputs_on_device = [jax.device_put(inputs[0], device)]
    expected, state = [], jnp.zeros((256, 256), jnp.float32)
    for x in inputs:
        state, out = reference(state, jnp.asarray(x), host, weights)
        expected.append(np.asarray(out))
    expected_state = np.asarray(state)

    state = jax.device_put(np.zeros((256, 256), np.float32), device)
    outs, start = [], None
    for i, x in enumerate(inputs):
        if i == 2:  # the first two runs record the graph
            jax.block_until_ready(state)
            start = time.perf_counter()
        fed = inputs_on_device[0] if same_input else jax.device_put(x, device)
        state, out = graphed(state, fed, host, weights)
        outs.append(out)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    mismatches = sum(int(not np.array_equal(np.asarray(o), e)) for o, e in zip(outs, expected))
    return dict(
        ran=True,
        steps=steps,
        mismatched_steps=mismatches,
        state_equal=bool(np.array_equal(np.asarray(state), expected_state)),
        ms_per_step=1e3 * seconds / (steps - 2),
    )


def log_counts(log: str) -> dict:
    """Re-records and first records of command buffers of more than 10 commands, from XLA's log."""
    big = lambda line: int(re.search(r"num_commands=(\d+)", line).group(1)) > 10  # noqa: E731
    lines = [line for line in log.splitlines() if "num_commands=" in line]
    return dict(
        updates=sum(1 for line in lines if "Updated command buffer" in line and big(line)),
        records=sum(1 for line in lines if ("Recorded command buffer" in line or "Initialized command buffer" in line) and big(line)),
        remap_lines=sum(1 for line in log.splitlines() if "remap" in line.lower()),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=sorted(VARIANTS), action="append")
    parser.add_argument("--child", action="store_true", help="run one variant in this process, print its JSON")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--same_input", action="store_true", help="feed one input buffer every step")
    parser.add_argument("--out", default=None)
    parser.add_argument("--timeout", type=int, default=120)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.steps, args.same_input)), flush=True)
        return 0
    results = {}
    for name in args.variant or list(VARIANTS):
        extra_env, flags = VARIANTS[name]
        env = {**os.environ, **extra_env, "TF_CPP_VMODULE": "command_buffer_thunk=3", "TF_CPP_MIN_LOG_LEVEL": "0"}
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
        cmd = [sys.executable, __file__, "--child", f"--variant={name}", f"--steps={args.steps}"] + ["--same_input"] * args.same_input
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            log, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as error:
            log, rc = f"{error.stdout or ''}{error.stderr or ''}timed out", -1
        result = next((json.loads(line[7:]) for line in log.splitlines() if line.startswith("RESULT ")), dict(ran=False))
        result.update(rc=rc, **log_counts(log))
        if rc != 0 or not result.get("ran"):
            result["log_tail"] = [line for line in log.splitlines() if "num_commands" not in line][-15:]
        results[name] = result
        print(name, json.dumps({k: v for k, v in result.items() if k != "log_tail"}), flush=True)
        for line in result.get("log_tail", []):
            print("   ", line[:300])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
