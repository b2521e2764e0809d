"""examples/: the scripts the README points users at run, and show what they claim."""

import importlib.util
import pathlib
import subprocess
import sys

import numpy as np

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_own_model_hisparse_equals_full_kv():
    result = load("own_model").main(["--implementation=reference"])
    hisparse, full = result["hisparse"], result["full"]
    assert hisparse["outputs"].shape == full["outputs"].shape == (6, 2, 3, 4, 32)  # [steps, L, R, H, D]
    assert np.all(np.isfinite(hisparse["outputs"]))
    np.testing.assert_array_equal(hisparse["outputs"], full["outputs"])
    assert result["equal"]
    assert hisparse["misses"].sum() > 0, "the example never swapped a row in"
    assert full["misses"].sum() == 0


def test_own_model_runs_as_a_script_with_pallas_kernels():
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "own_model.py"), "--implementation=pallas"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "outputs equal to the full-KV run" in done.stdout
