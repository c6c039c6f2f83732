"""A worker actor runs the malloc `scaling.worker_allocator` names (Ray's jemalloc by default)."""

from __future__ import annotations

import pytest
from helpers import tiny_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("allocator", ["jemalloc", "system"])
def test_a_started_worker_runs_the_chosen_malloc(ray_local, tmp_path, allocator):
    from elastictrain.cluster.worker_group import WorkerGroup
    from elastictrain.cluster.worker_resources import WorkerResources

    cfg = tiny_config(tmp_path / "run", f"scaling.worker_allocator={allocator}")
    group = WorkerGroup(WorkerResources(False, 1, 0, cfg.scaling.worker_allocator), name_prefix=allocator[:3])
    try:
        group.request(1)
        assert group.wait_for_reservations(1, timeout_s=60) == 1
        group.start_workers(1, cfg)
        (worker,) = group.poll_warm(timeout_s=120)
        assert worker.info["allocator"] == allocator
    finally:
        for w in list(group.workers):
            group.remove(w)
