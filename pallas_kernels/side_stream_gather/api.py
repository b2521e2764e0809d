"""The shared-index prefetch's row gather on a CUDA stream of its own, as two XLA FFI calls.

On JAX 0.11.2 XLA's own ways to run the gather beside other kernels (stream annotation through
compute_on, the latency-hiding scheduler, scheduling groups) all left the copy's start right
before its done (docs/architecture.md, "Overlap"). Here the ordering is explicit:

    rows, tie = side_gather_start(pool, layer, host_slots, counts, tie, tag=s)
    ...  # kernels that need `tie` run on XLA's stream while the side stream copies
    rows, tie2 = side_gather_wait(rows, pool, layer, host_slots, counts, tie2, tag=s)

`start` records an event on XLA's compute stream, makes a side stream wait for it and launches
the gather there (csrc/side_stream_gather.cu); `wait` makes the compute stream wait for that
copy. `tie` is passed through (the output aliases the operand): threading a value the next
compute needs through `start` makes XLA issue the start before that compute, and threading one
the consumer's compute needs through `wait` keeps the wait late. `wait` takes the start's
operands again so XLA keeps their buffers (and the pool, unwritten) alive while the side
stream reads them. Both calls are pure as XLA sees them; `tag` (a static int, one per pending
gather in a program) pairs a wait with its start.

On the CPU the same two targets exist (csrc/side_stream_gather_cpu.cc): start gathers in line,
wait does nothing, so the decode step's wiring runs in CPU tests bit for bit. The libraries are
built on first use, with nvcc (GPU) or the C++ compiler (CPU), into $HISPARSE_JAX_BUILD_DIR
(default ~/.cache/hisparse_jax), keyed by a hash of the source; a missing compiler raises
RuntimeError naming what to install.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import check_gather_inputs, on_gpu

CSRC = Path(__file__).parent / "csrc"
START_TARGET = "hisparse_side_gather_start"
WAIT_TARGET = "hisparse_side_gather_wait"
DEFAULT_BLOCKS = 64  # 8-warp blocks: the copy needs few SMs, the compute beside it the rest
DEFAULT_THREADS = 256
BLOCKS_ENV = "HISPARSE_SIDE_GATHER_BLOCKS"  # overrides DEFAULT_BLOCKS (read when a step is traced)


def default_blocks() -> int:
    """The side gather's grid: $HISPARSE_SIDE_GATHER_BLOCKS, else DEFAULT_BLOCKS."""
    value = os.environ.get(BLOCKS_ENV, "")
    if not value:
        return DEFAULT_BLOCKS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"${BLOCKS_ENV} must be a positive integer, got {value!r}")
    return int(value)


def build_dir() -> Path:
    return Path(os.environ.get("HISPARSE_JAX_BUILD_DIR") or Path.home() / ".cache" / "hisparse_jax")


def _find_nvcc() -> str | None:
    candidates = [shutil.which("nvcc")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "bin", "nvcc"))
    return next((c for c in candidates if c and os.path.exists(c)), None)


def can_build_gpu() -> bool:
    """Whether this machine can build the CUDA version (nvcc found): what a default may assume."""
    return _find_nvcc() is not None


def _build(source: Path, platform: str) -> Path:
    """The shared library of `source` for `platform` ("cuda" or "cpu"), compiled once per source hash."""
    include = jax.ffi.include_dir()
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + include.encode() + jax.__version__.encode()).hexdigest()[:16]
    target = build_dir() / f"lib{source.stem}_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if platform == "cuda":
        compiler = _find_nvcc()
        if compiler is None:
            raise RuntimeError("the side-stream gather needs nvcc (CUDA's compiler) on PATH or under $CUDA_HOME/bin to build its kernel")
        command = [compiler, "-O3", "-std=c++17", "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC", f"-I{include}", f"-I{source.parent}", str(source)]
    else:
        compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
        if compiler is None:
            raise RuntimeError("the side-stream gather's CPU version needs a C++ compiler (c++ / g++, or $CXX)")
        command = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{include}", f"-I{source.parent}", str(source)]
    partial = target.with_suffix(f".{os.getpid()}.tmp")  # concurrent builders each rename a whole file
    result = subprocess.run([*command, "-o", str(partial)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building {source.name} failed ({' '.join(command[:1])}):\n{result.stderr[-4000:]}")
    os.replace(partial, target)
    return target


@functools.cache
def _register(platform: str) -> None:
    """Builds and registers the start / wait FFI targets for "cuda" or "cpu", once per process."""
    source = CSRC / ("side_stream_gather.cu" if platform == "cuda" else "side_stream_gather_cpu.cc")
    library = ctypes.cdll.LoadLibrary(str(_build(source, platform)))
    jax.ffi.register_ffi_target(START_TARGET, jax.ffi.pycapsule(library.HisparseSideGatherStart), platform=platform.upper() if platform == "cuda" else "cpu")
    jax.ffi.register_ffi_target(WAIT_TARGET, jax.ffi.pycapsule(library.HisparseSideGatherWait), platform=platform.upper() if platform == "cuda" else "cpu")


def register() -> None:
    """Makes the two FFI targets known to XLA for the default backend (GPU: CUDA, else CPU)."""
    if jax.default_backend() not in ("gpu", "cpu"):
        raise NotImplementedError(f"the side-stream gather runs on CUDA GPUs and the CPU, not on {jax.default_backend()!r}")
    _register("cuda" if on_gpu() else "cpu")


def _check_tag(tag) -> None:
    if not isinstance(tag, (int, np.integer)):
        raise TypeError(f"tag must be a static int (one per pending gather), got {type(tag).__name__}")


def _check(pool, layer, host_slots, counts, tag) -> None:
    """The gather's shape checks (row_copy's, shared with gather_host_rows), whole 4-byte words, the tag."""
    check_gather_inputs(pool, layer, host_slots, counts)
    if (pool.shape[2] * np.dtype(pool.dtype).itemsize) % 4:
        raise ValueError(f"the side-stream gather copies whole 4-byte words: rows of {pool.shape[2]} x {np.dtype(pool.dtype)} are not")
    _check_tag(tag)


def side_gather_start(pool, layer, host_slots, counts, tie, *, tag: int, blocks: int | None = None, threads: int = DEFAULT_THREADS):
    """Starts rows[r, i] = pool[layer, host_slots[r, i]] (i < counts[r]) on the side stream -> (rows, tie).

    pool: row[L, S, W] (pinned host, read only until the matching wait); layer: int or i32[];
    host_slots: i32[R, K]; counts: i32[R]; tie: any array, returned as is (aliased). rows:
    row[R, K, W], a new device array whose rows past counts[r] are undefined, and which must
    not be read before side_gather_wait(..., tag=tag) returns it. blocks: the grid (None:
    default_blocks()), threads per block (a multiple of 32): one warp copies one row at a time.
    """
    _check(pool, layer, host_slots, counts, tag)
    register()
    blocks = default_blocks() if blocks is None else blocks
    R, K = host_slots.shape
    call = jax.ffi.ffi_call(
        START_TARGET,
        (jax.ShapeDtypeStruct((R, K, pool.shape[2]), pool.dtype), jax.ShapeDtypeStruct(tie.shape, tie.dtype)),
        input_output_aliases={4: 1},
    )
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    return call(pool, layer, host_slots.astype(jnp.int32), counts.astype(jnp.int32), tie, tag=np.int64(tag), blocks=np.int64(blocks), threads=np.int64(threads))


def side_gather_wait(rows, pool, layer, host_slots, counts, tie, *, tag: int):
    """The compute stream waits for side_gather_start(..., tag=tag) -> (rows, tie), both as given.
    pool, layer, host_slots, counts: the start's operands (kept alive until here).

    Only `tie` is a result of the call (aliased); rows come back through an optimization barrier
    with it, so every read of them follows the wait. Were rows a result too, XLA could copy them
    ahead of the call (to alias them), and the copy would read them before the side stream wrote
    them: seen on the H200 in tests/test_attention_layer.py's layer harness.
    """
    _check_tag(tag)
    register()
    call = jax.ffi.ffi_call(WAIT_TARGET, jax.ShapeDtypeStruct(tie.shape, tie.dtype), input_output_aliases={5: 0})
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    tie = call(rows, pool, layer, host_slots.astype(jnp.int32), counts.astype(jnp.int32), tie, tag=np.int64(tag))
    return jax.lax.optimization_barrier((rows, tie))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingGather:
    """A side-stream gather in flight: what side_gather_start returned, and what its wait needs."""

    rows: jax.Array  # row[R, K, W]: not to be read before wait()
    pool: jax.Array  # row[L, S, W]: the pool it reads (kept alive, unwritten, until wait)
    layer: jax.Array  # i32[1]
    host_slots: jax.Array  # i32[R, K]
    counts: jax.Array  # i32[R]
    tag: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def start(cls, pool, layer, host_slots, counts, tie, *, tag: int) -> tuple["PendingGather", jax.Array]:
        """side_gather_start -> (the pending gather, tie)."""
        layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
        rows, tie = side_gather_start(pool, layer, host_slots, counts, tie, tag=tag)
        return cls(rows, pool, layer, host_slots, counts, tag), tie

    def wait(self, tie) -> tuple[jax.Array, jax.Array]:
        """side_gather_wait -> (rows row[R, K, W], tie): compute threaded through `tie` runs after it."""
        return side_gather_wait(self.rows, self.pool, self.layer, self.host_slots, self.counts, tie, tag=self.tag)
