"""Fixtures shared by the unit tests of the worker's in-memory snapshots."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from elastictrain.checkpoint import rank_snapshot
from elastictrain.checkpoint.rank_snapshot import Snapshot as RankSnapshot


class _Plan:
    def __init__(self, numel: int) -> None:
        self.numel, self.data_bytes = numel, numel * 4
        self.keys = {"w::fp32": (0, numel)}
        self.pieces: list[Any] = []


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Each copy of the state a WorkerMemory takes, in order, with a fake engine ({"value": v}, and
    optionally "before_copy": a call made once the copy has its buffer): the value copied, the thread
    it ran on, and the buffer it was written into."""
    taken: list[dict[str, Any]] = []

    def take_snapshot(engine: Any, max_bytes: float, found: Any, into: Any = None) -> RankSnapshot:
        found.plan = _Plan(4)
        buffer = into if into is not None else torch.empty(4)
        engine.get("before_copy", lambda: None)()
        buffer.fill_(engine["value"])
        taken.append({"value": engine["value"], "thread": threading.current_thread().name, "buffer": buffer})
        return RankSnapshot(found.plan, buffer, {})  # type: ignore[arg-type]

    monkeypatch.setattr(rank_snapshot, "take_snapshot", take_snapshot)
    return taken
