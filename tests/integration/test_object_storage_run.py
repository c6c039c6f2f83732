"""A run whose run.dir is on S3 (a real S3 server on 127.0.0.1, no shared POSIX folder for checkpoints),
whose driver is lost.

One run, several checks: 2 Ray workers train and write their rank objects straight to the store; the
driver is SIGKILLed in the middle of committing its third checkpoint, and the local Ray cluster it
started dies with it; `status` and `runs` read the run from s3:// and say its driver is gone; a
corrupted object of the latest checkpoint is named by `verify`; `resume s3://...` rejects that
checkpoint, continues at 3 workers from the one before (reshard 2 -> 3) into the same MLflow run, and
removes the killed group's shared-memory buffers. (A driver stopped by SIGTERM, and the refusal of a
second driver: test_driver_loss.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from driver_sessions import names, session_processes, shm_buffers, start
from helpers import REPO, TINY

from elastictrain.checkpoint.store import CheckpointStore, verify
from elastictrain.rundir.run_dir import RunDir
from elastictrain.tracking.run_tracker import tracking_uri_of

pytestmark = pytest.mark.integration

TIMEOUT_S = 300
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _train_args(run: str) -> list[str]:
    return [
        "-c",
        str(TINY),
        f"run.dir={run}",
        "training.max_steps=8",
        "training.global_batch_size=6",  # splits at 2 and at 3 workers
        "training.micro_batch_size=3",
        "training.warmup_steps=1",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=2",
        "data.generated_chars=40000",
        "scaling.max_workers=2",
        "ray.num_cpus=3",
        "failure.wait_for_capacity_s=60",
    ]


@pytest.fixture
def env(s3_server: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The drivers' environment: the S3 server's AWS_* variables (the workers inherit them), their
    own local Ray cluster each, and a local folder for what stays on the driver's machine."""
    out = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ELASTICTRAIN_CRASH_AT")}
    out.update(s3_server)
    out.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        DS_ACCELERATOR="cpu",
        ELASTICTRAIN_CACHE=str(tmp_path / "cache"),
    )
    return out


def _cli(
    env: dict[str, str], sessions: list[int], *args: str, crash_at: str | None = None
) -> subprocess.CompletedProcess[str]:
    run_env = dict(env)
    if crash_at:
        run_env["ELASTICTRAIN_CRASH_AT"] = crash_at
    log = Path(env["ELASTICTRAIN_CACHE"]).parent / f"cli-{len(sessions)}.log"
    proc = start(list(args), cwd=REPO, env=run_env, log=log, sessions=sessions)
    proc.wait(timeout=TIMEOUT_S)
    return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), "")


def _events(run: str, name: str) -> list[dict]:
    return [e for e in RunDir.open(run).read_events() if e["event"] == name]


def test_a_run_on_s3_survives_its_driver_and_resumes_resharded_past_a_corrupted_object(
    env: dict[str, str], s3_bucket: str, sessions: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = f"{s3_bucket}/runs/tiny"
    ckpts = CheckpointStore(f"{run}/checkpoints")

    # 1. Two workers; the driver is killed while it writes the third checkpoint's manifest.
    first = _cli(env, sessions, "train", *_train_args(run), crash_at="manifest_partial@3")
    assert first.returncode == -signal.SIGKILL, first.stdout[-3000:]
    assert ckpts.listing().committed == ("step-000002", "step-000004")
    assert ckpts.listing().latest == "step-000004"
    unfinished = ckpts.root / "step-000006"
    assert sorted(p.name for p in unfinished.iterdir()) == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ], "each rank wrote its object straight to the store; only the manifest is missing"
    info = RunDir.open(run).read_info()
    assert info.status == "RUNNING" and info.mlflow_run_id
    # The local Ray cluster the driver started dies with it (only the driver was killed): its GCS,
    # raylet and workers go. Ray's dashboard and runtime-env agents exit on their own once they find
    # their raylet gone (1-2 minutes on this machine); the teardown kills them.
    driver = sessions[-1]

    def left() -> list[str]:
        return [name for name in names(session_processes(driver)) if name not in RAY_AGENTS]

    deadline = time.monotonic() + 60
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left()
    # DeepSpeed's shared-memory all-reduce buffers of the killed group, if it made any (it does when
    # LOCAL_SIZE equals the world size; the cleanup itself is tested in tests/unit/test_liveness.py).
    left_behind = shm_buffers(RunDir.open(run))

    # 2. status and runs read it from the store, and say the driver is gone.
    status = _cli(env, sessions, "status", run)
    assert status.returncode == 0, status.stdout
    out = status.stdout
    assert "status    RUNNING" in out and f"pid {driver}" in out and "NOT RUNNING" in out, out
    assert f"elastictrain resume {run}" in out and "world size history: 2 from step 0 (start)" in out
    assert "checkpoints: step-000002, step-000004 (latest: step-000004)" in out
    assert "not used: step-000006: not a committed checkpoint: it has no manifest.json" in out
    assert f"mlflow    run {info.mlflow_run_id}" in out and '"loss"' in out
    runs = _cli(env, sessions, "runs", f"{s3_bucket}/runs")
    assert runs.returncode == 0, runs.stdout
    (line,) = [ln for ln in runs.stdout.splitlines() if run in ln]
    assert line.startswith("RUNNING") and "driver not running: resume it" in line

    # 3. A byte of the latest checkpoint's object flipped: `verify` names the object.
    obj = ckpts.root / "step-000004" / "rank-00001-of-00002.safetensors"
    data = bytearray(obj.read_bytes())
    data[-10] ^= 0xFF
    obj.write_bytes(bytes(data))
    checked = _cli(env, sessions, "verify", run)
    assert checked.returncode == 1 and f"{obj}: sha256 differs from the manifest" in checked.stdout

    # 4. Resumed at 3 workers: step 4 is rejected, step 2 (saved by 2 workers) is loaded, resharded.
    resumed = _cli(env, sessions, "resume", run, "scaling.min_workers=3", "scaling.max_workers=3")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resuming from checkpoint step-000002" in resumed.stdout, resumed.stdout[-3000:]
    rd = RunDir.open(run)
    resumed_info = rd.read_info()
    assert (resumed_info.status, resumed_info.last_step) == ("FINISHED", 8)
    assert (resumed_info.run_id, resumed_info.mlflow_run_id) == (info.run_id, info.mlflow_run_id)
    (rejected,) = _events(run, "checkpoint_rejected")
    assert rejected["tag"] == "step-000004" and "rank-00001-of-00002" in json.dumps(rejected["problems"])
    (removed,) = _events(run, "partial_checkpoints_removed")
    assert "step-000006" in removed["removed"]
    started = _events(run, "attempt_started")[-1]
    assert (started["world_size"], started["checkpoint"]) == (3, "step-000002")
    assert ckpts.listing().committed == ("step-000006", "step-000008")  # keep_last=2
    for tag in ckpts.listing().committed:
        manifest = ckpts.manifest(tag)
        assert manifest["world_size"] == 3 and len(manifest["files"]) == 3
        assert verify(ckpts.root / tag).ok
    for path in left_behind:
        assert not Path(path).exists(), f"{path} of the killed group was not removed"
    if left_behind:
        (cleaned,) = _events(run, "shm_buffers_removed")
        assert set(left_behind) <= set(cleaned["paths"])

    # One MLflow run holds every step's metrics: those the killed driver logged and the rest.
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("ELASTICTRAIN_CACHE", env["ELASTICTRAIN_CACHE"])  # the drivers' local state
    client = MlflowClient(tracking_uri_of(rd, None))
    steps = {m.step for m in client.get_metric_history(info.mlflow_run_id, "loss")}
    assert steps == set(range(1, 9)), sorted(steps)
    assert client.get_run(info.mlflow_run_id).info.status == "FINISHED"
    status = _cli(env, sessions, "status", run)
    assert "status    FINISHED" in status.stdout and "NOT RUNNING" not in status.stdout
