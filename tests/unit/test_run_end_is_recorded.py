"""How a run ends is true and recorded: FINISHED only with max_steps committed, any error in run.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from loop_harness import at_step, make_run

from elastictrain.checkpoint.store import verify


def test_a_worker_dying_in_the_last_segments_save_does_not_finish_the_run_without_its_checkpoint(
    tmp_path: Path,
):
    r = make_run(tmp_path, "scaling.min_workers=1")
    r.controller.callbacks.after_step.append(at_step(9, lambda c: r.group.die_in_save(rank=1)))
    summary = r.run()
    assert r.events("failure")[0]["step"] == 12
    assert summary.status.value == "FINISHED" and summary.step == 12
    # FINISHED means a committed checkpoint holds max_steps: the survivor restarted from its in-memory
    # snapshot of step 12 (nothing redone) and saved that checkpoint again.
    assert r.committed_step() == 12 and verify(r.run_dir.checkpoints_dir / "step-000012").ok
    restarted = r.events("attempt_started")[-1]
    assert restarted["source"] == "memory" and restarted["step"] == 12


def test_a_hang_while_finishing_the_last_save_does_not_finish_the_run_without_its_checkpoint(
    tmp_path: Path,
):
    r = make_run(tmp_path)
    r.controller.callbacks.after_step.append(at_step(9, lambda c: r.group.save_hangs(rank=0)))
    summary = r.run()
    (failure,) = r.events("failure")
    assert failure["kind"] == "hang" and "step-000012" in failure["message"]
    assert r.events("checkpoint_abandoned")[0]["step"] == 12
    assert summary.status.value == "FINISHED" and r.committed_step() == 12


def test_a_final_save_that_cannot_be_written_ends_the_run_failed_and_resumable(tmp_path: Path):
    r = make_run(tmp_path)
    r.controller.callbacks.after_step.append(at_step(9, lambda c: r.group.write_fails(rank=0)))
    summary = r.run()
    assert summary.status.value == "FAILED" and r.status == "FAILED"
    assert "final checkpoint" in summary.message and "No space left on device" in summary.message
    assert r.committed_step() == 8  # what `elastictrain resume` continues from


def test_a_commit_error_skips_that_save_and_training_goes_on(tmp_path: Path):
    r = make_run(tmp_path)
    # Rank 1 reports its file written, but it is not there: the store refuses to commit (CheckpointError).
    r.controller.callbacks.after_step.append(at_step(5, lambda c: r.group.drop_file(rank=1)))
    summary = r.run()
    (failed,) = r.events("checkpoint_failed")
    assert failed["step"] == 8 and "CheckpointError" in failed["reason"] and "missing" in failed["reason"]
    assert summary.status.value == "FINISHED" and r.committed_step() == 12


def test_an_unexpected_error_leaves_the_run_failed_in_run_json_and_events(tmp_path: Path):
    r = make_run(tmp_path)

    def bug(controller):
        raise RuntimeError("a bug in the loop")

    r.controller.callbacks.after_step.append(at_step(3, bug))
    with pytest.raises(RuntimeError, match="a bug in the loop"):
        r.run()
    info = r.run_dir.read_info()
    assert info.status == "FAILED" and "RuntimeError: a bug in the loop" in info.message
    assert r.events("fail")[0]["reason"] == "RuntimeError: a bug in the loop"
    assert f"`elastictrain resume {r.run_dir.path}`" in r.events("fail")[0]["message"]  # resumable
    assert r.group.workers == []  # the workers are shut down all the same


def test_a_finished_run_run_again_has_nothing_to_train_and_stays_finished(tmp_path: Path):
    first = make_run(tmp_path)
    assert first.run().status.value == "FINISHED"
    again = make_run(tmp_path, run_dir=first.run_dir)  # e.g. `fit` called twice with one config
    summary = again.run()
    assert summary.status.value == "FINISHED" and summary.step == 12
    assert again.status == "FINISHED" and again.group.workers == []
    assert len(again.events("attempt_started")) == 1  # the first run's only: no worker was set up again


def _finished_then(tmp_path: Path, damage: Any) -> Any:
    """A finished run whose step-000012 is then damaged, run again: what does the second driver do?"""
    first = make_run(tmp_path)
    assert first.run().status.value == "FINISHED"
    damage(first.run_dir.checkpoints_dir / "step-000012")
    return make_run(tmp_path, run_dir=first.run_dir)


def test_a_corrupt_manifest_is_rejected_and_the_previous_checkpoint_used(tmp_path: Path):
    again = _finished_then(tmp_path, lambda ckpt: (ckpt / "manifest.json").write_text("{not json"))
    summary = again.run()
    (rejected,) = again.events("checkpoint_rejected")
    assert rejected["tag"] == "step-000012" and "manifest.json" in rejected["problems"][0]
    assert again.events("attempt_started")[-1]["checkpoint"] == "step-000008"
    assert summary.status.value == "FINISHED" and again.committed_step() == 12


def test_an_unreadable_rank_file_is_rejected_like_a_corrupt_one(tmp_path: Path, monkeypatch):
    import errno

    import elastictrain.checkpoint.store as store

    real = store.sha256_of_file

    def eio(path: Path) -> str:
        if "step-000012" in str(path):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path)

    again = _finished_then(tmp_path, lambda ckpt: monkeypatch.setattr(store, "sha256_of_file", eio))
    summary = again.run()
    (rejected,) = again.events("checkpoint_rejected")
    assert rejected["tag"] == "step-000012" and "unreadable (Input/output error)" in rejected["problems"][0]
    assert again.events("attempt_started")[-1]["checkpoint"] == "step-000008"
    assert summary.status.value == "FINISHED"


def test_a_full_disk_while_recording_the_world_size_does_not_stop_the_run(tmp_path: Path, monkeypatch):
    import errno

    r = make_run(tmp_path)

    def full(*_args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(r.run_dir, "record_world_size", full)
    summary = r.run()
    assert summary.status.value == "FINISHED" and r.status == "FINISHED" and r.committed_step() == 12


def _corrupt_a_rank_file(folder: Path) -> None:
    rank_file = sorted(p for p in folder.iterdir() if p.name.startswith("rank-"))[0]
    data = bytearray(rank_file.read_bytes())
    data[0] ^= 0xFF
    rank_file.write_bytes(bytes(data))


def test_keep_last_1_reads_the_new_checkpoint_back_before_pruning_the_last_good_one(tmp_path: Path):
    r = make_run(tmp_path, "checkpoint.keep_last=1", "checkpoint.memory_every_steps=0")
    store = r.controller.store
    real, rotted = store.commit, []

    def commit_then_bit_rot(step: int, *args: Any) -> Any:
        committed = real(step, *args)
        if step == 8 and not rotted:  # what reached the disk differs from what was hashed in memory
            rotted.append(step)
            _corrupt_a_rank_file(committed.path)
        return committed

    store.commit = commit_then_bit_rot  # type: ignore[method-assign]
    r.group.die_at_step(rank=1, step=10)
    summary = r.run()
    (rejected,) = r.events("checkpoint_rejected")
    assert rejected["tag"] == "step-000008" and "sha256" in rejected["problems"][0]
    assert r.events("attempt_started")[-1]["checkpoint"] == "step-000004"  # kept: not step 0
    assert summary.status.value == "FINISHED" and r.committed_step() == 12


def test_no_restart_from_step_0_when_every_checkpoint_is_rejected(tmp_path: Path):
    again = _finished_then(tmp_path, _corrupt_a_rank_file)
    for tag in ("step-000004", "step-000008"):
        folder = again.run_dir.checkpoints_dir / tag
        if folder.exists():
            _corrupt_a_rank_file(folder)
    summary = again.run()
    assert summary.status.value == "FAILED" and again.status == "FAILED"
    assert "step-000012" in summary.message and "not starting over from step 0" in summary.message
    assert "elastictrain train --fresh" in summary.message
    assert len(again.events("attempt_started")) == 1  # the first run's only: nothing trained from 0


def test_a_run_whose_driver_was_killed_mid_step_is_taken_up_by_the_next_driver(tmp_path: Path):
    # A driver killed outright records no end: run.json still says the state it was in.
    first = make_run(tmp_path, "training.max_steps=8")
    assert first.run().status.value == "FINISHED"
    first.run_dir.update(status="RECOVERING")
    again = make_run(tmp_path, "training.max_steps=12", run_dir=first.run_dir)
    summary = again.run()
    assert summary.status.value == "FINISHED" and again.committed_step() == 12
