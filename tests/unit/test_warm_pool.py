"""The pool of warm workers a finished run parks (cluster/warm_pool.py): who may take them, and when
they are given back. Ray's part (killing actors, removing reservations) is replaced by a record."""

from __future__ import annotations

import time

import pytest

from elastictrain.cluster import warm_pool
from elastictrain.cluster.warm_pool import ParkedReservation


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    given_back: list[str] = []
    monkeypatch.setattr(warm_pool, "_cluster", lambda: ("gcs", "job"))
    monkeypatch.setattr(warm_pool, "_release", lambda rs: given_back.extend(r.pg for r in rs))
    warm_pool._pool.parked.clear()
    warm_pool._pool.key = None
    yield given_back
    warm_pool.release_all()


def _parked(name: str, workers: int = 1) -> ParkedReservation:
    return ParkedReservation(name, None, {b: f"{name}-actor{b}" for b in range(workers)}, cpus=workers)  # type: ignore[arg-type]


def test_a_run_asking_alike_takes_what_it_needs_and_leaves_the_rest_parked(released):
    key = warm_pool.pool_key("1 CPU", ())
    warm_pool.park(key, [_parked("a"), _parked("b"), _parked("c")], keep_s=60)
    assert warm_pool.count() == 3 and warm_pool.reserved() == {"CPU": 3, "GPU": 0}
    assert [r.pg for r in warm_pool.take(key, 2)] == ["a", "b"]
    assert warm_pool.count() == 1 and released == []


def test_a_run_asking_otherwise_gives_every_parked_worker_back_saying_what_differs(released, caplog):
    warm_pool.park(warm_pool.pool_key("1 CPU", ()), [_parked("a", 2)], keep_s=60)
    with caplog.at_level("INFO", logger="elastictrain.workers"):
        assert warm_pool.take(warm_pool.pool_key("1 GPU", ()), 1) == []
    assert released == ["a"] and warm_pool.count() == 0
    assert "2 warm worker(s) of this driver's last run given back" in caplog.text
    assert "'1 CPU' then, '1 GPU' now" in caplog.text


def test_a_run_taking_parked_workers_says_how_many(released, caplog):
    key = warm_pool.pool_key("1 CPU", ())
    warm_pool.park(key, [_parked("a", 2)], keep_s=60)
    with caplog.at_level("INFO", logger="elastictrain.workers"):
        assert [r.pg for r in warm_pool.take(key, 1)] == ["a"]
    assert "2 warm worker(s) of this driver's last run taken" in caplog.text


def test_parked_workers_are_given_back_after_keep_s(released):
    warm_pool.park(warm_pool.pool_key("1 CPU", ()), [_parked("a")], keep_s=0.2)
    deadline = time.monotonic() + 10
    while warm_pool.count() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert released == ["a"] and warm_pool.count() == 0


def test_handles_of_a_cluster_the_driver_left_are_forgotten_not_released(released, monkeypatch):
    warm_pool.park(warm_pool.pool_key("1 CPU", ()), [_parked("a")], keep_s=60)
    monkeypatch.setattr(warm_pool, "_cluster", lambda: ("another gcs", "job"))  # reconnected elsewhere
    assert warm_pool.take(warm_pool.pool_key("1 CPU", ()), 1) == []
    assert released == [] and warm_pool.count() == 0


def test_a_run_without_tensor_parallelism_takes_each_rank_of_a_parked_replica_as_a_replica(released):
    key = warm_pool.pool_key("1 CPU", ())
    warm_pool.park(key, [_parked("tp-a", 2), _parked("tp-b", 2), _parked("tp-c", 2)], keep_s=60)
    # Three replicas of one rank: two reservations of two bundles (four slots), the third stays parked.
    assert [r.pg for r in warm_pool.take(key, 3, ranks=1)] == ["tp-a", "tp-b"]
    assert warm_pool.count() == 2 and released == []


def test_a_tensor_parallel_run_takes_whole_replicas_of_its_degree_and_gives_back_the_rest(released, caplog):
    key = warm_pool.pool_key("1 CPU", ())
    warm_pool.park(key, [_parked("one"), _parked("two", 2), _parked("four", 4)], keep_s=60)
    with caplog.at_level("INFO", logger="elastictrain.workers"):
        assert [r.pg for r in warm_pool.take(key, 1, ranks=2)] == ["two"]
    assert released == ["one", "four"] and warm_pool.count() == 0
    assert "5 warm worker(s) of this driver's last run given back" in caplog.text
    assert "replicas of 1 or 4 ranks then, 2 now" in caplog.text


class _Worker:
    pass


class _FaultyWorker(_Worker):
    pass


def test_workers_hosting_a_subclass_serve_a_run_of_its_base_and_not_the_reverse(released, caplog):
    key = warm_pool.pool_key("1 CPU", ())
    faulty = ParkedReservation("faulty", None, {0: "a0"}, cpus=1, hosts={0: _FaultyWorker})  # type: ignore[arg-type]
    mixed = ParkedReservation("mixed", None, {0: "b0", 1: "b1"}, cpus=2, hosts={0: _FaultyWorker, 1: _Worker})  # type: ignore[arg-type]
    warm_pool.park(key, [faulty, mixed], keep_s=60)
    # A plain run takes both: a faulty worker is a worker.
    assert [r.pg for r in warm_pool.take(key, 3, hosts=_Worker)] == ["faulty", "mixed"]
    warm_pool.park(key, [faulty, mixed], keep_s=60)
    with caplog.at_level("INFO", logger="elastictrain.workers"):
        # A run that injects faults takes only the reservation whose every actor can.
        assert [r.pg for r in warm_pool.take(key, 3, hosts=_FaultyWorker)] == ["faulty"]
    assert released == ["mixed"] and warm_pool.count() == 0
    assert "2 warm worker(s) of this driver's last run given back" in caplog.text
    assert f"'{__name__}._Worker' then, '{__name__}._FaultyWorker' now" in caplog.text
