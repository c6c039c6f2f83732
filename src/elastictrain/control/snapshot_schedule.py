"""Which steps every rank copies to host memory: decided here, so that all ranks snapshot the same steps.

A rank's in-memory snapshot (worker/memory.py) costs a copy of its slice of the state and a replica
sent to its buddy, both in a thread beside the next step. Where they hide behind the step they cost
nothing; where they do not, training waits for them (before the next optimizer update, or before the
next copy). The workers count that wait (`stall_s`) and the copies they started (`taken`); the
controller takes the slowest rank's wait per snapshot as the cost and spaces the snapshots out
(`core.memory_snapshots.snapshot_interval`) so that they take at most
`checkpoint.memory_max_step_share` of the training time, never more often than
`checkpoint.memory_every_steps`. Each step is sent with its mark, so a change of interval reaches
every rank at the same step. A checkpoint's step is always marked: the checkpoint's background write
then writes that copy, and training does not stop for a copy of its own. A rank that finds its copies
would not fit in host memory turns them off for the attempt and says so in its reports; the schedule
then marks no step until the next attempt.
"""

from __future__ import annotations

from typing import Any

from elastictrain.core.memory_snapshots import snapshot_interval

SMOOTHING = 0.3  # weight of the newest measurement in the running cost and step time


class SnapshotSchedule:
    def __init__(self, config: Any) -> None:
        ck = config.checkpoint
        self.every = int(ck.memory_every_steps)
        self.max_share = float(ck.memory_max_step_share)
        self.for_checkpoints = bool(ck.background_write)  # a checkpoint's save writes its step's copy
        self.interval = self.every  # steps between snapshots now (0: none)
        self.cost_s = 0.0  # one snapshot's copy and replication, smoothed
        self.step_s = 0.0  # a step's wall time, smoothed
        self.off = ""  # why snapshots are off in this attempt ("" while they are on)
        self._seen: dict[int, tuple[float, int]] = {}  # rank -> its last (stall_s, taken)

    def start_attempt(self) -> None:
        """A new attempt (world size, slices, maybe nodes): the memory check runs again on its workers."""
        self.off = ""
        self._seen = {}  # ranks and their workers change: counts start again

    def due(self, steps_done: int, *, checkpoint: bool = False) -> bool:
        """Whether the ranks snapshot the state after `steps_done` steps (`checkpoint`: a disk checkpoint
        follows that step, and its background write takes the copy instead of making its own)."""
        if self.off or self.interval <= 0:
            return False
        return (checkpoint and self.for_checkpoints) or steps_done % self.interval == 0

    def observe(self, results: list[dict[str, Any]], step_s: float) -> str | None:
        """Take a step's reports into account; a message when the schedule changed, else None."""
        if self.every <= 0 or self.off:
            return None
        reports = [r.get("memory") or {} for r in results]
        off = next((m["off"] for m in reports if m.get("off")), "")
        if off:
            self.off = off
            return f"in-memory snapshots off until the next restart: {off}; a failure recovers from disk"
        self.step_s = _smooth(self.step_s, step_s)
        costs = []
        for rank, m in enumerate(reports):
            now = (float(m.get("stall_s", 0.0)), int(m.get("taken", 0)))
            before = self._seen.get(rank, (0.0, 0))
            self._seen[rank] = now
            if now[1] > before[1]:  # copies started since the last report: their wait per copy
                costs.append(max(0.0, now[0] - before[0]) / (now[1] - before[1]))
        if not costs:
            return None
        self.cost_s = _smooth(self.cost_s, max(costs))
        wanted = snapshot_interval(self.cost_s, self.step_s, every=self.every, max_share=self.max_share)
        # Longer at once when snapshots cost too much; shorter only when half would do, so that noise in
        # the timings does not move the interval back and forth.
        if wanted > self.interval or wanted * 2 <= self.interval:
            old, self.interval = self.interval, wanted
            return (
                f"in-memory snapshots every {wanted} step(s) (was {old}): a snapshot costs "
                f"{self.cost_s:.2f}s against {self.step_s:.2f}s a step, at most "
                f"{self.max_share:.0%} of training time (checkpoint.memory_max_step_share)"
            )
        return None


def _smooth(old: float, new: float) -> float:
    return new if old <= 0 else (1 - SMOOTHING) * old + SMOOTHING * new
