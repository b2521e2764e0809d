"""Is XLA's cuDNN ragged-dot fusion faster than its dense rewrite for the MoE's grouped GEMMs?

    python3 benchmarks/probes/probe_ragged_dot.py --out=$OUT/plain.json
    XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true python3 benchmarks/probes/probe_ragged_dot.py --out=$OUT/fusion.json --compare=$OUT/plain.json

models/common/moe.py runs each expert projection as one `lax.ragged_dot` over the token-expert
assignments sorted by expert. XLA 0.11.2 rewrites a ragged dot on the GPU into a dense dot over
every (expert, assignment) pair by default, E times the work (a profile at 88 running requests
showed those GEMMs growing ~3x from 24 to 88 requests). This probe times the gate/up/down
ragged dots of the serving benchmark's MoE (E experts, top-X, hidden D, intermediate F, bf16)
by device busy time (benchmarks/device_timing.py) at several token counts, and with --compare
checks the outputs against another run's (saved as .npz beside the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks import device_timing  # noqa: E402

PARSER = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
PARSER.add_argument("--out", required=True)
PARSER.add_argument("--compare", default=None, help="JSON of another run: outputs must be close")
PARSER.add_argument("--tokens", default="1,24,88,256")
PARSER.add_argument("--experts", type=int, default=16)
PARSER.add_argument("--top", type=int, default=8)
PARSER.add_argument("--hidden", type=int, default=7168)
PARSER.add_argument("--intermediate", type=int, default=2048)
PARSER.add_argument("--calls", type=int, default=20)
PARSER.add_argument("--precision", default="default", choices=("default", "highest"),
                    help="lax.Precision of the ragged dots (models/common/moe.py passes HIGHEST)")
ARGS = PARSER.parse_args()


PRECISION = jax.lax.Precision.HIGHEST if ARGS.precision == "highest" else None


def moe_ragged(x, gate, up, down, experts):
    """x bf16[T, D], weights bf16[E, D, F] / [E, F, D], experts i32[T, X] -> f32[T * X, D]."""
    E, X = gate.shape[0], experts.shape[1]
    order = jnp.argsort(experts.reshape(-1), stable=True)  # i32[M]
    sizes = jnp.bincount(experts.reshape(-1), length=E).astype(jnp.int32)  # i32[E]
    xs = x[order // X]  # bf16[M, D]
    dot = lambda lhs, rhs, **kw: jax.lax.ragged_dot(lhs, rhs, sizes, precision=PRECISION, **kw)  # noqa: E731
    h = jax.nn.silu(dot(xs, gate)) * dot(xs, up)  # bf16[M, F]
    return dot(h, down, preferred_element_type=jnp.float32)  # f32[M, D]


def main():
    E, X, D, F = ARGS.experts, ARGS.top, ARGS.hidden, ARGS.intermediate
    keys = jax.random.split(jax.random.key(0), 4)
    scale = lambda n: 1.0 / np.sqrt(n)  # noqa: E731
    gate = (jax.random.normal(keys[0], (E, D, F)) * scale(D)).astype(jnp.bfloat16)  # bf16[E, D, F]
    up = (jax.random.normal(keys[1], (E, D, F)) * scale(D)).astype(jnp.bfloat16)  # bf16[E, D, F]
    down = (jax.random.normal(keys[2], (E, F, D)) * scale(F)).astype(jnp.bfloat16)  # bf16[E, F, D]
    fn = jax.jit(moe_ragged)
    result = dict(xla_flags=os.environ.get("XLA_FLAGS", ""), precision=ARGS.precision, device=str(jax.devices()[0]), sizes=[])
    outputs = {}
    for T in (int(t) for t in ARGS.tokens.split(",")):
        kx, ke = jax.random.split(jax.random.fold_in(keys[3], T))
        x = jax.random.normal(kx, (T, D)).astype(jnp.bfloat16)  # bf16[T, D]
        experts = jnp.argsort(jax.random.uniform(ke, (T, E)), axis=1)[:, :X].astype(jnp.int32)  # i32[T, X]: distinct
        out = jax.block_until_ready(fn(x, gate, up, down, experts))
        outputs[f"T{T}"] = np.asarray(out)
        events, _ = device_timing.record(lambda: fn(x, gate, up, down, experts), ARGS.calls)
        busy = device_timing.busy_per_call(events, ARGS.calls)
        entry = dict(tokens=T, **device_timing.summary(busy, "busy"))
        result["sizes"].append(entry)
        print(json.dumps(entry), flush=True)
    np.savez(ARGS.out.replace(".json", ".npz"), **outputs)
    if ARGS.compare:
        with np.load(ARGS.compare.replace(".json", ".npz")) as other:
            for name, value in outputs.items():
                ref = other[name]
                err = float(np.max(np.abs(value - ref)) / max(float(np.max(np.abs(ref))), 1e-6))
                result.setdefault("max_rel_err_vs_compare", {})[name] = err
        print("max relative error vs", ARGS.compare, result["max_rel_err_vs_compare"], flush=True)
    with open(ARGS.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
