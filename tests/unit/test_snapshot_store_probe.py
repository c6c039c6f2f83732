"""A probe's copy (worker/snapshots/store.py): taken at the next step's update, not beside its forward and
backward, which then run with no copy beside them."""

from __future__ import annotations

from elastictrain.worker.snapshots.store import WorkerMemory


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
