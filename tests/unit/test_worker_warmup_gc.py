"""A worker's warm-up collects nothing while it imports and loads, freezes the code it loaded (it lives
as long as the process) but not the run's data, and leaves the collector on afterwards, whether the
warm-up worked or raised. Leaving a run then collects only what is not code."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from elastictrain.worker.actor import TrainWorker


@pytest.fixture
def worker() -> Iterator[TrainWorker]:
    yield TrainWorker("w", False, in_ray=False)
    gc.unfreeze()  # this test process's objects go back to the collector's generations
    gc.enable()


def test_the_warm_up_runs_with_the_collector_off_and_freezes_the_code_once_not_the_data(
    worker: TrainWorker, monkeypatch: pytest.MonkeyPatch
):
    collecting: list[bool] = []
    kept: list[Any] = []
    frozen_at_data: list[int] = []

    def load_code(config: Any) -> None:
        collecting.append(gc.isenabled())
        kept.append([{"module": i} for i in range(1000)])

    def load_data(config: Any) -> None:
        collecting.append(gc.isenabled())
        frozen_at_data.append(gc.get_freeze_count())
        kept.append([{"sample": i} for i in range(5000)])

    monkeypatch.setattr(worker, "_load_code", load_code)
    monkeypatch.setattr(worker, "_ensure_dataset", load_data)
    frozen_before = gc.get_freeze_count()
    worker.warmup(config=None)
    assert collecting == [False, False]
    assert gc.isenabled()
    assert frozen_at_data[0] >= frozen_before + 1000, "the code is frozen before the data loads"
    assert gc.get_freeze_count() < frozen_at_data[0] + 5000, "the data is not frozen"

    worker.leave_run()
    worker.warmup(config=None, worker_id="w2")  # the next run of a warm worker: nothing frozen again
    assert gc.get_freeze_count() < frozen_at_data[0] + 1000


def test_a_warm_up_that_raises_leaves_the_collector_on(worker: TrainWorker, monkeypatch: pytest.MonkeyPatch):
    def load_code(config: Any) -> None:
        raise RuntimeError("no such model")

    monkeypatch.setattr(worker, "_load_code", load_code)
    with pytest.raises(RuntimeError, match="no such model"):
        worker.warmup(config=None)
    assert gc.isenabled()
