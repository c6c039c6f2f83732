"""The controller's schedule of in-memory snapshots: the same steps on every rank, spaced by cost."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from loop_harness import make_run
from omegaconf import OmegaConf

from elastictrain.control.snapshot_schedule import SnapshotSchedule


def _schedule(every: int = 1, share: float = 0.03, use_gpu: bool = True) -> SnapshotSchedule:
    """GPU workers by default: their snapshots are measured by step times (CPU workers' by CPU time)."""
    cfg = OmegaConf.create(
        {
            "checkpoint": {
                "memory_every_steps": every,
                "memory_max_step_share": share,
                "background_write": True,
            },
            "scaling": {"use_gpu": use_gpu},
        }
    )
    return SnapshotSchedule(cfg)


REPORTS = [{"memory": {"off": ""}}, {"memory": {"off": ""}}]


def simulate(
    s: SnapshotSchedule,
    steps: range,
    base: float,
    cost: float,
    reports: list[dict] = REPORTS,
    noise: Callable[[int], float] = lambda step: 0.0,
) -> list[str]:
    """Drive the schedule as the pipeline does (each step submitted with its mark before the previous one
    is reported); a snapshot adds `cost` in all, half to the step beside its copy and half to the next
    (its replica), and step `j` `noise(j)` more. Returns the messages the schedule gave."""
    marks, said = {}, []
    for j in steps:
        marks[j + 1] = s.due(j + 1)
        extra = cost / 2 * (bool(marks.get(j)) + bool(marks.get(j - 1)))
        said.append(s.observe(j, reports, base + extra + noise(j)))
    return [m for m in said if m]


def test_costly_snapshots_are_spaced_out_until_they_cost_at_most_the_allowed_share():
    s = _schedule()
    # A copy slows the step beside it by 1 s of 3 s: one in 12 steps is under 3% of training time.
    said = simulate(s, range(0, 40), base=3.0, cost=1.0)
    assert s.interval == 12 and said and "every 12 step(s) (was 1)" in said[0]
    assert "3.50s, one without 3.00s, so a snapshot costs 1.00s" in said[0]
    assert [n for n in range(41, 80) if s.due(n)] == [48, 60, 72]


def test_free_snapshots_stay_every_step_but_two_in_ten_go_without_to_measure_the_baseline():
    s = _schedule()
    simulate(s, range(0, 40), base=3.0, cost=0.0)
    assert s.interval == 1
    skipped = [n for n in range(41, 81) if not s.due(n)]
    assert skipped == [41, 50, 51, 60, 61, 70, 71, 80]  # a failure right after 51 loses 3 steps, else 1


def test_the_interval_comes_back_down_when_snapshots_get_cheap():
    s = _schedule()
    simulate(s, range(0, 40), base=3.0, cost=1.0)
    assert s.interval == 12
    simulate(s, range(40, 400), base=3.0, cost=0.0)
    assert s.interval == 1


def test_a_new_attempt_measures_again_and_keeps_the_interval_meanwhile():
    s = _schedule()
    simulate(s, range(0, 40), base=3.0, cost=1.0)
    s.start_attempt()
    assert s.samples == {True: 0, False: 0} and s.interval == 12
    assert [s.due(n) for n in (48, 50)] == [True, False]  # interval 12 stays until measured otherwise


def test_a_rank_whose_copies_do_not_fit_turns_snapshots_off_until_the_next_attempt():
    s = _schedule()
    reports = [{"memory": {"off": ""}}, {"memory": {"off": "in-memory snapshots need 800 MiB per rank"}}]
    s.due(1)
    message = s.observe(0, reports, 3.0)
    assert message is not None and "off until the next restart" in message and "800 MiB" in message
    assert not any(s.due(n) for n in range(1, 10))
    s.start_attempt()
    assert s.due(3)  # every third step while both kinds of step are measured


def test_with_the_cost_rule_off_or_snapshots_off_the_interval_is_as_configured():
    fixed = _schedule(every=2, share=0.0)
    simulate(fixed, range(0, 40), base=1.0, cost=5.0)
    assert fixed.interval == 2 and [n for n in range(41, 51) if fixed.due(n)] == [42, 44, 46, 48, 50]
    every_step = _schedule(every=1, share=0.0)
    assert all(every_step.due(n) for n in range(1, 30))  # no baseline steps when the rule is off
    off = _schedule(every=0)
    assert not simulate(off, range(0, 10), base=1.0, cost=1.0) and not any(off.due(n) for n in range(5))


def test_a_checkpoint_step_is_always_copied_so_that_its_save_writes_that_copy():
    s = _schedule()
    simulate(s, range(0, 40), base=3.0, cost=1.0)  # every 12 steps
    assert not s.due(44) and s.due(44, checkpoint=True)
    s.off = "too large"
    assert not s.due(44, checkpoint=True)  # no copies at all: the save makes its own


def test_snapshots_off_for_lack_of_memory_recover_from_disk_and_say_why(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1")
    r.group.memory_report = {"off": "in-memory snapshots need 900 MiB per rank (8 copies of a 112 MiB slice)"}
    r.group.die_at_step(rank=1, step=6)
    summary = r.run()
    assert summary.status.value == "FINISHED"
    assert all(not w.own and not w.replicas for w in r.group.workers)
    said = r.events("snapshots")
    assert said and "off until the next restart" in said[0]["message"] and said[0]["off"]
    (decision,) = r.events("decision")
    assert decision["recovered_from"] == "disk" and "900 MiB per rank" in decision["memory"]


def test_on_cpu_workers_a_snapshot_costs_its_cpu_time_and_step_time_noise_does_not_move_the_interval():
    s = _schedule(use_gpu=False)
    # The busiest worker reports 0.4 CPU seconds per snapshot (copy, replica sent, buddy's replica kept);
    # steps of 3.2 s move by up to +-10% (a busy 2-core machine), far more than a snapshot's 3% share.
    reports = [{"memory": {"off": "", "cpu_s": 0.3}}, {"memory": {"off": "", "cpu_s": 0.4}}]
    rng = random.Random(7)
    said = simulate(s, range(0, 300), 3.2, 0.0, reports, noise=lambda j: rng.uniform(-0.32, 0.32))
    assert s.interval == 5  # ceil(0.4 / (0.03 * 3.2)): at most 3% of training time
    assert len(said) == 1 and "0.40 CPU seconds on the busiest worker" in said[0]
    assert "every 5 step(s) (was 1)" in said[0]


def test_on_cpu_workers_without_reported_cpu_time_the_step_times_decide():
    s = _schedule(use_gpu=False)
    simulate(s, range(0, 40), base=3.0, cost=1.0)
    assert s.interval == 12  # as on GPU workers: a copy slows two steps by 1 s of 3 s
