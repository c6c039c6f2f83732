"""Replicas travel over a socket straight into the buddy's buffer, only to a sender that knows the
buddy's secret, and go back to the Ray call where the buddy's socket cannot be reached."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from elastictrain.checkpoint.zero_state import Fragment
from elastictrain.worker.snapshots.format import Snapshot, SnapshotKey
from elastictrain.worker.snapshots.replica_link import FRAME, BuddyLink, ReplicaSender, ReplicaServer


def _snapshot(step: int) -> Snapshot:
    flat = torch.arange(12, dtype=torch.float32) + step
    tensors = {"w::fp32": flat.narrow(0, 0, 6), "w::exp_avg": flat.narrow(0, 6, 6)}
    fragments = {"w": Fragment(0, 6, 6, (2, 3))}
    scalars = {
        "optimizer_state": {"step": {"value": float(step), "kind": "tensor", "dtype": "torch.float32"}}
    }
    return Snapshot(SnapshotKey(1, 2, 0, step), tensors, fragments, scalars, flat=flat)


class Held:
    def __init__(self) -> None:
        self.snapshots: list[Snapshot] = []
        self.arrived = threading.Event()

    def keep(self, header: dict[str, Any], data: np.ndarray, cpu_s: float) -> None:
        assert cpu_s >= 0
        self.snapshots.append(Snapshot.from_frame(header, data))
        self.arrived.set()


def test_a_replica_arrives_whole_and_the_send_returns_once_it_is_held() -> None:
    held = Held()
    server = ReplicaServer("127.0.0.1", held.keep)
    sender = ReplicaSender(server.address, timeout_s=10)
    try:
        for step in (3, 4):  # one connection, two frames
            header, data = _snapshot(step).to_frame()
            sender.send(header, data)
        assert [s.key for s in held.snapshots] == [SnapshotKey(1, 2, 0, 3), SnapshotKey(1, 2, 0, 4)]
        got = held.snapshots[-1]
        assert torch.equal(got.tensors["w::exp_avg"], _snapshot(4).tensors["w::exp_avg"])
        assert got.fragments == _snapshot(4).fragments and got.scalars == _snapshot(4).scalars
        assert got.nbytes == 48
    finally:
        sender.close()
        server.close()


def test_a_frame_without_the_buddys_secret_is_dropped_unread() -> None:
    held = Held()
    server = ReplicaServer("127.0.0.1", held.keep)
    try:
        stranger = ReplicaSender({**server.address, "secret": "guessed"}, timeout_s=5)
        header, data = _snapshot(1).to_frame()
        with pytest.raises(OSError):
            stranger.send(header, data)
        with socket.create_connection(("127.0.0.1", server.address["port"])) as raw:
            raw.sendall(FRAME.pack(1 << 30, 4))  # a header far larger than a replica's: not read
            assert raw.recv(1) == b""  # closed
        assert held.snapshots == []
    finally:
        server.close()


def test_where_the_buddys_socket_cannot_be_reached_the_ray_call_carries_the_replica() -> None:
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    by_ray: list[int] = []
    link = BuddyLink("buddy", lambda: {"host": "127.0.0.1", "port": port, "secret": "s"}, timeout_s=5)
    link.send(_snapshot(2), lambda: by_ray.append(2))
    link.send(_snapshot(3), lambda: by_ray.append(3))  # the link stays on Ray for the attempt
    assert by_ray == [2, 3]
    assert link.transport.startswith("ray (Unreachable: replica socket 127.0.0.1:")


def test_a_buddy_that_stops_answering_is_an_error_not_a_fallback() -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    address = {"host": "127.0.0.1", "port": silent.getsockname()[1], "secret": "s"}
    link = BuddyLink("buddy", lambda: address, timeout_s=0.5)
    by_ray: list[int] = []
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            link.send(_snapshot(2), lambda: by_ray.append(2))
    finally:
        silent.close()
    assert by_ray == [] and link.transport == "socket" and time.monotonic() - t0 < 5


def _holding(step: int) -> tuple[Any, dict[str, Any]]:
    """A worker's memory holding its own snapshot of `step`, and the socket that serves it."""
    from elastictrain.worker.snapshots.store import WorkerMemory

    memory = WorkerMemory("holder")
    memory.store.add_own(_snapshot(step))
    return memory, memory.replica_address("127.0.0.1")


def test_a_load_fetches_exactly_the_pieces_it_asks_for_over_the_holders_socket() -> None:
    from elastictrain.worker.snapshots.replica_link import fetch_over_sockets

    memory, address = _holding(5)
    try:
        key = SnapshotKey(1, 2, 0, 5)
        got = fetch_over_sockets({0: address}, {0: key}, {0: ["w::exp_avg"]}, timeout_s=10)
        assert list(got) == [0] and list(got[0]) == ["w::exp_avg"]
        assert np.array_equal(got[0]["w::exp_avg"], _snapshot(5).tensors["w::exp_avg"].numpy())
        assert got[0]["w::exp_avg"].flags.writeable  # the loader's own buffer: no copy needed
        both = fetch_over_sockets({0: address}, {0: key}, {0: ["w::fp32", "w::exp_avg"]}, timeout_s=10)
        assert np.array_equal(both[0]["w::fp32"], np.arange(6, dtype=np.float32) + 5)
    finally:
        memory._server.close()


def test_a_snapshot_the_holder_does_not_hold_is_an_error_naming_it() -> None:
    from elastictrain.worker.snapshots.replica_link import fetch_pieces

    memory, address = _holding(5)
    try:
        with pytest.raises(
            RuntimeError, match=r"snapshot \[1, 2, 0, 6\].*no in-memory snapshot of rank 0 at step 6"
        ):
            fetch_pieces(address, [1, 2, 0, 6], ["w::fp32"], timeout_s=10)
    finally:
        memory._server.close()


def test_an_unreachable_holder_is_left_to_the_ray_call_and_a_wrong_secret_is_refused() -> None:
    from elastictrain.worker.snapshots.replica_link import fetch_over_sockets, fetch_pieces

    memory, address = _holding(5)
    try:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            closed = {**address, "port": s.getsockname()[1]}
        key = SnapshotKey(1, 2, 0, 5)
        assert fetch_over_sockets({0: closed}, {0: key}, {0: ["w::fp32"]}, timeout_s=10) == {}
        with pytest.raises(OSError):  # dropped unread: the connection closes with no answer
            fetch_pieces({**address, "secret": "not-it"}, [1, 2, 0, 5], ["w::fp32"], timeout_s=10)
    finally:
        memory._server.close()
