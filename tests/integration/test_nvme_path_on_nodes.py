"""Issue 12 point 12: deepspeed.nvme_path is checked on every worker node by a task pinned to it, not only
on the driver (a real cluster of a CPU-less head and three one-CPU worker nodes on this machine); the
driver's own node answers from the driver's process.
"""

from __future__ import annotations

import os
import time

import pytest
from helpers import offload_overrides, tiny_config

from elastictrain.driver.preflight import PreflightError, check_nvme_on_nodes

pytestmark = pytest.mark.integration


def test_nvme_path_is_checked_on_every_worker_node(ray_cluster, tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cfg = tiny_config(tmp_path / "run", *offload_overrides("nvme", nvme))
    assert check_nvme_on_nodes(cfg) == 3, "the three worker nodes, not the head (it has no CPU for a worker)"

    # The driver saw the folder when the config was loaded; the nodes do not (as on a node without it).
    cfg.deepspeed.nvme_path = str(tmp_path / "missing")
    with pytest.raises(PreflightError) as e:
        check_nvme_on_nodes(cfg)
    lines = str(e.value).splitlines()
    assert lines[0] == (
        f"deepspeed.nvme_path: got '{tmp_path / 'missing'}'; expected a folder every worker node can write "
        "(each rank swaps there), but:"
    )
    assert len(lines) == 4 and all("it does not exist or is not a folder there" in line for line in lines[1:])


def test_without_nvme_offload_no_node_is_asked(tmp_path):
    assert check_nvme_on_nodes(tiny_config(tmp_path / "run")) == 0


def _pid_and_node() -> tuple[int, str]:
    import ray

    return os.getpid(), ray.get_runtime_context().get_node_id()


def _stuck(seconds: float) -> None:
    time.sleep(seconds)


def test_the_drivers_own_node_answers_from_the_driver_and_the_others_from_a_task_there(ray_cluster):
    import sys

    import ray
    from ray import cloudpickle

    from elastictrain.cluster.nodes import on_each_node

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the nodes' workers cannot import tests
    nodes = [n for n in ray.nodes() if n["Alive"]]
    here = ray.get_runtime_context().get_node_id()
    answers, late = on_each_node(nodes, _pid_and_node, timeout_s=60)
    assert not late and len(answers) == 4  # the head (the driver's node) and the three worker nodes
    for node, (pid, node_id) in answers:
        assert node_id == node["NodeID"]  # each answer comes from its own node
        assert (pid == os.getpid()) == (node["NodeID"] == here)  # no Ray worker started for the head

    (head,) = [n for n in nodes if n["NodeID"] == here]
    answers, late = on_each_node([head], _stuck, 5, timeout_s=0.5)
    assert (answers, late) == ([], [head])  # a probe stuck on the driver's node is late, as a task would be
