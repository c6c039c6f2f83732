"""The fake worker group's parts: one fake worker, its background write, and a scripted fault."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENOSPC = "OSError: [Errno 28] No space left on device"


class FakeDied(Exception):
    """Raised inside a fake call: the worker's process dies."""


class FakeKilledForMemory(Exception):
    """Raised inside a fake call: Ray's memory monitor kills the worker's process."""


class FakeHung(Exception):
    """Raised inside a fake call: the worker stops answering."""


@dataclass
class FakeWrite:
    staging: str
    name: str
    rank: int
    state: str = "writing"  # writing, done, error
    error: str = ""
    hangs: bool = False
    drop: bool = False
    file: dict[str, Any] | None = None

    def finish(self) -> None:
        """The background write ends (unless scripted to hang)."""
        if self.state != "writing" or self.hangs:
            return
        if self.error:
            self.state = "error"
            return
        data = f"{self.name} of {self.staging}".encode()
        path = Path(self.staging) / self.name
        if not self.drop:
            path.write_bytes(data)
        self.file = {"name": self.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        self.state = "done"

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"staging": self.staging, "state": self.state, "write_s": 0.0}
        if self.state == "done":
            out["file"] = self.file
        elif self.state == "error":
            out["error"] = self.error
        return out


@dataclass
class FakeWorker:
    worker_id: str
    node_id: str
    warm: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    dead: bool = False
    hung: bool = False
    spec: Any = None
    writer: FakeWrite | None = None
    step: int = -1
    calls: list[str] = field(default_factory=list)  # every method called, in order
    polls: int = 0  # looks at its warm-up so far
    own: list[dict[str, Any]] = field(default_factory=list)  # in-memory snapshots, as memory_holdings says
    replicas: list[dict[str, Any]] = field(default_factory=list)

    @property
    def actor(self) -> FakeWorker:  # what a buddy is reached through
        return self

    @property
    def actor_id(self) -> str:
        return f"actor-{self.worker_id}"

    def __hash__(self) -> int:
        return hash(self.worker_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeWorker) and other.worker_id == self.worker_id


@dataclass
class FakeFault:
    kind: str  # die, hang, raise (at a step); write_error, save_hangs, drop_file (at the next write)
    rank: int
    step: int = -1
    detail: str = ""
