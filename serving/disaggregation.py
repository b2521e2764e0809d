"""PD disaggregation: a prefill process hands each request's KV to a decode process.

    decode process:  receiver = KVReceiver(("127.0.0.1", 5757)); engine.run([], arrivals=receiver)
    prefill process: sender = KVSender(("127.0.0.1", 5757)); sender.send(request, runner.prefill_kv(prompt)); sender.close()

Transport, and why:
  * the arrays (every layer's KV rows, the indexer keys and, fp8 keys, their scales) go through JAX's own cross-process
    transfer, `jax.experimental.transfer`: the prefill side offers them (`await_pull`), the decode
    side pulls them straight into the memory it names: the KV rows into pinned host memory (they
    are bound for the HiSparse host pool, docs/background.md: the decode device never holds the
    context), the indexer keys into device memory. No serialisation, no staging through Python;
    on GPUs the same API moves device buffers over the network stack XLA was built with.
  * the small control messages (which request, its prompt, its first token, where to pull)
    go over the standard library's `multiprocessing.connection` (a length-prefixed, authenticated
    socket): JAX offers no message channel between independent programs (jax.distributed's
    key-value store comes with one global multi-process program, which PD is not).
The decode process admits a request once its KV has arrived (serving.engine: `arrivals`).

Either process may start first: the prefill side retries its connection until the decode side
listens, the decode side waits for the prefill side's connection, each for `timeout_s`; past it,
and when the other side goes away mid-run, the failure is one UsageError line, no traceback.
KV rows travel as the prefill runner stores them (PrefilledKV.row_layout: fp8_e4m3 rows as
FlashMLA's 656 B rows, quantised on the prefill side).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from multiprocessing.connection import Client, Listener

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from hisparse_jax import memory
from hisparse_jax.row_layout import KVRowLayout
from models.dsa.runner import PrefilledKV
from serving.errors import UsageError
from serving.workload import Request

AUTHKEY = b"hisparse-pd"  # loopback and trusted networks only: both processes share it
_LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT_S = 60.0  # how long either side waits for the other (--disaggregation_timeout_s)
_RETRY_S = 0.25  # between connection attempts
_GONE = (EOFError, ConnectionError, OSError)  # the other process went away mid-run


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' -> (host, port)."""
    host, _, port = str(text).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--disaggregation_address must be host:port, got {text!r}")
    return host, int(port)


def _start_transfer_server(host: str):
    return transfer.start_transfer_server(jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"])


class KVSender:
    """Prefill side: offers each request's KV for the decode process to pull."""

    def __init__(self, decode_address: tuple[str, int], *, authkey: bytes = AUTHKEY, timeout_s: float = DEFAULT_TIMEOUT_S):
        """Connects to the decode instance's control address, retrying while nothing listens
        there for up to timeout_s (then a UsageError)."""
        self._server = _start_transfer_server(decode_address[0] if decode_address[0] != "localhost" else _LOOPBACK)
        self._address = f"{decode_address[0]}:{decode_address[1]}"
        self._control = _connect(decode_address, authkey, timeout_s)
        self._uuids = itertools.count(1)
        self._offered: dict[int, list[jax.Array]] = {}  # kept alive until the decode side pulled them

    def send(self, request: Request, kv: PrefilledKV, first_token: int) -> None:
        uuid = next(self._uuids)
        arrays = [*kv.rows, *kv.index_keys, *kv.index_key_scales]
        self._server.await_pull(uuid, arrays)
        self._offered[uuid] = arrays
        layout = None if kv.row_layout is None else dataclasses.astuple(kv.row_layout)
        self._talk(
            self._control.send,
            dict(
                kind="request", uuid=uuid, transfer_address=self._server.address(),
                id=int(request.id), prompt=np.asarray(request.prompt, np.int32).tolist(),
                max_new_tokens=int(request.max_new_tokens), eos_token_id=request.eos_token_id,
                first_token=int(first_token), row_layout=layout,
                rows=[(list(a.shape), a.dtype.name) for a in kv.rows],
                index_keys=[(list(a.shape), a.dtype.name) for a in kv.index_keys],
                index_key_scales=[(list(a.shape), a.dtype.name) for a in kv.index_key_scales],
            ),
        )  # fmt: skip
        self._collect_acks(block=False)

    def _talk(self, call, *args):
        """A control-channel call; the decode instance gone is one UsageError line."""
        try:
            return call(*args)
        except _GONE as error:
            raise UsageError(f"PD: the decode instance at {self._address} went away ({type(error).__name__}: {error})") from None

    def _collect_acks(self, block: bool) -> None:
        while self._offered and (block or self._talk(self._control.poll)):
            message = self._talk(self._control.recv)
            if message.get("kind") == "error":  # the decode side refused a request: stop here
                raise UsageError(f"PD: the decode instance refused request {message['id']}: {message['error']}")
            self._offered.pop(message["uuid"], None)

    def close(self) -> None:
        """Tells the decode side no more requests come; returns once it has pulled everything."""
        self._talk(self._control.send, dict(kind="done"))
        self._collect_acks(block=True)
        self._control.close()


def _connect(address: tuple[str, int], authkey: bytes, timeout_s: float):
    """A control connection to `address`, retried every _RETRY_S while refused, for timeout_s."""
    deadline, said = time.monotonic() + timeout_s, False
    while True:
        try:
            return Client(address, authkey=authkey)
        except (ConnectionRefusedError, FileNotFoundError, ConnectionResetError):
            if time.monotonic() >= deadline:
                raise UsageError(
                    f"--disaggregation_address: no decode instance listening at {address[0]}:{address[1]} after {timeout_s:g} s"
                    " (start one with --disaggregation_mode=decode, or raise --disaggregation_timeout_s)"
                ) from None
            if not said:
                logging.info("waiting up to %g s for the decode instance at %s:%d", timeout_s, *address)
                said = True
            time.sleep(_RETRY_S)


class KVReceiver:
    """Decode side: receives requests with their KV; the engine polls it for arrivals.

    A background thread accepts one prefill connection, pulls each request's arrays (rows into
    pinned host memory, indexer keys into device memory), acknowledges, and queues the request
    with its KV attached (Request.kv). `closed` once the prefill side said done and every
    arrival was handed out.
    """

    def __init__(
        self, address: tuple[str, int], *, rows_memory_kind: str = memory.PINNED_HOST, authkey: bytes = AUTHKEY,
        timeout_s: float = DEFAULT_TIMEOUT_S, check=None,
    ):  # fmt: skip
        """rows_memory_kind: where pulled KV rows land: pinned_host for a HiSparse decode instance
        (bound for its host pool), device for the full-KV baseline. timeout_s: how long poll()
        waits for the prefill instance to connect before it raises a UsageError. check: called on
        each arriving request before its KV is pulled (the engine's admission check); what it
        raises is sent back to the prefill side and ends the run."""
        try:
            self._listener = Listener(address, authkey=authkey)
        except OSError as error:
            raise UsageError(f"--disaggregation_address: cannot listen on {address[0]}:{address[1]}: {error.strerror or error}") from None
        self.address = self._listener.address
        self.timeout_s, self._started = timeout_s, time.monotonic()
        self.connected = threading.Event()
        self._check = check
        self._server = _start_transfer_server(address[0] if address[0] != "localhost" else _LOOPBACK)
        self._arrived: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._error: BaseException | None = None
        device = jax.local_devices()[0]
        self._host = SingleDeviceSharding(device, memory_kind=rows_memory_kind)
        self._device = SingleDeviceSharding(device, memory_kind=memory.DEVICE)
        self._pulls: list[tuple[int, float]] = []  # per request: (bytes pulled, seconds from pull() to ready)
        self._thread = threading.Thread(target=self._serve, name="kv-receiver", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            with self._listener.accept() as control:
                self.connected.set()
                connections = {}
                while True:
                    try:
                        message = control.recv()
                    except EOFError:
                        raise UsageError("PD: the prefill instance closed its connection before it sent everything") from None
                    if message["kind"] == "done":
                        break
                    request = Request(
                        message["id"], np.asarray(message["prompt"], np.int32), message["max_new_tokens"], message["eos_token_id"]
                    )  # fmt: skip
                    try:
                        if self._check is not None:
                            self._check(request)
                    except UsageError as error:
                        control.send(dict(kind="error", id=message["id"], error=str(error)))
                        raise
                    address = message["transfer_address"]
                    if address not in connections:
                        connections[address] = self._server.connect(address)
                    specs = [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d), sharding=self._host) for s, d in message["rows"]]
                    keys = message["index_keys"] + message["index_key_scales"]  # both bound for the device
                    specs += [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d), sharding=self._device) for s, d in keys]
                    started = time.perf_counter()
                    arrays = connections[address].pull(message["uuid"], specs)
                    jax.block_until_ready(arrays)
                    self._record_pull(started, arrays)
                    control.send(dict(uuid=message["uuid"]))
                    L, J = len(message["rows"]), len(message["index_keys"])
                    layout = None if message.get("row_layout") is None else KVRowLayout(*message["row_layout"])
                    kv = PrefilledKV(tuple(arrays[:L]), tuple(arrays[L : L + J]), None, tuple(arrays[L + J :]), layout)
                    self._arrived.put(dataclasses.replace(request, prefilled=kv, first_token=message["first_token"]))
        except BaseException as error:  # surfaced to the engine's thread by poll()
            if not isinstance(error, UsageError):
                logging.error("KV receiver failed: %s: %s", type(error).__name__, error)
            self._error = error
        finally:
            self._done.set()
            self._listener.close()

    def _record_pull(self, started: float, arrays) -> None:
        self._pulls.append((sum(int(a.nbytes) for a in arrays), time.perf_counter() - started))

    def handover_stats(self) -> dict:
        """The KV hand-over as the decode side saw it: requests pulled, their bytes (rows and
        index keys), the seconds from each pull() to its arrays being ready (one request at a
        time: the receiver pulls serially), and bytes over those seconds."""
        nbytes = sum(b for b, _ in self._pulls)
        seconds = sum(t for _, t in self._pulls)
        per_request = [b / t / 1e9 for b, t in self._pulls if t > 0]
        return dict(
            requests=len(self._pulls), bytes=nbytes, seconds=seconds, gb_per_s=nbytes / seconds / 1e9 if seconds else None,
            gb_per_s_per_request=dict(min=min(per_request), median=float(np.median(per_request)), max=max(per_request)) if per_request else None,
        )  # fmt: skip

    def poll(self, timeout: float | None = None) -> list[Request]:
        """Requests arrived since the last call; with a timeout, waits that long for a first one.
        Raises a UsageError once the prefill instance has not connected within timeout_s, or
        when the receiving failed (the prefill instance went away, a request was refused)."""
        if self._error is not None:
            if isinstance(self._error, UsageError):
                raise self._error
            raise UsageError(f"PD: receiving from the prefill instance failed ({type(self._error).__name__}: {self._error})")
        if not self.connected.is_set() and time.monotonic() - self._started > self.timeout_s:
            host, port = self.address
            raise UsageError(
                f"--disaggregation_address: no prefill instance connected to {host}:{port} within {self.timeout_s:g} s"
                " (start one with --disaggregation_mode=prefill, or raise --disaggregation_timeout_s)"
            )
        out = []
        try:
            out.append(self._arrived.get(timeout=timeout) if timeout else self._arrived.get_nowait())
            while True:
                out.append(self._arrived.get_nowait())
        except queue.Empty:
            pass
        return out

    @property
    def closed(self) -> bool:
        """The prefill side said done and every arrival was handed out (a failure is not closed:
        the next poll() raises it)."""
        return self._done.is_set() and self._arrived.empty() and self._error is None
