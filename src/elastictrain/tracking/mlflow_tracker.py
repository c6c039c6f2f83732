"""Experiment tracking in MLflow that never blocks or stops training.

Callers only enqueue; one background thread (mlflow_send.py) talks to MLflow. A failure there is
logged once and the data stays queued for the next attempt, so a slow or absent tracking server
costs training nothing. The run folder (run.json, events.jsonl) stays the source of truth; MLflow is
a view of it.

Every call is also appended to the run folder's spool (RUN_DIR/tracking-spool) before it is queued,
and the run itself is created or resumed by the background thread: a server that is down when the
run starts, or stays down until the driver dies, loses nothing. What was not sent goes out, in
order and once, from the next driver on the run folder or `elastictrain sync`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastictrain.redact import install_log_redaction, redact, redact_text
from elastictrain.tracking.mlflow_send import SendLoop
from elastictrain.tracking.spool import Spool
from elastictrain.tracking.tracker import (
    LOGGED_ARTIFACTS_TAG,
    MAX_PARAM_VAL_LENGTH,
    MAX_TAG_VAL_LENGTH,
    TERMINAL_STATUSES,
    TrackerError,
    artifacts_beside_sqlite,
    now_ms,
    sanitize_key,
)

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

log = logging.getLogger("elastictrain.tracker")
install_log_redaction()  # the tracking URI may hold a password: never in a log line


class MlflowTracker(SendLoop):
    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        spool_dir: str | Path,
        run_id: str | None = None,
        flush_interval_s: float = 1.0,
        tags: dict[str, str] | None = None,
        *,
        artifact_location: str | None = None,
        max_pending_metrics: int = 100_000,
        max_backoff_s: float = 30.0,
        max_attempts_refused: int = 3,
        max_spool_mb: float | None = None,
        on_run_id: Callable[[str], None] | None = None,
        start_wait_s: float = 5.0,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_id: str = run_id or ""
        self.flush_interval_s = flush_interval_s
        self.tags = dict(tags or {})
        self.artifact_location = artifact_location or artifacts_beside_sqlite(tracking_uri)
        self.max_pending_metrics = max_pending_metrics
        self.max_backoff_s = max_backoff_s
        self.max_attempts_refused = max_attempts_refused
        self.max_spool_mb = max_spool_mb
        self.max_spool_bytes = None if max_spool_mb is None else int(max_spool_mb * 2**20)
        self.metrics_dropped = 0  # while the spool was full
        self._resume = run_id is not None
        self._client: MlflowClient | None = None

        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False
        self._flush_requested = False
        # Everything below is guarded by _cond and only removed once MLflow has accepted it.
        self._prepared = False  # the run's existing params/events are known (resume may defer it)
        self._logged_params: dict[str, str] = {}
        self._params: list[tuple[str, str, int]] = []  # (key, value, spool seq or 0)
        self._tags: dict[str, str] = {}
        self._metrics: deque[tuple[str, float, int, int, int]] = deque()  # key, value, ms, step, seq
        self._event_lines: list[str] = []
        self._events_dirty = False
        self._texts: dict[str, str] = {}
        self._tables: set[str] = set()  # artifact files logged as tables
        self._terminal: str | None = None
        self._busy = False  # the thread holds data it is sending
        self._failures = 0
        self._refused: dict[str, int] = {}
        self._warned: set[str] = set()
        # Spool bookkeeping: records (by seq) with items not yet accepted, and what a replay may repeat.
        self._spool = Spool(spool_dir)
        self.on_run_id = on_run_id
        self.start_wait_s = start_wait_s
        self._open: dict[int, int] = {}
        self._event_seqs: deque[int] = deque()
        self._text_seqs: dict[str, int] = {}
        self._spill_seq: int | None = None  # metrics from this seq on are in the spool, not in memory
        self._dedup_keys: set[str] = set()  # metric keys replayed after a crash: some may have arrived
        self._replayed_upto = 0
        self._logged_before: set[tuple[str, int, int, float]] = set()  # MLflow's, read during a replay
        self._fetched_keys: set[str] = set()

    @property
    def pending_metrics(self) -> int:
        """Metrics queued and not yet accepted by MLflow."""
        with self._cond:
            return len(self._metrics)

    # ------------------------------------------------------------------ setup
    def start(self) -> str:
        """Replay what an earlier process left unsent, then let the thread create or resume the run.

        Returns the MLflow run id ("" while a new run's server does not answer). Waits at most
        start_wait_s for the server (so the run id is known at once when it answers); a server that
        is down or slow never holds training up. Raises TrackerError when another process holds the
        run folder's spool.
        """
        if self._thread is not None:
            return self.run_id
        if not self._spool.lock():
            raise TrackerError(
                f"{self._spool.folder} is in use by another process (a driver of this run, or "
                "`elastictrain sync`); wait for it to end"
            )
        self.run_id = self.run_id or self._spool.run_id or ""
        self._resume = bool(self.run_id)
        self._prepared = False
        self._replay(self._spool.read())
        self._thread = threading.Thread(target=self._loop, name="elastictrain-tracker", daemon=True)
        self._thread.start()
        with self._cond:
            self._flush_requested = True
            self._cond.notify_all()
            deadline = time.monotonic() + self.start_wait_s
            while not self._prepared and time.monotonic() < deadline:
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            if not self._prepared:
                log.warning(
                    "MLflow at %s does not answer yet; training goes on and everything is spooled in %s",
                    self.tracking_uri,
                    self._spool.folder,
                )
        return self.run_id

    def _replay(self, records: list[dict[str, Any]]) -> None:
        """Queue the spooled records an earlier process did not get accepted, in their order."""
        if not records:
            return
        with self._cond:
            for r in records:
                seq, kind, data = int(r["seq"]), r.get("kind"), r.get("data")
                if kind == "metrics":
                    self._dedup_keys.update(str(m[0]) for m in data)
                    self._queue_metrics([(str(k), float(v), int(ts), int(st)) for k, v, ts, st in data], seq)
                elif kind == "params":
                    self._params.extend((str(k), str(v), seq) for k, v in data)
                    self._open[seq] = len(data)
                elif kind == "event":
                    self._queue_event(str(data), seq)
                elif kind == "text":
                    self._queue_text(str(data[1]), str(data[0]), seq, table=len(data) > 2 and bool(data[2]))
            self._replayed_upto = int(records[-1]["seq"])
        log.warning(
            "sending %d tracking record(s) an earlier process spooled but did not get into MLflow",
            len(records),
        )

    def _spool_append(self, kind: str, data: Any) -> int:
        """Append under the lock (appends are ordered); 0 when the spool cannot be written."""
        try:
            return self._spool.append(kind, data)
        except OSError as e:  # e.g. disk full: keep going from memory
            self._warn_once(
                "spool", "cannot write the tracking spool %s (%s); keeping it in memory", self._spool.path, e
            )
            return 0

    def _done(self, seq: int, n: int = 1) -> None:
        left = self._open.get(seq)
        if left is None:
            return
        if left <= n:
            del self._open[seq]
        else:
            self._open[seq] = left - n

    def _ack(self) -> None:
        """Record in the spool how far everything reached MLflow."""
        with self._cond:
            upto = self._spool.last_seq
            if self._open:
                upto = min(upto, min(self._open) - 1)
            if self._spill_seq is not None:
                upto = min(upto, self._spill_seq - 1)
            try:
                self._spool.ack(upto)
            except OSError as e:
                self._warn_once("ack", "cannot update the tracking spool (%s); it will be re-checked", e)

    @property
    def logged_step(self) -> int:
        """The highest step whose metrics this run's spool ever took."""
        return self._spool.max_step

    @property
    def spooled(self) -> int:
        """Records in the spool not yet accepted by MLflow."""
        with self._cond:
            return self._spool.last_seq - self._spool.acked

    # ------------------------------------------------------------------ enqueue (never blocks)
    def log_params(self, params: dict[str, Any]) -> None:
        items = [(sanitize_key(k), str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in redact(params).items()]
        with self._cond:
            seq = self._spool_append("params", items)
            self._params.extend((k, v, seq) for k, v in items)
            if seq:
                self._open[seq] = len(items)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        ts = now_ms()
        # Plain tuples (key, value, timestamp_ms, step): turned into MLflow entities by the thread.
        batch: list[tuple[str, float, int, int]] = []
        for k, v in metrics.items():
            try:
                value = float(v)
            except (TypeError, ValueError):
                self._warn_once(f"metric-{k}", "metric %r has a non-numeric value %r; not logged", k, v)
                continue
            batch.append((sanitize_key(k), value, ts, int(step)))
        if not batch:
            return
        with self._cond:
            if not self._spool_has_room(step):
                self.metrics_dropped += len(batch)
                return
            self._queue_metrics(batch, self._spool_append("metrics", batch))

    def _spool_has_room(self, step: int) -> bool:
        """Whether metrics may still be spooled (lock held); warns at 80% and once full.

        A full spool drops new metrics and keeps the older ones: the run's record stays contiguous
        from its start, nothing already on disk is rewritten during an outage, and params, events
        and artifact texts (small, and the run's story) are still spooled.
        """
        limit = self.max_spool_bytes
        if limit is None:
            return True
        size = self._spool.size
        if size < limit // 2 and "spool-80" in self._warned:
            self._warned -= {"spool-80", "spool-full"}  # drained: warn again next time
            if self.metrics_dropped:
                log.warning(
                    "the tracking spool has room again; %d metric value(s) were dropped", self.metrics_dropped
                )
        if size >= limit:
            self._warn_once(
                "spool-full",
                "the tracking spool %s is full (tracking.max_spool_mb=%g); metrics from step %d on are "
                "dropped until MLflow takes what waits (events and params are still kept)",
                self._spool.path,
                self.max_spool_mb,
                step,
            )
            return False
        if size >= limit * 0.8:
            self._warn_once(
                "spool-80",
                "the tracking spool %s is 80%% full (%.1f of %g MB, tracking.max_spool_mb) while MLflow "
                "does not take it; when full, new metrics are dropped",
                self._spool.path,
                size / 2**20,
                self.max_spool_mb,
            )
        return True

    def _queue_metrics(self, batch: list[tuple[str, float, int, int]], seq: int) -> None:
        """Queue in memory (lock held); past the memory bound, spooled batches wait on disk instead."""
        if seq:
            self._open[seq] = len(batch)
            if self._spill_seq is not None:
                return  # older metrics wait in the spool: keep the order, read these from there too
            if len(self._metrics) + len(batch) > self.max_pending_metrics:
                self._spill_seq = seq
                self._warn_once(
                    "spill",
                    "MLflow is not keeping up: more than %d metrics pending; the rest wait in %s",
                    self.max_pending_metrics,
                    self._spool.path,
                )
                return
        self._metrics.extend((k, v, ts, st, seq) for k, v, ts, st in batch)
        overflow = len(self._metrics) - self.max_pending_metrics
        if overflow > 0:  # the spool could not be written (disk full): the memory bound wins, the oldest go
            for _ in range(overflow):
                self._metrics.popleft()
            self._warn_once(
                "overflow",
                "MLflow is not keeping up: more than %d metrics pending, dropping the oldest",
                self.max_pending_metrics,
            )

    def log_event(self, record: dict[str, Any]) -> None:
        line = json.dumps(redact(record, by_key=False), default=str)  # also the `last_event` tag
        with self._cond:
            self._queue_event(line, self._spool_append("event", line))

    def _queue_event(self, line: str, seq: int) -> None:
        self._event_lines.append(line)
        self._events_dirty = True
        self._tags["last_event"] = line[:MAX_TAG_VAL_LENGTH]
        if seq:
            self._event_seqs.append(seq)
            self._open[seq] = 1

    def log_artifact_text(self, text: str, artifact_file: str, *, table: bool = False) -> None:
        with self._cond:
            text = redact_text(text)
            record = [artifact_file, text, *([True] if table else [])]
            self._queue_text(text, artifact_file, self._spool_append("text", record), table=table)

    def _queue_text(self, text: str, artifact_file: str, seq: int, *, table: bool = False) -> None:
        self._texts[artifact_file] = text
        if table:  # as mlflow.log_table tags its files (only this run's own tables are listed)
            self._tables.add(artifact_file)
            listed = [{"path": path, "type": "table"} for path in sorted(self._tables)]
            self._tags[LOGGED_ARTIFACTS_TAG] = json.dumps(listed)
        old = self._text_seqs.pop(artifact_file, None)
        if old is not None:
            self._done(old)  # superseded by the newer text
        if seq:
            self._text_seqs[artifact_file] = seq
            self._open[seq] = 1

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    # ------------------------------------------------------------------ draining
    def _pending(self) -> bool:
        return bool(
            self._busy
            or not self._prepared
            or self._params
            or self._tags
            or self._metrics
            or self._events_dirty
            or self._texts
            or self._terminal
            or self._spill_seq is not None
        )

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued reached MLflow; False when it did not within timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                return not self._pending()
            self._flush_requested = True
            self._cond.notify_all()
            while self._pending():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def finish(self, status: str, timeout_s: float = 30.0) -> None:
        """Flush, then mark the run terminated; gives up (with a warning) after timeout_s."""
        status = str(getattr(status, "value", status)).upper()
        if status == "STOPPED":
            status = "KILLED"
        if status not in TERMINAL_STATUSES:
            log.warning("unknown run status %r for MLflow; marking the run FAILED", status)
            status = "FAILED"
        with self._cond:
            self._terminal = status
        if not self.flush(timeout_s):
            log.warning(
                "MLflow at %s did not take everything within %.0f s; the run folder has the full record; "
                "what is missing stays in %s: `elastictrain sync %s` sends it",
                self.tracking_uri,
                timeout_s,
                self._spool.folder,
                self._spool.folder.parent,
            )

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            # A request in flight may take up to MLflow's HTTP timeout; the thread is a daemon, so
            # an unfinished one never keeps the process alive.
            self._thread.join(timeout=5.0)
        self._spool.sync_to_disk()
        self._spool.close()
