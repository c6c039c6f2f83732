"""Recovery from the workers' memory, driver side: buddies for an attempt, and where a restart loads from.

After a failure (or before a grow) the surviving workers say which in-memory snapshots they hold;
the core (`core.snapshot_plan`) picks the newest step every rank of the old world has somewhere.
The next attempt then loads from those workers instead of the disk checkpoint; when no such step
exists (a rank and its buddy both lost, ranks at different steps, snapshots off) it loads from disk
and the reason is recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elastictrain.cluster.calls import Group
from elastictrain.cluster.worker_api import WorkerApi
from elastictrain.control.snapshot_schedule import SnapshotSchedule
from elastictrain.core.snapshot_plan import Held, MemoryChoice, MemoryPlan, assign_buddies, off_node

HOLDINGS_TIMEOUT_S = 10.0
SNAPSHOT_NOW_TIMEOUT_S = 120.0  # a copy and its replica; a worker that does not answer: no grow now


@dataclass(frozen=True)
class MemoryLoad:
    """What the next attempt's ranks get: the plan and, per old rank, (worker id, actor handle)."""

    plan: MemoryPlan
    holders: dict[int, tuple[str, Any]]


class MemoryRecovery:
    def __init__(self, config: Any, group: Group, schedule: SnapshotSchedule | None = None) -> None:
        self.every = int(config.checkpoint.memory_every_steps)
        self.group = group
        self.schedule = schedule  # says when the workers found their snapshots would not fit
        self.choice: MemoryChoice | None = None  # the last decision, until an attempt uses it

    def buddies(self, active: Sequence[Any]) -> tuple[list[int | None], bool]:
        """Each rank's buddy rank (None alone or with snapshots off), and whether all are on another node."""
        if self.every <= 0:
            return [None] * len(active), False
        nodes = [w.node_id for w in active]
        ranks = assign_buddies(nodes)
        return ranks, off_node(nodes, ranks)

    def choose(self, *, max_step: int, disk_step: int) -> MemoryChoice:
        """Ask the live workers what they hold; decide (core) which snapshot, if any, the restart loads."""
        if self.every <= 0:
            self.choice = MemoryChoice(None, "in-memory snapshots are off (checkpoint.memory_every_steps=0)")
            return self.choice
        from elastictrain.core.snapshot_plan import choose_memory_snapshot

        workers = self.group.warm_workers
        replies = self.group.gather(
            self.group.call(workers, WorkerApi.memory_holdings, control=True), HOLDINGS_TIMEOUT_S
        )
        held = [Held(worker_id=wid, **h) for wid, r in replies.items() if r.ok for h in r.value]
        choice = choose_memory_snapshot(held, max_step=max_step, disk_step=disk_step)
        if choice.plan is None and self.schedule is not None and self.schedule.off:
            choice = MemoryChoice(None, self.schedule.off)
        self.choice = choice
        return self.choice

    def live(self) -> bool:
        """Whether this attempt's ranks keep in-memory snapshots (on, not turned off for lack of memory)."""
        return self.every > 0 and not (self.schedule is not None and self.schedule.off)

    def snapshot_now(self, active: Sequence[Any], step: int) -> bool:
        """Every rank copies the state after `step` steps to memory (unless it just did) and replicates it;
        whether all of them hold it now (a grow at this step then loads it, losing nothing)."""
        replies = self.group.gather(self.group.call(active, WorkerApi.snapshot_now), SNAPSHOT_NOW_TIMEOUT_S)
        return all(r.ok and r.value.get("held") and r.value.get("step") == step for r in replies.values())

    def take(self) -> MemoryLoad | None:
        """The memory source for the attempt starting now (once), if its holders are still there."""
        choice, self.choice = self.choice, None
        if choice is None or choice.plan is None:
            return None
        by_id = {w.worker_id: w for w in self.group.warm_workers}
        if any(wid not in by_id for wid in choice.plan.holders.values()):
            return None  # a holder left between the decision and the start: disk it is
        holders = {r: (wid, by_id[wid].actor) for r, wid in choice.plan.holders.items()}
        return MemoryLoad(choice.plan, holders)
