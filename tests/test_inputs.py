"""Input validation without running a model: models.common.inputs (what generate and decode_checkpoint
refuse, as ValueError) and serving.validation (run_decode.py's flags, as UsageError
naming the flag). End to end through run_decode.py: tests/test_run_decode.py."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model import DSAModelConfig
from hisparse_jax.config import HiSparseConfig
from serving import validation
from serving.cli import ServingArgs, load_model, make_runner
from serving.errors import UsageError
from hisparse_jax.sharding import ParallelConfig
from models import registry
from models.common import inputs
from models.dsa.model import DSAForCausalLM
from models.dsa.runner import NO_COMMAND_BUFFERS
from models.registry import decode_checkpoint
from models.dsa.generate import generate
from models.common.inputs import InputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT = os.path.join(ROOT, "tests", "fixtures", "deepseek_v32_tiny")
TINY = DSAModelConfig.tiny()  # the fixture's dims: vocab 512, max_position_embeddings 512, index_topk 16
GOOD = np.arange(40, dtype=np.int64).reshape(2, 20)


# ---- prompts and lengths --------------------------------------------------------------------------


def test_good_prompts_come_back_as_int32():
    for prompts in (GOOD, GOOD.astype(np.uint16), GOOD.tolist(), jnp.asarray(GOOD, jnp.int32)):
        out = inputs.check_prompts(prompts, TINY, max_new_tokens=492)  # 20 + 492 = 512: exactly fits
        assert out.dtype == np.int32 and out.shape == (2, 20)
        np.testing.assert_array_equal(out, GOOD)
    edges = np.array([[0, TINY.vocab_size - 1]])
    np.testing.assert_array_equal(inputs.check_prompts(edges, TINY), edges)


@pytest.mark.parametrize(
    "prompts, message",
    [
        (np.array([[1, 512, 3]]), r"token id 512 outside the vocabulary \[0, 512\) \(prompt 0, position 1"),
        (np.array([[1, 2], [3, -1]]), r"token id -1 outside the vocabulary \[0, 512\) \(prompt 1, position 1"),
        (np.array([[1, 2**40]]), r"token id 1099511627776 outside"),  # would wrap when cast to int32
        (GOOD.astype(np.float32), "must hold integer token ids, got dtype float32"),
        (GOOD > 3, "must hold integer token ids, got dtype bool"),
        (GOOD.astype(str), "must hold integer token ids, got dtype <U"),
        (np.array([[1, "a"]], dtype=object), "must hold integer token ids, got dtype object"),
        ([[1, 2], [3]], "must be a rectangular"),
        (GOOD[0], r"must be a \[B, T\] array .* got shape \(20,\)"),
        (GOOD[None], r"got shape \(1, 2, 20\)"),
        (np.zeros((0, 5), np.int32), r"is empty \(shape \(0, 5\)\)"),
        (np.zeros((2, 0), np.int32), r"is empty \(shape \(2, 0\)\)"),
    ],
    ids=["too_large", "negative", "wraps_int32", "float", "bool", "str", "object", "ragged", "1d", "3d", "no_rows", "no_columns"],
)
def test_bad_prompts_are_refused(prompts, message):
    with pytest.raises(InputError, match=message):
        inputs.check_prompts(prompts, TINY)


@pytest.mark.parametrize("max_new_tokens", [0, -3, True, 2.0, None])
def test_max_new_tokens_must_be_a_positive_integer(max_new_tokens):
    with pytest.raises(InputError, match="max_new_tokens must be a positive integer"):
        inputs.check_max_new_tokens(max_new_tokens)


def test_prompt_and_output_must_fit_max_position_embeddings():
    with pytest.raises(InputError, match=r"prompt length 20 \+ max_new_tokens 493 = 513 tokens exceeds the model's max_position_embeddings \(512\)"):
        inputs.check_prompts(GOOD, TINY, max_new_tokens=493)
    with pytest.raises(InputError, match="= 1000020 tokens exceeds"):
        inputs.check_context(20, 1_000_000, TINY)


def test_hisparse_top_k_must_be_the_models():
    registry.check_hisparse(None, TINY)
    registry.check_hisparse(HiSparseConfig(top_k=16, device_buffer_size=32), TINY)
    with pytest.raises(InputError, match=r"top_k \(32\) must equal the model's index_topk \(16\)"):
        registry.check_hisparse(HiSparseConfig(top_k=32, device_buffer_size=64), TINY)


@pytest.mark.parametrize(
    "config, parallel, requests, message",
    [
        (TINY, ParallelConfig(tp_size=3), None, r"4 attention heads do not split over 3 devices \(tp_size=3"),
        (TINY, ParallelConfig(tp_size=4, dp_size=4, enable_dp_attention=True), 6, r"6 requests do not split over 4 data-parallel"),
        (TINY.replace(intermediate_size=130), ParallelConfig(tp_size=4, dp_size=2, enable_dp_attention=True), None,
         r"intermediate_size \(130\) does not split over tp_size=4"),
        (TINY.replace(moe_intermediate_size=30), ParallelConfig(tp_size=4), None, r"moe_intermediate_size \(30\)"),
    ],
    ids=["heads", "requests", "dense", "experts"],
)
def test_parallel_split_must_be_even(config, parallel, requests, message):
    with pytest.raises(InputError, match=message):
        inputs.check_parallel(config, parallel, num_requests=requests)


def test_even_parallel_splits_pass():
    inputs.check_parallel(TINY, None, num_requests=3)
    inputs.check_parallel(TINY, ParallelConfig(), num_requests=3)  # one device: nothing to split
    inputs.check_parallel(TINY, ParallelConfig(tp_size=2, dp_size=2), num_requests=4)
    inputs.check_parallel(TINY, ParallelConfig(tp_size=4, dp_size=2, enable_dp_attention=True), num_requests=2)
    # An all-dense model splits no experts (and an all-MoE one no dense MLP).
    inputs.check_parallel(TINY.replace(moe_intermediate_size=30, mlp_layer_types=("dense",) * 3), ParallelConfig(tp_size=4))


@pytest.fixture(scope="module")
def tiny_model():
    return DSAForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "prompts, max_new_tokens, hisparse, message",
    [
        (np.array([[5, 600]]), 2, None, "token id 600 outside the vocabulary"),  # the gather would clamp it to 511
        (GOOD.astype(np.float64), 2, None, "integer token ids"),
        (np.zeros((0, 4), np.int32), 2, None, "is empty"),
        (GOOD, 1_000_000, None, "exceeds the model's max_position_embeddings"),
        (GOOD, 0, None, "max_new_tokens must be a positive integer"),
        (GOOD, 2, HiSparseConfig(top_k=32, device_buffer_size=64), r"top_k \(32\) must equal"),
    ],
    ids=["vocab", "float", "empty", "too_long", "no_tokens", "top_k"],
)
def test_generate_refuses_bad_input_with_value_error(tiny_model, prompts, max_new_tokens, hisparse, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny_model, prompts, max_new_tokens, hisparse=hisparse)


# ---- checkpoint decoding's files ------------------------------------------------------------------


def write_config(directory, config):
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write(config if isinstance(config, str) else json.dumps(config))
    return str(directory)


def fixture_config() -> dict:
    with open(os.path.join(CHECKPOINT, "config.json")) as f:
        return json.load(f)


def test_load_config(tmp_path):
    config = registry.load_config(CHECKPOINT)
    assert (config.model_type, config.vocab_size, config.num_layers, config.index_topk) == ("deepseek_v32", 512, 3, 16)
    cases = [
        (str(tmp_path / "nowhere"), "checkpoint directory .*nowhere does not exist"),
        (os.path.join(CHECKPOINT, "config.json"), "is a file, not a directory"),
        (str(tmp_path), r"no config.json at .*config.json"),
        (write_config(tmp_path / "json", "{nope"), r"cannot read model config .*config.json: Expecting property name"),
        (write_config(tmp_path / "list", "[1]"), "must hold a JSON object"),
        (write_config(tmp_path / "type", dict(fixture_config(), num_hidden_layers="3")), r"config.json: malformed config \(TypeError"),
        (write_config(tmp_path / "value", dict(fixture_config(), vocab_size=-5)), r"config.json: vocab_size=-5 must be a positive integer"),
        (write_config(tmp_path / "llama", {"model_type": "llama"}), r"config.json: model_type 'llama' is not supported"),
    ]
    for path, message in cases:
        with pytest.raises(InputError, match=message):
            registry.load_config(path)


def test_read_prompts(tmp_path):
    ids = GOOD.astype(np.int32)
    np.savez(tmp_path / "good.npz", input_ids=ids, other=ids)
    np.testing.assert_array_equal(inputs.read_prompts(tmp_path / "good.npz"), ids)
    np.save(tmp_path / "p.npy", ids)
    shutil.copy(tmp_path / "p.npy", tmp_path / "npy_inside.npz")
    (tmp_path / "text.npz").write_text("hello")
    (tmp_path / "empty.npz").write_bytes(b"")
    np.savez(tmp_path / "nokey.npz", tokens=ids)
    np.savez(tmp_path / "object.npz", input_ids=np.array([[1, "a"]], dtype=object))
    os.mkdir(tmp_path / "dir.npz")
    cases = [
        ("missing.npz", "no file"),
        ("dir.npz", "is a directory"),
        ("p.npy", r"p.npy is not an .npz file"),
        ("npy_inside.npz", "holds a single .npy array"),
        ("text.npz", "is not an .npz archive"),
        ("empty.npz", "is not an .npz archive"),
        ("nokey.npz", r"has no input_ids array \(found \['tokens'\]\)"),
        ("object.npz", "input_ids is an object array"),
    ]
    for name, message in cases:
        with pytest.raises(InputError, match=message):
            inputs.read_prompts(tmp_path / name)


def test_output_path(tmp_path):
    assert inputs.check_output_path(str(tmp_path / "out.npz")) == str(tmp_path / "out.npz")
    for path, message in [
        (tmp_path / "out", "must end in .npz"),  # np.savez would write out.npz, not out
        (tmp_path / "out.npy", "must end in .npz"),
        (tmp_path / "missing" / "out.npz", "directory .*missing does not exist"),
    ]:
        with pytest.raises(InputError, match=message):
            inputs.check_output_path(path)
    os.mkdir(tmp_path / "d.npz")
    with pytest.raises(InputError, match="is a directory"):
        inputs.check_output_path(tmp_path / "d.npz")


def test_decode_checkpoint_refuses_before_loading_weights(tmp_path, monkeypatch):
    import models.dsa.loading

    def no_loading(*args, **kwargs):
        raise AssertionError("weights loaded despite bad input")

    monkeypatch.setattr(models.dsa.loading, "load_hf_checkpoint", no_loading)
    np.savez(tmp_path / "p.npz", input_ids=np.array([[3, 512]], np.int32))
    np.savez(tmp_path / "ok.npz", input_ids=GOOD)
    for prompts, output, kwargs, message in [
        ("p.npz", "o.npz", {}, "token id 512 outside the vocabulary"),
        ("ok.npz", "o.npz", dict(max_new_tokens=1_000_000), "max_position_embeddings"),
        ("ok.npz", "o", {}, "must end in .npz"),
        ("ok.npz", "o.npz", dict(hisparse=HiSparseConfig(top_k=8, device_buffer_size=8)), r"top_k \(8\) must equal"),
    ]:
        with pytest.raises(ValueError, match=message):
            decode_checkpoint(CHECKPOINT, tmp_path / prompts, str(tmp_path / output), **{"max_new_tokens": 4, **kwargs})
    assert sorted(os.listdir(tmp_path)) == ["ok.npz", "p.npz"]  # nothing written


# ---- run_decode.py's flags (serving.validation) --------------------------------------


def run_decode_flags() -> set[str]:
    with open(os.path.join(ROOT, "serving", "run_decode.py")) as f:
        return set(re.findall(r'flags\.DEFINE_\w+\(\s*"(\w+)"', f.read()))


def test_every_run_decode_flag_belongs_to_a_mode():
    names = run_decode_flags()
    assert len(names) > 20
    serving = {f.name for f in ServingArgs.__dataclass_fields__.values()}
    assert names == serving | validation.CHECKPOINT_DECODING_FLAGS
    assert validation.CHECKPOINT_DECODING_ONLY == validation.CHECKPOINT_DECODING_FLAGS - serving


def flag_values(**changes) -> dict:
    values = {f.name: f.default for f in ServingArgs.__dataclass_fields__.values()}
    values.update(prompts=None, output=None, max_new_tokens=16, hisparse_config='{"host_to_device_ratio": 8}')
    values.update(changes)
    return values


@pytest.mark.parametrize(
    "mode, changes, message",
    [
        (validation.CHECKPOINT_DECODING, dict(context_length=64), r"--context_length is not used by checkpoint decoding"),
        (validation.CHECKPOINT_DECODING, dict(context_length=64, seed=3), r"--context_length, --seed are not used by checkpoint decoding"),
        (validation.CHECKPOINT_DECODING, dict(context_length=0), r"--context_length must be an integer >= 2, got 0"),
        (validation.CHECKPOINT_DECODING, dict(num_prompts=-1), r"--num_prompts must be a positive integer"),
        (validation.SERVING, dict(max_new_tokens=8), r"--max_new_tokens is not used by serving"),
        (validation.SERVING, dict(max_new_tokens=0), r"--max_new_tokens must be a positive integer"),
        (validation.SERVING, dict(checkpoint="ckpt", model="tiny"), "--model is not used with --checkpoint"),
        (validation.SERVING, dict(disaggregation_address="h:1"), "--disaggregation_address is not used without"),
        (validation.SERVING, dict(seed=-1), "--seed must be a non-negative integer"),
        (validation.SERVING, dict(kv_budget_gb=float("inf")), "--kv_budget_gb must be a positive number"),
        (validation.SERVING, dict(max_concurrency="1,x"), "--max_concurrency must be a comma-separated list"),
        (validation.SERVING, dict(hisparse_config="{nope"), "--hisparse_config is not valid JSON"),
    ],
    ids=["unused", "unused_two", "bad_value_unused", "bad_value_unused_2", "checkpoint_only", "checkpoint_only_bad",
         "model_and_checkpoint", "address", "seed", "budget", "concurrency", "hisparse_json"],  # fmt: skip
)
def test_flags_a_mode_does_not_read_or_bad_values_are_refused(mode, changes, message):
    with pytest.raises(UsageError, match=message):
        validation.check_flags(mode, flag_values(**changes), present=set(changes))


def test_flags_the_mode_reads_pass():
    changes = dict(checkpoint="ckpt", prompts="p.npz", output="o.npz", max_new_tokens=4, dtype="float32",
                   enable_hisparse=True, hisparse_config="{}")  # fmt: skip
    validation.check_flags(validation.CHECKPOINT_DECODING, flag_values(**changes), present=set(changes))
    changes = dict(context_length=64, tp_size=2, disaggregation_mode="decode", disaggregation_address="h:1", seed=0)
    validation.check_flags(validation.SERVING, flag_values(**changes), present=set(changes))
    changes = dict(prompts="p.npz", enable_hisparse=False, hisparse_config="{}")
    with pytest.raises(UsageError, match="--hisparse_config is not used with --noenable_hisparse"):
        validation.check_flags(validation.CHECKPOINT_DECODING, flag_values(**changes), present=set(changes))


def test_serving_args_check_the_prefetch_environment(monkeypatch):
    monkeypatch.setenv("HISPARSE_SHARED_PREFETCH", "bogus")
    with pytest.raises(UsageError, match=r"shared prefetch mode must be one of .*got 'bogus'"):
        ServingArgs()
    monkeypatch.setenv("HISPARSE_SHARED_PREFETCH", "ffi_stream")
    monkeypatch.setenv("HISPARSE_PREFETCH_START", "sideways")
    with pytest.raises(UsageError, match=r"HISPARSE_PREFETCH_START must be one of"):
        ServingArgs()
    monkeypatch.setenv("HISPARSE_PREFETCH_START", "mlp")
    ServingArgs()  # valid values: no UsageError


def test_serving_args_use_the_same_value_rules():
    with pytest.raises(UsageError, match="--seed must be a non-negative integer"):
        ServingArgs(seed=-1)
    with pytest.raises(UsageError, match="--context_length must be an integer >= 2"):
        ServingArgs(context_length=1)
    with pytest.raises(UsageError, match="--max_concurrency entries must be positive integers"):
        ServingArgs(max_concurrency=(0,))


def test_the_overlap_schedule_switch_is_a_serving_flag():
    # SGLang's --disable-overlap-schedule: a boolean serving reads, checkpoint decoding refuses.
    assert ServingArgs(disable_overlap_schedule=True).disable_overlap_schedule
    with pytest.raises(UsageError, match="--disable_overlap_schedule must be true or false, got 'no'"):
        ServingArgs(disable_overlap_schedule="no")
    changes = dict(disable_overlap_schedule=True)
    validation.check_flags(validation.SERVING, flag_values(**changes), present=set(changes))
    with pytest.raises(UsageError, match="--disable_overlap_schedule is not used by checkpoint decoding"):
        validation.check_flags(validation.CHECKPOINT_DECODING, flag_values(**changes), present=set(changes))


def test_the_cuda_graph_switches_are_serving_flags_that_reach_the_decode_compile():
    # SGLang's --disable-cuda-graph (the decode step compiles without XLA command buffers) and
    # --cuda-graph-max-bs (buckets above it do): serving reads them, checkpoint decoding refuses.
    with pytest.raises(UsageError, match="--disable_cuda_graph must be true or false, got 'no'"):
        ServingArgs(disable_cuda_graph="no")
    model = DSAForCausalLM(DSAModelConfig.tiny(), dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert make_runner(model, ServingArgs(disable_cuda_graph=True)).dense_graphs.compiler_options == NO_COMMAND_BUFFERS
    assert make_runner(model, ServingArgs()).dense_graphs.compiler_options == {}
    assert make_runner(model, ServingArgs(cuda_graph_max_bs=4)).dense_graphs.cuda_graph_max_bs == 4
    with pytest.raises(UsageError, match="--cuda_graph_max_bs must be a positive integer, got 0"):
        ServingArgs(cuda_graph_max_bs=0)
    v4_args = ServingArgs(model="deepseek_v4_tiny", dtype="float32", cuda_graph_max_bs=4)  # its family's runner
    with pytest.raises(UsageError, match="--cuda_graph_max_bs is not supported for deepseek_v4_tiny yet"):
        make_runner(load_model(v4_args)[0], v4_args)
    changes = dict(disable_cuda_graph=True, cuda_graph_max_bs=4)
    validation.check_flags(validation.SERVING, flag_values(**changes), present=set(changes))
    with pytest.raises(UsageError, match="--cuda_graph_max_bs, --disable_cuda_graph are not used by checkpoint decoding"):
        validation.check_flags(validation.CHECKPOINT_DECODING, flag_values(**changes), present=set(changes))


def checkpoint_decode(tmp_path, prompts=GOOD, **changes):
    np.savez(tmp_path / "p.npz", input_ids=prompts)
    kwargs = dict(max_new_tokens=4, dtype="float32", enable_hisparse=True, hisparse_config="")
    kwargs.update(changes)
    output = kwargs.pop("output", str(tmp_path / "o.npz"))
    return validation.check_checkpoint_decode(kwargs.pop("checkpoint", CHECKPOINT), str(tmp_path / "p.npz"), output, **kwargs)


def test_checkpoint_decode_inputs(tmp_path):
    job = checkpoint_decode(tmp_path)
    assert job.prompts_shape == (2, 20) and job.hisparse.top_k == 16 and job.config.vocab_size == 512
    assert checkpoint_decode(tmp_path, enable_hisparse=False).hisparse is None
    cases = [
        (dict(prompts=np.array([[1, 512]])), r"^--prompts: .*p.npz input_ids holds token id 512 outside the vocabulary"),
        (dict(max_new_tokens=1_000_000), r"^--max_new_tokens: prompt length 20 \+ max_new_tokens 1000000"),
        (dict(max_new_tokens=0), r"^--max_new_tokens must be a positive integer"),
        (dict(output=str(tmp_path / "o")), r"^--output: .*o must end in .npz"),
        (dict(checkpoint=os.path.join(CHECKPOINT, "config.json")), r"^--checkpoint: .*is a file, not a directory"),
        (dict(hisparse_config='{"top_k": 32}'), r"^--hisparse_config: HiSparse top_k \(32\) must equal the model's index_topk \(16\)"),
        (dict(hisparse_config='{"device_buffer_size": 4}'), r"^--hisparse_config: .*device_buffer_size \(4\) must be >= top_k \(16\)"),
        (dict(dtype="float16"), r"^--dtype='float16': use one of"),
    ]
    for changes, message in cases:
        with pytest.raises(UsageError, match=message):
            checkpoint_decode(tmp_path, **changes)


def test_validation_refuses_before_jax_starts():
    """run_decode.py checks its flags and checkpoint decoding's files with validation alone: that
    must not import JAX (seconds, and --tp_size's XLA_FLAGS must be set before it starts)."""
    code = "import sys, serving.validation; print(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


# ---- defaults the user never set, and refusals before JAX starts (issue 25) -----------------------


def test_noenable_hisparse_alone_is_accepted_and_sweeps_nothing():
    # --device_buffer_sweep's default depends on HiSparse: none without it, top_k x (1, 2, 4) with it.
    from serving import cli

    values = flag_values(enable_hisparse=False, device_buffer_sweep=None)
    validation.check_flags(validation.SERVING, values, present={"enable_hisparse"})
    args = ServingArgs(enable_hisparse=False, device_buffer_sweep=None)
    assert cli.buffer_sweep(args, HiSparseConfig(top_k=16, device_buffer_size=32)) == ()
    assert cli.buffer_sweep(ServingArgs(device_buffer_sweep=None), HiSparseConfig(top_k=16, device_buffer_size=32)) == (16, 32, 64)
    assert cli.buffer_sweep(ServingArgs(device_buffer_sweep=(20,)), HiSparseConfig(top_k=16, device_buffer_size=32)) == (20,)
    changes = dict(enable_hisparse=False, device_buffer_sweep="16,32")  # set by the user: refused
    with pytest.raises(UsageError, match="--device_buffer_sweep needs --enable_hisparse"):
        validation.check_flags(validation.SERVING, flag_values(**changes), present=set(changes))


@pytest.mark.parametrize(
    "text",
    ['{"top_k": 16}', '{"dynamic_residency": {"mode": "adaptive"}}', '{"dynamic_residency": true, "dynamic_residency_mode": "adaptive"}', ""],
    ids=["top_k", "nested_residency", "sglang_flat_residency", "empty"],
)
def test_hisparse_config_keys_left_out_keep_the_cli_defaults(text):
    # Any JSON used to fall back to the library's host_to_device_ratio 2 (HiSparse capacity 2 vs
    # the baseline's 3 in the README's dynamic-residency example); now keys left out keep run_decode's 8.
    config = validation.resolve_hisparse_config(text, TINY)
    assert (config.top_k, config.device_buffer_size, config.host_to_device_ratio) == (16, 32, 8)
    assert validation.resolve_hisparse_config('{"host_to_device_ratio": 3}', TINY).host_to_device_ratio == 3


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(prefill_token_budget=0), r"^--prefill_token_budget must be a positive integer, got 0"),
        (dict(model="deepseek_v4_tiny", hisparse_config='{"dynamic_residency": {"mode": "adaptive"}}'),
         r"^--hisparse_config: dynamic_residency is not supported by DeepSeek-V4 serving yet"),
        (dict(model="minimax_m3_tiny", hisparse_config='{"dynamic_residency": true}'),
         r"^--hisparse_config: dynamic_residency is not supported by MiniMax-M3 serving yet"),
        (dict(tp_size=2, hisparse_config='{"dynamic_residency": {"mode": "adaptive"}}'),
         r"^--hisparse_config: dynamic_residency runs on one device only yet; drop --tp_size"),
        (dict(hisparse_config='{"dynamic_residency_mode": "adaptive"}'), r'^--hisparse_config: dynamic_residency_mode needs "dynamic_residency": true'),
    ],
    ids=["prefill_budget", "v4_residency", "m3_residency", "tp_residency", "flat_without_switch"],
)
def test_serving_refusals_before_jax_name_the_flag(changes, message):
    with pytest.raises(UsageError, match=message):
        validation.check_flags(validation.SERVING, flag_values(**changes), present=set(changes))
    values = {k: v for k, v in changes.items()}
    with pytest.raises(UsageError, match=message.lstrip("^")):  # ServingArgs / _prepare apply the same rules
        from serving import cli

        cli._prepare(ServingArgs(**values))


# ---- weights + KV against the device's memory, before anything is built (serving.fit) -----------


def test_full_size_model_is_refused_with_its_sizes(monkeypatch):
    from serving import fit

    v32 = DSAModelConfig.deepseek_v32()
    assert 1.3e12 < fit.param_bytes(v32, jnp.bfloat16) < 1.4e12  # 685 B params (with the MTP layer), from shapes only
    monkeypatch.setattr(fit, "device_memory", lambda device=None: (24 * 10**9, False))  # a 24 GB accelerator
    with pytest.raises(UsageError, match=r"^--model=deepseek_v32 needs ~1.4 TB of weights in bfloat16 \+ 2 GB of KV; this device has 24 GB available$"):
        fit.check_fits("--model=deepseek_v32", v32, jnp.bfloat16, kv_device_bytes=2 * 10**9)
    eight = ParallelConfig(tp_size=8)  # split over 8 devices: 171 GB each, still too much
    with pytest.raises(UsageError, match=r"needs ~171 GB of weights in bfloat16 \(1\.4 TB split over 8 devices\) \+ 0 B of KV; each device has 24 GB"):
        fit.check_fits("--model=deepseek_v32", v32, jnp.bfloat16, kv_device_bytes=0, parallel=eight)
    fit.check_fits("--model=tiny", TINY, jnp.bfloat16, kv_device_bytes=10**6)  # fits
    monkeypatch.setattr(fit, "device_memory", lambda device=None: (10**9, True))  # the CPU: the host pool counts too
    with pytest.raises(UsageError, match=r"\+ 1\.2 GB of KV; this machine has 1 GB available$"):
        fit.check_fits("--model=tiny", TINY, jnp.bfloat16, kv_device_bytes=2 * 10**8, kv_host_bytes=10**9)


def test_serving_checks_the_fit_before_building_the_model(monkeypatch):
    from serving import cli, fit

    def no_building(*args, **kwargs):
        raise AssertionError("model built despite not fitting")

    monkeypatch.setattr(cli, "load_model", no_building)
    monkeypatch.setattr(fit, "device_memory", lambda device=None: (24 * 10**9, False))
    with pytest.raises(UsageError, match=r"^--model=deepseek_v32 needs ~1.4 TB of weights"):
        cli._prepare(ServingArgs(model="deepseek_v32", device_buffer_sweep=None))
