"""The actor methods that write a rank's checkpoint file: now, or beside the next step, and how it goes.

A mixin of the worker (worker/actor.py): it reads the attempt's spec, engine, in-memory snapshots and
progress marks the worker keeps.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from elastictrain.host.memory import snapshot_budget_bytes
from elastictrain.storage import as_path


class ShardSaves:
    spec: Any
    engine: Any
    memory: Any
    built_model: dict[str, Any] | None
    _writer: Any
    _write_delay_s: float
    _idle_since: float

    if TYPE_CHECKING:  # the worker's own

        def _set_mark(self, phase: str, step: int) -> None: ...

    def save_shard(self, staging_dir: str, background: bool = False) -> dict[str, Any]:
        """Write this rank's fragments durably into the staging folder.

        With `background`, the state is copied to host memory beside the next step's forward and backward
        (its update waits for the copy; with state on NVMe the copy is taken here), then written in a
        thread while training goes on; the outcome comes back in the next `train_step` results (or from
        `save_status`). A copy larger than the host memory checkpoints may use
        (`checkpoint.max_host_memory_mb`) is not made: the file is streamed from the live state group by
        group beside the next step's forward and backward, and its update waits for the write (with
        state on NVMe, read from its swap files instead: checkpoint/swap_stream.py). Every save without
        `background` is streamed here.
        """
        from elastictrain.checkpoint.rank_save import prepare_rank_write
        from elastictrain.checkpoint.swap_stream import swap_file_stream

        spec, engine = self.spec, self.engine
        assert spec is not None and engine is not None, "save_shard before setup"
        self._join_writer()  # one snapshot in host memory at a time
        waited = time.time() - self._idle_since
        t0 = time.perf_counter()
        self._set_mark("save", spec.start_step)
        budget = snapshot_budget_bytes(spec.config.checkpoint.max_host_memory_mb, spec.ranks_on_node)
        # This step's in-memory snapshot if one was taken, else a copy beside the next step's compute.
        held = (self.memory.for_disk() or self.memory.copy_for_disk(engine, budget)) if background else None
        swapped, missing = self.memory.copies_inline, background and held is None
        from_swap = swap_file_stream(engine, larger_than=budget) if missing and swapped else None
        beside_step = missing and (from_swap is not None or not swapped)
        write, out = prepare_rank_write(
            engine,
            as_path(staging_dir),
            spec.rank,
            spec.world_size,
            snapshot=background and not beside_step,  # beside the step: known not to fit a copy
            max_snapshot_bytes=budget,
            delay_s=self._write_delay_s,
            held=held,
            stream_later=beside_step,
            from_swap=from_swap,
        )
        if write.error:
            raise RuntimeError(write.error)
        out["snapshot_s"] = time.perf_counter() - t0
        mode = out["mode"]
        if mode == "streamed" and beside_step:
            self._writer = write
            self.memory.hold_updates_for(engine, write.run_niced)
            out["beside_step"] = True
        elif mode == "snapshot" and background:
            self._writer = write
            write.start()
            if out.get("memory"):  # it writes an in-memory snapshot: whose buffer waits for it
                self.memory.lent_until(write.wait)
        else:
            out["file"] = write.file
        self._set_mark("saved", spec.start_step)
        if spec.rank == 0:  # the manifest's record of the model as built
            out["model"] = self.built_model
        out["save_s"] = time.perf_counter() - t0
        out["waited_s"] = waited
        self._idle_since = time.time()
        return out

    def save_status(self, staging_dir: str, wait_s: float = 0.0) -> dict[str, Any]:
        """The background write into `staging_dir`: `writing`, `done` or `error` (waits up to wait_s)."""
        write = self._writer
        if write is None or write.staging_dir != staging_dir:
            return {"staging": staging_dir, "state": "error", "error": "no such write on this worker"}
        write.wait(wait_s)
        return write.report()

    def _join_writer(self) -> None:
        """Let a background write end before its snapshot or staging folder may be reused."""
        if self._writer is not None:
            self._writer.wait()
