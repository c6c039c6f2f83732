"""A driver's next run takes the warm workers its last run left (scaling.keep_warm_s), and trains
exactly as new workers would: nothing of the last run (a planted fault, snapshots) follows them."""

from __future__ import annotations

import time

import pytest
import ray
from helpers import at_step, chain, record_losses, run, tiny_config

from elastictrain.cluster import warm_pool

pytestmark = pytest.mark.integration


def _remember_pids(pids: dict[str, set[int]], name: str):  # noqa: ANN202
    return at_step(1, lambda c: pids.__setitem__(name, {int(w.info["pid"]) for w in c.group.workers}))


def _plant_crash_at_step(step: int):  # noqa: ANN202
    return at_step(1, lambda c: ray.get(c.active[0].actor.inject_fault.remote("crash", step)))


def test_a_second_run_takes_the_first_runs_warm_workers_and_trains_as_new_workers_do(ray_local, tmp_path):
    warm_pool.release_all()
    pids: dict[str, set[int]] = {}
    keep = "scaling.keep_warm_s=120"

    # The first run stops at step 2, leaving a crash planted for step 4 that it never reaches.
    first = tiny_config(tmp_path / "first", keep, "training.max_steps=2", "checkpoint.every_steps=2")
    summary, _, _ = run(
        first, tracking=False, hook=chain(_remember_pids(pids, "first"), _plant_crash_at_step(4)), faults=True
    )
    assert summary.status.value == "FINISHED"
    assert warm_pool.count() == 2, "both workers parked for the next run"
    held = ray.get([a.memory_holdings.remote() for a in warm_pool.parked_actors()], timeout=30)
    assert held == [[], []], f"parked workers still hold the first run's snapshots: {held}"

    second_losses: list[float] = []
    second = tiny_config(tmp_path / "second", keep, "training.max_steps=6")
    summary, _, _ = run(
        second,
        tracking=False,
        hook=chain(_remember_pids(pids, "second"), record_losses(second_losses)),
        faults=True,
    )
    assert pids["second"] == pids["first"], "the second run's workers are the first run's processes"
    assert summary.status.value == "FINISHED" and summary.failures == 0, "the planted crash did not follow"

    # The same run on new workers: the same losses, bit for bit.
    warm_pool.release_all()
    new_losses: list[float] = []
    new = tiny_config(tmp_path / "new", "scaling.keep_warm_s=1", "training.max_steps=6")
    summary, _, _ = run(
        new, tracking=False, hook=chain(_remember_pids(pids, "new"), record_losses(new_losses)), faults=True
    )
    assert pids["new"].isdisjoint(pids["first"]), "released workers ended; the run started new ones"
    assert summary.status.value == "FINISHED"
    assert second_losses == new_losses

    # Kept for 1 s: then the slots go back to the cluster.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        warm_pool.count() or ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]
    ):
        time.sleep(0.2)
    assert warm_pool.count() == 0
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]
