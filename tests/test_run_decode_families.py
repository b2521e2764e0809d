"""run_decode.py's checkpoint decoding of the DeepSeek-V4 and MiniMax-M3 fixtures, as users run it:

    python run_decode.py --checkpoint=DIR --prompts=DIR/golden.npz --output=OUT.npz --max_new_tokens=32
        --dtype=float32 [--enable_hisparse --hisparse_config=...|--noenable_hisparse]

reproduces the fixture's greedy tokens exactly and its logits within 1e-4 of the largest |logit|,
HiSparse on (device buffers small enough that decoding misses) and off. config.json's model_type
picks the family (models.registry); bad input ends in one `error:` line and exit status 2 before
JAX starts. (The DSA fixtures: tests/test_models.py.)"""

import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "run_decode.py")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
RTOL = 1e-4

# Device buffers just above one selection (V4: index_topk 8 C4 entries; M3: 4 blocks x 4 keys), so
# steps evict and swap rows in from the host (the families' own tests use the same sizes).
CASES = {
    "deepseek_v4_tiny": '{"device_buffer_size": 10}',
    "minimax_m3_tiny": '{"device_buffer_size": 20}',
}


def run_decode(*flags):
    return subprocess.run(
        [sys.executable, SCRIPT, *flags], capture_output=True, text=True, cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300,
    )  # fmt: skip


def assert_refused(done, message):
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr


# no_offload is slow (CI time): the HiSparse run reproduces the fixture here and
# test_engine_serves_family_hisparse_equals_baseline gives each family's baseline HiSparse's tokens.
@pytest.mark.parametrize("hisparse", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["hisparse", "no_offload"])
@pytest.mark.parametrize("fixture", sorted(CASES))
def test_run_decode_reproduces_the_fixture(tmp_path, fixture, hisparse):
    checkpoint = os.path.join(FIXTURES, fixture)
    golden_path = os.path.join(checkpoint, "golden.npz")
    with np.load(golden_path) as data:
        golden = dict(data)
    steps = golden["greedy_tokens"].shape[1]
    assert steps == 32
    output = tmp_path / "out.npz"
    mode = ["--enable_hisparse", f"--hisparse_config={CASES[fixture]}"] if hisparse else ["--noenable_hisparse"]
    done = run_decode(f"--checkpoint={checkpoint}", f"--prompts={golden_path}", f"--output={output}",
                      f"--max_new_tokens={steps}", "--dtype=float32", *mode)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # Progress at INFO while it works: loading, prefill, decode steps (the last one always)
    for said in ("loading weights from", "loaded ", "prefill: 2 prompt(s)", "prefill done", f"decode step {steps - 1}/{steps - 1}"):
        assert said in done.stderr, (said, done.stderr[-3000:])
    if hisparse:  # rows did come from the host pool
        misses = [line for line in done.stderr.splitlines() if "hisparse:" in line and "misses" in line]
        assert misses and int(misses[-1].split("hisparse:")[1].split()[0]) > 0, done.stderr[-3000:]
    with np.load(output) as data:
        assert data["tokens"].dtype == np.int32 and data["logits"].dtype == np.float32
        np.testing.assert_array_equal(data["tokens"], golden["greedy_tokens"])
        error = np.abs(data["logits"] - golden["greedy_logits"]).max() / np.abs(golden["greedy_logits"]).max()
        assert error < RTOL, f"max error {error:.2e} of the largest |logit|"


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    v4, m3 = (os.path.join(FIXTURES, name) for name in ("deepseek_v4_tiny", "minimax_m3_tiny"))
    np.savez(tmp_path / "big.npz", input_ids=np.array([[3, 512]], np.int32))  # both vocabularies are 512
    np.savez(tmp_path / "ok.npz", input_ids=np.array([[3, 5, 7, 9]], np.int32))
    out = str(tmp_path / "out.npz")
    decode = [f"--output={out}", "--max_new_tokens=4", "--dtype=float32"]
    cases = [
        ((f"--checkpoint={v4}", f"--prompts={tmp_path / 'big.npz'}", *decode), "token id 512 outside the vocabulary [0, 512)"),
        ((f"--checkpoint={m3}", f"--prompts={tmp_path / 'big.npz'}", *decode), "token id 512 outside the vocabulary [0, 512)"),
        ((f"--checkpoint={v4}", f"--prompts={tmp_path / 'ok.npz'}", *decode, '--hisparse_config={"top_k": 16}'),
         "top_k (16) must equal the model's index_topk (8)"),
        ((f"--checkpoint={m3}", f"--prompts={tmp_path / 'ok.npz'}", *decode, '--hisparse_config={"top_k": 8}'),
         "top_k (8) is not applied to MiniMax-M3"),
        ((f"--checkpoint={m3}", f"--prompts={tmp_path / 'ok.npz'}", *decode, '--hisparse_config={"device_buffer_size": 8}'),
         "device_buffer_size (8) must be >= top_k (16)"),  # top_k: M3's selection width
        ((f"--checkpoint={v4}", f"--prompts={tmp_path / 'ok.npz'}", *decode, "--kv_cache_dtype=fp8_e4m3"),
         "kv_cache_dtype 'fp8_e4m3' is not supported for model_type 'deepseek_v4'"),
        ((f"--checkpoint={m3}", "--num_prompts=2"), "served only by checkpoint decoding"),
        ((f"--checkpoint={v4}", f"--prompts={tmp_path / 'ok.npz'}", *decode, "--tp_size=2"),
         "--tp_size/--dp_size/--enable_dp_attention: DeepSeek-V4 checkpoint decoding runs on one device; drop them"),
        ((f"--checkpoint={m3}", f"--prompts={tmp_path / 'ok.npz'}", *decode, "--implementation=pallas"),
         "--implementation: MiniMax-M3 checkpoint decoding runs its default kernels; drop it"),
        # serving the tiny models: flags their runners cannot honour
        (("--model=deepseek_v4_tiny", "--kv_cache_dtype=fp8_e4m3"), "kv_cache_dtype 'fp8_e4m3' is not supported"),
        (("--model=minimax_m3_tiny", "--dp_size=2"), "MiniMax-M3 serving runs on one device"),
        (("--model=deepseek_v4_tiny", "--disaggregation_mode=prefill"), "DeepSeek-V4 serving is colocated only"),
    ]  # fmt: skip
    for flags, message in cases:
        assert_refused(run_decode(*flags), message)
    assert sorted(os.listdir(tmp_path)) == ["big.npz", "ok.npz"]  # nothing written


# ---- serving: run_decode.py --model=deepseek_v4_tiny|minimax_m3_tiny ------------------------------
#
# The engine (continuous batching: prefill into a slot, one jitted step over all slots, retire)
# with the families' runners, HiSparse and the no-offload baseline on one random workload. CPU
# compiles dominate (a V4 prefill compile is ~20 s on the 2-core CI machine), so the fast tests
# serve a cut-down model of each family (one sparse layer) through Engine directly; the CLI runs
# of the named tiny models are slow-only.


def _serve(runner, hisparse, requests, *, slots=2, context=64):
    from serving.engine import Engine, EngineConfig

    engine = Engine(runner, EngineConfig(max_running_requests=slots, context_length=context, hisparse=hisparse,
                                         page_size=16, batch_buckets=False, fill_value=float("nan")))  # fmt: skip
    return engine.run(requests, max_concurrency=slots)


def _numpy_weights(model_class, config):
    """A model with N(0, 0.1) weights drawn by numpy: random init through jax.random costs ~15 s of
    small compiles on the CPU (one per parameter shape), more than the serving under test."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_class(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    values = jax.tree.map(lambda s: jnp.asarray((0.1 * rng.standard_normal(s.shape)).astype(s.dtype)), state)
    return nnx.merge(graphdef, values)


def _family_case(family):

    from configs.deepseek_v4 import CSA, DeepseekV4Config
    from configs.minimax_m3 import MiniMaxM3Config
    from hisparse_jax.config import HiSparseConfig
    from models.deepseek_v4.model import DeepseekV4ForCausalLM
    from models.deepseek_v4.runner import V4Runner
    from models.minimax_m3.model import MiniMaxM3ForCausalLM
    from models.minimax_m3.runner import M3Runner

    if family == "deepseek_v4":  # one CSA layer: entries offloaded, indexer keys and window on the device
        config = DeepseekV4Config.tiny().replace(
            num_layers=1, layer_types=(CSA,), mlp_layer_types=("moe",), hc_sinkhorn_iters=2, n_routed_experts=2, num_experts_per_tok=1
        )  # fewer unrolled Sinkhorn iterations and experts: a smaller graph to compile
        model, runner = _numpy_weights(DeepseekV4ForCausalLM, config), V4Runner
        hisparse = HiSparseConfig(top_k=8, device_buffer_size=10)  # 10 entries < the 10..16 a request holds
    else:  # one full and one sparse layer
        config = MiniMaxM3Config.tiny().replace(
            num_layers=2, layer_types=("full_attention", "minimax_m3_sparse"), mlp_layer_types=("dense", "dense")
        )  # dense MLPs: a smaller graph to compile
        model, runner = _numpy_weights(MiniMaxM3ForCausalLM, config), M3Runner
        hisparse = HiSparseConfig(top_k=16, device_buffer_size=20)  # 20 rows < the 41..56 keys a request holds
    return runner(model), hisparse


@pytest.mark.parametrize("family", ["deepseek_v4", "minimax_m3"])
def test_engine_serves_family_hisparse_equals_baseline(family):
    """Three requests through two slots (the third waits for a retired slot, then reuses it): the
    HiSparse run copies rows from the host pool and gives every request the baseline's tokens;
    unwritten rows are NaN, so a read of a row nothing stored would show."""
    from serving.workload import random_requests

    runner, hisparse = _family_case(family)
    requests = random_requests(num_prompts=3, input_len=56, output_len=6, range_ratio=0.7, vocab_size=512, seed=0)
    offloaded = _serve(runner, hisparse, requests)
    baseline = _serve(runner, None, requests)
    assert offloaded.summary["misses"] > 0 and baseline.summary["misses"] == 0
    for r in requests:
        assert len(offloaded.tokens[r.id]) == r.max_new_tokens
        np.testing.assert_array_equal(offloaded.tokens[r.id], baseline.tokens[r.id])


@pytest.mark.slow  # ~1-2 min each on 2 CPU cores: the tiny models' prefill and decode compiles
@pytest.mark.parametrize("model", ["deepseek_v4_tiny", "minimax_m3_tiny"])
def test_run_decode_serves_tiny_family_model(tmp_path, model):
    """`run_decode.py --model=...` as a user runs it: HiSparse and the baseline on one workload,
    the same tokens, misses, results.json and the plots written."""
    import json

    # DeepSeek-V4's compressed rows (one per 4 tokens: 16 at 64) fit its default buffer of 2 x top_k = 16
    # rows, which would miss nothing: a buffer of 9 makes its HiSparse run copy rows in.
    buffer = ['--hisparse_config={"device_buffer_size": 9}'] if model == "deepseek_v4_tiny" else []
    done = run_decode(f"--model={model}", "--num_prompts=3", "--random_input_len=64", "--random_output_len=6",
                      "--max_concurrency=2", "--max_running_requests=2", "--device_buffer_sweep=", "--dtype=float32",
                      "--noprogress", f"--output_dir={tmp_path}", *buffer)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same tokens for every request in every run: True" in done.stdout
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    assert results["tokens_identical"] and {p["mode"] for p in results["points"]} == {"hisparse", "baseline"}
    assert next(p for p in results["points"] if p["mode"] == "hisparse")["misses"] > 0
    assert all(os.path.exists(path) for path in results["files"].values())
