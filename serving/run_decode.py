"""Serve a random workload with HiSparse (and the full-KV baseline), or decode a checkpoint.

    python run_decode.py                    # tiny random-weight model, HiSparse vs baseline, CPU ok
    python run_decode.py --max_concurrency=1,4,8 --device_buffer_sweep=16,32,64 --output_dir=outputs
    python run_decode.py --synthetic_topk_overlap=0.9        # SYNTHETIC selection, labelled as such
    python run_decode.py --checkpoint=DIR --prompts=prompts.npz --output=out.npz --max_new_tokens=32

Checkpoint decoding takes DSA (deepseek_v32, glm_moe_dsa), DeepSeek-V4 (deepseek_v4) and MiniMax-M3
(minimax_m3_vl_text, minimax_m3_vl) checkpoints, by config.json's model_type (models.registry);
serving runs DSA models (built-in or checkpoints) and the random-weight deepseek_v4_tiny /
minimax_m3_tiny through the same engine (their families' runners; docs/models.md).

Flags follow SGLang (server: --enable-hisparse, --hisparse-config, --context-length,
--max-running-requests, --dtype, --kv-cache-dtype; bench_serving: --num-prompts, --random-input-len,
--random-output-len, --random-range-ratio, --max-concurrency, --seed) with underscores.
Serving writes results.json and PNG plots to --output_dir and prints a summary; checkpoint
decoding (--prompts/--output) writes `tokens` int32 [B, N] and `logits` float32 [B, N, vocab].
Bad input (an unknown flag, a bad value, a flag the mode does not read, prompts the model cannot
take, unusable files) ends with one `error: ...` line on stderr and exit status 2, before JAX
starts and before anything is written (serving.validation holds the checks). Ctrl-C ends with
one `interrupted` line and exit status 130; every file is written whole or not at all.
Intentionally thin: flags -> library. The top-level run_decode.py and the `hisparse-decode`
console command run this module's run().
"""

import logging
import os
import sys

from absl import app, flags

from serving import interrupts, speculation, validation
from serving.errors import UsageError

_MODEL = flags.DEFINE_string(
    "model", "tiny",
    "Built-in model config (random weights): tiny, tiny_glm, deepseek_v32, glm_5_1, glm_5_2 (DSA),"
    " deepseek_v32_bench (DeepSeek-V3.2's attention, 4 layers x 16 experts: one GPU), deepseek_v4_tiny, minimax_m3_tiny.",
)  # fmt: skip
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Hugging Face checkpoint directory (config.json + *.safetensors), instead of --model.")
_PROMPTS = flags.DEFINE_string("prompts", None, "Checkpoint decoding: .npz with input_ids int32 [B, T].")
_OUTPUT = flags.DEFINE_string("output", None, "Checkpoint decoding: .npz to write tokens and logits to.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 16, "Checkpoint decoding: tokens to generate per prompt.")
_ENABLE_HISPARSE = flags.DEFINE_bool("enable_hisparse", True, "KV in pinned host memory, a hot buffer per request on the device (--noenable_hisparse: baseline only).")
_HISPARSE_CONFIG = flags.DEFINE_string(
    "hisparse_config", "",
    "HiSparse settings as JSON, as SGLang's --hisparse-config (its flat dynamic_residency_* keys too); keys left out:"
    " top_k the model's index_topk, device_buffer_size 2 x top_k, host_to_device_ratio 8 (SGLang's colocated"
    " setting), swap_in_block_size 960.",
)  # fmt: skip
_CONTEXT_LENGTH = flags.DEFINE_integer("context_length", None, "Most tokens (prompt + output) per request; default: the workload's longest.")
_MAX_RUNNING_REQUESTS = flags.DEFINE_integer("max_running_requests", 8, "Request slots: the static decode batch.")
_KV_BUDGET_GB = flags.DEFINE_float(
    "kv_budget_gb", None,
    "Device memory for KV (rows + indexer keys), the same for HiSparse and the baseline. Default: what"
    " --max_running_requests HiSparse requests of --context_length need.",
)  # fmt: skip
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Param and KV dtype: bfloat16 or float32.")
_WEIGHTS_DTYPE = flags.DEFINE_string(
    "weights_dtype", "auto",
    "Checkpoint decoding (DSA models): auto keeps an FP8 checkpoint's linear layers and experts block-FP8 on the device,"
    " fp8_e4m3 makes them so whatever the checkpoint holds (128 x 128 blocks), --dtype's name dequantises at load.",
)  # fmt: skip
_FP8_ACTIVATIONS = flags.DEFINE_bool(
    "fp8_activations", False,
    "Checkpoint decoding with block-FP8 weights: quantise the activations to e4m3 per 128-block before each fp8 matmul"
    " (w8a8: the checkpoints' activation_scheme 'dynamic', as DeepSeek's inference code and SGLang run them). Default:"
    " the numbers of the weights dequantised at load, the reference implementation's.",
)  # fmt: skip
_KV_CACHE_DTYPE = flags.DEFINE_string(
    "kv_cache_dtype", "auto",
    "As SGLang's --kv-cache-dtype: auto (= --dtype), bfloat16, or fp8_e4m3 (fp8 KV rows and fp8 indexer keys with a"
    " float32 scale per key).",
)  # fmt: skip
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 16, "Requests in the random workload.")
_RANDOM_INPUT_LEN = flags.DEFINE_integer("random_input_len", 224, "Longest prompt.")
_RANDOM_OUTPUT_LEN = flags.DEFINE_integer("random_output_len", 32, "Longest output.")
_RANDOM_RANGE_RATIO = flags.DEFINE_float("random_range_ratio", 0.5, "Lengths are uniform in [ratio x len, len].")
_MAX_CONCURRENCY = flags.DEFINE_string("max_concurrency", "1,4,8", "Requests in flight at most; a comma list sweeps it.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload, random weights and synthetic selection seed.")
_COMPARE_BASELINE = flags.DEFINE_bool("compare_baseline", True, "Also run the full-KV baseline on the same workload and budget.")
_DEVICE_BUFFER_SWEEP = flags.DEFINE_string(
    "device_buffer_sweep", None,
    "HiSparse device_buffer_size values to sweep at the highest concurrency ('': none). Default: 1, 2 and 4 x top_k"
    " with HiSparse (16,32,64 on the tiny models), none with --noenable_hisparse.",
)  # fmt: skip
_SYNTHETIC_TOPK_OVERLAP = flags.DEFINE_float(
    "synthetic_topk_overlap", None,
    "SYNTHETIC decode selection: consecutive top-k sets share this fraction (miss-rate study; outputs labelled synthetic).",
)  # fmt: skip
_EOS_TOKEN_ID = flags.DEFINE_integer("eos_token_id", None, "Stop a request at this token (default: run to its output length).")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per host page.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "outputs", "Where results.json and the plots go.")
_IMPLEMENTATION = flags.DEFINE_string(
    "implementation", None,
    "Kernels: reference, pallas or tpu (the Pallas TPU kernels; TPU interpret mode off a TPU, docs/tpu.md). Default:"
    " pallas on GPU, tpu on TPU, reference elsewhere.",
)  # fmt: skip
_PROGRESS = flags.DEFINE_bool("progress", True, "Progress bars on prefill and decode.")
_BATCH_BUCKETS = flags.DEFINE_bool(
    "batch_buckets", False,
    "Decode each step on the smallest compiled batch (1, 2, 4, ... slots) holding the running requests: faster at low"
    " load; bf16 rounding then depends on the batch size, so HiSparse and baseline tokens may differ (off: exact).",
)
_PREFILL_TOKEN_BUDGET = flags.DEFINE_integer(
    "prefill_token_budget", None, "Prefill work per decode step in prompt tokens x layers (None: each prompt whole)."
)
_DISABLE_OVERLAP_SCHEDULE = flags.DEFINE_bool(
    "disable_overlap_schedule", False,
    "As SGLang's: read each decode step's tokens before dispatching the next. Default: the overlap schedule (step t + 1"
    " dispatched before step t's tokens are read, so the device never waits for the host's loop); tokens are the same.",
)  # fmt: skip
_DISABLE_CUDA_GRAPH = flags.DEFINE_bool(
    "disable_cuda_graph", False,
    "As SGLang's: compile the decode step without XLA command buffers (CUDA graphs); every kernel is launched by the host."
    " On DeepSeek-V3.2's 61-layer rank at 61,440 tokens this made HiSparse's step faster at 1 and 37 requests and the"
    " full-KV step slower (docs/PERFORMANCE.md, 2026-12-04 eleventh session); small models run better with them.",
)  # fmt: skip
_CUDA_GRAPH_MAX_BS = flags.DEFINE_integer(
    "cuda_graph_max_bs", None,
    "As SGLang's: decode batches (buckets) of more requests compile without command buffers, smaller ones with them"
    " (default: every batch with them). DeepSeek-V3.2's rank at 131,072 tokens ran its 1-request HiSparse step faster"
    " with graphs and its 20-request step without (docs/PERFORMANCE.md, eleventh session).",
)  # fmt: skip
_TP_SIZE = flags.DEFINE_integer("tp_size", 1, "Tensor parallelism: devices the dense and MoE weights are split over.")
_DP_SIZE = flags.DEFINE_integer("dp_size", 1, "Data-parallel groups: each owns its requests, buffers and host pool block.")
_ENABLE_DP_ATTENTION = flags.DEFINE_bool(
    "enable_dp_attention", False,
    "SGLang's meaning: attention data-parallel over --dp_size groups within the --tp_size devices"
    " (otherwise --dp_size replicas of a --tp_size model).",
)  # fmt: skip
_DISAGGREGATION_MODE = flags.DEFINE_enum(
    "disaggregation_mode", "null", ["null", "prefill", "decode"],
    "PD disaggregation: prefill sends each request's KV to the decode instance at --disaggregation_address;"
    " decode admits requests as their KV arrives. Either may start first (--disaggregation_timeout_s). null: colocated.",
)  # fmt: skip
_DISAGGREGATION_ADDRESS = flags.DEFINE_string("disaggregation_address", "127.0.0.1:5757", "The decode instance's host:port.")
_DISAGGREGATION_TIMEOUT_S = flags.DEFINE_float(
    "disaggregation_timeout_s", 60.0,
    "PD: how long the prefill instance retries its connection to the decode instance, and the decode instance waits"
    " for the prefill instance to connect, before one error line.",
)  # fmt: skip
# Speculative decoding with the model's MTP layer (SGLang's flags; serving.speculation).
_SPECULATIVE_ALGORITHM = flags.DEFINE_string("speculative_algorithm", None, "EAGLE: draft with the model's MTP layer, verify in one step.")
_SPECULATIVE_NUM_STEPS = flags.DEFINE_integer("speculative_num_steps", None, "Draft steps per verification (default 3).")
_SPECULATIVE_EAGLE_TOPK = flags.DEFINE_integer("speculative_eagle_topk", None, "Draft branches per step: 1 only (a chain).")
_SPECULATIVE_NUM_DRAFT_TOKENS = flags.DEFINE_integer(
    "speculative_num_draft_tokens", None, "Tokens verified per step: speculative_num_steps + 1 (the default)."
)


def _use_host_devices(count: int) -> None:
    """Lets a CPU-only machine run a --tp_size/--dp_size mesh on `count` host devices. Must run
    before JAX starts its backends; the flag only affects the CPU platform."""
    if count > 1:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()


def _refuse(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
    """app.run's flags parser: a flag error (unknown flag, bad literal, missing value) or a stray
    argument is one `error:` line and exit status 2, as every other bad input."""
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as error:
        _refuse(" ".join(str(error).split()))
    if len(rest) > 1:
        _refuse(f"unexpected arguments {rest[1:]} (flags are --name=value)")
    return rest


def _flag_values() -> tuple[dict, set]:
    """(value of every run_decode.py flag, names of those set on the command line)."""
    own = flags.FLAGS.get_flags_for_module(sys.modules[__name__])
    return {f.name: f.value for f in own}, {f.name for f in own if f.present}


def main(argv):
    del argv  # parse_flags refused positional arguments
    interrupts.install()
    try:
        values, present = _flag_values()
        checkpoint_decoding = _PROMPTS.value is not None or _OUTPUT.value is not None
        mode = validation.CHECKPOINT_DECODING if checkpoint_decoding else validation.SERVING
        validation.check_flags(mode, values, present)
        speculative = speculation.speculative_config(values)
        if checkpoint_decoding:
            job = validation.check_checkpoint_decode(
                _CHECKPOINT.value, _PROMPTS.value, _OUTPUT.value, max_new_tokens=_MAX_NEW_TOKENS.value,
                dtype=_DTYPE.value, enable_hisparse=_ENABLE_HISPARSE.value, hisparse_config=_HISPARSE_CONFIG.value,
                kv_cache_dtype=_KV_CACHE_DTYPE.value, tp_size=_TP_SIZE.value, dp_size=_DP_SIZE.value,
                enable_dp_attention=_ENABLE_DP_ATTENTION.value, implementation=_IMPLEMENTATION.value,
                speculative=speculative, weights_dtype=_WEIGHTS_DTYPE.value, fp8_activations=_FP8_ACTIVATIONS.value,
            )  # fmt: skip
            _use_host_devices(job.num_devices)
        else:
            speculation.check_serving(speculative, values)
            if _CHECKPOINT.value is not None:  # its config.json: a model serving runs (DSA), before JAX starts
                validation.checkpoint_config(_CHECKPOINT.value)
            devices = _TP_SIZE.value if _ENABLE_DP_ATTENTION.value else _TP_SIZE.value * _DP_SIZE.value
            _use_host_devices(devices)
        # Inputs checked: now start JAX (after _use_host_devices, which it reads on start).
        from hisparse_jax import memory

        memory.add_host_pool_xla_flags()
        import jax

        from serving import cli
        from serving.telemetry import format_summary

        logging.info("jax %s on %s", jax.__version__, jax.devices())
        if checkpoint_decoding:
            cli.run_checkpoint_decode(job)
            print(f"wrote {job.output}")
            return
        concurrency = validation.parse_int_list("--max_concurrency", _MAX_CONCURRENCY.value)
        if _DISAGGREGATION_MODE.value != "null" and "max_concurrency" not in present:
            concurrency = ()  # its default sweep is colocated serving's; a decode instance takes what arrives
        args = cli.ServingArgs(
            model=_MODEL.value, checkpoint=_CHECKPOINT.value, enable_hisparse=_ENABLE_HISPARSE.value,
            hisparse_config=_HISPARSE_CONFIG.value, context_length=_CONTEXT_LENGTH.value,
            max_running_requests=_MAX_RUNNING_REQUESTS.value, kv_budget_gb=_KV_BUDGET_GB.value, dtype=_DTYPE.value,
            kv_cache_dtype=_KV_CACHE_DTYPE.value,
            num_prompts=_NUM_PROMPTS.value, random_input_len=_RANDOM_INPUT_LEN.value,
            random_output_len=_RANDOM_OUTPUT_LEN.value, random_range_ratio=_RANDOM_RANGE_RATIO.value,
            max_concurrency=concurrency, seed=_SEED.value,
            compare_baseline=_COMPARE_BASELINE.value,
            device_buffer_sweep=None if _DEVICE_BUFFER_SWEEP.value is None else validation.parse_int_list(
                "--device_buffer_sweep", _DEVICE_BUFFER_SWEEP.value),
            synthetic_topk_overlap=_SYNTHETIC_TOPK_OVERLAP.value, eos_token_id=_EOS_TOKEN_ID.value,
            page_size=_PAGE_SIZE.value, output_dir=_OUTPUT_DIR.value, implementation=_IMPLEMENTATION.value,
            progress=_PROGRESS.value, batch_buckets=_BATCH_BUCKETS.value, prefill_token_budget=_PREFILL_TOKEN_BUDGET.value,
            disable_overlap_schedule=_DISABLE_OVERLAP_SCHEDULE.value, disable_cuda_graph=_DISABLE_CUDA_GRAPH.value,
            cuda_graph_max_bs=_CUDA_GRAPH_MAX_BS.value,
            tp_size=_TP_SIZE.value, dp_size=_DP_SIZE.value,
            enable_dp_attention=_ENABLE_DP_ATTENTION.value, disaggregation_mode=_DISAGGREGATION_MODE.value,
            disaggregation_address=_DISAGGREGATION_ADDRESS.value, disaggregation_timeout_s=_DISAGGREGATION_TIMEOUT_S.value,
            speculative_algorithm=_SPECULATIVE_ALGORITHM.value,
            speculative_num_steps=_SPECULATIVE_NUM_STEPS.value, speculative_eagle_topk=_SPECULATIVE_EAGLE_TOPK.value,
            speculative_num_draft_tokens=_SPECULATIVE_NUM_DRAFT_TOKENS.value,
        )  # fmt: skip
        if args.disaggregation_mode == "prefill":
            print(cli.run_prefill_instance(args))
        elif args.disaggregation_mode == "decode":
            results = cli.run_decode_instance(args)
            print(format_summary(f"{results['run']['mode']} decode instance", results["summary"]))
            print(f"wrote {results['files']['results']}")
        else:
            print(cli.format_report(cli.run_serving(args)))
        interrupts.raise_if_requested()  # a Ctrl-C that something swallowed on its way
    except UsageError as error:
        _refuse(str(error))
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT; files are written whole or not at all
        interrupts.handled()
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        interrupts.handled()


def run() -> None:
    """The console entry point (`hisparse-decode`, pyproject.toml) and `python run_decode.py`."""
    for flag in flags.FLAGS.get_flags_for_module(sys.modules[__name__]):  # --help lists them for the script run
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
