"""A straggler's node gets no new workers for a while (failure.straggler_avoid_s): the worker group's
reservations carry a label selector off the avoided nodes, and one still waiting when the while ends is
asked for again without it. A real cluster of a CPU-less head and three one-CPU worker nodes."""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group_table

pytestmark = pytest.mark.integration


def _placed_on(group) -> set[str]:  # noqa: ANN001 - a WorkerGroup
    placed = group._ready(0.0)
    return {placement_group_table(s.pg)["bundles_to_node_id"][s.bundle] for s in placed}


def test_new_reservations_stay_off_avoided_nodes_until_the_while_ends(ray_cluster, tmp_path):
    from elastictrain.cluster.worker_group import WorkerGroup
    from elastictrain.cluster.worker_resources import WorkerResources

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0)
    assert len(nodes) == 3
    # New reservations only: warm workers an earlier module's run parked on these nodes are given back.
    group = WorkerGroup(WorkerResources(False, 1, 0, "system"), name_prefix="avoid", reuse_warm=False)
    try:
        group.avoid_node(nodes[0], 60.0)
        group.avoid_node(nodes[1], 60.0)
        group.request(1)
        assert group.wait_for_reservations(1, timeout_s=30) == 1
        assert _placed_on(group) == {nodes[2]}
        group.release_pending()

        # Every node avoided for a moment: nothing places; once the moment passes, the reservation is asked
        # for again without the restriction and places.
        for node in nodes:
            group.avoid_node(node, 1.5)
        group.request(1)
        assert group.wait_for_reservations(1, timeout_s=1.0) == 0
        time.sleep(1.0)
        assert group.wait_for_reservations(1, timeout_s=30) == 1
        assert len(_placed_on(group)) == 1
    finally:
        group.release_pending()
