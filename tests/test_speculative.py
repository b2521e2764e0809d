"""Speculative decoding with the MTP layer (models.dsa.speculative): greedy decoding with
speculation gives exactly the tokens of greedy decoding without it, which for these fixtures are
the transformers reference's (golden.npz of the source fixtures; tests/fixtures/*_mtp add a
random MTP layer to them).

CPU, float32. HiSparse on (top_k + a few slots, so decoding misses and evicts; NaN in every
unwritten row) and off. Drafts: the MTP layer's own (random weights: it proposes what the target
rarely agrees with), the target's own next tokens (every draft accepted: the machinery's
ceiling), deliberately wrong ones (none accepted), and the target's with some corrupted (every
acceptance length from 0 to N, so rollbacks of 1 .. N tokens); in that last case every place a
rejected token could have left something (speculative slots, host rows, device rows and indexer
keys past the new lengths) is filled with NaN after each step.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.speculative import SpeculativeConfig, SpeculativeConfigError
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.state import FullKVState
from models.dsa.decoding import DecodeCache, cache_shardings
from models.dsa.generate import generate
from models.dsa.loading import load_hf_checkpoint
from models.dsa.runner import ModelRunner
from pallas_kernels.swap_in import host_slots_of

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
# (checkpoint with an MTP layer, the source fixture whose golden.npz it shares, (top_k, device_buffer_size))
DEEPSEEK = ("deepseek_v32_tiny_mtp", "deepseek_v32_tiny", (16, 24))
DEEPSEEK_FP8 = ("deepseek_v32_tiny_fp8_mtp", "deepseek_v32_tiny_fp8", (16, 24))
GLM = ("glm_moe_dsa_tiny_mtp", "glm_moe_dsa_tiny", (8, 10))
RTOL = 1e-4  # logits, relative to the largest |logit| (tests/test_models.py's)
SPEC = SpeculativeConfig(num_steps=3)


def load(fixture):
    name, source, buffers = fixture
    with np.load(os.path.join(FIXTURES, source, "golden.npz")) as data:
        golden = dict(data)
    return load_hf_checkpoint(os.path.join(FIXTURES, name), dtype=jnp.float32), golden, buffers


def sequence(golden, extra):
    """i32[B, T + N + extra]: prompt and greedy tokens by position (what a copying draft reads)."""
    prompts, tokens = golden["input_ids"], golden["greedy_tokens"]
    return np.concatenate([prompts, tokens, np.zeros((prompts.shape[0], extra), np.int32)], axis=1)


def assert_greedy(out, golden):
    np.testing.assert_array_equal(out.tokens, golden["greedy_tokens"])
    error = np.abs(out.logits - golden["greedy_logits"]).max() / np.abs(golden["greedy_logits"]).max()
    assert error < RTOL, f"logits off by {error:.2e} of the largest"


# Under -m slow (CI time), each still covered in the default run: GLM without offload by
# test_every_rollback_length_...[glm_no_offload]; DeepSeek-V3.2's MTP drafts to the reference
# tokens by test_engine_speculates_...[baseline] (no offload) and [hisparse] (same fixture and
# drafts, through the engine), and the MTP layer missing with HiSparse by deepseek_v32_fp8-hisparse_on
# (the same architecture, fp8 weights) and glm_moe_dsa-hisparse_on.
@pytest.mark.parametrize(
    "fixture_name, hisparse",
    [pytest.param(DEEPSEEK, False, marks=pytest.mark.slow), pytest.param(DEEPSEEK, True, marks=pytest.mark.slow),
     pytest.param(GLM, False, marks=pytest.mark.slow), (GLM, True),
     pytest.param(DEEPSEEK_FP8, False, marks=pytest.mark.slow), (DEEPSEEK_FP8, True)],
    ids=["deepseek_v32-hisparse_off", "deepseek_v32-hisparse_on", "glm_moe_dsa-hisparse_off", "glm_moe_dsa-hisparse_on",
         "deepseek_v32_fp8-hisparse_off", "deepseek_v32_fp8-hisparse_on"],
)  # fmt: skip
def test_mtp_drafts_decode_the_reference_tokens(fixture_name, hisparse):
    model, golden, (top_k, buffer) = load(fixture_name)
    config = HiSparseConfig(top_k=top_k, device_buffer_size=buffer) if hisparse else None
    runner = ModelRunner(model, prefill_chunk=16, speculative=SPEC)
    steps = golden["greedy_tokens"].shape[1]
    out = generate(runner, golden["input_ids"], steps, hisparse=config, page_size=16, fill_value=np.nan, speculative=SPEC)
    assert_greedy(out, golden)
    assert out.num_misses.shape == (len(out.num_accepted), model.config.num_layers + 1, 2)  # the MTP layer last
    if hisparse:
        assert (out.num_misses.sum(axis=(0, 2)) > 0).all(), "every layer, the MTP layer too, should miss"


@pytest.mark.parametrize("draft", ["copy", "wrong"])
def test_copying_and_wrong_drafts_bound_the_acceptance(draft):
    model, golden, (top_k, buffer) = load(DEEPSEEK)
    runner = ModelRunner(model, prefill_chunk=16, speculative=SPEC)
    steps = golden["greedy_tokens"].shape[1]
    seq = sequence(golden, SPEC.tokens_per_step)
    override = seq if draft == "copy" else (seq + 1) % model.config.vocab_size
    config = HiSparseConfig(top_k=top_k, device_buffer_size=buffer)
    out = generate(runner, golden["input_ids"], steps, hisparse=config, page_size=16, fill_value=np.nan, speculative=SPEC,
                   draft_override=override)  # fmt: skip
    assert_greedy(out, golden)
    expected = SPEC.num_steps if draft == "copy" else 0
    assert (out.num_accepted == expected).all(), out.num_accepted
    assert len(out.num_accepted) == (-(-(steps - 1) // SPEC.tokens_per_step) if draft == "copy" else steps - 1)


def poison_fn(cache: DecodeCache):
    """A jitted (cache, lengths i32[R], ends i32[R]) -> cache that fills with NaN every place a
    token at positions lengths .. ends - 1 may have left anything: speculative slots, host rows
    (HiSparse), device rows (no offload), indexer keys and their scales."""

    def poison(cache, lengths, ends):
        C = cache.index_keys.shape[2]
        dead = (jnp.arange(C)[None, :] >= lengths[:, None]) & (jnp.arange(C)[None, :] < ends[:, None])  # bool[R, C]
        keys = jnp.where(dead[None, :, :, None], jnp.nan, cache.index_keys.astype(jnp.float32)).astype(cache.index_keys.dtype)
        scales = cache.index_key_scales
        if scales.shape[2]:
            scales = jnp.where(dead[None], jnp.nan, scales)
        kv = cache.kv
        nan = jnp.asarray(kv.layout.fill_element(jnp.nan), kv.layout.dtype)
        if isinstance(kv, FullKVState):
            kv = kv.replace(kv=jnp.where(dead[None, :, :, None], nan, kv.kv))
        else:
            host = jax.vmap(host_slots_of, in_axes=(0, None, None))(kv.host_page_table, jnp.arange(C), kv.page_size)
            pool = kv.host_pool.at[:, jnp.where(dead, host, kv.host_pool.shape[1]).reshape(-1)].set(nan, mode="drop")
            kv = kv.replace(host_pool=pool, device_buffer=kv.device_buffer.at[:, :, kv.buffer_size + 1 :].set(nan))
        return DecodeCache(kv, keys, scales)

    return jax.jit(poison, donate_argnums=0, out_shardings=cache_shardings(cache))


@pytest.mark.parametrize(
    "fixture_name, hisparse, buffer",
    [(DEEPSEEK, True, None), (GLM, True, None), (DEEPSEEK, True, 40), (GLM, False, None)],
    ids=["deepseek_hisparse", "glm_hisparse", "deepseek_hisparse_plans_of_2_positions", "glm_no_offload"],
)
def test_every_rollback_length_leaves_nothing_of_rejected_tokens(fixture_name, hisparse, buffer):
    """Drafts = the target's tokens with some corrupted, so steps accept 0 .. N drafts; after each
    step every place a rejected token could be is NaN, and decoding goes on to the reference's
    tokens. With a 40-slot buffer (top_k 16) two positions share each plan."""
    model, golden, (top_k, default_buffer) = load(fixture_name)
    runner = ModelRunner(model, prefill_chunk=16, speculative=SPEC)
    prompts, steps = golden["input_ids"], golden["greedy_tokens"].shape[1]
    B, T = prompts.shape
    seq = sequence(golden, SPEC.tokens_per_step)
    wrong = np.random.default_rng(0).random(seq.shape) < 0.3
    override = np.where(wrong, (seq + 1) % model.config.vocab_size, seq).astype(np.int32)
    config = HiSparseConfig(top_k=top_k, device_buffer_size=buffer or default_buffer) if hisparse else None
    max_context = T + steps + SPEC.tokens_per_step
    cache = runner.create_cache(num_requests=B, max_context=max_context, hisparse=config, page_size=16, fill_value=np.nan,
                                num_host_pages=B * -(-max_context // 16))  # fmt: skip
    drafts = []
    for b in range(B):
        pages = np.arange(b * -(-max_context // 16), (b + 1) * -(-max_context // 16), dtype=np.int32)[::-1].copy() if config else None
        job = runner.start_prefill(cache, b, prompts[b], host_pages=pages)
        cache = job.cache
        while not job.done:
            cache = job.advance(cache)
        drafts.append(job.draft)
    carry = jax.tree.map(lambda *parts: jnp.stack(parts), *drafts)
    poison = poison_fn(cache)
    tokens = [[int(t)] for t in np.asarray(carry.bonus)]
    lengths, seen = np.full(B, T, np.int32), set()
    while min(map(len, tokens)) < steps:
        running = np.array([len(t) < steps for t in tokens])
        cache, out = runner.speculative_step(cache, carry, np.where(running, lengths, -1).astype(np.int32), override)
        accepted, carry = np.asarray(out.num_accepted), out.carry
        for b in np.flatnonzero(running):
            tokens[b].extend(np.asarray(out.tokens)[b, : min(accepted[b] + 1, steps - len(tokens[b]))].tolist())
            seen.add(int(accepted[b]))
        ends = lengths + SPEC.tokens_per_step
        lengths = np.where(running, lengths + accepted + 1, lengths)
        np.testing.assert_array_equal(np.asarray(cache.kv.seq_lens), lengths)
        cache = poison(cache, jnp.asarray(lengths), jnp.asarray(np.where(running, ends, lengths)))
    np.testing.assert_array_equal(np.array(tokens), golden["greedy_tokens"])
    assert seen == set(range(SPEC.num_steps + 1)), f"acceptance lengths seen: {sorted(seen)}"


def test_speculative_config_takes_sglang_values_only():
    assert SpeculativeConfig(num_steps=3).num_draft_tokens == 4
    assert SpeculativeConfig(num_steps=2, num_draft_tokens=3).tokens_per_step == 3
    with pytest.raises(SpeculativeConfigError, match=r"speculative_eagle_topk=4 is not supported: only 1"):
        SpeculativeConfig(eagle_topk=4)
    with pytest.raises(SpeculativeConfigError, match=r"speculative_num_draft_tokens=8 must be speculative_num_steps \+ 1 \(4\)"):
        SpeculativeConfig(num_steps=3, num_draft_tokens=8)
    with pytest.raises(SpeculativeConfigError, match=r"speculative_algorithm 'MEDUSA' is not supported"):
        SpeculativeConfig(algorithm="MEDUSA")
    with pytest.raises(SpeculativeConfigError, match=r"speculative_num_steps=0 must be a positive integer"):
        SpeculativeConfig(num_steps=0)


def test_a_model_without_mtp_cannot_speculate():
    model = load_hf_checkpoint(os.path.join(FIXTURES, "deepseek_v32_tiny"), dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"needs the model's MTP layer"):
        ModelRunner(model, speculative=SPEC)


# baseline is slow (CI time): test_serving_run_reports_acceptance_and_plots_it serves the baseline
# speculating and checks it gives HiSparse's tokens.
@pytest.mark.parametrize("hisparse", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["hisparse", "baseline"])
def test_engine_speculates_to_the_reference_tokens_and_gives_everything_back(hisparse):
    """Three requests through two slots (one retires early at its EOS, one at a short
    max_new_tokens; compaction moves the third down; batch buckets): each gets the reference's
    greedy tokens, the summary its acceptance length, and every slot, page and byte comes back."""
    from serving.engine import Engine, EngineConfig
    from serving.errors import UsageError
    from serving.workload import Request

    model, golden, (top_k, buffer) = load(DEEPSEEK)
    prompts, greedy = golden["input_ids"], golden["greedy_tokens"]
    eos = int(greedy[1, 9])
    stop = 1 + int(np.flatnonzero(greedy[1] == eos)[0])  # the reference's tokens up to its first EOS
    requests = [Request(0, prompts[1], 24, eos_token_id=eos), Request(1, prompts[0], 24), Request(2, prompts[1], 5)]
    expected = {0: greedy[1, :stop], 1: greedy[0], 2: greedy[1, :5]}
    config = EngineConfig(
        max_running_requests=2, context_length=prompts.shape[1] + 24 + SPEC.num_steps - 1, page_size=16, fill_value=np.nan,
        hisparse=HiSparseConfig(top_k=top_k, device_buffer_size=buffer, host_to_device_ratio=8) if hisparse else None,
    )  # fmt: skip
    engine = Engine(ModelRunner(model, prefill_chunk=16, speculative=SPEC), config)
    engine.compile_buckets()  # from the engine's first carry, as warm-up does
    result = engine.run(requests)
    for request_id, tokens in expected.items():
        np.testing.assert_array_equal(result.tokens[request_id], tokens, err_msg=f"request {request_id}")
    assert engine.scheduler.all_free()
    summary = result.summary
    assert 1 <= summary["acceptance_length"] <= SPEC.tokens_per_step
    assert summary["output_tokens"] == sum(len(t) for t in expected.values())
    assert all(step.accepted is not None and step.emitted >= step.running for step in result.steps)
    assert (summary["misses"] > 0) == hisparse
    # One compile per batch bucket: the engine's first carry is placed where the step leaves it
    # (unplaced, the run compiled every bucket again).
    assert engine.runner._jitted(engine.cache)["speculative"]._cache_size() == len(engine.buckets)
    # A last step may write num_steps - 1 positions past prompt + max_new_tokens: admission counts them.
    with pytest.raises(UsageError, match=r"needs 123 tokens \(96 prompt \+ 25 new \+ 2 speculative\) > context_length 122"):
        engine.run([Request(3, prompts[0], 25)])


def run_decode(*flags):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(
        [sys.executable, os.path.join(root, "run_decode.py"), *flags], capture_output=True, text=True, cwd=root,
        env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600,
    )  # fmt: skip


def test_checkpoint_decoding_with_sglang_flags_reproduces_the_fixture(tmp_path):
    name, source, _ = GLM
    prompts = os.path.join(FIXTURES, source, "golden.npz")
    done = run_decode(
        f"--checkpoint={os.path.join(FIXTURES, name)}", f"--prompts={prompts}", f"--output={tmp_path / 'out.npz'}",
        "--max_new_tokens=16", "--dtype=float32", '--hisparse_config={"device_buffer_size": 10}',
        "--speculative_algorithm=EAGLE", "--speculative_num_steps=2", "--speculative_eagle_topk=1", "--speculative_num_draft_tokens=3",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(prompts) as golden, np.load(tmp_path / "out.npz") as out:
        np.testing.assert_array_equal(out["tokens"], golden["greedy_tokens"])
        assert out["num_accepted"].shape[1] == 2 and out["num_accepted"].max() <= 2
    assert "acceptance length" in done.stderr


def test_serving_run_reports_acceptance_and_plots_it(tmp_path):
    done = run_decode(
        f"--output_dir={tmp_path}", "--speculative_algorithm=EAGLE", "--num_prompts=4", "--random_input_len=48",
        "--random_output_len=12", "--max_concurrency=2", "--max_running_requests=2", "--device_buffer_sweep=", "--noprogress",
        "--dtype=float32",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    assert results["run"]["speculative"] == dict(num_steps=3, eagle_topk=1, num_draft_tokens=4, algorithm="EAGLE")
    assert results["run"]["overlap_schedule"] is False
    for point in results["points"]:
        assert 1 <= point["acceptance_length"] <= 4 and len(point["steps"]["accepted"]) == point["decode_steps"]
    assert results["tokens_identical"] is True  # HiSparse and the baseline, both speculating
    with open(tmp_path / "accepted_per_step.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "acceptance length" in done.stdout


def test_device_footprint_counts_the_mtp_layer_and_the_speculative_slots():
    from models.dsa.footprint import DeviceFootprint

    config = load_hf_checkpoint(os.path.join(FIXTURES, DEEPSEEK[0]), dtype=jnp.float32).config
    hisparse = HiSparseConfig(top_k=16, device_buffer_size=24)
    plain = DeviceFootprint.of(config, jnp.float32, hisparse)
    spec = DeviceFootprint.of(config, jnp.float32, hisparse, speculative=SPEC)
    keys = (config.num_layers + 1) * 100 * spec.key_bytes  # one more indexer (the MTP layer's)
    assert spec.request_bytes(100) == (config.num_layers + 1) * (24 + 1 + SPEC.tokens_per_step) * spec.row_bytes + keys
    assert plain.request_bytes(100) == config.num_layers * (24 + 1) * plain.row_bytes + config.num_layers * 100 * plain.key_bytes
    baseline = DeviceFootprint.of(config, jnp.float32, None, speculative=SPEC)  # every row on the device, no slots
    assert baseline.request_bytes(100) == (config.num_layers + 1) * 100 * (baseline.row_bytes + baseline.key_bytes)
