"""Where does a full-depth rank's memory go? The DeepSeek-V3.2 rank preset (2026-12-03) logged
XLA programs of ~207 GiB live memory (188 GiB available), a device allocation of exactly the host
pool's bytes when the pool was made, and a second host pool at warm-up. This builds the preset's
rank at a few layers (same widths, fp8 weights, fp8 KV, the preset's slots and context) and, per
program the engine runs on the host pool (the SYNTHETIC fill, the decode step), prints:
  - XLA's memory analysis (device and host: argument / alias / output / temp bytes);
  - the largest HLO results that are not parameters, with their op names;
  - the device's peak bytes and whether the host pool's buffer stayed where it was (aliased)
    when the program ran;
and for the pool's allocation two ways (jit of jnp.full into pinned_host, numpy zeros put there)
the device peak they raise and their time. Two depths give the growth per layer.

    python benchmarks/probes/rank_memory.py --layers=4,8            # H200: ~2-3 min
    python benchmarks/probes/rank_memory.py --smoke                 # CPU, tiny model
    flags: --preset=deepseek_v32|glm_5_1 --slots=50 --baseline_slots=12 --context=40960 --alloc_gib=16 (0: skip)
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from configs.model import DSAModelConfig  # noqa: E402
from hisparse_jax import memory  # noqa: E402
from hisparse_jax.config import HiSparseConfig  # noqa: E402
from models.dsa.model import DSAForCausalLM  # noqa: E402
from models.dsa.runner import ModelRunner  # noqa: E402
from benchmarks.helpers import ep8_rank_config  # noqa: E402
from serving.synthetic_fill import SyntheticFill  # noqa: E402

SMOKE = "--smoke" in sys.argv
OUT = os.environ.get("OUT", "/tmp")
BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "f8e4m3fn": 1, "u8": 1, "s8": 1, "pred": 1, "s64": 8, "u64": 8}


def flag(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), default)


def device_stats() -> dict:
    s = jax.devices()[0].memory_stats() or {}
    return {k: s.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def largest_results(hlo: str, n: int = 8) -> list[dict]:
    """The n largest instruction results of optimised HLO that are not parameters."""
    out = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (\w+)\[([\d,]*)\](\{[^}]*\})? (\w[\w-]*)\(", line)
        if not m or m.group(5) in ("parameter", "get-tuple-element", "tuple", "bitcast"):
            continue
        dims = [int(d) for d in m.group(3).split(",") if d]
        nbytes = math.prod(dims) * BYTES.get(m.group(2), 4)
        name = re.search(r'op_name="([^"]*)"', line)
        out.append(dict(bytes=nbytes, op=m.group(5), shape=f"{m.group(2)}[{m.group(3)}]{m.group(4) or ''}",
                        op_name=name.group(1)[-160:] if name else ""))  # fmt: skip
    return sorted(out, key=lambda r: -r["bytes"])[:n]


def analysis(compiled) -> dict:
    m = compiled.memory_analysis()
    return {k: getattr(m, k) for k in dir(m) if k.endswith("size_in_bytes")}


def pool_pointer(cache) -> int | None:
    pool = getattr(cache.kv, "host_pool", None)
    try:
        return None if pool is None else pool.addressable_data(0).unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 (a backend without pointers)
        return None


def probe_allocation(gib: float) -> list[dict]:
    """The host pool's allocation two ways, `gib` GiB of u32 in pinned_host."""
    shape = (int(gib * 2**30 // (4 * 164)), 164)
    rows = []
    for how in ("jit_full", "numpy_zeros"):
        before = device_stats()
        t = time.perf_counter()
        if how == "jit_full":
            x = memory.allocate(shape, jnp.uint32, 0, memory.PINNED_HOST)
        else:
            x = jax.device_put(np.zeros(shape, np.uint32), memory.sharding(memory.PINNED_HOST))
        jax.block_until_ready(x)
        rows.append(dict(how=how, gib=gib, s=time.perf_counter() - t, before=before, after=device_stats(), kind=memory.memory_kind_of(x)))
        print(json.dumps(rows[-1]), flush=True)
        del x
    return rows


def probe_depth(preset: str, layers: int, slots: dict, context: int, hisparse: HiSparseConfig) -> list[dict]:
    config = ep8_rank_config(preset, num_layers=layers) if not SMOKE else DSAModelConfig.tiny().replace(weight_block_size=(16, 16), max_position_embeddings=8192)
    t = time.perf_counter()
    model = DSAForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    print(f"{layers} layers: weights {weight_bytes / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s", device_stats(), flush=True)
    runner = ModelRunner(model, kv_cache_dtype="fp8_e4m3")
    rows = []
    J, K = len(config.full_indexer_layers), hisparse.top_k
    for mode, hs in (("hisparse", hisparse), ("baseline", None)):
        R = slots[mode]
        before = device_stats()
        t = time.perf_counter()
        cache = runner.create_cache(num_requests=R, max_context=context, hisparse=hs)
        jax.block_until_ready(cache)
        row = dict(layers=layers, mode=mode, slots=R, weight_bytes=weight_bytes, create_s=time.perf_counter() - t,
                   create_before=before, create_after=device_stats(), programs={})  # fmt: skip
        fill = SyntheticFill(cache)
        P = cache.kv.host_page_table.shape[1] if hs is not None else None
        pages = None if P is None else jnp.arange(P, dtype=jnp.int32)
        key = jax.random.key(0)
        synthetic = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (J, R, K))  # i32[J, R, K]
        step = runner._jitted(cache)["decode"]
        tokens = jnp.zeros(R, jnp.int32)  # i32[R]
        # i32[R]: slot 0 (the filled one) decodes its next position; the others are inactive (-1)
        positions = jnp.full(R, -1, jnp.int32).at[0].set(context // 2)
        calls = {
            "fill": (fill._fill, (cache, jnp.int32(0), jnp.int32(context // 2), pages, key)),
            "decode_synthetic": (step, (runner._param_leaves, cache, tokens, positions, synthetic)),
        }
        for name, (fn, args) in calls.items():
            t = time.perf_counter()
            lowered = fn.lower(*args)  # tracing and lowering, in Python (Pallas kernels lower here)
            lower_s = time.perf_counter() - t
            compiled = lowered.compile()  # XLA's passes and code generation
            program = dict(lower_s=lower_s, compile_s=time.perf_counter() - t - lower_s, memory=analysis(compiled),
                           largest=largest_results(compiled.as_text()))  # fmt: skip
            print(mode, name, json.dumps(program), flush=True)
            pointer, before = pool_pointer(cache), device_stats()
            t = time.perf_counter()
            try:
                out = compiled(*args)
                cache = out[0] if isinstance(out, tuple) else out
                jax.block_until_ready(cache)
                program.update(run_s=time.perf_counter() - t, pool_aliased=pointer == pool_pointer(cache) if pointer else None)
            except Exception as e:  # noqa: BLE001 (an OOM is the finding)
                program.update(error=str(e)[:400])
                print(mode, name, "failed:", str(e)[:400], flush=True)
                row["programs"][name] = program
                break
            program.update(run_before=before, run_after=device_stats())
            print(mode, name, {k: program[k] for k in ("run_s", "pool_aliased", "run_before", "run_after")}, flush=True)
            row["programs"][name] = program
            # the next program reads the new cache
            if name == "fill":
                calls["decode_synthetic"] = (step, (runner._param_leaves, cache, tokens, positions, synthetic))
        rows.append(row)
        del cache, fill, step
    del model, runner
    return rows


def main():
    preset = flag("preset", "deepseek_v32")
    if SMOKE:
        depths, context, slots = [2], 256, dict(hisparse=4, baseline=2)
        hisparse = HiSparseConfig(top_k=16, device_buffer_size=64, host_to_device_ratio=8)
    else:
        depths = [int(x) for x in flag("layers", "4,8").split(",")]
        context = int(flag("context", "40960"))
        slots = dict(hisparse=int(flag("slots", "50")), baseline=int(flag("baseline_slots", "12")))
        hisparse = HiSparseConfig(top_k=2048, device_buffer_size=4096, host_to_device_ratio=8)
    alloc_gib = 0.05 if SMOKE else float(flag("alloc_gib", "16"))
    result = dict(device=str(jax.devices()[0]), preset=preset, context=context, slots=slots, allocation=probe_allocation(alloc_gib) if alloc_gib else [], depths=[])
    for layers in depths:
        result["depths"] += probe_depth(preset, layers, slots, context, hisparse)
        with open(os.path.join(OUT, "rank_memory.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
