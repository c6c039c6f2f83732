"""The control loop recovers from the workers' in-memory snapshots (fake worker group), or says why not."""

from __future__ import annotations

from pathlib import Path

from loop_harness import at_step, make_run

from elastictrain.control.memory_recovery import MemoryRecovery
from elastictrain.testing.fake_group import FakeWorker


def test_a_rank_dying_restarts_from_memory_at_the_last_reported_step_losing_nothing(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1")
    r.group.die_at_step(rank=1, step=6)
    summary = r.run()
    assert summary.status.value == "FINISHED" and summary.failures == 1
    (decision,) = r.events("decision")
    assert decision["recovered_from"] == "memory" and "in-memory snapshot at step 6" in decision["message"]
    restarted = r.events("attempt_started")[1]
    assert restarted["source"] == "memory" and restarted["checkpoint"] is None and restarted["step"] == 6
    recovered = r.events("recovered")[0]
    assert recovered["steps_lost"] == 0 and recovered["recovered_from"] == "memory"
    assert r.committed_step() == 12


def test_the_dead_ranks_slice_comes_from_its_buddy(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1")
    r.group.die_at_step(rank=1, step=6)
    r.run()
    # rank 0 (fw0) served its own slice and, as rank 1's buddy, rank 1's.
    assert "rank 0: fw0, rank 1: fw0" in r.events("decision")[0]["memory"]


def test_a_copy_that_never_completed_uses_the_previous_complete_snapshot(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1")
    r.group.copy_unfinished(rank=1, step=6)  # rank 1 was still copying step 6 when it died in step 6
    r.group.die_at_step(rank=1, step=6)
    summary = r.run()
    assert summary.status.value == "FINISHED"
    assert r.events("attempt_started")[1]["step"] == 5
    assert r.events("recovered")[0]["steps_lost"] == 1  # the step whose copy was in flight


def test_a_rank_lost_with_its_buddy_falls_back_to_disk_and_says_so(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1", "scaling.max_workers=3", "training.global_batch_size=12",
                 capacity=3)  # fmt: skip
    # Three workers on three nodes: rank 1's buddy is rank 2 (the next node round the ring).
    r.group.die_at_step(rank=1, step=6)
    r.group.die_at_step(rank=2, step=6)
    summary = r.run()
    assert summary.status.value == "FINISHED"
    (decision,) = r.events("decision")
    assert decision["recovered_from"] == "disk"
    assert "rank(s) [1]" in decision["memory"] and "buddy were both lost" in decision["memory"]
    restarted = r.events("attempt_started")[1]
    assert restarted["source"] == "disk" and restarted["checkpoint"] == "step-000004"
    recovered = r.events("recovered")[0]
    assert recovered["recovered_from"] == "disk" and recovered["steps_lost"] == 2


def test_with_snapshots_off_recovery_is_from_disk_naming_the_setting(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1", "checkpoint.memory_every_steps=0")
    r.group.die_at_step(rank=1, step=6)
    r.run()
    assert "checkpoint.memory_every_steps=0" in r.events("decision")[0]["memory"]
    assert all(not w.own for w in r.group.workers)


def test_snapshots_every_other_step_lose_at_most_that_many_steps(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1", "checkpoint.memory_every_steps=2")
    r.group.die_at_step(rank=1, step=7)
    r.run()
    assert r.events("attempt_started")[1]["step"] == 6 and r.events("recovered")[0]["steps_lost"] == 1


def test_growing_loads_the_larger_world_from_memory(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=2", "scaling.max_workers=4", capacity=2)
    r.controller.callbacks.after_step.append(at_step(6, lambda c: r.group.add_capacity(2)))
    r.controller.callbacks.after_step.append(at_step(7, _warm))
    summary = r.run()
    assert summary.world_sizes == [2, 4]
    larger = r.events("attempt_started")[1]
    assert larger["world_size"] == 4 and larger["source"] == "memory" and larger["step"] == 8
    assert any(e["tag"] == "step-000008" for e in r.events("checkpoint"))  # disk checkpoints stay


def test_a_grow_does_not_wait_for_the_checkpoint_when_every_rank_can_hold_the_step_in_memory(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=2", "scaling.max_workers=4", capacity=2)
    r.controller.callbacks.after_step.append(at_step(4, lambda c: r.group.add_capacity(2)))
    # Warm once 6 steps are done: the steps in flight end, and the world grows before the checkpoint (8).
    r.controller.callbacks.after_step.append(at_step(5, _warm))
    summary = r.run()
    assert summary.world_sizes == [2, 4] and summary.status.value == "FINISHED"
    (grow,) = r.events("grow")
    assert grow["step"] in (6, 7) and "this step's state is in memory" in grow["message"]
    larger = r.events("attempt_started")[1]
    assert larger["world_size"] == 4 and larger["source"] == "memory" and larger["step"] == grow["step"]
    assert r.events("recovered")[0]["steps_lost"] == 0
    assert [e["tag"] for e in r.events("checkpoint")] == ["step-000004", "step-000008", "step-000012"]


def test_without_in_memory_snapshots_a_grow_waits_for_the_checkpoint(tmp_path: Path):
    off = "checkpoint.memory_every_steps=0"
    r = make_run(tmp_path, "scaling.min_workers=2", "scaling.max_workers=4", off, capacity=2)
    r.controller.callbacks.after_step.append(at_step(4, lambda c: r.group.add_capacity(2)))
    r.controller.callbacks.after_step.append(at_step(5, _warm))
    r.run()
    (grow,) = r.events("grow")
    assert grow["step"] == 8 and "just checkpointed" in grow["message"]


def test_buddies_are_on_other_nodes_when_there_are_some(tmp_path: Path):
    r = make_run(tmp_path)
    r.run()
    assert r.events("attempt_started")[0]["buddies_off_node"] is True
    memory = MemoryRecovery(r.controller.cfg, r.group)
    same_node = [FakeWorker(f"w{i}", "node-0") for i in range(3)]
    buddies, off = memory.buddies(same_node)
    assert buddies == [1, 2, 0] and off is False


def _warm(controller) -> None:  # noqa: ANN001
    from elastictrain.testing.chaos import wait_until_replacements_are_warm

    wait_until_replacements_are_warm(controller)


def test_a_survivor_replaced_for_being_stuck_hands_its_snapshots_on_first(tmp_path: Path):
    # Rank 1 dies; rank 2, which holds rank 1's replica, is stuck (as a gloo survivor waiting on another
    # survivor can be) and is replaced: what it held goes to rank 0 before it goes.
    r = make_run(tmp_path, "scaling.min_workers=1", "scaling.max_workers=3", capacity=3)
    r.group.die_at_step(rank=1, step=6)
    r.group.hang_at_step(rank=2, step=6)
    summary = r.run()
    assert summary.status.value == "FINISHED"
    (replaced,) = r.events("worker_replaced")
    assert "in-memory snapshots handed to fw0" in replaced["message"]
    (decision,) = r.events("decision")
    assert decision["recovered_from"] == "memory" and "rank 1: fw0" in decision["memory"]
    assert r.events("attempt_started")[1]["step"] == 6


def test_a_grow_from_memory_says_how_long_training_stopped_from_the_last_step_before_it(tmp_path: Path):
    from elastictrain.testing.chaos import wait_until_replacements_are_warm

    r = make_run(tmp_path, "scaling.min_workers=2", "scaling.max_workers=3", capacity=2)
    r.controller.callbacks.after_step.append(at_step(4, lambda c: r.group.add_capacity(1)))
    r.controller.callbacks.after_step.append(at_step(5, wait_until_replacements_are_warm))
    summary = r.run()
    assert summary.status.value == "FINISHED" and summary.world_sizes == [2, 3]
    assert r.events("grow")
    recovered = r.events("recovered")[0]
    assert recovered["recovered_from"] == "memory" and recovered["steps_lost"] == 0
    # The fake clock moves 0.1 s per reading: the stall runs from the last step before the grow (not
    # from the decision, later), so it is longer than the recovery counted from the decision.
    assert recovered["stall_s"] > recovered["recovery_seconds"] > 0
    assert f"training stopped for {recovered['stall_s']:.2f}s" in recovered["message"]
