"""Issue 6.1/6.2/6.5: a save killed (SIGKILL) at any phase, a corrupted file, a full disk.

The save runs the real commit code (CheckpointStore + the durable writes the workers use) in a child
process that kills itself at a named phase (ELASTICTRAIN_CRASH_AT); the parent then checks what a
resume would see.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from elastictrain.checkpoint.store import CheckpointError, CheckpointStore, verify
from elastictrain.storage.durable import write_bytes_durably

SAVE_TWO_CHECKPOINTS = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from elastictrain.checkpoint.store import CheckpointStore
    from elastictrain.storage.durable import write_bytes_durably

    store = CheckpointStore(Path(sys.argv[1]))
    for step in (4, 8):
        staging = store.begin(step)
        files = []
        for rank in range(2):  # what each rank's save_shard does, one after the other
            name = f"rank-{rank:05d}-of-00002.safetensors"
            data = bytes([step, rank]) * 50_000
            digest = write_bytes_durably(staging / name, data)
            files.append({"name": name, "bytes": len(data), "sha256": digest})
        store.commit(step, staging, files, {"world_size": 2, "samples_consumed": step * 12})
    print("both committed")
    """
)

# (phase@occurrence, the checkpoint a resume must pick): the second save is killed at each phase.
PHASES = [
    ("shard_partial@3", "step-000004"),  # rank 0's file of the 2nd save half written
    ("shard_written@3", "step-000004"),  # rank 0 finished, rank 1 not
    ("manifest_partial@2", "step-000004"),  # manifest torn
    ("manifest_written@2", "step-000004"),  # manifest fsynced, folder not renamed yet
    ("renamed@2", "step-000008"),  # committed by the rename, `latest` not moved yet
    ("latest_tmp_written@2", "step-000008"),  # new `latest` written aside, not replaced yet
    ("committed@2", "step-000008"),  # control: killed right after the commit
]


@pytest.mark.parametrize(("phase", "expected"), PHASES)
def test_a_save_killed_at_any_phase_never_leaves_a_checkpoint_that_loads_as_complete(
    tmp_path: Path, phase: str, expected: str
) -> None:
    root = tmp_path / "checkpoints"
    child = subprocess.run(
        [sys.executable, "-c", SAVE_TWO_CHECKPOINTS, str(root)],
        env={**os.environ, "ELASTICTRAIN_CRASH_AT": phase},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == -9, (child.returncode, child.stdout, child.stderr)  # SIGKILL
    assert "both committed" not in child.stdout

    store = CheckpointStore(root)
    chosen = store.latest_committed()
    assert chosen is not None and chosen.tag == expected
    assert verify(chosen.path).ok, verify(chosen.path).problems
    # Every folder a resume could pick verifies: nothing partial looks committed.
    for tag in store.listing().committed:
        assert verify(root / tag).ok, tag
    leftovers = store.clean_partials()
    if expected == "step-000004" or phase.startswith("latest_tmp"):
        assert leftovers, "the partial save is reported (and removed)"
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


def test_a_crash_while_an_old_checkpoint_is_deleted_leaves_no_half_deleted_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in (4, 8, 12):
        staging = store.begin(step)
        data = b"x" * 1000
        entry = {
            "name": "rank-0.safetensors",
            "bytes": 1000,
            "sha256": write_bytes_durably(staging / "r", data),
        }
        os.rename(staging / "r", staging / "rank-0.safetensors")
        store.commit(step, staging, [entry], {})
    # A delete is a rename out of sight first: simulate the crash right after that rename.
    os.rename(tmp_path / "step-000004", tmp_path / ".trash-step-000004-1-1")
    assert store.listing().committed == ("step-000008", "step-000012")
    assert store.clean_partials() == [".trash-step-000004-1-1"]
    assert store.prune(keep_last=1) == ["step-000008"]
    assert store.listing().committed == ("step-000012",)


def make_checkpoints(root: Path, steps: tuple[int, ...] = (4, 8)) -> CheckpointStore:
    store = CheckpointStore(root)
    for step in steps:
        staging = store.begin(step)
        files = []
        for rank in range(2):
            name = f"rank-{rank:05d}-of-00002.safetensors"
            data = os.urandom(300_000)
            files.append(
                {"name": name, "bytes": len(data), "sha256": write_bytes_durably(staging / name, data)}
            )
        store.commit(step, staging, files, {"world_size": 2})
    return store


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "missing"])
def test_verification_names_the_damaged_file_and_the_previous_checkpoint_is_chosen(
    tmp_path: Path, damage: str
) -> None:
    store = make_checkpoints(tmp_path)
    victim = tmp_path / "step-000008" / "rank-00001-of-00002.safetensors"
    if damage == "truncated":
        os.truncate(victim, 1000)
    elif damage == "corrupted":
        data = bytearray(victim.read_bytes())
        data[12345] ^= 0x01
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    result = verify(tmp_path / "step-000008")
    assert len(result.problems) == 1 and str(victim) in result.problems[0]
    assert {"truncated": "bytes, manifest says", "corrupted": "sha256 differs", "missing": "missing"}[
        damage
    ] in result.problems[0]
    assert store.latest_committed(rejected=("step-000008",)).tag == "step-000004"
    assert verify(tmp_path / "step-000004").ok


def test_a_manifest_cannot_point_outside_its_folder(tmp_path: Path) -> None:
    store = make_checkpoints(tmp_path, (4,))
    manifest_path = tmp_path / "step-000004" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][0]["name"] = "../../etc/passwd"
    manifest_path.write_text(json.dumps(manifest))
    assert "points outside the checkpoint folder" in verify(store.root / "step-000004").problems[0]


def test_a_full_disk_while_committing_keeps_the_previous_checkpoint_and_leaves_no_torn_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC injected at the manifest write (the integration test fills a real tmpfs instead)."""
    store = make_checkpoints(tmp_path, (4,))
    staging = store.begin(8)
    import elastictrain.storage.local as local_storage  # the writes of a checkpoint on a local disk

    def full(path: Path, data: bytes) -> str:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(local_storage, "write_bytes_durably", full)
    with pytest.raises(OSError) as e:
        store.commit(8, staging, [], {})
    assert e.value.errno == errno.ENOSPC
    store.abandon(staging)
    assert store.latest_committed().tag == "step-000004" and verify(tmp_path / "step-000004").ok
    assert not staging.exists()
    with pytest.raises(CheckpointError):
        store.manifest("step-000008")


# ---------------------------------------------------------------- with real training (Ray, DeepSpeed)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):  # noqa: ANN201
    """A real 16 MiB tmpfs: writes beyond it fail with ENOSPC, as on a full disk. Needs root."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); the ENOSPC unit test covers it")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.integration
def test_a_full_disk_skips_the_save_training_goes_on_and_the_next_save_retries(
    ray_local, tmp_path, tiny_tmpfs
):
    from helpers import at_step, chain, run, tiny_config

    cfg = tiny_config(tmp_path / "run")
    checkpoints = tiny_tmpfs / "checkpoints"
    checkpoints.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(checkpoints)  # only the checkpoints live on the small disk
    filler = tiny_tmpfs / "filler"
    seen: dict[str, object] = {}

    def fill_the_disk(controller: Any) -> None:  # after step-000004 is committed
        controller.saves.finish(controller.step)  # written in the background: wait for its commit
        size = sum(f.stat().st_size for f in (checkpoints / "step-000004").iterdir())
        free = os.statvfs(tiny_tmpfs).f_bavail * os.statvfs(tiny_tmpfs).f_frsize
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, free - size // 2))  # room for half a checkpoint
        seen["size"] = size

    def free_the_disk(controller: Any) -> None:  # after the failed save at step 8
        controller.saves.finish(controller.step)  # the background write's failure is handled by now
        seen["step4_ok_after_failure"] = verify(checkpoints / "step-000004").ok
        seen["leftovers"] = [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]
        filler.unlink()

    summary, rd, terminal = run(cfg, hook=chain(at_step(5, fill_the_disk), at_step(9, free_the_disk)))
    assert summary.status.value == "FINISHED", terminal
    events = rd.read_events()
    failed = [e for e in events if e["event"] == "checkpoint_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 8, terminal
    assert "No space left on device" in failed[0]["reason"]
    assert "NOT saved" in terminal and "training goes on from memory" in terminal
    assert "step-000004 stays intact" in terminal
    assert seen["step4_ok_after_failure"] is True and seen["leftovers"] == []
    # Training went on without a restart: no failure, one attempt, no step redone.
    assert not [e for e in events if e["event"] in ("failure", "recovered")]
    assert len([e for e in events if e["event"] == "attempt_started"]) == 1
    committed = [e["tag"] for e in events if e["event"] == "checkpoint"]
    assert committed == ["step-000004", "step-000012"], "the next save retried and worked"
    assert verify(checkpoints / "step-000012").ok
