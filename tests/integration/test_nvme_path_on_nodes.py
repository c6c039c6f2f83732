"""Issue 12 point 12: deepspeed.nvme_path is checked on every worker node by a task pinned to it, not only
on the driver (a real cluster of a CPU-less head and three one-CPU worker nodes on this machine).
"""

from __future__ import annotations

import pytest
from helpers import offload_overrides, tiny_config

from elastictrain.preflight import PreflightError, check_nvme_on_nodes

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
