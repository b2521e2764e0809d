"""benchmarks/step_split.py: classification, busy-time union and host idle on synthetic events,
and a real (CPU) trace end to end: no device plane there, the XLA thunks stand in."""

import jax
import jax.numpy as jnp

from benchmarks import step_split
from benchmarks.device_timing import Event
from benchmarks.step_split import Kernel


def test_kernel_names_then_scopes_then_generic_names():
    assert step_split.classify("hisparse_sparse_mla_attention") == "attention"
    assert step_split.classify("hisparse_indexer_topk_select") == "indexer"
    assert step_split.classify("hisparse_copy_host_rows") == "swap_in"
    assert step_split.classify("hisparse_grouped_matmul") == "moe"  # not dense_gemm's "matmul"
    assert step_split.classify("MemcpyH2D") == "swap_in"
    assert step_split.classify("sm90_xmma_gemm_bf16bf16_bf16f32") == "dense_gemm"
    assert step_split.classify("nvjet_tst_128x64") == "dense_gemm"
    # a gemm the scope places in the attention / the MoE
    assert step_split.classify("nvjet_tst_128x64", "jit(decode)/attention/dot_general") == "attention"
    assert step_split.classify("loop_fusion", "jit(decode)/moe/ragged_dot") == "moe"
    assert step_split.classify("loop_fusion.12") == "other"


def test_busy_time_merges_overlapping_streams_and_host_idle_is_the_rest():
    a = Event(0.0, 4e6, "nvjet_gemm", "Stream #1")  # 0..4 ms
    b = Event(2e6, 4e6, "hisparse_copy_host_rows", "Stream #2")  # 2..6 ms, overlaps a
    c = Event(8e6, 2e6, "loop_fusion", "Stream #1")  # 8..10 ms
    assert step_split.busy_ns([a, b, c]) == 8e6
    out = step_split.split([Kernel(a, ""), Kernel(b, ""), Kernel(c, "")], steps=2, window_ms=12.0)
    ms = out["categories_ms"]
    assert (ms["dense_gemm"], ms["swap_in"], ms["other"]) == (2.0, 2.0, 1.0)
    assert ms["host_idle"] == 2.0  # (12 - 8) / 2 steps
    assert out["top_kernels"][0]["name"] in ("nvjet_gemm", "hisparse_copy_host_rows")


def test_a_cpu_trace_is_split_and_a_missing_one_is_an_error(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((64, 64))  # f32[64, 64]
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            f(x).block_until_ready()
    out = step_split.summarize(str(tmp_path), steps=2)
    assert "error" not in out, out
    assert out["kernels"] > 0 and set(out["categories_ms"]) == {*step_split.CATEGORIES, "host_idle"}
    missing = step_split.summarize(str(tmp_path / "none"), steps=2)
    assert "error" in missing and sum(missing["categories_ms"].values()) == 0.0


def test_hlo_op_names_read_the_optimised_dump(tmp_path):
    """A kernel's (program_id, hlo_op) -> its op_name (the named-scope path) from XLA's text dump
    (module_NNNN is the program id); other passes' files and lines without metadata ignored."""
    dump = tmp_path / "module_0011.jit__greedy_decode_step.sm_9.0_gpu_after_optimizations.txt"
    dump.write_text(
        "ENTRY %main {\n"
        '  %loop_fusion.3 = bf16[8,64]{1,0} fusion(%p0), kind=kLoop, calls=%fc, metadata={op_name="jit(step)/moe/dot_general" stack_frame_id=3}\n'
        '  ROOT %tuple.9 = (f32[8]) tuple(%loop_fusion.3)\n'
        '  %wrapped_scatter = u32[4,8]{1,0} fusion(%p1), kind=kLoop, metadata={op_name="jit(step)/swap_in/scatter"}\n'
        "}\n"
    )  # fmt: skip
    (tmp_path / "module_0012.jit__greedy_decode_step.sm_9.0_gpu_after_optimizations.txt").write_text(
        '  %loop_fusion.3 = f32[2] fusion(%p0), metadata={op_name="jit(step)/attention/other_bucket"}\n'
    )
    (tmp_path / "module_0001.jit__greedy_decode_step.before_optimizations.txt").write_text(
        '  %loop_fusion.9 = f32[2] add(%a, %b), metadata={op_name="jit(step)/attention/add"}\n'
    )
    names = step_split.hlo_op_names(str(tmp_path))
    assert names[11, "loop_fusion.3"] == "jit(step)/moe/dot_general" and names[11, "wrapped_scatter"] == "jit(step)/swap_in/scatter"
    assert names[12, "loop_fusion.3"] == "jit(step)/attention/other_bucket"  # the same name in another program
    assert names["loop_fusion.3"] == "jit(step)/moe/dot_general"  # no program id in the trace: the first dump's
    assert not any("loop_fusion.9" in str(k) for k in names)  # not from before_optimizations
    assert step_split._op_name(names, {"hlo_op": "loop_fusion.3", "program_id": "12"}) == "jit(step)/attention/other_bucket"
    assert step_split.classify("loop_fusion.3", names[11, "loop_fusion.3"]) == "moe"
    assert "--xla_dump_hlo_module_re=" in step_split.dump_flags(str(tmp_path))


def test_a_fusion_inside_a_command_buffer_is_scoped_by_its_kernel_name(tmp_path):
    """In a command buffer the trace's hlo_op is the command buffer ("command_buffer_1"); the
    kernel keeps the fusion's name with "_" for "." (input_concatenate_fusion_241), which the
    dump maps to its scope, per program."""
    (tmp_path / "module_0011.jit__greedy_decode_step.sm_9.0_gpu_after_optimizations.txt").write_text(
        '  %input_concatenate_fusion.241 = bf16[50,2048,576]{2,1,0} fusion(%p0), kind=kInput,'
        ' metadata={op_name="jit(step)/attention/concatenate"}\n'
    )  # fmt: skip
    (tmp_path / "module_0012.jit__greedy_decode_step.sm_9.0_gpu_after_optimizations.txt").write_text(
        '  %input_concatenate_fusion.241 = bf16[8,64]{1,0} fusion(%p0), kind=kInput, metadata={op_name="jit(step)/moe/concatenate"}\n'
    )
    names = step_split.hlo_op_names(str(tmp_path))
    assert step_split.kernel_name("input_concatenate_fusion.241") == "input_concatenate_fusion_241"
    own = "command_buffer_1 XlaModule:"
    scope = step_split.kernel_scope("input_concatenate_fusion_241", "command_buffer_1", own, "11", names, {})
    assert scope.startswith(own) and step_split.classify("input_concatenate_fusion_241", scope) == "attention"
    other_program = step_split.kernel_scope("input_concatenate_fusion_241", "command_buffer_1", own, 12, names, {})
    assert step_split.classify("input_concatenate_fusion_241", other_program) == "moe"
    # outside a command buffer the hlo_op is the fusion itself: its own stats already scope it
    assert step_split.kernel_scope("loop_fusion_3", "loop_fusion_3", "jit(step)/moe/x", 11, names, {}) == "jit(step)/moe/x"
    assert step_split.classify("input_concatenate_fusion_241", own) == "other"  # what the split said before
