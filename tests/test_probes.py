import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from benchmarks.probes import command_buffer_updates, pass_times, spy_top, state_copies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke_run(tmp_path, script: str, *flags: str) -> dict:
    """benchmarks/probes/<script> --smoke on the CPU (interpret mode) -> its JSON; it must exit 0
    (each probe exits 1 when a check fails)."""
    out = tmp_path / "probe.json"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "probes", script), "--smoke", *flags, f"--out={out}"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())


def test_pass_times_sums_each_pass_over_its_runs():
    lines = [
        "I1203 hlo_pass_pipeline.cc:206] HLO pass: dce time: 10 us (10 us) (cumulative: 10 us)",
        "I1203 hlo_pass_pipeline.cc:211]   HLO pass copy-insertion",
        "I1203 hlo_pass_pipeline.cc:206] HLO pass: copy-insertion time: 2500 us (2500 us)",
        "I1203 hlo_pass_pipeline.cc:206] HLO pass: dce time: 30 us (40 us)",
    ]
    total, runs = pass_times.pass_times(lines)
    assert total == {"dce": 40, "copy-insertion": 2500}
    assert runs == {"dce": 2, "copy-insertion": 1}


def test_pass_times_refuses_a_log_without_pass_lines(tmp_path, capsys):
    log = tmp_path / "log.txt"
    log.write_text("nothing here\n")
    assert pass_times.main(["pass_times.py", str(log)]) == 2
    assert "no 'HLO pass" in capsys.readouterr().err


def test_spy_top_counts_a_frame_once_per_stack_and_the_leaf_as_self():
    lines = [
        "<module> (a.py:1);compile (b.py:2);llvm::Pass;llvm::Pass 6\n",  # a recursive frame counts once
        "<module> (a.py:1);lower (c.py:3) 4\n",
        "not a stack line\n",
    ]
    inclusive, leaf, total = spy_top.frame_counts(lines)
    assert total == 10
    assert inclusive == {"<module>": 10, "compile": 6, "llvm::Pass": 6, "lower": 4}
    assert leaf == {"llvm::Pass": 6, "lower": 4}


def test_command_buffer_updates_counts_re_records_per_buffer_in_both_spellings():
    lines = [  # jaxlib 0.11.2's spelling, then XLA head's
        "I1204 command_buffer_thunk.cc:270] Initialized command buffer on device #0 in 9000 \u03bcs; num_commands=835",
        "I1204 command_buffer_thunk.cc:336] [0] Create/Update command buffer by recoding command buffer cmd sequence after 1"
        " executions since last update; num_commands=835; updated_allocs=4; is_first_record=false; needs_update=true",
        "I1204 command_buffer_thunk.cc:362] [0] Updated command buffer in 1100 \u03bcs; num_commands=835",
        "I1204 command_buffer_thunk.cc:250] Update command buffer on device #0 by recoding command buffer cmd sequence after 3"
        " executions since last update; num_commands=835; updated_allocs=10",
        "I1204 command_buffer_thunk.cc:270] Updated command buffer in 900 \u03bcs; num_commands=835",
        "I1204 command_buffer_thunk.cc:336] [0] Create/Update command buffer by recoding command buffer cmd sequence after 1"
        " executions since last update; num_commands=40; updated_allocs=2; is_first_record=false; needs_update=true",
    ]
    per_buffer = command_buffer_updates.summarise(lines)
    assert per_buffer[835]["updates"] == 2 and per_buffer[835]["update_us"] == 2000
    assert per_buffer[835]["initializations"] == 1 and per_buffer[835]["initialize_us"] == 9000
    assert per_buffer[835]["moved_allocs"] == {4: 1, 10: 1} and per_buffer[835]["runs_between"] == {1: 1, 3: 1}
    assert per_buffer[40]["updates"] == 1 and per_buffer[40]["update_us"] == 0


def test_command_buffer_updates_refuses_a_log_without_its_lines(tmp_path, capsys):
    log = tmp_path / "log.txt"
    log.write_text("nothing here\n")
    assert command_buffer_updates.main(["command_buffer_updates.py", str(log)]) == 2
    assert "no command_buffer_thunk lines" in capsys.readouterr().err


STATE_COPIES_HLO = """HloModule jit__greedy_decode_step, is_scheduled=true, input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }

%fused (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} copy(%p)
}

ENTRY %main.3 (x.1: f32[8], tables.1: s32[3,4,20], y.1: f32[]) -> (f32[8], s32[3,4,20]) {
  %x.1 = f32[8]{0} parameter(0), metadata={op_name="x"}
  %tables.1 = s32[3,4,20]{2,1,0} parameter(1)
  %y.1 = f32[] parameter(2)
  %constant.3 = f32[8]{0} constant({0, 0, 0, 0, 0, 0, 0, 0})
  %copy.1 = f32[8]{0} copy(%x.1)
  %copy = f32[8]{0} copy(%copy.1)
  %copy.9 = f32[8]{0} copy(%constant.3)
  %bitcast.2 = s32[240]{0} bitcast(%tables.1)
  %copy-start.4 = (s32[240]{0}, s32[240]{0}, u32[]) copy-start(%bitcast.2)
  %copy-done.4 = s32[240]{0} copy-done(%copy-start.4)
  %fusion.7 = f32[8]{0} fusion(%x.1), kind=kLoop, calls=%fused
  %fusion.8 = f32[8]{0} fusion(%x.1), kind=kCustom, calls=%fused, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %custom-call.2 = f32[8]{0} custom-call(%x.1), custom_call_target="__gpu$xla.gpu.triton"
  %custom-call.3 = f32[8]{0} custom-call(%x.1), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %tuple.13 = (f32[8]{0}, s32[3,4,20]{2,1,0}) tuple(%copy, %tables.1)
}
"""


def test_state_copies_finds_each_copy_of_a_parameter_through_bitcasts_and_copies(tmp_path, capsys):
    copies, num_params, aliased = state_copies.copied_parameters(STATE_COPIES_HLO)
    assert (num_params, aliased) == (3, 2)
    # x twice (a copy and a copy of it), the tables once through a bitcast; the constant's copy
    # and the fused computation's copy of its own parameter are not the entry's parameters.
    assert [(c["parameter"], c["name"], c["op"], c["bytes"]) for c in copies] == [
        (0, "x.1", "copy", 32), (0, "x.1", "copy", 32), (1, "tables.1", "copy-start", 960)
    ]
    assert state_copies.shape_bytes("s32[3,4,20]{2,1,0}") == 960
    dump = tmp_path / "module_0001.jit__greedy_decode_step.sm_9.0_gpu_after_optimizations.txt"
    dump.write_text(STATE_COPIES_HLO)
    assert state_copies.main([str(tmp_path)]) == 0
    assert state_copies.entry_census(STATE_COPIES_HLO) == {
        "copy": 3, "copy-start": 1, "copy-done": 1, "fusion kLoop": 1, "fusion kCustom __triton_gemm": 1,
        "custom-call __gpu$xla.gpu.triton": 2,
    }  # fmt: skip
    out = capsys.readouterr().out
    assert "3 copies of parameters" in out and "entry runs 9: copy 3, custom-call __gpu$xla.gpu.triton 2," in out
    assert state_copies.main([str(tmp_path), "--module=prefill"]) == 2
    assert "no optimised module matching 'prefill'" in capsys.readouterr().err


def test_indexer_fp8_tiling_probe_checks_every_shape_against_the_reference(tmp_path):
    """The probe's smoke run (CPU, interpret mode): each scoring shape checked against the jnp
    reference, each top-k exactly against lax.top_k, exit 0 only when all pass."""
    (size,) = smoke_run(tmp_path, "indexer_fp8_tiling.py", "--queries=bfloat16,fp8", "--fused")["sizes"]
    shapes = [{}, {"keys_major": True, "block_c": 32, "blocks_per_program": 2}]
    assert [(v["queries"], v["tuning"]) for v in size["variants"]] == [(fmt, t) for fmt in ("bfloat16", "fp8") for t in shapes]
    assert [(v["queries"], v["fused"], v["exact"]) for v in size["selection"]] == [
        (fmt, fused, True) for fmt in ("bfloat16", "fp8") for fused in (False, True)
    ]
    assert all(v["checked"] is True for v in size["variants"]) and all(v["exact"] is True for v in size["topk"])
    assert all(c["max_abs_score"] > 0 for c in size["checks"].values())  # the check compared real scores


def test_va_remap_counts_re_records_of_graphs_over_ten_commands():
    from benchmarks.probes import va_remap

    log = "\n".join([
        "I1204 command_buffer_thunk.cc:270] Initialized command buffer on device #0 in 80 μs; num_commands=21",
        "I1204 command_buffer_thunk.cc:362] [0] Updated command buffer in 39 μs; num_commands=21",
        "I1204 command_buffer_thunk.cc:362] [0] Updated command buffer in 30 μs; num_commands=21",
        "I1204 command_buffer_thunk.cc:362] [0] Updated command buffer in 5 μs; num_commands=6",  # a small one: left out
        "I1204 gpu_executable_va_remap_allocator.cc:405] [0] VA remapping: module jit_step executing",
    ])  # fmt: skip
    assert va_remap.log_counts(log) == dict(updates=2, records=1, remap_lines=1)


def test_va_remap_child_runs_its_step_exactly_on_the_cpu():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "probes", "va_remap.py"), "--child", "--steps=4"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300,
    )  # fmt: skip
    result = json.loads(next(line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")))
    assert result["ran"] and result["mismatched_steps"] == 0 and result["state_equal"], result


def test_copy_row_rate_probe_checks_every_copy_bit_for_bit(tmp_path):
    """The probe's smoke run (CPU, interpret mode): every launch shape's copy leaves the copied
    layer's buffer exactly as expected (the missed rows in their slots, 0xFF.. elsewhere)."""
    rows = smoke_run(tmp_path, "copy_row_rate.py", "--kinds=fp8_e4m3", "--rows=16", "--programs_per_sm=4")["rows"]
    assert [(r["layers"], r["sweep_mb"]) for r in rows] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r["exact"] is True and r["misses"] == 5 for r in rows)


def test_dense_fp8_linear_probe_finds_the_models_projections_and_checks_each_tile(tmp_path):
    """The probe's smoke run (tiny config, CPU, interpret mode): every fp8 projection of a MoE
    layer and the dense MLP found by walking the model, each tile equal to the current one."""
    rows = smoke_run(tmp_path, "dense_fp8_linear.py")["rows"]
    names = {r["projection"] for r in rows}
    assert {"self_attn.q_b_proj", "self_attn.o_proj", "self_attn.indexer.wq_b", "mlp.shared_experts.down_proj", "mlp.gate_proj"} <= names
    assert "mla.value_lift" in names and not any(n.startswith("mlp.experts") for n in names)  # the routed experts are not Linears
    tuned = [r for r in rows if r.get("variant") == "m16"]
    assert tuned and all(r["rows"] == 3 and r["equal_to_current"] for r in tuned)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA's compiler) to build the probe")
def test_host_row_gather_builds_and_refuses_what_it_cannot_run(tmp_path):
    """benchmarks/probes/host_row_gather.cu builds for the H200 (sm_90); without a GPU, or with an
    unknown flag, it ends with one error line and status 2 (the measurement itself is the GPU's)."""
    binary = tmp_path / "host_row_gather"
    source = os.path.join(ROOT, "benchmarks", "probes", "host_row_gather.cu")
    built = subprocess.run(["nvcc", "-O3", "-arch=sm_90", "-std=c++17", "-o", str(binary), source], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    for args, message in ((["--bogus=1"], "error: unknown argument --bogus=1"), (["--row_bytes=650"], "must be a multiple of 16")):
        done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr
    if not os.path.exists("/dev/nvidia0"):
        done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stderr.strip() == "error: no CUDA device"


def test_kernel_resources_reads_launches_and_counts_programs_per_sm():
    """benchmarks/probes/kernel_resources.py's own arithmetic, without Triton: the launch of each
    Triton custom call from lowered text (the module bytecode, which may hold braces, skipped),
    and the H200's programs per SM by registers (per warp, in units of 256), threads, shared memory."""
    from benchmarks.probes import kernel_resources as kr

    text = ('%0 = stablehlo.custom_call @__gpu$xla.gpu.triton(%arg0) {backend_config = "", mhlo.backend_config = {debug = false, '
            'grid_x = 50 : i32, grid_y = 20 : i32, grid_z = 1 : i32, ir = "ML\\EFR}{\\22x", name = "hisparse_indexer_topk_split", '
            'num_stages = 1 : i32, num_warps = 4 : i32}} : (tensor<50x40960xf32>) -> tensor<50x2048xi32>')
    assert kr.launches(text) == {"hisparse_indexer_topk_split": {"num_warps": 4, "num_stages": 1, "grid": [50, 20, 1]}}
    # 154 registers x 32 lanes -> 4,992 a warp -> 5,120 allocated; x 4 warps = 20,480: 3 programs in 65,536.
    assert kr.occupancy(154, 4, 8192) == {"programs_per_sm": 3, "bound_by": "registers",
                                          "limits": {"registers": 3, "threads": 16, "shared": 28, "blocks": 32}}  # fmt: skip
    assert kr.occupancy(24, 16, 0)["bound_by"] == "threads" and kr.occupancy(40, 1, 120_000)["programs_per_sm"] == 1
    assert kr.occupancy(64, 8, 240_000)["programs_per_sm"] == 0  # over a block's shared memory: it cannot run


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (pip install triton==3.6.0) to compile the kernels")
def test_kernel_resources_compiles_the_kernels_of_a_case(tmp_path):
    """With Triton installed: the radix top-k's four kernels at 9 x 131,072, each compiled, with
    registers, shared memory and waves; the per-row plan keeps the split program under 255 registers."""
    out = tmp_path / "resources.json"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "probes", "kernel_resources.py"), "--cases=topk_radix/9x131072", f"--out={out}"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    kernels = {k["kernel"]: k for k in json.loads(out.read_text())["kernels"]}
    assert set(kernels) == {f"hisparse_indexer_topk_{name}" for name in ("histogram", "plan", "split", "resolve")}
    assert all(k["registers"] > 0 and k["programs_per_sm"] > 0 for k in kernels.values())
    assert kernels["hisparse_indexer_topk_split"]["registers"] < 255 and kernels["hisparse_indexer_topk_split"]["programs"] == 9 * 64


def test_kernel_resources_counts_tensor_core_instructions_by_kind():
    from benchmarks.probes import kernel_resources as kr

    ptx = """
        wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%f1}, %rd1, %rd2, p, 1, 1;
        wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%f2}, %rd3, %rd4, p, 1, 1;
        mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f3}, {%r1}, {%r2}, {%f4};
        cvt.rn.f16x2.e4m3x2 %r5, %rs1;
        wgmma.fence.sync.aligned;
    """
    assert kr.mma_kinds(ptx) == {"cvt.f16x2.fp8": 1, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32": 1,
                                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3": 2}  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (pip install triton==3.6.0) to compile the kernels")
def test_w8a8_and_fp8_query_scoring_compile_to_fp8_wgmma():
    """With Triton installed: the fp8 x fp8 dots (pallas_kernels.common.FP8_TENSOR_CORE_DOTS)
    compile to Hopper's fp8 wgmma with no fp8 -> f16 conversion."""
    from benchmarks.probes import kernel_resources as kr

    for case in ("w8a8/o_proj_M50", "indexer_scores/deepseek_50x40960_fp8q"):
        (row,) = kr.run_case(case)
        assert "error" not in row, row
        assert [k for k in row["mma"] if k.startswith("wgmma") and k.endswith("e4m3.e4m3")] and "cvt.f16x2.fp8" not in row["mma"], row


def test_probes_exit_1_naming_what_failed(capsys):
    from benchmarks.helpers import checks_exit_status

    assert checks_exit_status([], 5, "copies differ") == 0 and capsys.readouterr().err == ""
    assert checks_exit_status([{"case": 2}], 5, "copies differ") == 1
    assert capsys.readouterr().err.strip() == "1 of 5 copies differ: [{'case': 2}]"
