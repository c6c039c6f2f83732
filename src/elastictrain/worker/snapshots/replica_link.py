"""Replicas of in-memory snapshots sent straight into the buddy's process over a TCP socket.

Through Ray, a replica (an actor call carrying the snapshot's buffer) crosses the object store: the
buffer is copied into the sender node's store, read and sent by its raylet, written into the buddy
node's store by the other raylet, and copied out by the buddy: CPU taken from the steps beside it. Over
a socket the bytes are copied once into the kernel and once out of it, into the buffer the buddy keeps
(figures: docs/concepts/recovery.md, `make bench ARGS="--only memory_recovery"`).

Each worker that is sent replicas listens on its node's address (the one Ray gives it) at a port the
kernel picks, and gives that address with a secret to its peers through Ray (`replica_address`); a
connection that does not present the secret is closed unread. Where the buddy's socket cannot be
reached (a network open to Ray's ports only), the sender goes back to the Ray call (store.py).

A frame: 8 bytes (header length, data length), a JSON header (the secret, the snapshot's key, where each
tensor lies in the buffer, its fragments and scalars), the buffer's bytes; the buddy answers one byte
once the replica is held.

The same socket serves a new attempt's load (`fetch_pieces`): a frame whose header asks for pieces of a
held snapshot (`"op": "pieces"`, no data) is answered with one frame of those pieces, rather than as
an actor call's result in the object store, where a load could wait a second longer for them.
"""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

FRAME = struct.Struct("!IQ")  # header bytes, data bytes
HELD = b"\x01"
MAX_HEADER = 64 << 20  # a header this large is not a replica's: the connection is dropped


def _read_exactly(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:], len(view) - got)
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-frame")
        got += n


def _read_json(conn: socket.socket, nbytes: int) -> Any:
    raw = bytearray(nbytes)
    _read_exactly(conn, memoryview(raw))
    return json.loads(raw)


def _read_floats(conn: socket.socket, nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
    """A frame's data, read straight into `into` (where it is a float32 array of that size) or a new
    float32 array, that is the reader's to keep."""
    fits = into is not None and into.dtype == np.float32 and into.nbytes == nbytes and into.flags.c_contiguous
    data = into if fits else np.empty(nbytes // 4, dtype=np.float32)
    _read_exactly(conn, memoryview(data).cast("B"))
    return data


class ReplicaServer:
    """Listens for replicas; `on_replica(header, data, cpu_s)` keeps each one (data: a float32 numpy
    array; cpu_s: the CPU seconds its receiving took). `serve_pieces(header)` answers a load's request.
    `receive_into(header, numel)` may give the array a replica is received into (None: a new one)."""

    def __init__(
        self,
        host: str,
        on_replica: Callable[[dict[str, Any], np.ndarray, float], None],
        serve_pieces: Callable[[dict[str, Any]], tuple[dict[str, Any], list[np.ndarray]]] | None = None,
        receive_into: Callable[[dict[str, Any], int], np.ndarray | None] | None = None,
    ) -> None:
        self.secret = secrets.token_hex(16)
        self._on_replica = on_replica
        self._receive_into = receive_into or (lambda header, numel: None)
        self._serve_pieces = serve_pieces  # (the request's header) -> (the answer's header, its arrays)
        self._sock = socket.create_server((host, 0))
        self.address = {"host": host, "port": self._sock.getsockname()[1], "secret": self.secret}
        threading.Thread(target=self._accept, name="replica-server", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="replica-receive", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while self._receive_one(conn):
                    pass
            except (OSError, ValueError):  # a sender gone, or not one of ours: it reconnects or falls back
                return

    def _receive_one(self, conn: socket.socket) -> bool:
        sizes = bytearray(FRAME.size)
        try:
            _read_exactly(conn, memoryview(sizes))
        except ConnectionError:
            return False  # closed between frames
        cpu0 = time.thread_time()  # reading the sizes above mostly waited for the next frame
        header_bytes, data_bytes = FRAME.unpack(sizes)
        if header_bytes > MAX_HEADER or data_bytes % 4:
            raise ValueError(f"not a replica frame ({header_bytes} header bytes, {data_bytes} data bytes)")
        header = _read_json(conn, header_bytes)
        if not hmac.compare_digest(str(header.get("secret", "")), self.secret):
            raise ValueError("a replica frame without this worker's secret")
        if header.get("op") == "pieces":
            self._answer_pieces(conn, header, data_bytes)
            return True
        into = self._receive_into(header, data_bytes // 4)
        data = _read_floats(conn, data_bytes, into)  # the replica's own buffer: kept as received
        self._on_replica(header, data, time.thread_time() - cpu0)
        conn.sendall(HELD)
        return True

    def _answer_pieces(self, conn: socket.socket, header: dict[str, Any], data_bytes: int) -> None:
        if data_bytes or self._serve_pieces is None:
            raise ValueError("a pieces request with data, or to a worker that serves none")
        try:
            answer, arrays = self._serve_pieces(header)
        except Exception as e:  # noqa: BLE001 - said to the loader, which fails with it
            answer, arrays = {"error": f"{type(e).__name__}: {e}"}, []
        # Each piece from where the snapshot holds it: no packed copy.
        views = [memoryview(np.ascontiguousarray(a, dtype=np.float32)).cast("B") for a in arrays]
        _send_frame(conn, json.dumps(answer).encode(), *views)

    def close(self) -> None:
        self._sock.close()


class Unreachable(OSError):
    """A worker's socket cannot be connected to (not a timeout): a Ray call can still carry the bytes."""


def _send_frame(conn: socket.socket, body: bytes, *payloads: memoryview) -> None:
    """One frame: its sizes, the JSON header `body`, then the data, sent as it lies in `payloads`."""
    conn.sendall(FRAME.pack(len(body), sum(len(p) for p in payloads)))
    conn.sendall(body)
    for payload in payloads:
        conn.sendall(payload)


def _connect(address: dict[str, Any], timeout_s: float) -> socket.socket:
    """A connection to a worker's socket; Unreachable where none can be made (not a timeout)."""
    where = (address["host"], int(address["port"]))
    try:
        conn = socket.create_connection(where, timeout=timeout_s)
    except TimeoutError:
        raise  # a worker too slow to answer is treated as lost, as a Ray call would be
    except OSError as e:
        raise Unreachable(f"replica socket {where[0]}:{where[1]} not reachable: {e}") from e
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def fetch_pieces(
    address: dict[str, Any], key: list[int], keys: list[str], timeout_s: float
) -> dict[str, np.ndarray]:
    """The tensors `keys` of the snapshot `key` (attempt, world size, rank, step) held by the worker at
    `address`, each a float32 array of one buffer that is the caller's. Unreachable where the socket
    cannot be reached (the Ray call can still fetch them); another OSError or a RuntimeError (the holder
    does not hold that snapshot) otherwise."""
    body = json.dumps({"secret": address["secret"], "op": "pieces", "key": key, "keys": keys}).encode()
    with _connect(address, timeout_s) as conn:
        _send_frame(conn, body)
        sizes = bytearray(FRAME.size)
        _read_exactly(conn, memoryview(sizes))
        header_bytes, data_bytes = FRAME.unpack(sizes)
        answer = _read_json(conn, header_bytes)
        data = _read_floats(conn, data_bytes)
    if "error" in answer:
        raise RuntimeError(f"the holder did not serve snapshot {key}: {answer['error']}")
    return {k: data[off : off + n] for k, (off, n) in answer["layout"].items()}


def pieces_answer(arrays: dict[str, np.ndarray]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The answer to a pieces request: where each array lies in the frame's data, and the arrays in
    that order (sent one after another, not packed into a copy)."""
    layout, offset = {}, 0
    for name, a in arrays.items():
        layout[name], offset = [offset, int(a.size)], offset + int(a.size)
    return {"layout": layout}, list(arrays.values())


def fetch_over_sockets(
    addresses: dict[int, dict[str, Any]], keys: dict[int, Any], plan: dict[int, list[str]], timeout_s: float
) -> dict[int, dict[str, np.ndarray]]:
    """A load's pieces from each old rank's holder at once (`addresses`: rank -> socket; `keys`: rank ->
    its SnapshotKey; `plan`: rank -> the tensors wanted). The ranks whose socket cannot be reached are
    left out, for the Ray call to fetch; any other error is raised (the holder is lost)."""
    if not addresses:
        return {}

    def one(rank: int) -> dict[str, np.ndarray] | None:
        k = keys[rank]
        try:
            key = [k.attempt, k.world_size, k.rank, k.step]
            return fetch_pieces(addresses[rank], key, plan[rank], timeout_s)
        except Unreachable:
            return None

    with ThreadPoolExecutor(max_workers=len(addresses), thread_name_prefix="fetch-pieces") as pool:
        got = dict(zip(addresses, pool.map(one, addresses), strict=True))
    return {rank: arrays for rank, arrays in got.items() if arrays is not None}


class ReplicaSender:
    """One buddy's socket: `send` returns once the buddy holds the replica, or raises OSError."""

    def __init__(self, address: dict[str, Any], timeout_s: float) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._conn: socket.socket | None = None

    def send(self, header: dict[str, Any], data: np.ndarray) -> None:
        """Send one replica; retried once on a new connection where the buddy dropped an idle one (not
        after a timeout: a silent buddy is lost after one REPLICATE_TIMEOUT_S, as with the Ray call)."""
        body = json.dumps({**header, "secret": self.address["secret"]}).encode()
        payload = memoryview(np.ascontiguousarray(data, dtype=np.float32)).cast("B")
        try:
            self._send_frame(body, payload)
        except (Unreachable, TimeoutError):
            self.close()
            raise
        except OSError:
            self.close()
            try:
                self._send_frame(body, payload)
            except OSError:
                self.close()
                raise

    def _send_frame(self, body: bytes, payload: memoryview) -> None:
        conn = self._connected()
        _send_frame(conn, body, payload)
        answer = bytearray(1)
        _read_exactly(conn, memoryview(answer))
        if bytes(answer) != HELD:
            raise ConnectionError(f"the buddy answered {bytes(answer)!r}")

    def _connected(self) -> socket.socket:
        if self._conn is None:
            self._conn = _connect(self.address, self._timeout_s)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None


class BuddyLink:
    """How this worker's replicas reach its buddy in an attempt: the buddy's socket, asked for once
    (`ask_address`, through Ray), or the Ray call (`by_ray`) where that socket cannot be reached or a
    snapshot's header is not JSON. `transport` says which, and why."""

    def __init__(self, buddy: Any, ask_address: Callable[[], dict[str, Any]], timeout_s: float) -> None:
        self.buddy = buddy
        self._ask_address = ask_address
        self._timeout_s = timeout_s
        self._sender: ReplicaSender | None = None
        self.transport = "socket"

    def send(self, snapshot: Any, by_ray: Callable[[], None]) -> None:
        """Send `snapshot` (format.Snapshot); returns once the buddy holds it."""
        if self.transport == "socket":
            try:
                if self._sender is None:
                    self._sender = ReplicaSender(self._ask_address(), self._timeout_s)
                header, data = snapshot.to_frame()
                self._sender.send(header, data)
                return
            except (Unreachable, TypeError, ValueError) as e:
                self.transport = f"ray ({type(e).__name__}: {e})"
                self.close()
        by_ray()

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
