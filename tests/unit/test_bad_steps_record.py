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
    again = BadSteps(r.controller.recorder)
    assert again.note(7, _results(True)) == {"skipped_steps": 1.0}
    assert again.note(8, _results(False))["skipped_steps"] == 2.0
    assert "its gradients were not finite" in r.events("bad_step")[-1]["message"]
