"""Shared fixtures."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

# One intra-op thread in every process of the suite (the test processes, the commands and scripts they
# start, the Ray clusters and probe actors they start inherit it; training workers get
# scaling.cpus_per_worker, 1 in the tests, as always). The suite runs two pytest workers on two cores,
# each starting workers, commands and servers: a second torch thread per process only contends, and
# OpenMP's threads spin after every parallel region, thousands of them for the tests' tiny models.
# Three test files of fresh-process ranks took 106.7 CPU s and 67 s with torch's default (one thread a
# core), 91.2 CPU s and 60 s with one. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from elastictrain.compat.deepspeed.ops import prefer_environment_tools  # noqa: E402

# As every elastictrain process does: engines built in a test process load the ops `make setup` built.
prefer_environment_tools()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_mlflow_server(
    root: Path, port: int | None = None, *, app_name: str | None = None, env: dict[str, str] | None = None
) -> Iterator[str]:
    """A real `mlflow server` on loopback, its SQLite store and artifacts under root; yields its URI.

    app_name="basic-auth" serves MLflow's own basic-auth app (give MLFLOW_AUTH_ADMIN_PASSWORD in env).
    """
    port = port or free_port()
    uri = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        # Proxied artifacts: clients upload through the server, so log_text works over HTTP alone.
        "--serve-artifacts", "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    cmd += ["--app-name", app_name] if app_name else []
    # The job runner would start several huey consumer processes the tests never use.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}
    log_path = root / "server.log"
    with open(log_path, "ab") as log_file:
        # Own session, so teardown can stop the server and the uvicorn worker it forks together.
        proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )

    def stop() -> None:
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        # Also sweeps a worker left behind by the parent (the group outlives its leader).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    deadline = time.monotonic() + 60
    try:
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text()[-4000:]
                raise RuntimeError(f"mlflow server exited with {proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not healthy after 60 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
    except BaseException:
        stop()
        raise
    try:
        yield uri
    finally:
        stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as uri:
        yield uri


@pytest.fixture
def mlflow_server_factory() -> Callable[..., AbstractContextManager[str]]:
    """running_mlflow_server(root, port=None): for tests that stop and restart a server themselves."""
    return running_mlflow_server


MLFLOW_ADMIN_PASSWORD = "right-password-4242"


@pytest.fixture(scope="session")
def mlflow_basic_auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `mlflow server` with MLflow's basic-auth app: user admin, password MLFLOW_ADMIN_PASSWORD."""
    env = {"MLFLOW_AUTH_ADMIN_PASSWORD": MLFLOW_ADMIN_PASSWORD, "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-only"}
    root = tmp_path_factory.mktemp("mlflow-auth")
    with running_mlflow_server(root, app_name="basic-auth", env=env) as uri:
        yield uri


# ---------------------------------------------------------------- a real S3 server on loopback ----


@contextlib.contextmanager
def running_s3_server(root: Path) -> Iterator[dict[str, str]]:
    """moto's S3 server (`python -m moto.server`) on 127.0.0.1; yields the AWS_* environment that
    points boto/s3fs at it. Ceph's radosgw in Debian 12 (16.2) has no standalone dbstore backend
    (it needs a RADOS cluster), so moto's server mode is the S3 peer these tests start."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    port = free_port()
    log_path = root / "s3-server.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"moto server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto server not answering after 60 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.3)
        yield {
            "AWS_ACCESS_KEY_ID": "testing-key",
            "AWS_SECRET_ACCESS_KEY": "testing-secret",
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real S3 server for the session: the AWS_* variables that reach it; each test makes its own
    bucket with `s3_bucket`, which sets them for that test."""
    with running_s3_server(tmp_path_factory.mktemp("s3-server")) as env:
        yield env


@pytest.fixture
def s3_bucket(
    s3_server: dict[str, str], request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> str:
    """A new, empty bucket on the S3 server: `s3://NAME`. The server's AWS_* variables are set in this
    process for the test (and so in what it starts), then taken back: set for the session, they told
    the shared local Ray cluster's check (tests/integration/conftest.py) that its workers' environment
    had changed, and the next module started a cluster and probe actors anew (about 55 CPU s)."""
    import re
    import uuid

    import s3fs

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(name)
    return f"s3://{name}"


# ------------------------------------------------------------------------ the order files start in ----

# `make test` runs the files on two pytest-xdist workers, a file on one worker, in this order (it passes
# --no-loadscope-reorder: xdist would sort the files by their number of tests): the longest first (the
# times are from a run on 2 cores, docs/contributing.md lists them), so that no worker is left finishing a
# long file while the other has nothing to do; and the modules with Ray clusters of their own (several
# nodes, or a driver's) before those that share the in-process local cluster, which each of them stops.
# Order only: every test passes in any order, alone or in a different one.
LONGEST_FIRST = (  # seconds of test time in a run of the whole suite on 2 cores (2026-11-29)
    "test_readme_commands.py",  # 526 s
    "test_tensor_parallel.py",  # 253 s (on 3 nodes of two CPUs)
    "test_pipeline_nodes.py",  # 107 s (2026-12-06, in the suite), right after it on its nodes
    "test_object_storage_run.py",  # 188 s
    "test_memory_recovery.py",  # 164 s
    "test_chaos.py",  # 157 s
    "test_user_code.py",  # 58 s
    "test_nvme_path_on_nodes.py",  # 15 s
    "test_background_checkpoint.py",  # 147 s
    "test_architectures.py",  # 125 s
    "test_zero_stages.py",  # 100 s
    "test_lora_options.py",  # 72 s
    "test_scale_preset.py",  # 66 s
    "test_preference_exact_losses.py",  # 63 s (2026-12-06, alone)
    "test_preference_elastic.py",  # 58 s (2026-12-06, alone, on the three one-CPU nodes)
    "test_train_end_to_end.py",  # 65 s
    "test_sft_run.py",  # 59 s
    "test_tracker_mlflow.py",  # 59 s
    "test_plain_pytorch_equivalence.py",  # 58 s
    "test_zero3_build_patches.py",  # 58 s
    "test_reshard.py",  # 52 s
    "test_mlflow_outage.py",  # 50 s
    "test_driver_loss.py",  # 19 s alone: one driver, SIGTERMed (the killed one is test_object_storage_run's)
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# Files that run on one xdist worker, one after the other: they ask for the same multi-node cluster
# (3 worker nodes of 1 or of 2 CPUs, tests/integration/conftest.py), which the second and later then take
# over, with the warm workers the one before left, instead of starting four nodes of their own (about
# 20 CPU s), and the worker's shared local cluster restarts once after them instead of once after each.
# test_tensor_parallel.py and test_pipeline_nodes.py use only the two-CPU nodes.
ONE_WORKER = {
    "test_memory_recovery.py": "three one-CPU nodes",
    "test_user_code.py": "three one-CPU nodes",
    "test_nvme_path_on_nodes.py": "three one-CPU nodes",
    "test_preference_elastic.py": "three one-CPU nodes",
    "test_node_avoidance.py": "three one-CPU nodes",
    "test_tensor_parallel.py": "three two-CPU nodes",
    "test_pipeline_nodes.py": "three two-CPU nodes",
}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` with the files of ONE_WORKER as one unit (the rest: one file, one unit)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesSharingAClusterTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return ONE_WORKER.get(path.rpartition("/")[2], path)

    return FilesSharingAClusterTogether(config, log)


# ------------------------------------------------------------- DeepSpeed ops compiled by the tests ----

# `make install` builds the ops elastictrain loads (compat/deepspeed/ops.py: OPS). An op a test makes
# DeepSpeed JIT-compile (FusedAdam did, from a config without torch_adam) costs a minute of both cores
# on every fresh machine, CI included: the summary names any op whose library the session built.
_OPS_AT_START: dict[str, float] = {}


def _built_ops() -> dict[str, float]:
    from elastictrain.compat.deepspeed.ops import own_extensions_dir

    return {p.parent.name: p.stat().st_mtime for p in own_extensions_dir().glob("*/*.so")}


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller only: workers share the folder
        _OPS_AT_START.update(_built_ops())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if hasattr(terminalreporter.config, "workerinput"):
        return
    built = sorted(op for op, t in _built_ops().items() if _OPS_AT_START.get(op) != t)
    if built:
        names = ", ".join(built)
        terminalreporter.write_line(f"DeepSpeed ops the tests compiled, not `make install`: {names}")
