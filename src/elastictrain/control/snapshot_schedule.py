"""Which steps every rank copies to host memory: decided here, so that all ranks snapshot the same steps.

A rank's in-memory snapshot (worker/memory.py) is a copy of its slice of the state and a replica sent
to its buddy, both in a thread beside the next step. Where they hide behind that step they cost
nothing; where they do not (no idle core, the next optimizer update waits for the copy) that step
takes longer, and the replica, sent after the copy, can reach into the step after it. On CPU workers
(every core trains) a snapshot costs training the CPU time its copy, its replica's sending and the
buddy's keeping of it take: the workers measure those threads' CPU time and report it, a steady figure
where step times on a busy machine move by more than the 3% to be resolved. On GPU workers (idle host
cores, copies beside the kernels) the controller measures the wall time of the two steps after a copy
against steps with no copy or replica beside them; a snapshot costs twice the difference (also the
fallback where no CPU time is reported). It spaces the snapshots out
(`core.memory_snapshots.snapshot_interval`) until they take at most
`checkpoint.memory_max_step_share` of the training time, never more often than
`checkpoint.memory_every_steps`. To measure both kinds of step, an attempt starts with a snapshot
every third step, and while snapshots are taken every step, two in `PROBE_EVERY` go without (so that
one step has nothing beside it; a failure right after them loses three steps, not one). Each step is
sent with its mark, so a change of interval reaches every rank at the same step. A checkpoint's step
is always marked: the checkpoint's background write then writes that copy, and training does not
stop for a copy of its own. A rank that finds its copies would not fit in host memory turns them off
for the attempt and says so in its reports; the schedule then marks no step until the next attempt.
"""

from __future__ import annotations

from typing import Any

from elastictrain.core.memory_snapshots import snapshot_interval

SMOOTHING = 0.2  # weight of the newest step time in the running means
PROBE_EVERY = 10  # at one snapshot a step, every this many steps one goes without (a baseline step)
MIN_SAMPLES = 3  # steps of each kind measured before the interval moves


class SnapshotSchedule:
    def __init__(self, config: Any) -> None:
        ck = config.checkpoint
        self.every = int(ck.memory_every_steps)
        self.max_share = float(ck.memory_max_step_share)
        self.for_checkpoints = bool(ck.background_write)  # a checkpoint's save writes its step's copy
        self.interval = self.every  # steps between snapshots now (0: none)
        self.off = ""  # why snapshots are off in this attempt ("" while they are on)
        self.step_s = {True: 0.0, False: 0.0}  # running mean wall time: beside a copy or replica, and not
        self.samples = {True: 0, False: 0}
        self.cpu_bound = not bool(config.scaling.use_gpu)  # a snapshot's CPU time is training's loss
        self.cpu_s = 0.0  # running mean of one snapshot's CPU seconds on the busiest worker (0: none yet)
        self._marked: dict[int, bool] = {}  # steps done -> whether the state after them is copied
        self._first = True  # the first step of an attempt pays for the new engine: not measured
        self.changes = 0  # interval changes so far

    @property
    def by_cpu(self) -> bool:
        """Whether a snapshot's cost is its CPU time: on CPU workers, once the workers reported it."""
        return self.cpu_bound and self.cpu_s > 0

    @property
    def cost_s(self) -> float:
        """What one snapshot costs training (0 until measured): its CPU time on CPU workers, else what it
        adds to the two steps it runs beside."""
        if self.by_cpu:
            return self.cpu_s
        if min(self.samples.values()) < MIN_SAMPLES:
            return 0.0
        return 2 * max(0.0, self.step_s[True] - self.step_s[False])

    def _measured(self) -> bool:
        """Steps without a copy measured, and a snapshot's cost (its CPU time or steps beside one)."""
        if self.samples[False] < MIN_SAMPLES:
            return False
        return self.by_cpu or self.samples[True] >= MIN_SAMPLES

    def start_attempt(self) -> None:
        """A new attempt (world size, slices, maybe nodes): the memory check runs again on its workers,
        and step times are measured again (they depend on the world size)."""
        self.off = ""
        self.step_s, self.samples = {True: 0.0, False: 0.0}, {True: 0, False: 0}
        self.cpu_s = 0.0
        self._marked, self._first = {}, True

    def due(self, steps_done: int, *, checkpoint: bool = False) -> bool:
        """Whether the ranks snapshot the state after `steps_done` steps (`checkpoint`: a disk checkpoint
        follows that step, and its background write takes the copy instead of making its own)."""
        if self.off or self.interval <= 0:
            marked = False
        elif checkpoint and self.for_checkpoints:
            marked = True
        elif self.interval == 1 and self.max_share > 0 and not self._measured():
            marked = steps_done % 3 == 0  # until both kinds of step are measured: every third one
        elif self.interval == 1 and self.max_share > 0 and steps_done % PROBE_EVERY in (0, 1):
            marked = False  # so that the step after these has nothing beside it: the baseline
        else:
            marked = steps_done % self.interval == 0
        self._marked[steps_done] = marked
        return marked

    def observe(self, step: int, results: list[dict[str, Any]], step_s: float) -> str | None:
        """Take step `step`'s reports and wall time into account; a message when the schedule changed."""
        # The copy of the state after `step` steps ran beside this step, its replica maybe into the next.
        after_previous = self._marked.pop(step - 1, False)
        beside_copy = self._marked.get(step, False) or after_previous
        if self.every <= 0 or self.off:
            return None
        off = next((m["off"] for r in results if (m := r.get("memory") or {}).get("off")), "")
        if off:
            self.off = off
            return f"in-memory snapshots off until the next restart: {off}; a failure recovers from disk"
        if self._first:
            self._first = False
            return None
        self.step_s[beside_copy] = _smooth(self.step_s[beside_copy], step_s)
        self.samples[beside_copy] += 1
        cpu = max(((r.get("memory") or {}).get("cpu_s") or 0.0 for r in results), default=0.0)
        if cpu > 0:
            self.cpu_s = _smooth(self.cpu_s, cpu)
        if self.max_share <= 0 or not self._measured():
            return None
        base = self.step_s[False]
        wanted = snapshot_interval(self.cost_s, base, every=self.every, max_share=self.max_share)
        # Longer once snapshots cost a quarter more than allowed; shorter only when half would do, so that
        # noise in the timings does not move the interval back and forth.
        if wanted > 1.25 * self.interval or wanted * 2 <= self.interval:
            old, self.interval = self.interval, wanted
            self.changes += 1
            measured = (
                f"a snapshot takes {self.cpu_s:.2f} CPU seconds on the busiest worker"
                if self.by_cpu
                else f"a step beside a copy takes {self.step_s[True]:.2f}s, one without {base:.2f}s, so "
                f"a snapshot costs {self.cost_s:.2f}s"
            )
            return (
                f"in-memory snapshots every {wanted} step(s) (was {old}): {measured}, a step "
                f"{base:.2f}s; at most {self.max_share:.0%} of training time "
                "(checkpoint.memory_max_step_share)"
            )
        return None


def _smooth(old: float, new: float) -> float:
    return new if old <= 0 else (1 - SMOOTHING) * old + SMOOTHING * new
