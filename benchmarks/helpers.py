"""What the benchmark scripts share: a timestamped log, summary statistics, results JSON written
after every point (so a run cut short keeps what it measured), an error-recording attempt, and
the serving benchmarks' model (DeepSeek-V3.2's attention and MoE shapes at a few layers), the
HBM floor's bandwidth and a grouped-matmul tile kept valid for a matmul's shape.

    from benchmarks.helpers import log, stats, write_json, attempt, bench_model_config

Device time of kernels (the profiler's trace) is benchmarks/device_timing.py's job.
"""

from __future__ import annotations

import json
import os
import time
import sys
import traceback

import numpy as np

T0 = time.perf_counter()  # the script's start (its first import of this module)
HBM_BYTES_PER_S = 4.8e12  # the H200's datasheet HBM bandwidth: the weight-streaming floor the issues state


def log(*args) -> None:
    """print, prefixed with the seconds since the script started, flushed (logs stream back)."""
    print(f"[{time.perf_counter() - T0:7.1f}s]", *args, flush=True)


def capacity_ratio(points: list[dict], capacity: dict) -> float | None:
    """bench_serving's points -> HiSparse's SYNTHETIC-selection throughput with its capacity
    running over the baseline's with its own (capacity: {"hisparse": n, "baseline": m}), whatever
    concurrency caps reached them (two merged runs may have asked for different ones); None
    unless both points exist."""
    at_capacity = {p["mode"]: p["decode_throughput"] for p in points
                   if p["phase"] == "synthetic" and p["mode"] in capacity and p["running"] == capacity[p["mode"]]}  # fmt: skip
    return at_capacity["hisparse"] / at_capacity["baseline"] if len(at_capacity) == 2 else None


def stats(xs) -> dict:
    """p50, mean, min, max and count of a list of numbers ({} for none)."""
    xs = np.asarray(xs, float)
    if xs.size == 0:
        return {}
    return dict(p50=float(np.median(xs)), mean=float(xs.mean()), min=float(xs.min()), max=float(xs.max()), n=int(xs.size))


def write_json(path: str | os.PathLike, data) -> None:
    """Writes `data` as indented JSON (values JSON cannot hold as their str), whole or not at all."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(partial, path)


def attempt(errors: list, where: str, fn):
    """Runs fn(); an exception is recorded in `errors` (the run goes on) and gives None."""
    try:
        return fn()
    except Exception as e:
        errors.append(f"{where}: {type(e).__name__}: {str(e)[:400]}\n{traceback.format_exc()[-1500:]}")
        log(f"ERROR {where}: {type(e).__name__}: {str(e)[:400]}")
        return None


def bench_model_config(*, smoke: bool, num_layers: int, num_experts: int, num_heads: int | None = None):
    """The serving benchmarks' model: DeepSeek-V3.2's attention (128 heads unless num_heads, 576-wide
    latent rows, indexer 64 x 128, top_k 2048), hidden 7168, vocab 129,280, `num_layers` layers (one
    dense, then MoE with `num_experts` routed experts, top-8); the tiny config with smoke."""
    from configs.model import DSAModelConfig

    if smoke:
        return DSAModelConfig.tiny()
    config = DSAModelConfig.deepseek_v32_bench(num_layers, num_experts)  # no MTP layer: no speculation here
    return config if num_heads is None else config.replace(num_heads=num_heads)


def ep8_rank_config(released: str, *, weight_block_size=(128, 128), num_layers: int | None = None):
    """One EP8 rank of a released DSA model (configs.model.DSAModelConfig.<released>(): deepseek_v32,
    glm_5_1, ...): its 32 local routed experts of 256 with uniform routing over them (the router's
    groups: one), top-8, block-FP8 weights (weight_block_size; None: bf16), no MTP layer (these
    runs do not speculate; SGLang then does not load it either); the first num_layers layers
    (None: all)."""
    from configs.model import DSAModelConfig

    config = getattr(DSAModelConfig, released)().replace(
        n_routed_experts=32, n_group=1, topk_group=1, weight_block_size=weight_block_size, num_nextn_predict_layers=0
    )
    if num_layers is None:
        return config
    return config.replace(
        num_layers=num_layers, mlp_layer_types=config.mlp_layer_types[:num_layers], indexer_types=config.indexer_types[:num_layers]
    )


def checks_exit_status(failed: list, total: int, what: str) -> int:
    """A probe's exit status after its checks: 0 when none of `total` failed, else 1 with one
    stderr line naming how many `what` failed and the first three of them."""
    if not failed:
        return 0
    print(f"{len(failed)} of {total} {what}: {failed[:3]}", file=sys.stderr)
    return 1


def valid_tile(cfg, K: int, N: int):
    """A grouped-matmul TritonConfig changed by a tuning, made valid for K and N: split_k back to 1
    where block_k x split_k no longer divides K, block_n halved to a divisor of N."""
    if K % (cfg.block_k * cfg.split_k):
        cfg = cfg.replace(split_k=1)
    while N % cfg.block_n:
        cfg = cfg.replace(block_n=cfg.block_n // 2)
    return cfg
