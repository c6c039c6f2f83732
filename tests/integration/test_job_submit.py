"""`ray job submit` of `elastictrain train` to a real Ray cluster started with `ray start` on loopback.

The cluster (a head and one worker node, one CPU each) is this module's own: its own temp dir and
free ports, so it never meets other Ray clusters on the machine, and it is stopped at teardown by
signalling the `ray start --block` processes this module started (never `ray stop`, which would stop
every Ray cluster of this user on the machine).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import REPO

from elastictrain.rundir.run_dir import RunDir

pytestmark = pytest.mark.integration
pytest.importorskip(
    "aiohttp_cors", reason="`ray job submit` needs Ray's dashboard: pip install 'ray[default]'"
)

BIN = Path(sys.executable).parent  # the venv's bin: ray, elastictrain
START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 240

# Ray rewrites 127.0.0.1 in a worker node's --address/--node-ip-address to the machine's outbound
# address (its servers would then listen on every interface), and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
# which keeps the head on loopback, makes `ray start --address` refuse to start. So the worker node
# runs Ray's own `ray start` entry point with that one rewrite disabled: every server stays on 127.0.0.1.
WORKER_NODE_LAUNCHER = (
    "import sys, ray._private.services as s; s.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; sys.exit(main())"
)

TRAIN = [
    "elastictrain",
    "train",
    "-c",
    "conf/tiny-cpu.yaml",
    "training.max_steps=6",
    "training.global_batch_size=4",
    "training.micro_batch_size=2",
    "training.warmup_steps=1",
    "checkpoint.every_steps=2",
    "data.generated_chars=40000",
    "failure.wait_for_capacity_s=30",
]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _node_ports() -> list[str]:
    p = _free_ports(6)
    return [
        f"--node-manager-port={p[0]}",
        f"--object-manager-port={p[1]}",
        f"--dashboard-agent-listen-port={p[2]}",
        f"--dashboard-agent-grpc-port={p[3]}",
        f"--metrics-export-port={p[4]}",
        f"--runtime-env-agent-port={p[5]}",
    ]


@dataclass
class RayCluster:
    temp_dir: Path
    dashboard: str  # what `ray job submit --address` takes
    env: dict[str, str]  # for the `ray` CLI: the cluster's auth token
    procs: list[subprocess.Popen] = field(default_factory=list)

    def ray(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "ray"), *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def submit(self, *entrypoint: str, sid: str, wait: bool = True) -> subprocess.Popen[str]:
        """`ray job submit --working-dir .` from the repo root, as a user types it (streams the logs)."""
        cmd = [str(BIN / "ray"), "job", "submit", "--address", self.dashboard, "--working-dir", "."]
        cmd += ["--submission-id", sid] + ([] if wait else ["--no-wait"]) + ["--", *entrypoint]
        return subprocess.Popen(
            cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def status(self, sid: str) -> str:
        """The job's final state as `ray job status` words it: succeeded, failed or stopped."""
        out = self.ray("job", "status", sid, "--address", self.dashboard).stdout
        found = re.search(rf"Job '{re.escape(sid)}' (?:was )?(succeeded|failed|stopped)", out)
        return found.group(1) if found else out

    def logs(self, sid: str) -> str:
        return self.ray("job", "logs", sid, "--address", self.dashboard).stdout


def _wait_started(proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if "Ray runtime started" in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not start:\n{log.read_text(errors='replace')[-3000:]}")


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each `ray start --block` (it stops its node's processes), then SIGKILL what is left."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    for p in reversed(procs):
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        # Each was started in a session of its own: its process group holds only what it started.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    # Short: Ray's socket paths live under it and must fit in 107 characters.
    temp_dir = Path(tempfile.mkdtemp(prefix="etjob-", dir="/tmp"))
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    base.update(
        PATH=f"{BIN}{os.pathsep}{base.get('PATH', '')}",  # the job's entrypoint finds `elastictrain`
        DS_ACCELERATOR="cpu",
        # A token of this cluster's own, shared by its nodes and the CLI (not ~/.ray/auth_token).
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=uuid.uuid4().hex,
    )
    head_env = {**base, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    worker_env = {k: v for k, v in base.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    gcs, dashboard, client = _free_ports(3)
    common = [f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--block"]
    common += ["--object-store-memory=100000000"]
    head_cmd = [str(BIN / "ray"), "start", "--head", f"--port={gcs}", "--dashboard-host=127.0.0.1"]
    head_cmd += [f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}"]
    head_cmd += common + _node_ports()
    worker_cmd = [str(BIN / "python"), "-c", WORKER_NODE_LAUNCHER, "start", f"--address=127.0.0.1:{gcs}"]
    worker_cmd += common + _node_ports()

    procs: list[subprocess.Popen] = []
    try:
        for name, cmd, env in (("head", head_cmd, head_env), ("worker", worker_cmd, worker_env)):
            log = temp_dir / f"{name}.log"
            with open(log, "w") as f:
                procs.append(
                    subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
                )
            _wait_started(procs[-1], log, f"the Ray {name} node")
        yield RayCluster(temp_dir, f"http://127.0.0.1:{dashboard}", base, procs)
    finally:
        _stop(procs)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _communicate(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"`ray job submit` did not end in {JOB_TIMEOUT_S}s:\n{out[-4000:]}") from None
    return proc.returncode, out


def test_submitted_training_streams_progress_and_succeeds_then_a_resubmission_continues_it(cluster, tmp_path):
    run = tmp_path / "run"  # absolute: the job runs in a copy of the working dir
    code, out = _communicate(cluster.submit(*TRAIN, f"run.dir={run}", sid="train-ok"))
    assert code == 0, out[-4000:]
    assert cluster.status("train-ok") == "succeeded"
    # Progress reaches the submitter while the job runs: one plain line per step, then the end.
    for step in range(1, 7):
        assert f"step {step}/6 loss" in out, out[-4000:]
    assert "connected to Ray at 127.0.0.1:" in out and "finished at step 6" in out
    assert "finished at step 6" in cluster.logs("train-ok")

    info = RunDir.open(run).read_info()
    assert info.status == "FINISHED" and info.last_step == 6
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000006"
    assert (run / "config.yaml").is_file() and info.mlflow_run_id
    assert [h["world_size"] for h in info.world_size_history] == [2]
    events = [e["event"] for e in RunDir.open(run).read_events()]
    # The run's plots are drawn from its finished events, so their event comes after `finish`.
    assert events.count("start") == 1 and events[-2:] == ["finish", "plots"]

    # The upload is the repo's own files: .gitignore'd folders (.venv, caches, runs/) stay behind.
    unpacked = cluster.temp_dir.glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*")
    packages = [p for p in unpacked if p.is_dir()]
    assert packages, "the working dir package was not found"
    for pkg in packages:
        assert (pkg / "conf" / "tiny-cpu.yaml").is_file() and (pkg / "src" / "elastictrain").is_dir()
        assert not (pkg / ".venv").exists() and not (pkg / ".git").exists()
        size = sum(f.stat().st_size for f in pkg.rglob("*") if f.is_file())
        assert size < 20_000_000, f"working dir upload of {size} bytes: something large is not ignored"

    # A retried job (same command, same run.dir) continues the run instead of starting it over.
    code, again = _communicate(cluster.submit(*TRAIN, f"run.dir={run}", sid="train-again"))
    assert code == 0, again[-4000:]
    assert "already holds this run: continuing it" in again and "already finished at step 6" in again
    assert RunDir.open(run).read_info().run_id == info.run_id
    assert [e["event"] for e in RunDir.open(run).read_events()].count("start") == 1


def test_a_job_whose_run_fails_ends_failed_with_the_reason_in_the_job_logs(cluster, tmp_path):
    # Valid config, but the run needs 3 workers and the cluster has 2 CPUs: it fails at runtime. A bad
    # config leaves through the same error exit (cli/output.py's fail); test_cli.py checks its message.
    too_big = [
        f"run.dir={tmp_path / 'b'}",
        "scaling.min_workers=3",
        "scaling.max_workers=3",
        "training.global_batch_size=6",
        "failure.wait_for_capacity_s=2",
    ]
    code, out = _communicate(cluster.submit(*TRAIN, *too_big, sid="no-capacity"))
    assert code != 0 and cluster.status("no-capacity") == "failed", out[-3000:]
    logs = cluster.logs("no-capacity")
    assert "run ended FAILED" in logs and "failure.wait_for_capacity_s" in logs, logs[-3000:]
    assert "scaling.min_workers=3" in logs
    info = RunDir.open(tmp_path / "b").read_info()
    assert info.status == "FAILED" and "wait_for_capacity_s" in (info.message or "")
