"""PD disaggregation on loopback: a prefill process and a decode process (run_decode.py
--disaggregation_mode=prefill|decode) produce, request for request, the tokens colocated
serving produces; the KV travels by jax.experimental.transfer into the decode host pool."""

import json
import os
import socket
import subprocess
import sys

import pytest

from serving import cli as serving
from models.dsa.runner import ModelRunner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = ["--num_prompts=5", "--random_input_len=60", "--random_output_len=8", "--max_running_requests=4",
            "--dtype=float32", "--noprogress", "--device_buffer_sweep="]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def colocated_tokens(enable_hisparse: bool) -> dict:
    args = serving.ServingArgs(num_prompts=5, random_input_len=60, random_output_len=8, max_running_requests=4,
                               dtype="float32", enable_hisparse=enable_hisparse, progress=False)  # fmt: skip
    prepared = serving._prepare(args)
    engine = serving._engine(ModelRunner(prepared.model), args, prepared.hisparse if enable_hisparse else None,
                             prepared.context, prepared.budget)  # fmt: skip
    return {str(i): t.tolist() for i, t in engine.run(prepared.requests).tokens.items()}


# Both under -m slow (CI time, ~65 s each on 2 cores): tests/test_fp8_keys.py hands a PD prefill
# over in-process in the default run.
@pytest.mark.slow
@pytest.mark.parametrize("enable_hisparse", [True, False], ids=["hisparse", "baseline"])
def test_two_process_pd_equals_colocated(tmp_path, enable_hisparse):
    address = f"127.0.0.1:{free_port()}"
    mode_flag = "--enable_hisparse" if enable_hisparse else "--noenable_hisparse"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = lambda *flags: subprocess.Popen(  # noqa: E731
        [sys.executable, "run_decode.py", f"--disaggregation_address={address}", mode_flag, *WORKLOAD, *flags],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    decode = run("--disaggregation_mode=decode", f"--output_dir={tmp_path}")
    prefill = None
    try:
        # The decode instance listens first; the prefill instance retries until it is up.
        for _ in range(60):
            prefill = run("--disaggregation_mode=prefill")
            out, _ = prefill.communicate(timeout=240)
            if prefill.returncode == 0 or "Connection refused" not in out:
                break
        assert prefill.returncode == 0, out
        decode_out, _ = decode.communicate(timeout=240)
        assert decode.returncode == 0, decode_out
    finally:
        for process in (decode, prefill):
            if process is not None and process.poll() is None:
                process.kill()
    with open(tmp_path / "results.json") as f:
        received = json.load(f)
    assert received["run"]["disaggregation_mode"] == "decode"
    assert received["tokens"] == colocated_tokens(enable_hisparse)
    if enable_hisparse:
        assert received["summary"]["misses"] > 0
