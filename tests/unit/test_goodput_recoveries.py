"""The goodput benchmark's record of each restart says where a grow's stall went, and of each move of
the snapshot schedule (benchmarks/goodput_events.py)."""

from __future__ import annotations

from benchmarks.goodput_events import recoveries, slowest_grow_note, snapshot_changes


def _event(name: str, second: float, **fields: object) -> dict[str, object]:
    return {"event": name, "time": f"2026-11-28T02:00:{second:06.3f}+00:00", **fields}


SET_UP = {
    "setup_s": 0.4,
    "process_group_s": 0.1,
    "engine_s": 0.2,
    "load_s": 0.1,
    "setup_s_by_rank": [0.4, 0.3],
    "load_fetch_s_by_rank": [0.05, 0.04],
}


def test_each_restart_keeps_its_cause_its_set_up_parts_and_the_time_to_its_attempt_and_first_step():
    events = [
        _event("attempt_started", 1.0, **SET_UP),  # the first start: no recovery follows it
        _event("failure", 10.0),
        _event("attempt_started", 11.5, **SET_UP),
        _event("recovered", 12.0, step=7, steps_lost=1, stall_s=0.3, recovered_from="memory"),
        _event("grow", 20.0),
        _event("attempt_started", 21.25, **{**SET_UP, "setup_s": 0.9}),
        _event("recovered", 22.0, step=9, steps_lost=0, stall_s=1.6, recovered_from="memory"),
    ]
    failure, grow = recoveries(events)
    assert (failure["cause"], failure["steps_lost"], failure["to_attempt_s"]) == ("failure", 1, 1.5)
    assert (grow["cause"], grow["setup_s"], grow["to_attempt_s"], grow["first_step_s"]) == (
        "grow",
        0.9,
        1.25,
        0.75,
    )
    note = slowest_grow_note([failure | {"cause": "grow"}, grow])
    assert "the longest (step 9): 1.25 s from the grow to the new attempt (set-up 0.90 s" in note, note


def test_results_recorded_before_the_set_up_parts_were_kept_give_no_breakdown():
    assert slowest_grow_note([{"step": 3, "stall_s": 1.0, "cause": "grow"}]) == ""


def test_each_move_of_the_snapshot_schedule_is_kept_with_its_step_interval_and_reason():
    events = [
        _event("snapshots", 1.0, step=6, interval=2, off=False, message="a snapshot costs 4%"),
        _event("recovered", 2.0, step=7, steps_lost=1, stall_s=0.3, recovered_from="memory"),
        _event("snapshots", 3.0, step=40, interval=1, off=False, message="back to every step"),
    ]
    assert snapshot_changes(events) == [
        {"step": 6, "interval": 2, "off": False, "message": "a snapshot costs 4%"},
        {"step": 40, "interval": 1, "off": False, "message": "back to every step"},
    ]
