"""run_decode.py as users run it: the default command (tiny model, HiSparse vs baseline, plots),
a labelled synthetic-selection run, and bad input (flags, prompts, files) ending in one line and
exit status 2 with nothing written. (Checkpoint decoding through run_decode.py:
tests/test_models.py; the checks themselves, without a subprocess: tests/test_inputs.py.)"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "run_decode.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_decode(*flags, cwd=ROOT):
    return subprocess.run(
        [sys.executable, SCRIPT, *flags], capture_output=True, text=True, cwd=cwd,
        env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300,
    )  # fmt: skip


def assert_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC, path


def test_default_command_serves_and_writes_results_and_plots(tmp_path):
    done = run_decode(f"--output_dir={tmp_path}")  # every other flag at its default
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    assert results["run"]["selection"] == "model selection"
    points = {(p["mode"], p["max_concurrency"]): p for p in results["points"]}
    assert set(points) == {(m, c) for m in ("hisparse", "baseline") for c in (1, 4, 8)}
    for point in points.values():
        assert point["num_requests"] == 16 and point["output_throughput"] > 0
        assert len(point["steps"]["misses"]) == point["decode_steps"]
    assert points["hisparse", 8]["misses"] > 0 and points["baseline", 8]["misses"] == 0
    # Same budget: HiSparse fits more requests at once than the full-KV baseline.
    assert results["capacity"]["hisparse"] > results["capacity"]["baseline"]
    assert points["hisparse", 8]["max_running"] > points["baseline", 8]["max_running"]
    assert results["tokens_identical"] is True
    # KV bytes per request at context_length: HiSparse holds less on the device, the rest in the host pool
    kv = results["kv_bytes_per_request"]
    assert kv["hisparse"]["device"] < kv["baseline"]["device"] and kv["hisparse"]["host"] > 0 == kv["baseline"]["host"]
    assert all(p["kv_bytes_per_request"] == kv[p["mode"]] for p in results["points"])
    assert "KV bytes per request at context_length" in done.stdout and "same tokens for every request" in done.stdout
    assert [p["device_buffer_size"] for p in results["buffer_sweep"]] == [16, 32, 64]
    for name in ("throughput_vs_concurrency", "misses_over_time", "misses_vs_buffer_size", "misses_over_time_by_buffer"):
        assert_png(tmp_path / f"{name}.png")
    assert "hisparse / baseline output throughput" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.slow  # ~37 s on 2 cores (CI time), as the engine-level synthetic runs in tests/test_engine.py
def test_synthetic_selection_outputs_are_labelled_apart(tmp_path):
    done = run_decode(f"--output_dir={tmp_path}", "--synthetic_topk_overlap=0.9", "--num_prompts=4", "--random_input_len=64",
                      "--max_concurrency=4", "--device_buffer_sweep=", "--nocompare_baseline", "--noprogress")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    files = sorted(os.listdir(tmp_path))
    assert files and all(name.startswith("synthetic_overlap0.9_") for name in files), files
    with open(tmp_path / "synthetic_overlap0.9_results.json") as f:
        results = json.load(f)
    assert results["run"]["selection"] == "SYNTHETIC top-k, overlap 0.9"
    assert all(p["selection"] == "synthetic(overlap=0.9)" for p in results["points"])
    assert "SYNTHETIC" in done.stdout


CHECKPOINT = os.path.join(ROOT, "tests", "fixtures", "deepseek_v32_tiny")  # vocab 512, max_position_embeddings 512


def write_bad_inputs(directory):
    """The files the bad-input cases name as {tmp}/NAME."""
    with np.load(os.path.join(CHECKPOINT, "golden.npz")) as data:
        ids = data["input_ids"]  # int32 [2, 96]
    for name, value in {
        "ok": ids, "vocab": np.where(ids == ids[0, 3], 512, ids), "negative": ids - 600, "float": ids.astype(np.float32),
        "bool": ids > 100, "str": ids.astype(str), "object": np.array([[1, "a"]], dtype=object),
        "no_rows": ids[:0], "no_columns": ids[:, :0], "1d": ids[0],
    }.items():  # fmt: skip
        np.savez(directory / f"{name}.npz", input_ids=value)
    np.savez(directory / "no_key.npz", tokens=ids)
    np.save(directory / "prompts.npy", ids)
    shutil.copy(directory / "prompts.npy", directory / "npy_inside.npz")
    (directory / "text.npz").write_text("not an archive")
    for name, config in {"bad_json": "{nope", "bad_type": '{"model_type": "deepseek_v32", "num_hidden_layers": "3"}'}.items():
        (directory / name).mkdir()
        (directory / name / "config.json").write_text(config)


def checkpoint_decoding(prompts="ok.npz", *flags, checkpoint=CHECKPOINT, output="{tmp}/out.npz"):
    return [f"--checkpoint={checkpoint}", "--prompts={tmp}/" + prompts, f"--output={output}", *flags]


def serving(*flags):
    return ["--output_dir={tmp}/out", *flags]


BAD_INPUT = {
    # serving
    "model": (serving("--model=gpt2"), "is not a built-in config"),
    "concurrency": (serving("--max_concurrency=1,x"), "--max_concurrency must be a comma-separated list of integers"),
    "buffer": (serving('--hisparse_config={"device_buffer_size": 4}'), "device_buffer_size (4) must be >= top_k (16)"),
    "context": (serving("--context_length=50"), "> context_length 50"),
    "context_over_model": (serving("--context_length=1000"), "--context_length=1000 exceeds the model's max_position_embeddings (512)"),
    "sweep": (serving("--device_buffer_sweep=16,8"), "device_buffer_size (8) must be >= top_k (16)"),
    "tp_size": (serving("--tp_size=3"), "the model's 4 attention heads do not split over 3 devices"),
    "unused_in_serving": (serving("--max_new_tokens=8"), "--max_new_tokens is not used by serving"),
    "positional": (serving("extra"), "unexpected arguments ['extra']"),
    "kv_cache_dtype": (serving("--kv_cache_dtype=int4"), "--kv_cache_dtype='int4': use one of ('auto', 'bfloat16', 'fp8_e4m3')"),
    "prefill_budget": (serving("--prefill_token_budget=0"), "--prefill_token_budget must be a positive integer, got 0"),
    "v4_residency": (serving("--model=deepseek_v4_tiny", '--hisparse_config={"dynamic_residency": {"mode": "adaptive"}}'),
                     "--hisparse_config: dynamic_residency is not supported by DeepSeek-V4 serving yet"),
    "tp_residency": (serving("--tp_size=2", '--hisparse_config={"dynamic_residency": true}'),
                     "--hisparse_config: dynamic_residency runs on one device only yet"),
    "full_size": (serving("--model=deepseek_v32"), "--model=deepseek_v32 needs ~1.4 TB of weights in bfloat16 +"),  # no machine here has 1.3 TB
    "pd_decode_unused": (serving("--disaggregation_mode=decode", "--num_prompts=3", "--compare_baseline"),
                         "--compare_baseline, --num_prompts are not used by a PD decode instance (--disaggregation_mode=decode)"),
    "pd_decode_sweep": (serving("--disaggregation_mode=decode", "--device_buffer_sweep=16"), "--device_buffer_sweep is not used by a PD decode instance"),
    "pd_decode_concurrency": (serving("--disaggregation_mode=decode", "--max_concurrency=1,4"), "a PD decode instance takes one value"),
    "pd_prefill_output": (serving("--disaggregation_mode=prefill"), "--output_dir is not used by a PD prefill instance"),
    "pd_timeout": (serving("--disaggregation_mode=decode", "--disaggregation_timeout_s=0"), "--disaggregation_timeout_s must be a positive number, got 0.0"),
    "pd_timeout_colocated": (serving("--disaggregation_timeout_s=5"), "--disaggregation_timeout_s is not used without --disaggregation_mode"),
    "sweep_without_hisparse": (serving("--noenable_hisparse", "--device_buffer_sweep=16"), "--device_buffer_sweep needs --enable_hisparse"),
    # checkpoint decoding: prompts
    "vocab": (checkpoint_decoding("vocab.npz"), "input_ids holds token id 512 outside the vocabulary [0, 512)"),
    "negative": (checkpoint_decoding("negative.npz"), "outside the vocabulary [0, 512)"),
    "float": (checkpoint_decoding("float.npz"), "input_ids must hold integer token ids, got dtype float32"),
    "bool": (checkpoint_decoding("bool.npz"), "input_ids must hold integer token ids, got dtype bool"),
    "str": (checkpoint_decoding("str.npz"), "input_ids must hold integer token ids, got dtype <U"),
    "object": (checkpoint_decoding("object.npz"), "input_ids is an object array"),
    "no_rows": (checkpoint_decoding("no_rows.npz"), "input_ids is empty (shape (0, 96))"),
    "no_columns": (checkpoint_decoding("no_columns.npz"), "input_ids is empty (shape (2, 0))"),
    "1d": (checkpoint_decoding("1d.npz"), "input_ids must be a [B, T] array"),
    "too_long": (checkpoint_decoding("ok.npz", "--max_new_tokens=417"), "96 + max_new_tokens 417 = 513 tokens exceeds the model's max_position_embeddings (512)"),
    "max_new_tokens": (checkpoint_decoding("ok.npz", "--max_new_tokens=1000000"), "exceeds the model's max_position_embeddings (512)"),
    "no_new_tokens": (checkpoint_decoding("ok.npz", "--max_new_tokens=0"), "--max_new_tokens must be a positive integer"),
    # checkpoint decoding: files
    "npy": (checkpoint_decoding("prompts.npy"), "prompts.npy is not an .npz file"),
    "npy_inside": (checkpoint_decoding("npy_inside.npz"), "holds a single .npy array"),
    "not_npz": (checkpoint_decoding("text.npz"), "text.npz is not an .npz archive"),
    "no_input_ids": (checkpoint_decoding("no_key.npz"), "has no input_ids array (found ['tokens'])"),
    "no_prompts_file": (checkpoint_decoding("missing.npz"), "--prompts: no file"),
    "bad_json": (checkpoint_decoding(checkpoint="{tmp}/bad_json"), "cannot read model config"),
    "bad_config": (checkpoint_decoding(checkpoint="{tmp}/bad_type"), "config.json: malformed config"),
    "checkpoint_file": (checkpoint_decoding(checkpoint=os.path.join(CHECKPOINT, "config.json")), "is a file, not a directory"),
    "no_checkpoint_dir": (checkpoint_decoding(checkpoint="{tmp}/missing"), "does not exist"),
    "output_suffix": (checkpoint_decoding(output="{tmp}/out"), "--output: {tmp}/out must end in .npz"),
    "output_dir": (checkpoint_decoding(output="{tmp}/missing/out.npz"), "--output: directory {tmp}/missing does not exist"),
    "top_k": (checkpoint_decoding("ok.npz", '--hisparse_config={"top_k": 32}'), "HiSparse top_k (32) must equal the model's index_topk (16)"),
    "needs_checkpoint": (["--prompts=p.npz", "--output=o.npz"], "needs --checkpoint=DIR"),
    # checkpoint decoding: flags it does not read, bad values whatever the mode
    "unused_flag": (checkpoint_decoding("ok.npz", "--context_length=64"), "--context_length is not used by checkpoint decoding"),
    "unused_seed": (checkpoint_decoding("ok.npz", "--seed=2"), "--seed is not used by checkpoint decoding"),
    "mesh_heads": (checkpoint_decoding("ok.npz", "--tp_size=3"), "--tp_size/--dp_size/--enable_dp_attention: the model's 4 attention heads do not split over 3 devices"),
    "mesh_prompts": (checkpoint_decoding("ok.npz", "--tp_size=4", "--dp_size=4", "--enable_dp_attention"),
                     "--tp_size/--dp_size/--enable_dp_attention: 2 prompts (rows of {tmp}/ok.npz input_ids) do not split over 4 data-parallel groups"),
    "mesh_dp_attention": (checkpoint_decoding("ok.npz", "--tp_size=3", "--dp_size=2", "--enable_dp_attention"), "tp_size (3) must be a multiple of dp_size (2)"),
    "implementation": (checkpoint_decoding("ok.npz", "--implementation=cuda"), "--implementation='cuda': use one of ('reference', 'pallas', 'tpu')"),
    "bad_unused_value": (checkpoint_decoding("ok.npz", "--context_length=0"), "--context_length must be an integer >= 2, got 0"),
    "kv_cache_dtype_checkpoint": (checkpoint_decoding("ok.npz", "--kv_cache_dtype=int4"), "--kv_cache_dtype='int4': use one of"),
    "weights_dtype": (checkpoint_decoding("ok.npz", "--weights_dtype=int4"), "--weights_dtype='int4': use one of"),
    "weights_dtype_mismatch": (checkpoint_decoding("ok.npz", "--weights_dtype=float32"),
                               "--weights_dtype=float32: DSA checkpoints take auto, fp8_e4m3 or --dtype's name (bfloat16)"),
    "weights_dtype_serving": (serving("--weights_dtype=fp8_e4m3"), "--weights_dtype is not used by serving"),
    "fp8_activations_bf16_checkpoint": (checkpoint_decoding("ok.npz", "--fp8_activations"),
                                        "--fp8_activations needs a DSA checkpoint with block-FP8 weights"),
    "fp8_activations_serving": (serving("--fp8_activations"), "--fp8_activations is not used by serving"),
    # speculative decoding (SGLang's flags; serving.speculation)
    "speculative_topk": (checkpoint_decoding("ok.npz", "--speculative_algorithm=EAGLE", "--speculative_eagle_topk=2"),
                         "--speculative_eagle_topk=2 is not supported: only 1 (chain drafting, no tree)"),
    "speculative_draft_tokens": (serving("--speculative_algorithm=EAGLE", "--speculative_num_steps=2", "--speculative_num_draft_tokens=4"),
                                 "--speculative_num_draft_tokens=4 must be speculative_num_steps + 1 (3)"),
    "speculative_without_algorithm": (serving("--speculative_num_steps=2"), "--speculative_num_steps is not used without --speculative_algorithm=EAGLE"),
    "speculative_algorithm": (serving("--speculative_algorithm=MEDUSA"), "--speculative_algorithm 'MEDUSA' is not supported"),
    "speculative_without_mtp": (checkpoint_decoding("ok.npz", "--speculative_algorithm=EAGLE"), "needs the model's MTP layer"),
    "speculative_pd": (serving("--speculative_algorithm=EAGLE", "--disaggregation_mode=decode"), "does not run with --disaggregation_mode"),
}


@pytest.mark.parametrize("flags, message", list(BAD_INPUT.values()), ids=list(BAD_INPUT))
def test_bad_input_ends_with_one_line_and_status_2(tmp_path, flags, message):
    write_bad_inputs(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    done = run_decode(*(flag.replace("{tmp}", str(tmp_path)) for flag in flags))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message.replace("{tmp}", str(tmp_path)) in errors[0], done.stderr[-2000:]
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, not even the output directory


def test_noenable_hisparse_alone_serves_the_baseline(tmp_path):
    # The default --device_buffer_sweep (HiSparse's) used to refuse this: a default the user never set.
    done = run_decode(f"--output_dir={tmp_path}", "--noenable_hisparse", "--num_prompts=2", "--random_input_len=16",
                      "--random_output_len=4", "--max_concurrency=2", "--noprogress")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    assert [p["mode"] for p in results["points"]] == ["baseline"] and results["buffer_sweep"] == []
    # one run, nothing to compare: no "same tokens" claim
    assert results["tokens_identical"] is None and "same tokens" not in done.stdout


RTOL = 1e-4  # of the largest |logit|, as tests/test_parallel_models.py


def decode_fixture(tmp_path, *flags, steps=None):
    """run_decode.py's checkpoint decoding of the deepseek_v32_tiny fixture's prompts (float32;
    `steps` tokens, default golden.npz's 24) -> its stderr; the tokens and logits checked against
    the golden ones."""
    golden_path, output = os.path.join(CHECKPOINT, "golden.npz"), tmp_path / "out.npz"
    with np.load(golden_path) as data:
        golden = dict(data)
    steps = steps or golden["greedy_tokens"].shape[1]
    done = run_decode(f"--checkpoint={CHECKPOINT}", f"--prompts={golden_path}", f"--output={output}",
                      f"--max_new_tokens={steps}", "--dtype=float32", *flags)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(output) as data:
        np.testing.assert_array_equal(data["tokens"], golden["greedy_tokens"][:, :steps])
        error = np.abs(data["logits"] - golden["greedy_logits"][:, :steps]).max() / np.abs(golden["greedy_logits"]).max()
        assert error < RTOL, f"max error {error:.2e} of the largest |logit|"
    return done.stderr


def test_checkpoint_decoding_with_fp8_activations_runs_w8a8(tmp_path):
    """The FP8 fixture with --fp8_activations: every matmul over its block-FP8 weights quantises
    its activations (w8a8), so the logits move off the golden (w8a16) ones: by more than float32
    round-off. Not by a bound: the fixture's router margins are ~10x float32 round-off, so e4m3's
    ~2% per matmul flips experts (one projection's rounding alone moves some positions' logits by
    25-40% of the largest); tests/test_grouped_matmul.py checks w8a8's numbers against its
    reference."""
    fp8 = os.path.join(ROOT, "tests", "fixtures", "deepseek_v32_tiny_fp8")
    golden_path, output = os.path.join(fp8, "golden.npz"), tmp_path / "out.npz"
    with np.load(golden_path) as data:
        golden = dict(data)
    steps = 4
    done = run_decode(f"--checkpoint={fp8}", f"--prompts={golden_path}", f"--output={output}", f"--max_new_tokens={steps}",
                      "--dtype=float32", "--fp8_activations")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(output) as data:
        first = data["logits"][:, 0]  # the first step's logits: the same prompt, whatever tokens followed
        assert data["tokens"].shape == (golden["greedy_tokens"].shape[0], steps) and np.all(np.isfinite(data["logits"]))
    error = np.abs(first - golden["greedy_logits"][:, 0]).max() / np.abs(golden["greedy_logits"]).max()
    assert error > 10 * RTOL, error


def misses_logged(stderr: str) -> int:
    lines = [line for line in stderr.splitlines() if "hisparse:" in line and " misses over " in line]
    return int(lines[-1].split("hisparse:")[1].split()[0]) if lines else 0


# device_buffer_size 20 against top_k 16: the steps evict and swap rows in from the host pool
FORCED_MISSES = '--hisparse_config={"device_buffer_size": 20}'


@pytest.mark.parametrize(
    "mesh",
    [["--tp_size=4", "--dp_size=2", "--enable_dp_attention"], pytest.param(["--tp_size=2", "--dp_size=2"], marks=pytest.mark.slow)],
    ids=["dp2_x_tp2_dp_attention", "tp2_replicas"],
)
@pytest.mark.parametrize("hisparse", [[FORCED_MISSES], ["--noenable_hisparse"]], ids=["hisparse_misses", "hisparse_off"])
def test_checkpoint_decoding_on_a_mesh_reproduces_the_fixture(tmp_path, mesh, hisparse):
    """Checkpoint decoding on 4 virtual CPU devices (run_decode.py sets
    --xla_force_host_platform_device_count itself): the fixture's golden tokens and logits, as on one device."""
    stderr = decode_fixture(tmp_path, *mesh, *hisparse)
    assert "CpuDevice(id=3)" in stderr  # four devices
    assert (misses_logged(stderr) > 0) == (hisparse == [FORCED_MISSES])


def test_checkpoint_decoding_with_the_tpu_kernels_reproduces_the_fixture(tmp_path):
    """--implementation=tpu: every kernel (plan, copies, attention) the Pallas TPU one, in TPU
    interpret mode on the CPU, with the host pool in device memory there (memory.host_pool_kind);
    HiSparse swapping rows in every step. 4 of the 24 golden steps (~1 s a step interpreted; all
    24 through generate: tests/test_tpu_kernels.py, -m slow)."""
    stderr = decode_fixture(tmp_path, "--implementation=tpu", FORCED_MISSES, steps=4)
    assert misses_logged(stderr) > 0


def test_unknown_flag_is_one_line_and_status_2(tmp_path):
    done = run_decode(f"--output_dir={tmp_path}", "--num_promptz=3")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: Unknown command line flag 'num_promptz'. Did you mean: num_prompts ?"]
    assert done.stdout == ""


def test_without_matplotlib_the_run_says_plots_were_skipped(monkeypatch, tmp_path):
    import sys as _sys

    from serving import cli

    monkeypatch.setitem(_sys.modules, "matplotlib", None)  # import matplotlib now fails
    monkeypatch.delitem(_sys.modules, "serving.plots", raising=False)
    results = {"points": [{"mode": "hisparse", "max_concurrency": 1, "steps": {"misses": [1]}}], "buffer_sweep": []}
    assert cli._plot(results, str(tmp_path), "", "model selection") == {}
    assert results["notes"] == [cli.PLOTS_NEED] and os.listdir(tmp_path) == []


def test_ctrl_c_ends_with_one_line_and_status_130(tmp_path):
    """SIGINT mid-run: `interrupted`, exit status 130, no traceback, and no file half-written
    (results.json and the plots are renamed into place whole; no scratch file is left)."""
    import signal
    import time

    process = subprocess.Popen(
        [sys.executable, SCRIPT, f"--output_dir={tmp_path}", "--num_prompts=64", "--noprogress", "--device_buffer_sweep="],
        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in process.stderr:  # JAX started: the run is under way
            if "jax " in line and " on [" in line:
                break
        time.sleep(4)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in stderr, stderr[-2000:]
    for path in tmp_path.rglob("*"):
        assert ".partial" not in path.name and not path.name.endswith(".tmp"), path
        if path.name == "results.json":
            json.loads(path.read_text())  # a whole file (the points done before the interrupt)
