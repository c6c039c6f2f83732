"""A driver is stopped: `elastictrain train` is SIGTERMed mid-run (`ray job stop`, a pod's deletion) and
stops cleanly, its run resumable; while it runs, a second driver and `--fresh` on its folder are refused.

The driver is a real process that starts its own local Ray cluster (as `elastictrain train` without an
address does). A driver SIGKILLed with its cluster, its run then inspected and resumed into the same
MLflow run, is test_object_storage_run.py's (with the run folder on S3) and test_chaos.py's (on a
cluster it did not start, the run folder local); `--fresh` moving a finished run aside is
tests/unit/test_run_lock.py's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from driver_sessions import BIN, shm_buffers, start
from helpers import REPO, TINY

from elastictrain.rundir.run_dir import RunDir

pytestmark = pytest.mark.integration

RUN_TIMEOUT_S = 300


def _train_args(run: Path) -> list[str]:
    return [
        "-c",
        str(TINY),
        f"run.dir={run}",
        "training.max_steps=1000",  # still running when the signal comes
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


def _wait_for(predicate, proc: subprocess.Popen, log: Path, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the driver exited ({proc.returncode}) before {what}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} in {RUN_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


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


def test_a_sigtermed_driver_stops_cleanly_and_a_running_one_is_exclusive(tmp_path, sessions):
    """Issue 12 points 2 and 4: a driver holds its folder from its start, refusing a second driver and
    `--fresh`; SIGTERMed, it stops within seconds, its run STOPPED and resumable from a verified
    checkpoint, its shared-memory buffers gone."""
    run = tmp_path / "runs" / "tiny"
    log = tmp_path / "driver.log"
    args = _train_args(run)
    driver = start(["train", "--no-tracking", *args], cwd=REPO, env=_env(), log=log, sessions=sessions)
    latest = run / "checkpoints" / "latest"
    _wait_for(latest.is_file, driver, log, "committed checkpoint")

    # While it runs, a second driver and --fresh are both refused (it holds the folder from its start).
    for extra in ([], ["--fresh"]):
        second = _cli("train", "--no-tracking", *extra, *args, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"is being driven by {os.uname().nodename}:{driver.pid} since" in second.stderr
    assert sorted(p.name for p in run.parent.iterdir() if not p.name.startswith(".")) == ["tiny"]

    os.kill(driver.pid, signal.SIGTERM)  # the driver only, as Kubernetes signals a pod's main process
    assert driver.wait(timeout=30) == 130, log.read_text()[-4000:]
    rd = RunDir.open(run)
    info = rd.read_info()
    assert info.status == "STOPPED" and info.message == "stopped by SIGTERM", log.read_text()[-4000:]
    stop = [e for e in rd.read_events() if e["event"] == "stop"]
    assert stop and f"elastictrain resume {run}" in stop[-1]["message"]
    tag = latest.read_text().strip()
    assert _cli("verify", str(run / "checkpoints" / tag), timeout=120).returncode == 0
    assert not shm_buffers(rd), "the stopped run left its /dev/shm buffers"
