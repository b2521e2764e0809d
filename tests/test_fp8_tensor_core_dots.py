"""pallas_kernels.common's fp8 dots: an fp8 x fp8 dot lowers for the H200 with maxNumImpreciseAcc
set to its contraction size (without it Triton runs the dot as f16 mma.sync after widening both
operands in registers, never on the fp8 tensor cores); a dot of other operands keeps Pallas'
lowering. Checked on the Triton module text Pallas makes for an abstract H200, on the CPU."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks.probes import kernel_resources
from pallas_kernels import common

F8, BF16, F32, I32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32, jnp.int32
S = jax.ShapeDtypeStruct


def dots(fn, *args) -> list[str]:
    """The tt.dot lines of every Triton module that jitted fn lowers to."""
    _, modules = kernel_resources.lower(fn, *args)
    assert modules, "no Triton kernel was lowered"
    return [line for text in modules.values() for line in re.findall(r"tt\.dot [^\n]*", text)]


def imprecise_acc(line: str) -> int | None:
    match = re.search(r"maxNumImpreciseAcc = (\d+)", line)
    return int(match.group(1)) if match else None


def w8a8_projection(M: int, K: int = 512, N: int = 256):
    from pallas_kernels.grouped_matmul import fp8_matmul

    def project(x, w, scale):
        return fp8_matmul(x, w, scale, implementation="pallas", fp8_activations=True)

    return project, S((M, K), BF16), S((N, K), F8), S((N // 128, K // 128), F32)


def indexer_scores(q_dtype, b: int = 4, heads: int = 64, context: int = 4096):
    from pallas_kernels.indexer_scores import index_scores_masked_pallas

    args = (S((b, heads, 128), q_dtype), S((b, heads), F32), S((1, b, context, 128), F8), S((1, b, context), F32), S((), I32), S((b,), I32))
    return index_scores_masked_pallas, *args


@pytest.mark.parametrize("M", [12, 50])  # the 16-row tile (two dots a weight tile) and the 64-row one
def test_w8a8_dots_accumulate_each_k_step_on_the_fp8_tensor_cores(M):
    lines = dots(*w8a8_projection(M))
    assert lines and all("f8E4M3FN" in line for line in lines)
    # One dot per K step of <= 128 (one scale block): the kernel promotes to f32 between them.
    steps = {imprecise_acc(line) for line in lines}
    assert steps <= {64, 128} and None not in steps, lines


def test_indexer_fp8_queries_dot_on_the_fp8_tensor_cores_and_bf16_queries_as_before():
    fp8 = dots(*indexer_scores(F8))
    assert fp8 and all(imprecise_acc(line) == 128 for line in fp8), fp8  # the index head dim
    bf16 = dots(*indexer_scores(BF16))
    assert bf16 and all("xbf16>" in line and imprecise_acc(line) is None for line in bf16), bf16


def test_the_switch_leaves_fp8_dots_as_pallas_lowers_them(monkeypatch):
    monkeypatch.setattr(common, "FP8_TENSOR_CORE_DOTS", False)
    lines = dots(*w8a8_projection(20, K=256))  # a shape no other test lowers (nothing cached)
    assert lines and all(imprecise_acc(line) is None for line in lines), lines


def test_the_lowering_rule_is_wrapped_once():
    from jax._src.pallas.triton import lowering

    rule = lowering.triton_lowering_rules[jax.lax.dot_general_p]
    common._install_fp8_tensor_core_dots()
    assert lowering.triton_lowering_rules[jax.lax.dot_general_p] is rule and rule.fp8_tensor_core_dots
