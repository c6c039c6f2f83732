"""One driver per run folder: an exclusive lock plus a lease, held for the driver's whole life.

The lock file sits beside the run folder (`<parent>/.<name>.driver-lock`), not inside it, so it can
be taken before the folder is created and stays put when `train --fresh` moves the folder aside.

Two guards, because `flock` is not reliable across the nodes of a shared volume (NFS, object storage):
- `flock` on the file: exact and instant on one host (released by the OS when the driver dies);
- a lease in the file's content: the owner (host, pid, process start time) and a heartbeat (the
  file's mtime, touched every `heartbeat_s`). A lease whose heartbeat is older than `ttl_s` has
  expired; one whose owner is a dead process on this host is expired at once.

A run folder on an object store has no `flock`: its lock object holds the lease alone, rewritten as
the heartbeat (its modification time), and read back after it is taken, so of two drivers starting
together the one whose lease the store kept wins.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from typing import Any

from elastictrain.rundir.liveness import process_start_time, this_driver
from elastictrain.storage import AnyPath, ObjectPath, as_path
from elastictrain.storage.durable import pid_exists

TTL_S = 60.0
HEARTBEAT_S = 10.0


class RunFolderBusy(RuntimeError):
    """Another driver holds the run folder."""


def lock_path(run_dir: str | AnyPath) -> AnyPath:
    p = as_path(run_dir).absolute()
    return p.parent / f".{p.name}.driver-lock"


def busy_message(run_dir: str | AnyPath, owner: dict[str, Any] | None) -> str:
    who = f"{owner.get('host', '?')}:{owner.get('pid', '?')}" if owner else "another driver"
    since = f" since {owner.get('since', '?')}" if owner else ""
    return f"run.dir {run_dir} is being driven by {who}{since}; stop it first or wait"


def _owner_alive(owner: dict[str, Any]) -> bool:
    """False only when the owner is provably gone: a dead (or reused) pid on this host."""
    if owner.get("host") != socket.gethostname():
        return True  # another host: only the heartbeat can tell
    try:
        pid = int(owner["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    started = owner.get("process_started")
    now_started = process_start_time(pid)
    if now_started is None:
        return pid_exists(pid) if started is None else False
    return started is None or abs(now_started - float(started)) < 1.0


class RunLock:
    """Exclusive ownership of a run folder by this process, until `release` (or the process's exit)."""

    def __init__(
        self, run_dir: str | AnyPath, *, ttl_s: float = TTL_S, heartbeat_s: float = HEARTBEAT_S
    ) -> None:
        self.run_dir = as_path(run_dir)
        self.path = lock_path(run_dir)
        self.ttl_s = ttl_s
        self.heartbeat_s = heartbeat_s
        self._fd: int | None = None
        self._lease = ""  # on an object store: the lease this process wrote
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def read_owner(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text() or "null")
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and "pid" in data else None

    def _lease_live(self, owner: dict[str, Any] | None) -> bool:
        if owner is None or (owner.get("host") == socket.gethostname() and owner.get("pid") == os.getpid()):
            return False
        try:
            age = time.time() - self.path.stat().st_mtime
        except OSError:
            return False
        return age < self.ttl_s and _owner_alive(owner)

    def acquire(self) -> RunLock:
        if isinstance(self.path, ObjectPath):
            return self._acquire_lease(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise RunFolderBusy(busy_message(self.run_dir, self.read_owner())) from e
        owner = self.read_owner()
        if self._lease_live(owner):  # flock granted but a live lease: a driver on another node
            os.close(fd)
            raise RunFolderBusy(busy_message(self.run_dir, owner))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(this_driver()).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        self._start_heartbeat()
        return self

    def _acquire_lease(self, path: ObjectPath, settle_s: float = 0.5) -> RunLock:
        owner = self.read_owner()
        if self._lease_live(owner):
            raise RunFolderBusy(busy_message(self.run_dir, owner))
        mine = json.dumps(this_driver())
        path.write_bytes(mine.encode())
        time.sleep(settle_s)  # a driver that wrote at the same moment has written by now: last one wins
        now = self.read_owner()
        if now is None or json.dumps(now) != mine:
            raise RunFolderBusy(busy_message(self.run_dir, now))
        self._lease = mine
        self._start_heartbeat()
        return self

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="elastictrain-lease", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with contextlib.suppress(OSError):
                if isinstance(self.path, ObjectPath):
                    self.path.write_bytes(self._lease.encode())  # a new modification time
                else:
                    os.utime(self.path)

    def release(self) -> None:
        if self._lease:
            self._stop.set()
            if self._beat is not None:
                self._beat.join(timeout=5)
            with contextlib.suppress(OSError):
                self.path.write_bytes(b"")  # an empty lock object holds no lease
            self._lease = ""
            return
        if self._fd is None:
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        # The file stays (unlinking a flock file races with a waiter); an empty one holds no lease.
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing releases the flock
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


_held: dict[AnyPath, RunLock] = {}


def hold_for_process(run_dir: str | AnyPath) -> RunLock:
    """Take the run folder until this process exits (a CLI command's driver).

    Taken again by the same process (commands run in-process, as in tests), the earlier hold is
    released first: one process is one driver.
    """
    key = lock_path(run_dir)
    if key in _held:
        _held.pop(key).release()
    lock = RunLock(run_dir).acquire()
    _held[key] = lock
    return lock
