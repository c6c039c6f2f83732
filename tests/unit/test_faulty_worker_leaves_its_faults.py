"""A fault-injecting worker parked warm and taken by the next run (cluster/warm_pool.py) brings none of
the last run's faults or delays: a plain run may take it (a subclass serves a run of its base)."""

from __future__ import annotations

from elastictrain.testing.faulty_worker import FaultyTrainWorker


def test_a_worker_leaving_its_run_drops_its_injected_faults_and_delays():
    worker = FaultyTrainWorker("w", False, in_ray=False)
    worker.inject_fault("raise", 3)
    worker.inject_forward_delay(1.5)
    worker.inject_write_delay(2.0)
    worker.inject_snapshot_delay(0.5)
    worker.leave_run()
    assert worker._faults == {}
    assert (worker._forward_delay_s, worker._write_delay_s, worker.memory.delay_s) == (0.0, 0.0, 0.0)
