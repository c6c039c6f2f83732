"""The driver is lost or stopped: `elastictrain train` is SIGKILLed mid-run, then the run is inspected and
resumed; a driver is SIGTERMed mid-run and stops cleanly; while one runs, another on its folder is refused.

The driver is a real process that starts its own local Ray cluster (as `elastictrain train` without an
address does), so killing its session takes the cluster down with it, as losing a head pod would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers import REPO, TINY
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.rundir.run_dir import RunDir
from elastictrain.tracking.tracker import resolve_tracking_uri

pytestmark = pytest.mark.integration
cli = CliRunner()

BIN = Path(sys.executable).parent
MAX_STEPS = 10  # the kill, right after the step-2 checkpoint's commit, comes well before the end
RUN_TIMEOUT_S = 300


def _train_args(run: Path) -> list[str]:
    return [
        "-c",
        str(TINY),
        f"run.dir={run}",
        f"training.max_steps={MAX_STEPS}",
        "training.global_batch_size=4",
        "training.micro_batch_size=2",
        "training.warmup_steps=1",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=2",
        "data.generated_chars=40000",
        "failure.wait_for_capacity_s=60",
    ]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local cluster
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", DS_ACCELERATOR="cpu")
    return env


def _session(sid: int) -> list[psutil.Process]:
    """Every process of the session a driver was started in: the driver, its Ray cluster, the workers."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) == sid:
                found.append(p)
    return found


def _kill_session(sid: int) -> None:
    for p in _session(sid):
        with contextlib.suppress(psutil.Error):
            p.kill()


@pytest.fixture
def sessions() -> Iterator[list[int]]:
    """Sessions of the drivers a test starts: whatever is left of them is killed at teardown."""
    started: list[int] = []
    yield started
    for sid in started:
        _kill_session(sid)


def _start(args: list[str], log: Path, sessions: list[int]) -> subprocess.Popen:
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [str(BIN / "elastictrain"), *args],
            cwd=REPO,
            env=_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own session: the test can kill it and all it started
        )
    sessions.append(proc.pid)
    return proc


def _wait_for(predicate, proc: subprocess.Popen, log: Path, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the driver exited ({proc.returncode}) before {what}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} in {RUN_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


def _sigkill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the driver's process group: as `kill -9` of a job's driver
    proc.wait(timeout=30)


def _shm_buffers(run_dir: RunDir) -> list[str]:
    paths: list[str] = []
    for e in run_dir.read_events():
        if e.get("event") == "attempt_started":
            addr, _, port = e["master"].rpartition(":")
            paths += [str(p) for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{addr}_{port}_*")]
    return paths


def _cli(*args: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "elastictrain"), *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def test_a_killed_driver_loses_nothing_a_sigtermed_one_stops_cleanly_and_a_running_one_is_exclusive(
    tmp_path, sessions
):
    """A SIGKILLed driver's run resumes into the same MLflow run; then a `--fresh` driver on the folder
    is SIGTERMed (issue 12 points 1, 2 and 4: `ray job stop` or a pod's deletion), refusing a second
    driver and another `--fresh` while it runs. One folder: the --fresh driver is the SIGTERMed one."""
    run = tmp_path / "runs" / "tiny"
    log = tmp_path / "driver.log"
    driver = _start(["train", *_train_args(run)], log, sessions)
    latest = run / "checkpoints" / "latest"
    _wait_for(latest.is_file, driver, log, "committed checkpoint")
    _sigkill(driver)

    rd = RunDir.open(run)
    info = rd.read_info()
    assert info.status == "RUNNING" and info.last_step < MAX_STEPS, "the driver was killed too late"
    tag = latest.read_text().strip()  # the last committed checkpoint: what a resume must start from
    mlflow_run = info.mlflow_run_id
    assert mlflow_run

    # The local cluster the driver started dies with it: nothing of its session is left.
    deadline = time.monotonic() + 60
    while _session(driver.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _session(driver.pid), [p.cmdline() for p in _session(driver.pid)]
    # DeepSpeed's shared-memory all-reduce buffers of the killed group, if it made any (it does when
    # LOCAL_SIZE equals the world size; the cleanup itself is tested in tests/unit/test_liveness.py).
    left_behind = _shm_buffers(rd)

    # status tells that run.json's RUNNING is stale: its driver is gone.
    status = cli.invoke(app, ["status", str(run)])
    assert status.exit_code == 0, status.output
    out = status.output
    assert "status    RUNNING" in out and f"pid {driver.pid}" in out and "NOT RUNNING" in out, out
    assert f"elastictrain resume {run}" in out
    assert "world size history: 2 from step 0 (start)" in out and f"latest: {tag}" in out
    assert f"mlflow    run {mlflow_run}" in out and '"loss"' in out
    listing = cli.invoke(app, ["runs", str(tmp_path / "runs")])
    assert str(run) in listing.output and "driver not running: resume it" in listing.output

    resumed = _cli("resume", str(run))
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert f"resuming from checkpoint {tag}" in resumed.stdout
    info = rd.read_info()
    assert info.status == "FINISHED" and info.last_step == MAX_STEPS
    assert info.mlflow_run_id == mlflow_run and info.run_id == RunDir.open(run).read_info().run_id
    resumes = [e for e in rd.read_events() if e["event"] == "resume"]
    assert [e["tag"] for e in resumes] == [tag]
    for path in left_behind:
        assert not Path(path).exists(), f"{path} of the killed group was not removed"
    if left_behind:
        removed = [e for e in rd.read_events() if e["event"] == "shm_buffers_removed"]
        assert removed and set(left_behind) <= set(removed[0]["paths"])

    # One MLflow run holds every step's metrics: those the killed driver logged and the rest.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(resolve_tracking_uri(info.mlflow_tracking_uri, rd.path))
    steps = {m.step for m in client.get_metric_history(mlflow_run, "loss")}
    assert steps == set(range(1, MAX_STEPS + 1)), sorted(steps)
    assert client.get_run(mlflow_run).info.status == "FINISHED"

    status = cli.invoke(app, ["status", str(run)])
    assert "status    FINISHED" in status.output and "NOT RUNNING" not in status.output

    # A retried job (the same `train`) of a finished run: docs/guides/ray-job-submit.md's retried job
    # (test_readme_commands.py) and tests/unit/test_launch_messages.py.

    # Starting over in a used folder takes --fresh, which moves the old run aside.
    log = tmp_path / "fresh.log"
    args = [*_train_args(run), "training.max_steps=1000"]  # still running when the signal comes
    driver = _start(["train", "--fresh", "--no-tracking", *args], log, sessions)

    def new_run_started() -> bool:
        with contextlib.suppress(Exception):
            return RunDir.open(run).read_info().run_id != info.run_id
        return False

    _wait_for(new_run_started, driver, log, "new run in run.dir")
    aside = [p for p in run.parent.iterdir() if p.name.startswith("tiny.old-")]
    assert len(aside) == 1
    old = RunDir.open(aside[0]).read_info()
    assert old.run_id == info.run_id and old.status == "FINISHED"

    # While it runs, a second driver and --fresh are both refused (it holds the folder from its start).
    for extra in ([], ["--fresh"]):
        second = _cli("train", "--no-tracking", *extra, *args, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"is being driven by {os.uname().nodename}:{driver.pid} since" in second.stderr
    folders = sorted(p.name for p in run.parent.iterdir() if not p.name.startswith("."))
    assert folders == ["tiny", aside[0].name]  # the refused --fresh moved nothing aside

    latest = run / "checkpoints" / "latest"  # the new run's
    _wait_for(latest.is_file, driver, log, "committed checkpoint")
    t0 = time.monotonic()
    os.kill(driver.pid, signal.SIGTERM)  # the driver only, as Kubernetes signals a pod's main process
    assert driver.wait(timeout=30) == 130, log.read_text()[-4000:]
    assert time.monotonic() - t0 < 30
    rd = RunDir.open(run)
    info = rd.read_info()
    assert info.status == "STOPPED" and info.message == "stopped by SIGTERM", log.read_text()[-4000:]
    stop = [e for e in rd.read_events() if e["event"] == "stop"]
    assert stop and f"elastictrain resume {run}" in stop[-1]["message"]
    tag = latest.read_text().strip()
    assert _cli("verify", str(run / "checkpoints" / tag), timeout=120).returncode == 0
    assert not _shm_buffers(rd), "the stopped run left its /dev/shm buffers"
