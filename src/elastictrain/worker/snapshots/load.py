"""A new attempt's load from in-memory snapshots: each old rank's fragments from whoever holds them.

The holders are this worker (its own rank's snapshot, or its buddy's replica) and its peers. A peer is
asked for what its snapshot holds (`snapshot_meta`, a Ray call: small), then for the pieces this rank's
slices need, over the peer's socket (replica_link.py) where it has one, by a Ray call otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from elastictrain.worker.attempt import MemorySource
from elastictrain.worker.ray_calls import REPLICATE_TIMEOUT_S, call_peers
from elastictrain.worker.snapshots.format import MemoryReader, SnapshotKey, keys_to_fetch
from elastictrain.worker.snapshots.replica_link import fetch_over_sockets


class SnapshotHolder(Protocol):
    """What a loading worker holds itself (worker/memory.WorkerMemory): asked without a call."""

    worker_id: str

    def meta(self, key: SnapshotKey) -> dict[str, Any]: ...

    def pieces(self, key: SnapshotKey, keys: list[str]) -> dict[str, Any]: ...


def load_from_holders(memory: SnapshotHolder, engine: Any, source: MemorySource) -> float:
    """Fill `engine`'s slices from the snapshots of `source`; the seconds spent asking their holders."""
    import torch

    from elastictrain.checkpoint.zero_layouts import FlatPartitionLayout, layout_for
    from elastictrain.checkpoint.zero_state import load_local_state

    t0 = time.perf_counter()
    keys = {r: SnapshotKey(source.attempt, source.world_size, r, source.step) for r in source.holders}
    metas = _ask_all(memory, source, "snapshot_meta", lambda r: (keys[r],), memory.meta)
    addresses = {r: meta.pop("address", None) for r, meta in metas.items()}  # peers' sockets
    layout = layout_for(engine)
    wanted = [(p.name, p.start, p.length) for p in layout.load_slices()]
    plan = keys_to_fetch(metas, wanted, full_fp32=isinstance(layout, FlatPartitionLayout))
    by_socket = {r: addresses[r] for r in plan if addresses.get(r) is not None}
    received = fetch_over_sockets(by_socket, keys, plan, REPLICATE_TIMEOUT_S)
    others = sorted(set(plan) - set(received))  # this worker's own, and peers whose socket is unreachable
    asked = _ask_all(memory, source, "snapshot_pieces", lambda r: (keys[r], plan[r]), memory.pieces, others)
    fetch_s = time.perf_counter() - t0
    # Received arrays are this worker's; the others view its own snapshots or Ray's read-only store.
    tensors = {r: {k: torch.from_numpy(a) for k, a in arrays.items()} for r, arrays in received.items()}
    for r, arrays in asked.items():
        tensors[r] = {k: torch.from_numpy(a.copy()) for k, a in arrays.items()}
    load_local_state(engine, MemoryReader(metas, tensors), metas[min(metas)]["scalars"])
    return fetch_s


def _ask_all(
    memory: SnapshotHolder,
    source: MemorySource,
    method: str,
    args: Callable[[int], tuple[Any, ...]],
    local: Callable[..., Any],
    ranks: list[int] | None = None,
) -> dict[int, Any]:
    """One call per old rank, to its holder (all at once), or locally when this worker holds it."""
    out: dict[int, Any] = {}
    remote: list[int] = []
    for r in source.holders if ranks is None else ranks:
        worker_id, _ = source.holders[r]
        if worker_id == memory.worker_id:
            out[r] = local(*args(r))
        else:
            remote.append(r)
    answers = call_peers((source.holders[r][1], method, args(r)) for r in remote)
    out.update(zip(remote, answers, strict=True))
    return out
