"""The actor methods a worker answers about in-memory snapshots: for its peers (the `replica` concurrency
group: holding a buddy's replica, serving pieces of what it holds) and for the controller."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastictrain.core.snapshot_plan import SnapshotKey
from elastictrain.worker.ray_calls import call_peers
from elastictrain.worker.snapshots.store import WorkerMemory


class SnapshotPeer:
    """Actor methods a worker answers for its peers (replica group) and the controller (control group)."""

    memory: WorkerMemory
    engine: Any

    if TYPE_CHECKING:  # the worker's own

        def info(self) -> dict[str, Any]: ...

    def hold_replica(self, wire: dict[str, Any]) -> None:
        """Keep a buddy's snapshot (sent after each of its copies)."""
        self.memory.hold_replica(wire)

    def replica_address(self) -> dict[str, Any]:
        """Where the worker this one backs up sends its replicas (a socket on this node's address)."""
        return self.memory.replica_address(self.info()["node_ip"])

    def snapshot_meta(self, key: SnapshotKey) -> dict[str, Any]:
        """What a loader reads first, and the socket that serves the snapshot's pieces (`address`)."""
        return {**self.memory.meta(key), "address": self.replica_address()}

    def snapshot_pieces(self, key: SnapshotKey, keys: list[str]) -> dict[str, Any]:
        return self.memory.pieces(key, keys)

    def hand_off_snapshots(self, target: Any) -> int:
        """This worker is replaced (stuck in a collective): send what it holds to `target` first."""
        snaps = self.memory.store.all()
        call_peers((target, "keep_handed", (s.to_wire(),)) for s in snaps)
        return len(snaps)

    def keep_handed(self, wire: dict[str, Any]) -> None:
        from elastictrain.worker.snapshots.format import Snapshot  # imports torch (worker/snapshots/store.py)

        self.memory.store.add_handed(Snapshot.from_wire(wire))

    def snapshot_now(self) -> dict[str, Any]:
        """Copy the state after the last step to memory, unless that copy was started, and replicate it
        (the controller grows at this step: the new attempt loads it). Runs between steps."""
        return self.memory.snapshot_last_step(self.engine)

    def memory_holdings(self) -> list[dict[str, Any]]:
        """Every complete snapshot this worker holds: its own rank's and its buddy's."""
        return self.memory.store.holdings()
