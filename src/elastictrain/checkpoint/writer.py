"""One rank's checkpoint file, written from chunks of bytes, inline or in a background thread.

The chunks come from a host-memory snapshot (a private copy, so training may go on changing the live
state while this thread writes, fsyncs and hashes it) or straight from the live state
(checkpoint/rank_snapshot.py): inline, or in a thread whose end the next optimizer update waits for
(worker/snapshots/store.py). Only one write runs at a time; the controller commits the checkpoint
once every rank's write reports `done`.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from elastictrain.host.niceness import lower_this_threads_priority
from elastictrain.storage import AnyPath

# The background writer's nice value (training threads keep 0). 10 keeps the writer out of training's
# way where a write is heavier; nice 0, 10 and 19 made no measurable difference at 30M.
WRITER_NICE = 10


class ShardWrite:
    def __init__(
        self,
        path: AnyPath,
        chunks: Callable[[], Iterable[Any]],
        total: int | None = None,
        *,
        delay_s: float = 0.0,
    ) -> None:
        self.path = path
        self._delay_s = delay_s  # tests: a slow disk
        self._chunks: Callable[[], Iterable[Any]] | None = chunks
        self._total = total
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.file: dict[str, Any] | None = None
        self.error: str | None = None
        self.write_s = 0.0

    @property
    def staging_dir(self) -> str:
        return str(self.path.parent)

    def run(self) -> None:
        """Write durably in the calling thread; the result or the error is kept."""
        from elastictrain.storage import storage_of

        t0 = time.perf_counter()
        try:
            if self._delay_s > 0:
                time.sleep(self._delay_s)
            assert self._chunks is not None, "a shard is written once"
            # The storage gives a stream that is durable and whole once closed (fsynced on a local
            # disk, one completed upload on an object store) and hashes what goes through it; a
            # failure inside leaves no file behind.
            with storage_of(self.path).create(self.path) as out:
                for chunk in self._chunks():
                    out.write(chunk)
                if self._total is not None and out.size != self._total:
                    raise RuntimeError(f"{self.path}: wrote {out.size} bytes, expected {self._total}")
            self.file = {"name": self.path.name, "bytes": out.size, "sha256": out.sha256}
        except Exception as e:  # noqa: BLE001 - reported to the controller, which decides
            self.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        finally:
            self._chunks = None  # the snapshot's memory goes with the last reference to it
            self.write_s = time.perf_counter() - t0
            self._done.set()

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self.run_niced, name=f"shard-write-{self.path.name}", daemon=True
        )
        self._thread.start()

    def run_niced(self) -> None:
        """`run` at the writer's nice value (for the calling thread alone)."""
        # Hashing and copying into the page cache take CPU from the training step that runs meanwhile:
        # on Linux a thread has its own nice value, so the writer yields the cores to training.
        lower_this_threads_priority(WRITER_NICE)
        self.run()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)

    def report(self) -> dict[str, Any]:
        """What the controller needs: the staging folder and `writing`, `done` (with the file) or `error`."""
        state = "writing" if not self._done.is_set() else ("error" if self.error else "done")
        out: dict[str, Any] = {"staging": self.staging_dir, "state": state, "write_s": self.write_s}
        if state == "done":
            out["file"] = self.file
        elif state == "error":
            out["error"] = self.error
        return out
