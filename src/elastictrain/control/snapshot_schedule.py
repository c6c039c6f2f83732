"""Which steps every rank copies to host memory: decided here, so that all ranks snapshot the same steps.

A rank's in-memory snapshot (worker/memory.py) is a copy of its slice of the state and a replica sent
to its buddy, both in threads beside the next step. Where they hide behind that step they cost
nothing. What they do cost training is measured by the workers and sent with every step's report:
- on CPU workers (every core trains) the CPU time of the copy, of sending its replica and of the
  buddy's keeping of it: a steady figure, where step times on a busy machine move by more than the few
  percent to be resolved;
- on GPU workers (idle host cores, the copy on its own CUDA stream) the time the next optimizer update
  waited for the copy: the only way a snapshot holds up the kernels. Also the fallback on CPU workers
  that report no CPU time.
Snapshots are taken every `checkpoint.memory_every_steps` steps from the first step of an attempt, so
that a failure at any moment loses at most the step in flight; no step goes without a copy to serve as
a baseline. Where they cost more than `checkpoint.memory_max_step_share` of the training time they
are spaced out, but only on evidence: the cost and the step time are the medians of a window of
WINDOW snapshots (or WINDOW_STEPS steps), and `core.memory_snapshots.next_interval` moves the interval
only past a margin, so that noise does not move it back and forth. Every change is a `snapshots` event
with the measured figures. Each step is sent with its mark, so a change reaches every rank at the same
step. A checkpoint's step is always marked: the checkpoint's background write then writes that copy,
and training does not stop for a copy of its own. A rank that finds its copies would not fit in host
memory turns them off for the attempt and says so in its reports; the schedule then marks no step
until the next attempt.
"""

from __future__ import annotations

import statistics
from typing import Any

from elastictrain.core.memory_snapshots import next_interval

WINDOW = 20  # snapshots measured before the interval may move
WINDOW_STEPS = 200  # ... or this many steps with at least MIN_SAMPLES snapshots (long intervals)
MIN_SAMPLES = 3


class SnapshotSchedule:
    def __init__(self, config: Any) -> None:
        ck = config.checkpoint
        self.every = int(ck.memory_every_steps)
        self.max_share = float(ck.memory_max_step_share)
        self.for_checkpoints = bool(ck.background_write)  # a checkpoint's save writes its step's copy
        self.interval = self.every  # steps between snapshots now (0: none)
        self.off = ""  # why snapshots are off in this attempt ("" while they are on)
        self.cpu_bound = not bool(config.scaling.use_gpu)  # a snapshot's CPU time is training's loss
        self.costs: list[float] = []  # this window: one snapshot's cost (s) per measured snapshot
        self.steps: list[float] = []  # this window: every measured step's wall time (s)
        self.cost_kind = ""  # how the window's costs were measured ("cpu" or "wait")
        self._marked: dict[int, bool] = {}  # steps done -> whether the state after them is copied
        self._first = True  # the first step of an attempt pays for the new engine: not measured
        self.changes = 0  # interval changes so far
        self.measured: float | None = None  # the last observed step's snapshot cost (None: no copy beside)

    def start_attempt(self) -> None:
        """A new attempt (world size, slices, maybe nodes): the memory check runs again on its workers,
        and costs are measured again (they depend on the world size); the interval stays meanwhile."""
        self.off = ""
        self.costs, self.steps = [], []
        self._marked, self._first = {}, True

    def due(self, steps_done: int, *, checkpoint: bool = False) -> bool:
        """Whether the ranks snapshot the state after `steps_done` steps (`checkpoint`: a disk checkpoint
        follows that step, and its background write takes the copy instead of making its own)."""
        if self.off or self.interval <= 0:
            marked = False
        elif checkpoint and self.for_checkpoints:
            marked = True
        else:
            marked = steps_done % self.interval == 0
        self._marked[steps_done] = marked
        return marked

    def observe(self, step: int, results: list[dict[str, Any]], step_s: float) -> str | None:
        """Take step `step`'s reports and wall time into account; a message when the schedule changed."""
        # Step `step` (0-based) ran beside the copy of the state after `step` steps, if one was marked.
        beside_copy = self._marked.pop(step, False)
        self._marked.pop(step - 1, None)
        self.measured = None
        if self.every <= 0 or self.off:
            return None
        off = next((m["off"] for r in results if (m := r.get("memory") or {}).get("off")), "")
        if off:
            self.off = off
            return f"in-memory snapshots off until the next restart: {off}; a failure recovers from disk"
        if self._first:
            self._first = False
            return None
        self.steps.append(step_s)
        if beside_copy:
            self.measured = self._cost(results)
            self.costs.append(self.measured)
        if self.max_share <= 0 or not self._window_full():
            return None
        if not self.costs:  # nothing marked for a long while (a long interval): nothing measured
            self.steps = []
            return None
        cost, typical_step = statistics.median(self.costs), statistics.median(self.steps)
        self.costs, self.steps = [], []
        change = next_interval(
            cost, typical_step, interval=self.interval, every=self.every, max_share=self.max_share
        )
        if change is None:
            return None
        old, self.interval = self.interval, change.interval
        self.changes += 1
        how = (
            "CPU seconds on the busiest worker"
            if self.cost_kind == "cpu"
            else "seconds of the optimizer update waiting for the copy"
        )
        return (
            f"in-memory snapshots every {change.interval} step(s) (was {old}): a snapshot takes "
            f"{cost:.3f} {how}, a step {typical_step:.3f}s (medians of the last window), "
            f"{change.share:.1%} of training time at every {old}; at most {self.max_share:.0%} "
            "(checkpoint.memory_max_step_share)"
        )

    def _cost(self, results: list[dict[str, Any]]) -> float:
        """One snapshot's cost to training: the busiest worker's CPU time for it on CPU workers (where
        reported), else the longest wait of an optimizer update for the copy."""
        cpu = max(((r.get("memory") or {}).get("cpu_s") or 0.0 for r in results), default=0.0)
        if self.cpu_bound and cpu > 0:
            self.cost_kind = "cpu"
            return float(cpu)
        self.cost_kind = "wait"
        return float(max((r.get("update_wait_s") or 0.0 for r in results), default=0.0))

    def _window_full(self) -> bool:
        n = len(self.costs)
        return n >= WINDOW or (len(self.steps) >= WINDOW_STEPS and (n >= MIN_SAMPLES or n == 0))
