"""One rank's part of a checkpoint: a host snapshot to write later, or the file streamed from the live state.

Shared by the worker actor (worker/actor.py) and the benchmarks, so both run the same save.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from elastictrain.checkpoint.rank_snapshot import (
    RankFilePlan,
    Snapshot,
    Walked,
    scalars_now,
    stream_chunks,
    take_snapshot,
)
from elastictrain.checkpoint.swap_stream import SwapFileStream
from elastictrain.checkpoint.writer import ShardWrite
from elastictrain.checkpoint.zero_state import fragments_of, rank_file
from elastictrain.storage import AnyPath, as_path


def prepare_rank_write(
    engine: Any,
    folder: AnyPath,
    rank: int,
    world_size: int,
    *,
    snapshot: bool,
    max_snapshot_bytes: float = float("inf"),
    delay_s: float = 0.0,
    held: tuple[Callable[[], Snapshot | None], dict[str, Any] | None] | None = None,
    stream_later: bool = False,
    from_swap: SwapFileStream | None = None,
) -> tuple[ShardWrite, dict[str, Any]]:
    """With `snapshot`, copy the state to host memory (when it fits `max_snapshot_bytes`) and return
    a write not yet started: the caller runs it now or in a thread. Otherwise, or when it does not fit,
    stream the file from the live state before returning (the write is done, or holds its error); with
    `stream_later`, that write is returned not yet run: the caller runs it while the state stays as it is
    (its scalars are read now). With `from_swap` (state on NVMe), that write reads the swap files
    (checkpoint/swap_stream.py), also returned not yet run.
    With `held` (the in-memory snapshot of this very state, being copied or done: a function that waits
    for it, and its scalars if known) and `snapshot`, nothing is copied: the write waits for that copy.

    Returns the write and {"name", "engine_state" (the scalars), "mode": "snapshot" | "streamed"}.
    """
    path = as_path(folder) / rank_file(rank, world_size, {})[0]

    def metadata_for(plan: RankFilePlan) -> dict[str, str]:
        return rank_file(rank, world_size, fragments_of(plan.pieces))[1]

    if from_swap is not None:
        metadata = metadata_for(from_swap.plan)
        total = len(from_swap.plan.header(metadata)) + from_swap.plan.data_bytes
        write = ShardWrite(path, lambda: from_swap.chunks(metadata), total, delay_s=delay_s)
        return write, {"name": path.name, "engine_state": from_swap.scalars, "mode": "streamed"}

    if snapshot and held is not None:
        ready, scalars = held

        def from_memory() -> Iterator[Any]:
            snap = ready()
            if snap is None:
                raise RuntimeError("the in-memory copy of this step failed: no state to write")
            yield from snap.chunks(metadata_for(snap.plan))

        write = ShardWrite(path, from_memory, delay_s=delay_s)
        engine_state = scalars if scalars is not None else scalars_now(engine)
        return write, {"name": path.name, "engine_state": engine_state, "mode": "snapshot", "memory": True}

    snap = take_snapshot(engine, max_bytes=max_snapshot_bytes) if snapshot else None
    if snap is not None:
        metadata = metadata_for(snap.plan)
        chunks = snap.chunks  # the write holds the buffer until it has written it, then drops it
        total = len(snap.plan.header(metadata)) + snap.plan.data_bytes
        write = ShardWrite(path, lambda: chunks(metadata), total, delay_s=delay_s)
        return write, {"name": path.name, "engine_state": snap.scalars, "mode": "snapshot"}
    walked = Walked()
    write = ShardWrite(path, lambda: stream_chunks(engine, metadata_for, walked), delay_s=delay_s)
    if stream_later:
        return write, {"name": path.name, "engine_state": scalars_now(engine), "mode": "streamed"}
    write.run()
    return write, {"name": path.name, "engine_state": walked.scalars, "mode": "streamed"}
