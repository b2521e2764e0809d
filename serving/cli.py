"""A serving-style run, what `run_decode.py` does without --prompts: build a model, generate
bench_serving's random workload, serve it with HiSparse and/or the full-KV baseline at each
max concurrency under one device KV budget, optionally sweep device_buffer_size, then write the
results JSON and the plots and return a printable report.

    results = run_serving(ServingArgs(compare_baseline=True, max_concurrency=(1, 4, 8)))
    print(format_report(results))

DeepSeek-V4 and MiniMax-M3 (`--model=deepseek_v4_tiny|minimax_m3_tiny`) are served by the same
engine through their families' runners (models.registry: random model, runner, device
footprint); flags those runners cannot honour are refused (validation.check_family_serving).

Every input is validated before anything is built (serving.validation: UsageError
names the flag); the script only maps flags to ServingArgs. A run with synthetic selection writes
`synthetic_*` files with the label in every title, so its figures are never mixed with real-model
ones.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.model import DSAModelConfig, UnsupportedModelError
from configs.speculative import SpeculativeConfig
from hisparse_jax import memory
from hisparse_jax.attention_layer import shared_prefetch_mode
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.sharding import ParallelConfig, ParallelConfigError
from models import registry
from models.common import inputs
from models.common.checkpoint import CheckpointError
from models.dsa.decoding import prefetch_start_point
from models.dsa.footprint import DeviceFootprint
from models.dsa.loading import load_hf_checkpoint
from models.dsa.model import DSAForCausalLM
from models.common.runner import padded_prompt_length
from models.dsa.runner import NO_COMMAND_BUFFERS, ModelRunner, PrefilledKV, resolved_shared_prefetch
from models.registry import decode_checkpoint
from serving import speculation
from serving.disaggregation import KVReceiver, KVSender, parse_address
from serving.engine import Engine, EngineConfig, progress_bar
from serving import fit
from serving.errors import UsageError
from serving.telemetry import format_summary, steps_to_json, write_json
from serving.validation import (
    DTYPE_NAMES,
    MODELS,
    CheckpointDecode,
    check_family_serving,
    check_flag,
    check_residency_serving,
    checkpoint_config,
    flag_errors,
    resolve_hisparse_config,
)
from serving.workload import Request, random_requests

DTYPES = {name: getattr(jnp, name) for name in DTYPE_NAMES}


@dataclasses.dataclass(frozen=True)
class ServingArgs:
    """run_decode.py's flags (SGLang's names where SGLang has one)."""

    model: str = "tiny"  # a key of MODELS, random weights
    checkpoint: str | None = None  # or a Hugging Face checkpoint directory
    enable_hisparse: bool = True
    hisparse_config: str = ""
    context_length: int | None = None  # None: the workload's longest request
    max_running_requests: int = 8
    kv_budget_gb: float | None = None  # None: what max_running_requests HiSparse requests need
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"  # SGLang's --kv-cache-dtype: auto (= dtype), bfloat16, fp8_e4m3
    num_prompts: int = 16
    random_input_len: int = 224
    random_output_len: int = 32
    random_range_ratio: float = 0.5
    max_concurrency: tuple[int, ...] = ()  # () : max_running_requests
    seed: int = 0
    compare_baseline: bool = True
    # HiSparse device_buffer_size values swept at the highest concurrency; None: top_k x (1, 2, 4)
    # with HiSparse, none without (run_decode's default when the flag is not set)
    device_buffer_sweep: tuple[int, ...] | None = ()
    synthetic_topk_overlap: float | None = None
    eos_token_id: int | None = None
    page_size: int = 16
    output_dir: str = "outputs"
    implementation: str | None = None
    progress: bool = True
    # Decode each step on the smallest compiled batch holding the running requests (EngineConfig.
    # batch_buckets). Off by default here: then every step runs all slots in both modes, so a
    # request's tokens cannot depend on the batch size (bf16 matmuls round differently at
    # different batch sizes) and the run's HiSparse-vs-baseline token check is exact.
    batch_buckets: bool = False
    prefill_token_budget: int | None = None  # EngineConfig.prefill_token_budget: None prefills whole
    disable_overlap_schedule: bool = False  # SGLang's --disable-overlap-schedule (EngineConfig.overlap_schedule)
    disable_cuda_graph: bool = False  # SGLang's --disable-cuda-graph: the decode step without XLA command buffers
    cuda_graph_max_bs: int | None = None  # SGLang's --cuda-graph-max-bs: larger decode buckets without them
    tp_size: int = 1  # SGLang's --tp-size, --dp-size, --enable-dp-attention (hisparse_jax.sharding)
    dp_size: int = 1
    enable_dp_attention: bool = False
    disaggregation_mode: str = "null"  # SGLang's --disaggregation-mode: null (colocated), prefill, decode
    disaggregation_address: str = "127.0.0.1:5757"  # the decode instance's control address
    disaggregation_timeout_s: float = 60.0  # how long either PD instance waits for the other
    # SGLang's --speculative-* flags (serving.speculation; `speculative` below): EAGLE drafting with
    # the model's MTP layer (built-in random models get a random one). None: plain decoding.
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):  # each value by its flag's rule (validation.check_flag)
            check_flag(field.name, getattr(self, field.name))
        try:
            ParallelConfig(self.tp_size, self.dp_size, self.enable_dp_attention)
        except ParallelConfigError as error:
            raise UsageError(f"--tp_size/--dp_size/--enable_dp_attention: {error}") from None
        if self.disaggregation_mode != "null":
            parse_address(self.disaggregation_address)
            if not self.parallel.is_single_device:
                raise UsageError("--disaggregation_mode runs one device per instance here; drop --tp_size/--dp_size")
        if not self.enable_hisparse and self.device_buffer_sweep:
            raise UsageError("--device_buffer_sweep needs --enable_hisparse (it sweeps HiSparse's buffer); drop one of them")
        check_residency_serving(dataclasses.asdict(self))
        speculation.check_serving(self.speculative, dataclasses.asdict(self))
        check_prefetch_environment(self.implementation)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The --speculative_* flags as one config (checked in __post_init__); None without them."""
        return speculation.speculative_config(dataclasses.asdict(self))

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.tp_size, self.dp_size, self.enable_dp_attention)

    @property
    def modes(self) -> tuple[str, ...]:
        if not self.enable_hisparse:
            return ("baseline",)
        return ("hisparse", "baseline") if self.compare_baseline else ("hisparse",)

    @property
    def label(self) -> str:
        """Selection label carried by every output."""
        if self.synthetic_topk_overlap is None:
            return "model selection"
        return f"SYNTHETIC top-k, overlap {self.synthetic_topk_overlap:g}"


def buffer_sweep(args: ServingArgs, hisparse: HiSparseConfig) -> tuple[int, ...]:
    """The device_buffer_size values to sweep: the flag's, or by default 1, 2 and 4 x top_k with
    HiSparse (16, 32, 64 on the tiny models) and none without."""
    if args.device_buffer_sweep is not None:
        return args.device_buffer_sweep
    return tuple(f * hisparse.top_k for f in (1, 2, 4)) if args.enable_hisparse else ()


def model_config(args: ServingArgs):
    """The architecture alone (cheap): a built-in config or the checkpoint's config.json."""
    if args.checkpoint is None:
        config = MODELS[args.model]()
        if args.speculative is not None and isinstance(config, DSAModelConfig):  # random weights: give it an MTP layer
            config = config.replace(num_nextn_predict_layers=max(1, config.num_nextn_predict_layers))
    else:
        config = checkpoint_config(args.checkpoint)
    speculation.check_model(args.speculative, config)
    return config


def load_model(args: ServingArgs):
    """(model, name): random weights of a built-in config, or a checkpoint's weights."""
    dtype = DTYPES[args.dtype]
    if args.checkpoint is not None:
        try:
            model = load_hf_checkpoint(args.checkpoint, dtype=dtype, load_mtp=args.speculative is not None)
            return model, os.path.basename(os.path.normpath(args.checkpoint))
        except (CheckpointError, UnsupportedModelError, OSError) as error:
            raise UsageError(f"--checkpoint: {error}") from None
    config = model_config(args)
    family = registry.family_of_config(config)
    if family.random_model is not None:  # DeepSeek-V4, MiniMax-M3
        return family.random_model(config, dtype, args.seed), f"{args.model} (random weights)"
    return DSAForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(args.seed)), f"{args.model} (random weights)"


def make_runner(model, args: ServingArgs, shared_prefetch: str | None = None):
    """The engine's runner: the model family's (DeepSeek-V4, MiniMax-M3) or the DSA ModelRunner
    (shared_prefetch: --hisparse_config's key; None, the default)."""
    family = registry.family_of_config(model.config)
    if family.make_runner is not None:
        for flag in ("disable_cuda_graph", "cuda_graph_max_bs"):
            if getattr(args, flag) not in (False, None):
                raise UsageError(f"--{flag} is not supported for {args.model} yet (DSA models only)")
        return family.make_runner(model, implementation=args.implementation)
    try:
        return ModelRunner(
            model, implementation=args.implementation, parallel=args.parallel, kv_cache_dtype=args.kv_cache_dtype,
            speculative=args.speculative, shared_prefetch=shared_prefetch,
            decode_compiler_options=NO_COMMAND_BUFFERS if args.disable_cuda_graph else None, cuda_graph_max_bs=args.cuda_graph_max_bs,
        )  # fmt: skip
    except ParallelConfigError as error:  # too few devices for the mesh
        raise UsageError(f"--tp_size/--dp_size/--enable_dp_attention: {error}") from None


def _point(result, concurrency: int) -> dict:
    summary = dict(result.summary)
    summary.update(max_concurrency=concurrency, steps=steps_to_json(result.steps))
    return summary


@dataclasses.dataclass
class _Prepared:
    """What every run derives from the flags before serving (checked, then the weights built)."""

    config: DSAModelConfig  # or DeepseekV4Config / MiniMaxM3Config (models.registry)
    hisparse: HiSparseConfig
    requests: list
    context: int
    model: DSAForCausalLM
    model_name: str
    budget: int
    budget_source: str


def _prepare(args: ServingArgs) -> _Prepared:
    config = model_config(args)  # everything is checked before the weights are built
    check_family_serving(config, dataclasses.asdict(args))  # flags another family's runner cannot honour
    with flag_errors("--tp_size/--dp_size/--enable_dp_attention"):
        inputs.check_parallel(config, args.parallel, num_requests=args.max_running_requests, requests="request slots (--max_running_requests)")
    hisparse = resolve_hisparse_config(args.hisparse_config, config)
    if args.eos_token_id is not None and args.eos_token_id >= config.vocab_size:
        raise UsageError(f"--eos_token_id={args.eos_token_id} is outside the model's vocabulary [0, {config.vocab_size})")
    requests = random_requests(
        num_prompts=args.num_prompts, input_len=args.random_input_len, output_len=args.random_output_len,
        range_ratio=args.random_range_ratio, vocab_size=config.vocab_size, seed=args.seed, eos_token_id=args.eos_token_id,
    )  # fmt: skip
    drafts = 0 if args.speculative is None else args.speculative.num_steps - 1  # a last step's drafts (Engine)
    context = args.context_length or max(r.max_tokens for r in requests) + drafts
    if args.disaggregation_mode == "decode":  # what arrives: any request the workload flags allow
        context = args.context_length or args.random_input_len + args.random_output_len
    longest = max(requests, key=lambda r: r.max_tokens)
    if longest.max_tokens + drafts > context and args.disaggregation_mode != "decode":
        extra = f" + {drafts} speculative" if drafts else ""
        raise UsageError(
            f"request {longest.id} needs {longest.max_tokens + drafts} tokens ({longest.prompt_len} prompt +"
            f" {longest.max_new_tokens} new{extra}) > context_length {context}"
        )
    if context > config.max_position_embeddings:
        source = f"--context_length={context}" if args.context_length else f"the workload's longest request ({context} tokens)"
        raise UsageError(f"{source} exceeds the model's max_position_embeddings ({config.max_position_embeddings})")
    for size in buffer_sweep(args, hisparse):
        if size < hisparse.top_k:
            raise UsageError(f"--device_buffer_sweep: device_buffer_size ({size}) must be >= top_k ({hisparse.top_k})")
    dtype = DTYPES[args.dtype]
    footprints = {mode: _footprint(config, args, hisparse if mode == "hisparse" else None) for mode in ("hisparse", "baseline")}
    if args.kv_budget_gb is not None:
        budget, budget_source = int(args.kv_budget_gb * 1e9), "--kv_budget_gb"
    else:
        # Auto: HiSparse's R slots at full context fit exactly; the baseline gets the same bytes.
        budget = args.max_running_requests * footprints["hisparse"].request_bytes(context)
        budget_source = "auto: max_running_requests HiSparse requests at context_length"
    # Each engine allocates its R slots' KV (the baseline's at full context: a static array); a PD
    # prefill instance holds one prompt's KV at a time.
    R, modes = args.max_running_requests, args.modes
    if args.disaggregation_mode == "prefill":
        R, modes = 1, ("baseline",)
    fit.check_fits(
        f"--checkpoint={args.checkpoint}" if args.checkpoint else f"--model={args.model}", config, dtype,
        kv_device_bytes=R * max(footprints[m].request_bytes(context) for m in modes),
        kv_host_bytes=R * footprints["hisparse"].host_request_bytes(context) if "hisparse" in modes else 0,
        parallel=args.parallel,
    )  # fmt: skip
    model, model_name = load_model(args)
    return _Prepared(config, hisparse, requests, context, model, model_name, budget, budget_source)


def _footprint(config, args: ServingArgs, hisparse: HiSparseConfig | None):
    """Device bytes per request of an engine serving `config` with `hisparse` (None: the baseline)."""
    family = registry.family_of_config(config)
    if family.footprint is not None:  # DeepSeek-V4, MiniMax-M3: the runner's own count
        return family.footprint(config, DTYPES[args.dtype], hisparse)
    key = None if hisparse is None else hisparse.shared_prefetch
    prefetch = resolved_shared_prefetch(args.parallel, args.implementation, key)  # as the runner will
    return DeviceFootprint.of(config, DTYPES[args.dtype], hisparse, args.kv_cache_dtype, prefetch, args.speculative)


def run_serving(args: ServingArgs) -> dict:
    """Runs everything `args` asks for; writes results JSON + plots to args.output_dir."""
    prepared = _prepare(args)
    hisparse, requests, context = prepared.hisparse, prepared.requests, prepared.context
    model, model_name, budget, budget_source = prepared.model, prepared.model_name, prepared.budget, prepared.budget_source
    concurrencies = args.max_concurrency or (args.max_running_requests,)
    runner = make_runner(model, args, None if hisparse is None else hisparse.shared_prefetch)
    os.makedirs(args.output_dir, exist_ok=True)
    prefix = "" if args.synthetic_topk_overlap is None else f"synthetic_overlap{args.synthetic_topk_overlap:g}_"
    results = dict(
        run=dict(
            model=model_name, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, selection=args.label,
            devices=[str(d) for d in (runner.mesh.devices.flat if runner.mesh is not None else jax.devices()[:1])],
            parallel=dataclasses.asdict(args.parallel),
            jax_version=jax.__version__, context_length=context, max_running_requests=args.max_running_requests,
            kv_budget_bytes=budget, kv_budget_source=budget_source, hisparse_config=json.loads(hisparse.to_json()),
            page_size=args.page_size, overlap_schedule=not args.disable_overlap_schedule and args.speculative is None,
            speculative=None if args.speculative is None else dataclasses.asdict(args.speculative),
            workload=dict(dataset="random", num_prompts=args.num_prompts, random_input_len=args.random_input_len,
                          random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
                          seed=args.seed, output_tokens=sum(r.max_new_tokens for r in requests)),
        ),  # fmt: skip
        capacity={},
        kv_bytes_per_request={},  # mode -> {tokens (context_length), device, host}
        points=[],
        buffer_sweep=[],
    )
    json_path = os.path.join(args.output_dir, f"{prefix}results.json")
    tokens = {}
    host_pages = None  # the sweep keeps HiSparse's host pool as sized for hisparse_config
    reusable = None  # HiSparse at the highest concurrency: the sweep's point for the configured B
    for mode in args.modes:
        engine = _engine(runner, args, hisparse if mode == "hisparse" else None, context, budget)
        results["capacity"][mode] = engine.capacity(context)
        results["kv_bytes_per_request"][mode] = engine.kv_bytes_per_request()
        if mode == "hisparse":
            host_pages = engine.cache.kv.num_host_pages
        engine.warmup(requests, progress=args.progress)
        for concurrency in concurrencies:
            run = engine.run(requests, max_concurrency=concurrency, progress=args.progress, label=f"{mode} c={concurrency}")
            results["points"].append(_point(run, concurrency))
            tokens[mode, concurrency] = run.tokens
            if mode == "hisparse" and concurrency == max(concurrencies):
                reusable = run
            write_json(json_path, results)  # partial results survive an interruption
    for size in buffer_sweep(args, hisparse):
        num_host_pages = host_pages or _host_pages(hisparse, args)
        if size == hisparse.device_buffer_size and reusable is not None:
            run = reusable  # the same configuration, already measured above
        else:
            swept = dataclasses.replace(hisparse, device_buffer_size=size)
            engine = _engine(runner, args, swept, context, budget, num_host_pages)
            engine.warmup(requests, progress=args.progress)
            run = engine.run(requests, max_concurrency=max(concurrencies), progress=args.progress, label=f"buffer {size}")
        point = _point(run, max(concurrencies))
        request_steps = max(1, sum(s.running for s in run.steps))
        point.update(device_buffer_size=size, num_host_pages=num_host_pages,
                     misses_per_request_step=run.summary["misses"] / request_steps)  # fmt: skip
        results["buffer_sweep"].append(point)
        tokens["buffer", size] = run.tokens
        write_json(json_path, results)
    # None when a single run leaves nothing to compare
    results["tokens_identical"] = _all_identical(tokens, [r.id for r in requests]) if len(tokens) > 1 else None
    results["files"] = _plot(results, args.output_dir, prefix, args.label)
    write_json(json_path, results)
    results["files"]["results"] = json_path
    return results


def run_prefill_instance(args: ServingArgs) -> str:
    """PD prefill instance: prefills the workload and hands every request's KV to the decode
    instance at --disaggregation_address (serving.disaggregation), waiting up to
    --disaggregation_timeout_s for it to listen. Rows go as this runner stores them
    (--kv_cache_dtype=fp8_e4m3: the 656 B fp8 rows, quantised here). Returns a report line."""
    prepared = _prepare(args)
    runner = ModelRunner(prepared.model, implementation=args.implementation, kv_cache_dtype=args.kv_cache_dtype)
    sender = KVSender(parse_address(args.disaggregation_address), timeout_s=args.disaggregation_timeout_s)
    first_token = jax.jit(lambda logits: jnp.argmax(logits).astype(jnp.int32))
    bar, rows = progress_bar(args.progress, total=len(prepared.requests), desc="prefill and send", unit="req"), 0
    try:
        for request in prepared.requests:
            kv = runner.prefill_kv(request.prompt)
            sender.send(request, kv, int(first_token(kv.logits)))
            rows += request.prompt_len * len(kv.rows)
            bar.update(1)
        sender.close()
    finally:
        bar.close()
    row = runner.row_layout
    return (
        f"prefilled and sent {len(prepared.requests)} requests to {args.disaggregation_address}: {rows} KV rows of"
        f" {row.bytes_per_row} B ({row.kind}), {rows * row.bytes_per_row / 1e6:.2f} MB of prompt rows"
    )


def run_decode_instance(args: ServingArgs) -> dict:
    """PD decode instance: compiles what arrivals run, listens at --disaggregation_address (for
    up to --disaggregation_timeout_s until the prefill instance connects), admits each request
    once its KV arrived and decodes with HiSparse (or the baseline with --noenable_hisparse);
    writes results.json with every request's tokens. Its figures start at the first arrival:
    neither the wait for the prefill instance nor compilation is in them."""
    prepared = _prepare(args)
    hisparse = prepared.hisparse if args.enable_hisparse else None
    prefetch = None if hisparse is None else hisparse.shared_prefetch
    runner = ModelRunner(prepared.model, implementation=args.implementation, kv_cache_dtype=args.kv_cache_dtype, shared_prefetch=prefetch)
    engine = _engine(runner, args, hisparse, prepared.context, prepared.budget)
    rows_kind = runner.host_memory_kind if hisparse is not None else memory.DEVICE  # host pool, or device KV
    _warm_decode_instance(engine, runner, args, rows_kind, prepared.context)
    address = parse_address(args.disaggregation_address)
    receiver = KVReceiver(address, rows_memory_kind=rows_kind, timeout_s=args.disaggregation_timeout_s, check=engine.scheduler.check)
    host, port = receiver.address
    logging.info(
        "decode instance (%s) listening on %s:%d for up to %g s; start the prefill instance with"
        " --disaggregation_mode=prefill --disaggregation_address=%s:%d",
        engine.config.mode, host, port, args.disaggregation_timeout_s, host, port,
    )  # fmt: skip
    run = engine.run([], max_concurrency=args.max_concurrency[0] if args.max_concurrency else None,
                     progress=args.progress, label=f"{engine.config.mode} decode", arrivals=receiver)  # fmt: skip
    os.makedirs(args.output_dir, exist_ok=True)
    results = dict(
        run=dict(model=prepared.model_name, disaggregation_mode="decode", mode=engine.config.mode, selection=args.label,
                 kv_cache_dtype=args.kv_cache_dtype, address=f"{host}:{port}", context_length=prepared.context,
                 max_running_requests=args.max_running_requests,
                 clock="from the first arrival (summary.first_arrival_wait_s: the wait before it)"),  # fmt: skip
        summary=run.summary,
        handover=receiver.handover_stats(),
        tokens={str(i): t.tolist() for i, t in sorted(run.tokens.items())},
    )
    handover = results["handover"]
    if handover["seconds"]:
        logging.info("KV hand-over: %d requests, %.1f MB in %.3f s of pulls: %.2f GB/s",
                     handover["requests"], handover["bytes"] / 1e6, handover["seconds"], handover["gb_per_s"])  # fmt: skip
    prefix = "" if args.synthetic_topk_overlap is None else f"synthetic_overlap{args.synthetic_topk_overlap:g}_"
    results["files"] = {"results": os.path.join(args.output_dir, f"{prefix}results.json")}  # labelled as colocated runs
    write_json(results["files"]["results"], results)
    return results


def _warm_decode_instance(engine: Engine, runner: ModelRunner, args: ServingArgs, rows_kind: str, context: int) -> None:
    """Compiles, before the decode instance listens, what its arrivals run: admitting prefilled KV
    (one compile per padded prompt length, for every length the workload flags allow), a decode
    step on every bucket, retiring. The warm requests carry zero KV placed as KVReceiver places
    it (rows in rows_kind, keys on the device)."""
    lo, hi = max(1, int(args.random_input_len * args.random_range_ratio)), min(args.random_input_len, context - 1)
    lengths = {padded_prompt_length(t, runner.prefill_chunk)[0]: t for t in range(lo, hi + 1)}  # a prompt length per bucket
    keys = engine.cache.index_keys
    warm = []
    for i, (padded, length) in enumerate(sorted(lengths.items())):
        kv = PrefilledKV(
            tuple(memory.allocate((padded, runner.row_layout.width), runner.row_layout.dtype, 0, rows_kind) for _ in range(runner.config.num_layers)),
            tuple(memory.allocate((padded, keys.shape[-1]), keys.dtype, 0, memory.DEVICE) for _ in range(keys.shape[0])),
            None,
            tuple(memory.allocate((padded,), jnp.float32, 0, memory.DEVICE) for _ in range(keys.shape[0]) if engine.cache.index_key_scales.shape[-1]),
            runner.row_layout,
        )  # fmt: skip
        warm.append(Request(i, np.zeros(length, np.int32), min(2, context - length), prefilled=kv, first_token=0))
    engine.run(warm, max_concurrency=1)
    engine.compile_buckets(progress=args.progress)


def _host_pages(hisparse: HiSparseConfig, args: ServingArgs) -> int:
    """SGLang's host pool: host_to_device_ratio x the device pool (R buffers of B tokens)."""
    return math.ceil(hisparse.host_to_device_ratio * args.max_running_requests * hisparse.device_buffer_size / args.page_size)


def _engine(runner, args: ServingArgs, hisparse, context: int, budget: int, num_host_pages: int | None = None) -> Engine:
    return Engine(
        runner,
        EngineConfig(
            max_running_requests=args.max_running_requests, context_length=context, hisparse=hisparse,
            kv_budget_bytes=budget, page_size=args.page_size, synthetic_topk_overlap=args.synthetic_topk_overlap,
            seed=args.seed, num_host_pages=num_host_pages, batch_buckets=args.batch_buckets,
            prefill_token_budget=args.prefill_token_budget, overlap_schedule=not args.disable_overlap_schedule,
        ),
    )  # fmt: skip


def _all_identical(tokens: dict, ids: list[int]) -> bool:
    """Every run produced the same tokens for every request (modes, concurrencies and buffer sizes alike)."""
    runs = list(tokens.values())
    return all(np.array_equal(run[i], runs[0][i]) for run in runs[1:] for i in ids)


PLOTS_NEED = "plots skipped: they need matplotlib (pip install -e '.[serving]'); the JSON holds every figure"


def _plot(results: dict, output_dir: str, prefix: str, label: str) -> dict:
    """Draws the run's plots -> {name: PNG path}; none (and a note in the report) without matplotlib."""
    try:
        from serving import plots  # matplotlib: an optional extra
    except ModuleNotFoundError as error:
        if error.name != "matplotlib":
            raise
        results["notes"] = results.get("notes", []) + [PLOTS_NEED]
        return {}
    files = {}
    path = lambda name: os.path.join(output_dir, f"{prefix}{name}.png")  # noqa: E731
    if results["points"]:
        files["throughput_vs_concurrency"] = path("throughput_vs_concurrency")
        plots.throughput_vs_concurrency(results["points"], files["throughput_vs_concurrency"], label=label)
        series = {f"{p['mode']} c={p['max_concurrency']}": p["steps"]["misses"] for p in results["points"] if p["mode"] == "hisparse"}
        if series:
            files["misses_over_time"] = path("misses_over_time")
            plots.misses_over_time(series, files["misses_over_time"], label=label)
        if "acceptance_length" in results["points"][0]:  # speculative decoding: tokens per request per step
            accepted = {
                f"{p['mode']} c={p['max_concurrency']}": [(n + a) / n for n, a in zip(p["steps"]["running"], p["steps"]["accepted"])]
                for p in results["points"]
            }  # fmt: skip
            files["accepted_per_step"] = path("accepted_per_step")
            plots.accepted_per_step(accepted, files["accepted_per_step"], label=label)
    if results["buffer_sweep"]:
        sweep = results["buffer_sweep"]
        files["misses_vs_buffer_size"] = path("misses_vs_buffer_size")
        plots.misses_vs_buffer_size(sweep, files["misses_vs_buffer_size"], label=label)
        files["misses_over_time_by_buffer"] = path("misses_over_time_by_buffer")
        plots.misses_over_time(
            {f"B={p['device_buffer_size']}": p["steps"]["misses"] for p in sweep}, files["misses_over_time_by_buffer"], label=label
        )
    return files


def format_report(results: dict) -> str:
    run = results["run"]
    lines = [
        f"model {run['model']}, {run['dtype']}, kv_cache_dtype {run['kv_cache_dtype']}, selection: {run['selection']}",
        f"workload: {run['workload']['num_prompts']} prompts, random_input_len {run['workload']['random_input_len']},"
        f" random_output_len {run['workload']['random_output_len']}, range ratio {run['workload']['random_range_ratio']}",
        f"device KV budget {run['kv_budget_bytes'] / 1e6:.3f} MB ({run['kv_budget_source']}); context_length"
        f" {run['context_length']}; max_running_requests {run['max_running_requests']}; hisparse_config {run['hisparse_config']}",
        "requests of context_length that fit at once: " + ", ".join(f"{m} {n}" for m, n in results["capacity"].items()),
        f"KV bytes per request at context_length {run['context_length']}: "
        + "; ".join(f"{m} device {kv['device'] / 1e6:.3f} MB, host {kv['host'] / 1e6:.3f} MB" for m, kv in results["kv_bytes_per_request"].items()),
    ]
    for p in results["points"]:
        lines.append(format_summary(f"{p['mode']} c={p['max_concurrency']}", p))
    for p in results["buffer_sweep"]:
        lines.append(format_summary(f"hisparse B={p['device_buffer_size']} c={p['max_concurrency']}", p))
    if len({p["mode"] for p in results["points"]}) > 1:
        by = {(p["mode"], p["max_concurrency"]): p["output_throughput"] for p in results["points"]}
        ratios = [f"c={c}: {by['hisparse', c] / by['baseline', c]:.2f}x" for (m, c) in by if m == "hisparse" and ("baseline", c) in by]
        lines.append("hisparse / baseline output throughput: " + ", ".join(ratios))
    if results["tokens_identical"] is not None:  # two runs or more to compare
        lines.append(f"same tokens for every request in every run: {results['tokens_identical']}")
    lines.extend(results.get("notes", []))
    lines.append("wrote " + ", ".join(results["files"].values()))
    return "\n".join(lines)


def check_prefetch_environment(implementation: str | None) -> None:
    """The shared-layer prefetch's environment variables ($HISPARSE_SHARED_PREFETCH,
    $HISPARSE_PREFETCH_START), checked before anything is built: a bad value is a UsageError."""
    try:
        shared_prefetch_mode(None, implementation)
        prefetch_start_point()
    except ValueError as error:
        raise UsageError(str(error)) from None


def run_checkpoint_decode(job: CheckpointDecode):
    """Greedy decoding of a checkpoint over job.prompts -> job.output (models.registry.decode_checkpoint);
    job comes from validation.check_checkpoint_decode, every input already checked. What only
    loading can find (missing or misshapen tensors, an unwritable output) is a UsageError too."""
    check_prefetch_environment(job.implementation)
    B, T = job.prompts_shape
    context, dtype = T + job.max_new_tokens, DTYPES[job.dtype]
    family = registry.family_of_config(job.config)
    if family.footprint is not None:  # DeepSeek-V4, MiniMax-M3
        footprint = family.footprint(job.config, dtype, job.hisparse)
    else:
        footprint = DeviceFootprint.of(job.config, dtype, job.hisparse, job.kv_cache_dtype)
    try:
        parallel = ParallelConfig(job.tp_size, job.dp_size, job.enable_dp_attention)
        parallel.make_mesh()  # enough devices?
    except ParallelConfigError as error:
        raise UsageError(f"--tp_size/--dp_size/--enable_dp_attention: {error}") from None
    fit.check_fits(
        f"--checkpoint={job.checkpoint}", job.config, dtype, kv_device_bytes=B * footprint.request_bytes(context),
        kv_host_bytes=B * footprint.host_request_bytes(context), parallel=parallel,
    )  # fmt: skip
    try:
        return decode_checkpoint(
            job.checkpoint, job.prompts, job.output, max_new_tokens=job.max_new_tokens, dtype=DTYPES[job.dtype],
            hisparse=job.hisparse, kv_cache_dtype=job.kv_cache_dtype, parallel=parallel, implementation=job.implementation,
            speculative=job.speculative, weights_dtype=job.weights_dtype, fp8_activations=job.fp8_activations,
        )  # fmt: skip
    except (CheckpointError, UnsupportedModelError) as error:
        raise UsageError(f"--checkpoint: {error}") from None
    except inputs.InputError as error:  # validation's checks again, e.g. a file changed since
        raise UsageError(str(error)) from None
    except OSError as error:
        raise UsageError(f"--output: cannot write {job.output}: {error}") from None
