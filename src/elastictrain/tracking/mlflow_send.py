"""The MLflow tracker's background thread: what goes to MLflow, in which order, and when.

The half of `MlflowTracker` (mlflow_tracker.py) that runs in its thread: it drains the queues the
caller's side fills (all state guarded by `_cond`), creates or resumes the run when the server
answers, backs off while it does not, and acks in the spool what MLflow accepted.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections import deque
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from elastictrain.redact import install_log_redaction
from elastictrain.storage.durable import crash_point
from elastictrain.tracking.tracker import (
    EVENTS_ARTIFACT,
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
    is_permanent,
    now_ms,
    sanitize_key,
)

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

log = logging.getLogger("elastictrain.tracker")
install_log_redaction()  # the tracking URI may hold a password: never in a log line
T = TypeVar("T")


class SendLoop:
    """Sending for MlflowTracker; its state (queues, spool, client) is set up there."""

    _cond: Any
    _metrics: deque[tuple[str, float, int, int, int]]

    # ------------------------------------------------------------------ the run in MLflow
    def _get_client(self) -> MlflowClient:
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(self.tracking_uri)
        return self._client

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        client = self._get_client()
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                return client.create_experiment(self.experiment, artifact_location=self.artifact_location)
            except MlflowException:
                # Another process may have created it between the lookup and the create.
                exp = client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id

    def _base_tags(self) -> dict[str, str]:
        from elastictrain.version import __version__

        return {"elastictrain.run": self.run_name, "elastictrain.version": __version__, **self.tags}

    def _create_run(self) -> None:
        client = self._get_client()
        tags = {sanitize_key(k): str(v)[:MAX_TAG_VAL_LENGTH] for k, v in self._base_tags().items()}
        run = client.create_run(self._experiment_id(), tags=tags, run_name=self.run_name)
        self.run_id = run.info.run_id
        self._spool.save_run_id(self.run_id)
        if self.on_run_id is not None:
            try:
                self.on_run_id(self.run_id)
            except Exception as e:  # noqa: BLE001 - recording the id must not stop tracking
                log.warning("could not record the MLflow run id %s: %s", self.run_id, e)
        with self._cond:
            self._prepared = True
            self._cond.notify_all()

    def _prepare_resumed(self) -> None:
        """Learn what the run already holds, so re-logging it neither fails nor overwrites it."""
        client = self._get_client()
        run = client.get_run(self.run_id)
        if run.info.lifecycle_stage == "deleted":
            client.restore_run(self.run_id)
        resumes = int(run.data.tags.get("elastictrain.resumes", "0") or 0) + 1
        event_lines = self._download_events(client)
        client.update_run(self.run_id, status="RUNNING")
        tags = {**self._base_tags(), "elastictrain.resumes": str(resumes)}
        with self._cond:
            self._logged_params = dict(run.data.params)
            # Earlier sessions' events come first; events.jsonl is re-uploaded whole on every flush.
            # Replayed lines that had already arrived before a crash are not repeated.
            known = set(event_lines)
            self._event_lines = event_lines + [x for x in self._event_lines if x not in known]
            for k, v in tags.items():
                self._tags.setdefault(sanitize_key(k), str(v)[:MAX_TAG_VAL_LENGTH])
            self._prepared = True
            self._cond.notify_all()

    def _download_events(self, client: MlflowClient) -> list[str]:
        if not any(f.path == EVENTS_ARTIFACT for f in client.list_artifacts(self.run_id)):
            return []
        with tempfile.TemporaryDirectory() as tmp:
            local = client.download_artifacts(self.run_id, EVENTS_ARTIFACT, tmp)
            text = Path(local).read_text(encoding="utf-8")
        return [line for line in text.splitlines() if line.strip()]

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                delay = self.flush_interval_s
                if self._failures:
                    delay = min(self.flush_interval_s * 2**self._failures, self.max_backoff_s)
                end = time.monotonic() + delay
                while not (self._stop or self._flush_requested):
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._stop:
                    return
                self._flush_requested = False
            try:
                self._flush_once()
                self._ack()
                if self._failures:
                    log.info("MLflow at %s answers again", self.tracking_uri)
                self._failures = 0
            except Exception as e:
                self._failures += 1
                if self._failures == 1:
                    log.warning(
                        "MLflow logging to %s failed (%s: %s); keeping the data and retrying with backoff",
                        self.tracking_uri,
                        type(e).__name__,
                        e,
                    )
                else:
                    log.debug("MLflow logging still failing (%d): %s", self._failures, e)
            finally:
                self._spool.sync_to_disk()  # the spool's fsync, off the training thread
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _snapshot(self, read: Callable[[], T]) -> T:
        """Copy pending data under the lock; it stays queued until MLflow has accepted it."""
        with self._cond:
            self._busy = True
            return read()

    def _events_snapshot(self) -> tuple[str, int, int] | None:
        if not self._events_dirty:
            return None
        return "\n".join(self._event_lines) + "\n", len(self._event_lines), len(self._event_seqs)

    def _send(self, what: str, fn: Callable[..., object], *args: object) -> None:
        """One MLflow call; returns when its data is done with (sent, or refused for good and dropped)."""
        try:
            fn(*args)
        except Exception as e:
            if not is_permanent(e):
                raise
            n = self._refused.get(what, 0) + 1
            self._refused[what] = n
            if n < self.max_attempts_refused:
                raise
            self._spool.record_rejected(what, e, args[1:])
            log.warning(
                "MLflow rejected %s as invalid %d times (%s); dropped, recorded in %s",
                what,
                n,
                e,
                self._spool.rejected_path,
            )
        self._refused.pop(what, None)

    def _flush_once(self) -> None:
        from mlflow.entities import Metric, Param, RunTag

        client = self._get_client()
        if not self._prepared:
            if self._resume:
                self._prepare_resumed()
            else:
                self._create_run()

        params = self._snapshot(lambda: list(self._params))
        if params:
            new: dict[str, str] = {}
            changed: dict[str, str] = {}
            for k, v, _ in params:
                known = new.get(k, self._logged_params.get(k))
                if known is None:
                    new[k] = v
                elif known != v:
                    # MLflow params are immutable: record the new value without failing the run.
                    changed[sanitize_key(f"param_changed.{k}")] = v[:MAX_TAG_VAL_LENGTH]
            items = list(new.items())
            for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
                chunk = items[i : i + MAX_PARAMS_TAGS_PER_BATCH]
                self._send("params", client.log_batch, self.run_id, (), [Param(k, v) for k, v in chunk])
                self._logged_params.update(chunk)
            if changed:
                with self._cond:
                    self._tags.update(changed)
            with self._cond:
                del self._params[: len(params)]
                for *_, seq in params:
                    self._done(seq)

        tags = self._snapshot(lambda: dict(self._tags))
        if tags:
            items = list(tags.items())
            for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
                chunk = items[i : i + MAX_PARAMS_TAGS_PER_BATCH]
                self._send("tags", client.log_batch, self.run_id, (), (), [RunTag(k, v) for k, v in chunk])
                with self._cond:
                    for k, v in chunk:
                        if self._tags.get(k) == v:  # a newer value may have arrived meanwhile
                            del self._tags[k]

        while True:
            if self._dedup_keys:
                self._drop_already_logged(client)
            while batch := self._snapshot(lambda: list(islice(self._metrics, MAX_METRICS_PER_BATCH))):
                self._send("metrics", client.log_batch, self.run_id, [Metric(*m[:4]) for m in batch])
                crash_point("tracking_metrics_sent")  # tests: killed after sending, before the ack
                with self._cond:
                    # Remove what was sent; the overflow may have dropped the head of it meanwhile.
                    for m in batch:
                        if self._metrics and self._metrics[0] is m:
                            self._metrics.popleft()
                            self._done(m[4])
            if not self._refill_from_spool():
                break

        events = self._snapshot(self._events_snapshot)
        if events is not None:
            text, sent_lines, sent_seqs = events
            self._send("events", client.log_text, self.run_id, text, EVENTS_ARTIFACT)
            with self._cond:
                self._events_dirty = len(self._event_lines) != sent_lines
                for _ in range(sent_seqs):
                    self._done(self._event_seqs.popleft())

        for artifact_file, text in self._snapshot(lambda: dict(self._texts)).items():
            self._send(f"artifact {artifact_file}", client.log_text, self.run_id, text, artifact_file)
            with self._cond:
                if self._texts.get(artifact_file) is text:
                    del self._texts[artifact_file]
                    seq = self._text_seqs.pop(artifact_file, None)
                    if seq is not None:
                        self._done(seq)

        status = self._snapshot(lambda: self._terminal)
        if status is not None:
            with self._cond:
                # Terminate only once everything queued before finish() has gone out.
                if (
                    self._params
                    or self._tags
                    or self._metrics
                    or self._events_dirty
                    or self._texts
                    or self._spill_seq is not None
                ):
                    return
            self._send("status", client.set_terminated, self.run_id, status, now_ms())
            with self._cond:
                if self._terminal == status:
                    self._terminal = None

    def _drop_already_logged(self, client: MlflowClient) -> None:
        """Replayed metrics that reached MLflow before a crash (sent, not yet acked) are not sent again.

        What MLflow held before this process sent anything is read once per key and kept while the
        replay lasts: replayed metrics beyond max_pending_metrics come back from the spool later.
        """
        logged = self._logged_before
        for key in sorted(self._dedup_keys - self._fetched_keys):
            logged.update(
                (key, m.step, m.timestamp, m.value) for m in client.get_metric_history(self.run_id, key)
            )
            self._fetched_keys.add(key)
        with self._cond:
            keep: deque[tuple[str, float, int, int, int]] = deque()
            for m in self._metrics:
                if 0 < m[4] <= self._replayed_upto and (m[0], m[3], m[2], m[1]) in logged:
                    self._done(m[4])
                else:
                    keep.append(m)
            dropped = len(self._metrics) - len(keep)
            self._metrics = keep
            self._dedup_keys.clear()
            if self._spill_seq is None or self._spill_seq > self._replayed_upto:
                self._logged_before.clear()  # no replayed metric is left to check
                self._fetched_keys.clear()
        if dropped:
            log.info("%d replayed metric value(s) had already reached MLflow; not sent twice", dropped)

    def _refill_from_spool(self) -> bool:
        """After memory drained, queue the next metrics that waited in the spool; False when none wait."""
        if self._spill_seq is None:
            return False
        start = self._spill_seq
        records = self._spool.read(after=start - 1)
        loaded = 0
        with self._cond:
            room = self.max_pending_metrics
            last_read = start - 1
            for r in records:
                if r.get("kind") == "metrics":
                    if room < len(r["data"]) and loaded:
                        break  # memory is full again: the rest next time
                    if int(r["seq"]) <= self._replayed_upto:  # may have reached MLflow before a crash
                        self._dedup_keys.update(str(m[0]) for m in r["data"])
                    self._metrics.extend((k, v, ts, st, int(r["seq"])) for k, v, ts, st in r["data"])
                    room -= len(r["data"])
                    loaded += len(r["data"])
                last_read = int(r["seq"])
            # Metrics appended after the read stay in the spool until the next refill.
            self._spill_seq = last_read + 1 if last_read < self._spool.last_seq else None
        return loaded > 0
