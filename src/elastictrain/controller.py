"""The controller: the only loop (observe -> decide -> act) and the only writer of the run's state.

It keeps workers alive across attempts: after a failure or a resize only the process group and the
engines are rebuilt (on a fresh rendezvous), and only missing workers get new actors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from elastictrain.checkpoint.store import CheckpointStore, Committed, model_mismatch, verify
from elastictrain.cluster.worker_group import WorkerGroup, WorkerHandle, node_alive
from elastictrain.config.deepspeed_config import build_deepspeed_config
from elastictrain.core.batch import BatchPlan, plan_batch
from elastictrain.core.checkpoints import tag_for_step
from elastictrain.core.membership import WorkerObservation, stalled_workers
from elastictrain.core.policy import (
    Fail,
    Failure,
    Restart,
    ScalingRules,
    Wait,
    decide_after_failure,
    decide_grow,
    decide_start,
)
from elastictrain.core.state import RunStatus
from elastictrain.progress import Reporter
from elastictrain.rundir.run_dir import RunDir
from elastictrain.tracking.tracker import Tracker
from elastictrain.worker.attempt import AttemptSpec

log = logging.getLogger("elastictrain.controller")

PIPELINE_DEPTH = 2  # steps queued per actor, so no rank idles while the driver reads results
FIRST_PLACEMENT_WAIT_S = 5.0  # at the first start, time for the reservations to be placed
WARMUP_POLL_S = 1.0
SETTLE_SAVE_WAIT_S = 30.0  # after a failure, how long survivors' background writes may take to end
TEARDOWN_TIMEOUT_S = 5.0  # a survivor that cannot leave its attempt in this time is replaced


@dataclass
class PendingSave:
    """A checkpoint whose snapshot is taken and whose rank files are being written."""

    staging: Path
    step: int
    samples: int
    names: list[str]  # one file per rank, in rank order
    engine_state: dict[str, Any]
    started: float
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # written so far, by name


@dataclass
class QueuedSave:
    """A checkpoint's snapshot calls, queued on every actor behind the segment's last step."""

    step: int
    staging: Path | None  # None: the staging folder could not be made (error says why)
    refs: dict[str, Any]
    started: float
    error: str = ""


class AttemptFailed(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class RunFailed(Exception):
    pass


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
        group: WorkerGroup,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.cfg = config
        self.run_dir = run_dir
        self.tracker = tracker
        self.reporter = reporter
        self.group = group
        self.clock = clock
        self.sleep = sleep
        self.store = CheckpointStore(run_dir.checkpoints_dir)
        s = config.scaling
        self.rules = ScalingRules(
            min_workers=s.min_workers,
            max_workers=s.max_workers,
            global_batch_size=config.training.global_batch_size,
            micro_batch_size=config.training.micro_batch_size,
            max_failures=config.failure.max_failures,
            wait_for_capacity_s=config.failure.wait_for_capacity_s,
        )
        self.failures = run_dir.read_info().failures
        # MLflow holds each step's metrics once. The spool knows every step it took, even one whose
        # run.json update a killed driver did not get to write.
        self.logged_step = max(run_dir.read_info().logged_step, getattr(tracker, "logged_step", 0))
        self.attempt = 0
        self.world_size = 0
        self.plan: BatchPlan | None = None
        self.active: list[WorkerHandle] = []
        self.active_before: list[WorkerHandle] = []  # the last attempt's workers, for stable ranks
        self.step = 0
        self.last_step_done_at: float | None = None
        self.recovering_since: float | None = None
        self.lost_steps = 0
        self.ledger: Callable[[int, int, list[int]], None] | None = _ledger_from_env()
        self.rejected: list[str] = []  # checkpoints that failed verification: never loaded again
        self.last_verify_s = 0.0
        self._said_none_verifies = False
        self.pending_save: PendingSave | None = None
        self.pause_parts: tuple[int, list[float]] | None = None  # the last save's step, per-rank pause so far

    # ------------------------------------------------------------------ checkpoints to load
    def _resume_point(self) -> Committed | None:
        """The newest committed checkpoint whose every file matches its manifest's sha256.

        One that does not verify is rejected (and said so in the terminal, events.jsonl and MLflow);
        the previous one is used instead. A checkpoint of another model is refused outright.
        """
        while True:
            found = self.store.latest_committed(rejected=tuple(self.rejected))
            if found is None:
                if self.rejected and not self._said_none_verifies:
                    self._said_none_verifies = True
                    self.event(
                        "no_valid_checkpoint",
                        f"no checkpoint verifies (rejected: {', '.join(self.rejected)}); "
                        "starting from step 0",
                        style="bold red",
                    )
                return None
            mismatch = model_mismatch(found.manifest, dict(self.cfg.model.hf_config))
            if mismatch:
                raise RunFailed(
                    f"checkpoint {found.path} was saved from another model: {'; '.join(mismatch[:5])}. "
                    "Resume it with the config it was trained with (its run folder's config.yaml), "
                    "or give this config a new run.dir"
                )
            result = verify(found.path)
            self.last_verify_s = result.seconds
            if result.ok:
                return found
            self.rejected.append(found.tag)
            self.event(
                "checkpoint_rejected",
                f"checkpoint {found.tag} does not verify and will not be loaded: {'; '.join(result.problems)}"
                " -- falling back to the previous committed checkpoint",
                style="bold red",
                tag=found.tag,
                problems=result.problems,
            )

    # ------------------------------------------------------------------ events
    def event(
        self, name: str, message: str = "", style: str = "", *, step: int | None = None, **fields: Any
    ) -> None:
        step = self.step if step is None else step
        try:
            record = self.run_dir.append_event(name, step=step, message=message, **fields)
        except OSError as e:  # a full disk must not stop training: the terminal and MLflow still get it
            log.warning("could not append to %s: %s", self.run_dir.events_path, e)
            record = {"event": name, "step": step, "message": message, **fields}
        self.tracker.log_event(record)
        if message:
            self.reporter.event(message, style)
        log.info("%s %s", name, message)

    def set_status(self, status: RunStatus, message: str | None = None) -> None:
        self._update_run(status=status.value, message=message, last_step=self.step, failures=self.failures)

    def _update_run(self, **changes: Any) -> None:
        try:
            self.run_dir.update(**changes)
        except OSError as e:  # disk full: run.json keeps its last good content; training goes on
            log.warning("could not update %s: %s", self.run_dir.run_json, e)

    # ------------------------------------------------------------------ main loop
    def run(self) -> RunSummary:
        partials = self.store.clean_partials()
        if partials:
            self.event(
                "partial_checkpoints_removed",
                f"removed what an interrupted save left behind: {', '.join(partials)}",
                style="yellow",
                removed=partials,
            )
        try:
            resumed = self._resume_point()
            self.step = resumed.manifest["step"] if resumed else 0
            self.set_status(RunStatus.STARTING)
            if resumed:
                self.event(
                    "resume",
                    f"resuming from checkpoint {resumed.tag} (step {self.step}; "
                    f"all files verified in {self.last_verify_s:.2f}s)",
                    tag=resumed.tag,
                )
            else:
                self.event("start", f"starting run {self.run_dir.read_info().name} at step 0")
            self.reporter.start(self.step)
            while self.step < self.cfg.training.max_steps:
                size = self._acquire_capacity(initial=self.attempt == 0)
                try:
                    self._start_attempt(size)
                    self._train()
                except AttemptFailed as e:
                    self._handle_failure(e.failure)
            self.set_status(RunStatus.FINISHED, "finished")
            self.event("finish", f"finished at step {self.step}", style="green")
            return RunSummary(RunStatus.FINISHED, self.step, "finished", self._history(), self.failures)
        except RunFailed as e:
            self.set_status(RunStatus.FAILED, str(e))
            self.event("fail", f"run failed: {e}", style="bold red", reason=str(e))
            return RunSummary(RunStatus.FAILED, self.step, str(e), self._history(), self.failures)
        except KeyboardInterrupt:
            self.set_status(RunStatus.STOPPED, "interrupted")
            self.event("stop", "interrupted; resume with `elastictrain resume`", style="yellow")
            raise
        finally:
            self.reporter.close()
            self.group.shutdown()

    def _history(self) -> list[int]:
        return [h["world_size"] for h in self.run_dir.read_info().world_size_history]

    # ------------------------------------------------------------------ capacity
    def _capacity(self) -> int:
        return len(self.group.workers) + self.group.ready_reservations()

    def _start_new_workers(self) -> None:
        """Start actors in every placed reservation; they warm up while the others train."""
        new = self.group.start_workers(self.rules.max_workers, self.cfg)
        if new:
            self.event(
                "workers_starting",
                f"starting {len(new)} new worker actor(s) in the background",
                workers=[w.worker_id for w in new],
            )

    def _acquire_capacity(self, initial: bool) -> int:
        """The world size of the next attempt, once that many warm workers are there.

        After a failure, the warm survivors restart at once (shrinking if need be) and replacements
        warm up in the background, joining by a grow at a later checkpoint: a cold actor is on the
        critical path only at the first start or below the minimum size.
        """
        missing = self.rules.max_workers - len(self.group.workers) - len(self.group.pending)
        if missing > 0:
            self.group.request(missing)
        if initial:
            self.group.wait_for_reservations(len(self.group.pending), FIRST_PLACEMENT_WAIT_S)
        waiting_since: float | None = None
        announced = None
        while True:
            self._start_new_workers()
            self.group.poll_warm()
            if not initial:
                size = self.rules.best_size(len(self.group.warm_workers))
                if size is not None:
                    return size
            capacity = self._capacity()  # read once: a reservation may be placed at any moment
            target = self.rules.best_size(capacity)
            if target is not None:
                # Enough workers exist but some are still warming up: wait for them.
                need = target - len(self.group.warm_workers)
                if need <= 0:
                    if waiting_since is not None:
                        self.event("capacity_back", f"{target} workers ready")
                    return target
                self.group.poll_warm(timeout_s=WARMUP_POLL_S, n=need)
                continue
            decision = decide_start(self.rules, capacity, self.clock(), waiting_since)
            if isinstance(decision, Fail):
                raise RunFailed(decision.reason)
            assert isinstance(decision, Wait)
            if waiting_since is None:
                waiting_since = self.clock()
                self.set_status(RunStatus.WAITING, decision.reason)
            if announced != decision.reason:
                self.event(
                    "waiting_for_capacity",
                    f"waiting up to {decision.deadline - self.clock():.0f}s for capacity: {decision.reason}",
                    style="yellow",
                    need=decision.need,
                )
                announced = decision.reason
            self.group.wait_for_reservations(decision.need - len(self.group.workers), timeout_s=1.0)

    # ------------------------------------------------------------------ attempts
    def _start_attempt(self, size: int) -> None:
        self.attempt += 1
        plan = plan_batch(self.rules.global_batch_size, self.rules.micro_batch_size, size)
        assert plan is not None
        # Survivors keep their ranks' order; newly warm workers follow.
        warm = self.group.warm_workers
        active = [w for w in self.active_before if w in warm] + [
            w for w in warm if w not in self.active_before
        ]
        active = active[:size]
        if len(active) < size:
            raise AttemptFailed(
                Failure("setup_error", (), self.step, f"only {len(active)} of {size} workers ready")
            )
        resume = self._resume_point()
        if resume is None and self.step > 0:  # every checkpoint was rejected: start over
            self.lost_steps, self.step = self.step, 0
        if resume is not None and resume.manifest["step"] != self.step:
            self.lost_steps = self.step - resume.manifest["step"]
            self.step = resume.manifest["step"]
        self.plan, self.active, self.active_before = plan, active, active
        previous = self.world_size
        self.world_size = size
        port = ray.get(active[0].actor.free_port.remote())
        ds_config = build_deepspeed_config(self.cfg, plan.micro_batch_size, plan.grad_accum_steps, size)
        master_addr = active[0].info["node_ip"]
        specs = [
            AttemptSpec(
                attempt=self.attempt,
                rank=rank,
                world_size=size,
                master_addr=master_addr,
                master_port=port,
                backend="nccl" if self.cfg.scaling.use_gpu else "gloo",
                plan=plan,
                config=self.cfg,
                ds_config=ds_config,
                checkpoint_dir=str(resume.path) if resume else None,
                start_step=self.step,
            )
            for rank in range(size)
        ]
        t0 = self.clock()
        refs = {w.worker_id: w.actor.setup.remote(spec) for w, spec in zip(active, specs, strict=True)}
        timings = self._gather(
            refs, self.step, timeout_s=self.cfg.failure.collective_timeout_s, phase="setup"
        )
        reason = (
            "start"
            if previous == 0
            else ("shrink" if size < previous else "grow" if size > previous else "restart")
        )
        self.run_dir.record_world_size(self.step, size, reason)
        self.set_status(RunStatus.RUNNING)
        self.event(
            "attempt_started",
            f"attempt {self.attempt}: world size {size} (micro batch {plan.micro_batch_size} x accumulation "
            f"{plan.grad_accum_steps} x {size} ranks = {plan.global_batch_size}), step {self.step}"
            + (f", from {resume.tag}" if resume else "")
            + f", set up in {self.clock() - t0:.2f}s",
            attempt=self.attempt,
            world_size=size,
            checkpoint=resume.tag if resume else None,
            setup_s=max(t["total_s"] for t in timings.values()),
            # The sha256 check of the checkpoint, next to what loading it cost the slowest rank.
            verify_s=self.last_verify_s if resume else 0.0,
            load_s=max(t.get("load_s", 0.0) for t in timings.values()),
            actors=[w.actor_id for w in active],
            master=f"{master_addr}:{port}",
        )
        self.tracker.log_metrics({"world_size": float(size)}, step=self.step)

    def _train(self) -> None:
        every = self.cfg.checkpoint.every_steps
        max_steps = self.cfg.training.max_steps
        ahead: deque[tuple[int, dict[str, Any]]] = deque()
        while self.step < max_steps:
            segment_end = min(max_steps, (self.step // every + 1) * every)
            save, ahead = self._run_segment(segment_end, ahead)
            self._checkpoint(save)
            if not ahead and self._maybe_grow():
                return
        self._finish_pending_save()  # the last checkpoint is committed before the run says finished

    def _run_segment(
        self, end: int, ahead: deque[tuple[int, dict[str, Any]]]
    ) -> tuple[QueuedSave, deque[tuple[int, dict[str, Any]]]]:
        """Steps up to `end`, then the checkpoint's snapshot, queued on each actor behind the last step.

        Queued, not sent after the last step's result: a rank goes from its last step straight to its
        snapshot and, unless a resize may follow, straight on to the next segment's first steps, so it
        never idles while the driver reads results. Returns the queued save and the steps queued ahead.
        """
        inflight = ahead
        next_step = self.step + len(inflight)
        self.last_step_done_at = self.clock()
        save: QueuedSave | None = None
        following: deque[tuple[int, dict[str, Any]]] = deque()
        while self.step < end:
            while next_step < end and len(inflight) < PIPELINE_DEPTH:
                inflight.append((next_step, self._submit_step(next_step)))
                next_step += 1
            if next_step == end and save is None:
                save = self._queue_save(end)
                if save.refs and end < self.cfg.training.max_steps and not self._resize_may_follow():
                    # Never past the next checkpoint, whose snapshot must queue behind its last step.
                    every = self.cfg.checkpoint.every_steps
                    limit = min(self.cfg.training.max_steps, end + PIPELINE_DEPTH, end + every)
                    following.extend((s, self._submit_step(s)) for s in range(end, limit))
            step, refs = inflight.popleft()
            results = self._gather(refs, step, timeout_s=self.cfg.failure.hang_timeout_s, phase="step")
            self._report(step, list(results.values()))
        if save is None:  # the segment was empty (resumed exactly at a checkpoint step)
            save = self._queue_save(end)
        return save, following

    def _submit_step(self, step: int) -> dict[str, Any]:
        return {w.worker_id: w.actor.train_step.remote(step) for w in self.active}

    def _queue_save(self, step: int) -> QueuedSave:
        """Queue every rank's snapshot (and write) of the state after `step` steps behind its last step."""
        self._finish_pending_save()  # one save in flight: bounds host memory to one snapshot per rank
        started = self.clock()
        try:
            staging = self.store.begin(step)
        except OSError as e:
            return QueuedSave(step, None, {}, started, str(e))
        background = bool(self.cfg.checkpoint.background_write)
        refs = {w.worker_id: w.actor.save_shard.remote(str(staging), background) for w in self.active}
        return QueuedSave(step, staging, refs, started)

    def _resize_may_follow(self) -> bool:
        """Below max_workers every checkpoint may be followed by a grow: then no step is queued past it."""
        return self.world_size < self.rules.max_workers

    def _report(self, step: int, results: list[dict[str, Any]]) -> None:
        self._note_saves(results)
        self._note_pause(step, results)
        now = self.clock()
        wall = now - (self.last_step_done_at or now)
        self.last_step_done_at = now
        self.step = step + 1
        gbs = self.rules.global_batch_size
        metrics = {
            "loss": sum(r["loss"] for r in results) / len(results),
            "lr": results[0]["lr"],
            "step_time_s": wall,
            "samples_per_s": gbs / wall if wall > 0 else 0.0,
            "tokens_per_s": gbs * self.cfg.data.seq_len / wall if wall > 0 else 0.0,
            "world_size": float(self.world_size),
        }
        if self.recovering_since is not None:
            metrics["recovery_seconds"] = now - self.recovering_since
            metrics["steps_lost"] = float(self.lost_steps)
            self.event(
                "recovered",
                f"first step after the restart done {metrics['recovery_seconds']:.2f}s after detection; "
                f"{self.lost_steps} step(s) lost",
                recovery_seconds=metrics["recovery_seconds"],
                steps_lost=self.lost_steps,
            )
            self.recovering_since = None
        if self.ledger is not None:
            for r in sorted(results, key=lambda r: r["rank"]):
                self.ledger(step, r["rank"], r["sample_ids"])
        if self.group.pending:
            self._start_new_workers()  # a replacement placed mid-segment starts warming now
        if self.step > self.logged_step:
            self.tracker.log_metrics(metrics, step=self.step)
            self.logged_step = self.step
        else:  # redone after a failure: its metrics were logged the first time (nearly equal values)
            extra = {k: metrics[k] for k in ("recovery_seconds", "steps_lost") if k in metrics}
            if extra:
                self.tracker.log_metrics(extra, step=self.step)
        self.reporter.step(self.step, metrics, log_line=self.step % self.cfg.training.log_every_steps == 0)
        self._update_run(
            last_step=self.step,
            logged_step=self.logged_step,
            last_metrics={k: round(v, 6) for k, v in metrics.items()},
        )

    def _checkpoint(self, save: QueuedSave) -> None:
        """Collect the queued snapshots; commit once every rank's file is durably written.

        With `checkpoint.background_write` (the default) training stops only for the snapshot: each
        rank writes its file in a background thread, reports `done` with its next step's result, and
        the checkpoint is committed then. Until then the previous committed checkpoint is what a
        restart loads, so a failure mid-write costs at most this interval, never a torn checkpoint.
        """
        t0 = save.started
        if save.staging is None:
            self._save_failed(None, save.error, save.step)
            return
        staging, refs = save.staging, save.refs
        try:
            reports = self._gather(
                refs, self.step, timeout_s=self.cfg.failure.collective_timeout_s, phase="checkpoint"
            )
        except AttemptFailed as e:
            if e.failure.kind != "step_error" or not _is_disk_full(e.failure.message):
                raise
            # Every rank is still healthy: only the write failed. Let the other ranks' writes end first.
            ray.wait(
                list(refs.values()), num_returns=len(refs), timeout=self.cfg.failure.collective_timeout_s
            )
            self._save_failed(staging, e.failure.message, self.step)
            return
        ordered = [reports[w.worker_id] for w in self.active]
        # Each rank's pause: idle before its snapshot, the snapshot, idle before its next step.
        self.pause_parts = (self.step, [r.get("waited_s", 0.0) + r["save_s"] for r in ordered])
        self.pending_save = PendingSave(
            staging=staging,
            step=self.step,
            samples=self.step * self.rules.global_batch_size,
            names=[r["name"] for r in ordered],
            engine_state=ordered[0]["engine_state"],
            started=t0,
            files={r["name"]: r["file"] for r in ordered if r.get("file")},
        )
        self._commit_if_written()
        # The pipelined steps restart their clock after the save.
        self.last_step_done_at = self.clock()

    def _note_pause(self, step: int, results: list[dict[str, Any]]) -> None:
        """How long the last checkpoint held training up: the slowest rank's pause around its snapshot."""
        if self.pause_parts is None or self.pause_parts[0] != step:
            return
        parts = self.pause_parts[1]
        self.pause_parts = None
        pauses = [parts[r["rank"]] + r.get("waited_s", 0.0) for r in results if r["rank"] < len(parts)]
        if not pauses:
            return
        pause = max(pauses)
        self.tracker.log_metrics({"checkpoint_pause_s": pause}, step=step)
        with contextlib.suppress(OSError):  # a full disk must not stop training
            self.run_dir.append_event("checkpoint_pause", step=step, tag=tag_for_step(step), pause_s=pause)

    def _note_saves(self, results: list[dict[str, Any]]) -> None:
        """Background writes' outcomes, carried by step results; commit when every rank's file is in."""
        pending = self.pending_save
        if pending is None:
            return
        for r in results:
            report = r.get("save")
            if not report or report["staging"] != str(pending.staging):
                continue
            if report["state"] == "done":
                pending.files[report["file"]["name"]] = report["file"]
            elif report["state"] == "error":
                self._write_failed(r.get("rank"), report["error"])
                return
        self._commit_if_written()

    def _ask_save_status(self, workers: list[WorkerHandle], staging: Path, wait_s: float) -> dict[str, Any]:
        """Each worker's background write into `staging`, waited for up to wait_s (answered mid-step)."""
        return {
            w.worker_id: w.actor.save_status.options(concurrency_group="control").remote(str(staging), wait_s)
            for w in workers
        }

    def _finish_pending_save(self) -> None:
        """Wait for the pending checkpoint's writes, then commit it (before a resize, at the end)."""
        pending = self.pending_save
        if pending is None or self._commit_if_written():
            return
        timeout_s = self.cfg.failure.collective_timeout_s
        control = self._ask_save_status(self.active, pending.staging, timeout_s)
        reports = self._gather(control, pending.step, timeout_s=timeout_s + 10.0, phase="checkpoint")
        results = [{**{"rank": rank}, "save": reports[w.worker_id]} for rank, w in enumerate(self.active)]
        self._note_saves(results)
        if self.pending_save is pending:  # still writing after the wait: a hung write
            writing = [w.worker_id for w in self.active if reports[w.worker_id]["state"] == "writing"]
            raise AttemptFailed(
                Failure(
                    "hang",
                    tuple(writing),
                    pending.step,
                    f"checkpoint write of {pending.staging.name} not done in {timeout_s:.0f}s "
                    f"(failure.collective_timeout_s): {', '.join(writing)}",
                )
            )

    def _commit_if_written(self) -> bool:
        """Commit the pending checkpoint if every rank's file is in; True when nothing is pending anymore."""
        pending = self.pending_save
        if pending is None:
            return True
        if set(pending.files) != set(pending.names):
            return False
        self.pending_save = None
        try:
            committed = self._commit(pending)
        except OSError as e:
            self._save_failed(pending.staging, f"{type(e).__name__}: {e}", pending.step)
            return True
        if committed.tag in self.rejected:  # saved anew: the damaged copy is gone
            self.rejected.remove(committed.tag)
        removed = self.store.prune(self.cfg.checkpoint.keep_last, protect=(committed.tag,))
        seconds = self.clock() - pending.started
        self.tracker.log_metrics({"checkpoint_time_s": seconds}, step=pending.step)
        written = "in the background" if self.cfg.checkpoint.background_write else "synchronously"
        self.event(
            "checkpoint",
            f"checkpoint {committed.tag} committed {seconds:.2f}s after it was queued (written {written})"
            + (f" (removed {', '.join(removed)})" if removed else ""),
            step=pending.step,
            committed_at_step=self.step,
            tag=committed.tag,
            seconds=seconds,
            bytes=sum(f["bytes"] for f in committed.manifest["files"]),
            removed=removed,
        )
        return True

    def _write_failed(self, rank: int | None, error: str) -> None:
        """A rank's background write raised: a full disk skips this save; anything else fails the attempt."""
        pending = self.pending_save
        assert pending is not None
        wid = self.active[rank].worker_id if rank is not None and rank < len(self.active) else "?"
        if not _is_disk_full(error):
            self.pending_save = None
            self.store.abandon(pending.staging)
            reason = f"checkpoint write raised in {wid}: {_short(error)}"
            raise AttemptFailed(Failure("step_error", (wid,), self.step, reason))
        # Let the other ranks' writes end (all at once, not one after another) before their folder goes.
        timeout_s = self.cfg.failure.collective_timeout_s
        refs = self._ask_save_status(self.active, pending.staging, timeout_s)
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s + 10.0)
        self.pending_save = None
        reason = f"checkpoint write raised in {wid}: {_short(error)}"
        self._save_failed(pending.staging, reason, pending.step)

    def _save_failed(self, staging: Any, reason: str, step: int) -> None:
        """A checkpoint could not be written (e.g. disk full): train on from memory, retry at the next one."""
        if staging is not None:
            self.store.abandon(staging)
        previous = self.store.latest_committed(rejected=tuple(self.rejected))
        every = self.cfg.checkpoint.every_steps
        self.event(
            "checkpoint_failed",
            f"checkpoint at step {step} was NOT saved ({reason}); training goes on from memory, "
            f"{previous.tag if previous else 'no earlier checkpoint'} stays intact and is what a restart "
            f"would load; the next save (step {min(step + every, self.cfg.training.max_steps)}) "
            f"retries. Free space under {self.store.root}",
            style="bold red",
            reason=reason,
            previous=previous.tag if previous else None,
            step=step,
        )
        self.last_step_done_at = self.clock()

    def _commit(self, pending: PendingSave) -> Committed:
        assert self.plan is not None
        return self.store.commit(
            pending.step,
            pending.staging,
            [pending.files[name] for name in pending.names],
            {
                "world_size": self.world_size,
                "samples_consumed": pending.samples,
                "data_position": {"samples_consumed": pending.samples, "seed": self.cfg.training.seed},
                "rng": {
                    "scheme": "torch reseeded per micro-batch from (training.seed, data position)",
                    "seed": self.cfg.training.seed,
                },
                "global_batch_size": self.rules.global_batch_size,
                "plan": {
                    "micro_batch_size": self.plan.micro_batch_size,
                    "grad_accum_steps": self.plan.grad_accum_steps,
                },
                "engine_state": pending.engine_state,
                "model": {"hf_config": dict(self.cfg.model.hf_config)},
                "run_id": self.run_dir.read_info().run_id,
                "config_digest": self.run_dir.read_info().config_digest,
            },
        )

    def _maybe_grow(self) -> bool:
        if self.step >= self.cfg.training.max_steps or self.world_size >= self.rules.max_workers:
            return False
        missing = self.rules.max_workers - len(self.group.workers) - len(self.group.pending)
        if missing > 0:
            self.group.request(missing)
        self._start_new_workers()
        self.group.poll_warm()
        target = decide_grow(self.rules, self.world_size, len(self.group.warm_workers))
        if target is None:
            return False
        self.set_status(RunStatus.RESIZING)
        self.event(
            "grow",
            f"capacity for {target} workers is back; growing {self.world_size} -> {target} "
            f"at step {self.step} (just checkpointed: nothing lost)",
            style="cyan",
            world_size=target,
        )
        self._finish_pending_save()  # the checkpoint just taken is what the larger world loads
        self.recovering_since = self.clock()
        self.lost_steps = 0
        self._teardown_active()
        return True

    # ------------------------------------------------------------------ failures
    def _gather(self, refs: dict[str, Any], step: int, *, timeout_s: float, phase: str) -> dict[str, Any]:
        """Results of one call on every active worker; raises AttemptFailed with the root cause."""
        pending = {ref: wid for wid, ref in refs.items()}
        results: dict[str, Any] = {}
        deadline = self.clock() + timeout_s
        while pending:
            ready, _ = ray.wait(
                list(pending), num_returns=1, timeout=min(1.0, max(0.0, deadline - self.clock()))
            )
            for ref in ready:
                wid = pending.pop(ref)
                try:
                    results[wid] = ray.get(ref)
                except (RayActorError, RayTaskError) as e:
                    raise AttemptFailed(self._classify(refs, step, phase, first_error=(wid, e))) from None
            if pending and self.clock() > deadline:
                raise AttemptFailed(
                    self._classify_hang(step, phase, timeout_s, [pending[r] for r in pending])
                )
        return results

    def _classify(
        self, refs: dict[str, Any], step: int, phase: str, first_error: tuple[str, Exception]
    ) -> Failure:
        # The first error seen may be a survivor's broken collective; wait briefly for the root cause.
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=3.0)
        dead, raised = [], {}
        for wid, ref in refs.items():
            try:
                ray.get(ref, timeout=0)
            except RayActorError:
                dead.append(wid)
            except RayTaskError as e:
                raised[wid] = e
            except GetTimeoutError:
                pass
            except Exception as e:  # noqa: BLE001
                raised[wid] = e
        by_id = {w.worker_id: w for w in self.group.workers}
        if dead:
            lost_nodes = {by_id[w].node_id for w in dead if w in by_id and not node_alive(by_id[w].node_id)}
            kind = "node_lost" if lost_nodes else "worker_died"
            what = (
                f"node(s) {', '.join(n[:8] for n in lost_nodes)} lost"
                if lost_nodes
                else "worker process died"
            )
            return Failure(kind, tuple(dead), step, f"{what} during {phase}: {', '.join(dead)}")
        # No death: a worker raised. Prefer the one whose error is its own, not a broken collective.
        own = (
            {w: e for w, e in raised.items() if not _is_collective_error(e)}
            or raised
            or {first_error[0]: first_error[1]}
        )
        wid, err = next(iter(own.items()))
        return Failure(
            "setup_error" if phase == "setup" else "step_error",
            tuple(own),
            step,
            f"{phase} raised in {wid}: {_short(err)}",
        )

    def _classify_hang(self, step: int, phase: str, timeout_s: float, silent: list[str]) -> Failure:
        progress = self.group.progress(timeout_s=5.0)
        by_id = {w.worker_id: w for w in self.group.workers}
        observations = [
            WorkerObservation(
                worker_id=wid,
                answering=p is not None,
                node_alive=node_alive(by_id[wid].node_id) if wid in by_id else False,
                last_progress=p["since"] if p else 0.0,
                step=p["step"] if p else step,
                in_collective=bool(p and p["in_collective"]),
            )
            for wid, p in progress.items()
        ]
        dead = [o.worker_id for o in observations if not o.answering or not o.node_alive]
        suspects = tuple(dead) or stalled_workers(observations)
        where = "; ".join(f"{w}: {progress[w]['where']}" for w in suspects if progress.get(w))
        return Failure(
            "hang",
            suspects,
            step,
            f"no progress in {phase} for {timeout_s:.0f}s (failure.hang_timeout_s); "
            f"stalled: {', '.join(suspects)}" + (f" at {where}" if where else ""),
        )

    def _handle_failure(self, failure: Failure) -> None:
        detected = self.clock()
        self.failures += 1
        self.set_status(RunStatus.RECOVERING, failure.message)
        self.event(
            "failure",
            f"{failure.kind}: {failure.message}",
            style="bold red",
            kind=failure.kind,
            workers=list(failure.worker_ids),
            failure_number=self.failures,
        )
        by_id = {w.worker_id: w for w in self.group.workers}
        # The workers at fault are replaced; everyone else keeps its actor. A rank whose step raised is
        # replaced too: its peers wait for it inside a gloo collective, and only its process exiting
        # releases them at once (and after a CUDA error its process is not to be trusted anyway).
        if failure.worker_ids:
            for wid in failure.worker_ids:
                if wid in by_id:
                    self.group.remove(by_id[wid])
        self._settle_pending_save(failure)
        self._teardown_active()
        self.store.clean_partials()  # a snapshot queued when the failure struck left its staging folder
        ckpt = self.store.latest_committed(rejected=tuple(self.rejected))
        decision = decide_after_failure(self.rules, failure, self.failures, self._capacity(), self.clock())
        if isinstance(decision, Fail):
            raise RunFailed(decision.reason)
        resume_step = ckpt.manifest["step"] if ckpt else 0
        self.event(
            "decision",
            f"decision: restart from {ckpt.tag if ckpt else 'the beginning'} (step {resume_step}); "
            + (decision.reason if isinstance(decision, Restart) else f"wait: {decision.reason}"),
            decision=type(decision).__name__,
            world_size=getattr(decision, "world_size", None),
        )
        self.recovering_since = detected
        self.world_size = self.world_size  # the attempt that starts next records its own size

    def _settle_pending_save(self, failure: Failure) -> None:
        """After a failure: commit the checkpoint being written if every rank's file made it, else drop it."""
        pending = self.pending_save
        if pending is None:
            return
        wait_s = min(SETTLE_SAVE_WAIT_S, self.cfg.failure.collective_timeout_s)
        ranks = {w.worker_id: rank for rank, w in enumerate(self.active)}
        survivors = [w for w in self.active if w.worker_id not in failure.worker_ids]
        refs = self._ask_save_status(survivors, pending.staging, wait_s)
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s + 2.0)
        results = []
        for wid, ref in refs.items():
            with contextlib.suppress(Exception):
                if ref in ready:
                    results.append({"rank": ranks[wid], "save": ray.get(ref)})
        with contextlib.suppress(AttemptFailed):  # a write error: the save is dropped below
            self._note_saves(results)
        if self.pending_save is None:
            return  # committed (or its failure already reported)
        self.pending_save = None
        self.store.abandon(pending.staging)
        self.event(
            "checkpoint_abandoned",
            f"checkpoint at step {pending.step} was not complete when {failure.kind} struck "
            f"({len(pending.files)} of {len(pending.names)} rank files written); dropped",
            style="yellow",
            step=pending.step,
            written=len(pending.files),
            ranks=len(pending.names),
        )

    def _teardown_active(self) -> None:
        """Tear the attempt down on every surviving worker; a worker that cannot is replaced."""
        survivors = [w for w in self.group.workers if w in self.active]
        refs = {w.worker_id: w.actor.teardown.remote() for w in survivors}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=TEARDOWN_TIMEOUT_S)
        stuck: dict[str, str] = {}
        for w in survivors:
            ref = refs[w.worker_id]
            try:
                if ref not in ready:
                    raise TimeoutError(f"teardown did not finish in {TEARDOWN_TIMEOUT_S:.0f}s")
                ray.get(ref)
            except Exception as e:  # noqa: BLE001
                stuck[w.worker_id] = _short(e)
        if stuck:
            progress = self.group.progress(timeout_s=2.0)
            for w in [w for w in survivors if w.worker_id in stuck]:
                where = (progress.get(w.worker_id) or {}).get("where", "")
                self.event(
                    "worker_replaced",
                    f"worker {w.worker_id} could not leave the attempt "
                    f"({stuck[w.worker_id]}; at {where or 'unknown'}); replacing it",
                    worker=w.worker_id,
                    where=where,
                )
                self.group.remove(w)
        self.active = []


def _ledger_from_env() -> Callable[[int, int, list[int]], None] | None:
    """ELASTICTRAIN_SAMPLE_LEDGER=FILE: append every reported step's sample ids (audits and chaos tests)."""
    path = os.environ.get("ELASTICTRAIN_SAMPLE_LEDGER")
    if not path:
        return None

    def record(step: int, rank: int, ids: list[int]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "rank": rank, "ids": ids}) + "\n")

    return record


def _is_disk_full(text: str) -> bool:
    return any(s in text for s in ("No space left on device", "Errno 28", "Disk quota exceeded", "Errno 122"))


def _is_collective_error(e: Exception) -> bool:
    text = str(e)
    return any(
        s in text for s in ("Connection closed by peer", "Connection reset", "gloo", "NCCL", "Timed out")
    )


def _short(e: BaseException | str) -> str:
    """The last line of an error or of a worker's error report (its traceback ends with 'Type: message')."""
    text = str(e).strip().splitlines()
    if text:
        return text[-1][:300]
    return "unknown error" if isinstance(e, str) else type(e).__name__
