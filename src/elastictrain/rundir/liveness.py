"""Is a run's driver still alive, and what did a dead one leave behind?

run.json says RUNNING until the driver records an end; a driver that was SIGKILLed (the job stopped,
the pod evicted, the head restarted) never does. Each driver records who it is (host, pid, process
start time) so that `elastictrain status` can tell a live run from an orphaned one on that host.

A killed worker group also leaves DeepSpeed's CPU all-reduce buffers in /dev/shm (about 69 MB per
rank, named after the rendezvous' address and port); the next driver of the run removes those of the
run's dead rendezvous.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from elastictrain.storage.durable import pid_exists

SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*_{addr}_{port}_*"
ACTIVE_STATUSES = ("STARTING", "RUNNING", "RECOVERING", "RESIZING", "WAITING")


def process_start_time(pid: int) -> float | None:
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - no psutil, or no such process
        return None


def this_driver() -> dict[str, Any]:
    """The record a driver writes into run.json (key "driver") when it takes the run."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        # With the pid, the start time tells this process from a later one that reused its pid.
        "process_started": process_start_time(pid),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@dataclass(frozen=True)
class DriverState:
    alive: bool | None  # None: the driver ran on another host, so this one cannot tell
    text: str


def driver_state(record: dict[str, Any] | None, status: str, run_dir: str = "RUN_DIR") -> DriverState | None:
    """What can be said about a run's driver from here; None when the run recorded none."""
    if not isinstance(record, dict) or "pid" not in record:
        return None
    pid, host = int(record["pid"]), str(record.get("host", "?"))
    who = f"pid {pid} on {host}"
    if status not in ACTIVE_STATUSES:
        return DriverState(False, f"{who} (ended, run {status})")
    if host != socket.gethostname():
        return DriverState(None, f"{who}: another host, cannot check from here")
    started = record.get("process_started")
    now_started = process_start_time(pid)
    if now_started is None:
        alive = pid_exists(pid) if started is None else False
    else:
        alive = started is None or abs(now_started - float(started)) < 1.0
    if alive:
        return DriverState(True, f"{who}: alive")
    return DriverState(
        False,
        f"{who}: NOT RUNNING - the driver died without recording an end (killed?); "
        f"`elastictrain resume {run_dir}` continues from the last committed checkpoint",
    )


def _port_is_free(addr: str, port: int) -> bool:
    """True when nothing listens on addr:port here; False when in use or addr is not this host's."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except OSError as e:
            if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                raise
            return False
    return True


def dead_rendezvous(events: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """The run's earlier rendezvous (from attempt_started events) that nothing here listens on anymore."""
    found: list[tuple[str, int]] = []
    for e in events:
        master = e.get("master") if e.get("event") == "attempt_started" else None
        if not isinstance(master, str) or ":" not in master:
            continue
        addr, _, port = master.rpartition(":")
        with contextlib.suppress(ValueError):
            if (addr, int(port)) not in found:
                found.append((addr, int(port)))
    out = []
    for addr, port in found:
        try:
            if _port_is_free(addr, port):
                out.append((addr, port))
        except OSError:
            continue
    return out


def remove_dead_buffers(events: list[dict[str, Any]]) -> list[str]:
    """Remove this host's shared-memory all-reduce buffers of the run's dead rendezvous.

    Only buffers named after one of this run's own earlier attempts, and only when no process listens
    on that port now (a live group elsewhere that reused the port keeps its buffers).
    """
    removed = []
    for addr, port in dead_rendezvous(events):
        for path in glob.glob(SHM_BUFFERS.format(addr=addr, port=port)):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    return removed
