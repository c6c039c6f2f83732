"""A run's end parks every whole reservation it took from the warm pool (cluster/worker_group.py), also
one it used only part of: a replica of 2 that a run of one-rank replicas took keeps both of its warm
workers for the next run, whether the second never started or was still loading the run's data.

Real Ray (the shared local cluster), real placement groups and actors; the actors only answer what the
worker group asks (no model, no training), and the test has a pool of its own, so the warm workers the
suite's runs parked stay where they are.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from elastictrain.cluster import warm_pool
from elastictrain.cluster.worker_group import WorkerGroup
from elastictrain.cluster.worker_resources import WorkerResources

pytestmark = pytest.mark.integration


class AnsweringWorker:
    """What the worker group asks of a worker at its start and at a run's end, and nothing else."""

    def __init__(self, worker_id: str, use_gpu: bool) -> None:
        self.worker_id = worker_id

    def warmup(self, config: dict[str, Any], worker_id: str | None = None) -> dict[str, Any]:
        import ray

        self.worker_id = worker_id or self.worker_id
        time.sleep(config.get(self.worker_id, 0.0))  # a run's data, loading
        return {"worker_id": self.worker_id, "actor_id": ray.get_runtime_context().get_actor_id()}

    def leave_run(self) -> dict[str, float]:
        return {"leave_run_s": 0.0}


@pytest.fixture
def own_pool(ray_local: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import ray

    # The suite's parked workers may hold every CPU (their reservations): they are then given back to
    # make room for this test's two hundredths of a CPU (the next run starts its workers cold).
    def short_of_cpu() -> bool:
        return ray.available_resources().get("CPU", 0) < 0.02

    if short_of_cpu():
        warm_pool.release_all()
        deadline = time.monotonic() + 30  # reservations are removed in the background
        while short_of_cpu() and time.monotonic() < deadline:
            time.sleep(0.2)
    monkeypatch.setattr(warm_pool, "_pool", warm_pool._Pool())
    yield
    warm_pool.release_all()


def _group(name: str, ranks_per_replica: int) -> WorkerGroup:
    # A hundredth of a CPU each: they fit beside the suite's parked workers unless those hold every CPU.
    resources = WorkerResources(False, 0.01, 0, ranks_per_reservation=ranks_per_replica)
    return WorkerGroup(resources, name_prefix=name, keep_warm_s=60, worker_class=AnsweringWorker)


def _start(group: WorkerGroup, wanted: int, started: int, config: dict[str, Any]) -> list[Any]:
    group.request(wanted)
    assert group.wait_for_reservations(wanted, timeout_s=60) >= wanted
    return group.start_workers(started, config)


def _parked_actor_ids() -> set[str]:
    return {a._actor_id.hex() for a in warm_pool.parked_actors()}


def _parked_replica_of_2() -> set[str]:
    """A run of one replica of 2 ends: its two workers are parked; their actor ids."""
    replica = _group("tp", 2)
    _start(replica, 2, 2, {})
    assert len(replica.poll_warm(timeout_s=60, n=2)) == 2
    replica.shutdown()
    parked = _parked_actor_ids()
    assert len(parked) == 2
    return parked


def test_a_run_of_one_rank_replicas_parks_a_replica_of_2_whole_with_a_bundle_it_never_started(own_pool):
    first = _parked_replica_of_2()

    single = _group("dp", 1)
    started = _start(single, 1, 1, {})  # the replica's two bundles are two slots: one is started
    assert len(started) == 1 and len(single.pending) == 1
    assert len(single.poll_warm(timeout_s=60, n=1)) == 1
    single.shutdown()
    assert _parked_actor_ids() == first


def test_a_reused_spare_still_loading_the_runs_data_at_its_end_is_parked_with_its_replica(own_pool):
    first = _parked_replica_of_2()

    single = _group("dp", 1)
    started = _start(single, 2, 2, {"dp-w1": 3.0})  # the second loads its data for 3 s
    assert len(single.poll_warm(timeout_s=60, n=1)) == 1 and sorted(w.warm for w in started) == [False, True]
    single.shutdown()  # before the spare finished loading
    assert _parked_actor_ids() == first
