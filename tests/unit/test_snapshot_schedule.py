"""The controller's schedule of in-memory snapshots: the same steps on every rank, spaced by cost."""

from __future__ import annotations

from pathlib import Path

from loop_harness import make_run
from omegaconf import OmegaConf

from elastictrain.control.snapshot_schedule import SnapshotSchedule


def _schedule(every: int = 1, share: float = 0.03) -> SnapshotSchedule:
    cfg = OmegaConf.create(
        {
            "checkpoint": {
                "memory_every_steps": every,
                "memory_max_step_share": share,
                "background_write": True,
            }
        }
    )
    return SnapshotSchedule(cfg)


class Ranks:
    """Two ranks' cumulative memory reports, as workers send them with each step."""

    def __init__(self) -> None:
        self.stall, self.taken = [0.0, 0.0], [0, 0]

    def after(self, stall_per_copy: float, copies: int = 1, *, slow_rank_only: bool = False) -> list[dict]:
        for r in range(2):
            self.taken[r] += copies
            if r == 1 or not slow_rank_only:
                self.stall[r] += stall_per_copy * copies
        return [{"memory": {"stall_s": self.stall[r], "taken": self.taken[r], "off": ""}} for r in range(2)]


def test_costly_snapshots_are_spaced_out_and_marked_on_multiples_of_the_interval():
    s, ranks = _schedule(), Ranks()
    assert [s.due(n) for n in range(1, 5)] == [True] * 4
    # Training waited 0.3 s per snapshot on the slower rank, against 3 s a step: 10%.
    message = s.observe(ranks.after(0.3, slow_rank_only=True), step_s=3.0)
    assert s.interval == 4 and message is not None and "every 4 step(s) (was 1)" in message
    assert [n for n in range(1, 13) if s.due(n)] == [4, 8, 12]


def test_the_interval_shrinks_only_when_half_of_it_would_do():
    s, ranks = _schedule(), Ranks()
    s.observe(ranks.after(0.3), step_s=3.0)
    assert s.interval == 4
    assert s.observe(ranks.after(0.25), step_s=3.0) is None  # a little cheaper: 4 stays
    assert s.interval == 4
    for _ in range(20):  # snapshots that hide behind the step: training hardly waits
        s.observe(ranks.after(0.001), step_s=3.0)
    assert s.interval == 1


def test_a_report_without_a_new_snapshot_changes_nothing():
    s, ranks = _schedule(), Ranks()
    reports = ranks.after(0.3)
    s.observe(reports, step_s=3.0)
    cost = s.cost_s
    s.observe(reports, step_s=3.0)  # no copy started since: the same counts again
    assert s.cost_s == cost == 0.3


def test_a_rank_whose_copies_do_not_fit_turns_snapshots_off_until_the_next_attempt():
    s = _schedule()
    reports = Ranks().after(0.1)
    reports[1]["memory"]["off"] = "in-memory snapshots need 800 MiB per rank"
    message = s.observe(reports, step_s=3.0)
    assert message is not None and "off until the next restart" in message and "800 MiB" in message
    assert not any(s.due(n) for n in range(1, 10))
    s.start_attempt()
    assert s.due(1)


def test_with_the_cost_rule_off_or_snapshots_off_the_interval_is_as_configured():
    fixed = _schedule(every=2, share=0.0)
    fixed.observe(Ranks().after(5.0), step_s=1.0)
    assert fixed.interval == 2 and [n for n in range(1, 7) if fixed.due(n)] == [2, 4, 6]
    off = _schedule(every=0)
    assert off.observe(Ranks().after(0.1), step_s=1.0) is None and not any(off.due(n) for n in range(5))


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


def test_a_checkpoint_step_is_always_copied_so_that_its_save_writes_that_copy():
    s = _schedule()
    s.observe(Ranks().after(0.3), step_s=3.0)  # every 4 steps
    assert not s.due(6) and s.due(6, checkpoint=True)
    s.off = "too large"
    assert not s.due(6, checkpoint=True)  # no copies at all: the save makes its own
