"""run_decode.py as users run it: the default command (tiny model, HiSparse vs baseline, plots),
a labelled synthetic-selection run, and bad input ending in one line and exit status 2.
(Checkpoint decoding through run_decode.py: tests/test_models.py.)"""

import json
import os
import subprocess
import sys

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
    assert [p["device_buffer_size"] for p in results["buffer_sweep"]] == [16, 32, 64]
    for name in ("throughput_vs_concurrency", "misses_over_time", "misses_vs_buffer_size", "misses_over_time_by_buffer"):
        assert_png(tmp_path / f"{name}.png")
    assert "hisparse / baseline output throughput" in done.stdout and "Traceback" not in done.stderr


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


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model=gpt2"], "is not a built-in config"),
        (["--max_concurrency=1,x"], "--max_concurrency must be a comma-separated list of integers"),
        (['--hisparse_config={"device_buffer_size": 4}'], "device_buffer_size (4) must be >= top_k (16)"),
        (["--context_length=50"], "> context_length 50"),
        (["--device_buffer_sweep=16,8"], "device_buffer_size (8) must be >= top_k (16)"),
        (["--prompts=p.npz", "--output=o.npz"], "needs --checkpoint=DIR"),
    ],
    ids=["model", "concurrency", "buffer", "context", "sweep", "checkpoint"],
)
def test_bad_input_ends_with_one_line_and_status_2(tmp_path, flags, message):
    done = run_decode(f"--output_dir={tmp_path}", *flags)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]


def test_unknown_flag_is_refused_without_traceback(tmp_path):
    done = run_decode(f"--output_dir={tmp_path}", "--num_promptz=3")
    assert done.returncode != 0 and "Unknown command line flag 'num_promptz'" in done.stderr
    assert "Traceback" not in done.stderr
