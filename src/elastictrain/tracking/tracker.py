"""Experiment tracking in MLflow that never blocks or stops training.

Callers only enqueue; one background thread talks to MLflow. A failure there is logged once and the
data stays queued for the next attempt, so a slow or absent tracking server costs training nothing.
The run folder (run.json, events.jsonl) stays the source of truth; MLflow is a view of it.

With a spool (`spool_dir`, the run folder), every call is also appended to RUN_DIR/tracking-spool
before it is queued, and the run itself is created or resumed by the background thread: a server
that is down when the run starts, or stays down until the driver dies, loses nothing. What was not
sent goes out, in order and once, from the next driver on the run folder or `elastictrain sync`.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from elastictrain.redact import install_log_redaction
from elastictrain.rundir.durable import crash_point
from elastictrain.tracking.spool import Spool

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

log = logging.getLogger("elastictrain.tracker")
install_log_redaction()  # the tracking URI may hold a password: never in a log line
T = TypeVar("T")

# MLflow's limits (mlflow.utils.validation); repeated here so the module imports without mlflow.
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_KEY_LENGTH = 250

TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
EVENTS_ARTIFACT = "events.jsonl"


class TrackerError(RuntimeError):
    """The tracker could not be set up (start); once started, nothing it does raises."""


class Tracker(Protocol):
    def start(self) -> str: ...
    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_event(self, record: dict[str, Any]) -> None: ...
    def log_artifact_text(self, text: str, artifact_file: str) -> None: ...
    def finish(self, status: str) -> None: ...
    def close(self) -> None: ...


class NullTracker:
    """Tracks nothing: for tests and --no-tracking."""

    run_id = ""

    def start(self) -> str:
        return ""

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_event(self, record: dict[str, Any]) -> None:
        pass

    def log_artifact_text(self, text: str, artifact_file: str) -> None:
        pass

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def finish(self, status: str) -> None:
        pass

    def close(self) -> None:
        pass


_BAD_KEY_CHARS = re.compile(r"[^\w./\- ]")


def sanitize_key(key: str) -> str:
    """A name MLflow accepts for a metric, param or tag: allowed characters, a normalised path.

    Colons are replaced too (MLflow refuses them on Windows stores), as are empty, "." and ".."
    path segments, which MLflow rejects as non-unique paths.
    """
    key = _BAD_KEY_CHARS.sub("_", str(key))
    parts = [p if p not in (".", "..") else "_" for p in key.split("/") if p]
    return ("/".join(parts) or "_")[:MAX_KEY_LENGTH].rstrip("/") or "_"


def default_tracking_uri(run_dir: Path) -> str:
    """A SQLite store inside the run folder, so a run folder is self-contained and movable between runs."""
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def _artifacts_beside_sqlite(tracking_uri: str) -> str | None:
    # MLflow's default artifact root for a SQL store is relative to the current directory; keep a
    # SQLite store's artifacts next to its database instead (<run_dir>/mlartifacts for the default).
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    # What follows the prefix is the file path, absolute ("/abs/mlflow.db") or relative ("mlflow.db").
    db = tracking_uri[len(prefix) :].split("?", 1)[0]
    if db in ("", ":memory:"):
        return None
    return (Path(db).parent / "mlartifacts").resolve().as_uri()


def _now_ms() -> int:
    return int(time.time() * 1000)


def _is_permanent(exc: BaseException) -> bool:
    """MLflow refused the request itself (4xx): retrying the same data will not help."""
    code = getattr(exc, "get_http_status_code", None)
    try:
        return code is not None and 400 <= int(code()) < 500
    except Exception:
        return False


class MlflowTracker:
    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        run_id: str | None = None,
        flush_interval_s: float = 1.0,
        tags: dict[str, str] | None = None,
        *,
        artifact_location: str | None = None,
        max_pending_metrics: int = 100_000,
        max_backoff_s: float = 30.0,
        max_attempts_refused: int = 3,
        spool_dir: str | Path | None = None,
        on_run_id: Callable[[str], None] | None = None,
        start_wait_s: float = 5.0,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_id: str = run_id or ""
        self.flush_interval_s = flush_interval_s
        self.tags = dict(tags or {})
        self.artifact_location = artifact_location or _artifacts_beside_sqlite(tracking_uri)
        self.max_pending_metrics = max_pending_metrics
        self.max_backoff_s = max_backoff_s
        self.max_attempts_refused = max_attempts_refused
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
        self._terminal: str | None = None
        self._busy = False  # the thread holds data it is sending
        self._failures = 0
        self._refused: dict[str, int] = {}
        self._warned: set[str] = set()
        # Spool bookkeeping: records (by seq) with items not yet accepted, and what a replay may repeat.
        self._spool = Spool(spool_dir) if spool_dir is not None else None
        self.on_run_id = on_run_id
        self.start_wait_s = start_wait_s
        self._open: dict[int, int] = {}
        self._event_seqs: deque[int] = deque()
        self._text_seqs: dict[str, int] = {}
        self._spill_seq: int | None = None  # metrics from this seq on are in the spool, not in memory
        self._dedup_keys: set[str] = set()  # metric keys replayed after a crash: some may have arrived
        self._replayed_upto = 0

    @property
    def pending_metrics(self) -> int:
        """Metrics queued and not yet accepted by MLflow."""
        with self._cond:
            return len(self._metrics)

    # ------------------------------------------------------------------ setup
    def _get_client(self) -> MlflowClient:
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(self.tracking_uri)
        return self._client

    def start(self) -> str:
        """Create the run (and its experiment), or resume run_id; returns the MLflow run id.

        A new run needs the tracking store now and raises TrackerError when it is unreachable. A run
        to resume only needs its id: when the store is unreachable, reconnecting is left to the
        background thread and training goes on.
        """
        if self._thread is not None:
            return self.run_id
        if self._spool is not None:
            return self._start_spooled()
        try:
            if self._resume:
                try:
                    self._prepare_resumed()
                except Exception as e:
                    if _is_permanent(e):  # e.g. no such run: a wrong run id or tracking URI
                        raise
                    log.warning(
                        "MLflow at %s is unreachable (%s); run %s will be resumed when it answers",
                        self.tracking_uri,
                        e,
                        self.run_id,
                    )
            else:
                self._create_run()
        except Exception as e:
            action = "resume" if self._resume else "create"
            raise TrackerError(f"could not {action} the MLflow run at {self.tracking_uri}: {e}") from e
        self._thread = threading.Thread(target=self._loop, name="elastictrain-tracker", daemon=True)
        self._thread.start()
        return self.run_id

    def _start_spooled(self) -> str:
        """Replay what an earlier process left unsent, then let the thread create or resume the run.

        Waits at most start_wait_s for the server (so the run id is known at once when it answers);
        a server that is down or slow never holds training up.
        """
        assert self._spool is not None
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
                    self._queue_text(str(data[1]), str(data[0]), seq)
            self._replayed_upto = int(records[-1]["seq"])
        log.warning(
            "sending %d tracking record(s) an earlier process spooled but did not get into MLflow",
            len(records),
        )

    def _spool_append(self, kind: str, data: Any) -> int:
        """Append under the lock (appends are ordered); 0 when there is no spool or it cannot be written."""
        if self._spool is None:
            return 0
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
        if self._spool is None:
            return
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
        """The highest step whose metrics this run's spool ever took (0 without a spool)."""
        return self._spool.max_step if self._spool is not None else 0

    @property
    def spooled(self) -> int:
        """Records in the spool not yet accepted by MLflow."""
        if self._spool is None:
            return 0
        with self._cond:
            return self._spool.last_seq - self._spool.acked

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
        if self._spool is not None:
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

    # ------------------------------------------------------------------ enqueue (never blocks)
    def log_params(self, params: dict[str, Any]) -> None:
        items = [(sanitize_key(k), str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items()]
        with self._cond:
            seq = self._spool_append("params", items)
            self._params.extend((k, v, seq) for k, v in items)
            if seq:
                self._open[seq] = len(items)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        ts = _now_ms()
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
            self._queue_metrics(batch, self._spool_append("metrics", batch))

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
                    self._spool.path if self._spool else "",
                )
                return
        self._metrics.extend((k, v, ts, st, seq) for k, v, ts, st in batch)
        overflow = len(self._metrics) - self.max_pending_metrics
        if overflow > 0:  # without a spool the memory bound wins: the oldest go
            for _ in range(overflow):
                self._metrics.popleft()
            self._warn_once(
                "overflow",
                "MLflow is not keeping up: more than %d metrics pending, dropping the oldest",
                self.max_pending_metrics,
            )

    def log_event(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=str)
        with self._cond:
            self._queue_event(line, self._spool_append("event", line))

    def _queue_event(self, line: str, seq: int) -> None:
        self._event_lines.append(line)
        self._events_dirty = True
        self._tags["last_event"] = line[:MAX_TAG_VAL_LENGTH]
        if seq:
            self._event_seqs.append(seq)
            self._open[seq] = 1

    def log_artifact_text(self, text: str, artifact_file: str) -> None:
        with self._cond:
            self._queue_text(text, artifact_file, self._spool_append("text", [artifact_file, text]))

    def _queue_text(self, text: str, artifact_file: str, seq: int) -> None:
        self._texts[artifact_file] = text
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
            where = (
                f"; what is missing stays in {self._spool.folder}: `elastictrain sync "
                f"{self._spool.folder.parent}` sends it"
                if self._spool is not None
                else ""
            )
            log.warning(
                "MLflow at %s did not take everything within %.0f s; the run folder has the full record%s",
                self.tracking_uri,
                timeout_s,
                where,
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
        if self._spool is not None:
            self._spool.sync_to_disk()
            self._spool.close()

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
                if self._spool is not None:
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
            if not _is_permanent(e):
                raise
            n = self._refused.get(what, 0) + 1
            self._refused[what] = n
            if n < self.max_attempts_refused:
                raise
            log.warning("MLflow refused %s %d times (%s); dropping them", what, n, e)
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

        if self._dedup_keys:
            self._drop_already_logged(client)
        while True:
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
            self._send("status", client.set_terminated, self.run_id, status, _now_ms())
            with self._cond:
                if self._terminal == status:
                    self._terminal = None

    def _drop_already_logged(self, client: MlflowClient) -> None:
        """Replayed metrics that reached MLflow before a crash (sent, not yet acked) are not sent again."""
        keys = sorted(self._dedup_keys)
        logged = {
            (key, m.step, m.timestamp, m.value)
            for key in keys
            for m in client.get_metric_history(self.run_id, key)
        }
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
        if dropped:
            log.info("%d replayed metric value(s) had already reached MLflow; not sent twice", dropped)

    def _refill_from_spool(self) -> bool:
        """After memory drained, queue the next metrics that waited in the spool; False when none wait."""
        if self._spill_seq is None or self._spool is None:
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
                    self._metrics.extend((k, v, ts, st, int(r["seq"])) for k, v, ts, st in r["data"])
                    room -= len(r["data"])
                    loaded += len(r["data"])
                last_read = int(r["seq"])
            # Metrics appended after the read stay in the spool until the next refill.
            self._spill_seq = last_read + 1 if last_read < self._spool.last_seq else None
        return loaded > 0
