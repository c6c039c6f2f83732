"""`elastictrain` commands run as a user runs them, each in a session of its own: a driver that starts
its own local Ray cluster takes it into that session, so a test can see what is left of it and kill it
all at the end."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil

from elastictrain.rundir.run_dir import RunDir

BIN = Path(sys.executable).parent


def session_processes(sid: int) -> list[psutil.Process]:
    """Every live process of session `sid` (a zombie is not: it has exited), the driver, its Ray cluster,
    the workers."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


def names(processes: list[psutil.Process]) -> list[str]:
    """Their names (those that ended meanwhile left out)."""
    found = []
    for p in processes:
        with contextlib.suppress(psutil.Error):
            found.append(p.name())
    return found


def kill_session(sid: int) -> None:
    for p in session_processes(sid):
        with contextlib.suppress(psutil.Error):
            p.kill()


def start(
    args: list[str], *, cwd: Path, env: dict[str, str], log: Path, sessions: list[int]
) -> subprocess.Popen:
    """`elastictrain ARGS` in a session of its own (recorded in `sessions`), its output in `log`."""
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [str(BIN / "elastictrain"), *args],
            cwd=cwd,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    sessions.append(proc.pid)
    return proc


def shm_buffers(run_dir: RunDir) -> list[str]:
    """DeepSpeed's shared-memory all-reduce buffers of the run's attempts that are still in /dev/shm (it
    makes them when LOCAL_SIZE equals the world size)."""
    paths: list[str] = []
    for e in run_dir.read_events():
        if e.get("event") == "attempt_started":
            addr, _, port = e["master"].rpartition(":")
            paths += [str(p) for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{addr}_{port}_*")]
    return paths
