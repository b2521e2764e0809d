"""run_decode.py's checkpoint decoding of the DeepSeek-V4 and MiniMax-M3 fixtures, as users run it:

    python run_decode.py --checkpoint=DIR --prompts=DIR/golden.npz --output=OUT.npz --max_new_tokens=32
        --dtype=float32 [--enable_hisparse --hisparse_config=...|--noenable_hisparse]

reproduces the fixture's greedy tokens exactly and its logits within 1e-4 of the largest |logit|,
HiSparse on (device buffers small enough that decoding misses) and off. config.json's model_type
picks the family (models.families); bad input ends in one `error:` line and exit status 2 before
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


# HiSparse off is what the library tests check against the fixtures too; its run_decode pass is slow-only.
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
    ]  # fmt: skip
    for flags, message in cases:
        assert_refused(run_decode(*flags), message)
    assert sorted(os.listdir(tmp_path)) == ["big.npz", "ok.npz"]  # nothing written
