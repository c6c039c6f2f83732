"""A probe's copy (worker/memory.py): taken at the next step's update instead of beside its forward and
backward, which then run with no copy beside them; and copies go into the buffers of dropped ones."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from elastictrain.checkpoint import rank_snapshot
from elastictrain.checkpoint.rank_snapshot import Snapshot as RankSnapshot
from elastictrain.worker.memory import WorkerMemory


class Plan:
    def __init__(self, numel: int) -> None:
        self.numel, self.data_bytes = numel, numel * 4
        self.keys = {"w::fp32": (0, numel)}
        self.pieces: list[Any] = []


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Each copy the worker takes: the engine's value then, the thread it ran on, its buffer."""
    taken: list[dict[str, Any]] = []

    def take_snapshot(engine: Any, max_bytes: float, found: Any, spare: Any) -> RankSnapshot:
        found.plan = Plan(4)
        buffer = spare(4, False)
        reused = buffer is not None
        buffer = buffer if reused else torch.empty(4)
        buffer.fill_(engine["value"])
        taken.append({"value": engine["value"], "thread": threading.current_thread().name, "reused": reused})
        return RankSnapshot(found.plan, buffer, {})  # type: ignore[arg-type]

    monkeypatch.setattr(rank_snapshot, "take_snapshot", take_snapshot)
    return taken


def test_a_probes_copy_waits_for_the_next_update_and_takes_the_state_before_it(copies):
    memory = WorkerMemory("w")
    memory.attach(1, 2, 0, every=1, buddy=None, inline=False)
    engine = {"value": 1.0}
    memory.after_step(engine, 1, True)  # the attempt's first copy (it measures the slice): beside
    memory.wait()
    engine["value"] = 2.0  # step 2's update
    memory.after_step(engine, 2, True, probe=True)
    memory.wait()
    assert [c["value"] for c in copies] == [1.0], "a probe's copy does not start after its step"
    assert memory.for_disk() is None  # not started: a checkpoint would copy for itself (never a probe's step)
    # Step 3 runs its forward and backward with nothing beside them; its update first takes the copy.
    memory.before_update()
    assert [c["value"] for c in copies] == [1.0, 2.0]  # the state after step 2, before step 3's update
    memory.wait()
    assert [s.key.step for s in memory.store.own] == [1, 2]
    assert memory.pop_update_wait() > 0.0  # the update waited for it: the probe's cost


def test_a_probes_copy_not_yet_taken_is_taken_when_a_grow_asks_for_the_last_step(copies):
    memory = WorkerMemory("w")
    memory.attach(1, 2, 0, every=1, buddy=None, inline=False)
    engine = {"value": 1.0}
    memory.after_step(engine, 1, True)
    memory.wait()
    engine["value"] = 2.0
    memory.after_step(engine, 2, True, probe=True)
    held = memory.snapshot_last_step(engine)  # the controller grows at this step: it must be held
    assert held["held"] and held["step"] == 2 and [c["value"] for c in copies] == [1.0, 2.0]
    memory.before_update()  # the next attempt's first update: nothing deferred any more
    assert len(copies) == 2


def test_a_copy_goes_into_the_buffer_of_the_snapshot_dropped_two_copies_before(copies):
    memory = WorkerMemory("w")
    memory.attach(1, 2, 0, every=1, buddy=None, inline=False)
    for step in range(1, 6):
        memory.after_step({"value": float(step)}, step, True)
        memory.wait()
    assert [c["reused"] for c in copies] == [False, False, False, True, True]
    assert [float(s.raw.buffer[0]) for s in memory.store.own] == [4.0, 5.0]


def test_a_copy_lent_to_a_checkpoint_write_is_never_copied_into_again(copies):
    memory = WorkerMemory("w")
    memory.attach(1, 2, 0, every=1, buddy=None, inline=False)
    memory.after_step({"value": 1.0}, 1, True)
    memory.wait()
    written = memory.for_disk()  # a checkpoint of step 1 writes this copy in the background
    assert written is not None
    raw = written[0]()
    for step in range(2, 6):
        memory.after_step({"value": float(step)}, step, True)
        memory.wait()
    assert float(raw.buffer[0]) == 1.0  # still step 1's bytes while the write may be reading them
    assert [c["reused"] for c in copies] == [False, False, False, False, True]  # step 2's buffer, at 5
