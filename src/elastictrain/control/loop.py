"""The controller: the only run loop (observe -> decide -> act) and, through its recorder, the only writer
of the run's state.

    acquire capacity -> start an attempt -> train -> (failure or resize) decide -> ... -> finish

Workers outlive attempts: after a failure or a resize only the process group and the engines are
rebuilt (on a fresh rendezvous), and only missing workers get new actors. Every concern is a part
with its own state (capacity.py, saves.py, failures.py, pipeline.py, record.py); this file is the
order in which the loop uses them: `_apply` is what the run does with each step done, in order. It
never imports Ray: the worker group does (cluster/).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastictrain.checkpoint.model_record import configured_model
from elastictrain.checkpoint.store import CheckpointStore
from elastictrain.cluster.calls import Group
from elastictrain.control.attempt import AttemptSetUp
from elastictrain.control.bad_steps import BadSteps
from elastictrain.control.callbacks import Callbacks
from elastictrain.control.capacity import Capacity
from elastictrain.control.errors import AttemptFailed, RollBackDue, RunFailed
from elastictrain.control.evaluation import Evaluations
from elastictrain.control.failures import leave_workers, remove_at_fault, teardown
from elastictrain.control.manifest import manifest_for
from elastictrain.control.memory_recovery import MemoryRecovery
from elastictrain.control.pipeline import SAVE_DUE, WAITING, Ahead, StepDone, StepPipeline
from elastictrain.control.progress import Reporter
from elastictrain.control.record import RunRecorder, ledger_from_env
from elastictrain.control.reference_pass import ReferencePass
from elastictrain.control.resume import ResumePoints
from elastictrain.control.saves import QueuedSave, SaveCoordinator
from elastictrain.control.snapshot_schedule import SnapshotSchedule
from elastictrain.control.specs import resize_reason
from elastictrain.control.stop import STOPPED_BY_SIGTERM, Signals, sigterm_stops
from elastictrain.control.stragglers import Stragglers
from elastictrain.core.batch import BatchPlan
from elastictrain.core.policy import Fail, Failure, Restart, decide_after_failure
from elastictrain.core.recovery import Recovery
from elastictrain.core.state import RunStatus
from elastictrain.rundir.run_dir import RunDir
from elastictrain.storage.durable import remove_stale_temporaries
from elastictrain.tracking.tracker import Tracker

log = logging.getLogger("elastictrain.controller")


@dataclass
class RunSummary:
    status: RunStatus
    step: int
    message: str = ""
    world_sizes: list[int] = field(default_factory=list)
    failures: int = 0


class Controller:
    def __init__(
        self,
        config: Any,
        run_dir: RunDir,
        tracker: Tracker,
        reporter: Reporter,
        group: Group,
        *,
        clock: Callable[[], float] = time.monotonic,
        callbacks: Callbacks | None = None,
        degrees: Any = None,
        layouts: Any = None,
        stages: Any = None,
    ) -> None:
        """`degrees`: with `tensor_parallel: auto`, what chose the degree (driver/tensor_parallel_auto.py); a
        restart at a new world size asks it again; `layouts` likewise for auto layout fields
        (driver/layout_auto.py) and `stages` for `pipeline_parallel: auto` (driver/pipeline_auto.py),
        asked before every attempt."""
        self.cfg = config
        self.group = group
        self.clock = clock
        self.callbacks = callbacks or Callbacks()
        self._signals = Signals()  # what sigterm_stops saw while the loop runs
        self.store = CheckpointStore(run_dir.checkpoints_dir)
        self.recorder = RunRecorder(run_dir, tracker, reporter)
        self.resume = ResumePoints(self.store, configured_model(config), self.recorder)
        self.capacity = Capacity(
            config, group, self.recorder, clock=clock, degrees=degrees, layouts=layouts, stages=stages
        )
        self.saves = SaveCoordinator(config, group, self.store, self.recorder, self.resume, clock=clock)
        self.snapshots = SnapshotSchedule(config)  # which steps the ranks copy to host memory
        self.evals = Evaluations(config, self.recorder)
        # Steps not applied, rollbacks and the batches skipped on purpose.
        self.bad_steps = BadSteps(config, self.recorder, self.store)
        self.pipeline = StepPipeline(
            config,
            group,
            self.snapshots,
            self.evals,
            clock=clock,
            skip=self.bad_steps.skip,
            hold_snapshots=lambda: self.bad_steps.first_bad() is not None,
        )
        self.memory = MemoryRecovery(config, group, self.snapshots)  # buddies, and loading from them
        self.reference = ReferencePass(config, group, self.recorder)  # a full fine-tune's DPO/KTO reference
        self.stragglers = Stragglers(config, self.recorder, group)  # a rank slower than the others, named
        self.setup = AttemptSetUp(
            config, group, self.recorder, self.resume, self.memory, self.reference, clock
        )
        self.recovery: Recovery | None = None  # from a failure's detection or a grow to the next step done
        # ELASTICTRAIN_SAMPLE_LEDGER=FILE: every step's sample ids, appended (audits and chaos tests).
        self.ledger: Callable[[int, int, list[int], bool], None] | None = ledger_from_env()
        self.attempt = 0
        self.failure_history: list[Failure] = []  # what recurs unchanged after a restart is not retried
        self.plan: BatchPlan | None = None
        self.active: list[Any] = []  # this attempt's workers, in rank order
        self.active_before: list[Any] = []  # the last attempt's workers, for stable ranks

    # What callbacks look at.
    @property
    def step(self) -> int:
        return self.pipeline.step

    @property
    def world_size(self) -> int:
        return self.pipeline.world_size

    # ------------------------------------------------------------------ the loop
    def run(self) -> RunSummary:
        with sigterm_stops() as self._signals:  # SIGTERM takes the Ctrl-C path below
            return self._run()

    def _run(self) -> RunSummary:
        recorder, max_steps = self.recorder, self.cfg.training.max_steps
        try:
            self._begin()
            # Finished only when a committed checkpoint holds max_steps: a failure during the last
            # segment's save leaves the step counter at max_steps but that checkpoint abandoned.
            while self._committed_step() < max_steps:
                size = self.capacity.acquire(initial=self.attempt == 0, step=self.step)
                try:
                    self._start_attempt(size)
                    self._train()
                except RollBackDue as due:
                    self._roll_back(due)
                except AttemptFailed as e:
                    self._after_failure(e.failure)
            recorder.set_status(RunStatus.FINISHED, "finished", step=self.step)
            recorder.step_costs(self.step)
            self._event("finish", f"finished at step {self.step}", style="green")
            return self._summary(RunStatus.FINISHED, "finished")
        except RunFailed as e:
            recorder.record_end(RunStatus.FAILED, str(e), step=self.step)
            self._event("fail", f"run failed: {e}", style="bold red", reason=str(e))
            return self._summary(RunStatus.FAILED, str(e))
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (control/stop.py)
            reason = STOPPED_BY_SIGTERM if self._signals.sigterm else (str(e) or "interrupted")
            self.saves.stop(self.step)  # committed if every rank's file is written, else dropped
            recorder.record_end(RunStatus.STOPPED, reason, step=self.step)
            self._event(
                "stop",
                f"{reason}; resume with `elastictrain resume {recorder.run_dir.path}`",
                style="yellow",
                reason=reason,
            )
            raise
        except Exception as e:  # a bug or an error no part handles: still the run's recorded end
            message = f"{type(e).__name__}: {e}"
            recorder.record_end(RunStatus.FAILED, message, step=self.step)
            self._event(
                "fail",
                f"run failed: {message}; once fixed, `elastictrain resume {recorder.run_dir.path}` "
                "continues from the last committed checkpoint",
                style="bold red",
                reason=message,
            )
            raise
        finally:
            recorder.reporter.close()
            for callback in self.callbacks.before_shutdown:
                callback(self)
            self._leave()

    def _leave(self) -> None:
        leave_workers(self.group, self.recorder, self.step, self._teardown if self.active else None)

    def _begin(self) -> None:
        """Clean what an interrupted save left, find the checkpoint to resume from, say so."""
        # With the run folder's lock held, another pid's temporary file is a crashed driver's.
        partials = self.store.clean_partials() + remove_stale_temporaries(self.recorder.run_dir.path)
        if partials:
            self._event(
                "partial_checkpoints_removed",
                f"removed what an interrupted save left behind: {', '.join(partials)}",
                style="yellow",
                removed=partials,
            )
        resumed = self.resume.candidate(self.step)
        if resumed and resumed.manifest["step"] >= self.cfg.training.max_steps:
            resumed = self.resume.find(self.step)  # no set-up follows to verify it beside: now
        self.pipeline.resume_at(resumed.manifest["step"] if resumed else 0)
        self.recorder.begin(step=self.step, nothing_to_train=self.step >= self.cfg.training.max_steps)
        if resumed:
            self._event(
                "resume",
                f"resuming from checkpoint {resumed.tag} (step {self.step})",
                tag=resumed.tag,
            )
        else:
            self._event("start", f"starting run {self.recorder.run_dir.read_info().name} at step 0")
        self.recorder.reporter.start(self.step)

    # ------------------------------------------------------------------ start an attempt
    def _start_attempt(self, size: int) -> None:
        while not self._set_up_attempt(size):
            # What it loaded did not verify (now rejected): set up again from the previous checkpoint.
            self._teardown()
            fallback = self.resume.candidate(self.step)
            assert fallback is not None  # with one rejected, `candidate` raises once none is left
            self._event("resume", f"resuming from checkpoint {fallback.tag} instead", tag=fallback.tag)

    def _set_up_attempt(self, size: int) -> bool:
        """Set up the workers of an attempt of `size`; False when the checkpoint they loaded was rejected."""
        self.attempt += 1
        plan = self.capacity.layout_plan(size, self.step)
        workers = self.setup.choose_workers(plan, self.active_before, self.step)
        source = self.setup.choose_source(self.step)
        # Steps since that snapshot or checkpoint are redone (added up over set-ups done again).
        if self.recovery is not None:
            self.recovery = self.recovery.set_up(self.step - source.step, source.name)
        previous = self.world_size
        self.plan, self.active, self.active_before = plan, workers, workers
        self.stragglers.attach(workers, plan.pipeline_parallel)
        self.pipeline.attach(workers, source.step)
        self.saves.attach(workers, manifest_for(self.cfg, self.recorder.run_dir, size, plan))
        attempt = self.setup.attempt(self.attempt, plan, workers, source, self.step)
        began = self.clock()
        timings = self.setup.set_up(attempt, self.setup.build_specs(attempt, self.step), self.step)
        if timings is None:
            return False
        self.recorder.record_world_size(self.step, size, resize_reason(previous, size))
        self.recorder.set_status(RunStatus.RUNNING, step=self.step)
        self.setup.describe(attempt, timings, self.step, began)
        self.recorder.metrics({"world_size": float(size)}, step=self.step)
        for callback in self.callbacks.after_attempt_start:
            callback(self)
        return True

    # ------------------------------------------------------------------ train
    def _train(self) -> None:
        every = self.cfg.checkpoint.every_steps
        max_steps = self.cfg.training.max_steps
        if self.reference.due():  # before the first update: the workers hold the starting model
            self.reference.run(self.active, self.step)
        ahead: Ahead = deque()
        if self._committed_step() < self.step and (self.step % every == 0 or self.step == max_steps):
            # Restarted from memory at a checkpoint step whose save the failure dropped: save it now.
            save, ahead = self._segment(self.step, ahead, resize_may_follow=True)
            assert save is not None  # no stop asked
            self.saves.collect(save, self.step)
        while self.step < max_steps:
            segment_end = min(max_steps, (self.step // every + 1) * every)
            # Below max_workers every checkpoint may be followed by a grow: then no step is queued past it.
            resize_may_follow = self.world_size < self.capacity.rules.max_workers
            # With in-memory snapshots a grow need not wait for the checkpoint: any step will do.
            anywhere = resize_may_follow and self.memory.live()
            save, ahead = self._segment(
                segment_end, ahead, resize_may_follow=resize_may_follow, grow=anywhere
            )
            if save is not None:
                self.saves.collect(save, self.step)
                self.pipeline.restart_clock()
            if not ahead and self._grow(checkpointed=save is not None):
                return
        self.saves.finish(self.step)  # the last checkpoint is committed before the run says finished
        if self._committed_step() < max_steps:  # not written (e.g. a full disk): training again won't help
            previous = self.resume.latest()
            raise RunFailed(
                f"the final checkpoint (step {max_steps}) could not be saved: {self.saves.last_failure}; "
                f"resume with `elastictrain resume` (from {previous.tag if previous else 'step 0'}) "
                "once it can be written"
            )

    def _segment(
        self, end: int, ahead: Ahead, *, resize_may_follow: bool, grow: bool = False
    ) -> tuple[QueuedSave | None, Ahead]:
        """Steps up to `end` and the save queued behind them: the queued save (None when a grow stopped
        the segment early) and the next segment's steps already queued."""
        segment = self.pipeline.segment(end, ahead, resize_may_follow=resize_may_follow)
        for item in segment:
            if item is SAVE_DUE:
                segment.queued(self.saves.queue(end, current=self.step))
            elif item is WAITING:  # a write that ended mid-step commits now, not with the next report
                self._watching_saves(lambda: self.saves.poll_writes(self.step))
            else:
                assert isinstance(item, StepDone)
                self._apply(item)
                if grow and segment.save is None and self._grow_is_ready():
                    segment.stop_early()
        return segment.save, segment.ahead

    def _apply(self, done: StepDone) -> None:
        """A step whose replies are in, in the order the run takes note of it."""
        self._watching_saves(lambda: self.saves.observe(done.index, done.results))  # writes ride on replies
        metrics = {
            **done.metrics,
            **self.snapshots.note(done.index, done.results, done.wall_s, self.recorder),
            **self.bad_steps.note(done.index, done.results, done.metrics["loss"]),
            **self.stragglers.note(done.index, done.results, done.wall_s),
        }
        if self.recovery is not None:  # the first step after a failure or a resize
            compute = max((float(r.get("step_time_s") or 0.0) for r in done.results), default=0.0)
            figures = self.recovery.figures(self.clock(), compute)
            metrics.update(figures)
            self._event(
                "recovered",
                self.recovery.describe(figures),
                recovery_seconds=figures["recovery_seconds"],
                stall_s=figures["stall_seconds"],
                steps_lost=self.recovery.lost_steps,
                recovered_from=self.recovery.source,
            )
            self.recovery = None
        if self.ledger is not None:
            for r in sorted(done.replicas, key=lambda r: r["rank"]):
                self.ledger(done.index, r["rank"], r["sample_ids"], not r.get("update_applied", True))
        self.capacity.tend_workers(self.step)  # a replacement placed mid-segment starts warming now
        self.recorder.step_metrics(self.step, metrics, log_every=self.cfg.training.log_every_steps)
        # With failure.replace_stragglers: ends the attempt to swap or drop one.
        self.stragglers.replace_named(spare_ready=lambda: self.capacity.slots() > self.world_size)
        self.bad_steps.roll_back_if_due()  # bad steps in a row, or a spike: ends the attempt to go back
        self.saves.keep_before = self.bad_steps.first_bad()  # the last good checkpoint is not pruned
        self.evals.collect(self.group, done.index)
        for callback in self.callbacks.after_step:
            callback(self, done.index, done.results)

    def _watching_saves(self, look: Callable[[], None]) -> None:
        """`look` at the save in flight; a save it gave up restarts the step clock (not a step's pause)."""
        given_up = self.saves.failed_at
        look()
        if self.saves.failed_at != given_up:
            self.pipeline.restart_clock()

    def _grow_is_ready(self) -> bool:
        return self.capacity.grow_target(self.world_size, self.step) is not None

    def _grow(self, *, checkpointed: bool) -> bool:
        """Move to a larger world size if warm workers for it are there: after a checkpoint, or at any
        step once every rank holds this step's state in memory."""
        if self.step >= self.cfg.training.max_steps:
            return False
        target = self.capacity.grow_target(self.world_size, self.step)
        if target is None or not (checkpointed or self.memory.snapshot_now(self.active, self.step)):
            return False
        self.recorder.set_status(RunStatus.RESIZING, step=self.step)
        held = "just checkpointed" if checkpointed else "this step's state is in memory"
        self._event(
            "grow",
            f"capacity for {target} workers is back; growing {self.world_size} -> {target} "
            f"at step {self.step} ({held}: nothing lost)",
            style="cyan",
            world_size=target,
        )
        self.saves.finish(self.step)
        # Training stopped when the last step before the grow was done.
        self.recovery = Recovery(self.clock(), stalled_since=self.pipeline.last_step_done_at)
        self._teardown()
        self.memory.choose(max_step=self.step, disk_step=self._committed_step())  # no disk read if held
        return True

    def _roll_back(self, due: RollBackDue) -> None:
        """Return to the newest state before `due`'s steps, from memory (disk if none); the next attempt
        skips their batches (the pipeline's skip set holds them)."""
        detected = self.clock()
        self.recorder.set_status(RunStatus.RECOVERING, str(due), step=self.step)
        self.saves.settle(Failure("rollback", (), self.step, str(due)), self.step)
        self._teardown()
        self.store.clean_partials()
        # Checkpoints saved since the bad steps began are not loaded (a replay saves them again).
        self.resume.pass_over_after(due.before, f"saved after step {due.before}, once bad steps began")
        memory = self.memory.choose(max_step=due.before, disk_step=self._committed_step())
        source = (
            f"the in-memory snapshot at step {memory.plan.step}"
            if memory.plan
            else f"the last checkpoint at or before step {due.before} (not from memory: {memory.reason})"
        )
        steps = ", ".join(map(str, due.steps))
        self._event(
            "rollback",
            f"rolling back to {source}: {due}; the batches of step(s) {steps} are skipped",
            style="bold yellow",
            cause=due.cause,
            steps=list(due.steps),
            recovered_from="memory" if memory.plan else "disk",
        )
        self.recovery = Recovery(detected, stalled_since=self.pipeline.last_step_done_at)

    # ------------------------------------------------------------------ decide after a failure
    def _after_failure(self, failure: Failure) -> None:
        for callback in self.callbacks.on_failure:
            callback(self, failure)
        detected = self.clock()
        self.recorder.failures += 1
        self.recorder.set_status(RunStatus.RECOVERING, failure.message, step=self.step)
        self._event(
            "failure",
            f"{failure.kind}: {failure.message}",
            style="bold red",
            kind=failure.kind,
            workers=list(failure.worker_ids),
            failure_number=self.recorder.failures,
        )
        remove_at_fault(self.group, failure)
        self.saves.settle(failure, self.step)
        self._teardown(abort=True)
        self.store.clean_partials()  # a snapshot queued when the failure struck left its staging folder
        ckpt = self.resume.latest()
        if failure.kind == "out_of_memory":
            self.capacity.lower_ceiling(self.world_size, self.step)
        decision = decide_after_failure(
            self.capacity.rules,
            failure,
            self.recorder.failures,
            self.capacity.slots(),
            self.clock(),
            earlier=self.failure_history,
        )
        self.failure_history.append(failure)
        if isinstance(decision, Fail):
            if failure.detail and decision.reason.startswith("deterministic"):
                # Once, whole: the worker's own traceback, for the error that ends the run.
                worker = failure.worker_ids[0] if failure.worker_ids else ""
                self._event("worker_traceback", failure.detail.strip(), style="red", worker=worker)
            raise RunFailed(decision.reason)
        resume_step = ckpt.manifest["step"] if ckpt else 0
        memory = self.memory.choose(max_step=self.step, disk_step=resume_step)
        source = (
            f"the in-memory snapshot at step {memory.plan.step}"
            if memory.plan
            else f"{ckpt.tag if ckpt else 'the beginning'} (step {resume_step}; "
            f"not from memory: {memory.reason})"
        )
        self._event(
            "decision",
            f"decision: restart from {source}; "
            + (decision.reason if isinstance(decision, Restart) else f"wait: {decision.reason}"),
            decision=type(decision).__name__,
            world_size=decision.world_size if isinstance(decision, Restart) else None,
            recovered_from="memory" if memory.plan else "disk",
            memory=memory.reason,
        )
        # A failure before the first step of the last recovery keeps that recovery's lost steps.
        self.recovery = self.recovery.detected(detected) if self.recovery else Recovery(detected)

    def _committed_step(self) -> int:
        latest = self.resume.latest()
        return int(latest.manifest["step"]) if latest else 0

    def _teardown(self, *, abort: bool = False) -> None:
        teardown(
            self.group, self.active, self.recorder, self.step, hand_off=self.memory.every > 0, abort=abort
        )
        self.active = []

    # ------------------------------------------------------------------ helpers
    def _event(self, name: str, message: str = "", style: str = "", **fields: Any) -> None:
        self.recorder.event(name, message, style, step=self.step, **fields)

    def _summary(self, status: RunStatus, message: str) -> RunSummary:
        return RunSummary(status, self.step, message, self.recorder.history(), self.recorder.failures)
