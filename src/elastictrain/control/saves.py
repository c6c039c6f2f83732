"""The checkpoint in flight: queue its snapshots, observe its background writes, finish and settle it.

One save at a time. Its snapshot calls queue on every actor behind the segment's last step; each
rank then writes its file (in a background thread with `checkpoint.background_write`) and reports
`done` with a later step's result, or sooner through a watch: a call on each rank that returns when
its write ends, looked at five times a second while the driver waits for a step. The checkpoint is
committed once every rank's file is in. Until then the previous committed checkpoint is what a
restart loads: a failure mid-write costs at most this interval, never a torn checkpoint.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastictrain.checkpoint.store import CheckpointError, CheckpointStore, Committed, verify
from elastictrain.cluster.calls import TIMED_OUT, Calls, Group
from elastictrain.cluster.worker_api import WorkerApi
from elastictrain.control.errors import AttemptFailed
from elastictrain.control.evaluation import best_checkpoint
from elastictrain.control.failures import gather_results, is_disk_full, short
from elastictrain.control.record import RunRecorder
from elastictrain.control.resume import ResumePoints
from elastictrain.core.checkpoints import newest_at_or_before, prune_leaves_no_fallback, tag_for_step
from elastictrain.core.policy import Failure
from elastictrain.storage import AnyPath

SETTLE_SAVE_WAIT_S = 30.0  # after a failure, how long survivors' background writes may take to end
STOP_SAVE_WAIT_S = 10.0  # on Ctrl-C/SIGTERM: the whole stop must fit a pod's 30 s grace period
WATCH_WAIT_S = 10.0  # a watch on a rank's write answers when it ends, or after this (then is renewed)


@dataclass
class PendingSave:
    """A checkpoint whose snapshot is taken and whose rank files are being written."""

    staging: AnyPath
    step: int
    names: list[str]  # one file per rank, in rank order
    engine_state: dict[str, Any]
    started: float  # when the checkpoint's step ended (its state exists): the time to commit counts from here
    manifest: dict[str, Any]  # the run's manifest fields (manifest.py)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # written so far, by name


@dataclass
class QueuedSave:
    """A checkpoint's snapshot calls, queued on every actor behind the segment's last step."""

    step: int
    staging: AnyPath | None  # None: the staging folder could not be made (error says why)
    calls: Calls
    error: str = ""


# (step, engine_state, the model as rank 0 built it) -> fields
ManifestFields = Callable[[int, dict[str, Any], dict[str, Any] | None], dict[str, Any]]


class SaveCoordinator:
    def __init__(
        self,
        config: Any,
        group: Group,
        store: CheckpointStore,
        recorder: RunRecorder,
        resume: ResumePoints,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = config
        self.group = group
        self.store = store
        self.recorder = recorder
        self.resume = resume
        self.clock = clock
        self.pending: PendingSave | None = None
        self.last_committed: Committed | None = None
        self.failed_at: float | None = None  # when a save was last given up (the step clock restarts)
        self.last_failure = ""  # why
        self._pause_parts: tuple[int, list[float]] | None = None  # the last save's step, per-rank pause
        self._workers: list[Any] = []  # the attempt's workers, in rank order
        self._manifest: ManifestFields | None = None
        self._streamed = False  # the pending save's ranks streamed their files (no room for a snapshot)
        self._streamed_beside = False  # ... beside the next step (not while training waited)
        self._watch: Calls = {}  # per worker: a call that returns when its write into pending ends
        self.keep_before: int | None = None  # the first of the steps not applied in a row now (the loop's)

    # -- the attempt the saves belong to --
    def attach(self, workers: Sequence[Any], manifest: ManifestFields) -> None:
        self._workers = list(workers)
        self._manifest = manifest

    # -- queue --
    def queue(self, step: int, *, current: int) -> QueuedSave:
        """Queue every rank's snapshot (and write) of the state after `step` steps behind its last step.

        `current` is the loop's step now (steps before `step` may still be running)."""
        self.finish(current)  # one save in flight: bounds host memory to one snapshot per rank
        try:
            staging = self.store.begin(step)
        except OSError as e:
            return QueuedSave(step, None, {}, str(e))
        background = bool(self.cfg.checkpoint.background_write)
        calls = self.group.call(self._workers, WorkerApi.save_shard, str(staging), background)
        return QueuedSave(step, staging, calls)

    def collect(self, save: QueuedSave, step: int) -> None:
        """Collect the queued snapshots (after the segment's last step); commit if every file is written."""
        # The checkpoint's step was just reported: its state exists from now. The time to commit is
        # counted from here, not from the queueing, which came steps earlier (steps are queued ahead).
        step_ended = self.clock()
        if save.staging is None:
            self._failed(None, save.error, save.step, step)
            return
        timeout_s = self.cfg.failure.collective_timeout_s
        try:
            reports = gather_results(self.group, save.calls, step, timeout_s=timeout_s, phase="checkpoint")
        except AttemptFailed as e:
            if e.failure.kind != "step_error" or not is_disk_full(e.failure.message):
                raise
            # Every rank is still healthy: only the write failed. Let the other ranks' writes end first.
            self.group.gather(save.calls, timeout_s)
            self._failed(save.staging, e.failure.message, step, step)
            return
        ordered = [reports[w.worker_id] for w in self._workers]
        # Each rank's pause: idle before its snapshot, the snapshot (or starting its copy), and (added with
        # the next step's results) idle before that step and its update waiting for the copy.
        self._pause_parts = (step, [r.get("waited_s", 0.0) + r["save_s"] for r in ordered])
        assert self._manifest is not None
        self.pending = PendingSave(
            staging=save.staging,
            step=step,
            names=[r["name"] for r in ordered],
            engine_state=ordered[0]["engine_state"],
            started=step_ended,
            manifest=self._manifest(step, ordered[0]["engine_state"], ordered[0].get("model")),
            files={r["name"]: r["file"] for r in ordered if r.get("file")},
        )
        # A rank whose snapshot would exceed checkpoint.max_host_memory_mb streamed its file inline.
        self._streamed = any(r.get("mode") == "streamed" for r in ordered)
        self._streamed_beside = all(r.get("beside_step") for r in ordered if r.get("mode") == "streamed")
        self._watch = {}
        if not self._commit_if_written(step):
            self._watch_writes([w for w, r in zip(self._workers, ordered, strict=True) if not r.get("file")])

    # -- watch --
    def _watch_writes(self, workers: Sequence[Any]) -> None:
        assert self.pending is not None
        staging = str(self.pending.staging)
        self._watch.update(self.group.call(workers, WorkerApi.save_status, staging, WATCH_WAIT_S, watch=True))

    def poll_writes(self, step: int) -> None:
        """Writes that ended since the last look (without waiting): the checkpoint commits as soon as
        its last file is in, mid-step, not with the report of the step after."""
        pending = self.pending
        if pending is None:
            self._watch = {}
            return
        if not self._watch:
            return
        ranks = {w.worker_id: rank for rank, w in enumerate(self._workers)}
        results, renew = [], []
        for wid, reply in self.group.gather(self._watch, 0.0).items():
            if reply.error == TIMED_OUT:
                continue  # still waiting for the write to end
            del self._watch[wid]
            if reply.ok and wid in ranks:  # a lost worker is the step's gather's to report
                results.append({"rank": ranks[wid], "save": reply.value})
                if reply.value.get("state") == "writing":
                    renew.append(self._workers[ranks[wid]])
        self._note_writes(step, results)
        if renew and self.pending is pending:
            self._watch_writes(renew)

    # -- observe --
    def observe(self, step: int, results: list[dict[str, Any]]) -> None:
        """Background writes' outcomes, carried by step results; commit when every rank's file is in."""
        self._note_pause(step, results)
        self._note_writes(step, results)

    def _note_writes(self, step: int, results: list[dict[str, Any]]) -> None:
        pending = self.pending
        if pending is None:
            return
        for r in results:
            report = r.get("save")
            if not report or report["staging"] != str(pending.staging):
                continue
            if report["state"] == "done":
                pending.files[report["file"]["name"]] = report["file"]
            elif report["state"] == "error":
                self._write_failed(r.get("rank"), report["error"], step)
                return
        self._commit_if_written(step)

    def _note_pause(self, step: int, results: list[dict[str, Any]]) -> None:
        """How long the last checkpoint held training up: the slowest rank's pause around its snapshot."""
        if self._pause_parts is None or self._pause_parts[0] != step:
            return
        parts = self._pause_parts[1]
        self._pause_parts = None
        # The next step's own wait: idle before it, and its update held until the state's copy ended.
        pauses = [
            parts[r["rank"]] + r.get("waited_s", 0.0) + r.get("update_wait_s", 0.0)
            for r in results
            if r["rank"] < len(parts)
        ]
        if not pauses:
            return
        pause = max(pauses)
        self.recorder.metrics({"checkpoint_pause_s": pause}, step=step)
        self.recorder.quiet_event("checkpoint_pause", step=step, tag=tag_for_step(step), pause_s=pause)

    # -- finish --
    def finish(self, step: int) -> None:
        """Wait for the pending checkpoint's writes, then commit it (before a resize, at the end)."""
        pending = self.pending
        if pending is None or self._commit_if_written(step):
            return
        timeout_s = self.cfg.failure.collective_timeout_s
        control = self._ask_status(self._workers, pending.staging, timeout_s)
        reports = gather_results(
            self.group, control, pending.step, timeout_s=timeout_s + 10.0, phase="checkpoint"
        )
        results = [{"rank": rank, "save": reports[w.worker_id]} for rank, w in enumerate(self._workers)]
        self._note_writes(step, results)
        if self.pending is pending:  # still writing after the wait: a hung write
            writing = [w.worker_id for w in self._workers if reports[w.worker_id]["state"] == "writing"]
            raise AttemptFailed(
                Failure(
                    "hang",
                    tuple(writing),
                    pending.step,
                    f"checkpoint write of {pending.staging.name} not done in {timeout_s:.0f}s "
                    f"(failure.collective_timeout_s): {', '.join(writing)}",
                )
            )

    # -- settle --
    def stop(self, step: int) -> None:
        """On Ctrl-C or SIGTERM: commit the checkpoint in flight if its files are written, else drop it."""
        try:
            self.settle(Failure("stopped", (), step, "the run was stopped"), step, wait_s=STOP_SAVE_WAIT_S)
        except Exception as e:  # noqa: BLE001 - stopping goes on; the next driver cleans the staging folder
            self.recorder.event(
                "checkpoint_abandoned", f"checkpoint in flight dropped on stop: {e}", step=step
            )

    def settle(self, failure: Failure, step: int, *, wait_s: float = SETTLE_SAVE_WAIT_S) -> None:
        """After a failure: commit the checkpoint being written if every rank's file made it, else drop it."""
        pending = self.pending
        if pending is None:
            return
        wait_s = min(wait_s, self.cfg.failure.collective_timeout_s)
        ranks = {w.worker_id: rank for rank, w in enumerate(self._workers)}
        survivors = [w for w in self._workers if w.worker_id not in failure.worker_ids]
        replies = self.group.gather(self._ask_status(survivors, pending.staging, wait_s), wait_s + 2.0)
        results = [{"rank": ranks[wid], "save": r.value} for wid, r in replies.items() if r.ok]
        with contextlib.suppress(AttemptFailed):  # a write error: the save is dropped below
            self._note_writes(step, results)
        if self.pending is None:
            return  # committed (or its failure already reported)
        self.pending = None
        self.store.abandon(pending.staging)
        self.recorder.event(
            "checkpoint_abandoned",
            f"checkpoint at step {pending.step} was not complete when {failure.kind} struck "
            f"({len(pending.files)} of {len(pending.names)} rank files written); dropped",
            style="yellow",
            step=pending.step,
            written=len(pending.files),
            ranks=len(pending.names),
        )

    # -- helpers --
    def _ask_status(self, workers: Sequence[Any], staging: AnyPath, wait_s: float) -> Calls:
        """Each worker's background write into `staging`, waited for up to wait_s (answered mid-step)."""
        return self.group.call(workers, WorkerApi.save_status, str(staging), wait_s, control=True)

    def _write_failed(self, rank: int | None, error: str, step: int) -> None:
        """A rank's background write raised: a full disk skips this save; anything else fails the attempt."""
        pending = self.pending
        assert pending is not None
        workers = self._workers
        wid = workers[rank].worker_id if rank is not None and rank < len(workers) else "?"
        reason = f"checkpoint write raised in {wid}: {short(error)}"
        if not is_disk_full(error):
            self.pending = None
            self.store.abandon(pending.staging)
            raise AttemptFailed(Failure("step_error", (wid,), step, reason))
        # Let the other ranks' writes end (all at once, not one after another) before their folder goes.
        timeout_s = self.cfg.failure.collective_timeout_s
        self.group.gather(self._ask_status(workers, pending.staging, timeout_s), timeout_s + 10.0)
        self.pending = None
        self._failed(pending.staging, reason, pending.step, step)

    def _failed(self, staging: AnyPath | None, reason: str, save_step: int, step: int) -> None:
        """A checkpoint could not be written (e.g. disk full): train on from memory, retry at the next one."""
        if staging is not None:
            self.store.abandon(staging)
        previous = self.resume.latest()
        every = self.cfg.checkpoint.every_steps
        self.recorder.event(
            "checkpoint_failed",
            f"checkpoint at step {save_step} was NOT saved ({reason}); training goes on from memory, "
            f"{previous.tag if previous else 'no earlier checkpoint'} stays intact and is what a restart "
            f"would load; the next save (step {min(save_step + every, self.cfg.training.max_steps)}) "
            f"retries. Free space under {self.store.root}",
            style="bold red",
            step=save_step,
            reason=reason,
            previous=previous.tag if previous else None,
        )
        self.failed_at = self.clock()
        self.last_failure = reason

    def _reads_back(self, committed: Committed, step: int) -> bool:
        """Before a prune that would leave nothing else to fall back to: read the new checkpoint back.

        Its hashes were taken from memory; one that does not verify on disk is rejected and the
        previous checkpoint kept."""
        listing = self.store.listing().committed
        keep_last = self.cfg.checkpoint.keep_last
        if not prune_leaves_no_fallback(listing, committed.tag, keep_last, self.resume.rejected):
            return True
        problems = verify(committed.path).problems
        if problems:
            self.resume.reject(committed.tag, problems, step)
        return not problems

    def _last_good(self, new: str) -> tuple[str, ...]:
        """While steps in a row are not applied (`keep_before`: the first of them): the newest checkpoint
        from before them, kept from pruning so a run that stops over them keeps a good one."""
        if self.keep_before is None:
            return ()
        tag = newest_at_or_before(self.store.listing().committed, self.keep_before - 1)
        return (tag,) if tag and tag != new else ()

    def _commit_if_written(self, step: int) -> bool:
        """Commit the pending checkpoint if every rank's file is in; True when nothing is pending anymore."""
        pending = self.pending
        if pending is None:
            return True
        if set(pending.files) != set(pending.names):
            return False
        self.pending = None
        try:
            committed = self.store.commit(
                pending.step, pending.staging, [pending.files[n] for n in pending.names], pending.manifest
            )
        except (OSError, CheckpointError) as e:  # a rank file missing, or the disk refused
            self._failed(pending.staging, f"{type(e).__name__}: {e}", pending.step, step)
            return True
        self.resume.saved_anew(committed.tag)
        if not self._reads_back(committed, step):
            return True
        self.last_committed = committed
        best = best_checkpoint(self.cfg, self.recorder)
        good = self._last_good(committed.tag)
        removed = self.store.prune(self.cfg.checkpoint.keep_last, protect=(committed.tag, *best, *good))
        seconds = self.clock() - pending.started
        self.recorder.metrics({"checkpoint_time_s": seconds}, step=pending.step)
        written = (
            "written in the background" if self.cfg.checkpoint.background_write else "written synchronously"
        )
        if self.cfg.checkpoint.background_write and self._streamed:
            beside = ""
            if self._streamed_beside:  # the last step's has no next step to run beside
                last = pending.step >= self.cfg.training.max_steps
                beside = (
                    " after the last step" if last else " beside the next step, whose update waited for it"
                )
            written = (
                f"streamed from the live state{beside}: a copy would exceed checkpoint.max_host_memory_mb"
            )
        self.recorder.event(
            "checkpoint",
            f"checkpoint {committed.tag} committed {seconds:.2f}s after its step ({written})"
            + (f" (removed {', '.join(removed)})" if removed else ""),
            step=pending.step,
            committed_at_step=step,
            tag=committed.tag,
            seconds=seconds,
            bytes=sum(f["bytes"] for f in committed.manifest["files"]),
            removed=removed,
        )
        return True
