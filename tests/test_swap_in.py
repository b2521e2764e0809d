"""Swap-in: the jnp reference and the Pallas kernel against the contract, and against each other.

Hand-written cases follow SGLang's own swap-in tests; randomised cases (hypothesis) hold both
implementations to the plain-Python oracle in swap_in_oracle.py, bit-exact in every output and
state field.
"""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.row_layout import KVRowLayout
from pallas_kernels import row_copy, swap_in
from swap_in_oracle import swap_in_one_request

IMPLEMENTATIONS = ["reference", "pallas"]
PAGE_SIZE = 4


def identity_page_table(R, C):
    """Request r's pages are r*P .. r*P+P-1, so host slot = r * C + position."""
    P = C // PAGE_SIZE
    return np.arange(R * P, dtype=np.int32).reshape(R, P)


@functools.partial(jax.jit, static_argnames=("implementation",))
def run_plan(buffer_tokens, lru, scratch, topk, lengths, page_table, implementation):
    """One layer (L = 1) of swap-in planning."""
    plan, tokens, lru, scratch = swap_in.swap_in_plan(
        buffer_tokens[None], lru[None], scratch, 0, topk, lengths, page_table, page_size=PAGE_SIZE,
        implementation=implementation,
    )
    return plan, tokens[0], lru[0], scratch


def plan_numpy(buffer_tokens, lru, topk, lengths, implementation, C=64):
    R = len(lengths)
    scratch = jnp.full((R, C), swap_in.SCRATCH_EMPTY, jnp.int32)
    plan, tokens, new_lru, scratch = run_plan(
        jnp.asarray(buffer_tokens, jnp.int32), jnp.asarray(lru, jnp.int32), scratch, jnp.asarray(topk, jnp.int32),
        jnp.asarray(lengths, jnp.int32), jnp.asarray(identity_page_table(R, C)), implementation,
    )
    assert np.all(np.asarray(scratch) == swap_in.SCRATCH_EMPTY), "scratch not restored"
    return jax.tree.map(np.asarray, plan), np.asarray(tokens), np.asarray(new_lru)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
class TestSGLangCases:
    B = 8

    def test_fast_path_is_a_pure_gather(self, implementation):
        topk = [[5, 0, 3, -1], [2, 2, 1, 0]]
        bt = np.full((2, self.B), -1)
        lru = np.tile(np.arange(self.B), (2, 1))
        plan, tokens, new_lru = plan_numpy(bt, lru, topk, [6, 8], implementation)
        np.testing.assert_array_equal(plan.slots, topk)
        np.testing.assert_array_equal(plan.num_misses, [0, 0])
        np.testing.assert_array_equal(plan.num_hits, [3, 3])  # distinct positions
        np.testing.assert_array_equal(plan.miss_device_slots, -1)
        np.testing.assert_array_equal(tokens, bt)
        np.testing.assert_array_equal(new_lru, lru)

    def test_hits_and_newest_resolve(self, implementation):
        bt = [[10, 11, 12, 13, 14, 15, 16, 17]]
        lru = [[0, 1, 2, 3, 4, 5, 6, 7]]
        # n = 20: newest is 19 -> reserved slot 8; 12 and 16 are held by slots 2 and 6.
        plan, tokens, _ = plan_numpy(bt, lru, [[12, 19, 16, -1]], [20], implementation)
        np.testing.assert_array_equal(plan.slots, [[2, self.B, 6, -1]])
        np.testing.assert_array_equal(plan.num_hits, [3])
        np.testing.assert_array_equal(plan.num_misses, [0])
        np.testing.assert_array_equal(tokens, bt)

    def test_lru_moves_hits_to_most_recent(self, implementation):
        bt = [[10, 11, 12, 13, 14, 15, 16, 17]]
        lru = [[3, 1, 4, 0, 5, 2, 6, 7]]  # slot 3 least recent
        plan, _, new_lru = plan_numpy(bt, lru, [[14, 13, -1, -1]], [20], implementation)
        # Hit slots 4 and 3 go to the end in their old relative order (3 before 4).
        np.testing.assert_array_equal(new_lru, [[1, 0, 5, 2, 6, 7, 3, 4]])

    def test_miss_reuses_lru_head_and_copies_the_right_row(self, implementation):
        bt = [[10, 11, 12, 13, 14, 15, 16, 17]]
        lru = [[5, 1, 4, 0, 3, 2, 6, 7]]
        plan, tokens, new_lru = plan_numpy(bt, lru, [[3, 11, 7, -1]], [20], implementation)
        # 11 hits slot 1; misses 3 then 7 take the LRU non-hit slots 5 then 4.
        np.testing.assert_array_equal(plan.slots, [[5, 1, 4, -1]])
        np.testing.assert_array_equal(plan.num_misses, [2])
        np.testing.assert_array_equal(plan.miss_device_slots[0, :3], [5, 4, -1])
        np.testing.assert_array_equal(plan.miss_host_slots[0, :3], [3, 7, -1])  # request 0: slot = position
        np.testing.assert_array_equal(tokens, [[10, 11, 12, 13, 7, 3, 16, 17]])
        # Untouched (0, 3, 2, 6, 7), then the fresh misses (5, 4), then the hit (1).
        np.testing.assert_array_equal(new_lru, [[0, 3, 2, 6, 7, 5, 4, 1]])

    def test_batch_mixing_long_short_and_padded(self, implementation):
        bt = np.array([[10, 11, 12, 13, 14, 15, 16, 17], [0, 1, 2, -1, -1, -1, -1, -1], [-1] * 8])
        lru = np.tile(np.arange(self.B), (3, 1))
        topk = [[30, 10, 29, 30], [2, 0, -1, -1], [-1, -1, -1, -1]]
        plan, tokens, _ = plan_numpy(bt, lru, topk, [31, 3, 0], implementation)
        # Long: 30 is newest (reserved slot), 10 hits slot 0, 29 misses into slot 1 (LRU head
        # among non-hits); the duplicate 30 resolves to the reserved slot too.
        np.testing.assert_array_equal(plan.slots, [[8, 0, 1, 8], [2, 0, -1, -1], [-1, -1, -1, -1]])
        np.testing.assert_array_equal(plan.num_misses, [1, 0, 0])
        np.testing.assert_array_equal(plan.num_hits, [2, 2, 0])
        np.testing.assert_array_equal(plan.miss_host_slots[0, :2], [29, -1])
        np.testing.assert_array_equal(tokens[0], [10, 29, 12, 13, 14, 15, 16, 17])
        np.testing.assert_array_equal(tokens[1:], bt[1:])

    def test_duplicate_miss_resolves_to_one_slot(self, implementation):
        bt = [[10, 11, 12, 13, 14, 15, 16, 17]]
        lru = [list(range(8))]
        plan, _, _ = plan_numpy(bt, lru, [[5, 6, 5, 6]], [20], implementation)
        np.testing.assert_array_equal(plan.slots, [[0, 1, 0, 1]])
        np.testing.assert_array_equal(plan.num_misses, [2])


def oracle_batch(bt, lru, topk, lengths, C):
    outs = [
        swap_in_one_request(list(bt[r]), list(lru[r]), list(topk[r]), int(lengths[r]), lambda p, r=r: r * C + p)
        for r in range(len(lengths))
    ]
    return outs


def assert_matches_oracle(plan, tokens, new_lru, expected):
    for r, (slots, o_tokens, o_lru, hits, misses, o_plan) in enumerate(expected):
        np.testing.assert_array_equal(plan.slots[r], slots, err_msg=f"slots of request {r}")
        np.testing.assert_array_equal(tokens[r], o_tokens, err_msg=f"buffer_tokens of request {r}")
        np.testing.assert_array_equal(new_lru[r], o_lru, err_msg=f"lru of request {r}")
        assert plan.num_hits[r] == hits and plan.num_misses[r] == misses, r
        K = len(slots)
        host = [h for h, _ in o_plan] + [-1] * (K - len(o_plan))
        device = [d for _, d in o_plan] + [-1] * (K - len(o_plan))
        np.testing.assert_array_equal(plan.miss_host_slots[r], host)
        np.testing.assert_array_equal(plan.miss_device_slots[r], device)


R_RAND, B_RAND, K_RAND, C_RAND = 3, 12, 8, 64


@st.composite
def swap_in_cases(draw):
    """A valid state and a top-k request per slot: lengths cross B, duplicates, -1 padding."""
    bt = np.full((R_RAND, B_RAND), -1, np.int32)
    lru = np.zeros((R_RAND, B_RAND), np.int32)
    topk = np.full((R_RAND, K_RAND), -1, np.int32)
    lengths = np.zeros(R_RAND, np.int32)
    for r in range(R_RAND):
        n = draw(st.integers(0, C_RAND))
        lengths[r] = n
        lru[r] = draw(st.permutations(range(B_RAND)))
        if n > B_RAND:  # a long-path buffer holds distinct older positions, some slots empty
            held = draw(st.lists(st.integers(0, n - 2), max_size=B_RAND, unique=True))
            slots = draw(st.permutations(range(B_RAND)))[: len(held)]
            bt[r, slots] = held
        elif n > 0:
            bt[r, :n] = np.arange(n)
        if n > 0:
            entries = draw(st.lists(st.integers(-1, n - 1), min_size=K_RAND, max_size=K_RAND))
            topk[r] = entries
    return bt, lru, topk, lengths


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@hypothesis.settings(max_examples=1000, deadline=None, derandomize=True)
@hypothesis.given(case=swap_in_cases())
def test_random_cases_match_oracle(implementation, case):
    bt, lru, topk, lengths = case
    plan, tokens, new_lru = plan_numpy(bt, lru, topk, lengths, implementation, C=C_RAND)
    assert_matches_oracle(plan, tokens, new_lru, oracle_batch(bt, lru, topk, lengths, C_RAND))


def test_many_consecutive_steps_kernel_equals_reference_and_oracle():
    """Lengths grow across B over many steps; kernel and reference carry their own state."""
    rng = np.random.default_rng(7)
    R, B, K, C = 4, 16, 8, 160
    lengths = np.array([1, 10, 17, 0], np.int32)
    bt = np.full((R, B), -1, np.int32)
    for r in range(R):
        held = min(max(lengths[r] - 1, 0), B)  # stored before this step: 0 .. n-2, at most B
        bt[r, :held] = np.arange(held)
    lru = np.tile(np.arange(B, dtype=np.int32), (R, 1))
    states = {impl: (bt.copy(), lru.copy()) for impl in IMPLEMENTATIONS}
    oracle_state = (bt.copy(), lru.copy())
    fast_steps = long_steps = misses = 0
    for _ in range(60):
        # As the decode step does: on the fast path the newest token lands in slot n - 1.
        for tokens, _ in [*states.values(), oracle_state]:
            for r in range(R):
                if 0 < lengths[r] <= B:
                    tokens[r, lengths[r] - 1] = lengths[r] - 1
        topk = np.full((R, K), -1, np.int32)
        for r in range(R):
            n = lengths[r]
            if n:
                # Mostly recent positions, as a real indexer picks: many hits, some misses.
                recent = rng.integers(max(0, n - 24), n, K)
                topk[r] = np.where(rng.random(K) < 0.8, recent, rng.integers(-1, n, K))
        expected = oracle_batch(*oracle_state, topk, lengths, C)
        fast_steps += int(np.sum((lengths > 0) & (lengths <= B)))
        long_steps += int(np.sum(lengths > B))
        misses += sum(e[4] for e in expected)
        for impl in IMPLEMENTATIONS:
            plan, tokens, new_lru = plan_numpy(*states[impl], topk, lengths, impl, C=C)
            assert_matches_oracle(plan, tokens, new_lru, expected)
            states[impl] = (tokens.copy(), new_lru.copy())
        oracle_state = (np.array([e[1] for e in expected]), np.array([e[2] for e in expected]))
        lengths = np.where(lengths > 0, lengths + 1, 0).astype(np.int32)
    # Both paths ran, and the long path really evicted (not only hits).
    assert fast_steps > 0 and long_steps > 0 and misses > 0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_copy_moves_exactly_the_planned_rows(implementation):
    """Missed rows land in their slots; every other slot keeps its (NaN) content."""
    rng = np.random.default_rng(3)
    L, R, B, S, W = 2, 3, 8, 40, 6
    pool = jnp.asarray(rng.standard_normal((L, S, W)), jnp.float32)
    buffer = jnp.full((L, R, B + 1, W), jnp.nan, jnp.float32)
    miss_host = jnp.asarray([[7, 3, -1, -1, -1], [39, 0, 12, 5, 1], [-1] * 5], jnp.int32)
    miss_device = jnp.asarray([[2, 8, -1, -1, -1], [0, 1, 2, 3, 4], [-1] * 5], jnp.int32)
    num_misses = jnp.asarray([2, 5, 0], jnp.int32)
    out = jax.jit(
        functools.partial(row_copy.copy_host_rows_to_buffer, implementation=implementation), static_argnums=2
    )(pool, buffer, 1, miss_host, miss_device, num_misses)
    out = np.asarray(out)
    expected = np.full((L, R, B + 1, W), np.nan, np.float32)
    for r in range(R):
        for i in range(int(num_misses[r])):
            expected[1, r, miss_device[r, i]] = pool[1, miss_host[r, i]]
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("rows, programs", [(4, None), (4, 1), (8, 3), (16, 64)])
def test_copy_work_items_cover_every_miss(rows, programs):
    """The fixed-grid copy (programs share (request, `rows` misses) items, any number each):
    requests with no misses between others, a partial last item, a plan batch b < R (slots
    0 .. b - 1 only) and more programs than items all copy exactly the reference's rows."""
    rng = np.random.default_rng(rows * 100 + (programs or 0))
    L, R, b, B, S, W, K = 2, 6, 5, 24, 200, 6, 20
    pool = jnp.asarray(rng.standard_normal((L, S, W)), jnp.float32)
    buffer = jnp.asarray(rng.standard_normal((L, R, B + 1, W)), jnp.float32)
    num_misses = jnp.asarray([0, 20, 3, 0, 9][:b], jnp.int32)
    miss_host = jnp.asarray(np.stack([rng.choice(S, K, replace=False) for _ in range(b)]), jnp.int32)
    miss_device = jnp.asarray(np.stack([rng.choice(B + 1, K, replace=False) for _ in range(b)]), jnp.int32)
    args = (pool, buffer, 1, miss_host, miss_device, num_misses)
    expected = np.asarray(row_copy.copy_host_rows_to_buffer_reference(*args))
    copy = functools.partial(row_copy.copy_host_rows_to_buffer_pallas, rows=rows, programs=programs)
    got = jax.jit(copy, static_argnums=2)(*args)
    np.testing.assert_array_equal(np.asarray(got), expected)
    np.testing.assert_array_equal(np.asarray(got)[:, b:], np.asarray(buffer)[:, b:])  # slots past the batch untouched


def test_copy_grid_is_fixed_and_never_exceeds_the_work():
    """The copy's grid does not grow with the batch (the launch costs the same at any batch)."""
    assert row_copy.copy_grid_size(256, 2048, 16, programs=528) == 528
    assert row_copy.copy_grid_size(1, 2048, 16, programs=528) == 128  # one program per item at most
    assert row_copy.copy_grid_size(3, 5, 16, programs=528) == 3


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fp8_rows_copy_bit_exact(implementation):
    """Packed fp8 rows (uint32 words, width 164 = 128 + 32 + 4 for 512 + 64) move as opaque rows:
    the swap-in copy and the host write reproduce every bit; untouched slots keep theirs."""
    layout = KVRowLayout(512, 64, "fp8_e4m3")
    rng = np.random.default_rng(8)
    L, R, B, S = 2, 3, 8, 40
    values = rng.standard_normal((L, S, 576)).astype(np.float32)
    pool = layout.pack(jnp.asarray(values[..., :512]), jnp.asarray(values[..., 512:]))  # u32[L, S, 164]
    assert pool.shape == (L, S, 164) and pool.dtype == jnp.uint32
    nan_word = layout.fill_element(float("nan"))
    buffer = jnp.full((L, R, B + 1, layout.width), nan_word, jnp.uint32)
    miss_host = jnp.asarray([[7, 3, -1, -1, -1], [39, 0, 12, 5, 1], [-1] * 5], jnp.int32)
    miss_device = jnp.asarray([[2, 8, -1, -1, -1], [0, 1, 2, 3, 4], [-1] * 5], jnp.int32)
    num_misses = jnp.asarray([2, 5, 0], jnp.int32)
    out = jax.jit(
        functools.partial(row_copy.copy_host_rows_to_buffer, implementation=implementation), static_argnums=2
    )(pool, buffer, 1, miss_host, miss_device, num_misses)
    expected = np.full((L, R, B + 1, layout.width), nan_word, np.uint32)
    for r in range(R):
        for i in range(int(num_misses[r])):
            expected[1, r, miss_device[r, i]] = np.asarray(pool)[1, miss_host[r, i]]
    np.testing.assert_array_equal(np.asarray(out), expected)
    # Device -> host: rows land bit for bit in their slots, -1 skipped, the rest untouched.
    rows = pool[0, :4] ^ jnp.uint32(0x01010101)  # other bits than the pool's
    slots = jnp.asarray([5, -1, 0, 39], jnp.int32)
    written = np.asarray(
        jax.jit(functools.partial(row_copy.write_rows_to_host, implementation=implementation), static_argnums=1)(pool, 1, rows, slots)
    )
    expected = np.asarray(pool).copy()
    expected[1, [5, 0, 39]] = np.asarray(rows)[[0, 2, 3]]
    np.testing.assert_array_equal(written, expected)


@pytest.mark.parametrize("implementation", [*IMPLEMENTATIONS, "tpu"])
def test_every_layers_rows_written_to_host_in_one_call(implementation):
    """write_all_layer_rows_to_host (a decode step's backup after its last layer, one launch):
    rows[l, i] lands bit for bit at pool[l, host_slots[i]] in every layer, -1 skipped, every
    other row untouched; more rows than one program's block."""
    layout = KVRowLayout(512, 64, "fp8_e4m3")
    rng = np.random.default_rng(9)
    L, S, N = 3, 64, 21
    values = rng.standard_normal((L, S, 576)).astype(np.float32)
    pool = layout.pack(jnp.asarray(values[..., :512]), jnp.asarray(values[..., 512:]))  # u32[L, S, 164]
    rows = layout.pack(*(jnp.asarray(x) for x in np.split(rng.standard_normal((L, N, 576)).astype(np.float32), [512], -1)))
    slots = rng.permutation(S)[:N].astype(np.int32)
    slots[[2, 17]] = -1  # inactive requests
    written = np.asarray(jax.jit(functools.partial(row_copy.write_all_layer_rows_to_host, implementation=implementation))(
        pool, rows, jnp.asarray(slots)))  # fmt: skip
    expected = np.asarray(pool).copy()
    keep = slots >= 0
    for layer in range(L):
        expected[layer, slots[keep]] = np.asarray(rows)[layer, keep]
    np.testing.assert_array_equal(written, expected)
    with pytest.raises(ValueError, match=r"rows layers \(2\) must equal pool layers \(L\) \(3\)"):
        row_copy.write_all_layer_rows_to_host(pool, rows[:2], jnp.asarray(slots), implementation=implementation)


# ---- static shape checks ----------------------------------------------------------------------


def plan_inputs(R=2, B=8, K=4, C=32, L=1):
    return dict(
        buffer_tokens=jnp.full((L, R, B), -1, jnp.int32),
        lru_slots=jnp.zeros((L, R, B), jnp.int32),
        scratch=jnp.full((R, C), swap_in.SCRATCH_EMPTY, jnp.int32),
        layer=0,
        topk=jnp.zeros((R, K), jnp.int32),
        lengths=jnp.zeros((R,), jnp.int32),
        page_table=jnp.zeros((R, C // PAGE_SIZE), jnp.int32),
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(topk=jnp.zeros((2, 9), jnp.int32)), r"top_k \(9\) must be <= device_buffer_size \(8\)"),
        (dict(topk=jnp.zeros((3, 4), jnp.int32)), r"topk batch \(3\) must be <= buffer_tokens request slots \(R\) \(2\)"),
        (dict(lengths=jnp.zeros((1,), jnp.int32)), r"lengths batch \(1\) must equal topk batch \(R\) \(2\)"),
        (dict(page_table=jnp.zeros((4, 8), jnp.int32)), r"page_table batch \(4\) must equal buffer_tokens request slots \(R\) \(2\)"),
        (dict(lru_slots=jnp.zeros((1, 2, 7), jnp.int32)), r"lru_slots shape \(\(1, 2, 7\)\) must equal buffer_tokens shape"),
        (dict(scratch=jnp.zeros((3, 32), jnp.int32)), r"scratch batch \(3\) must equal buffer_tokens request slots \(R\) \(2\)"),
        (dict(layer=1), r"layer \(1\) must be in \[0, num_layers \(1\)\)"),
        (dict(topk=jnp.zeros((2,), jnp.int32)), r"topk must be \[R, K\]"),
    ],
)
def test_swap_in_plan_checks_static_shapes(implementation, changes, message):
    args = {**plan_inputs(), **changes}
    with pytest.raises(ValueError, match=message):
        swap_in.swap_in_plan(**args, page_size=PAGE_SIZE, implementation=implementation)


def test_swap_in_plan_reference_checks_top_k_fits_the_buffer():
    args = plan_inputs(K=9)
    with pytest.raises(ValueError, match=r"top_k \(9\) must be <= device_buffer_size \(8\)"):
        swap_in.swap_in_plan_reference(
            args["buffer_tokens"][0], args["lru_slots"][0], args["topk"], args["lengths"], args["page_table"], page_size=PAGE_SIZE
        )


def copy_inputs(L=2, R=3, B=8, S=40, W=6, K=5):
    return dict(
        pool=jnp.zeros((L, S, W), jnp.float32),
        device_buffer=jnp.zeros((L, R, B + 1, W), jnp.float32),
        layer=0,
        miss_host=jnp.zeros((R, K), jnp.int32),
        miss_device=jnp.zeros((R, K), jnp.int32),
        num_misses=jnp.zeros((R,), jnp.int32),
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(pool=jnp.zeros((2, 40, 7))), r"device_buffer row width \(6\) must equal pool row width \(W\) \(7\)"),
        (dict(pool=jnp.zeros((3, 40, 6))), r"device_buffer layers \(2\) must equal pool layers \(L\) \(3\)"),
        (dict(miss_device=jnp.zeros((3, 4), jnp.int32)), r"miss_device shape \(\(3, 4\)\) must equal miss_host shape \(\(3, 5\)\)"),
        (
            dict(miss_host=jnp.zeros((4, 5), jnp.int32), miss_device=jnp.zeros((4, 5), jnp.int32)),
            r"miss_host batch \(4\) must not exceed the device_buffer request slots \(R = 3\)",
        ),
        (dict(num_misses=jnp.zeros((4,), jnp.int32)), r"num_misses batch \(4\) must equal miss_host batch \(R\) \(3\)"),
        (dict(layer=2), r"layer \(2\) must be in \[0, num_layers \(2\)\)"),
    ],
)
def test_copy_checks_static_shapes(implementation, changes, message):
    args = {**copy_inputs(), **changes}
    with pytest.raises(ValueError, match=message):
        row_copy.copy_host_rows_to_buffer(**args, implementation=implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "rows_shape, slots_shape, layer, message",
    [
        ((4, 5), (4,), 0, r"rows width \(5\) must equal pool row width \(W\) \(6\)"),
        ((4, 6), (3,), 0, r"host_slots length \(3\) must equal rows \(N\) \(4\)"),
        ((4, 6), (4,), 2, r"layer \(2\) must be in \[0, num_layers \(2\)\)"),
        ((6,), (4,), 0, r"rows must be \[N, W\]"),
    ],
)
def test_write_checks_static_shapes(implementation, rows_shape, slots_shape, layer, message):
    pool = jnp.zeros((2, 40, 6), jnp.float32)
    with pytest.raises(ValueError, match=message):
        row_copy.write_rows_to_host(pool, layer, jnp.zeros(rows_shape), jnp.zeros(slots_shape, jnp.int32), implementation=implementation)


@pytest.mark.parametrize("implementation", [*IMPLEMENTATIONS, "tpu"])  # tpu: interpret mode on the CPU
def test_a_batch_below_the_slot_count_plans_its_slots_on_the_whole_tables(implementation):
    """topk of b < R rows plans request slots 0 .. b - 1 of the whole [L, R, B] tables (what a
    batch bucket below the engine's slots runs: no slices copied out and back): the same plan and
    rows as the reference on the sliced tables, slots b .. R - 1 and the other layer untouched."""
    L, R, b, B, C = 2, 4, 2, 8, 64
    rng = np.random.default_rng(7)
    tokens = rng.integers(1000, 2000, (L, R, B)).astype(np.int32)  # sentinels: must stay as they are
    lru = np.stack([np.stack([rng.permutation(B) for _ in range(R)]) for _ in range(L)]).astype(np.int32)
    tokens[1, 0] = rng.permutation(19)[:B]  # layer 1, slot 0: a long-path request (20 tokens) holding 8 positions
    tokens[1, 1] = -1  # slot 1: a fast-path request (6 tokens)
    topk = np.array([[3, 15, 19, 3], [5, 0, 2, -1]], np.int32)  # i32[b, K]
    lengths = np.array([20, 6], np.int32)
    page_table = identity_page_table(R, C)
    scratch = jnp.full((R, C), swap_in.SCRATCH_EMPTY, jnp.int32)
    args = lambda rows: (jnp.asarray(tokens[:, :rows]), jnp.asarray(lru[:, :rows]), scratch[:rows], 1, jnp.asarray(topk),  # noqa: E731
                         jnp.asarray(lengths), jnp.asarray(page_table[:rows]))  # fmt: skip
    plan, new_tokens, new_lru, new_scratch = swap_in.swap_in_plan(*args(R), page_size=PAGE_SIZE, implementation=implementation)
    want_plan, want_tokens, want_lru, _ = swap_in.swap_in_plan(*args(b), page_size=PAGE_SIZE, implementation="reference")
    for got, want in zip(plan, want_plan):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(plan.num_misses[0]) > 0  # the long path ran
    np.testing.assert_array_equal(np.asarray(new_tokens)[:, :b], np.asarray(want_tokens))
    np.testing.assert_array_equal(np.asarray(new_lru)[:, :b], np.asarray(want_lru))
    np.testing.assert_array_equal(np.asarray(new_tokens)[:, b:], tokens[:, b:])
    np.testing.assert_array_equal(np.asarray(new_lru)[:, b:], lru[:, b:])
    np.testing.assert_array_equal(np.asarray(new_tokens)[0], tokens[0])  # the other layer
    assert np.all(np.asarray(new_scratch) == swap_in.SCRATCH_EMPTY)
