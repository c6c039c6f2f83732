"""A durable spool of tracking records in the run folder, so an MLflow outage loses nothing.

RUN_DIR/tracking-spool/
  spool.jsonl   one JSON record per tracker call, numbered by `seq`, appended before it is queued
  acked         "SEQ MAX_STEP": every record up to SEQ was accepted by MLflow; the highest metric step
                spooled so far (so a restarted driver knows which steps' metrics were logged)
  state.json    the MLflow run id once created (a run created in the background survives a crash)
  lock          held (flock) by the process that sends from this spool

RUN_DIR/tracking-rejected.jsonl: what MLflow rejected as invalid and was dropped (error and data).

Records after `acked` are re-sent by the next tracker on this run folder (a resumed driver, or
`elastictrain sync RUN_DIR`); metrics that did reach MLflow before a crash are recognised and not
sent twice. Once everything is acked the file is emptied, so it only grows during an outage.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from elastictrain.redact import redact_text
from elastictrain.storage.durable import replace_text_atomically

log = logging.getLogger("elastictrain.tracker")

SPOOL_DIR = "tracking-spool"
COMPACT_BYTES = 1 << 20  # rewrite the spool without its acked records beyond this size
REJECTED_FILE = "tracking-rejected.jsonl"
MAX_REJECTED_CHARS = 100_000  # of one dropped request's data kept in the rejected log


class Spool:
    def __init__(self, run_dir: str | Path) -> None:
        self.folder = Path(run_dir) / SPOOL_DIR
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "spool.jsonl"
        self._acked_path = self.folder / "acked"
        self._state_path = self.folder / "state.json"
        self._lock_fd: int | None = None
        self._file: Any = None
        self.rejected_path = Path(run_dir) / REJECTED_FILE
        try:
            self.size = self.path.stat().st_size  # bytes on disk, bounded by the tracker's max_spool
        except OSError:
            self.size = 0
        try:
            fields = self._acked_path.read_text().split()
            self.acked = int(fields[0]) if fields else 0
            self.max_step = int(fields[1]) if len(fields) > 1 else 0
        except (OSError, ValueError):
            self.acked, self.max_step = 0, 0
        unacked = self.read()
        self.last_seq = max([self.acked, *(r["seq"] for r in unacked)])
        for r in unacked:
            self._note_steps(r)

    def _note_steps(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "metrics":
            self.max_step = max([self.max_step, *(int(m[3]) for m in record.get("data") or [])])

    # ------------------------------------------------------------------ ownership
    def lock(self) -> bool:
        """Become the one process sending from this spool; False when another one is (e.g. a driver)."""
        fd = os.open(self.folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._close_file()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # ------------------------------------------------------------------ records
    def append(self, kind: str, payload: Any) -> int:
        """Write one record (no fsync: `sync_to_disk` does that off the training thread); its seq."""
        seq = self.last_seq + 1
        if self._file is None:
            self._file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - kept open
            if self._file.tell() > 0:
                # A crash mid-append leaves a line without its newline: end it, or it would swallow this one.
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        self._file.write("\n")
        record = {"seq": seq, "kind": kind, "data": payload}
        line = json.dumps(record) + "\n"
        self._file.write(line)
        self._file.flush()
        self.size += len(line.encode())
        self.last_seq = seq
        self._note_steps(record)
        return seq

    def sync_to_disk(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._file.fileno())

    def read(self, after: int | None = None) -> list[dict[str, Any]]:
        """Records with seq > after (default: > acked), in order; a line torn by a crash is skipped."""
        after = self.acked if after is None else after
        records = []
        try:
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(record, dict) and record.get("seq", 0) > after:
                        records.append(record)
        except FileNotFoundError:
            pass
        return records

    def ack(self, seq: int) -> None:
        """Every record up to seq reached MLflow. Call with appends excluded (the tracker's lock)."""
        if seq <= self.acked:
            return
        replace_text_atomically(self._acked_path, f"{seq} {self.max_step}\n")
        self.acked = seq
        if not self.path.exists():
            return
        if seq >= self.last_seq:
            # All sent: start an empty file (the seq numbering goes on from `acked`).
            self._close_file()
            os.truncate(self.path, 0)
            self.size = 0
        elif self.path.stat().st_size > COMPACT_BYTES:
            # Records keep arriving while older ones are acked: drop the acked ones now and then.
            keep = "".join(json.dumps(r) + "\n" for r in self.read())
            self._close_file()
            replace_text_atomically(self.path, keep)
            self.size = len(keep.encode())

    def record_rejected(self, what: str, error: BaseException, data: Any) -> None:
        """Keep what MLflow rejected as invalid (and is dropped) in the run folder, secrets masked."""
        record = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "what": what,
            "error": redact_text(f"{type(error).__name__}: {error}"),
            "data": redact_text(json.dumps(data, default=str))[:MAX_REJECTED_CHARS],
        }
        try:
            with open(self.rejected_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            log.warning("cannot record the rejected %s in %s: %s", what, self.rejected_path, e)

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # ------------------------------------------------------------------ state
    @property
    def run_id(self) -> str | None:
        try:
            return json.loads(self._state_path.read_text()).get("run_id") or None
        except (OSError, ValueError):
            return None

    def save_run_id(self, run_id: str) -> None:
        replace_text_atomically(self._state_path, json.dumps({"run_id": run_id}) + "\n")
