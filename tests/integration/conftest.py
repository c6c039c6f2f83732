"""Fixtures for integration tests: a real local Ray cluster on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Keep every Ray server on 127.0.0.1 (as cluster/connect.py does); must be set before Ray starts.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[object]:
    """A real multi-node Ray cluster on this machine: a head with no CPUs and 3 one-CPU worker nodes.

    Workers can only land on the worker nodes, so removing one is a real node failure for them.
    """
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def probes(ray_local: None) -> Iterator[object]:
    """Three warm worker actors tests can look inside (tests/integration/probe.py), for a module."""
    from probe import ProbeGroup

    group = ProbeGroup(3)
    yield group
    group.teardown()
    group.kill()
