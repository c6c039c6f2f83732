"""A worker whose start never ends (a hung import, an op build, a placement never met) is named, stopped and
started again, so the run never waits on it (control/capacity.stop_stuck_warmups, on the fake group)."""

from __future__ import annotations

from pathlib import Path

from loop_harness import make_run

RANGE = ("scaling.min_workers=2", "scaling.max_workers=3")


def test_a_worker_that_never_warms_up_is_stopped_and_replaced_and_the_run_reaches_its_size(tmp_path: Path):
    r = make_run(tmp_path, *RANGE, "failure.warmup_timeout_s=5", capacity=3)
    r.group.never_warm(3)  # of the first three started, the third hangs in its warm-up
    summary = r.run()
    assert summary.status.value == "FINISHED"
    (stopped,) = r.events("warmup_timeout")
    assert stopped["worker"] == "fw2" and stopped["seconds"] > 5
    assert "did not finish starting in 5s (failure.warmup_timeout_s; 3x the slowest" in stopped["message"]
    assert "fw2" in r.group.removed
    assert summary.world_sizes[-1] == 3  # a new worker took its slot


def test_starts_all_stuck_alike_get_three_timeouts_then_are_replaced(tmp_path: Path):
    """No start has finished to compare with: slow alike (a large dataset to tokenize) is given three
    timeouts, then taken as stuck alike; the new workers start, and the run does not wait forever."""
    r = make_run(tmp_path, *RANGE, "failure.warmup_timeout_s=5", capacity=3)
    for n in (1, 2, 3):
        r.group.never_warm(n)
    summary = r.run()
    assert summary.status.value == "FINISHED"
    stopped = r.events("warmup_timeout")
    assert sorted(e["worker"] for e in stopped) == ["fw0", "fw1", "fw2"]
    assert (
        all(e["seconds"] > 15 for e in stopped)
        and "or 3x the timeout while none has" in stopped[0]["message"]
    )
