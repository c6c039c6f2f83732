"""The step pipeline: submit steps ahead to every rank, gather them in order, and report each step."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from elastictrain.cluster.calls import Calls, Group
from elastictrain.cluster.worker_api import WorkerApi
from elastictrain.control.capacity import Capacity
from elastictrain.control.evaluation import Evaluations
from elastictrain.control.failures import gather_results
from elastictrain.control.record import RunRecorder
from elastictrain.control.saves import QueuedSave, SaveCoordinator
from elastictrain.control.snapshot_schedule import SnapshotSchedule
from elastictrain.core.losses import preference_figures, replica_results, step_loss

PIPELINE_DEPTH = 2  # steps queued per actor, so no rank idles while the driver reads results

Ahead = deque[tuple[int, Calls]]  # steps submitted past the last gathered one
StepHook = Callable[[int, list[dict[str, Any]]], None]  # (step index, every rank's result)


class StepPipeline:
    def __init__(
        self,
        config: Any,
        group: Group,
        recorder: RunRecorder,
        saves: SaveCoordinator,
        capacity: Capacity,
        *,
        after_step: StepHook,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = config
        self.group = group
        self.recorder = recorder
        self.saves = saves
        self.capacity = capacity
        self.snapshots = SnapshotSchedule(config)  # which steps the ranks copy to host memory
        self.after_step = after_step
        self.clock = clock
        self.step = 0  # optimizer steps done (and reported)
        self.workers: list[Any] = []  # this attempt's, in rank order
        self.world_size = 0
        self.last_step_done_at: float | None = None
        self.last_step_s = 0.0  # the last reported step's time, as the loop measures it
        self.recovering_since: float | None = None  # set after a failure or resize until a step is done
        # A grow: when the last step before it was done (training stopped then, not at the decision).
        self.stalled_since: float | None = None
        self.lost_steps = 0
        self.recovered_from = "disk"  # where the attempt after a failure or resize loaded: memory or disk
        self.ledger: Callable[[int, int, list[int]], None] | None = _ledger_from_env()
        self.evals = Evaluations(config, recorder)

    def attach(self, workers: Sequence[Any], step: int) -> None:
        self.workers = list(workers)
        self.world_size = len(self.workers)
        self.step = step
        self.evals.forget()
        self.snapshots.start_attempt()

    def run_segment(
        self, end: int, ahead: Ahead, *, resize_may_follow: bool, stop: Callable[[], bool] | None = None
    ) -> tuple[QueuedSave | None, Ahead]:
        """Steps up to `end`, then the checkpoint's snapshot, queued on each actor behind the last step.

        Queued, not sent after the last step's result: a rank goes from its last step straight to its
        snapshot and, unless a resize may follow, straight on to the next segment's first steps, so it
        never idles while the driver reads results. Returns the queued save and the steps queued ahead.
        `stop()`, asked after each step before the save is queued, ends the segment early: the steps in
        flight are finished and (None, nothing ahead) returned (a grow that need not wait for `end`).
        """
        max_steps = self.cfg.training.max_steps
        inflight = ahead
        next_step = self.step + len(inflight)
        self.last_step_done_at = self.clock()
        save: QueuedSave | None = None
        following: Ahead = deque()
        while self.step < end:
            while next_step < end and len(inflight) < PIPELINE_DEPTH:
                inflight.append((next_step, self._submit(next_step, end)))
                next_step += 1
            if next_step == end and save is None:
                save = self.saves.queue(end, current=self.step)
                if save.calls and end < max_steps and not resize_may_follow:
                    # Never past the next checkpoint, whose snapshot must queue behind its last step.
                    limit = min(max_steps, end + PIPELINE_DEPTH, end + self.cfg.checkpoint.every_steps)
                    following.extend(
                        (s, self._submit(s, end + self.cfg.checkpoint.every_steps)) for s in range(end, limit)
                    )
            step, calls = inflight.popleft()
            self._gather_and_report(step, calls)
            if save is None and stop is not None and stop():
                while inflight:
                    self._gather_and_report(*inflight.popleft())
                return None, deque()
        if save is None:  # the segment was empty (resumed exactly at a checkpoint step)
            save = self.saves.queue(end, current=self.step)
        return save, following

    def _gather_and_report(self, step: int, calls: Calls) -> None:
        results = gather_results(
            self.group,
            calls,
            step,
            timeout_s=self.cfg.failure.hang_timeout_s,
            phase="step",
            tick=lambda: self.saves.poll_writes(self.step),  # a checkpoint commits once written
        )
        self._report(step, list(results.values()))

    def restart_clock(self) -> None:
        """Pipelined steps restart their clock after a save's pause."""
        self.last_step_done_at = self.clock()

    def _submit(self, step: int, checkpoint_at: int) -> Calls:
        # The checkpoint's step is copied to memory too: its save then writes that copy (no pause for it).
        due = self.snapshots.due(step + 1, checkpoint=step + 1 == checkpoint_at)
        calls = self.group.call(self.workers, WorkerApi.train_step, step, due, self.snapshots.probe(step + 1))
        self.evals.submit(self.group, self.workers, step)  # queued behind the step on every rank
        return calls

    def _report(self, step: int, results: list[dict[str, Any]]) -> None:
        self.saves.observe(step, results)
        now = self.clock()
        # A save given up meanwhile restarts the clock, as its pause is not the step's.
        started = max(self.last_step_done_at or now, self.saves.failed_at or float("-inf"))
        wall = now - started
        self.last_step_done_at = now
        self.last_step_s = wall
        self.step = step + 1
        gbs = self.cfg.training.global_batch_size
        replicas = replica_results(results)
        metrics = {
            "loss": step_loss(replicas),
            "lr": results[0]["lr"],
            "step_time_s": wall,
            "samples_per_s": gbs / wall if wall > 0 else 0.0,
            "tokens_per_s": gbs * self.cfg.data.seq_len / wall if wall > 0 else 0.0,
            "world_size": float(self.world_size),
            **preference_figures(replicas),  # a preference objective's rewards and log-probabilities
        }
        changed = self.snapshots.observe(step, results, wall)
        if self.snapshots.window is not None:  # a window of snapshots measured: its figures, moved or not
            self.recorder.quiet_event("snapshot_costs", step=self.step, **self.snapshots.window)
            self.snapshots.window = None
        if self.snapshots.measured is not None:  # what this step's snapshot cost training (CPU or wait)
            metrics["snapshot_cost_s"] = self.snapshots.measured
        if changed:
            s, fields = self.snapshots, {"interval": self.snapshots.interval, "off": self.snapshots.off}
            if s.off or s.changes == 1:  # said in the terminal once; later moves only in events.jsonl
                self.recorder.event("snapshots", changed, step=self.step, **fields)
            else:
                self.recorder.quiet_event("snapshots", step=self.step, message=changed, **fields)
        if self.recovering_since is not None:
            metrics["recovery_seconds"] = now - self.recovering_since
            metrics["steps_lost"] = float(self.lost_steps)
            metrics["recovered_from_memory"] = float(self.recovered_from == "memory")
            # The time no rank trained: from the last step done (a grow) or the detection (a failure) to
            # this step's end, less this step's own compute on its slowest rank.
            since = self.stalled_since if self.stalled_since is not None else self.recovering_since
            compute = max((float(r.get("step_time_s") or 0.0) for r in results), default=0.0)
            metrics["stall_seconds"] = max(0.0, now - since - compute)
            self.recorder.event(
                "recovered",
                f"first step after the restart done {metrics['recovery_seconds']:.2f}s after detection; "
                f"{self.lost_steps} step(s) lost; state from {self.recovered_from}; training stopped for "
                f"{metrics['stall_seconds']:.2f}s",
                step=self.step,
                recovery_seconds=metrics["recovery_seconds"],
                stall_s=metrics["stall_seconds"],
                steps_lost=self.lost_steps,
                recovered_from=self.recovered_from,
            )
            self.recovering_since, self.lost_steps = None, 0  # the next recovery counts its own
            self.stalled_since = None
        if self.ledger is not None:
            for r in sorted(replicas, key=lambda r: r["rank"]):
                self.ledger(step, r["rank"], r["sample_ids"])
        if self.group.pending:
            self.capacity.start_new_workers(self.step)  # a replacement placed mid-segment starts warming now
        self.recorder.step_metrics(self.step, metrics, log_every=self.cfg.training.log_every_steps)
        self.evals.collect(self.group, step)
        self.after_step(step, results)


def _ledger_from_env() -> Callable[[int, int, list[int]], None] | None:
    """ELASTICTRAIN_SAMPLE_LEDGER=FILE: append every reported step's sample ids (audits and chaos tests)."""
    path = os.environ.get("ELASTICTRAIN_SAMPLE_LEDGER")
    if not path:
        return None

    def record(step: int, rank: int, ids: list[int]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "rank": rank, "ids": ids}) + "\n")

    return record
