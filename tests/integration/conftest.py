"""Fixtures for integration tests: a real local Ray cluster on loopback."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import TEST_MODULE_ROOTS

from elastictrain.cluster.connect import LOCAL_SYSTEM_CONFIG
from elastictrain.user_code import add_to_pythonpath

# Keep every Ray server on 127.0.0.1 (as cluster/connect.py does); must be set before Ray starts.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# The folders of the modules this suite's runs hand their workers code from (helpers.TEST_MODULE_ROOTS),
# on PYTHONPATH before any cluster starts. A run puts them there itself (user_code.share_module_roots)
# for the workers it starts; put there by the first such run, they changed the environment a shared
# cluster's workers inherit, and the next module here started a cluster of its own.
# test_user_code.py empties PYTHONPATH to show a run adding them.
add_to_pythonpath(list(TEST_MODULE_ROOTS))


# The local cluster modules share, while it is reusable: started in this process with the environment
# it still has (its workers inherit the environment at the cluster's start: a module that sets AWS_* or
# PYTHONPATH first gets a cluster of its own), and every CPU free again when the last module left it.
_shared: dict[str, Any] = {}

# What the test process's environment gains that no Ray worker reads from it: pytest's name of the
# running test (another in every module: compared, it gave each module a cluster of its own), what
# elastictrain sets with setdefault in any process that needs it (the offline flags, a driver's
# RAY_IGNORE_UNHANDLED_ERRORS), torch's inductor cache folder (its default, set where inductor is
# imported), the rendezvous a `--local` run's in-process rank sets (every Ray worker sets its own
# at each attempt), and where this file logs the shared cluster's starts.
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
        "ELASTICTRAIN_TEST_CLUSTER_LOG",
        # Set by a package at its import, in every process that imports it, workers included: DeepSpeed,
        # scikit-learn (through transformers), MLflow.
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        "KMP_DUPLICATE_LIB_OK",
        "_MLFLOW_TELEMETRY_SESSION_ID",
    }
)


def _workers_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _NOT_READ_BY_WORKERS}


def _why_the_kept_cluster_is_not_connected_alike(kept: dict[str, Any]) -> str | None:
    """None when this process is still the driver of the cluster `kept` recorded (its "gcs") and the
    environment its workers inherited ("env") is the same; else why not."""
    import ray

    if not ray.is_initialized():
        return "no cluster is connected (the first module, or one that had a cluster of its own)"
    if kept.get("gcs") != ray.get_runtime_context().gcs_address:
        return "this process is connected to another cluster"
    before, env = kept.get("env") or {}, _workers_environment()
    if before != env:
        changed = sorted(k for k in {*before, *env} if before.get(k) != env.get(k))
        return f"the environment its workers inherited changed: {changed}"
    return None


def _why_the_shared_cluster_is_not_reusable() -> str | None:
    """None when the next module can take the shared local cluster; else why it cannot."""
    return _why_the_kept_cluster_is_not_connected_alike(_shared) or _why_cpus_are_not_all_free()


def _why_cpus_are_not_all_free() -> str | None:
    """None once every CPU of the connected cluster is free (or held by this driver's parked warm
    workers, which its next run takes back: scaling.keep_warm_s)."""
    import ray

    from elastictrain.cluster import warm_pool

    deadline = time.monotonic() + 10  # actors killed at a test's end release their CPUs in a moment
    while time.monotonic() < deadline:
        try:
            free = ray.available_resources().get("CPU", 0) + warm_pool.reserved()["CPU"]
            if free >= ray.cluster_resources().get("CPU", 0) > 0:
                return None
        except Exception as e:  # noqa: BLE001 - a cluster a test broke: start another
            return f"the cluster does not answer: {e}"
        time.sleep(0.2)
    return "CPUs were still taken 10 s after the last module"


def _log_cluster_start(module: str, why: str) -> None:
    """ELASTICTRAIN_TEST_CLUSTER_LOG=FILE: one line per shared-cluster start, with why (a restart costs
    its workers' and probes' warm-up, tens of CPU seconds on 2 cores)."""
    path = os.environ.get("ELASTICTRAIN_TEST_CLUSTER_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {module}: {why}\n")


class _WarmPoolLog(logging.Handler):
    """ELASTICTRAIN_TEST_CLUSTER_LOG=FILE also gets each worker's cold start and the warm pool's takes
    and give-backs, with the test: which modules pay workers' imports, and why."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.DEBUG)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {test}: {record.getMessage()}\n")


@pytest.fixture(scope="session", autouse=True)
def _log_the_warm_pool() -> Iterator[None]:
    path = os.environ.get("ELASTICTRAIN_TEST_CLUSTER_LOG")
    if not path:
        yield
        return
    logger, handler = logging.getLogger("elastictrain.workers"), _WarmPoolLog(path)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def ray_local(request: pytest.FixtureRequest) -> Iterator[None]:
    """A local Ray cluster (4 CPUs, on loopback) for the module, shared with the modules before and
    after it where nothing tells them apart (a cluster starts in about 3 s on 2 cores)."""
    import ray

    why = _why_the_shared_cluster_is_not_reusable()
    if why is not None:
        _log_cluster_start(request.module.__name__, why)
        if ray.is_initialized():
            ray.shutdown()
        _drop_multi_node_cluster()
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
    _drop_multi_node_cluster()


# The multi-node cluster modules asking for the same node size share, while the last one left it whole:
# three live worker nodes of that size, every CPU free, the environment its workers inherited unchanged
# (a test that removes a node adds one back). Four nodes' start is about 20 CPU s on 2 cores. It is shut
# down when this process needs another cluster.
_multi: dict[str, Any] = {}


def _drop_multi_node_cluster() -> None:
    cluster = _multi.get("cluster")
    _multi.clear()
    if cluster is not None:
        with contextlib.suppress(Exception):  # a cluster a test broke: its processes are gone already
            cluster.shutdown()  # type: ignore[attr-defined]


def _why_the_multi_node_cluster_is_not_reusable(cpus_per_node: int) -> str | None:
    import ray

    cluster = _multi.get("cluster")
    if cluster is None:
        return "none is kept (the first multi-node module here, or the last one's was shut down)"
    if _multi["cpus_per_node"] != cpus_per_node:
        return f"the kept one has {_multi['cpus_per_node']} CPU(s) a node, not {cpus_per_node}"
    why = _why_the_kept_cluster_is_not_connected_alike(_multi)
    if why is not None:
        return why
    try:
        sizes = sorted(n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"])
    except Exception as e:  # noqa: BLE001 - a cluster a test broke: start another
        return f"the cluster does not answer: {e}"
    if sizes != [0, cpus_per_node, cpus_per_node, cpus_per_node]:
        return f"its live nodes' CPUs are {sizes}"
    return _why_cpus_are_not_all_free()


def _three_worker_nodes(module: str, cpus_per_node: int) -> Iterator[object]:
    """The multi-node cluster (helpers.multi_node_cluster) of the modules before this one, if they left
    it whole, else a new one; this process its driver."""
    import ray
    from helpers import multi_node_cluster

    why = _why_the_multi_node_cluster_is_not_reusable(cpus_per_node)
    if why is not None:
        _log_cluster_start(f"{module} (3 nodes of {cpus_per_node} CPU)", why)
        if ray.is_initialized():
            ray.shutdown()
        _drop_multi_node_cluster()
        cluster = multi_node_cluster(cpus_per_node)
        ray.init(address=cluster.address, log_to_driver=False)
        _multi.update(
            cluster=cluster,
            cpus_per_node=cpus_per_node,
            gcs=ray.get_runtime_context().gcs_address,
            env=_workers_environment(),
        )
    yield _multi["cluster"]


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[object]:
    """3 one-CPU worker nodes (and a head with no CPUs)."""
    yield from _three_worker_nodes(request.module.__name__, 1)


@pytest.fixture(scope="module")
def ray_cluster_two_cpu_nodes(request: pytest.FixtureRequest) -> Iterator[object]:
    """3 worker nodes of 2 CPUs (and a head with no CPUs): each holds one tensor-parallel replica of 2."""
    yield from _three_worker_nodes(request.module.__name__, 2)


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


@pytest.fixture
def sessions() -> Iterator[list[int]]:
    """Sessions of the commands a test starts (driver_sessions.start records them): whatever is left of
    them (a driver's local Ray cluster) is killed at teardown."""
    from driver_sessions import kill_session

    started: list[int] = []
    yield started
    for sid in started:
        kill_session(sid)
