"""One rank's checkpoint file, written from a host-memory snapshot, inline or in a background thread.

The snapshot is a private copy of the rank's fragments, so training may go on changing the live state
while this thread serializes, writes, fsyncs and hashes the copy. Only one write runs at a time; the
controller commits the checkpoint once every rank's write reports `done`.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any

from elastictrain.storage import AnyPath


class ShardWrite:
    def __init__(
        self, path: AnyPath, tensors: dict[str, Any], metadata: dict[str, str], *, delay_s: float = 0.0
    ) -> None:
        self.path = path
        self._delay_s = delay_s  # tests: a slow disk
        self._tensors: dict[str, Any] | None = tensors
        self._metadata = metadata
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.file: dict[str, Any] | None = None
        self.error: str | None = None
        self.write_s = 0.0

    @property
    def staging_dir(self) -> str:
        return str(self.path.parent)

    def run(self) -> None:
        """Serialize and write durably in the calling thread; the result or the error is kept."""
        from safetensors.torch import save as save_safetensors

        from elastictrain.storage import storage_of

        t0 = time.perf_counter()
        try:
            if self._delay_s > 0:
                time.sleep(self._delay_s)
            assert self._tensors is not None, "a shard is written once"
            data = save_safetensors(self._tensors, metadata=self._metadata)
            self._tensors = None  # the snapshot's memory goes as soon as it is serialized
            # The storage gives a stream that is durable and whole once closed (fsynced on a local
            # disk, one completed upload on an object store) and hashes what goes through it.
            with storage_of(self.path).create(self.path) as out:
                out.write(data)
            self.file = {"name": self.path.name, "bytes": out.size, "sha256": out.sha256}
        except Exception as e:  # noqa: BLE001 - reported to the controller, which decides
            self.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        finally:
            self._tensors = None
            self.write_s = time.perf_counter() - t0
            self._done.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"shard-write-{self.path.name}", daemon=True)
        self._thread.start()

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
