"""A worker's warm-up collects nothing while it imports and loads (all of it lives as long as the actor),
freezes what it made, and leaves the collector on afterwards, whether the warm-up worked or raised."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from elastictrain.worker.actor import TrainWorker


@pytest.fixture
def worker() -> Iterator[TrainWorker]:
    was_enabled = gc.isenabled()
    yield TrainWorker("w", False, in_ray=False)
    gc.unfreeze()  # this test process's objects go back to the collector's generations
    if was_enabled:
        gc.enable()


def test_the_warm_up_runs_with_the_collector_off_and_freezes_what_it_made(
    worker: TrainWorker, monkeypatch: pytest.MonkeyPatch
):
    seen: list[bool] = []
    made: list[Any] = []

    def warm_up(config: Any) -> None:
        seen.append(gc.isenabled())
        made.append([{"a": i} for i in range(1000)])

    monkeypatch.setattr(worker, "_warm_up", warm_up)
    frozen_before = gc.get_freeze_count()
    worker.warmup(config=None)
    assert seen == [False]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen_before + 1000


def test_a_warm_up_that_raises_leaves_the_collector_on(worker: TrainWorker, monkeypatch: pytest.MonkeyPatch):
    def warm_up(config: Any) -> None:
        raise RuntimeError("no such model")

    monkeypatch.setattr(worker, "_warm_up", warm_up)
    with pytest.raises(RuntimeError, match="no such model"):
        worker.warmup(config=None)
    assert gc.isenabled()
