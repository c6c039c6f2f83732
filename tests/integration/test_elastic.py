"""Issue 3: failures detected and recovered in place; shrink on node loss, grow when capacity returns.

A node removed and added back three times, with an exact sample ledger and the fault-free run's
parameters at the end: tests/integration/test_memory_recovery.py. A killed worker whose survivor
restarts at once from disk and grows back once the replacement is warm: test_background_checkpoint.py
(the worker lost while a checkpoint is written). A hung worker detected by the hang timeout and replaced
by the warm spare: test_background_checkpoint.py (the checkpoint whose writes end in a hung step).
Capacity below the minimum after a node loss (the run waits failure.wait_for_capacity_s, then fails
resumable from its last commit): the control loop on the fake worker group
(tests/unit/test_control_loop.py); the real group's reservations that wait for a node to come back:
the node-loss runs of test_memory_recovery.py and test_tensor_parallel.py."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import tiny_config

pytestmark = pytest.mark.integration


def _loss_that_always_raises(model: Any, batch: Any) -> Any:
    raise KeyError("labels: this dataset has no labels column")


def test_a_deterministic_step_error_stops_after_one_restart_with_the_workers_error(ray_local, tmp_path):
    """The same error at the same step after a restart is not retried up to max_failures (here 3)."""
    import elastictrain

    # One worker: a loss of the test's module starts new workers, and the failed one is replaced; the
    # rule is the same at any world size.
    cfg = tiny_config(
        tmp_path / "run", "failure.max_failures=3", "scaling.min_workers=1", "scaling.max_workers=1"
    )
    summary = elastictrain.fit(cfg, loss=_loss_that_always_raises, tracking=False)
    assert summary.status.value == "FAILED"
    assert summary.failures == 2, "one restart, then the error repeats and the run stops"
    assert summary.message.startswith("deterministic error (rule: the same error at the same step")
    assert "labels: this dataset has no labels column" in summary.message
    from elastictrain.rundir.run_dir import RunDir

    events = RunDir.open(tmp_path / "run").read_events()
    (shown,) = [e for e in events if e["event"] == "worker_traceback"]
    assert "_loss_that_always_raises" in shown["message"]  # the worker's own traceback, once
    assert "RayTaskError" not in shown["message"]
