"""The DSA indexer's kernels (pallas_kernels/indexer_scores/, topk.py) in interpret mode
against their jnp references, and models/dsa/indexer.py's decode_topk against the model's own path
(index_scores per request + select_topk).

Scores: within a tolerance with an absolute floor, -inf exactly where a key is not visible,
never NaN (the key rows past each position are NaN). Top-k: exactly lax.top_k's positions and
order on the same scores, ties included."""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.dsa.indexer import decode_topk, index_scores, quantize_keys, quantize_queries, select_topk
from pallas_kernels import common, indexer_scores, topk

J, R, C, G, I = 2, 5, 300, 6, 32
POSITIONS = [250, -1, 9, C - 1]  # b = 4 < R: a long context, an inactive slot, one shorter than K, a full one
KEY_DTYPES = ["bfloat16", "float32", "fp8_e4m3", "fp8_e4m3+q8"]  # +q8: fp8 queries too (w8a8)


def make_inputs(key_dtype: str, seed: int = 0, positions=POSITIONS):
    """(q [b, G, I], w f32[b, G], keys [J, R, C, I], scales f32[J, R, C or 0], positions i32[b]).
    Key rows past each slot's position are NaN (stale memory must not leak into a score); rows
    10..19 of every slot repeat rows 0..9 (tied scores)."""
    rng = np.random.default_rng(seed)
    b = len(positions)
    keys = rng.standard_normal((J, R, C, I)).astype(np.float32)
    keys[:, :, 10:20] = keys[:, :, 0:10]
    for slot, position in enumerate(positions):
        keys[:, slot, position + 1 :] = np.nan
    keys = jnp.asarray(keys)
    q_dtype = jnp.float32 if key_dtype == "float32" else jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((b, G, I)), q_dtype)
    w = jnp.asarray(rng.standard_normal((b, G)), jnp.float32)  # negative weights too: -0.0 and 0 ties
    if key_dtype.startswith("fp8_e4m3"):
        keys, scales = quantize_keys(keys)  # NaN rows get NaN scales, also never read
        if key_dtype.endswith("+q8"):
            q, w = quantize_queries(q, w)  # f8e4m3[b, G, I], the scales in w
    else:
        keys, scales = keys.astype(key_dtype), jnp.zeros((J, R, 0), jnp.float32)
    return q, w, keys, scales, jnp.asarray(positions, jnp.int32)


@functools.partial(jax.jit, static_argnames=("implementation", "block_c", "blocks_per_program", "keys_major"))
def scores_of(q, w, keys, scales, layer, positions, implementation, block_c=64, blocks_per_program=None, keys_major=None):
    tuning = {"block_c": block_c, "blocks_per_program": blocks_per_program, "keys_major": keys_major} if implementation == "pallas" else {}
    return indexer_scores.index_scores_masked(q, w, keys, scales, layer, positions, implementation=implementation, **tuning)


@pytest.mark.parametrize(
    "key_dtype, blocks_per_program, keys_major",
    [("bfloat16", None, None), ("float32", None, None), ("fp8_e4m3", None, None), ("bfloat16", 1, None), ("fp8_e4m3", 2, False),
     ("fp8_e4m3", 2, True), ("float32", None, True), ("fp8_e4m3+q8", None, None), ("fp8_e4m3+q8", 2, False)],
)
def test_scores_kernel_matches_reference(key_dtype, blocks_per_program, keys_major):
    inputs = make_inputs(key_dtype)
    positions = np.asarray(inputs[-1])
    ref = np.asarray(scores_of(*inputs[:4], 1, inputs[4], "reference"))
    got = np.asarray(scores_of(*inputs[:4], jnp.int32(1), inputs[4], "pallas", blocks_per_program=blocks_per_program, keys_major=keys_major))
    visible = np.arange(C)[None, :] <= positions[:, None]
    assert not np.isnan(got).any()
    assert np.all(got[~visible] == -np.inf) and np.all(np.isfinite(got[visible]))
    np.testing.assert_array_equal(ref[~visible], -np.inf)
    floor = 1e-5 * np.abs(ref[visible]).max()  # different summation orders: an absolute floor
    if key_dtype.endswith("+q8") and common.fp8_dots_round_in_mma():
        # The fp8 x fp8 dot accumulates on the fp8 tensor cores (~14 significant bits on Hopper):
        # each score within 2**-8 of its terms' absolute sum (the scores of |q|, |w|, |keys|).
        q, w, keys = (jnp.abs(x.astype(jnp.float32)).astype(x.dtype) for x in inputs[:3])
        terms = np.asarray(scores_of(q, w, keys, inputs[3], 1, inputs[4], "reference"))
        floor = 2.0**-8 * terms[visible]
    np.testing.assert_allclose(got[visible], ref[visible], rtol=1e-5, atol=floor)


def tied_scores(seed=0):
    """f32[6, C] with many exact ties (small integers, +0 and -0), masked runs, a row with no
    visible score, rows with fewer visible scores than K, a NaN and infinities."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, (6, C)).astype(np.float32)
    x[0, :40] = rng.choice(np.array([0.0, -0.0], np.float32), 40)  # -0 ties with +0
    x[1, 30:] = -np.inf  # 30 visible: fewer than K = 64
    x[2] = -np.inf  # an inactive slot
    x[3, ::3] = -np.inf
    x[3, 5], x[3, 7], x[3, 8] = np.nan, np.inf, np.inf  # NaN: first, reported -1 (as select_topk)
    x[4] = rng.standard_normal(C).astype(np.float32)  # distinct values: the early exit
    x[5, :] = 1.0  # one tie across the row
    return jnp.asarray(x)


@functools.partial(jax.jit, static_argnames=("k", "implementation", "tuning"))
def topk_of(scores, k, implementation, tuning=()):
    """tuning: topk_indices_pallas's keyword arguments as a tuple of (name, value) pairs."""
    return topk.topk_indices(scores, k, implementation=implementation, **dict(tuning) if implementation == "pallas" else {})


# Radix: slices of 64 scores (5 programs per row), one-hot products over 16 or 32, candidates
# in registers 16 / 32 at a time (row 5's 300 tied candidates are re-read on every step).
RADIX_SMALL = (("method", "radix"), ("slice_len", 64), ("sub", 16), ("split_chunk", 32), ("chunk", 16))
RADIX_ONE_SLICE = (("method", "radix"), ("sub", 32), ("chunk", 32), ("onehot", "int8"))  # C = 300: one slice, sub-chunks looped


def bisect(order, chunk=32768):
    return (("method", "bisect"), ("order", order), ("chunk", chunk))


@pytest.mark.parametrize(
    "k, tuning",
    [(16, RADIX_SMALL), (64, RADIX_SMALL), (64, RADIX_SMALL + (("row_plan", True),)), (64, RADIX_ONE_SLICE), (16, bisect("kernel")),
     (16, bisect("fused", 64)), (64, bisect("xla"))],
)  # bisect chunk 64: the row spans 5 chunks and each pass re-reads it from memory; row_plan True: planned once a row
def test_topk_kernel_equals_lax_top_k_with_ties(k, tuning):
    scores = tied_scores()
    expected = np.asarray(topk_of(scores, k, "reference"))
    assert np.any(expected == -1) and np.any(expected[0] >= 0)
    np.testing.assert_array_equal(np.asarray(topk_of(scores, k, "pallas", tuning)), expected)


def test_radix_topk_on_distinct_scores_over_many_slices():
    """Distinct random scores with a masked tail: the threshold bucket holds a few of many
    candidates, picked out by the bisection's early exit."""
    x = np.random.default_rng(3).standard_normal((3, 1000)).astype(np.float32)
    x[1, 700:] = -np.inf
    scores = jnp.asarray(x)
    expected = np.asarray(topk_of(scores, 100, "reference"))
    for row_plan in (True, False):
        tuning = (("slice_len", 128), ("sub", 32), ("chunk", 64), ("row_plan", row_plan))
        np.testing.assert_array_equal(np.asarray(topk_of(scores, 100, "pallas", tuning)), expected)


def test_default_launch_choices_follow_the_measurements():
    """The size rules behind the defaults (topk.default_method, indexer_scores.default_blocking)
    at the sizes the H200 measured them (2026-12-01)."""
    assert [topk.default_method(b, c) for b, c in [(13, 32768), (47, 32768), (190, 32768), (47, 65536), (47, 131072)]] == [
        "radix", "bisect", "bisect", "radix", "radix"
    ]
    assert indexer_scores.default_blocking(13, 32768, False) == (64, 4, False)
    assert indexer_scores.default_blocking(47, 32768, False) == (64, 16, False)
    assert [indexer_scores.default_blocking(b, c, True) for b, c in [(37, 61440), (47, 32768), (23, 40960), (1, 61440)]] == [
        (64, 16, True), (64, 16, True), (128, 1, True), (128, 1, True)
    ]  # fp8 keys: measured 2026-12-04 (tenth session)


def test_digit_is_monotone_in_the_score():
    """The radix digit never decreases along sorted scores (else the bucket select would be
    wrong), ties -0 with +0, and spreads a typical score range over many buckets."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 9, 4000), [0.0, -0.0, np.inf, 7e4, -7e4, 1e-30, -1e-30, np.nan]])
    x = np.sort(x.astype(np.float32))  # NaN last, as the keys rank it
    digits = np.asarray(common.score_digit(jnp.asarray(x)))
    assert np.all(np.diff(digits) >= 0) and digits.min() >= 0 and digits.max() < topk.pallas_triton.DIGITS
    assert common.score_digit(jnp.float32(-0.0)) == common.score_digit(jnp.float32(0.0))
    assert len(np.unique(np.asarray(common.score_digit(jnp.asarray(rng.standard_normal(4096), jnp.float32))))) > 40


def test_reference_ties_minus_zero_with_zero():
    """-0.0 and +0.0 tie, lower position first, on every platform (lax.top_k ranks +0 first on
    the CPU and ties them on the GPU)."""
    scores = jnp.asarray([[-0.0, 0.0, 1.0, -0.0, -1.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(topk.topk_reference(scores, 5)), [[2, 0, 1, 3, 4]])
    np.testing.assert_array_equal(np.asarray(topk_of(scores, 5, "pallas")), [[2, 0, 1, 3, 4]])
    np.testing.assert_array_equal(np.asarray(topk_of(scores, 5, "pallas", bisect("kernel"))), [[2, 0, 1, 3, 4]])


@pytest.mark.parametrize("tuning", [RADIX_SMALL, bisect("fused")])
def test_topk_kernel_with_k_past_the_row(tuning):
    scores = tied_scores()[:, :40]  # K = 64 > C = 40: -1 past the row, as select_topk pads
    expected = np.asarray(topk_of(scores, 64, "reference"))
    assert np.all(expected[:, 40:] == -1)
    np.testing.assert_array_equal(np.asarray(topk_of(scores, 64, "pallas", tuning)), expected)


@pytest.mark.parametrize("key_dtype", KEY_DTYPES)
def test_decode_topk_kernels_and_reference(key_dtype):
    q, w, keys, scales, positions = make_inputs(key_dtype, seed=1)
    K = 16
    select = jax.jit(functools.partial(decode_topk, k=K), static_argnames=("implementation", "fused_histogram"))
    got = np.asarray(select(q, w, keys, scales, jnp.int32(1), positions, implementation="pallas"))
    # The scoring kernel counting the top-k's histograms selects the same (fused_histogram).
    fused = select(q, w, keys, scales, jnp.int32(1), positions, implementation="pallas", fused_histogram=True)
    np.testing.assert_array_equal(np.asarray(fused), got)
    # The kernels' selection is lax.top_k's on the kernel's own scores ...
    own_scores = scores_of(q, w, keys, scales, 1, positions, "pallas")
    np.testing.assert_array_equal(got, np.asarray(topk.topk_reference(own_scores, K)))
    assert np.all(got[1] == -1) and np.all(got[2, 10:] == -1) and np.all(got[2, :10] >= 0)
    # ... and the reference is the model's own decode path, bit for bit.
    b = q.shape[0]
    fp8 = key_dtype.startswith("fp8_e4m3")
    model_scores = jax.vmap(index_scores)(q[:, None], w[:, None], keys[1, :b], scales[1, :b] if fp8 else None)[:, 0]
    allowed = jnp.arange(C)[None, :] <= positions[:, None]
    np.testing.assert_array_equal(
        np.asarray(select(q, w, keys, scales, 1, positions, implementation="reference")),
        np.asarray(select_topk(model_scores, allowed, K)),
    )


@pytest.mark.parametrize("key_dtype, keys_major", [("bfloat16", False), ("fp8_e4m3+q8", True), ("float32", True)])
def test_scoring_kernel_counts_the_topk_histograms_of_what_it_writes(key_dtype, keys_major):
    """histogram=True: the same scores, and per program (2 blocks of 32 keys) the digit counts the
    radix top-k's histogram kernel makes of them over slices of 64 (masked keys not counted;
    slot 1 is inactive, slot 2 mostly masked, the rows past each position NaN)."""
    q, w, keys, scales, positions = make_inputs(key_dtype, seed=2)
    tuning = dict(block_c=32, blocks_per_program=2, keys_major=keys_major)
    plain = indexer_scores.index_scores_masked_pallas(q, w, keys, scales, jnp.int32(0), positions, **tuning)
    scores, hist = indexer_scores.index_scores_masked_pallas(q, w, keys, scales, jnp.int32(0), positions, histogram=True, **tuning)
    np.testing.assert_array_equal(np.asarray(scores), np.asarray(plain))
    expected = topk.pallas_triton._topk_radix(scores, 16, slice_len=64, sub=32, stop_after="histogram")
    assert hist.shape == expected.shape == (4, 5, topk.DIGITS)
    np.testing.assert_array_equal(np.asarray(hist), np.asarray(expected))
    visible = np.minimum(np.asarray(positions) + 1, C)  # per slot, the keys a count may include
    np.testing.assert_array_equal(np.asarray(hist).sum(axis=(1, 2)), visible)
    with pytest.raises(ValueError, match="power-of-two blocks_per_program"):
        indexer_scores.index_scores_masked_pallas(q, w, keys, scales, 0, positions, histogram=True, block_c=32, blocks_per_program=3)
    with pytest.raises(ValueError, match=r"hist must be i32\[b, S, N\] = \(4, 3, 256\)"):
        topk.topk_indices_pallas(scores, 16, hist=hist, slice_len=128)
    with pytest.raises(ValueError, match="for method 'radix', not 'bisect'"):
        topk.topk_indices_pallas(scores, 16, method="bisect", hist=hist, slice_len=64)


def test_decode_topk_fuses_the_histogram_where_asked_or_where_the_scoring_still_fills_the_gpu(monkeypatch):
    """fused_histogram=True fuses; None follows FUSED_TOPK_HISTOGRAM, and only for batches whose
    2048-key programs still make two waves (4 requests of 300 keys do not: 4 programs)."""
    from models.dsa import indexer

    q, w, keys, scales, positions = make_inputs("bfloat16")

    def has_histogram_kernel(**kwargs):
        select = functools.partial(decode_topk, k=16, implementation="pallas", **kwargs)
        eqns = all_eqns(jax.make_jaxpr(select)(q, w, keys, scales, jnp.int32(0), positions).jaxpr)
        names = [str(e.params["name"]) for e in eqns if e.primitive.name == "pallas_call"]
        assert "hisparse_indexer_scores" in names  # the names are what the test reads
        return "hisparse_indexer_topk_histogram" in names

    assert has_histogram_kernel() and not has_histogram_kernel(fused_histogram=True)
    monkeypatch.setattr(indexer, "FUSED_TOPK_HISTOGRAM", True)
    monkeypatch.setattr(common, "num_sms", lambda: 132)  # as on the H200
    assert has_histogram_kernel()  # too small a batch
    monkeypatch.setattr(common, "num_sms", lambda: 2)  # 4 programs make two waves of 2 SMs
    assert not has_histogram_kernel()
    assert not indexer_scores.histogram_fills_the_gpu(1, 131072, 132) and indexer_scores.histogram_fills_the_gpu(9, 131072, 132)


def test_the_scoring_kernel_reads_the_cache_in_place():
    """The kernel gets the whole [J, R, C, I] cache (no [b, C, I] slice copied for it)."""
    q, w, keys, scales, positions = make_inputs("bfloat16")
    jaxpr = jax.make_jaxpr(functools.partial(indexer_scores.index_scores_masked, implementation="pallas"))(
        q, w, keys, scales, jnp.int32(0), positions
    )
    eqns = all_eqns(jaxpr.jaxpr)
    calls = [e for e in eqns if e.primitive.name == "pallas_call"]
    assert len(calls) == 1
    assert tuple(keys.shape) in [tuple(v.aval.shape) for v in calls[0].invars]
    assert not any(e.primitive.name in ("slice", "dynamic_slice", "gather") for e in eqns)


def all_eqns(jaxpr) -> list:
    """The equations of a jaxpr and of the jits it calls (common.lower_once wraps each kernel)."""
    out = []
    for e in jaxpr.eqns:
        out.append(e)
        if "jaxpr" in e.params:
            out += all_eqns(getattr(e.params["jaxpr"], "jaxpr", e.params["jaxpr"]))
    return out


def test_a_kernel_called_per_layer_lowers_once():
    """Two layers' calls (the layer an i32[]) share one lowered kernel: a 61-layer model must not
    lower, and XLA compile, 61 copies of it (common.lower_once)."""
    q, w, keys, scales, positions = make_inputs("bfloat16")

    def two_layers(q, w, keys, scales, positions):
        score = functools.partial(indexer_scores.index_scores_masked, implementation="pallas")
        return score(q, w, keys, scales, jnp.int32(0), positions) + score(q, w, keys, scales, jnp.int32(1), positions)

    text = jax.jit(two_layers).lower(q, w, keys, scales, positions).as_text()
    assert text.count("func.func private @index_scores_masked_pallas") == 1, text[:2000]
    assert text.count("call @index_scores_masked_pallas") == 2


def test_shape_errors_name_both_values():
    q, w, keys, scales, positions = make_inputs("bfloat16")
    with pytest.raises(ValueError, match=r"positions length \(3\) must equal q batch \(b\) \(4\)"):
        indexer_scores.index_scores_masked(q, w, keys, scales, 0, positions[:3])
    with pytest.raises(ValueError, match=r"b = 6.*R = 5"):
        indexer_scores.index_scores_masked(jnp.zeros((6, G, I)), jnp.zeros((6, G)), keys, scales, 0, jnp.zeros(6, jnp.int32))
    with pytest.raises(ValueError, match=r"key_scales shape \(\(2, 5, 300\)\) must equal \[J, R, 0\] of the keys \(\(2, 5, 0\)\)"):
        indexer_scores.index_scores_masked(q, w, keys, jnp.zeros((J, R, C)), 0, positions)
    with pytest.raises(ValueError, match=r"layer \(2\) must be in \[0, num_layers \(2\)\)"):
        indexer_scores.index_scores_masked(q, w, keys, scales, 2, positions)
    with pytest.raises(ValueError, match=r"power-of-two head dim"):
        indexer_scores.index_scores_masked_pallas(q[..., :24], w, keys[..., :24], scales, 0, positions)
    with pytest.raises(ValueError, match=r"implementation"):
        topk.topk_indices(jnp.zeros((2, 8)), 4, implementation="tpu")


def test_kernels_lower_to_triton_for_the_h200(monkeypatch):
    """Both kernels lower to Triton at the serving sizes (b 47, C 32768, 64 x 128 heads, K 2048)
    for an abstract H200, on the CPU: a lowering rule Pallas lacks fails here, not on the GPU
    (Triton's own compilation still happens there only)."""
    monkeypatch.setattr(common, "interpret_mode", lambda: False)  # the GPU path, not the interpreter
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    )
    spec = jax.ShapeDtypeStruct
    b, context = 47, 32768
    with jax.sharding.use_abstract_mesh(mesh):
        for q_dtype, key_dtype in ((jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float8_e4m3fn), (jnp.float8_e4m3fn, jnp.float8_e4m3fn)):
            scale_shape = (1, b, context) if key_dtype == jnp.float8_e4m3fn else (1, b, 0)
            args = (
                spec((b, 64, 128), q_dtype), spec((b, 64), jnp.float32), spec((1, b, context, 128), key_dtype),
                spec(scale_shape, jnp.float32), spec((), jnp.int32), spec((b,), jnp.int32),
            )  # fmt: skip
            for histogram in (False, True):
                score = functools.partial(indexer_scores.index_scores_masked_pallas, histogram=histogram)
                text = jax.jit(score).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
                assert "__gpu$xla.gpu.triton" in text
        for tuning in ({"method": "radix"}, {"method": "bisect", "order": "kernel"}, {"method": "bisect", "order": "xla"}):
            select = functools.partial(topk.topk_indices_pallas, k=2048, **tuning)
            text = jax.jit(select).trace(spec((b, context), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text
        fused = jax.jit(lambda scores, hist: topk.topk_indices_pallas(scores, 2048, hist=hist, slice_len=2048))
        text = fused.trace(spec((b, context), jnp.float32), spec((b, context // 2048, topk.DIGITS), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text and "hisparse_indexer_topk_histogram" not in text


@pytest.mark.slow
def test_bench_indexer_smoke(tmp_path):
    """benchmarks/bench_indexer.py --smoke runs end to end on the CPU with every check passing
    (~30 s; the GPU session is one call, so a crash there costs the measurement)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "bench_indexer.json"
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_indexer.py"), "--smoke", f"--out={out}"], check=True, cwd=root)
    results = json.loads(out.read_text())
    assert results["checks"] and all(c["scores"]["ok"] and c["topk_on_kernel_scores"]["ok"] for c in results["checks"])
    assert not results["errors"]
