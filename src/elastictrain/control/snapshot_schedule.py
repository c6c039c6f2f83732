"""Which steps every rank copies to host memory: decided here, so that all ranks snapshot the same steps.

A rank's in-memory snapshot (worker/snapshots/store.py) is a copy of its slice of the state and a replica sent
to its buddy, both in threads beside the next step. Where they hide behind that step they cost
nothing. What they do cost training is measured by the workers and sent with every step's report:
- on CPU workers (every core trains) the CPU time of the copy, of sending its replica and of the
  buddy's keeping of it: a steady figure, where step times on a busy machine move by more than the few
  percent to be resolved;
- on GPU workers (idle host cores, the copy on its own CUDA stream) the time the next optimizer update
  waited for the copy: the only way a snapshot holds up the kernels. Also the fallback on CPU workers
  that report no CPU time.
CPU time misses what copies cost the training threads beside them through shared cores and memory
bandwidth: at 30M on 2 cores, more than the CPU time itself (docs/concepts/recovery.md). So on CPU
workers the slowest rank's forward and backward beside a copy is also compared with those of steps
with nothing beside them: unmarked steps, and at every step's snapshots
one *probe* in PROBE_EVERY, whose copy is taken alone at the next update instead of beside the step
(so it loses nothing: a failure in that step still falls back one step; its cost is the copy's time
once per PROBE_EVERY steps). Each such step is compared with the steps beside a copy around it, and
the difference counts once MIN_PROBES comparisons say, at their lower confidence bound, that it is
more than the CPU time does. Wall times on a busy machine scatter by several percent a step: the
bound keeps that noise from moving the interval.
Snapshots are taken every `checkpoint.memory_every_steps` steps from the first step of an attempt, so
that a failure at any moment loses at most the step in flight. Where they cost more than
`checkpoint.memory_max_step_share` of the training time they are spaced out, but only on evidence:
the cost and the step time are the medians of a window of WINDOW snapshots (or WINDOW_STEPS steps),
and `core.snapshot_plan.next_interval` moves the interval only past a margin, so that noise does
not move it back and forth. Every change is a `snapshots` event with the measured figures. Each step
is sent with its mark, so a change reaches every rank at the same step. A checkpoint's step is always
marked: the checkpoint's background write then writes that copy, and training does not stop for a
copy of its own. A rank that finds its copies would not fit in host memory turns them off for the
attempt and says so in its reports; the schedule then marks no step until the next attempt.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from elastictrain.core.snapshot_plan import next_interval

WINDOW = 20  # snapshots measured before the interval may move
WINDOW_STEPS = 200  # ... or this many steps with at least MIN_SAMPLES snapshots (long intervals)
MIN_SAMPLES = 3
PROBE_EVERY = 10  # at every step's snapshots, one marked step in this many is a probe (CPU workers)
PAIR = 3  # a step with no copy beside it is compared with the steps beside one this close on each side
MIN_PROBES = 8  # comparisons before they may count
COMPARISONS_KEPT = 30  # the latest comparisons of the attempt


class SnapshotSchedule:
    def __init__(self, config: Any) -> None:
        ck = config.checkpoint
        self.every = int(ck.memory_every_steps)
        if self.every == 1 and float(config.failure.loss_spike) > 0:
            # A spike is seen when the next step is already running: with a snapshot every step, the two
            # a worker keeps would both be from after the spike.
            self.every = 2
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
        self._probes: set[int] = set()  # marked steps whose copy waits for the next update
        self._marked_count = 0  # marked steps of this attempt that could be probes
        self._recent: deque[tuple[int, str, float]] = deque(maxlen=2 * PAIR + 1)  # (step, kind, fb s)
        self.comparisons: deque[list[float]] = deque(maxlen=COMPARISONS_KEPT)  # log(beside / without)
        self.clean_s: deque[float] = deque(maxlen=COMPARISONS_KEPT)  # forward+backward with nothing beside
        self.waits: list[float] = []  # this window: the update's wait for the copy, steps beside one
        self.window: dict[str, Any] | None = None  # the last window's figures, until the caller takes them

    def start_attempt(self) -> None:
        """A new attempt (world size, slices, maybe nodes): the memory check runs again on its workers,
        and costs are measured again (they depend on the world size); the interval stays meanwhile."""
        self.off = ""
        self.costs, self.steps, self.waits = [], [], []
        self._marked, self._first = {}, True
        self._probes, self._marked_count = set(), 0
        self._recent.clear()
        self.comparisons.clear()
        self.clean_s.clear()

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
        if marked and not checkpoint and self.cpu_bound and self.interval == 1 and self.max_share > 0:
            # At every step no step runs without a copy beside it unless a probe makes one.
            self._marked_count += 1
            if self._marked_count % PROBE_EVERY == PROBE_EVERY // 2:
                self._probes.add(steps_done)
        return marked

    def probe(self, steps_done: int) -> bool:
        """Whether the copy of the state after `steps_done` steps (marked by `due`) is a probe: taken at
        the next step's update instead of beside its forward and backward."""
        return steps_done in self._probes

    def note(
        self, step: int, results: list[dict[str, Any]], step_s: float, recorder: Any
    ) -> dict[str, float]:
        """`observe` step `step`, telling the run what changed; its metrics (what its copy cost)."""
        changed, steps_done = self.observe(step, results, step_s), step + 1
        if self.window is not None:  # a window of snapshots measured: its figures, moved or not
            recorder.quiet_event("snapshot_costs", step=steps_done, **self.window)
            self.window = None
        if changed:
            fields = {"interval": self.interval, "off": self.off}
            if self.off or self.changes == 1:  # said in the terminal once; later moves only in events.jsonl
                recorder.event("snapshots", changed, step=steps_done, **fields)
            else:
                recorder.quiet_event("snapshots", step=steps_done, message=changed, **fields)
        return {} if self.measured is None else {"snapshot_cost_s": self.measured}

    def observe(self, step: int, results: list[dict[str, Any]], step_s: float) -> str | None:
        """Take step `step`'s reports and wall time into account; a message when the schedule changed."""
        # Step `step` (0-based) ran beside the copy of the state after `step` steps, if one was marked,
        # unless that copy was a probe (taken at its update). A probe's replica runs beside the next step.
        beside_copy = self._marked.pop(step, False)
        self._marked.pop(step - 1, None)
        probed = step in self._probes
        after_probe = step - 1 in self._probes
        self._probes.discard(step - 1)
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
        if beside_copy and not probed:
            self.measured = self._cost(results)
            self.costs.append(self.measured)
            self.waits.append(_update_wait_s(results))
        if self.cpu_bound:
            kind = "without" if probed or not beside_copy else "beside"
            self._compare(step, "skip" if after_probe else kind, _forward_backward_s(results, step_s))
        if self.max_share <= 0 or not self._window_full():
            return None
        if not self.costs:  # nothing marked for a long while (a long interval): nothing measured
            self.steps = []
            return None
        cost, typical_step = statistics.median(self.costs), statistics.median(self.steps)
        wall = self._wall_cost()
        self.window = {
            "interval": self.interval,
            "step_s": typical_step,
            f"{self.cost_kind}_cost_s": cost,
            "wall_cost_s": wall,  # None: fewer than MIN_PROBES comparisons yet
            "comparisons": len(self.comparisons),
        }
        if wall is not None and wall > cost:
            cost, self.cost_kind = wall, "wall"
        self.costs, self.steps, self.waits = [], [], []
        change = next_interval(
            cost, typical_step, interval=self.interval, every=self.every, max_share=self.max_share
        )
        if change is None:
            return None
        old, self.interval = self.interval, change.interval
        self.changes += 1
        how = {
            "cpu": "CPU seconds on the busiest worker",
            "wall": (
                f"seconds more on the slowest rank than a step with no copy beside it (the lower bound of "
                f"{len(self.comparisons)} comparisons)"
            ),
        }.get(self.cost_kind, "seconds of the optimizer update waiting for the copy")
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
        return _update_wait_s(results)

    def _compare(self, step: int, kind: str, forward_backward_s: float) -> None:
        """Keep step `step`'s forward and backward time; compare the step PAIR steps back, if it ran
        with nothing beside it, with each step beside a copy around it (the log of their ratio: for two
        steps alike it is as likely above 0 as below, however skewed step times are)."""
        self._recent.append((step, kind, forward_backward_s))
        if len(self._recent) < self._recent.maxlen:  # type: ignore[operator]
            return
        middle, kind, clean = self._recent[PAIR]
        if kind != "without" or clean <= 0:
            return
        beside = [t for s, k, t in self._recent if k == "beside" and abs(s - middle) <= PAIR and t > 0]
        if len(beside) >= 2:
            self.comparisons.append([math.log(t / clean) for t in beside])
            self.clean_s.append(clean)

    def _wall_cost(self) -> float | None:
        """What one copy costs the slowest rank's step, from the comparisons: the lower end of the 95%
        interval of their median (seconds, counting each compared step once), plus the update's typical
        wait; None until MIN_PROBES steps were compared."""
        n = len(self.comparisons)
        if n < MIN_PROBES:
            return None
        pooled = [d for ds in self.comparisons for d in ds]
        middle = statistics.median(pooled)
        spread = 1.4826 * statistics.median(abs(d - middle) for d in pooled)  # a robust sigma
        low = middle - 2.0 * 1.2533 * spread / math.sqrt(n)  # a median's standard error: 1.25x a mean's
        wait = statistics.median(self.waits) if self.waits else 0.0
        return max(0.0, math.expm1(low)) * statistics.median(self.clean_s) + wait

    def _window_full(self) -> bool:
        n = len(self.costs)
        return n >= WINDOW or (len(self.steps) >= WINDOW_STEPS and (n >= MIN_SAMPLES or n == 0))


def _forward_backward_s(results: list[dict[str, Any]], step_s: float) -> float:
    """The slowest rank's forward and backward (the step's wall time where workers do not report it)."""
    return max((float(r.get("forward_backward_s") or 0.0) for r in results), default=0.0) or step_s


def _update_wait_s(results: list[dict[str, Any]]) -> float:
    """The longest wait of a rank's optimizer update for the copy."""
    return max((float(r.get("update_wait_s") or 0.0) for r in results), default=0.0)
