"""Registers, spills, shared memory and occupancy of the Pallas kernels at the ranks' shapes, on a
machine without a GPU: what bounds a kernel's programs per SM, and how many waves its grid makes.

    pip install --target /tmp/triton triton==3.6.0     # the H200 machine's Triton; ~640 MB, not a project dependency
    TRITON_PATH=/tmp/triton JAX_PLATFORMS=cpu python benchmarks/probes/kernel_resources.py [--cases=a,b] [--out=FILE.json]

How: each case lowers one kernel entry for "cuda" against an abstract H200 with the Triton
lowering (not the CPU interpreter). Each pallas_call's Triton module is kept as text as Pallas
makes it, and its launch (num_warps, num_stages, grid) read from the custom call's backend
config. Triton (pip) compiles the module for sm_90 to PTX, and its ptxas (-v) reports registers
and spills; Triton's metadata the shared memory; the PTX its tensor-core instructions by kind
(`mma_kinds`: wgmma or the Ampere mma.sync, and fp8 -> f16 conversions). Programs per SM follow from the H200's limits
(65,536 registers, 2,048 threads, 32 blocks and 228 KB of shared memory per SM, 227 KB per
block; registers allocated per warp in units of 256), waves from the grid over 132 SMs.

An estimate, not a measurement: XLA compiles the same module with the Triton inside jaxlib, whose
pipeline may allocate otherwise than pip's. The H200's own figures come from the profiler.
Prints one line per kernel and writes JSON.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402

from pallas_kernels import common  # noqa: E402

flags.DEFINE_list("cases", [], "Cases to run (default: all of CASES).")
flags.DEFINE_string("out", "outputs/kernel_resources.json", "Where the JSON goes.")
FLAGS = flags.FLAGS

# The H200 (sm_90) per SM.
SMS, REGISTERS, THREADS, BLOCKS, SHARED, SHARED_PER_BLOCK = 132, 65536, 2048, 32, 233472, 232448
REGISTER_UNIT = 256  # registers are allocated per warp, in units of 256


def occupancy(registers: int, num_warps: int, shared: int) -> dict:
    """Programs (blocks) one SM holds at once, and the limit that sets it."""
    per_warp = math.ceil(registers * 32 / REGISTER_UNIT) * REGISTER_UNIT
    limits = {
        "registers": REGISTERS // (per_warp * num_warps) if registers else BLOCKS,
        "threads": THREADS // (32 * num_warps),
        "shared": SHARED // shared if shared else BLOCKS,
        "blocks": BLOCKS,
    }
    if shared > SHARED_PER_BLOCK:
        limits["shared"] = 0
    bound = min(limits, key=lambda k: limits[k])
    return {"programs_per_sm": limits[bound], "bound_by": bound, "limits": limits}


def launches(hlo_text: str) -> dict:
    """Kernel name -> {num_warps, num_stages, grid} from the Triton custom calls' backend configs."""
    out = {}
    hlo_text = re.sub(r'ir = "(?:[^"\\]|\\.)*"', "ir = ...", hlo_text)  # the modules' bytecode: long, may hold braces
    for config in re.findall(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?backend_config = \{(.*?)\}', hlo_text, flags=re.S):
        field = lambda name: int(re.search(rf"{name} = (\d+)", config).group(1))  # noqa: E731
        name = re.search(r'name = "([^"]+)"', config).group(1)
        out[name] = {"num_warps": field("num_warps"), "num_stages": field("num_stages"),
                     "grid": [field("grid_x"), field("grid_y"), field("grid_z")]}  # fmt: skip
    return out


def lower(fn, *args) -> tuple[str, dict]:
    """(HLO text, kernel name -> Triton module text) of jitted fn lowered for an abstract H200."""
    import jax._src.pallas.triton.pallas_call_registration as registration

    modules = {}
    original = registration.lowering.lower_jaxpr_to_triton_module

    def keep(*a, **k):
        result = original(*a, **k)
        text = result.module.operation.get_asm(enable_debug_info=False)
        modules[re.search(r"module @([\w$.\-]+)", text).group(1)] = text
        return result

    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=SMS, platform="gpu")
    )
    registration.lowering.lower_jaxpr_to_triton_module = keep
    interpret, sms = common.interpret_mode, common.num_sms
    common.interpret_mode, common.num_sms = (lambda: False), (lambda: SMS)  # the H200's, not this machine's
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = original
        common.interpret_mode, common.num_sms = interpret, sms
    return text, modules


def compile_module(text: str, num_warps: int, num_stages: int) -> dict:
    """Triton (pip) compiles one module for sm_90; ptxas -v's registers and spills, and shared bytes."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(text)
        kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True).stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, report)) else 0  # noqa: E731
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "shared_bytes": int(kernel.metadata.shared),
            "mma": mma_kinds(kernel.asm["ptx"])}  # fmt: skip


def mma_kinds(ptx: str) -> dict:
    """Tensor-core instructions in the PTX by kind (wgmma: Hopper's; mma.sync: the Ampere form,
    which an fp8 dot reaches only through f16), and the fp8 -> f16 conversions: the static count
    in the text (a loop body once), not how often they run."""
    kinds = collections.Counter(re.findall(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx))
    if converts := len(re.findall(r"\bcvt\.rn\.f16x2\.e[45]m[23]x2\b", ptx)):
        kinds["cvt.f16x2.fp8"] = converts
    return dict(sorted(kinds.items()))


# ---- the cases: one kernel entry each, at a rank's shapes --------------------------------------

S = jax.ShapeDtypeStruct
F8, BF16, F32, I32, U32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32, jnp.int32, jnp.uint32


def _scores(b, C, heads, q_dtype=BF16, **tuning):
    from pallas_kernels.indexer_scores import index_scores_masked_pallas

    fn = functools.partial(index_scores_masked_pallas, **tuning)
    return fn, (S((b, heads, 128), q_dtype), S((b, heads), F32), S((1, b, C, 128), F8), S((1, b, C), F32), S((), I32), S((b,), I32))


def _topk(b, C, **tuning):
    from pallas_kernels.topk import topk_indices_pallas

    return functools.partial(topk_indices_pallas, k=2048, **tuning), (S((b, C), F32),)


def _plan(R, C=40960, B=4096, K=2048, page_size=64):
    from pallas_kernels.swap_in.pallas_triton import swap_in_plan_pallas

    fn = functools.partial(swap_in_plan_pallas, page_size=page_size)
    return fn, (S((1, R, B), I32), S((1, R, B), I32), S((R, C), I32), S((), I32), S((R, K), I32), S((R,), I32), S((R, C // page_size), I32))


def _copy(R, K=2048, words=164, context=40960, B=4096):
    from pallas_kernels.row_copy import copy_host_rows_to_buffer_pallas

    return copy_host_rows_to_buffer_pallas, (S((1, R * context, words), U32), S((1, R, B, words), U32), S((), I32), S((R, K), I32), S((R, K), I32), S((R,), I32))


def _attention(R, heads, K=2048, **launch):
    from pallas_kernels.sparse_mla_attention.pallas_triton import sparse_mla_attention_pallas

    fn = functools.partial(sparse_mla_attention_pallas, latent_dim=512, sm_scale=0.1, **launch)
    return fn, (S((R, heads, 576), BF16), S((1, R, K, 576), BF16), S((), I32), S((R, K), I32))  # dequantize_first's dense rows


def _fp8_attention(R, heads, form, K=2048, slots=4096):
    from hisparse_jax.row_layout import KVRowLayout
    from pallas_kernels.sparse_mla_attention.pallas_triton import sparse_mla_attention_pallas

    layout = KVRowLayout(512, 64, "fp8_e4m3")
    fn = functools.partial(sparse_mla_attention_pallas, latent_dim=512, sm_scale=0.1, layout=layout, fp8_form=form)
    return fn, (S((R, heads, 576), BF16), S((1, R, slots, layout.width), U32), S((), I32), S((R, K), I32))


def _w8a8(M, N, K, **tile):
    """A dense block-FP8 projection, w8a8 (w8a8_config's tile, changed by `tile`)."""
    from pallas_kernels.grouped_matmul import fp8_matmul, w8a8_config

    config = w8a8_config(M, 1, K, N).replace(**tile) if tile else None
    fn = functools.partial(fp8_matmul, implementation="pallas", fp8_activations=True, config=config)
    return fn, (S((M, K), BF16), S((N, K), F8), S((N // 128, K // 128), F32))


def _w8a8_experts(M, G, N, K, **tile):
    """The routed experts' grouped GEMM, w8a8, [G, N, K] weights as the checkpoints store them."""
    from pallas_kernels.grouped_matmul import grouped_matmul, w8a8_config

    config = w8a8_config(M, G, K, N).replace(**tile) if tile else None
    fn = functools.partial(grouped_matmul, transpose_rhs=True, implementation="pallas", fp8_activations=True, config=config)
    return lambda x, w, s, g: fn(x, w, g, rhs_scale=s), (S((M, K), BF16), S((G, N, K), F8), S((G, N // 128, K // 128), F32), S((G,), I32))


CASES = {
    "indexer_scores/deepseek_50x40960": lambda: _scores(50, 40960, 64),
    "indexer_scores/deepseek_50x40960_fp8q": lambda: _scores(50, 40960, 64, F8),
    "indexer_scores/deepseek_50x40960_histogram": lambda: _scores(50, 40960, 64, F8, histogram=True),
    "indexer_scores/glm_9x131072": lambda: _scores(9, 131072, 32),
    "indexer_scores/glm_9x131072_histogram": lambda: _scores(9, 131072, 32, F8, histogram=True),
    "indexer_scores/glm_1x131072": lambda: _scores(1, 131072, 32),
    "topk_radix/50x40960": lambda: _topk(50, 40960, method="radix"),
    "topk_radix/9x131072": lambda: _topk(9, 131072, method="radix"),
    "topk_radix/9x131072_inline_plan": lambda: _topk(9, 131072, method="radix", row_plan=False),
    "topk_radix/50x40960_row_plan": lambda: _topk(50, 40960, method="radix", row_plan=True),
    "topk_bisect/47x32768": lambda: _topk(47, 32768, method="bisect"),
    "swap_in_plan/R1": lambda: _plan(1),
    "swap_in_plan/R50": lambda: _plan(50),
    "swap_in_plan/R256": lambda: _plan(256, C=32768),
    "copy_host_rows/R50_fp8": lambda: _copy(50),
    "attention/50x128_bf16": lambda: _attention(50, 128),
    "attention/128x128_bf16": lambda: _attention(128, 128),
    "attention/50x128_bf16_keys_major": lambda: _attention(50, 128, keys_major=True, block_k=128, num_stages=1),
    "attention/50x128_bf16_transposed_acc": lambda: _attention(50, 128, keys_major=True, transposed_acc=True, block_k=128, num_stages=1),
    "attention/50x128_fp8_dequantize_kernel": lambda: _fp8_attention(50, 128, "dequantize_kernel"),
    "attention/50x128_fp8_interleave": lambda: _fp8_attention(50, 128, "interleave"),
    "w8a8/q_b_M50": lambda: _w8a8(50, 24576, 1536),
    "w8a8/o_proj_M50": lambda: _w8a8(50, 7168, 16384),
    "w8a8/o_proj_M12": lambda: _w8a8(12, 7168, 16384),
    "w8a8/o_proj_M12_swap": lambda: _w8a8(12, 7168, 16384, block_m=16, m_subtiles=1, swap_ab=True),
    "w8a8/o_proj_M50_swap64": lambda: _w8a8(50, 7168, 16384, block_m=64, swap_ab=True),
    "w8a8/experts_gate_up_M400": lambda: _w8a8_experts(400, 32, 4096, 7168),  # DeepSeek-V3.2's 50 running, top-8
    "w8a8/experts_gate_up_M400_swap": lambda: _w8a8_experts(400, 32, 4096, 7168, block_m=16, m_subtiles=1, swap_ab=True),
}


def run_case(name: str) -> list[dict]:
    fn, args = CASES[name]()
    hlo, modules = lower(fn, *args)
    rows = []
    for kernel, launch in launches(hlo).items():
        row = {"case": name, "kernel": kernel, **launch, "programs": math.prod(launch["grid"])}
        try:
            row |= compile_module(modules[kernel], launch["num_warps"], launch["num_stages"])
        except Exception as e:  # one kernel's compile failing keeps the others
            rows.append(row | {"error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        row |= occupancy(row["registers"], launch["num_warps"], row["shared_bytes"])
        row["waves"] = round(row["programs"] / max(1, row["programs_per_sm"] * SMS), 2)
        rows.append(row)
    return rows


def main(argv):
    del argv
    if os.environ.get("TRITON_PATH"):
        sys.path.insert(0, os.environ["TRITON_PATH"])
    try:
        import triton  # noqa: F401
    except ImportError:
        raise app.UsageError("needs Triton to compile the kernels: pip install --target DIR triton==3.6.0, then TRITON_PATH=DIR") from None
    names = FLAGS.cases or list(CASES)
    if unknown := [n for n in names if n not in CASES]:
        raise app.UsageError(f"unknown case(s) {unknown}; known: {list(CASES)}")
    results = []
    for name in names:
        try:
            rows = run_case(name)
        except Exception as e:
            rows = [{"case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}]
        for r in rows:
            results.append(r)
            if "error" in r:
                print(f"{r['case']:44s} {r.get('kernel', '-'):36s} error: {r['error'][:160]}", flush=True)
            else:
                print(f"{r['case']:44s} {r['kernel']:36s} warps {r['num_warps']:2d} stages {r['num_stages']} regs {r['registers']:3d} "
                      f"spills {r['spill_stores']:4d}/{r['spill_loads']:4d} smem {r['shared_bytes'] / 1024:6.1f} KB -> "
                      f"{r['programs_per_sm']:2d}/SM ({r['bound_by']}), {r['programs']} programs = {r['waves']} waves"
                      + "".join(f"; {kind} x{n}" for kind, n in r["mma"].items()), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"note": "estimates from pip Triton's compile of the lowered modules (sm_90), not measurements", "kernels": results}, f, indent=1)
    print(f"wrote {FLAGS.out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    app.run(main)
