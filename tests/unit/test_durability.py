"""Issue 12 point 9: new names in the run folder are fsynced; a crash's temporary files are cleaned."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from loop_harness import make_run

import elastictrain.storage.local as local_storage
from elastictrain.checkpoint.store import CheckpointStore
from elastictrain.rundir.run_dir import RunDir


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders fsynced, in order."""
    seen: list[Path] = []
    real = local_storage.fsync_dir

    def record(path: Path) -> None:
        seen.append(Path(path))
        real(path)

    monkeypatch.setattr(local_storage, "fsync_dir", record)
    return seen


def test_creating_events_jsonl_fsyncs_the_run_folder(tmp_path: Path, fsynced: list[Path]) -> None:
    rd = RunDir.create(tmp_path / "run", name="x", config_yaml="a: 1\n", config_digest="d")
    fsynced.clear()
    rd.append_event("first")
    assert rd.path in fsynced
    fsynced.clear()
    rd.append_event("second")  # an append to an existing file: its name is durable already
    assert rd.path not in fsynced


def test_creating_the_checkpoints_folder_fsyncs_the_run_folder(tmp_path: Path, fsynced: list[Path]) -> None:
    (tmp_path / "run").mkdir()
    CheckpointStore(tmp_path / "run" / "checkpoints").begin(4)
    assert fsynced == [tmp_path / "run"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temporary_files_a_crashed_driver_left_are_removed_at_the_next_start(tmp_path: Path) -> None:
    r: Any = make_run(tmp_path)
    run = r.run_dir.path
    stale = run / f".run.json.tmp-{_dead_pid()}"
    alive = run / f".run.json.tmp-{os.getppid()}"  # a live process's: it may be writing
    stale.write_text("{")
    alive.write_text("{")
    r.run()
    assert not stale.exists() and alive.exists()
    (removed,) = r.events("partial_checkpoints_removed")
    assert stale.name in removed["removed"]


def test_a_rank_removes_its_nvme_swap_folder_when_it_leaves_an_attempt(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from elastictrain.worker.actor import TrainWorker

    mine = tmp_path / "run-id" / "rank-1"
    other_run = tmp_path / "other-run" / "rank-1"
    for folder in (mine, other_run):
        folder.mkdir(parents=True)
        (folder / "swap.bin").write_bytes(b"x")
    worker = TrainWorker("w", False)
    zero = {"offload_optimizer": {"device": "nvme", "nvme_path": str(mine)}}
    worker.spec = SimpleNamespace(
        master_addr="127.0.0.1", master_port=1, ds_config={"zero_optimization": zero}
    )
    worker.teardown()
    assert not mine.exists() and other_run.exists()  # ranks may be reassigned; another run is untouched
