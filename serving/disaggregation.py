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
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from multiprocessing.connection import Client, Listener

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from hisparse_jax import memory
from models.dsa.runner import PrefilledKV
from serving.errors import UsageError
from serving.workload import Request

AUTHKEY = b"hisparse-pd"  # loopback and trusted networks only: both processes share it
_LOOPBACK = "127.0.0.1"


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

    def __init__(self, decode_address: tuple[str, int], *, authkey: bytes = AUTHKEY):
        self._server = _start_transfer_server(decode_address[0] if decode_address[0] != "localhost" else _LOOPBACK)
        self._control = Client(decode_address, authkey=authkey)
        self._uuids = itertools.count(1)
        self._offered: dict[int, list[jax.Array]] = {}  # kept alive until the decode side pulled them

    def send(self, request: Request, kv: PrefilledKV, first_token: int) -> None:
        uuid = next(self._uuids)
        arrays = [*kv.rows, *kv.index_keys, *kv.index_key_scales]
        self._server.await_pull(uuid, arrays)
        self._offered[uuid] = arrays
        self._control.send(
            dict(
                kind="request", uuid=uuid, transfer_address=self._server.address(),
                id=int(request.id), prompt=np.asarray(request.prompt, np.int32).tolist(),
                max_new_tokens=int(request.max_new_tokens), eos_token_id=request.eos_token_id,
                first_token=int(first_token),
                rows=[(list(a.shape), a.dtype.name) for a in kv.rows],
                index_keys=[(list(a.shape), a.dtype.name) for a in kv.index_keys],
                index_key_scales=[(list(a.shape), a.dtype.name) for a in kv.index_key_scales],
            )  # fmt: skip
        )
        self._collect_acks(block=False)

    def _collect_acks(self, block: bool) -> None:
        while self._offered and (block or self._control.poll()):
            message = self._control.recv()
            self._offered.pop(message["uuid"], None)

    def close(self) -> None:
        """Tells the decode side no more requests come; returns once it has pulled everything."""
        self._control.send(dict(kind="done"))
        self._collect_acks(block=True)
        self._control.close()


class KVReceiver:
    """Decode side: receives requests with their KV; the engine polls it for arrivals.

    A background thread accepts one prefill connection, pulls each request's arrays (rows into
    pinned host memory, indexer keys into device memory), acknowledges, and queues the request
    with its KV attached (Request.kv). `closed` once the prefill side said done and every
    arrival was handed out.
    """

    def __init__(self, address: tuple[str, int], *, rows_memory_kind: str = memory.PINNED_HOST, authkey: bytes = AUTHKEY):
        """rows_memory_kind: where pulled KV rows land: pinned_host for a HiSparse decode instance
        (bound for its host pool), device for the full-KV baseline."""
        self._listener = Listener(address, authkey=authkey)
        self.address = self._listener.address
        self._server = _start_transfer_server(address[0] if address[0] != "localhost" else _LOOPBACK)
        self._arrived: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._error: BaseException | None = None
        device = jax.local_devices()[0]
        self._host = SingleDeviceSharding(device, memory_kind=rows_memory_kind)
        self._device = SingleDeviceSharding(device, memory_kind=memory.DEVICE)
        self._thread = threading.Thread(target=self._serve, name="kv-receiver", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            with self._listener.accept() as control:
                connections = {}
                while True:
                    message = control.recv()
                    if message["kind"] == "done":
                        break
                    address = message["transfer_address"]
                    if address not in connections:
                        connections[address] = self._server.connect(address)
                    specs = [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d), sharding=self._host) for s, d in message["rows"]]
                    keys = message["index_keys"] + message["index_key_scales"]  # both bound for the device
                    specs += [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d), sharding=self._device) for s, d in keys]
                    arrays = connections[address].pull(message["uuid"], specs)
                    jax.block_until_ready(arrays)
                    control.send(dict(uuid=message["uuid"]))
                    L, J = len(message["rows"]), len(message["index_keys"])
                    kv = PrefilledKV(tuple(arrays[:L]), tuple(arrays[L : L + J]), None, tuple(arrays[L + J :]))
                    request = Request(
                        message["id"], np.asarray(message["prompt"], np.int32), message["max_new_tokens"],
                        message["eos_token_id"], prefilled=kv, first_token=message["first_token"],
                    )  # fmt: skip
                    self._arrived.put(request)
        except BaseException as error:  # surfaced to the engine's thread by poll()
            logging.exception("KV receiver failed")
            self._error = error
        finally:
            self._done.set()
            self._listener.close()

    def poll(self, timeout: float | None = None) -> list[Request]:
        """Requests arrived since the last call; with a timeout, waits that long for a first one."""
        if self._error is not None:
            raise RuntimeError(f"KV receiver failed: {self._error}") from self._error
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
        return self._done.is_set() and self._arrived.empty()
