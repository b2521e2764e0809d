"""PD disaggregation on loopback: a prefill process and a decode process (run_decode.py
--disaggregation_mode=prefill|decode) produce, request for request, the tokens colocated
serving produces; the KV travels by jax.experimental.transfer into the decode host pool."""

import json
import os
import socket
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest

from configs.model import DSAModelConfig
from hisparse_jax.row_layout import KVRowLayout
from models.dsa.runner import ModelRunner
from serving import cli as serving

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each side gets the flags it reads (a PD instance refuses the ones it does not: serving.validation)
COMMON = ["--random_input_len=60", "--random_output_len=8", "--dtype=float32", "--noprogress"]
PREFILL = ["--num_prompts=5"]
DECODE = ["--max_running_requests=4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def colocated_tokens(enable_hisparse: bool, kv_cache_dtype: str = "auto") -> dict:
    args = serving.ServingArgs(num_prompts=5, random_input_len=60, random_output_len=8, max_running_requests=4,
                               dtype="float32", enable_hisparse=enable_hisparse, progress=False, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    prepared = serving._prepare(args)
    engine = serving._engine(ModelRunner(prepared.model, kv_cache_dtype=kv_cache_dtype), args,
                             prepared.hisparse if enable_hisparse else None, prepared.context, prepared.budget)  # fmt: skip
    return {str(i): t.tolist() for i, t in engine.run(prepared.requests).tokens.items()}


def start(*flags):
    return subprocess.Popen(
        [sys.executable, "run_decode.py", *flags], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


# Both under -m slow (CI time, ~65 s each on 2 cores): tests/test_fp8_keys.py hands a PD prefill
# over in-process in the default run, and the waits below run each instance alone.
@pytest.mark.slow
@pytest.mark.parametrize(
    "enable_hisparse, kv_cache_dtype", [(True, "auto"), (False, "auto"), (True, "fp8_e4m3")], ids=["hisparse", "baseline", "hisparse_fp8"]
)
def test_two_process_pd_equals_colocated(tmp_path, enable_hisparse, kv_cache_dtype):
    """The prefill instance starts first and waits for the decode instance (it used to die with a
    ConnectionRefusedError traceback); the decode instance decodes what arrives, fp8 rows as
    shipped, the same tokens as colocated serving."""
    address = f"--disaggregation_address=127.0.0.1:{free_port()}"
    dtype = f"--kv_cache_dtype={kv_cache_dtype}"
    prefill = start("--disaggregation_mode=prefill", address, dtype, *COMMON, *PREFILL)
    decode = None
    try:
        time.sleep(2)  # the prefill instance is up first
        mode = "--enable_hisparse" if enable_hisparse else "--noenable_hisparse"
        decode = start("--disaggregation_mode=decode", address, dtype, mode, f"--output_dir={tmp_path}", *COMMON, *DECODE)
        prefill_out, prefill_err = prefill.communicate(timeout=300)
        decode_out, decode_err = decode.communicate(timeout=300)
    finally:
        for process in (decode, prefill):
            if process is not None and process.poll() is None:
                process.kill()
    assert prefill.returncode == 0, prefill_err[-3000:]
    assert decode.returncode == 0, decode_err[-3000:]
    assert "waiting up to 60 s for the decode instance" in prefill_err and "Traceback" not in prefill_err + decode_err
    assert "listening on 127.0.0.1:" in decode_err
    tiny = DSAModelConfig.tiny()  # fp8: the rows shipped are the stored fp8 rows (656 B at DeepSeek-V3.2's dims)
    row_bytes = KVRowLayout.for_kv_cache_dtype(tiny.kv_lora_rank, tiny.qk_rope_head_dim, jnp.float32, kv_cache_dtype).bytes_per_row
    assert f"KV rows of {row_bytes} B ({'fp8_e4m3' if kv_cache_dtype != 'auto' else 'float32'})" in prefill_out
    with open(tmp_path / "results.json") as f:
        received = json.load(f)
    assert received["run"]["disaggregation_mode"] == "decode"
    assert received["summary"]["first_arrival_wait_s"] >= 0  # the figures start at the first arrival
    assert received["tokens"] == colocated_tokens(enable_hisparse, kv_cache_dtype)
    handover = received["handover"]  # every request's KV pulled once, and timed
    assert handover["requests"] == len(received["tokens"]) and handover["bytes"] > 0 and handover["gb_per_s"] > 0
    assert "KV hand-over:" in decode_err
    if enable_hisparse:
        assert received["summary"]["misses"] > 0


def assert_one_error_line(process, message, timeout=240):
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 2, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in err and len(errors) == 1 and message in errors[0], err[-3000:]
    assert err.strip().splitlines()[-1] == errors[0]
    return err


def test_prefill_instance_alone_waits_then_ends_with_one_line():
    port = free_port()
    prefill = start("--disaggregation_mode=prefill", f"--disaggregation_address=127.0.0.1:{port}", "--disaggregation_timeout_s=1",
                    "--num_prompts=1", "--random_input_len=16", "--random_output_len=2", "--noprogress")  # fmt: skip
    err = assert_one_error_line(prefill, f"--disaggregation_address: no decode instance listening at 127.0.0.1:{port} after 1 s")
    assert "waiting up to 1 s for the decode instance" in err


def test_decode_instance_alone_says_where_it_listens_then_ends_with_one_line(tmp_path):
    port = free_port()
    decode = start("--disaggregation_mode=decode", f"--disaggregation_address=127.0.0.1:{port}", "--disaggregation_timeout_s=1",
                   "--random_input_len=16", "--random_output_len=2", "--max_running_requests=2", "--noprogress",
                   f"--output_dir={tmp_path}")  # fmt: skip
    err = assert_one_error_line(decode, f"no prefill instance connected to 127.0.0.1:{port} within 1 s")
    assert f"listening on 127.0.0.1:{port}" in err and f"--disaggregation_address=127.0.0.1:{port}" in err
    assert os.listdir(tmp_path) == []  # nothing written
