"""The controller: the only run loop (observe -> decide -> act) and, through its recorder, the only writer
of the run's state.

    acquire capacity -> start an attempt -> train -> (failure or resize) decide -> ... -> finish

Workers outlive attempts: after a failure or a resize only the process group and the engines are
rebuilt (on a fresh rendezvous), and only missing workers get new actors. Every concern is a part
with its own state (capacity.py, saves.py, failures.py, pipeline.py, record.py); this file is the
order in which the loop uses them. It never imports Ray: the worker group does (cluster/).
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
from elastictrain.cluster.worker_api import WorkerApi
from elastictrain.control.callbacks import Callbacks
from elastictrain.control.capacity import Capacity
from elastictrain.control.errors import AttemptFailed, RunFailed
from elastictrain.control.failures import gather_results, leave_workers, remove_at_fault, teardown
from elastictrain.control.manifest import manifest_for
from elastictrain.control.memory_recovery import MemoryRecovery
from elastictrain.control.pipeline import Ahead, StepPipeline
from elastictrain.control.progress import Reporter
from elastictrain.control.record import RunRecorder
from elastictrain.control.reference_pass import ReferencePass
from elastictrain.control.resume import ResumePoints
from elastictrain.control.saves import SaveCoordinator
from elastictrain.control.specs import (
    attempt_specs,
    replicas_text,
    resize_reason,
    set_up_peak_note,
    slowest_set_up,
)
from elastictrain.control.stop import STOPPED_BY_SIGTERM, Signals, sigterm_stops
from elastictrain.core.batch import BatchPlan
from elastictrain.core.policy import Fail, Failure, Restart, decide_after_failure
from elastictrain.core.replicas import replica_order
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
    ) -> None:
        """`degrees`: with `tensor_parallel: auto`, what chose the degree (tensor_parallel_auto.py); a
        restart at a new world size asks it again."""
        self.cfg = config
        self.group = group
        self.clock = clock
        self.callbacks = callbacks or Callbacks()
        self._signals = Signals()  # what sigterm_stops saw while the loop runs
        self.store = CheckpointStore(run_dir.checkpoints_dir)
        self.recorder = RunRecorder(run_dir, tracker, reporter)
        self.resume = ResumePoints(self.store, configured_model(config), self.recorder)
        self.capacity = Capacity(config, group, self.recorder, clock=clock, degrees=degrees)
        self.saves = SaveCoordinator(config, group, self.store, self.recorder, self.resume, clock=clock)
        self.pipeline = StepPipeline(
            config, group, self.recorder, self.saves, self.capacity, after_step=self._after_step, clock=clock
        )
        self.memory = MemoryRecovery(
            config, group, self.pipeline.snapshots
        )  # in-memory snapshots: buddies, and loading from them
        self.reference = ReferencePass(config, group, self.recorder)  # a full fine-tune's DPO/KTO reference
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

    @property
    def ledger(self) -> Callable[[int, int, list[int]], None] | None:
        return self.pipeline.ledger

    @ledger.setter
    def ledger(self, record: Callable[[int, int, list[int]], None] | None) -> None:
        self.pipeline.ledger = record

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
                except AttemptFailed as e:
                    self._after_failure(e.failure)
            recorder.set_status(RunStatus.FINISHED, "finished", step=self.step)
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
        self.pipeline.step = resumed.manifest["step"] if resumed else 0
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
        plan = self.capacity.rules.plan(size)
        assert plan is not None
        # Survivors keep their ranks' order; newly warm workers follow.
        warm = self.group.warm_workers
        active = [w for w in self.active_before if w in warm] + [
            w for w in warm if w not in self.active_before
        ]
        n = plan.tensor_parallel
        if n > 1:  # each replica's ranks together on one node, survivors first where they can be
            order = replica_order([w.node_id for w in active], size, n)
            active = [active[i] for i in order] if order is not None else []
        active = active[:size]
        if len(active) < size:
            raise AttemptFailed(
                Failure("setup_error", (), self.step, f"only {len(active)} of {size} workers ready")
            )
        memory = self.memory.take()  # the survivors' in-memory snapshots, when they hold a whole step
        resume = None if memory else self.resume.candidate(self.step)  # verified beside the set-up
        start = memory.plan.step if memory else resume.manifest["step"] if resume else 0
        # Steps since that snapshot or checkpoint are redone (added up over set-ups done again).
        self.pipeline.lost_steps += self.step - start
        self.pipeline.recovered_from = "memory" if memory else "disk"
        previous = self.world_size
        self.plan, self.active, self.active_before = plan, active, active
        self.pipeline.attach(active, start)
        self.saves.attach(active, manifest_for(self.cfg, self.recorder.run_dir, size, plan))
        port = gather_results(
            self.group,
            self.group.call(active[:1], WorkerApi.free_port),
            self.step,
            timeout_s=60.0,
            phase="setup",
        )[active[0].worker_id]
        master_addr = active[0].info["node_ip"]
        t0 = self.clock()
        buddies, off_node = self.memory.buddies(active)
        specs = attempt_specs(
            self.cfg,
            attempt=self.attempt,
            plan=plan,
            run_id=self.recorder.run_dir.read_info().run_id,
            master=(master_addr, port),
            start_step=self.step,
            checkpoint_dir=str(resume.path) if resume else None,
            buddies=[None if b is None else active[b].actor for b in buddies],
            memory=memory,
            node_ids=[w.node_id for w in active],
            reference=self.reference.table,
        )
        with self.resume.verified_beside(resume, self.step) as verdict:
            calls = self.group.call_each(active, WorkerApi.setup, [(spec,) for spec in specs])
            timings = gather_results(
                self.group, calls, self.step, timeout_s=self.cfg.failure.collective_timeout_s, phase="setup"
            )
        if not verdict.ok:
            return False
        self.recorder.record_world_size(self.step, size, resize_reason(previous, size))
        self.recorder.set_status(RunStatus.RUNNING, step=self.step)
        set_up = slowest_set_up(timings, [w.worker_id for w in active])
        self._event(
            "attempt_started",
            f"attempt {self.attempt}: world size {size} (micro batch {plan.micro_batch_size} x accumulation "
            f"{plan.grad_accum_steps} x {replicas_text(plan)} = {plan.global_batch_size}), step {self.step}"
            + (f", from {resume.tag}" if resume else "")
            + (f", from memory (snapshot of attempt {memory.plan.attempt})" if memory else "")
            + f", set up in {self.clock() - t0:.2f}s"
            + set_up_peak_note(set_up["setup_peak_rss_bytes"]),
            attempt=self.attempt,
            world_size=size,
            checkpoint=resume.tag if resume else None,
            source="memory" if memory else "disk" if resume else "none",
            buddies=buddies,
            buddies_off_node=off_node,
            # The sha256 check of the checkpoint (run beside the set-up), next to what loading it cost.
            verify_s=self.resume.last_verify_s if resume else 0.0,
            **set_up,
            actors=[w.actor_id for w in active],
            workers=[w.worker_id for w in active],
            master=f"{master_addr}:{port}",
        )
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
            save, ahead = self.pipeline.run_segment(self.step, ahead, resize_may_follow=True)
            assert save is not None  # no stop asked
            self.saves.collect(save, self.step)
        while self.step < max_steps:
            segment_end = min(max_steps, (self.step // every + 1) * every)
            # Below max_workers every checkpoint may be followed by a grow: then no step is queued past it.
            resize_may_follow = self.world_size < self.capacity.rules.max_workers
            # With in-memory snapshots a grow need not wait for the checkpoint: any step will do.
            anywhere = self._grow_is_ready if resize_may_follow and self.memory.live() else None
            save, ahead = self.pipeline.run_segment(
                segment_end, ahead, resize_may_follow=resize_may_follow, stop=anywhere
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
        self.pipeline.recovering_since = self.clock()
        self.pipeline.stalled_since = self.pipeline.last_step_done_at  # a grow stops training from there
        self.pipeline.lost_steps = 0
        self._teardown()
        self.memory.choose(max_step=self.step, disk_step=self._committed_step())  # no disk read if held
        return True

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
        self.pipeline.recovering_since = detected

    def _committed_step(self) -> int:
        latest = self.resume.latest()
        return int(latest.manifest["step"]) if latest else 0

    def _teardown(self, *, abort: bool = False) -> None:
        teardown(
            self.group, self.active, self.recorder, self.step, hand_off=self.memory.every > 0, abort=abort
        )
        self.active = []

    # ------------------------------------------------------------------ helpers
    def _after_step(self, step: int, results: list[dict[str, Any]]) -> None:
        for callback in self.callbacks.after_step:
            callback(self, step, results)

    def _event(self, name: str, message: str = "", style: str = "", **fields: Any) -> None:
        self.recorder.event(name, message, style, step=self.step, **fields)

    def _summary(self, status: RunStatus, message: str) -> RunSummary:
        return RunSummary(status, self.step, message, self.recorder.history(), self.recorder.failures)
