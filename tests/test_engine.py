"""The serving engine: continuous batching equals decoding each request alone, pools run dry
without a crash and come back whole, one decode compile per engine, EOS, the synthetic
selection's overlap, telemetry arithmetic.

Float32 tiny model with random weights; HiSparse buffers barely above top_k so decoding misses
and evicts; unwritten KV rows are NaN so any stray read would poison the tokens.
"""

import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model import DSAModelConfig
from hisparse_jax.config import HiSparseConfig
from serving.engine import COMPILE_HOST_BYTES, auto_compile_threads, batch_buckets, Engine, EngineConfig
from serving.errors import UsageError
from hisparse_jax.host_pages import HostPageAllocator
from serving.workload import Request, random_requests
from serving.scheduler import Scheduler
from models.common.buffer_addresses import BufferAddressLog
from models.dsa.footprint import DeviceFootprint
from serving.synthetic_selection import SyntheticSelector
from serving.telemetry import RequestTrace, StepRecord, summarize
from models.dsa.model import DSAForCausalLM
from models.dsa.runner import ModelRunner
from models.dsa.runner import LayerwisePrefill
from models.dsa.generate import generate

TINY = DSAModelConfig.tiny()  # top_k 16, 3 layers
HISPARSE = HiSparseConfig(top_k=16, device_buffer_size=20, host_to_device_ratio=8)
CONTEXT = 128
# By hand from the tiny config, float32: a KV row is kv_lora_rank 32 + rope 16 values, an indexer
# key index_head_dim 32; all 3 layers have a KV cache and a full indexer.
ROW_BYTES, KEY_BYTES = (32 + 16) * 4, 32 * 4


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(DSAForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)), prefill_chunk=32)


@pytest.fixture(scope="module")
def workload():
    """Prompts of 7..111 tokens, 1..16 new tokens: contexts past B = 20 from the start, or
    crossing it mid-decode. Two total lengths only, so `alone` compiles two decode steps."""
    rng = np.random.default_rng(0)
    lengths = [(100, 12), (7, 16), (111, 1), (103, 9), (9, 14), (107, 5), (12, 11), (96, 16)]
    return [Request(i, rng.integers(0, TINY.vocab_size, t).astype(np.int32), n) for i, (t, n) in enumerate(lengths)]


@pytest.fixture(scope="module")
def alone(runner, workload):
    """Each request decoded by itself, one slot, full KV on the device."""
    return {r.id: generate(runner, r.prompt[None], r.max_new_tokens, fill_value=np.nan).tokens[0] for r in workload}


def engine_config(hisparse, **overrides):
    values = dict(max_running_requests=3, context_length=CONTEXT, hisparse=hisparse, page_size=8, fill_value=np.nan)
    values.update(overrides)
    return EngineConfig(**values)


def assert_everything_free(engine):
    assert engine.scheduler.all_free()
    kv = engine.cache.kv
    np.testing.assert_array_equal(np.asarray(kv.seq_lens), 0)
    if engine.config.hisparse is not None:
        np.testing.assert_array_equal(np.asarray(kv.host_page_table), -1)
        np.testing.assert_array_equal(np.asarray(kv.buffer_tokens), -1)
        assert engine.scheduler.host_pages.num_free == engine.scheduler.host_pages.num_pages


@pytest.mark.parametrize(
    "hisparse", [HISPARSE, dataclasses.replace(HISPARSE, miss_read="attention"), None], ids=["hisparse", "miss_read_attention", "baseline"]
)
def test_requests_joining_and_leaving_decode_as_if_alone(runner, workload, alone, hisparse):
    engine = Engine(runner, engine_config(hisparse))
    result = engine.run(workload)  # 8 requests through 3 slots: they join and leave over the run
    for request in workload:
        np.testing.assert_array_equal(result.tokens[request.id], alone[request.id], err_msg=f"request {request.id}")
    running = [s.running for s in result.steps]
    assert max(running) == 3 and min(running) < 3 and len(result.steps) >= 20
    # Batch buckets: each step ran the smallest of (1, 2, 3) holding its requests, which the
    # engine moved down into the first slots as others retired (the tokens above say correctly).
    assert engine.buckets == (1, 2, 3)
    assert [s.batch for s in result.steps] == [next(b for b in (1, 2, 3) if b >= n) for n in running]
    assert min(s.batch for s in result.steps) < 3
    if hisparse is not None:
        # Every (layer, request) past the buffer had to evict: misses exceed what B slots hold.
        assert result.summary["misses"] > 3 * HISPARSE.device_buffer_size
        assert result.summary["h2d_bytes"] == result.summary["misses"] * ROW_BYTES
    else:
        assert result.summary["misses"] == 0
    assert result.summary["output_tokens"] == sum(r.max_new_tokens for r in workload)
    assert_everything_free(engine)


def test_pools_running_out_make_requests_wait_then_complete(runner):
    prompts = np.random.default_rng(5).integers(0, TINY.vocab_size, (6, 60)).astype(np.int32)
    requests = [Request(i, p, 8) for i, p in enumerate(prompts)]  # 68 tokens: 9 host pages each
    expected = generate(runner, prompts, 8).tokens
    # 4 slots, but the host pool (20 pages) holds two requests, and so does the device budget:
    # twice what the baseline's arrays take for one 68-token request, counted off a real cache.
    tight_host = Engine(runner, engine_config(HISPARSE, max_running_requests=4, num_host_pages=20))
    one = runner.create_cache(num_requests=1, max_context=68)
    budget = 2 * (one.kv.kv.nbytes + one.index_keys.nbytes)
    tight_device = Engine(runner, engine_config(None, max_running_requests=4, kv_budget_bytes=budget))
    for engine in (tight_host, tight_device):
        result = engine.run(requests)
        for request in requests:
            np.testing.assert_array_equal(result.tokens[request.id], expected[request.id])
        assert max(s.running for s in result.steps) == 2  # slots were free, yet requests waited
        assert_everything_free(engine)


def test_batch_buckets_are_powers_of_two_then_the_slot_count():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(4) == (1, 2, 4)
    assert batch_buckets(88) == (1, 2, 4, 8, 16, 32, 64, 88)


def test_without_batch_buckets_every_step_runs_every_slot(runner, workload, alone):
    # The switch the buckets can be compared against: no compaction, every step all R slots.
    engine = Engine(runner, engine_config(HISPARSE, batch_buckets=False))
    result = engine.run(workload)
    for request in workload:
        np.testing.assert_array_equal(result.tokens[request.id], alone[request.id], err_msg=f"request {request.id}")
    assert engine.buckets == (3,) and {s.batch for s in result.steps} == {3}
    assert_everything_free(engine)


def test_scheduler_moves_a_request_between_slots():
    scheduler = Scheduler(num_slots=3, context_length=64, footprint=DeviceFootprint(1, 1, 8, 4, None), kv_budget_bytes=10**6)
    for i in range(3):
        scheduler.submit(Request(i, np.zeros(4, np.int32), 2))
    scheduler.admit()
    scheduler.finish(0)
    scheduler.move(2, 0)
    assert scheduler.running_slots() == [0, 1] and scheduler.running_request(0).id == 2
    with pytest.raises(ValueError, match="cannot move the request in slot 2 to slot 0"):
        scheduler.move(2, 0)
    assert [a.slot for a in (scheduler.submit(Request(9, np.zeros(4, np.int32), 2)) or scheduler.admit())] == [2]


def test_scheduler_is_fcfs_and_returns_every_pool():
    footprint = DeviceFootprint.of(TINY, jnp.float32, HISPARSE)
    pages = HostPageAllocator(num_pages=10, page_size=8)
    scheduler = Scheduler(num_slots=4, context_length=80, footprint=footprint, host_pages=pages)
    long, short = Request(0, np.zeros(70, np.int32), 10), Request(1, np.zeros(4, np.int32), 4)
    scheduler.submit(short)
    scheduler.submit(long)
    assert [a.slot for a in scheduler.admit()] == [0]  # the long one needs 10 pages, 9 are free
    scheduler.submit(Request(2, np.zeros(4, np.int32), 4))
    assert scheduler.admit() == []  # FCFS: the small request behind the long one waits too
    assert len(scheduler.waiting) == 2
    scheduler.finish(0)
    admitted = scheduler.admit()
    assert [a.request.id for a in admitted] == [0] and admitted[0].host_pages == list(range(10))
    scheduler.finish(0)
    assert [a.request.id for a in scheduler.admit()] == [2]
    scheduler.finish(0)
    assert scheduler.all_free()


def test_requests_that_can_never_run_are_rejected(runner):
    engine = Engine(runner, engine_config(HISPARSE, num_host_pages=4))
    with pytest.raises(UsageError, match=r"request 7 needs 130 tokens .* > context_length 128"):
        engine.run([Request(7, np.zeros(120, np.int32), 10)])
    with pytest.raises(UsageError, match=r"needs 5 host pages; the host pool has 4"):
        engine.run([Request(8, np.zeros(30, np.int32), 10)])
    tiny_budget = Engine(runner, engine_config(None, kv_budget_bytes=1000))
    with pytest.raises(UsageError, match=r"device KV > kv budget 1000 B"):
        tiny_budget.run([Request(9, np.zeros(10, np.int32), 2)])
    with pytest.raises(UsageError, match="top_k"):
        Engine(runner, engine_config(HiSparseConfig(top_k=8, device_buffer_size=16)))


def test_device_footprint_counts_rows_and_indexer_keys():
    row, key = ROW_BYTES, KEY_BYTES
    on = DeviceFootprint.of(TINY, jnp.float32, HISPARSE)
    off = DeviceFootprint.of(TINY, jnp.float32, None)
    assert off.request_bytes(100) == 3 * 100 * row + 3 * 100 * key
    assert on.request_bytes(100) == 3 * 21 * row + 3 * 100 * key  # B + the newest-token slot
    ten = 10 * (3 * 21 * row + 3 * 100 * key)
    assert on.capacity(ten, 100) == 10 and on.capacity(ten - 1, 100) == 9
    # Host pool bytes per request: every row of every layer with HiSparse, none for the baseline
    assert on.host_request_bytes(100) == 3 * 100 * row and off.host_request_bytes(100) == 0
    from configs.deepseek_v4 import DeepseekV4Config
    from configs.minimax_m3 import MiniMaxM3Config
    from models.deepseek_v4.runner import footprint as v4_footprint
    from models.minimax_m3.runner import footprint as m3_footprint

    v4 = DeepseekV4Config.tiny()  # HiSparse offloads the C4 entries: one per csa_rate tokens and CSA layer
    v4_on = v4_footprint(v4, jnp.float32, HiSparseConfig(top_k=v4.index_topk))
    assert v4_on.host_request_bytes(100) == len(v4.csa_layers) * -(-100 // v4.csa_rate) * v4_on.row_bytes > 0
    assert v4_footprint(v4, jnp.float32, None).host_request_bytes(100) == 0
    m3 = MiniMaxM3Config.tiny()  # the sparse layers' K and V of every token and KV head
    m3_on = m3_footprint(m3, jnp.float32, HiSparseConfig(top_k=m3.selected_keys))
    assert m3_on.host_request_bytes(100) == len(m3.sparse_layers) * m3.num_kv_heads * 100 * m3_on.row_bytes > 0
    # A shared-layer prefetch stages top_k rows per shared layer after the longest anchor run
    glm = DSAModelConfig.tiny_glm()  # full, full, shared, full, shared: one shared layer per run
    staged = DeviceFootprint.of(glm, jnp.float32, HiSparseConfig(top_k=glm.index_topk), shared_prefetch="ffi_stream")
    plain = DeviceFootprint.of(glm, jnp.float32, HiSparseConfig(top_k=glm.index_topk))
    assert staged.request_bytes(100) - plain.request_bytes(100) == glm.index_topk * staged.row_bytes
    assert DeviceFootprint.of(glm, jnp.float32, None, shared_prefetch="ffi_stream").staged_rows == 0  # baseline: none


def test_eos_ends_a_request_early(runner, workload, alone):
    request = workload[7]
    eos = int(alone[request.id][4])
    first = int(np.flatnonzero(alone[request.id] == eos)[0])
    engine = Engine(runner, engine_config(HISPARSE))
    result = engine.run([Request(request.id, request.prompt, request.max_new_tokens, eos_token_id=eos)])
    np.testing.assert_array_equal(result.tokens[request.id], alone[request.id][: first + 1])
    assert_everything_free(engine)


class _Arrivals:
    """engine.run's `arrivals` source (PD's KVReceiver): one batch of requests per poll."""

    def __init__(self, *batches):
        self.batches = list(batches)

    def poll(self, timeout=None):
        return self.batches.pop(0) if self.batches else []

    @property
    def closed(self):
        return not self.batches


@pytest.mark.parametrize("failure", ["decode", "prefill", "arrival"])
@pytest.mark.parametrize("hisparse", [HISPARSE, None], ids=["hisparse", "baseline"])
def test_a_failed_run_gives_everything_back(runner, workload, alone, hisparse, failure, monkeypatch):
    engine = Engine(runner, engine_config(hisparse))
    calls = []

    def fail_on_third(real, before_real):
        """Raises on the third call: before the real one (the engine's cache intact, its slots are
        ended in place) or after it (the cache was donated to it: the engine's copy is gone)."""

        def call(*args, **kwargs):
            calls.append(None)
            if len(calls) == 3 and before_real:
                raise RuntimeError("injected")
            out = real(*args, **kwargs)
            if len(calls) == 3:
                raise RuntimeError("injected")
            return out

        return call

    bad = Request(99, np.zeros(CONTEXT, np.int32), 1)  # prompt + 1 > context_length
    if failure == "decode":
        # greedy_step: the decode step as the engine runs it (models/common/runner.py)
        monkeypatch.setattr(runner, "greedy_step", fail_on_third(runner.greedy_step, before_real=True))
        with pytest.raises(RuntimeError, match="injected"):
            engine.run(workload)  # 8 requests through 3 slots: some running, some waiting
    elif failure == "prefill":
        # Mid-prompt: the third prefill layer fails after the cache was donated to it.
        monkeypatch.setattr(LayerwisePrefill, "advance", fail_on_third(LayerwisePrefill.advance, before_real=False))
        with pytest.raises(RuntimeError, match="injected"):
            engine.run(workload)
    else:
        with pytest.raises(UsageError, match="request 99 needs 129 tokens"):
            engine.run([], arrivals=_Arrivals(workload[:5], [bad]))  # 3 running, 2 pending
    assert len(calls) == (0 if failure == "arrival" else 3)
    assert_everything_free(engine)
    monkeypatch.undo()
    result = engine.run(workload)  # the same engine serves the next run as a fresh one would
    for request in workload:
        np.testing.assert_array_equal(result.tokens[request.id], alone[request.id], err_msg=f"request {request.id}")
    assert_everything_free(engine)


_compiles = []


@pytest.fixture(scope="module")
def compile_counter():
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: _compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
    )
    before = len(_compiles)
    jax.jit(lambda x: x + 1)(np.float32(0))  # a new function: the listener must see it compile
    assert len(_compiles) > before, "the compile listener heard nothing: these tests could not fail"
    return _compiles


def test_no_recompilation_as_requests_come_and_go(runner, compile_counter):
    requests = random_requests(num_prompts=10, input_len=60, output_len=12, range_ratio=0.2, vocab_size=512, seed=3)
    engine = Engine(runner, engine_config(HISPARSE, max_running_requests=4))
    engine.warmup(requests)
    before = len(compile_counter)
    for concurrency in (1, 3, 10):  # different batches every step, requests joining and leaving
        engine.run(requests, max_concurrency=concurrency)
    assert len(compile_counter) == before


def test_warmup_fits_every_request_that_fits(runner, compile_counter):
    rng = np.random.default_rng(7)
    # prompt + 1 == context_length: the longest request the engine takes; it ends at prefill.
    edge = Request(0, rng.integers(0, TINY.vocab_size, CONTEXT - 1).astype(np.int32), 1)
    decodes = Request(1, rng.integers(0, TINY.vocab_size, 100).astype(np.int32), 6)  # the same prefill bucket
    # R = 2: a decode shape no other test here compiles, so the count below sees this warm-up's work.
    engine = Engine(runner, engine_config(HISPARSE, max_running_requests=2))
    engine.warmup([edge])  # asked 2 tokens of every prompt: "needs 129 tokens > context_length 128"
    result = engine.run([edge])
    assert result.steps == []  # done at prefill
    np.testing.assert_array_equal(result.tokens[0], generate(runner, edge.prompt[None], 1).tokens[0])
    engine.warmup([edge, decodes])  # the bucket's first request does not decode; the run does
    before = len(compile_counter)
    result = engine.run([edge, decodes])
    assert len(compile_counter) == before and len(result.steps) == 5
    assert_everything_free(engine)


@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.9, 1.0])
def test_synthetic_selection_overlap_is_its_parameter(overlap):
    K = 64
    selector = SyntheticSelector(num_index_layers=2, num_requests=3, top_k=K, overlap=overlap, seed=1)
    positions = np.array([200, 400, -1])
    previous, shared, fresh = None, 0, []  # shared: entries kept from the step before, counted here
    for _ in range(20):
        topk = np.asarray(selector.select(positions, [11, 12, 0]))
        for j in range(2):
            for r in range(2):
                chosen = topk[j, r]
                assert len(set(chosen)) == K and chosen.min() >= 0 and chosen.max() <= positions[r]
                if previous is not None:
                    shared += len(set(chosen) & set(previous[j, r]))
                    fresh += [p / positions[r] for p in set(chosen) - set(previous[j, r])]
        assert (topk[:, 2] == -1).all()  # inactive slot
        positions = np.where(positions >= 0, positions + 1, -1)
        previous = topk
    assert shared == 19 * 2 * 2 * round(overlap * K)  # every step after the first, both layers and requests
    assert selector.measured_overlap == round(overlap * K) / K
    assert selector.compared_entries == 19 * 2 * 2 * K  # every step after the first, both layers and requests
    if fresh:  # fresh positions spread uniformly over their contexts (not, e.g., the lowest ones first)
        assert abs(np.mean(fresh) - 0.5) < 0.05 and np.quantile(fresh, 0.1) < 0.2 and np.quantile(fresh, 0.9) > 0.8, np.mean(fresh)


def test_synthetic_selection_of_a_steady_request_does_not_depend_on_the_step_form():
    """A request with a whole previous selection gets the same next one whether its step takes the
    steady form (K - keep fresh draws) or the starting form (K: a neighbour starts), so a request's
    selections, and with them HiSparse's and the baseline's tokens, do not depend on what runs
    beside it (the two engines' schedules differ under a device budget)."""
    from serving.synthetic_selection import synthetic_topk

    J, R, K = 2, 3, 32
    rng = np.random.default_rng(4)
    lengths = jnp.asarray([300, 90, 1000], jnp.int32)  # i32[R]
    previous = jnp.asarray(np.stack([np.stack([rng.choice(int(n) - 1, K, replace=False) for n in lengths]) for _ in range(J)]), jnp.int32)
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(7), r))(jnp.arange(R))
    steady = synthetic_topk(keys, previous, lengths, overlap=0.75, steady=True)  # i32[J, R, K]
    starting = synthetic_topk(keys, previous, lengths, overlap=0.75, steady=False)
    np.testing.assert_array_equal(np.asarray(steady), np.asarray(starting))
    kept = [len(set(np.asarray(steady)[j, r]) & set(np.asarray(previous)[j, r])) for j in range(J) for r in range(R)]
    assert kept == [round(0.75 * K)] * (J * R)  # a real step: 24 kept, 8 fresh


def test_synthetic_selection_picks_its_form_on_the_host_as_the_device_would():
    """The selector's step form (`steady`: fewer fresh draws once every request longer than K has
    a whole previous selection) comes from host bookkeeping, not a lax.cond whose predicate the
    host would read back every step (that made each step wait for the one before it). The host's
    choice must equal what the device's previous selections say, through starts, moves, resets
    and inactive slots."""
    J, R, K = 2, 4, 32
    selector = SyntheticSelector(num_index_layers=J, num_requests=R, top_k=K, overlap=0.75, seed=3)
    chosen, original = [], selector._select

    def spy(*args, steady):
        chosen.append(steady)
        return original(*args, steady=steady)

    selector._select = spy
    positions, ids = np.array([100, 20, -1, 31], np.int64), np.array([1, 2, 0, 4], np.int32)
    seen = []
    for step in range(10):
        if step == 3:  # a new request starts in slot 2, mid-run
            selector.reset(2)
            positions[2], ids[2] = 70, 9
        if step == 5:  # request 2 ended: compaction moves slot 3 onto slot 1
            selector.move(3, 1)
            positions[1], ids[1], positions[3] = positions[3], ids[3], -1
        if step == 6:  # a start reuses slot 3
            selector.reset(3)
            positions[3], ids[3] = 500, 11
        if step == 7:  # slot 0's request ends and a new one starts there at the very next position
            selector.reset(0)
            ids[0] = 12
        n = np.where(positions >= 0, positions + 1, 0)  # i64[R]
        previous = np.asarray(selector.previous)  # i32[J, R, K]
        valid = ((previous >= 0) & (previous < n[None, :, None])).sum(-1)  # i64[J, R]
        # What the device's previous selections say: every slot longer than K has K valid entries
        # (a slot of at most K positions is selected whole, whatever the form).
        seen.append(bool(np.all((valid >= K) | (n <= K)[None])))
        selector.select(positions, ids)
        positions = np.where(positions >= 0, positions + 1, -1)
    assert chosen == seen and False in seen and True in seen, (chosen, seen)
    # That neither form's program holds a conditional: tests/test_gpu_lowering.py (lowered for the GPU).


def test_synthetic_selection_depends_on_the_request_not_its_slot():
    make = lambda: SyntheticSelector(num_index_layers=1, num_requests=2, top_k=16, overlap=0.5, seed=4)  # noqa: E731
    a, b = make(), make()
    for step in range(5):
        in_a = np.asarray(a.select([100 + step, -1], [7, 0]))
        in_b = np.asarray(b.select([50 + step, 100 + step], [3, 7]))
        np.testing.assert_array_equal(in_a[:, 0], in_b[:, 1])


@pytest.mark.slow  # ~31 s on 2 cores (CI time); the selector tests above and the compiled-step test in
# tests/test_models.py (top-k override, no copies) stay in the default run
def test_synthetic_selection_engine_runs_are_labelled_and_mode_independent(runner, workload):
    results = {}
    for hisparse, budget in ((HISPARSE, None), (None, DeviceFootprint.of(TINY, jnp.float32, None).request_bytes(CONTEXT))):
        engine = Engine(runner, engine_config(hisparse, synthetic_topk_overlap=0.75, kv_budget_bytes=budget))
        results[engine.config.mode] = engine.run(workload)
        assert_everything_free(engine)
    for result in results.values():
        assert result.summary["selection"] == "synthetic(overlap=0.75)"
        # K = 16: 12 of 16 kept; a context of 17-19 positions has too few fresh ones and keeps more.
        assert 0.75 <= result.summary["measured_topk_overlap"] < 0.8
    # Different schedules (the budget holds fewer baseline requests), same tokens.
    assert [s.running for s in results["baseline"].steps] != [s.running for s in results["hisparse"].steps]
    for request in workload:
        np.testing.assert_array_equal(results["hisparse"].tokens[request.id], results["baseline"].tokens[request.id])


def test_synthetic_contexts_decode_without_prefill(runner):
    requests = [Request(i, np.full(t, 3, np.int32), 6) for i, t in enumerate((90, 40, 110))]
    for hisparse in (HISPARSE, None):
        engine = Engine(runner, engine_config(hisparse, synthetic_context=True))
        result = engine.run(requests)
        assert result.summary["ttft_ms"] is None and result.summary["synthetic_context"]
        assert [len(result.tokens[r.id]) for r in requests] == [6, 6, 6]  # every token from a decode step
        assert len(result.steps) == 6 and result.summary["decode_throughput"] > 0
        # The fill stored a row for each prompt position and each step one more, nothing else
        # (unwritten rows are NaN): 6 rows past each prompt, in the host pool or the device KV.
        rows = np.asarray(engine.cache.kv.host_pool if hisparse else engine.cache.kv.kv)
        written = np.isfinite(rows).all(-1).reshape(TINY.num_layers, -1).sum(-1)  # per layer
        np.testing.assert_array_equal(written, sum(r.prompt_len + 6 for r in requests))
        assert_everything_free(engine)


def test_summary_arithmetic():
    steps = [StepRecord(1.0, 0.5, 2, 30, 10, 10 * 96), StepRecord(2.0, 0.25, 1, 15, 5, 5 * 96)]
    traces = [RequestTrace(0, 10, 0.0, [0.5, 1.0, 2.0]), RequestTrace(1, 20, 0.25, [0.75, 1.0])]
    summary = summarize(steps, traces, duration_s=2.0)
    assert summary["output_tokens"] == 5 and summary["output_throughput"] == 2.5
    assert summary["decode_throughput"] == 3 / 0.75
    assert summary["ttft_ms"]["mean"] == pytest.approx(500.0)
    assert summary["itl_ms"]["mean"] == pytest.approx((500 + 1000 + 250) / 3)
    assert summary["itl_ms"]["p50"] == pytest.approx(500.0)
    assert summary["miss_rate"] == 15 / 60 and summary["h2d_bytes"] == 15 * 96


def decode_steps_while_prefilling(result):
    """Per request admitted while others decoded: decode steps between its admission and its
    first token (its prefill ran in between them)."""
    counts = []
    for trace in result.traces:
        during = [s for s in result.steps if trace.admitted_s < s.time_s < trace.token_times_s[0]]
        if any(s.time_s < trace.admitted_s for s in result.steps):  # others were decoding already
            counts.append(len(during))
    return counts


def test_prefill_interleaves_with_decode_within_its_token_budget(runner, workload, alone):
    # A budget below one layer of any prompt: one layer per engine step, so a prompt admitted
    # while others decode takes 3 steps (3 layers) to its first token, and they keep decoding.
    engine = Engine(runner, engine_config(HISPARSE, prefill_token_budget=1))
    result = engine.run(workload)
    for request in workload:
        np.testing.assert_array_equal(result.tokens[request.id], alone[request.id], err_msg=f"request {request.id}")
    counts = decode_steps_while_prefilling(result)
    assert counts and min(counts) >= TINY.num_layers - 1, counts
    assert_everything_free(engine)
    # Without a budget a prompt is prefilled whole: no decode step between admission and first token.
    whole = Engine(runner, engine_config(HISPARSE)).run(workload)
    assert set(decode_steps_while_prefilling(whole)) == {0}


class _StaggeredArrivals:
    """Arrivals for Engine.run: the first request at once, the others on the `later`-th poll
    (one poll per engine iteration), then closed."""

    def __init__(self, requests, later):
        self._batches = {0: requests[:1], later: requests[1:]}
        self._polls = 0
        self.closed = False

    def poll(self, timeout=None):
        batch = self._batches.get(self._polls, [])
        self._polls += 1
        self.closed = self._polls > max(self._batches)
        return batch


@pytest.fixture(scope="module")
def residency_workload(runner):
    """Three 40 + 16 token requests: 7 pages of 8 rows each, past a buffer's 3 pages (B = 20)
    but short enough that one fits resident in the default pool (3 slots x 3 pages)."""
    prompts = np.random.default_rng(11).integers(0, TINY.vocab_size, (3, 40)).astype(np.int32)
    return [Request(i, p, 16) for i, p in enumerate(prompts)], generate(runner, prompts, 16).tokens


@pytest.mark.parametrize("mode", ["adaptive", "forced_resident", "forced_host_backed"])
def test_dynamic_residency_promotes_and_demotes_with_tokens_as_the_baseline(runner, residency_workload, mode):
    from hisparse_jax.config import ResidencyConfig

    requests, expected = residency_workload
    residency = ResidencyConfig(mode=mode, promote_watermark=0.1, demote_watermark=0.0)
    engine = Engine(runner, engine_config(HiSparseConfig(top_k=16, device_buffer_size=20, host_to_device_ratio=8, dynamic_residency=residency)))
    # The first request decodes alone for a few steps (adaptive: it is promoted), then the
    # others arrive and need its pages (adaptive: it is demoted to make room).
    result = engine.run([], arrivals=_StaggeredArrivals(requests, later=5))
    for request in requests:
        np.testing.assert_array_equal(result.tokens[request.id], expected[request.id], err_msg=f"request {request.id}")
    counts = result.summary["residency"]
    if mode == "adaptive":
        assert counts["promotions"] >= 1 and counts["demotions"] >= 1, counts
        assert counts["promoted_rows"] >= 40 * TINY.num_layers, counts  # at least one prompt's rows of every layer
    else:
        assert counts["promotions"] == counts["demotions"] == 0, counts
    running = max(s.running for s in result.steps)
    assert running == (1 if mode == "forced_resident" else 3)  # forced_resident: one context fits at a time
    assert_everything_free(engine)
    assert engine.residency.pages.num_free == engine.residency.pages.num_pages
    np.testing.assert_array_equal(np.asarray(engine.cache.kv.device_page_table), -1)


# ---- the overlap schedule: step t + 1 dispatched before step t's tokens are read ------------------


def with_eos(requests, eos):
    return [dataclasses.replace(r, eos_token_id=eos) for r in requests]


def until_eos(tokens, eos):
    """What a request decoding `tokens` alone emits when it stops at `eos` (inclusive)."""
    hits = np.flatnonzero(tokens == eos)
    return tokens[: hits[0] + 1] if hits.size else tokens


def extra_steps(expected: dict, requests) -> int:
    """Steps the overlap schedule runs past an EOS: one per request whose EOS came from a decode
    step (not its prefill) before its last allowed token; their tokens are never emitted."""
    by_id = {r.id: r for r in requests}
    return sum(1 for i, t in expected.items() if t[-1] == by_id[i].eos_token_id and 1 <= len(t) - 1 < by_id[i].max_new_tokens - 1)


@pytest.fixture(scope="module")
def eos_workload(workload, alone):
    """The workload with one EOS id for all: request 7 emits it mid-run (its 5th token), others
    may, the rest stop at max_new_tokens. -> (requests, expected tokens per id)."""
    eos = int(alone[7][4])
    requests = with_eos(workload, eos)
    expected = {r.id: until_eos(alone[r.id], eos) for r in requests}
    assert extra_steps(expected, requests) >= 1  # some EOS mid-run
    assert any(len(expected[r.id]) == r.max_new_tokens and expected[r.id][-1] != eos for r in requests)  # some by length
    return requests, expected


@pytest.mark.parametrize("case", ["hisparse", "baseline", "prefill_budget", "no_buckets"])
def test_overlap_schedule_on_and_off_decode_the_same_tokens(runner, eos_workload, case):
    # 8 requests through 3 slots: joining, leaving by EOS and by length, compaction moving them.
    requests, expected = eos_workload
    overrides = dict(baseline=dict(hisparse=None), prefill_budget=dict(prefill_token_budget=1), no_buckets=dict(batch_buckets=False))
    values = {"hisparse": HISPARSE, **overrides.get(case, {})}
    running = {}
    for overlap in (True, False):
        engine = Engine(runner, engine_config(overlap_schedule=overlap, **values))
        result = engine.run(requests)
        for request in requests:
            np.testing.assert_array_equal(result.tokens[request.id], expected[request.id], err_msg=f"request {request.id}, overlap {overlap}")
        assert_everything_free(engine)
        running[overlap] = sum(s.running for s in result.steps)
    # Without the overlap every step's token is emitted; with it a request stopped by EOS ran one
    # step more, whose token was dropped.
    assert running[False] == sum(len(t) - 1 for t in expected.values())
    assert running[True] == running[False] + extra_steps(expected, requests)


def test_overlap_schedule_with_dynamic_residency_and_arrivals(runner, residency_workload):
    from hisparse_jax.config import ResidencyConfig

    requests, expected = residency_workload
    eos = int(expected[1][6])  # request 1 stops mid-run, after the others arrived
    requests = with_eos(requests, eos)
    residency = ResidencyConfig(mode="adaptive", promote_watermark=0.1, demote_watermark=0.0)
    hisparse = HiSparseConfig(top_k=16, device_buffer_size=20, host_to_device_ratio=8, dynamic_residency=residency)
    for overlap in (True, False):
        engine = Engine(runner, engine_config(hisparse, overlap_schedule=overlap))
        result = engine.run([], arrivals=_StaggeredArrivals(requests, later=5))
        for request in requests:
            np.testing.assert_array_equal(result.tokens[request.id], until_eos(expected[request.id], eos), err_msg=f"request {request.id}")
        counts = result.summary["residency"]
        assert counts["promotions"] >= 1 and counts["demotions"] >= 1, counts
        assert_everything_free(engine)
        assert engine.residency.pages.num_free == engine.residency.pages.num_pages


def test_overlap_schedule_with_the_synthetic_selection(runner, workload):
    # The selector's draws depend on (request, position) only, so the extra step after an EOS
    # changes no one's selection; tokens as without the overlap.
    requests = workload[:4]
    results = {}
    for overlap in (True, False):
        engine = Engine(runner, engine_config(HISPARSE, synthetic_topk_overlap=0.75, overlap_schedule=overlap, batch_buckets=False))
        results[overlap] = engine.run(requests)
        assert_everything_free(engine)
    eos = int(results[False].tokens[requests[0].id][3])
    eos_results = {}
    for overlap in (True, False):
        engine = Engine(runner, engine_config(HISPARSE, synthetic_topk_overlap=0.75, overlap_schedule=overlap, batch_buckets=False))
        eos_results[overlap] = engine.run(with_eos(requests, eos))
        assert_everything_free(engine)
    for request in requests:
        np.testing.assert_array_equal(results[True].tokens[request.id], results[False].tokens[request.id])
        np.testing.assert_array_equal(eos_results[True].tokens[request.id], until_eos(results[False].tokens[request.id], eos))
        np.testing.assert_array_equal(eos_results[False].tokens[request.id], until_eos(results[False].tokens[request.id], eos))


def _record_device_work(monkeypatch, engine, events: list) -> None:
    """Appends to `events`, in program order: ("decode", t) for each decode step dispatched, the
    name of every other jitted function the engine or its runner calls and of every primitive
    run eagerly, and ("read", t) the first time the host reads an output of decode step t."""
    from jax._src import dispatch
    from jax._src.array import ArrayImpl  # private: the one place every host read of an array goes through

    runner, outputs = engine.runner, {}  # id of a step's output array -> step (the arrays kept alive)
    kept = []

    def counted(name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            if name != "decode":
                events.append(name)
                return out
            step = sum(1 for e in events if isinstance(e, tuple) and e[0] == "decode")
            events.append(("decode", step))
            for leaf in jax.tree.leaves(out[3]):  # the StepResult: tokens and counts
                outputs[id(leaf)] = step
                kept.append(leaf)
            return out

        return call

    for name, fn in runner._jitted(engine.cache).items():
        monkeypatch.setitem(runner._jitted(engine.cache), name, counted(name, fn))
    for owner in (engine, runner):
        for name, value in list(vars(owner).items()):
            if callable(value) and hasattr(value, "lower"):  # a jitted function
                monkeypatch.setattr(owner, name, counted(name, value))
    apply_primitive = dispatch.apply_primitive
    monkeypatch.setattr(dispatch, "apply_primitive", lambda prim, *a, **k: events.append(f"eager {prim}") or apply_primitive(prim, *a, **k))
    value = ArrayImpl._value

    def read(array):
        step = outputs.pop(id(array), None)
        if step is not None and ("read", step) not in events:
            events.append(("read", step))
        return value.fget(array)

    monkeypatch.setattr(ArrayImpl, "_value", property(read))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_one_dispatch_per_decode_step_and_tokens_read_after_the_next_dispatch(runner, overlap, monkeypatch):
    # Three requests of one length, admitted together, ending together: 5 decode steps with
    # nothing else to do between them.
    prompts = np.random.default_rng(3).integers(0, TINY.vocab_size, (3, 30)).astype(np.int32)
    requests = [Request(i, p, 6) for i, p in enumerate(prompts)]
    engine = Engine(runner, engine_config(HISPARSE, overlap_schedule=overlap))
    expected = engine.run(requests).tokens  # compiles what the run below calls
    events = []
    _record_device_work(monkeypatch, engine, events)
    result = engine.run(requests)
    monkeypatch.undo()
    for request in requests:
        np.testing.assert_array_equal(result.tokens[request.id], expected[request.id])
    assert_everything_free(engine)
    decodes = [i for i, e in enumerate(events) if isinstance(e, tuple) and e[0] == "decode"]
    assert len(decodes) == len(result.steps) == 5
    between = events[decodes[0] : decodes[-1] + 1]
    # One dispatch per decode step: between the first step's and the last's, nothing but steps and reads.
    assert [e for e in between if not isinstance(e, tuple)] == [], between
    steps = [e for e in events if isinstance(e, tuple)]
    if overlap:  # step t's tokens are read only once step t + 1 is dispatched
        order = [("decode", 0)] + [e for t in range(1, 5) for e in (("decode", t), ("read", t - 1))] + [("read", 4)]
    else:
        order = [e for t in range(5) for e in (("decode", t), ("read", t))]
    assert steps == order


_FRESH_PROCESS_COMPILES = """
import jax, jax.monitoring
from serving import cli
from serving.engine import Engine
timed, compiles = [False], []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: compiles.append(event) if timed[0] and event.endswith("backend_compile_duration") else None)
run, warmup = Engine.run, Engine.warmup
def timed_run(self, requests, **kwargs):
    timed[0] = True
    try:
        return run(self, requests, **kwargs)
    finally:
        timed[0] = False
def untimed_warmup(self, *args, **kwargs):  # its own engine.run calls are the warm-up's
    Engine.run = run
    try:
        return warmup(self, *args, **kwargs)
    finally:
        Engine.run = timed_run
Engine.run, Engine.warmup = timed_run, untimed_warmup
args = cli.ServingArgs(implementation="pallas", num_prompts=3, random_input_len=40, random_output_len=4,
                       max_concurrency=(1, 2), progress=False, output_dir=OUT)
cli.run_serving(args)
print("compiles in timed runs:", len(compiles))
"""


def test_timed_serving_runs_compile_nothing_in_a_fresh_process(tmp_path):
    """run_serving's warm-up compiles everything its timed runs call, also in a fresh process with
    the Pallas kernels interpreted (the first interpreted kernel used to change JAX's tracing
    context, so the prefill traced before it compiled again in the first timed run: TTFT 1967 ms)."""
    import subprocess
    import sys

    code = f"OUT = {str(tmp_path)!r}\n" + _FRESH_PROCESS_COMPILES
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}  # compile for real
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env=dict(env, JAX_PLATFORMS="cpu"), timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiles in timed runs: 0" in done.stdout, done.stdout + done.stderr[-2000:]


def test_decode_compiler_options_reach_the_decode_step_compile():
    """ModelRunner(decode_compiler_options) goes to the decode step's jax.jit alone: a name XLA
    does not know is refused when that step compiles (prefill, compiled first, runs as usual)."""
    runner = ModelRunner(
        DSAForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)), prefill_chunk=32,
        decode_compiler_options={"xla_no_such_option_for_this_test": True},
    )  # fmt: skip
    prompt = np.arange(9, dtype=np.int32)[None]
    with pytest.raises(Exception, match="xla_no_such_option_for_this_test"):
        generate(runner, prompt, 2)


def test_cuda_graph_max_bs_compiles_larger_buckets_without_command_buffers():
    """SGLang's --cuda-graph-max-bs: a step of b <= max_bs slots runs the jit with XLA's graphs,
    a larger one the same step compiled without command buffers; the tokens do not change."""
    model = DSAForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))
    runner = ModelRunner(model, prefill_chunk=32, cuda_graph_max_bs=1)
    prompts = np.arange(18, dtype=np.int32).reshape(2, 9)
    one = generate(runner, prompts[:1], 3)
    (fns,) = runner._cache_fns.values()
    with_graphs = fns["decode"]._cache_size()  # b = 1's programs
    assert with_graphs >= 1 and fns["decode_without_graphs"]._cache_size() == 0
    two = generate(runner, prompts, 3)
    assert fns["decode"]._cache_size() == with_graphs and fns["decode_without_graphs"]._cache_size() >= 1  # b = 2
    np.testing.assert_array_equal(two.tokens, generate(ModelRunner(model, prefill_chunk=32), prompts, 3).tokens)
    np.testing.assert_array_equal(one.tokens, two.tokens[:1])
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be None or an integer >= 0, got -1"):
        ModelRunner(model, cuda_graph_max_bs=-1)


def test_decode_program_copies_run_in_turn_with_the_same_tokens():
    """decode_program_copies=2: two compiles of each decode program, run on alternate steps (each
    keeps its own CUDA graph on the GPU); the tokens equal a single program's."""
    model = DSAForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))
    runner = ModelRunner(model, prefill_chunk=32, decode_program_copies=2)
    prompt = np.arange(9, dtype=np.int32)[None]
    out = generate(runner, prompt, 5, hisparse=HISPARSE)
    (fns,) = runner._cache_fns.values()
    assert fns["decode"]._cache_size() >= 1 and fns["decode_copy1"]._cache_size() >= 1
    np.testing.assert_array_equal(out.tokens, generate(ModelRunner(model, prefill_chunk=32), prompt, 5, hisparse=HISPARSE).tokens)
    with pytest.raises(ValueError, match="decode_program_copies must be an integer >= 1, got 0"):
        ModelRunner(model, decode_program_copies=0)
    engine = Engine(ModelRunner(model, prefill_chunk=32, decode_program_copies=2), engine_config(HISPARSE, batch_buckets=True))
    engine.compile_buckets()  # every copy of every bucket, so a timed run compiles nothing
    (fns,) = engine.runner._cache_fns.values()
    assert fns["decode"]._cache_size() == fns["decode_copy1"]._cache_size() == len(engine.buckets) > 1


@contextlib.contextmanager
def backend_compiles(*names):
    """-> the list of backend compiles JAX reports inside the block (jit names), of functions whose
    name holds one of `names`."""
    compiled = []

    def listen(event, duration, *, fun_name="", **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and any(name in fun_name for name in names):
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_decode_programs_compile_side_by_side_and_the_steps_compile_none():
    """Engine.compile_decode_programs compiles every bucket's decode programs at once (each copy;
    a bucket past cuda_graph_max_bs its one program without graphs), the SYNTHETIC selection's
    top-k among their inputs; the warm-up and the run after it then compile no decode step."""
    model = DSAForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))
    runner = ModelRunner(model, prefill_chunk=32, hisparse_cuda_graph_max_bs=1, hisparse_decode_program_copies=2)
    config = engine_config(HISPARSE, batch_buckets=True, synthetic_topk_overlap=0.75, max_running_requests=3)
    engine = Engine(runner, dataclasses.replace(config, compile_threads=4))  # threads even on 2 cores
    with pytest.raises(UsageError, match=r"compile_threads must be an integer >= 0, got -1"):
        dataclasses.replace(config, compile_threads=-1)
    assert engine.buckets == (1, 2, 3)
    with backend_compiles("greedy_decode_step") as compiled:
        engine.compile_decode_programs()
        assert len(compiled) == 2 + 1 + 1, compiled  # b = 1: two copies; b = 2, 3: one each, no graphs
        assert (engine.decode_compiles["programs"], engine.decode_compiles["threads"]) == (4, 4)
        requests = random_requests(num_prompts=4, input_len=20, output_len=4, range_ratio=0.2, vocab_size=TINY.vocab_size, seed=5)
        engine.warmup(requests)
        result = engine.run(requests, max_concurrency=3)
        assert len(compiled) == 4, compiled
    assert max(step.batch for step in result.steps) == 3
    reference = Engine(ModelRunner(model, prefill_chunk=32), config).run(requests, max_concurrency=3)  # one program a bucket
    for request in requests:
        np.testing.assert_array_equal(result.tokens[request.id], reference.tokens[request.id])


def test_decode_programs_of_engines_with_other_slot_counts_sharing_a_runner():
    """bench_serving builds engines of several slot counts on one runner: each engine's programs
    are lowered with its own cache's types (a cache of 1 slot and one of 3 have the same tree),
    and its steps then compile nothing more."""
    runner = ModelRunner(DSAForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)), prefill_chunk=32)
    requests = random_requests(num_prompts=3, input_len=20, output_len=3, range_ratio=0.2, vocab_size=TINY.vocab_size, seed=7)
    for slots in (1, 3):
        engine = Engine(runner, engine_config(None, max_running_requests=slots, batch_buckets=(slots,)))
        with backend_compiles("greedy_decode_step") as compiled:
            engine.compile_decode_programs()
            assert len(compiled) == 1, compiled
            engine.run(requests, max_concurrency=slots)
            assert len(compiled) == 1, compiled


def test_auto_compile_threads_bounded_by_programs_cores_and_host_memory():
    """compile_threads = 0: a compile per program, no more than a quarter of the cores or one per
    COMPILE_HOST_BYTES of available host memory (the DeepSeek-V3.2 rank at 131,072 tokens, a
    105 GB pinned pool on a 128 GB host, was killed compiling four at once); never none."""
    gib = 1 << 30
    assert auto_compile_threads(4, 16, 50 * gib) == 4  # GLM-5.1's rank at 61,440: unchanged
    assert auto_compile_threads(3, 16, None) == 3  # memory unknown: not capped
    assert auto_compile_threads(4, 16, 15 * gib) == 1  # what a 105 GB pool leaves of 128 GB
    assert auto_compile_threads(4, 16, 20 * gib) == 20 * gib // COMPILE_HOST_BYTES
    assert auto_compile_threads(4, 2, 100 * gib) == 1  # CI's 2 cores
    assert auto_compile_threads(4, None, 0) == 1


def test_decode_programs_take_the_cache_as_a_kernel_hands_it_on():
    """With the Pallas kernels (as on the GPU) a step hands the host pool on typed in device memory,
    though it stays pinned_host, while a fresh cache's is typed in host memory: the programs
    compiled ahead are lowered with the handed-on types, so the warm-up (a synthetic fill, then
    steps) compiles no decode step, as on the H200, where it had compiled each bucket again; the
    fill, compiled beside them for the fresh cache, compiles neither then nor in a later run."""
    model = DSAForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))
    runner = ModelRunner(model, prefill_chunk=32, implementation="pallas", kv_cache_dtype="fp8_e4m3")
    engine = Engine(runner, EngineConfig(max_running_requests=3, context_length=128, hisparse=HISPARSE, synthetic_context=True,
                                         synthetic_topk_overlap=0.9, page_size=64, batch_buckets=(1, 3)))  # fmt: skip
    fresh = jax.typeof(engine.cache.kv.host_pool)
    with backend_compiles("greedy_decode_step", "_fill") as compiled:
        engine.compile_decode_programs()
        assert sorted(compiled) == ["jit(_fill)"] + ["jit(_greedy_decode_step)"] * 2, compiled
        engine.warmup([Request(0, np.zeros(100, np.int32), 2)])
        engine.run([Request(1, np.zeros(90, np.int32), 3)])  # a fill on the cache the steps handed on
        assert len(compiled) == 3, compiled
    assert jax.typeof(engine.cache.kv.host_pool) != fresh  # else this test shows nothing


def test_hisparse_graph_settings_reach_hisparse_caches_alone():
    """hisparse_cuda_graph_max_bs / hisparse_decode_program_copies: HiSparse's steps take them, the
    dense step the shared ones (DeepSeek-V3.2's rank: HiSparse graphs at c = 1 in two copies, the
    baseline graphs at every bucket); an engine compiles every copy of its own cache kind."""
    model = DSAForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))
    runner = ModelRunner(model, prefill_chunk=32, hisparse_cuda_graph_max_bs=1, hisparse_decode_program_copies=2)
    assert (runner.hisparse_graphs.copies_for(1), runner.hisparse_graphs.copies_for(2), runner.dense_graphs.copies_for(1)) == (2, 1, 1)
    prompts = np.arange(18, dtype=np.int32).reshape(2, 9)
    dense = generate(runner, prompts, 3)
    (dense_fns,) = runner._cache_fns.values()
    assert "decode_copy1" not in dense_fns and "decode_without_graphs" not in dense_fns
    one = generate(runner, prompts[:1], 3, hisparse=HISPARSE)  # b = 1: graphs, the copies in turn
    two = generate(runner, prompts, 3, hisparse=HISPARSE)  # b = 2: no graphs
    sparse_fns = [fns for fns in runner._cache_fns.values() if fns is not dense_fns]
    assert sum(fns["decode"]._cache_size() for fns in sparse_fns) >= 1
    assert sum(fns["decode_copy1"]._cache_size() for fns in sparse_fns) >= 1
    assert sum(fns["decode_without_graphs"]._cache_size() for fns in sparse_fns) >= 1
    np.testing.assert_array_equal(two.tokens, dense.tokens)
    np.testing.assert_array_equal(one.tokens, dense.tokens[:1])
    with pytest.raises(ValueError, match="hisparse_decode_program_copies must be an integer >= 1, got 0"):
        ModelRunner(model, hisparse_decode_program_copies=0)
    with pytest.raises(ValueError, match="hisparse_cuda_graph_max_bs must be None or an integer >= 0, got -2"):
        ModelRunner(model, hisparse_cuda_graph_max_bs=-2)
    engine = Engine(ModelRunner(model, prefill_chunk=32, hisparse_decode_program_copies=2), engine_config(HISPARSE, batch_buckets=True))
    engine.compile_buckets()
    (fns,) = engine.runner._cache_fns.values()
    assert fns["decode"]._cache_size() == fns["decode_copy1"]._cache_size() == len(engine.buckets) > 1


def test_buffer_address_log_counts_moves_per_program_copy():
    """A runner given a BufferAddressLog records each step's fresh inputs and outputs by name,
    per (cache kind, bucket, copy); moves() counts, per name, the runs that found it elsewhere
    than that program's run before: an array kept in place never moves, a fresh one each run
    does (on the CPU every fresh buffer is a new one)."""
    log = BufferAddressLog()
    kept = jnp.zeros(4)
    for _ in range(3):
        log.record(("hisparse", 1, 0), dict(kept=kept, fresh=jnp.ones(4) * len(log.records)), dict(out=None))
    ((row),) = log.moves()
    assert row["runs"] == 3 and row["inputs_moved"] == {"['fresh']": 2, "['kept']": 0} and row["outputs_moved"] == {}
    model = DSAForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))
    runner = ModelRunner(model, prefill_chunk=32, decode_program_copies=2)
    runner.buffer_addresses = log = BufferAddressLog()
    generate(runner, np.arange(9, dtype=np.int32)[None], 5, hisparse=HISPARSE)
    programs = {tuple(r["program"]) for r in log.records}
    assert programs == {("hisparse", 1, 0), ("hisparse", 1, 1)}, programs
    (row, _) = log.moves()
    assert set(row["inputs_moved"]) == {"['tokens']", "['positions']", "['previous']", "['src']"}
    assert {"['logits']", "['result'].next_tokens", "['telemetry'].num_misses"} <= set(row["outputs_moved"])


def test_hisparse_decode_compiler_options_reach_the_hisparse_step_alone():
    """hisparse_decode_compiler_options go to HiSparse caches' decode step alone: the dense step
    compiles without them, a HiSparse step with them (an unknown name is refused)."""
    runner = ModelRunner(
        DSAForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)), prefill_chunk=32,
        hisparse_decode_compiler_options={"xla_no_such_option_for_this_test": True},
    )  # fmt: skip
    prompt = np.arange(9, dtype=np.int32)[None]
    assert generate(runner, prompt, 2).tokens.shape == (1, 2)  # the dense step: no options
    with pytest.raises(Exception, match="xla_no_such_option_for_this_test"):
        generate(runner, prompt, 2, hisparse=HISPARSE)
