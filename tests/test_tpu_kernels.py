"""implementation="tpu": the Pallas TPU kernels, run in TPU interpret mode on CPU.

Each TPU kernel against the same cases as the GPU kernels: the swap-in plan bit-exact to the
plain-Python oracle (and so to the jnp reference) on the hand-written SGLang cases and on
randomised ones; the DMA row copies bit-exact; the attention within the f32 tolerance of the
reference; and whole decode steps through attention_layer equal to the reference
implementation. TPU interpret mode simulates every DMA and semaphore, so sizes stay tiny and
the randomised cases fewer than for the other implementations.
"""

import functools
import math
import re

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_swap_in
from pallas_kernels import common, row_copy, swap_in
from test_swap_in import (
    C_RAND,
    assert_matches_oracle,
    oracle_batch,
    plan_numpy,
    swap_in_cases,
)


def test_tpu_is_an_implementation():
    assert "tpu" in common.IMPLEMENTATIONS
    assert common.resolve_implementation("tpu") == "tpu"
    with pytest.raises(ValueError, match="implementation must be one of"):
        common.resolve_implementation("mosaic")


# ---- swap-in plan -----------------------------------------------------------------------------


# The hand-written swap-in cases of test_swap_in, with implementation="tpu" (their own marks
# parametrize them over the other implementations, so the methods are taken without the marks).
TestSGLangCasesTPU = pytest.mark.parametrize("implementation", ["tpu"])(
    type(
        "TestSGLangCasesTPU",
        (),
        {k: v for k, v in vars(test_swap_in.TestSGLangCases).items() if k.startswith("test_") or k == "B"},
    )
)


@pytest.mark.slow  # the consecutive-steps case below covers the TPU plan in the default run
@hypothesis.settings(max_examples=200, deadline=None, derandomize=True)
@hypothesis.given(case=swap_in_cases())
def test_random_plan_cases_match_oracle(case):
    """test_swap_in's randomised cases (lengths across B, repeats, padding), fewer of them."""
    bt, lru, topk, lengths = case
    plan, tokens, new_lru = plan_numpy(bt, lru, topk, lengths, "tpu", C=C_RAND)
    assert_matches_oracle(plan, tokens, new_lru, oracle_batch(bt, lru, topk, lengths, C_RAND))


@pytest.mark.slow  # ~15 s in interpret mode; the SGLang cases and the fp8 decode steps cover the TPU plan
def test_many_consecutive_plan_steps_equal_reference_and_oracle(monkeypatch):
    """test_swap_in's 60-step run (fast path, transition, evictions), the TPU kernel carrying
    its own state beside the reference's."""
    monkeypatch.setattr(test_swap_in, "IMPLEMENTATIONS", ["reference", "tpu"])
    test_swap_in.test_many_consecutive_steps_kernel_equals_reference_and_oracle()


def test_plan_updates_only_its_layer():
    """Stacked tables: the planned layer changes, the other layers keep every entry."""
    rng = np.random.default_rng(11)
    L, R, B, C = 3, 2, 8, 32
    bt = jnp.asarray(np.stack([np.stack([rng.permutation(20)[:B] for _ in range(R)]) for _ in range(L)]), jnp.int32)
    lru = jnp.asarray(np.stack([np.stack([rng.permutation(B) for _ in range(R)]) for _ in range(L)]), jnp.int32)
    topk = jnp.asarray([[25, 26, 3, -1], [1, 1, 29, 30]], jnp.int32)
    lengths = jnp.asarray([31, 31], jnp.int32)
    page_table = jnp.asarray(test_swap_in.identity_page_table(R, C))
    scratch = jnp.full((R, C), swap_in.SCRATCH_EMPTY, jnp.int32)
    run = jax.jit(
        functools.partial(swap_in.swap_in_plan, page_size=test_swap_in.PAGE_SIZE), static_argnames="implementation"
    )
    ref = run(bt, lru, scratch, 1, topk, lengths, page_table, implementation="reference")
    got = run(bt, lru, scratch, 1, topk, lengths, page_table, implementation="tpu")
    for want, have in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(have), np.asarray(want))
    assert int(got[0].num_misses.sum()) > 0


# ---- row copies (DMAs) ------------------------------------------------------------------------


def test_copy_moves_exactly_the_planned_rows():
    test_swap_in.test_copy_moves_exactly_the_planned_rows("tpu")


def test_fp8_rows_copy_and_write_bit_exact():
    test_swap_in.test_fp8_rows_copy_bit_exact("tpu")


@pytest.mark.parametrize("num_semaphores", [1, 3, 8])
def test_dmas_beyond_the_semaphores_in_flight(num_semaphores):
    """More rows than semaphores: each semaphore is reused once its previous copy is waited on;
    copy and write both bit-exact to the reference (bf16 rows, skipped rows in the write)."""
    from pallas_kernels.row_copy.pallas_tpu import copy_host_rows_to_buffer_tpu, write_rows_to_host_tpu

    rng = np.random.default_rng(num_semaphores)
    L, R, B, S, W, K = 2, 2, 12, 50, 24, 11
    pool = jnp.asarray(rng.standard_normal((L, S, W)), jnp.bfloat16)
    buffer = jnp.asarray(rng.standard_normal((L, R, B + 1, W)), jnp.bfloat16)
    miss_host = jnp.asarray(np.stack([rng.permutation(S)[:K] for _ in range(R)]), jnp.int32)
    miss_device = jnp.asarray(np.stack([rng.permutation(B + 1)[:K] for _ in range(R)]), jnp.int32)
    num_misses = jnp.asarray([K, 7], jnp.int32)
    want = row_copy.copy_host_rows_to_buffer_reference(pool, buffer, 1, miss_host, miss_device, num_misses)
    got = jax.jit(functools.partial(copy_host_rows_to_buffer_tpu, num_semaphores=num_semaphores))(
        pool, buffer, jnp.int32(1), miss_host, miss_device, num_misses
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    rows = jnp.asarray(rng.standard_normal((9, W)), jnp.bfloat16)
    slots = jnp.asarray([4, -1, 0, 49, -1, -1, 17, 3, 30], jnp.int32)
    want = np.asarray(pool).copy()
    keep = np.asarray(slots) >= 0
    want[0, np.asarray(slots)[keep]] = np.asarray(rows)[keep]
    got = jax.jit(functools.partial(write_rows_to_host_tpu, num_semaphores=num_semaphores))(pool, jnp.int32(0), rows, slots)
    np.testing.assert_array_equal(np.asarray(got), want)


# ---- sparse MLA attention ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, tolerance, H, K, block_k",
    [
        (jnp.float32, 1e-5, 4, 8, None),  # one key block
        (jnp.float32, 1e-5, 16, 21, 8),  # three blocks (double buffering), K padded, 2 head blocks
        (jnp.bfloat16, 2e-2, 8, 13, 8),
    ],
)
def test_attention_equals_reference(dtype, tolerance, H, K, block_k):
    """Masked entries, repeats, a request with nothing valid; slots nothing selects and the
    other layer are NaN, so a stray read shows."""
    from pallas_kernels.sparse_mla_attention import sparse_mla_attention

    rng = np.random.default_rng(K)
    L, R, S, LATENT, ROPE = 2, 3, 24, 32, 16
    W = LATENT + ROPE
    kv = np.full((L, R, S, W), np.nan, np.float32)
    kv[1, :, :16] = rng.standard_normal((R, 16, W))
    slots = rng.integers(0, 16, (R, K)).astype(np.int32)
    slots[0, 2] = slots[0, K - 1] = -1
    slots[1, 3] = slots[1, 0]  # a repeat
    slots[2] = -1  # nothing valid: zeros
    query = jnp.asarray(rng.standard_normal((R, H, W)), dtype)
    kv, slots = jnp.asarray(kv, dtype), jnp.asarray(slots)
    attend = lambda impl, **tuning: np.asarray(  # noqa: E731
        sparse_mla_attention(query, kv, 1, slots, latent_dim=LATENT, sm_scale=0.125, implementation=impl, **tuning)
    )
    ref = attend("reference")
    got = attend("tpu", block_h=8, block_k=block_k)
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got[2], 0.0)
    np.testing.assert_allclose(got, ref, rtol=tolerance, atol=tolerance * np.abs(ref).max())


@pytest.mark.parametrize("query_dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_fp8_attention_equals_reference(query_dtype, tolerance):
    """Packed fp8 rows dequantised in the kernel (as test_attention_layer's fp8 kernel test):
    NaN words in every slot nothing selects and in the other layer, so a stray read shows."""
    from test_attention_layer import FP8_LAYOUT, LATENT, ROPE

    from pallas_kernels.sparse_mla_attention import sparse_mla_attention

    rng = np.random.default_rng(7)
    L, R, S, H, K = 2, 3, 24, 4, 11
    W = LATENT + ROPE
    values = rng.standard_normal((L, R, S, W)).astype(np.float32)
    values[..., :LATENT] *= np.exp(rng.uniform(-3, 3, (L, R, S, 1))).astype(np.float32)
    kv = FP8_LAYOUT.pack(jnp.asarray(values[..., :LATENT]), jnp.asarray(values[..., LATENT:]))
    slots = rng.integers(0, 16, (R, K)).astype(np.int32)
    slots[0, 2] = slots[0, 5] = -1
    slots[1, 3] = slots[1, 0]  # a repeat
    slots[2] = -1  # nothing valid: zeros
    nan_word = FP8_LAYOUT.fill_element(float("nan"))
    kv = kv.at[:, :, 16:].set(nan_word).at[0].set(nan_word)
    query = jnp.asarray(rng.standard_normal((R, H, W)), query_dtype)
    attend = lambda impl, **tuning: np.asarray(  # noqa: E731
        sparse_mla_attention(
            query, kv, 1, jnp.asarray(slots), latent_dim=LATENT, sm_scale=0.125, layout=FP8_LAYOUT, implementation=impl,
            **tuning,
        )
    )
    ref, got = attend("reference"), attend("tpu", block_k=8)  # two key blocks
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref, rtol=tolerance, atol=tolerance * np.abs(ref).max())


# ---- whole decode steps through attention_layer -----------------------------------------------


def device_pool_states(make_states):
    """test_attention_layer.make_states with the host pool in device memory: JAX 0.11's TPU
    interpret mode cannot lower a jit taking a pinned_host array on CPU (docs/tpu.md); on a TPU
    the pool stays pinned_host."""

    def make(dtype, layout_kind, miss_read="copy"):
        from hisparse_jax import memory

        hisparse, full = make_states(dtype, layout_kind, miss_read)
        pool = jax.device_put(hisparse.host_pool, memory.sharding(memory.DEVICE))
        return hisparse.replace(host_pool=pool), full

    return make


@pytest.mark.parametrize(
    "dtype, layout_kind, shared_second_layer",
    [
        # All under -m slow (30-50 s each in interpret mode; CI time): the kernel tests above
        # compare every TPU kernel with its reference.
        pytest.param(jnp.float32, "float32", False, marks=pytest.mark.slow),
        pytest.param(jnp.bfloat16, "bfloat16", False, marks=pytest.mark.slow),
        pytest.param(jnp.float32, "fp8_e4m3", False, marks=pytest.mark.slow),
        pytest.param(jnp.float32, "float32", True, marks=pytest.mark.slow),
    ],
)
def test_decode_steps_equal_reference_implementation(monkeypatch, dtype, layout_kind, shared_second_layer):
    """test_attention_layer's multi-step decode (fast path, the transition past B, hits, misses,
    evictions; prefill through the TPU write): with implementation="tpu" the counters and every
    state array (plan tables, device buffer, host pool) equal the reference implementation's bit
    for bit, HiSparse equals no-offload bit for bit, and the outputs are within the f32
    tolerance of the reference (bf16 rows: the bf16 tolerance). shared_second_layer: layer 1
    replays layer 0's plan (the copy-only path of shared_attention_layer)."""
    import test_attention_layer as tal

    monkeypatch.setattr(tal, "make_states", device_pool_states(tal.make_states))
    kwargs = dict(
        steps=16, prompt_lens=[3, 12, 40], select=tal.recent_and_random, seed=5, shared_second_layer=shared_second_layer
    )
    got, _, _, got_state = tal.run_decode("tpu", dtype, layout_kind, **kwargs)
    want, _, _, want_state = tal.run_decode("reference", dtype, layout_kind, **kwargs)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2  # fp8 rows, f32 queries: full-precision matmuls
    misses = 0
    for t, ((out_h, out_f, hits, m, topk, _), (ref_h, _, ref_hits, ref_m, ref_topk, _)) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(topk, ref_topk)
        np.testing.assert_array_equal(hits, ref_hits, err_msg=f"step {t}: hits")
        np.testing.assert_array_equal(m, ref_m, err_msg=f"step {t}: misses")
        assert np.all(np.isfinite(out_h)), f"step {t}: read an unwritten (NaN) row"
        np.testing.assert_array_equal(out_h, out_f, err_msg=f"step {t}: HiSparse != no-offload")
        np.testing.assert_allclose(out_h, ref_h, rtol=tolerance, atol=tolerance, err_msg=f"step {t}")
        misses += m.sum()
    assert misses > 0
    for name in ("buffer_tokens", "lru_slots", "device_buffer", "host_pool", "seq_lens", "host_page_table"):
        np.testing.assert_array_equal(bits(getattr(got_state, name)), bits(getattr(want_state, name)), err_msg=name)


def bits(array):
    """The array's bit patterns (NaNs included; numpy does not compare bf16 NaNs as equal)."""
    array = np.asarray(array)
    return array.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[array.dtype.itemsize])


# ---- the plan's tiles: bit-identical, and what it holds in VMEM at production sizes --------------


@functools.partial(jax.jit, static_argnames="tiles")
def plan_in_tiles(buffer_tokens, lru, scratch, topk, lengths, page_table, tiles):
    """test_swap_in.run_plan through the TPU kernel with `tiles` (rows, cols) of its matrices."""
    from pallas_kernels.swap_in.pallas_tpu import swap_in_plan_tpu

    plan, tokens, lru, scratch = swap_in_plan_tpu(
        buffer_tokens[None], lru[None], scratch, jnp.int32(0), topk, lengths, page_table, page_size=test_swap_in.PAGE_SIZE,
        tiles=tiles,
    )  # fmt: skip
    return plan, tokens[0], lru[0], scratch


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(case=swap_in_cases())
def test_plan_in_small_tiles_matches_oracle(case):
    """The plan in 4 x 4 tiles (B = 12: 3 row tiles, K = 8: 2, and column tiles of B, K and the
    page table's entries alike): every tiled loop runs several times and every accumulation
    crosses tiles; the result is the oracle's, bit for bit, as with whole-axis tiles."""
    bt, lru, topk, lengths = case
    R, C = len(lengths), C_RAND
    assert test_swap_in.B_RAND % 4 == 0 and test_swap_in.K_RAND % 4 == 0 and (C // test_swap_in.PAGE_SIZE) % 4 == 0
    outputs = plan_in_tiles(
        jnp.asarray(bt, jnp.int32), jnp.asarray(lru, jnp.int32), jnp.full((R, C), swap_in.SCRATCH_EMPTY, jnp.int32),
        jnp.asarray(topk, jnp.int32), jnp.asarray(lengths, jnp.int32), jnp.asarray(test_swap_in.identity_page_table(R, C)),
        tiles=(4, 4),
    )  # fmt: skip
    plan, tokens, new_lru, _ = jax.tree.map(np.asarray, outputs)
    assert_matches_oracle(plan, tokens, new_lru, oracle_batch(bt, lru, topk, lengths, C))


def _padded_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of a 32-bit TPU value of `shape` as vregs hold it: the last dim padded to 128 lanes,
    the one before to 8 sublanes (a 1-D value as one row)."""
    *lead, a, b = (1,) * (2 - len(shape)) + tuple(shape)
    return 4 * math.prod(lead) * -(-a // 8) * 8 * -(-b // 128) * 128


def vmem_bound(module_text: str) -> dict:
    """A static upper bound on what a Mosaic kernel holds in VMEM, from its MLIR: its memref
    operands (pipeline blocks and scratch, each counted twice as if double-buffered) plus, at the
    worst line of the kernel, every vector value live there (defined, and used on or after it; a
    value used inside a loop lives to the loop's end), each as big as its padded vreg tiles (a
    mask counted as 32-bit). The compiler keeps less (many values stay in vregs); this only shows
    that nothing needs more."""
    vector = re.compile(r"vector<((?:\d+x)*\d+)x(?:i1|i8|i16|i32|f32|bf16)>")
    memref = re.compile(r"memref<((?:\d+x)*\d+)xi32, #tpu\.memory_space<vmem>>")
    size_of = lambda text: _padded_bytes(tuple(int(d) for d in text.split("x")))  # noqa: E731
    lines = module_text.split("func.func @")[1].splitlines()  # the kernel (its blocks' index maps follow)
    operands = sum(2 * size_of(m) for m in memref.findall(lines[0]))
    defined, last_use, sizes, regions = {}, {}, {}, []  # regions: (open line, close line)
    open_at = [0] * (lines[0].count("{") - lines[0].count("}"))  # the kernel's own body
    for n, line in enumerate(lines[1:], 1):
        target, _, rest = line.partition(" = ") if re.match(r"\s*%[\w:#]+(, %[\w:#]+)* = ", line) else ("", "", line)
        for name in re.findall(r"%[\w]+", rest):
            last_use.setdefault(name, []).append(n)
        types = vector.findall(rest.split("->")[-1] if "->" in rest else rest)
        if target and types:
            for name in re.findall(r"%[\w]+", target):
                defined[name], sizes[name] = n, sum(size_of(t) for t in (types if "->" in rest else types[-1:]))
        for brace in re.findall(r"[{}]", line):
            if brace == "{":
                open_at.append(n)
            else:
                regions.append((open_at.pop(), n))
    live_until = {}
    for name, start in defined.items():
        end = start
        for use in last_use.get(name, []):
            loops = [close for open_, close in regions if start < open_ <= use <= close]  # re-read every iteration
            end = max(end, use, *loops)
        live_until[name] = end
    live = [0] * (len(lines) + 1)
    for name, start in defined.items():
        for n in range(start, live_until[name] + 1):
            live[n] += sizes[name]
    largest = max(sizes.values())
    return dict(operands=operands, largest_value=largest, live_at_worst=max(live), total=operands + max(live))


def lowered_mosaic(fn, *args) -> str:
    """The Mosaic MLIR of the pallas_call in fn(*args), compiled for a TPU v5e, lowered on the CPU."""
    from jax import export
    from jax._src import mesh as mesh_lib
    from jax._src.pallas.mosaic import lowering

    modules = []
    lower = lowering.lower_jaxpr_to_pipelined_module

    def keep(*a, **k):
        module = lower(*a, **k)
        modules.append(module.operation.get_asm())
        return module

    device = mesh_lib.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(common, "tpu_interpret", lambda: False)
        patch.setattr(lowering, "lower_jaxpr_to_pipelined_module", keep)
        with jax.sharding.use_abstract_mesh(mesh):
            export.export(jax.jit(fn), platforms=("tpu",))(*args)
    assert len(modules) == 1
    return modules[0]


V5E_SCOPED_VMEM = 16 * 2**20  # the default scoped VMEM limit of a v5e TensorCore (v6e: 32 MiB)


def test_plan_fits_v5e_vmem_at_production_sizes():
    """top_k 2048, device_buffer_size 6144, a 128k context in pages of 64: lowered to Mosaic for a
    v5e, the plan's static VMEM bound (vmem_bound) stays under v5e's 16 MiB scoped VMEM (7.3 MiB
    on 2026-12-03: 2.6 MiB of operands counted twice, 4.6 MiB of live values); no value is more
    than one [128, 1024] int32 tile (512 KiB). Untiled, one [B, B] matrix alone was 144 MiB and
    the bound 740 MiB."""
    L, R, B, K, C, page = 2, 4, 6144, 2048, 131072, 64
    i32, spec = jnp.int32, jax.ShapeDtypeStruct
    fn = functools.partial(swap_in.swap_in_plan, page_size=page, implementation="tpu")
    args = [spec((L, R, B), i32), spec((L, R, B), i32), spec((R, C), i32), spec((), i32), spec((R, K), i32),
            spec((R,), i32), spec((R, C // page), i32)]  # fmt: skip
    bound = vmem_bound(lowered_mosaic(fn, *args))
    assert bound["largest_value"] <= 128 * 1024 * 4, bound
    assert bound["total"] < V5E_SCOPED_VMEM, bound


# ---- Mosaic lowering (no TPU needed) ----------------------------------------------------------


def test_kernels_lower_to_mosaic(monkeypatch):
    """Compiled (not interpreted), every TPU kernel lowers to a Mosaic tpu_custom_call at
    DeepSeek-V3.2 row sizes (576-wide bf16 rows, 512 latent) for a TPU v5e, exported from CPU.
    fp8 rows included. This checks JAX's Pallas -> Mosaic lowering only; the Mosaic compiler in libtpu (tiling,
    VMEM limits) runs on a TPU alone."""
    from jax import export
    from jax._src import mesh as mesh_lib

    from hisparse_jax.row_layout import KVRowLayout
    from pallas_kernels import sparse_mla_attention as sma

    FP8 = KVRowLayout(512, 64, "fp8_e4m3")
    monkeypatch.setattr(common, "tpu_interpret", lambda: False)
    device = mesh_lib.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    L, R, B, K, C, P, page, S, W, H = 2, 4, 256, 128, 1024, 64, 16, 4096, 576, 128
    i32, bf16, spec = jnp.int32, jnp.bfloat16, jax.ShapeDtypeStruct
    cases = {
        "plan": (
            functools.partial(swap_in.swap_in_plan, page_size=page, implementation="tpu"),
            [spec((L, R, B), i32), spec((L, R, B), i32), spec((R, C), i32), spec((), i32), spec((R, K), i32),
             spec((R,), i32), spec((R, P), i32)],
        ),
        "copy": (
            functools.partial(row_copy.copy_host_rows_to_buffer, implementation="tpu"),
            [spec((L, S, W), bf16), spec((L, R, B + 1, W), bf16), spec((), i32), spec((R, K), i32), spec((R, K), i32),
             spec((R,), i32)],
        ),
        "write": (
            functools.partial(row_copy.write_rows_to_host, implementation="tpu"),
            [spec((L, S, W), bf16), spec((), i32), spec((R, W), bf16), spec((R,), i32)],
        ),
        "attention": (
            functools.partial(sma.sparse_mla_attention, latent_dim=512, sm_scale=0.1, implementation="tpu"),
            [spec((R, H, W), bf16), spec((L, R, B + 1, W), bf16), spec((), i32), spec((R, K), i32)],
        ),
        "attention_fp8": (
            functools.partial(
                sma.sparse_mla_attention, latent_dim=512, sm_scale=0.1, layout=FP8, implementation="tpu"
            ),
            [spec((R, H, W), bf16), spec((L, R, B + 1, FP8.width), jnp.uint32), spec((), i32), spec((R, K), i32)],
        ),
    }  # fmt: skip
    with jax.sharding.use_abstract_mesh(mesh):
        for name, (fn, args) in cases.items():
            module = export.export(jax.jit(fn), platforms=("tpu",))(*args).mlir_module()
            assert "tpu_custom_call" in module, name


# ---- the shared model fixture -----------------------------------------------------------------


@pytest.mark.slow  # ~50 s: the whole fixture model on the TPU kernels in interpret mode
def test_fixture_model_greedy_decoding_reproduces_its_tokens():
    """tests/fixtures/deepseek_v32_tiny decoded with HiSparse and implementation="tpu" (every
    kernel in TPU interpret mode): the golden greedy tokens and logits, as test_models checks
    for the other implementations. The runner puts the host pool in device memory itself
    (memory.host_pool_kind: TPU interpret mode cannot lower with a pinned_host operand on the CPU)."""
    import test_models

    from hisparse_jax import memory
    from hisparse_jax.config import HiSparseConfig
    from models.dsa.runner import ModelRunner
    from models.dsa.generate import generate
    from models.dsa.loading import load_hf_checkpoint

    path = test_models.DEEPSEEK
    with np.load(f"{path}/golden.npz") as data:
        golden = dict(data)
    model = load_hf_checkpoint(path, dtype=jnp.float32)
    top_k, buffer = test_models.BUFFERS[path]
    runner = ModelRunner(model, prefill_chunk=16, implementation="tpu")
    assert runner.host_memory_kind == memory.DEVICE and ModelRunner(model).host_memory_kind == memory.PINNED_HOST
    steps = golden["greedy_tokens"].shape[1]
    config = HiSparseConfig(top_k=top_k, device_buffer_size=buffer)
    out = generate(runner, golden["input_ids"], steps, hisparse=config, page_size=16, fill_value=np.nan)
    np.testing.assert_array_equal(out.tokens, golden["greedy_tokens"])
    test_models.assert_logits_close(out.logits, golden["greedy_logits"])
    assert (out.num_misses.sum(axis=0) > buffer).all()  # it really evicts
