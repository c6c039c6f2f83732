"""LR schedule, checkpoint choice and retention, and run state transitions."""

from __future__ import annotations

import math

import pytest

from elastictrain.core.checkpoints import (
    CheckpointListing,
    choose_resume_tag,
    step_of_tag,
    tag_for_step,
    tags_to_delete,
)
from elastictrain.core.schedule import learning_rate
from elastictrain.core.state import InvalidTransition, RunStatus, transition

LR = dict(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=14)


def test_warmup_rises_linearly_to_the_peak():
    assert [learning_rate(s, **LR, schedule="cosine") for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_ends_at_min_lr(schedule):
    assert learning_rate(4, **LR, schedule=schedule) == pytest.approx(1.0)
    assert learning_rate(14, **LR, schedule=schedule) == pytest.approx(0.1)
    assert learning_rate(100, **LR, schedule=schedule) == pytest.approx(0.1)


def test_cosine_midpoint_and_constant_schedule():
    assert learning_rate(9, **LR, schedule="cosine") == pytest.approx(
        0.1 + 0.45 * (1 + math.cos(math.pi / 2))
    )
    assert learning_rate(9, **LR, schedule="constant") == 1.0


def test_unknown_schedule_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match="training.lr_schedule.*constant, linear, cosine"):
        learning_rate(5, **LR, schedule="exp")


def test_tags_sort_by_step_and_round_trip():
    assert tag_for_step(20) == "step-000020"
    assert step_of_tag("step-000020") == 20
    assert step_of_tag("step-1234567") == 1234567
    assert step_of_tag(".staging-step-000020") is None


def test_resume_picks_latest_when_it_is_the_newest_committed():
    listing = CheckpointListing(("step-000010", "step-000020"), "step-000020")
    assert choose_resume_tag(listing) == "step-000020"


def test_resume_picks_newest_committed_when_latest_pointer_lags_behind_a_commit():
    # A crash between the rename of step-30 and the update of `latest`.
    listing = CheckpointListing(("step-000010", "step-000020", "step-000030"), "step-000020")
    assert choose_resume_tag(listing) == "step-000030"


def test_resume_skips_rejected_checkpoints_and_handles_none():
    listing = CheckpointListing(("step-000010", "step-000020"), "step-000020")
    assert choose_resume_tag(listing, rejected=["step-000020"]) == "step-000010"
    assert choose_resume_tag(CheckpointListing((), None)) is None
    assert choose_resume_tag(CheckpointListing(("step-000010",), "step-000099")) == "step-000010"


def test_retention_keeps_newest_and_protected():
    tags = [tag_for_step(s) for s in (10, 20, 30, 40)]
    assert tags_to_delete(tags, keep_last=2) == ["step-000010", "step-000020"]
    assert tags_to_delete(tags, keep_last=2, protect=["step-000010"]) == ["step-000020"]
    assert tags_to_delete(tags, keep_last=10) == []


def test_run_state_transitions():
    assert transition(RunStatus.CREATED, RunStatus.STARTING) is RunStatus.STARTING
    assert transition(RunStatus.RUNNING, RunStatus.RECOVERING) is RunStatus.RECOVERING
    assert transition(RunStatus.STOPPED, RunStatus.STARTING) is RunStatus.STARTING
    with pytest.raises(InvalidTransition, match="FINISHED cannot become RUNNING"):
        transition(RunStatus.FINISHED, RunStatus.RUNNING)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        ("RECOVERING", "RESIZING"),  # a grow decided while a failure is being handled
        ("WAITING", "RESIZING"),
        ("WAITING", "FINISHED"),  # finished without an attempt after the wait
        ("CREATED", "RUNNING"),  # training before any attempt started
        ("RECOVERING", "FINISHED"),  # finished without a step after the failure
        ("FAILED", "RUNNING"),
        ("STOPPED", "FAILED"),
    ],
)
def test_a_move_the_table_does_not_list_is_refused_naming_the_moves_allowed(current: str, target: str):
    with pytest.raises(InvalidTransition, match=f"{current} cannot become {target}; allowed: "):
        transition(RunStatus(current), RunStatus(target))


def test_every_move_in_the_table_says_why_and_every_state_can_be_left_but_the_ends():
    from elastictrain.core.state import TRANSITIONS, allowed_from

    assert all(why for why in TRANSITIONS.values())
    for status in RunStatus:
        assert allowed_from(status), status  # FINISHED, FAILED and STOPPED runs can be resumed
    assert transition(RunStatus.RUNNING, RunStatus.RUNNING) is RunStatus.RUNNING  # staying is no move
    # A killed driver records no end: the next driver takes the run up from the state it left.
    assert transition(RunStatus.RECOVERING, RunStatus.STARTING) is RunStatus.STARTING


def test_a_new_checkpoint_is_read_back_only_when_pruning_would_leave_no_fallback():
    from elastictrain.core.checkpoints import prune_leaves_no_fallback

    tags = ["step-000004", "step-000008"]
    assert prune_leaves_no_fallback(tags, "step-000008", keep_last=1)
    assert not prune_leaves_no_fallback(tags, "step-000008", keep_last=2)  # nothing pruned
    three = [*tags, "step-000012"]
    assert not prune_leaves_no_fallback(three, "step-000012", keep_last=2)  # step-000008 stays
    assert prune_leaves_no_fallback(three, "step-000012", keep_last=2, rejected=["step-000008"])
