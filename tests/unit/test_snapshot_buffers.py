"""Each new in-memory snapshot is written into the buffer of the one it pushes out (a copy into a new
buffer cost 5-7 times as much, in page faults), never into one that may still be read: a load's, or a
disk checkpoint's still writing it."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from elastictrain.checkpoint import rank_snapshot
from elastictrain.core.snapshot_plan import KEEP, SLICES_HELD, slices_held, snapshots_unaffordable
from elastictrain.worker.snapshots.format import Snapshot, SnapshotKey, SnapshotStore
from elastictrain.worker.snapshots.replica_link import ReplicaSender, ReplicaServer
from elastictrain.worker.snapshots.store import WorkerMemory


def _replica(attempt: int, step: int, numel: int = 8) -> Snapshot:
    flat = torch.full((numel,), float(step))
    return Snapshot(SnapshotKey(attempt, 2, 1, step), {"w::fp32": flat}, {}, {}, flat=flat)


def test_the_replica_pushed_out_lends_its_buffer_to_the_next_one_of_the_same_attempt() -> None:
    store = SnapshotStore()
    first = _replica(1, 1)
    for step, snap in enumerate([first, _replica(1, 2), _replica(1, 3)], start=1):
        assert store.take_spare(own=False, attempt=1, numel=8) is None or step > KEEP
        store.add_replica(snap)
    assert [s.key.step for s in store.replicas] == [2, 3]  # step 1 is no longer held...
    assert store.nbytes() == 3 * 32  # ...but its buffer is kept, and counted
    spare = store.take_spare(own=False, attempt=1, numel=8)
    assert spare is first and spare.buffer is first.flat
    assert store.nbytes() == 3 * 32  # being written into: still counted
    assert store.take_spare(own=False, attempt=1, numel=8) is None  # handed out once
    store.add_replica(_replica(1, 4))
    assert store.nbytes() == 3 * 32


def test_a_spare_of_another_attempt_or_size_is_let_go_not_reused() -> None:
    store = SnapshotStore()
    for step in (1, 2, 3):
        store.add_replica(_replica(1, step))
    assert store.take_spare(own=False, attempt=2, numel=8) is None  # a load may read attempt 1's
    assert store.spares == {} and store.nbytes() == 2 * 32
    store.add_replica(_replica(1, 4))
    assert store.take_spare(own=False, attempt=1, numel=16) is None  # another slice size


def test_an_arriving_replica_is_received_into_the_buffer_the_buddy_offers() -> None:
    offered = np.zeros(12, dtype=np.float32)
    kept: list[np.ndarray] = []
    arrived = threading.Event()

    def keep(header: dict[str, Any], data: np.ndarray, cpu_s: float) -> None:
        kept.append(data)
        arrived.set()

    def offer(header: dict[str, Any], numel: int) -> np.ndarray | None:
        return offered if numel == 12 else None

    server = ReplicaServer("127.0.0.1", keep, receive_into=offer)
    sender = ReplicaSender(server.address, timeout_s=10)
    try:
        flat = torch.arange(12, dtype=torch.float32)
        snap = Snapshot(SnapshotKey(1, 2, 0, 5), {"w::fp32": flat}, {}, {}, flat=flat)
        sender.send(*snap.to_frame())
        assert arrived.wait(10)
        assert kept[0] is offered and np.array_equal(offered, flat.numpy())
    finally:
        sender.close()
        server.close()


def _buffer(copies: list[dict[str, Any]], i: int) -> torch.Tensor:
    return copies[i]["buffer"]


def _step(memory: WorkerMemory, engine: dict[str, Any], step: int) -> None:
    engine["value"] = float(step)
    memory.after_step(engine, step, True)
    memory.wait()


def test_a_worker_copies_into_three_buffers_in_turn(copies):
    memory = WorkerMemory("w")
    memory.attach(1, 2, 0, every=1, buddy=None, inline=False)
    engine: dict[str, Any] = {}
    for step in (1, 2, 3, 4, 5):
        _step(memory, engine, step)
    # Two complete and the one being copied: the fourth copy goes where the first was.
    assert len({id(c["buffer"]) for c in copies}) == KEEP + 1
    assert _buffer(copies, 3) is _buffer(copies, 0) and _buffer(copies, 4) is _buffer(copies, 1)
    assert [float(s.tensors["w::fp32"][0]) for s in memory.store.own] == [4.0, 5.0]
    memory.attach(2, 2, 0, every=1, buddy=None, inline=False)  # a new attempt: loads read attempt 1's
    _step(memory, engine, 6)
    assert all(_buffer(copies, 5) is not c["buffer"] for c in copies[:5])


def test_a_copy_waits_for_the_disk_write_of_the_snapshot_it_would_overwrite(copies):
    memory = WorkerMemory("w")
    memory.attach(1, 2, 0, every=1, buddy=None, inline=False)
    engine: dict[str, Any] = {}
    _step(memory, engine, 1)
    held = memory.for_disk()  # a checkpoint of step 1 writes its snapshot...
    assert held is not None and held[0]() is memory.store.own[-1].raw
    written = threading.Event()
    memory.lent_until(written.wait)  # ...in the background, not finished yet
    _step(memory, engine, 2)
    _step(memory, engine, 3)
    waited: list[bool] = []
    engine["before_copy"] = lambda: waited.append(written.is_set())
    threading.Timer(0.2, written.set).start()
    _step(memory, engine, 4)  # would reuse step 1's buffer: only once the write has ended
    assert waited == [True] and _buffer(copies, 3) is _buffer(copies, 0)


def test_a_snapshot_handed_to_a_write_not_known_to_have_started_is_never_overwritten(copies):
    memory = WorkerMemory("w")
    memory.attach(1, 2, 0, every=1, buddy=None, inline=False)
    engine: dict[str, Any] = {}
    _step(memory, engine, 1)
    assert memory.for_disk() is not None  # handed out; its write never reported as started
    for step in (2, 3, 4):
        _step(memory, engine, step)
    assert _buffer(copies, 3) is not _buffer(copies, 0) and float(_buffer(copies, 0)[0]) == 1.0


def test_a_checkpoints_own_copy_fits_only_beside_the_snapshots_buffers(copies, monkeypatch):
    monkeypatch.setattr(rank_snapshot, "snapshot_bytes", lambda engine: 16)
    memory = WorkerMemory("w")
    memory.attach(1, 2, 0, every=1, buddy="peer", inline=False)
    engine: dict[str, Any] = {}
    memory._buddy = None  # no replicas sent in this test; the count is a buddy's
    _step(memory, engine, 1)
    memory._buddy = "peer"
    assert memory.reserved_bytes() == SLICES_HELD * 16
    assert memory.copy_for_disk(engine, max_bytes=SLICES_HELD * 16 + 15) is None  # streams instead
    memory._buddy = None
    assert memory.reserved_bytes() == slices_held(False) * 16


def test_the_buffers_counted_are_the_ones_held_with_a_buddy_or_without():
    assert SLICES_HELD == 2 * (KEEP + 1) and slices_held(False) == KEEP + 1
    assert snapshots_unaffordable(100, 3 * 100, has_buddy=False) is None
    why = snapshots_unaffordable(100, 3 * 100)
    assert why is not None and f"{SLICES_HELD} copies of a 0 MiB slice" in why


def test_a_replica_carried_by_the_ray_call_is_copied_into_the_spare_too():
    memory = WorkerMemory("w")
    memory.hold_replica(_replica(1, 1).to_wire())
    first = memory.store.replicas[0].flat  # kept here too: a new buffer could not land at its address
    for step in (2, 3, 4):
        memory.hold_replica(_replica(1, step).to_wire())
    assert [s.key.step for s in memory.store.replicas] == [3, 4]
    fourth = memory.store.replicas[-1]
    assert fourth.flat is first and float(fourth.tensors["w::fp32"][0]) == 4.0
