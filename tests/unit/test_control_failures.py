"""Replies of the workers -> a Failure: dead, lost with its node, raised, hung; up to 4,096 fake workers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastictrain.cluster.worker_api import WorkerApi
from elastictrain.control.errors import AttemptFailed
from elastictrain.control.failures import gather_results
from elastictrain.core.policy import Restart, ScalingRules, decide_after_failure
from elastictrain.testing.fake_group import FakeGroup


def set_up(n: int, *, nodes: int | None = None, spares: int = 0) -> FakeGroup:
    """n workers set up as the ranks of an attempt, and `spares` warm ones in none."""
    group = FakeGroup(n + spares, nodes=nodes, warmup_polls=0)
    group.request(n + spares)
    workers = group.start_workers(n + spares, None)[:n]
    group.poll_warm()
    specs = [(SimpleNamespace(rank=r, world_size=n, start_step=100),) for r in range(n)]
    gather_results(group, group.call_each(workers, WorkerApi.setup, specs), 100, timeout_s=1, phase="setup")
    return group


def step(group: FakeGroup, at: int = 100) -> dict:
    calls = group.call(group.workers, WorkerApi.train_step, at)
    return gather_results(group, calls, at, timeout_s=120, phase="step")


def failure_of(group: FakeGroup, at: int = 100):  # noqa: ANN201
    with pytest.raises(AttemptFailed) as e:
        step(group, at)
    return e.value.failure


def test_a_healthy_group_gives_every_rank_its_result():
    group = set_up(64)
    results = step(group)
    assert len(results) == 64 and all(r["step"] == 100 for r in results.values())


def test_a_lost_node_and_a_dead_worker_are_told_apart():
    group = set_up(8, nodes=4)
    group.die_at_step(rank=3, step=100)
    failure = failure_of(group)
    assert failure.kind == "worker_died" and failure.worker_ids == ("fw3",)
    group = set_up(8, nodes=4)
    group.lose_node_of(group.workers[3])  # fw3 and fw7 share node-0003
    failure = failure_of(group)
    assert failure.kind == "node_lost" and failure.worker_ids == ("fw3", "fw7")
    assert "node(s) node-000 lost" in failure.message


def test_a_rank_that_raised_its_own_error_is_blamed_not_the_peers_whose_collective_broke():
    group = set_up(4)
    group.raise_at_step(rank=1, step=100, error="RuntimeError: Connection closed by peer (gloo)")
    group.raise_at_step(rank=2, step=100, error="ValueError: a bad sample")
    failure = failure_of(group)
    assert failure.kind == "step_error" and failure.worker_ids == ("fw2",)
    assert failure.message.endswith("ValueError: a bad sample")


def test_a_hung_rank_is_named_by_its_stack_not_by_its_peers_waiting_on_it():
    group = set_up(4)
    group.hang_at_step(rank=2, step=100)
    failure = failure_of(group)
    assert failure.kind == "hang" and failure.worker_ids == ("fw2",)
    assert "failure.hang_timeout_s" in failure.message


def test_an_idle_spare_outside_the_attempt_is_not_blamed_for_its_hang():
    group = set_up(4, spares=1)
    spare = group.workers[4]  # warm, in no attempt: in no collective either
    group.hang_at_step(rank=2, step=100)
    with pytest.raises(AttemptFailed) as e:
        calls = group.call(group.workers[:4], WorkerApi.train_step, 100)
        gather_results(group, calls, 100, timeout_s=120, phase="step")
    assert e.value.failure.kind == "hang" and e.value.failure.worker_ids == ("fw2",)
    assert spare.worker_id not in e.value.failure.message


def test_one_failure_among_4096_simulated_workers_is_detected_and_decided():
    rules = ScalingRules(
        min_workers=2048,
        max_workers=4096,
        global_batch_size=4096 * 4,
        micro_batch_size=4,
        max_failures=10,
        wait_for_capacity_s=300.0,
    )
    group = set_up(4096, nodes=512)
    group.die_at_step(rank=1234, step=100)
    group.node_queries = 0
    failure = failure_of(group)
    assert failure.worker_ids == ("fw1234",) and failure.kind == "worker_died"
    assert group.node_queries == 1  # one cluster query, not 4,096
    decision = decide_after_failure(rules, failure, 1, capacity=4095, now=5000.0)
    # 4095 does not divide 16384; the largest size that does within [2048, 4095] is 2048.
    assert decision == Restart(2048, decision.reason)
