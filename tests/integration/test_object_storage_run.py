"""A run whose run.dir is on S3 (a real S3 server on 127.0.0.1, no shared POSIX folder for checkpoints).

One run, several checks: 2 Ray workers train and write their rank objects straight to the store; the
driver is SIGKILLed in the middle of committing its third checkpoint; `status` and `runs` read the
run from s3://; a corrupted object of the latest checkpoint is named by `verify`; `resume s3://...`
rejects that checkpoint and continues at 3 workers from the one before (reshard 2 -> 3).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, TINY

from elastictrain.checkpoint.store import CheckpointStore, verify
from elastictrain.rundir.run_dir import RunDir

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
TIMEOUT_S = 300


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


def _cli(env: dict[str, str], *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    run_env = dict(env)
    if crash_at:
        run_env["ELASTICTRAIN_CRASH_AT"] = crash_at
    proc = subprocess.Popen(
        [str(BIN / "elastictrain"), *args],
        cwd=REPO,
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own session: what it started (its Ray cluster) goes with it
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a SIGKILLed driver's local Ray cluster too
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _events(run: str, name: str) -> list[dict]:
    return [e for e in RunDir.open(run).read_events() if e["event"] == name]


def test_a_run_on_s3_survives_its_driver_and_resumes_resharded_past_a_corrupted_object(
    env: dict[str, str], s3_bucket: str
) -> None:
    run = f"{s3_bucket}/runs/tiny"
    ckpts = CheckpointStore(f"{run}/checkpoints")

    # 1. Two workers; the driver is killed while it writes the third checkpoint's manifest.
    first = _cli(env, "train", *_train_args(run), crash_at="manifest_partial@3")
    assert first.returncode == -signal.SIGKILL, first.stdout[-3000:]
    assert ckpts.listing().committed == ("step-000002", "step-000004")
    assert ckpts.listing().latest == "step-000004"
    unfinished = ckpts.root / "step-000006"
    assert sorted(p.name for p in unfinished.iterdir()) == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ], "each rank wrote its object straight to the store; only the manifest is missing"
    assert RunDir.open(run).read_info().status == "RUNNING"

    # 2. status and runs read it from the store, and say the driver is gone.
    status = _cli(env, "status", run)
    assert status.returncode == 0, status.stdout
    assert "status    RUNNING" in status.stdout and "NOT RUNNING" in status.stdout
    assert "checkpoints: step-000002, step-000004 (latest: step-000004)" in status.stdout
    assert "not used: step-000006: not a committed checkpoint: it has no manifest.json" in status.stdout
    runs = _cli(env, "runs", f"{s3_bucket}/runs")
    assert runs.returncode == 0, runs.stdout
    (line,) = [ln for ln in runs.stdout.splitlines() if run in ln]
    assert line.startswith("RUNNING") and "resume it" in line

    # 3. A byte of the latest checkpoint's object flipped: `verify` names the object.
    obj = ckpts.root / "step-000004" / "rank-00001-of-00002.safetensors"
    data = bytearray(obj.read_bytes())
    data[-10] ^= 0xFF
    obj.write_bytes(bytes(data))
    checked = _cli(env, "verify", run)
    assert checked.returncode == 1 and f"{obj}: sha256 differs from the manifest" in checked.stdout

    # 4. Resumed at 3 workers: step 4 is rejected, step 2 (saved by 2 workers) is loaded, resharded.
    resumed = _cli(env, "resume", run, "scaling.min_workers=3", "scaling.max_workers=3")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    info = RunDir.open(run).read_info()
    assert (info.status, info.last_step) == ("FINISHED", 8)
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
