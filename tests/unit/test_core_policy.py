"""Failure and scaling decisions, and who stalled a hung group, with scripted scenarios (no cluster)."""

from __future__ import annotations

from elastictrain.core.membership import WorkerObservation, stalled_workers
from elastictrain.core.policy import (
    Fail,
    Failure,
    Restart,
    ScalingRules,
    Wait,
    ceiling_after_out_of_memory,
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


def test_the_hung_worker_is_the_one_with_the_oldest_progress_mark():
    obs = [WorkerObservation(f"w{i}", True, True, 1000.0 - 0.01 * (i % 7), 100) for i in range(8)]
    obs[5] = WorkerObservation("w5", True, True, 900.0, 99)
    assert stalled_workers(obs) == ("w5",)


def test_the_rank_outside_the_collective_is_the_culprit_even_if_marks_are_close():
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


def test_a_warmup_error_seen_twice_ends_the_run_one_seen_once_does_not():
    from elastictrain.core.policy import repeated_warmup_error

    assert repeated_warmup_error([("w0", "OSError: disk gone")]) is None
    assert repeated_warmup_error([("w0", "OSError: a"), ("w1", "ValueError: b")]) is None
    reason = repeated_warmup_error([("w0", "ValueError: too short"), ("w1", "ValueError: too short")])
    assert reason is not None and "(w0, w1)" in reason and "ValueError: too short" in reason


def test_a_worker_killed_for_memory_lowers_the_ceiling_below_the_size_that_ran_out():
    lowered = ceiling_after_out_of_memory(RULES, world_size=3)
    assert isinstance(lowered, ScalingRules) and lowered.max_workers == 2 and lowered.min_workers == 2
    killed = Failure("out_of_memory", ("w2",), 12, "killed by Ray's memory monitor")
    decision = decide_after_failure(lowered, killed, 1, capacity=3, now=0.0)
    assert isinstance(decision, Restart) and decision.world_size == 2  # a slot is free, but not used
    assert decide_grow(lowered, 2, capacity=3) is None  # nor grown back into


def test_out_of_memory_at_the_minimum_size_ends_the_run_naming_what_lowers_memory_per_rank():
    decision = ceiling_after_out_of_memory(RULES, world_size=2)
    assert isinstance(decision, Fail)
    assert "killed at world size 2" in decision.reason and "scaling.min_workers=2" in decision.reason
    assert "deepspeed.offload_optimizer" in decision.reason


def test_out_of_memory_is_not_a_deterministic_error_when_it_recurs_at_the_same_step():
    killed = Failure("out_of_memory", ("w2",), 12, "killed by Ray's memory monitor during step")
    rules = ScalingRules(1, 3, 24, 4, max_failures=5, wait_for_capacity_s=60.0)
    decision = decide_after_failure(rules, killed, 2, capacity=2, now=0.0, earlier=[killed])
    assert isinstance(decision, Restart)
