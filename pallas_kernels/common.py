"""Shared plumbing of the Pallas kernels: implementation choice and masked gather/scatter.

Each public op takes `implementation=`:
  "reference": the plain jnp function a reader checks line by line against the contract;
  "pallas":    the Pallas kernel (Triton lowering on GPU, `interpret=True` elsewhere);
  "tpu":       the Pallas TPU kernel (Mosaic lowering on TPU, TPU interpret mode elsewhere:
               `interpret=pltpu.InterpretParams()`, which simulates DMAs and semaphores);
  None:        "pallas" on GPU, "tpu" on TPU, "reference" elsewhere (interpret mode is for
               testing, not speed).
A named implementation runs or raises; it never silently falls back.

Every public op checks the static shapes it depends on and raises a ValueError naming both
values (check_rank, check_equal, check_layer_index); traced values cannot be checked.

The Triton lowering and the CPU interpreter disagree in two places this module hides:
  * a masked-off lane of a gather/scatter must not touch memory. On GPU the mask does that; the
    interpreter lowers to XLA gather/scatter, which clamps a negative index and would let a
    masked lane write back a stale value. Masked lanes therefore get the index one past the
    end, which XLA's scatter drops and the GPU never dereferences.
  * `debug_barrier` (a CTA-wide barrier, which also orders global memory within the program)
    has no interpreter rule; the interpreter runs a program sequentially and needs none.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# JAX's interpret-mode lowering of a pallas_call imports this module on first use, and importing it
# adds a value to JAX's tracing context: every jit traced before the first interpreted kernel (a
# prefill layer, the embedding) would miss its cache and compile again afterwards, inside a timed
# serving run. Imported here, before anything is traced (50 ms).
try:
    import jax._src.pallas.mosaic.interpret.interpret_pallas_call  # noqa: F401
except ImportError:  # a JAX without the TPU interpreter: nothing to keep stable
    pass

IMPLEMENTATIONS = ("reference", "pallas", "tpu")

# fp8 x fp8 dots on Hopper's fp8 tensor cores (wgmma). Pallas' Triton lowering builds every tt.dot
# with maxNumImpreciseAcc = 0, and Triton gives an fp8 dot with an f32 result wgmma only when that
# number is >= 32 (AccelerateMatmul's supportMMA): at 0 it widens both operands to f16 in
# registers and runs f16 mma.sync, so "w8a8" and the indexer's fp8 queries never reached the fp8
# units (the PTX of pip Triton 3.6 for sm_90, benchmarks/probes/kernel_resources.py, 2026-12-04:
# 64 f16 mma.sync + 96 cvt.f16x2.e4m3x2 per K step of the 64-row w8a8 tile; with the attribute,
# wgmma m64n128k32 e4m3 and no conversion). Triton's own frontend sets 2**30 for fp8 on sm_90.
# Here each fp8 dot accumulates its own contraction (<= 128 in every kernel: one scale block of
# w8a8, the indexer's head dim) in the tensor cores' accumulator, ~14 significant bits on Hopper,
# and the kernels promote to f32 between dots: DeepGEMM's scheme, and what SGLang's Triton w8a8
# kernel runs. HISPARSE_FP8_TENSOR_CORE_DOTS=0 keeps Pallas' f16 path (A/B runs; read once).
FP8_TENSOR_CORE_DOTS = os.environ.get("HISPARSE_FP8_TENSOR_CORE_DOTS", "1") != "0"
_FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def _install_fp8_tensor_core_dots() -> None:
    """Wraps Pallas' Triton lowering rule of dot_general (its registry is the extension point) so
    that a dot of two fp8 operands carries maxNumImpreciseAcc = its contraction size."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering
    except ImportError:  # a JAX without Pallas' Triton lowering: nothing to set
        return
    rules = lowering.triton_lowering_rules
    pallas_rule = rules.get(jax.lax.dot_general_p)
    if pallas_rule is None or getattr(pallas_rule, "fp8_tensor_core_dots", False):
        return

    def rule(ctx, a, b, *, dimension_numbers, **params):
        out = pallas_rule(ctx, a, b, dimension_numbers=dimension_numbers, **params)
        if FP8_TENSOR_CORE_DOTS and all(aval.dtype in _FP8_DTYPES for aval in ctx.avals_in):
            op = out.owner
            for _ in range(4):  # the dot, or a cast of its accumulator
                if op.operation.name == "tt.dot":
                    (contract, _), _ = dimension_numbers
                    size = ctx.avals_in[0].shape[contract[0]]
                    op.operation.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), size)
                    break
                op = op.operation.operands[0].owner
            else:
                raise AssertionError("Pallas' dot_general lowering no longer ends in a tt.dot: update common.py")
        return out

    rule.fp8_tensor_core_dots = True
    rules[jax.lax.dot_general_p] = rule


_install_fp8_tensor_core_dots()


def fp8_dots_round_in_mma() -> bool:
    """Whether fp8 x fp8 dots here accumulate on the fp8 tensor cores (compiled kernels with
    FP8_TENSOR_CORE_DOTS), so checks against a reference allow that rounding; the interpreter's are exact."""
    return FP8_TENSOR_CORE_DOTS and not interpret_mode()


def resolve_implementation(implementation: str | None) -> str:
    """The implementation an `implementation=` argument selects: "reference", "pallas" or "tpu"."""
    if implementation is None:
        return "pallas" if on_gpu() else "tpu" if on_tpu() else "reference"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    return implementation


def resolve_gpu_implementation(implementation: str | None, op: str) -> str:
    """"pallas" or "reference" for an op with no TPU kernel (None: "pallas" on GPU, else
    "reference"); "tpu" raises (the caller decides whether XLA's path is what it wants)."""
    if implementation is None:
        return "pallas" if on_gpu() else "reference"
    if implementation not in ("reference", "pallas"):
        raise ValueError(f"implementation must be 'reference', 'pallas' or None for {op}, got {implementation!r}")
    return implementation


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU."""
    return jax.default_backend() == "gpu"


def on_tpu() -> bool:
    """Whether JAX's default backend is a TPU."""
    return jax.default_backend() == "tpu"


def tpu_interpret():
    """The `interpret=` of a Pallas TPU kernel: compiled (False) on a TPU, else TPU interpret
    mode (pltpu.InterpretParams: DMAs, semaphores and SMEM/VMEM simulated on the CPU)."""
    from jax.experimental.pallas import tpu as pltpu

    return False if on_tpu() else pltpu.InterpretParams()


def lower_once(kernel_entry):
    """`kernel_entry` jitted with its non-array arguments static (array arguments stay traced), so
    that a model's identical calls (one per layer; the layer index is an i32[] array) trace and
    lower one kernel that every call site shares. Lowered per call site, Pallas' Triton lowering
    took 7.5 s of an 8-layer rank's probe, growing with depth (H200,
    benchmarks/probes/compile_profile.sh, 2026-12-03; the saving itself is not timed on a GPU).
    Not for kernels reading the pinned host pool (row_copy), whose memory kind is the outer
    jit's to keep."""

    @functools.wraps(kernel_entry)
    def call(*args, **kwargs):
        nums = tuple(i for i, a in enumerate(args) if not isinstance(a, (jax.Array, np.ndarray)))
        names = tuple(sorted(k for k, v in kwargs.items() if not isinstance(v, (jax.Array, np.ndarray))))
        return _jitted(kernel_entry, nums, names, interpret_mode())(*args, **kwargs)

    return call


@functools.cache
def _jitted(kernel_entry, static_argnums: tuple, static_argnames: tuple, interpret: bool):
    del interpret  # a key only: a trace made in interpret mode is not the GPU's (tests switch it)
    return jax.jit(kernel_entry, static_argnums=static_argnums, static_argnames=static_argnames)


def num_sms() -> int:
    """Streaming multiprocessors of the default device (132 on an H200); 2 where unknown (CPU)."""
    return getattr(jax.devices()[0], "core_count", None) or 2


def interpret_mode() -> bool:
    """Pallas kernels run through the CPU interpreter wherever there is no GPU."""
    return not on_gpu()


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def power_of_2_pieces(width: int) -> list[tuple[int, int]]:
    """(start, size) pieces of power-of-two size covering [0, width).

    Triton tensors must have power-of-two sizes; a 576-wide row is moved as 512 + 64.
    """
    pieces, start = [], 0
    for bit in reversed(range(width.bit_length())):
        size = 1 << bit
        if width & size:
            pieces.append((start, size))
            start += size
    return pieces


def safe_index(index: jax.Array, mask: jax.Array, size: int) -> jax.Array:
    """`index` where `mask`, else one past the end (see the module docstring).

    index: i32[N]; mask: bool[N] -> i32[N]."""
    return jnp.where(mask, index, size)


def gather(ref, indices: tuple, mask: jax.Array, other) -> jax.Array:
    """Masked load of ref[indices] (shaped like mask); masked-off lanes read nothing and yield `other`."""
    return plgpu.load(ref.at[indices], mask=mask, other=other)


def scatter(ref, indices: tuple, value: jax.Array, mask: jax.Array) -> None:
    """Masked store of `value` (shaped like mask) to ref[indices]; indices of masked-off lanes
    must come from safe_index."""
    plgpu.store(ref.at[indices], value, mask=mask)


def barrier(interpret: bool) -> None:
    """Orders this program's global-memory writes before its later reads (bar.sync)."""
    if not interpret:
        plgpu.debug_barrier()


def any_spec():
    """A whole operand left where it is (HBM or pinned host); the kernel indexes it itself."""
    return pl.BlockSpec(memory_space=pl.ANY)


def triton_params(num_warps: int = 4, num_stages: int = 1):
    """Launch shape of a Triton-lowered kernel (ignored by the interpreter)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def row_block(leading: tuple, rows: jax.Array, offset: int, size: int, interpret: bool) -> tuple:
    """Index of the block ref[*leading, rows[i], offset:offset + size] -> shape [len(rows), size].

    The Triton lowering takes a contiguous slice for the last axis (vectorised loads); the
    interpreter cannot mix slices with index arrays, so there the columns become an index array.
    """
    if interpret:
        columns = offset + jnp.arange(size, dtype=jnp.int32)
        return (*leading, rows[:, None], columns[None, :])
    return (*leading, rows, pl.ds(offset, size))


def head_block(start, block: int, count: int) -> tuple[jax.Array, jax.Array]:
    """Rows start .. start + block - 1 of a head axis of `count` rows (a block padded to a
    power of two, or to >= 16 for Triton dots) -> (safe rows i32[block], ok bool[block]): rows
    past the axis are not ok and their index is one past the end (safe_index)."""
    rows = start + jnp.arange(block, dtype=jnp.int32)
    ok = rows < count
    return safe_index(rows, ok, count), ok


def gather_rows(ref, leading: tuple, rows: jax.Array, ok: jax.Array, offset: int, size: int, interpret: bool) -> jax.Array:
    """ref[*leading, rows, offset:offset + size] -> [len(rows), size]; rows not ok read 0.
    rows, ok: from head_block."""
    mask = jnp.broadcast_to(ok[:, None], (rows.shape[0], size))
    return gather(ref, row_block(leading, rows, offset, size, interpret), mask, jnp.zeros((), ref.dtype))  # typed: Triton casts no int to fp8


# --------------------------------------------------------------------------------------------
# Static shape checks (trace time; a ValueError names both values)
# --------------------------------------------------------------------------------------------


def check_rank(name: str, array, rank: int, letters: str) -> None:
    """Raises unless `array` has `rank` dimensions; `letters` names them, e.g. "[R, K]"."""
    shape = tuple(array.shape) if hasattr(array, "shape") else np.shape(array)
    if len(shape) != rank:
        raise ValueError(f"{name} must be {letters} ({rank} dimensions), got shape {shape}")


def check_equal(name: str, value, other_name: str, other) -> None:
    """Raises unless value == other: f"{name} ({value}) must equal {other_name} ({other})"."""
    if value != other:
        raise ValueError(f"{name} ({value}) must equal {other_name} ({other})")


def check_layer_index(layer, num_layers: int) -> None:
    """Raises when a static layer index (Python or NumPy int) is outside [0, num_layers).

    A traced index (i32[]) cannot be checked: an out-of-range one is clamped or dropped by XLA.
    """
    if isinstance(layer, (int, np.integer)) and not 0 <= layer < num_layers:
        raise ValueError(f"layer ({layer}) must be in [0, num_layers ({num_layers}))")


def request_row(r, array):
    """The row of `array` (row[L, R, S, W] or a ref of it) that request r reads or writes: r
    itself, or 0 when array has one request row, a pool the whole batch shares
    (hisparse_jax.paged_state). r: an index or array of them."""
    return r * 0 if array.shape[1] == 1 else r


def check_gather_inputs(pool, layer, host_slots, counts) -> None:
    """Static shape checks of the host -> fresh device array gather."""
    check_rank("pool", pool, 3, "[L, S, W]")
    check_rank("host_slots", host_slots, 2, "[R, K]")
    check_rank("counts", counts, 1, "[R]")
    check_equal("counts batch", counts.shape[0], "host_slots batch (R)", host_slots.shape[0])
    check_layer_index(layer, pool.shape[0])


# --------------------------------------------------------------------------------------------
# Score keys and digits: the radix top-k's buckets (pallas_kernels/topk), which the indexer's
# scoring kernel can count as it writes its scores (pallas_kernels/indexer_scores, histogram=True)
# --------------------------------------------------------------------------------------------

INVALID = np.iinfo(np.int32).min  # the key of a masked position (below every real score's key)
NEG_INF_KEY = int(np.int32(np.uint32(0xFF800000).view(np.int32)) ^ 0x7FFFFFFF)  # key(-inf)
DIGITS = 256  # histogram buckets: an 8-bit digit
DIGIT_HALF = 16  # a digit's two 4-bit halves: a [16, L] x [L, 16] one-hot product counts 256 buckets


def sort_keys(x: jax.Array) -> jax.Array:
    """f32[n] -> i32[n]: signed ints in the floats' order (-0 = +0, NaN above +inf); -inf (and
    -NaN) -> INVALID."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    key = jnp.where(key == -1, 0, key)  # -0.0 (key -1) ties with +0.0, as on the GPU
    return jnp.where(key > NEG_INF_KEY, key, INVALID)


def score_digit(x: jax.Array) -> jax.Array:
    """f32[n] -> i32[n] in [0, 256): the top 8 bits of the score's fp16 order key (sign, 5
    exponent bits, 2 mantissa bits). Monotone in the score (rounding to fp16 is), -0 = +0, and
    NaN, +inf and scores past fp16's range in the top buckets: the kept set depends on the exact
    keys only, the digit only decides which scores need them."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.int16).astype(jnp.int32)  # sign-extended
    key = bits ^ ((bits >> 15) & 0x7FFF)  # i32 in [-32768, 32767], fp16 order
    key = jnp.where(key == -1, 0, key)  # fp16 -0.0 (tiny negatives round to it) ties with +0
    return (key >> 8) + 128


def span(leading, start, size: int, length: int, interpret: bool) -> tuple:
    """Index of ref[*leading, start : start + size] (a last axis of `length`; lanes past it must
    be masked). leading: an index or a tuple of them. The Triton lowering takes a contiguous
    slice (vectorised, coalesced accesses); the interpreter an index array whose lanes past the
    end point one past it (see row_block)."""
    leading = leading if isinstance(leading, tuple) else (leading,)
    if interpret:
        lanes = start + jnp.arange(size, dtype=jnp.int32)
        return (*leading, jnp.minimum(lanes, length))
    return (*leading, pl.ds(start, size))


def onehot_dtypes(onehot: str):
    """(one-hot operand, accumulator) dtypes: bf16 one-hots accumulate in f32 (exact below 2**24),
    int8 ones in i32 (half the bytes through shared memory)."""
    return (jnp.int8, jnp.int32) if onehot == "int8" else (jnp.bfloat16, jnp.float32)


def digit_counts(x: jax.Array, onehot: str = "bfloat16") -> jax.Array:
    """Scores f32[n] -> the valid ones' digit counts [16, 16] ([high half, low half] of the
    digit; f32 or i32 by `onehot`, exact). Counted on the tensor cores: one-hot [16, n] (high
    half) x [16, n]^T (low half); a compare-and-sum over 256 buckets would cost 256 operations
    per score instead of 64. Masked (-inf) scores are not counted."""
    operand, acc = onehot_dtypes(onehot)
    half = jnp.arange(DIGIT_HALF, dtype=jnp.int32)[:, None]  # i32[16, 1]
    valid = (sort_keys(x) != INVALID)[None, :]  # bool[1, n]
    digit = score_digit(x)[None, :]  # i32[1, n]
    high = (((digit >> 4) == half) & valid).astype(operand)  # [16, n]
    low = ((digit & 15) == half).astype(operand)  # [16, n]
    return jax.lax.dot_general(high, low, (((1,), (1,)), ((), ())), preferred_element_type=acc)


def store_digit_counts(hist_ref, index: tuple, counts: jax.Array, interpret: bool) -> None:
    """Writes digit_counts' [16, 16] as row hist_ref[*index, :DIGITS] (i32)."""
    lanes = jnp.arange(DIGITS, dtype=jnp.int32)
    scatter(hist_ref, span(index, 0, DIGITS, DIGITS, interpret), counts.astype(jnp.int32).reshape(DIGITS), lanes < DIGITS)
