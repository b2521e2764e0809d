"""Checks that need the GPU (skipped elsewhere): the swap-in reads the pinned pool in place.

benchmarks/bench_kernels.py runs the same checks at production sizes on fresh inputs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax import memory
from pallas_kernels import common, row_copy, swap_in

pytestmark = pytest.mark.skipif(not common.on_gpu(), reason="needs a GPU")


def test_compiled_swap_in_holds_no_copy_of_the_pinned_pool():
    R, B, K, C, W, S = 4, 64, 32, 1024, 576, 8192
    spec = jax.ShapeDtypeStruct
    pool = spec((1, S, W), jnp.bfloat16, sharding=memory.sharding(memory.PINNED_HOST))

    def step(buf, bt, lru, scratch, topk, lengths, page_table, pool):
        plan, bt, lru, scratch = swap_in.swap_in_plan_pallas(bt, lru, scratch, jnp.int32(0), topk, lengths, page_table, page_size=64)
        buf = row_copy.copy_host_rows_to_buffer_pallas(pool, buf, jnp.int32(0), plan.miss_host_slots, plan.miss_device_slots, plan.num_misses)
        return buf, bt, lru, scratch

    i32 = functools.partial(spec, dtype=jnp.int32)
    text = jax.jit(step, donate_argnums=(0, 1, 2, 3)).lower(
        spec((1, R, B + 1, W), jnp.bfloat16), i32((1, R, B)), i32((1, R, B)), i32((R, C)), i32((R, K)), i32((R,)),
        i32((R, C // 64)), pool,
    ).compile().as_text()
    assert f"bf16[1,{S},{W}]" in text
    assert memory.hlo_copy_lines(text, f"bf16[1,{S},{W}]") == []


def test_host_write_lands_in_pinned_memory_in_place():
    S, W = 4096, 576
    pool = memory.allocate((1, S, W), jnp.bfloat16, 0.0, memory.PINNED_HOST)
    rows = jnp.ones((3, W), jnp.bfloat16)
    write = jax.jit(
        functools.partial(row_copy.write_rows_to_host, implementation="pallas"),
        static_argnums=1, donate_argnums=0, out_shardings=memory.sharding(memory.PINNED_HOST),
    )
    out = write(pool, 0, rows, jnp.asarray([5, -1, 4000], jnp.int32))
    assert memory.memory_kind_of(out) == memory.PINNED_HOST
    host = np.asarray(out, np.float32)
    assert host[0, 5].min() == 1 and host[0, 4000].min() == 1 and host[0, 6].max() == 0
