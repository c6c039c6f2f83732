"""Checkpoints on an object store (a real S3 server on 127.0.0.1): committed without a rename.

Ranks' objects go straight into `step-NNNNNN/`; the manifest written after all of them is the commit,
`latest` follows. A save killed (SIGKILL) at each phase of the commit, in a child process running the
real store and storage code, must leave a checkpoint a resume can load; a corrupted object is named by
verification; an unfinished save is removed at the next start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from elastictrain.checkpoint.choice import choose_checkpoint
from elastictrain.checkpoint.store import CheckpointStore, verify
from elastictrain.storage import ObjectPath, as_path, storage_of

pytestmark = pytest.mark.integration

SAVE_TWO_CHECKPOINTS = textwrap.dedent(
    """
    import sys
    from elastictrain.checkpoint.store import CheckpointStore
    from elastictrain.storage import storage_of

    store = CheckpointStore(sys.argv[1])
    for step in (4, 8):
        folder = store.begin(step)
        files = []
        for rank in range(2):  # what each rank's ShardWrite does, one after the other
            name = f"rank-{rank:05d}-of-00002.safetensors"
            data = bytes([step, rank]) * 50_000
            digest = storage_of(folder).write(folder / name, data)
            files.append({"name": name, "bytes": len(data), "sha256": digest})
        store.commit(step, folder, files, {"world_size": 2, "samples_consumed": step * 12})
    print("both committed")
    """
)

# (phase@occurrence, the checkpoint a resume must pick, objects of the unfinished save left behind):
# the second save is killed at each phase. No rename on an object store: the manifest's upload is the
# commit, so once it is written the new checkpoint counts even before `latest` names it.
PHASES = [
    ("shard_partial@3", "step-000004", False),  # rank 0's upload cut half-way: no object at all
    ("shard_written@3", "step-000004", True),  # rank 0's object there, rank 1's not
    ("manifest_partial@2", "step-000004", True),  # the manifest's upload cut half-way: no manifest
    ("manifest_written@2", "step-000008", False),  # committed, `latest` not moved yet
    ("committed@2", "step-000008", False),  # control: killed right after the commit
]


def _save(root: str, crash_at: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ELASTICTRAIN_CRASH_AT"}
    if crash_at:
        env["ELASTICTRAIN_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, "-c", SAVE_TWO_CHECKPOINTS, root],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(("phase", "expected", "leftovers"), PHASES)
def test_a_save_killed_at_any_phase_of_an_object_store_commit_leaves_a_loadable_checkpoint(
    s3_bucket: str, phase: str, expected: str, leftovers: bool
) -> None:
    root = f"{s3_bucket}/runs/r/checkpoints"
    proc = _save(root, phase)
    assert proc.returncode == -9, f"the save was not killed at {phase}: {proc.stdout}{proc.stderr}"
    store = CheckpointStore(root)
    found = store.latest_committed()
    assert found is not None and found.tag == expected
    assert verify(found.path).ok, verify(found.path).problems
    # What the next driver removes at its start: a step folder whose manifest never landed.
    assert store.clean_partials() == (["step-000008"] if leftovers else [])
    assert (store.root / "step-000008").is_dir() is (expected == "step-000008")
    assert store.latest_committed().tag == expected  # cleaning never touches a committed checkpoint


def test_object_store_checkpoints_are_listed_verified_pruned_and_a_corrupted_object_is_named(
    s3_bucket: str,
) -> None:
    root = f"{s3_bucket}/runs/r/checkpoints"
    assert _save(root, None).returncode == 0
    store = CheckpointStore(root)
    assert store.listing().committed == ("step-000004", "step-000008")
    assert store.listing().latest == "step-000008"
    assert choose_checkpoint(f"{s3_bucket}/runs/r").path == as_path(f"{root}/step-000008")

    obj = store.root / "step-000008" / "rank-00001-of-00002.safetensors"
    assert isinstance(obj, ObjectPath)
    data = bytearray(obj.read_bytes())
    data[100] ^= 0xFF  # one flipped bit pattern, same size: only the checksum can tell
    obj.write_bytes(bytes(data))
    problems = verify(store.root / "step-000008").problems
    assert problems == [f"{obj}: sha256 differs from the manifest (corrupted)"]
    assert store.latest_committed(rejected=("step-000008",)).tag == "step-000004"

    # Pruning deletes the manifest first (uncommitted at once), then the rest of the folder.
    assert store.prune(keep_last=1) == ["step-000004"]
    assert not (store.root / "step-000004").exists()
    assert store.listing().committed == ("step-000008",)


def test_a_failed_upload_leaves_no_object(s3_bucket: str) -> None:
    path = as_path(f"{s3_bucket}/x/rank-00000-of-00001.safetensors")
    with pytest.raises(RuntimeError, match="disk on fire"), storage_of(path).create(path) as out:
        out.write(b"a" * 1000)
        raise RuntimeError("disk on fire")
    assert not path.exists()
    with storage_of(path).create(path) as out:
        out.write(b"b" * 10)
        out.write(b"c" * 5)
    assert (path.read_bytes(), out.size) == (b"b" * 10 + b"c" * 5, 15)
