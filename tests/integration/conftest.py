"""Fixtures for integration tests: a real local Ray cluster on loopback."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from elastictrain.cluster.connect import LOCAL_SYSTEM_CONFIG

# Keep every Ray server on 127.0.0.1 (as cluster/connect.py does); must be set before Ray starts.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("DS_ACCELERATOR", "cpu")


# The local cluster modules share, while it is reusable: started in this process with the environment
# it still has (its workers inherit the environment at the cluster's start: a module that sets AWS_* or
# PYTHONPATH first gets a cluster of its own), and every CPU free again when the last module left it.
_shared: dict[str, object] = {}

# What the test process's environment gains that no Ray worker reads from it: pytest's name of the
# running test (another in every module: compared, it gave each module a cluster of its own), what
# elastictrain sets with setdefault in any process that needs it (the offline flags, a driver's
# RAY_IGNORE_UNHANDLED_ERRORS), torch's inductor cache folder (its default, set where inductor is
# imported), and the rendezvous a `--local` run's in-process rank sets (every Ray worker sets its own
# at each attempt).
_NOT_READ_BY_WORKERS = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "RAY_IGNORE_UNHANDLED_ERRORS",
        "TORCHINDUCTOR_CACHE_DIR",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
    }
)


def _workers_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _NOT_READ_BY_WORKERS}


def _reusable_shared_cluster() -> bool:
    import ray

    from elastictrain.cluster import warm_pool

    if not ray.is_initialized() or _shared.get("gcs") != ray.get_runtime_context().gcs_address:
        return False
    if _shared.get("env") != _workers_environment():
        return False
    deadline = time.monotonic() + 10  # actors killed at a test's end release their CPUs in a moment
    while time.monotonic() < deadline:
        try:
            # Parked warm workers (scaling.keep_warm_s) hold CPUs the next run here takes back.
            free = ray.available_resources().get("CPU", 0) + warm_pool.reserved()["CPU"]
            if free >= ray.cluster_resources().get("CPU", 0) > 0:
                return True
        except Exception:  # noqa: BLE001 - a cluster a test broke: start another
            return False
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A local Ray cluster (4 CPUs, on loopback) for the module, shared with the modules before and
    after it where nothing tells them apart (a cluster starts in about 3 s on 2 cores)."""
    import ray

    if not _reusable_shared_cluster():
        if ray.is_initialized():
            ray.shutdown()
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            _system_config=LOCAL_SYSTEM_CONFIG,  # as cluster/connect.py starts one
        )
        _shared.update(gcs=ray.get_runtime_context().gcs_address, env=_workers_environment())
    yield


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_the_end() -> Iterator[None]:
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _three_worker_nodes(cpus_per_node: int) -> Iterator[object]:
    """The module's multi-node cluster (helpers.multi_node_cluster), this process its driver."""
    import ray
    from helpers import multi_node_cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = multi_node_cluster(cpus_per_node)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[object]:
    """3 one-CPU worker nodes (and a head with no CPUs)."""
    yield from _three_worker_nodes(1)


@pytest.fixture(scope="module")
def ray_cluster_two_cpu_nodes() -> Iterator[object]:
    """3 worker nodes of 2 CPUs (and a head with no CPUs): each holds one tensor-parallel replica of 2."""
    yield from _three_worker_nodes(2)


# The probe group on the shared cluster (its GCS address -> the group): three actors' start, imports and
# first engine build (15-40 s of a module's first test on 2 cores) paid once per cluster, not per module.
_probe_groups: dict[str, object] = {}


@pytest.fixture(scope="module")
def probes(ray_local: None) -> Iterator[object]:
    """Three warm worker actors tests can look inside (tests/integration/probe.py). Kept from module to
    module on the same cluster, as a run keeps its workers warm from attempt to attempt: each test sets
    up attempts of its own on them (a config, a world size, a checkpoint), which is what they test."""
    import ray
    from probe import ProbeGroup

    gcs = ray.get_runtime_context().gcs_address
    group = _probe_groups.get(gcs)
    if group is None or not group.alive():  # type: ignore[attr-defined]
        _probe_groups.clear()
        group = _probe_groups[gcs] = ProbeGroup(3)
    yield group
    try:
        group.teardown()  # leaves the module's last attempt
    except Exception:  # noqa: BLE001 - a group a test broke: the next module starts another
        _probe_groups.clear()
        group.kill()
