"""Does the compiled decode step hold a device temp as large as the whole KV (full-KV baseline) or
the whole host pool (HiSparse)? The 61-layer preset run on the H200 (2026-12-03) failed with
RESOURCE_EXHAUSTED allocating exactly the host pool's bytes (61.06 GiB, HiSparse) and exactly the
device KV rows' bytes (18.32 GiB, baseline) in jit__greedy_decode_step. This compiles (does not
run) the step of the bench model for each KV dtype and mode and prints XLA's memory analysis
beside the cache's arrays, so the temp can be matched to an array.

    python benchmarks/probes/step_memory.py            # H200: ~1 min
    python benchmarks/probes/step_memory.py --smoke    # CPU, tiny model
    flags: --fp8_only (fp8 KV only), --fp8_weights (block-FP8 weights), --num_layers=N, --tag=NAME
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from configs.model import DSAModelConfig  # noqa: E402
from hisparse_jax.config import HiSparseConfig  # noqa: E402
from models.dsa.model import DSAForCausalLM  # noqa: E402
from models.dsa.runner import ModelRunner  # noqa: E402

SMOKE = "--smoke" in sys.argv
OUT = os.environ.get("OUT", "/tmp")


def _elements(line: str) -> int:
    """Elements of the first array shape on an HLO line (its result)."""
    match = re.search(r"\[([\d,]*)\]", line)
    return math.prod(int(d) for d in match.group(1).split(",") if d) if match else 0


def main():
    if SMOKE:
        config, R, C = DSAModelConfig.tiny().replace(max_position_embeddings=8192), 8, 4096
        hisparse = HiSparseConfig(top_k=16, device_buffer_size=64, host_to_device_ratio=8)
    else:
        layers = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--num_layers=")), 4))
        config, R, C = DSAModelConfig.deepseek_v32_bench(layers, 16), 16, 32768
        if "--fp8_weights" in sys.argv:  # block FP8 as the presets
            config = config.replace(weight_block_size=(128, 128))
        hisparse = HiSparseConfig(top_k=2048, device_buffer_size=4096, host_to_device_ratio=8)
    model = DSAForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rows = []
    J, K = len(config.full_indexer_layers), hisparse.top_k
    synthetic = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (J, R, K))  # i32[J, R, K]: the SYNTHETIC selector's override
    for kv_dtype, selection in (("fp8_e4m3", "model"), ("fp8_e4m3", "synthetic"), ("auto", "model"), ("auto", "synthetic")):
        if "--fp8_only" in sys.argv and kv_dtype != "fp8_e4m3":
            continue
        runner = ModelRunner(model, kv_cache_dtype=kv_dtype)
        for mode, hs in (("baseline", None), ("hisparse", hisparse)):
            cache = runner.create_cache(num_requests=R, max_context=C, hisparse=hs)
            step = runner._jitted(cache)["decode"]
            topk = synthetic if selection == "synthetic" else None
            compiled = step.lower(runner._param_leaves, cache, jnp.zeros(R, jnp.int32), jnp.full(R, C // 2, jnp.int32), topk).compile()
            m = compiled.memory_analysis()
            arrays = {f"{k}.{n}": (tuple(x.shape), str(x.dtype), x.nbytes, str(getattr(x.sharding, "memory_kind", "")))
                      for k in ("kv",) for n, x in vars(cache.kv).items() if hasattr(x, "nbytes")}  # fmt: skip
            arrays.update({k: (tuple(x.shape), str(x.dtype), x.nbytes, "") for k in ("index_keys", "index_key_scales")
                           if (x := getattr(cache, k, None)) is not None})  # fmt: skip
            row = dict(kv_cache_dtype=kv_dtype, mode=mode, selection=selection, temp_bytes=m.temp_size_in_bytes, argument_bytes=m.argument_size_in_bytes,
                       alias_bytes=m.alias_size_in_bytes, output_bytes=m.output_size_in_bytes,
                       host_temp_bytes=getattr(m, "host_temp_size_in_bytes", None), arrays=arrays)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            big = [line.strip()[:300] for line in compiled.as_text().splitlines() if " copy(" in line or "copy-start" in line]
            print(f"  {len(big)} copy instructions; the largest:", sorted(big, key=_elements)[-3:], flush=True)
            del cache
    tag = next((a.split("=")[1] for a in sys.argv if a.startswith("--tag=")), "")
    with open(os.path.join(OUT, f"step_memory{tag}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
