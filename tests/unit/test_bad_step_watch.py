"""When bad steps call for a rollback (core/bad_steps.py): steps not applied in a row, a loss spike, and a
rollback recurring within the window, which stops the run instead."""

from __future__ import annotations

import math

from elastictrain.core.bad_steps import BadStepWatch, GiveUp, RollBack

NAN = math.nan


def test_three_steps_not_applied_in_a_row_call_for_a_rollback_over_all_three():
    w = BadStepWatch(max_bad_steps=3, window=100)
    assert w.observe(5, applied=True, loss=1.0) is None
    assert w.observe(6, applied=False, loss=NAN) is None
    assert w.first_bad() == 6
    assert w.observe(7, applied=False, loss=NAN) is None
    decision = w.observe(8, applied=False, loss=NAN)
    assert isinstance(decision, RollBack) and decision.steps == (6, 7, 8) and decision.cause == "bad_steps"
    assert w.first_bad() is None


def test_a_good_step_between_bad_ones_resets_the_count():
    w = BadStepWatch(max_bad_steps=3, window=100)
    for step, applied in [(1, False), (2, False), (3, True), (4, False), (5, False)]:
        assert w.observe(step, applied=applied, loss=1.0 if applied else NAN) is None


def test_steps_skipped_on_purpose_or_fp16_overflows_do_not_count():
    w = BadStepWatch(max_bad_steps=2, window=100)
    assert w.observe(1, applied=False, loss=1.0, counts=False) is None
    assert w.observe(2, applied=False, loss=1.0, counts=False) is None
    assert w.first_bad() is None


def test_a_replayed_step_replaces_what_was_seen_of_it_and_after_it():
    w = BadStepWatch(max_bad_steps=3, window=100)
    w.observe(6, applied=False, loss=NAN)
    w.observe(7, applied=False, loss=NAN)
    # A restart from step 5 replays 6 and 7: the bad steps seen before are not counted twice.
    assert w.observe(6, applied=False, loss=NAN) is None
    assert w.observe(7, applied=False, loss=NAN) is None
    assert isinstance(w.observe(8, applied=False, loss=NAN), RollBack)


def test_a_second_rollback_within_the_window_gives_up_and_one_past_it_rolls_back():
    w = BadStepWatch(max_bad_steps=1, window=10)
    assert isinstance(w.observe(20, applied=False, loss=NAN), RollBack)
    give_up = w.observe(25, applied=False, loss=NAN)
    assert isinstance(give_up, GiveUp) and give_up.steps == (25,) and give_up.earlier == (20,)
    assert isinstance(w.observe(31, applied=False, loss=NAN), RollBack)


def test_max_bad_steps_zero_never_rolls_back():
    w = BadStepWatch(max_bad_steps=0, window=10)
    assert all(w.observe(s, applied=False, loss=NAN) is None for s in range(1, 50))


def test_a_loss_over_the_factor_times_the_running_median_is_a_spike_once_the_window_is_full():
    w = BadStepWatch(max_bad_steps=3, window=100, spike_factor=3.0, spike_window=4)
    # Before the window is full, nothing is judged (early losses fall fast).
    assert w.observe(1, applied=True, loss=10.0) is None
    for step in range(2, 6):
        assert w.observe(step, applied=True, loss=2.0) is None
    assert w.observe(6, applied=True, loss=5.9) is None  # under 3x the median 2.0
    spike = w.observe(7, applied=True, loss=20.0)
    assert isinstance(spike, RollBack) and spike.steps == (7,) and spike.cause == "loss_spike"
    assert "is 10.00x the median 2 of the last 4 steps" in spike.detail
    # The spike's loss is not part of the median the replay is judged by.
    assert 7 not in w.losses


def test_spikes_are_off_at_factor_zero():
    w = BadStepWatch(max_bad_steps=3, window=100, spike_factor=0.0, spike_window=3)
    for step in range(1, 5):
        w.observe(step, applied=True, loss=1.0)
    assert w.observe(5, applied=True, loss=1e6) is None
