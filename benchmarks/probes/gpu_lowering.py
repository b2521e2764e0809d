"""The per-step programs as the H200 runs them, lowered on a machine without a GPU: the tiny DSA
model's decode step (HiSparse and the baseline, a batch below the slots and all of them) and the
SYNTHETIC selector's two forms, exported for "cuda" against an abstract H200 (Triton kernels
lowered, not interpreted). Prints, per program, its control flow outside kernels (while / case /
if) and its custom calls by target, as JSON.

Why: a branch or loop test on a device value in a per-step program is read back on the host, so
the host waits for every step queued before it and the engine's overlap schedule is lost (the
SYNTHETIC selector's lax.cond did this on the H200; docs/PERFORMANCE.md, 2026-12-03 seventh
session). tests/test_gpu_lowering.py runs this in its own process: the kernels' lowering choice
(on_gpu) is patched here, which must not leak into other tests' traces.

    JAX_PLATFORMS=cpu python benchmarks/probes/gpu_lowering.py
"""

from __future__ import annotations

import collections
import functools
import json
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax import export
from jax._src.mesh import AbstractDevice, AbstractMesh

import pallas_kernels.common as common

common.on_gpu = lambda: True  # lower the kernels for the GPU (Triton), not the CPU interpreter

from configs.model import DSAModelConfig  # noqa: E402 (after the patch: imports may resolve kernels)
from hisparse_jax.config import HiSparseConfig  # noqa: E402
from models.dsa.model import DSAForCausalLM  # noqa: E402
from models.dsa.runner import ModelRunner  # noqa: E402
from serving import synthetic_selection  # noqa: E402

H200 = AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
# Custom calls the step is known to hold: the Pallas Triton kernels and memory-kind annotations.
ALLOWED_CUSTOM_CALLS = ("__gpu$xla.gpu.triton", "annotate_device_placement")


def lowered_for_h200(fn, *args) -> str:
    """StableHLO text of jitted `fn` on args, exported for CUDA against an abstract H200."""
    checks = [export.DisabledSafetyCheck.custom_call(target) for target in ALLOWED_CUSTOM_CALLS]
    with jax.sharding.use_abstract_mesh(H200):
        return export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()


def summary(text: str) -> dict:
    """Control flow outside kernels and custom calls by target, of one lowered program."""
    flow = collections.Counter(re.findall(r"stablehlo\.(while|case|if)\b", text))
    return dict(control_flow=dict(flow), custom_calls=dict(collections.Counter(re.findall(r"custom_call @([\w$.\-]+)", text))))


def programs() -> dict:
    """Program name -> summary, for every per-step program the engine dispatches in a decode."""
    config = DSAModelConfig.tiny()
    runner = ModelRunner(DSAForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0)), implementation="pallas")
    R, J, K = 4, len(config.full_indexer_layers), config.index_topk
    out = {}
    for engine, hisparse in (("hisparse", HiSparseConfig(top_k=K)), ("baseline", None)):
        cache = runner.create_cache(num_requests=R, max_context=128, hisparse=hisparse, page_size=16 if hisparse else None)
        for b in (1, R):  # a batch bucket below the slots, and all of them
            tokens = jnp.zeros(b, jnp.int32)  # i32[b]
            topk = jnp.zeros((J, b, K), jnp.int32)  # i32[J, b, K]: the SYNTHETIC override
            args = (runner._param_leaves, cache, tokens, tokens, topk, jnp.zeros(R, jnp.int32), tokens)
            out[f"decode_step/{engine}/b{b}"] = summary(lowered_for_h200(runner._jitted(cache)["decode"], *args))
    for steady in (False, True):
        select = jax.jit(functools.partial(synthetic_selection._select, overlap=0.9, steady=steady))
        args = (jax.random.key(0), jnp.zeros((J, R, K), jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(R, jnp.int32), jnp.zeros(R, jnp.int32))
        out[f"synthetic_select/steady={steady}"] = summary(lowered_for_h200(select, *args))
    return out


if __name__ == "__main__":
    print(json.dumps(programs(), indent=1))
