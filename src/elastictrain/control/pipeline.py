"""The step pipeline: steps submitted ahead to every rank, handed back to the loop as their replies arrive.

It owns what is queued on the actors (steps, the evaluations behind them) and the step counter; what
a done step means (record it, save, evaluate, grow) is the loop's. A segment is iterated:

    for item in pipeline.segment(end, ahead, resize_may_follow=...):
        StepDone  -> a step's replies are in: the loop applies them
        SAVE_DUE  -> the segment's last step is submitted: the loop queues the save behind it
        WAITING   -> a step has been out WAIT_SLICE_S more: the loop looks after what else is in flight
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastictrain.cluster.calls import TIMED_OUT, Calls, Group, Reply
from elastictrain.cluster.worker_api import WorkerApi
from elastictrain.control.errors import AttemptFailed
from elastictrain.control.evaluation import Evaluations
from elastictrain.control.failures import classify
from elastictrain.control.saves import QueuedSave
from elastictrain.control.snapshot_schedule import SnapshotSchedule
from elastictrain.core.losses import preference_figures, replica_results, step_loss

PIPELINE_DEPTH = 2  # steps queued per actor, so no rank idles while the driver reads results
WAIT_SLICE_S = 0.2  # a write that ends mid-step is committed within this (saves.py's watch)

Ahead = deque[tuple[int, Calls]]  # steps submitted past the last gathered one


@dataclass(frozen=True)
class StepDone:
    """A step whose replies are all in."""

    index: int  # the step's index; steps done after it: index + 1
    results: list[dict[str, Any]]  # every rank's reply
    wall_s: float  # since the step before it was done (or the clock restarted)
    metrics: dict[str, float]  # loss, lr, throughput, world size (and a preference objective's figures)
    replicas: list[Mapping[str, Any]]  # one result per data-parallel replica


SAVE_DUE = "save_due"
WAITING = "waiting"
Item = StepDone | str


class StepPipeline:
    def __init__(
        self,
        config: Any,
        group: Group,
        snapshots: SnapshotSchedule,
        evals: Evaluations,
        *,
        clock: Callable[[], float] = time.monotonic,
        skip: set[int] | None = None,
        hold_snapshots: Callable[[], bool] = lambda: False,
    ) -> None:
        """`skip`: steps (1-based) whose batches the workers skip on purpose (control/bad_steps.py's set,
        read at each submit); `hold_snapshots()`: true while steps in a row are not applied, so no copy
        replaces the snapshots from before them (a rollback returns to one)."""
        self.cfg = config
        self.skip = skip if skip is not None else set()
        self.hold_snapshots = hold_snapshots
        # A spike is seen with the next step running: none queued past a checkpoint, so at most one step
        # past it copies its state (control/snapshot_schedule.py keeps snapshots 2 steps apart then).
        self.queue_past_checkpoints = float(config.failure.loss_spike) <= 0
        self.group = group
        self.snapshots = snapshots  # which steps the ranks copy to host memory (read at submit)
        self.evals = evals  # validation, queued behind its step on every rank
        self.clock = clock
        self._step = 0
        self._workers: list[Any] = []
        self._done_at: float | None = None  # when the last step was done, or the clock restarted
        self.last_step_s = 0.0  # the last done step's wall time, as the loop measures it

    @property
    def step(self) -> int:
        """Optimizer steps done (and handed to the loop)."""
        return self._step

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def last_step_done_at(self) -> float | None:
        return self._done_at

    def resume_at(self, step: int) -> None:
        """Before the first attempt: the step a resumed run starts from."""
        self._step = step

    def attach(self, workers: Sequence[Any], step: int) -> None:
        """A new attempt's workers, in rank order, starting after `step` steps."""
        self._workers = list(workers)
        self._step = step
        self.evals.forget()
        self.snapshots.start_attempt()

    def restart_clock(self) -> None:
        """The next step's time counts from now (a save's pause, or one given up, is not the step's)."""
        self._done_at = self.clock()

    def segment(self, end: int, ahead: Ahead, *, resize_may_follow: bool) -> Segment:
        return Segment(self, end, ahead, resize_may_follow)

    # -- what a Segment uses
    def _submit(self, step: int, checkpoint_at: int) -> Calls:
        # The checkpoint's step is copied to memory too: its save then writes that copy (no pause for it).
        due = not self.hold_snapshots() and self.snapshots.due(step + 1, checkpoint=step + 1 == checkpoint_at)
        probe, skip = self.snapshots.probe(step + 1), step + 1 in self.skip
        calls = self.group.call(self._workers, WorkerApi.train_step, step, due, probe, skip)
        self.evals.submit(self.group, self._workers, step)  # queued behind the step on every rank
        return calls

    def _gather(self, step: int, calls: Calls) -> Generator[str, None, list[dict[str, Any]]]:
        """WAITING each slice the step is out, then every rank's result; a failure raises AttemptFailed."""
        timeout_s = self.cfg.failure.hang_timeout_s
        deadline = self.clock() + timeout_s
        answered: dict[str, Reply] = {}
        while True:
            left = deadline - self.clock()
            waiting = {wid: c for wid, c in calls.items() if wid not in answered}
            # With stop_on_error the group waits its grace for the others after a first error: the
            # first seen may be a survivor's broken collective, the root cause arrives just after.
            replies = self.group.gather(waiting, max(0.0, min(WAIT_SLICE_S, left)), stop_on_error=True)
            answered.update((wid, r) for wid, r in replies.items() if r.ok)
            if len(answered) == len(calls):
                return [answered[wid].value for wid in calls]
            if any(r.error not in ("", TIMED_OUT) for r in replies.values()) or left <= WAIT_SLICE_S:
                raise AttemptFailed(classify(self.group, {**answered, **replies}, step, "step", timeout_s))
            yield WAITING

    def _done(self, step: int, results: list[dict[str, Any]]) -> StepDone:
        now = self.clock()
        wall = now - (self._done_at or now)
        self._done_at, self.last_step_s, self._step = now, wall, step + 1
        gbs = self.cfg.training.global_batch_size
        replicas = replica_results(results)
        engine = max((float(r.get("engine_s", r.get("step_time_s")) or 0.0) for r in results), default=0.0)
        metrics = {
            "loss": step_loss(replicas),
            "lr": results[0]["lr"],
            "step_time_s": wall,
            "engine_s": engine,  # the slowest rank's forward, backward and update
            "step_overhead_s": max(0.0, wall - engine) if wall > 0 else 0.0,
            "samples_per_s": gbs / wall if wall > 0 else 0.0,
            "tokens_per_s": gbs * self.cfg.data.seq_len / wall if wall > 0 else 0.0,
            "world_size": float(self.world_size),
            **preference_figures(replicas),  # a preference objective's rewards and log-probabilities
        }
        return StepDone(step, results, wall, metrics, replicas)


class Segment:
    """Steps up to `end`, then the checkpoint's save, queued on each actor behind the last step.

    Queued, not sent after the last step's result: a rank goes from its last step straight to its
    snapshot and, unless a resize may follow, straight on to the next segment's first steps, so it
    never idles while the driver reads results. After iterating: `save` (None when stopped early or
    none was queued) and `ahead`, the next segment's steps already queued.
    """

    def __init__(self, pipeline: StepPipeline, end: int, ahead: Ahead, resize_may_follow: bool) -> None:
        self.pipeline = pipeline
        self.end = end
        self.save: QueuedSave | None = None
        self.ahead: Ahead = deque()
        self._inflight = ahead
        self._resize_may_follow = resize_may_follow
        self._stopping = False

    def queued(self, save: QueuedSave) -> None:
        """The save the loop queued at SAVE_DUE."""
        self.save = save

    def stop_early(self) -> None:
        """Submit no more: the steps in flight are handed back, then the segment ends (no save)."""
        assert self.save is None, "a segment whose save is queued runs to its end"
        self._stopping = True

    def __iter__(self) -> Iterator[Item]:
        p, end, inflight = self.pipeline, self.end, self._inflight
        max_steps, every = p.cfg.training.max_steps, p.cfg.checkpoint.every_steps
        next_step = p.step + len(inflight)
        p.restart_clock()
        while p.step < end or (next_step == end and self.save is None and not self._stopping):
            while not self._stopping and next_step < end and len(inflight) < PIPELINE_DEPTH:
                inflight.append((next_step, p._submit(next_step, end)))
                next_step += 1
            if next_step == end and self.save is None and not self._stopping:
                yield SAVE_DUE
                assert self.save is not None, "SAVE_DUE is answered with queued()"
                if (
                    self.save.calls
                    and end < max_steps
                    and not self._resize_may_follow
                    and p.queue_past_checkpoints
                ):
                    # Never past the next checkpoint, whose snapshot must queue behind its last step.
                    limit = min(max_steps, end + PIPELINE_DEPTH, end + every)
                    self.ahead.extend((s, p._submit(s, end + every)) for s in range(end, limit))
            if not inflight:
                break
            step, calls = inflight.popleft()
            results = yield from p._gather(step, calls)  # WAITING while the step is out
            yield p._done(step, results)
