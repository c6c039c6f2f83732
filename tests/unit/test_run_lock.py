"""Issue 12 points 1-2: one driver per run folder (a flock plus a lease with owner and heartbeat); `--fresh`
moves a finished run aside."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.rundir.lock import RunFolderBusy, RunLock, lock_path

TINY = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"

HOLDER = """
import sys, time
from elastictrain.rundir.lock import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def other_driver(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """A second process (another driver) holding tmp_path/run."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield run, proc
    proc.kill()
    proc.wait()


def test_second_driver_is_refused_naming_the_owner(other_driver: tuple[Path, subprocess.Popen[str]]) -> None:
    run, proc = other_driver
    with pytest.raises(RunFolderBusy) as e:
        RunLock(run).acquire()
    assert f"is being driven by {socket.gethostname()}:{proc.pid} since" in str(e.value)
    assert "stop it first or wait" in str(e.value)


def test_lock_is_free_again_once_the_owner_dies(other_driver: tuple[Path, subprocess.Popen[str]]) -> None:
    run, proc = other_driver
    proc.kill()
    proc.wait()
    with RunLock(run) as lock:  # flock released by the OS; the lease names a dead local pid
        assert lock.read_owner()["pid"] == os.getpid()  # type: ignore[index]


def test_fresh_on_a_running_run_is_refused_and_nothing_moves(
    other_driver: tuple[Path, subprocess.Popen[str]],
) -> None:
    run, proc = other_driver
    run.mkdir()
    (run / "run.json").write_text("{}")
    result = CliRunner().invoke(app, ["train", "-c", str(TINY), "--fresh", f"run.dir={run}"])
    assert result.exit_code == 2, result.output
    assert f"is being driven by {socket.gethostname()}:{proc.pid}" in result.output
    assert sorted(p.name for p in run.parent.iterdir() if not p.name.startswith(".")) == ["run"]


def test_resume_of_a_running_run_is_refused(other_driver: tuple[Path, subprocess.Popen[str]]) -> None:
    run, proc = other_driver
    result = CliRunner().invoke(app, ["resume", str(run), "--no-tracking"])
    assert result.exit_code == 2 and f":{proc.pid} since" in result.output, result.output


def _lease(tmp_path: Path, owner: dict[str, object], age_s: float) -> Path:
    """A lease written by a driver on another node (its flock not visible here, as on NFS)."""
    run = tmp_path / "run"
    path = lock_path(run)
    path.write_text(json.dumps(owner))
    t = time.time() - age_s
    os.utime(path, (t, t))
    return run


def test_live_lease_of_another_host_is_respected_where_flock_is_not_shared(tmp_path: Path) -> None:
    run = _lease(tmp_path, {"host": "node-7", "pid": 4242, "since": "2026-01-01T00:00:00"}, age_s=5)
    with pytest.raises(RunFolderBusy, match="being driven by node-7:4242 since 2026-01-01T00:00:00"):
        RunLock(run, ttl_s=60).acquire()


def test_expired_lease_of_another_host_is_taken_over(tmp_path: Path) -> None:
    run = _lease(tmp_path, {"host": "node-7", "pid": 4242, "since": "x"}, age_s=120)
    with RunLock(run, ttl_s=60) as lock:
        assert lock.read_owner()["host"] == socket.gethostname()  # type: ignore[index]


def test_lease_of_a_dead_local_pid_is_taken_over_at_once(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = _lease(tmp_path, {"host": socket.gethostname(), "pid": dead.pid, "process_started": 1.0}, age_s=0)
    with RunLock(run, ttl_s=600):
        pass


def test_heartbeat_keeps_the_lease_fresh_and_release_clears_it(tmp_path: Path) -> None:
    lock = RunLock(tmp_path / "run", heartbeat_s=0.05).acquire()
    path = lock_path(tmp_path / "run")
    old = time.time() - 100
    os.utime(path, (old, old))
    time.sleep(0.3)
    assert time.time() - path.stat().st_mtime < 5
    lock.release()
    assert lock.read_owner() is None
    RunLock(tmp_path / "run").acquire().release()  # free again


def test_fresh_moves_a_finished_run_aside_and_starts_a_new_one_in_its_folder(tmp_path: Path) -> None:
    from elastictrain.config import load_config
    from elastictrain.driver.launch import prepare_run_dir
    from elastictrain.rundir.run_dir import RunDir

    run = tmp_path / "runs" / "tiny"
    config = load_config(TINY, [f"run.dir={run}"])
    first, resumed = prepare_run_dir(config, fresh=False)
    first_id = first.read_info().run_id
    assert not resumed
    first.update(status="FINISHED")
    (run / "checkpoints").mkdir()
    again, resumed = prepare_run_dir(config, fresh=False)  # the same config: that run, continued
    assert resumed and again.read_info().run_id == first_id

    new, resumed = prepare_run_dir(config, fresh=True)
    assert not resumed and new.read_info().run_id != first_id
    assert new.read_info().status != "FINISHED" and not (run / "checkpoints").exists()
    (aside,) = [p for p in run.parent.iterdir() if p.name.startswith("tiny.old-")]
    old = RunDir.open(aside).read_info()
    assert old.run_id == first_id and old.status == "FINISHED"
    assert (aside / "checkpoints").is_dir()
