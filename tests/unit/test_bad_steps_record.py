"""Steps the ranks did not apply (control/bad_steps.py): recorded once, counted across restarts."""

from __future__ import annotations

from pathlib import Path

from loop_harness import make_run

from elastictrain.control.bad_steps import BadSteps


def _results(applied: bool, loss0: float = 1.0) -> list[dict]:
    return [
        {"rank": 1, "loss": 1.0, "update_applied": applied, "sample_ids": [4, 5]},
        {"rank": 0, "loss": loss0, "update_applied": applied, "sample_ids": [1, 2]},
    ]


def test_a_step_every_rank_applied_records_nothing(tmp_path: Path):
    r = make_run(tmp_path)
    assert r.controller.bad_steps.note(3, _results(True)) == {}
    assert r.events("bad_step") == []


def test_a_skipped_step_is_an_event_a_counter_and_a_metric_naming_its_samples_and_ranks(tmp_path: Path):
    r = make_run(tmp_path)
    metrics = r.controller.bad_steps.note(5, _results(False, loss0=float("nan")))
    assert metrics == {"skipped_steps": 1.0}
    (event,) = r.events("bad_step")
    assert event["step"] == 6 and event["non_finite_loss_ranks"] == [0] and event["skipped_ranks"] == [0, 1]
    assert event["samples"] == {"0": [1, 2], "1": [4, 5]}
    assert "step 6 was not applied: rank(s) [0] computed a non-finite loss" in event["message"]
    assert r.run_dir.read_info().skipped_steps == 1
    # The next driver of the same run (a resume) goes on counting from run.json.
    again = BadSteps(r.controller.cfg, r.controller.recorder, r.controller.store)
    assert again.note(7, _results(True)) == {"skipped_steps": 1.0}
    assert again.note(8, _results(False))["skipped_steps"] == 2.0
    assert "its gradients were not finite" in r.events("bad_step")[-1]["message"]


def _ledger(run) -> list[tuple[int, bool]]:  # noqa: ANN001
    lines: list[tuple[int, bool]] = []
    run.controller.ledger = lambda step, rank, ids, skipped: (
        lines.append((step, skipped)) if rank == 0 else None
    )
    return lines


def test_bad_steps_in_a_row_roll_back_to_the_snapshot_before_them_and_their_batches_are_skipped(
    tmp_path: Path,
):
    r = make_run(tmp_path)
    r.group.nan_steps = {5, 6, 7}  # steps 6, 7 and 8: a state gone bad
    ledger = _ledger(r)
    summary = r.run()
    assert summary.status.value == "FINISHED" and summary.step == 12
    (rollback,) = r.events("rollback")
    assert rollback["steps"] == [6, 7, 8] and rollback["cause"] == "bad_steps"
    assert rollback["recovered_from"] == "memory"
    assert "rolling back to the in-memory snapshot at step 5" in rollback["message"]
    info = r.run_dir.read_info()
    assert info.skipped_steps == 3 and info.extra["skip_steps"] == [6, 7, 8]
    assert info.extra["rollbacks"] == [[6, 7, 8]]
    assert len(r.events("bad_step")) == 3  # counted once each, not again when skipped on purpose
    # The replay skips the three batches on purpose; every step's last record is exact.
    last = dict(ledger)
    assert [s for s in range(12) if last[s]] == [5, 6, 7]
    assert ledger.count((5, True)) == 2  # once bad, once skipped on purpose
    (recovered,) = r.events("recovered")
    assert recovered["recovered_from"] == "memory"


def test_a_rollback_recurring_within_the_window_stops_the_run_naming_steps_samples_and_a_kept_checkpoint(
    tmp_path: Path,
):
    r = make_run(tmp_path, "checkpoint.keep_last=1")
    r.group.nan_steps = {5, 6, 7, 9, 10, 11}
    summary = r.run()
    assert summary.status.value == "FAILED"
    assert "step(s) 10, 11, 12 call for a rollback" in summary.message
    assert "within failure.bad_steps_window of the one for step(s) 6, 7, 8" in summary.message
    assert "step 10: 0: [18], 1: [19]" in summary.message  # the fake's sample ids: step * 2 + rank
    # keep_last=1 would have pruned it: the last checkpoint before the bad steps is kept, whole.
    assert "The last checkpoint from before them: step-000008" in summary.message
    from elastictrain.checkpoint.store import CheckpointStore

    assert "step-000008" in CheckpointStore(r.run_dir.checkpoints_dir).listing().committed


def test_a_loss_spike_rolls_back_to_the_snapshot_before_it_and_skips_its_batch(tmp_path: Path):
    r = make_run(tmp_path, "training.max_steps=16", "failure.loss_spike=3", "failure.loss_spike_window=5")
    r.group.loss_at = {10: 50.0}  # step 11
    summary = r.run()
    assert summary.status.value == "FINISHED"
    (rollback,) = r.events("rollback")
    assert rollback["steps"] == [11] and rollback["cause"] == "loss_spike"
    assert "x the median" in rollback["message"] and rollback["recovered_from"] == "memory"
    info = r.run_dir.read_info()
    assert info.skipped_steps == 1 and info.extra["skip_steps"] == [11]


def test_a_failure_restart_replays_a_skipped_step_as_skipped_and_counts_it_once(tmp_path: Path):
    r = make_run(tmp_path, "failure.max_bad_steps=0")
    r.group.nan_steps = {5}
    r.group.die_at_step(rank=1, step=6)  # step 6 was not applied, so not copied: the restart replays it
    ledger = _ledger(r)
    summary = r.run()
    assert summary.status.value == "FINISHED"
    assert r.run_dir.read_info().skipped_steps == 1 and r.events("rollback") == []
    assert len(r.events("bad_step")) == 1
    (recovered,) = r.events("recovered")
    assert recovered["recovered_from"] == "memory" and recovered["steps_lost"] == 1
    assert ledger.count((5, True)) == 2  # bad, then skipped on purpose by the replay


def test_fp16_overflows_with_a_finite_loss_are_counted_but_neither_roll_back_nor_are_skipped_on_replay(
    tmp_path: Path,
):
    """fp16's loss scaler skips steps whose scaled gradients overflow while it calibrates its scale: each is
    a bad_step (counted as any skipped step), but five in a row are no bad state, and a replay runs them
    again (the scaler's state after them is what the checkpoint holds); a NaN loss is as in any precision."""
    r = make_run(tmp_path, "training.precision=fp16")
    bad = r.controller.bad_steps
    for index in range(5):
        bad.note(index, _results(False), 1.0)
        bad.roll_back_if_due()  # never raises: no rollback is due
    assert bad.skipped == 5 and bad.skip == set() and bad.first_bad() is None
    bad.note(5, _results(False, loss0=float("nan")), float("nan"))
    assert bad.skip == {6} and bad.first_bad() == 6


def test_status_shows_skipped_steps_rollbacks_and_stragglers(tmp_path: Path):
    from typer.testing import CliRunner

    from elastictrain.cli import app

    r = make_run(tmp_path)
    r.run_dir.update(skipped_steps=3)
    r.run_dir.set_extra("rollbacks", [[6, 7, 8]])
    r.run_dir.set_extra(
        "stragglers", [{"step": 9, "rank": 1, "worker": "w1", "node": "node-1", "ratio": 3.9}]
    )
    result = CliRunner().invoke(app, ["status", str(r.run_dir.path)])
    assert result.exit_code == 0, result.output
    assert "skipped   3 step(s) not applied (non-finite loss or gradients)" in result.output
    assert "rollbacks 1, the last over step(s) 6, 7, 8" in result.output
    assert "straggler rank 1 (worker w1, node node-1) at step 9: 3.9x the others" in result.output
