"""Failure and scaling decisions, and failure detection, with scripted scenarios (no cluster)."""

from __future__ import annotations

from elastictrain.core.membership import WorkerObservation, detect_failure
from elastictrain.core.policy import (
    Fail,
    Failure,
    Restart,
    ScalingRules,
    Wait,
    decide_after_failure,
    decide_grow,
    decide_start,
)

RULES = ScalingRules(
    min_workers=2,
    max_workers=3,
    global_batch_size=24,
    micro_batch_size=4,
    max_failures=2,
    wait_for_capacity_s=60.0,
)
DIED = Failure("worker_died", ("w2",), 12, "worker process died")


def test_restart_at_same_size_when_a_replacement_slot_is_there():
    decision = decide_after_failure(RULES, DIED, 1, capacity=3, now=0.0)
    assert isinstance(decision, Restart) and decision.world_size == 3


def test_shrink_to_the_capacity_left_when_it_is_within_bounds():
    decision = decide_after_failure(RULES, DIED, 1, capacity=2, now=0.0)
    assert isinstance(decision, Restart) and decision.world_size == 2


def test_wait_below_the_minimum_then_fail_with_a_clear_message():
    decision = decide_after_failure(RULES, DIED, 1, capacity=1, now=100.0)
    assert isinstance(decision, Wait) and decision.need == 2 and decision.deadline == 160.0
    still = decide_start(RULES, capacity=1, now=150.0, waiting_since=100.0)
    assert isinstance(still, Wait)
    over = decide_start(RULES, capacity=1, now=160.0, waiting_since=100.0)
    assert isinstance(over, Fail)
    assert "failure.wait_for_capacity_s" in over.reason and "elastictrain resume" in over.reason


def test_failure_budget_spent_fails_naming_the_setting_and_the_last_failure():
    decision = decide_after_failure(RULES, DIED, 3, capacity=3, now=0.0)
    assert isinstance(decision, Fail)
    assert (
        "failure.max_failures=2" in decision.reason
        and "worker_died" in decision.reason
        and "w2" in decision.reason
    )


def test_sizes_that_do_not_split_the_global_batch_are_skipped():
    rules = ScalingRules(2, 5, 24, 4, 3, 60.0)
    assert decide_start(rules, 5, 0.0, None) == Restart(4, decide_start(rules, 5, 0.0, None).reason)
    assert isinstance(decide_start(ScalingRules(5, 5, 24, 4, 3, 0.0), 5, 0.0, None), Fail)


def test_grow_only_to_a_larger_workable_size():
    assert decide_grow(RULES, world_size=2, capacity=3) == 3
    assert decide_grow(RULES, world_size=3, capacity=5) is None
    assert decide_grow(RULES, world_size=2, capacity=2) is None


def _cluster(n: int, now: float) -> list[WorkerObservation]:
    return [WorkerObservation(f"w{i}", True, True, now - 0.01 * (i % 7), 100) for i in range(n)]


def test_healthy_cluster_has_no_failure():
    assert detect_failure(_cluster(64, 1000.0), now=1000.0, hang_timeout_s=30, step=100) is None


def test_lost_node_and_dead_worker_are_told_apart():
    obs = _cluster(8, 1000.0)
    obs[3] = WorkerObservation("w3", False, False, 990.0, 100)
    assert detect_failure(obs, 1000.0, 30, 100).kind == "node_lost"
    obs[3] = WorkerObservation("w3", False, True, 990.0, 100)
    f = detect_failure(obs, 1000.0, 30, 100)
    assert f.kind == "worker_died" and f.worker_ids == ("w3",)


def test_hung_worker_is_the_one_with_the_oldest_progress_mark():
    obs = _cluster(8, 1000.0)
    obs[5] = WorkerObservation("w5", True, True, 900.0, 99)
    f = detect_failure(obs, now=1000.0, hang_timeout_s=30, step=100)
    assert f.kind == "hang" and f.worker_ids == ("w5",)
    assert detect_failure(obs, now=920.0, hang_timeout_s=30, step=100) is None


def test_one_failure_among_4096_simulated_workers_is_detected_and_decided():
    rules = ScalingRules(
        min_workers=2048,
        max_workers=4096,
        global_batch_size=4096 * 4,
        micro_batch_size=4,
        max_failures=10,
        wait_for_capacity_s=300.0,
    )
    obs = _cluster(4096, 5000.0)
    obs[1234] = WorkerObservation("w1234", False, True, 4990.0, 100)
    failure = detect_failure(obs, now=5000.0, hang_timeout_s=60, step=100)
    assert failure is not None and failure.worker_ids == ("w1234",)
    decision = decide_after_failure(rules, failure, 1, capacity=4095, now=5000.0)
    # 4095 does not divide 16384; the largest size that does within [2048, 4095] is 2048.
    assert decision == Restart(2048, decision.reason)


def test_the_rank_outside_the_collective_is_the_culprit_even_if_marks_are_close():
    from elastictrain.core.membership import stalled_workers

    obs = [WorkerObservation(f"w{i}", True, True, 1000.0 + 0.01 * i, 5, in_collective=True) for i in range(4)]
    obs[2] = WorkerObservation("w2", True, True, 1000.02, 5, in_collective=False)
    assert stalled_workers(obs) == ("w2",)
    # Nobody in a collective (or everybody): fall back to the oldest marks.
    same = [WorkerObservation(f"w{i}", True, True, 1000.0 + i, 5) for i in range(3)]
    assert stalled_workers(same) == ("w0",)


def test_the_same_error_at_the_same_step_after_a_restart_stops_the_run_at_once():
    from elastictrain.core.policy import Fail, Failure

    first = Failure("step_error", ("w-aa",), 7, "step raised in w-aa: KeyError: 'param_groups' at 0x7f12ab")
    again = Failure("step_error", ("w-bb",), 7, "step raised in w-bb: KeyError: 'param_groups' at 0x7f99cd")
    decision = decide_after_failure(RULES, again, 2, capacity=3, now=0.0, earlier=[first])
    assert isinstance(decision, Fail)
    assert decision.reason.startswith("deterministic error (rule: the same error at the same step")
    assert "KeyError: 'param_groups'" in decision.reason


def test_a_different_error_or_step_or_a_lost_worker_is_still_retried():
    from elastictrain.core.policy import Failure, Restart

    first = Failure("step_error", ("w-a",), 7, "step raised in w-a: ValueError: bad batch")
    other_step = Failure("step_error", ("w-a",), 8, "step raised in w-a: ValueError: bad batch")
    other_error = Failure("step_error", ("w-a",), 7, "step raised in w-a: RuntimeError: oom")
    died = Failure("worker_died", ("w-a",), 7, "worker process died during step: w-a")
    for failure in (other_step, other_error, died):
        decision = decide_after_failure(RULES, failure, 2, capacity=3, now=0.0, earlier=[first])
        assert isinstance(decision, Restart), failure
