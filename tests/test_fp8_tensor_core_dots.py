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

F8, BF16 = jnp.float8_e4m3fn, jnp.bfloat16


def dots(fn, *args) -> list[str]:
    """The tt.dot lines of every Triton module that jitted fn lowers to."""
    _, modules = kernel_resources.lower(fn, *args)
    assert modules, "no Triton kernel was lowered"
    return [line for text in modules.values() for line in re.findall(r"tt\.dot [^\n]*", text)]


def imprecise_acc(line: str) -> int | None:
    match = re.search(r"maxNumImpreciseAcc = (\d+)", line)
    return int(match.group(1)) if match else None


@pytest.mark.parametrize("M", [12, 50])  # the 16-row tile (two dots a weight tile) and the 64-row one
def test_w8a8_dots_accumulate_each_k_step_on_the_fp8_tensor_cores(M):
    fn, args = kernel_resources._w8a8(M, 256, 512)  # the probe's own case builders: M x K=512 -> N=256
    lines = dots(fn, *args)
    assert lines and all("f8E4M3FN" in line for line in lines)
    # One dot per K step of <= 128 (one scale block): the kernel promotes to f32 between them.
    steps = {imprecise_acc(line) for line in lines}
    assert steps <= {64, 128} and None not in steps, lines


def test_indexer_fp8_queries_dot_on_the_fp8_tensor_cores_and_bf16_queries_as_before():
    fn, args = kernel_resources._scores(4, 4096, 64, F8)
    fp8 = dots(fn, *args)
    assert fp8 and all(imprecise_acc(line) == 128 for line in fp8), fp8  # the index head dim
    fn, args = kernel_resources._scores(4, 4096, 64, BF16)
    bf16 = dots(fn, *args)
    assert bf16 and all("xbf16>" in line and imprecise_acc(line) is None for line in bf16), bf16


def test_the_switch_leaves_fp8_dots_as_pallas_lowers_them(monkeypatch):
    monkeypatch.setattr(common, "FP8_TENSOR_CORE_DOTS", False)
    fn, args = kernel_resources._w8a8(20, 256, 256)  # a shape no other test lowers (nothing cached)
    lines = dots(fn, *args)
    assert lines and all(imprecise_acc(line) is None for line in lines), lines


def test_the_lowering_rule_is_wrapped_once():
    from jax._src.pallas.triton import lowering

    rule = lowering.triton_lowering_rules[jax.lax.dot_general_p]
    common._install_fp8_tensor_core_dots()
    assert lowering.triton_lowering_rules[jax.lax.dot_general_p] is rule and rule.fp8_tensor_core_dots
