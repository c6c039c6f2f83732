"""Where a command's CPU time goes, by kind of process: Ray workers by what they run (a worker's imports
are its `warmup`), Ray's own servers, the CLI runs tests start, the pytest processes that drive runs.

`ProcessCpu` reads every process's CPU ticks from /proc once a second, in a thread, and gives each
second's increase to what the process is doing at that moment (its command line: Ray renames a worker
`ray::TrainWorker.train_step` while it runs that method). Processes that were there before it started
are left out. A floor: a process's last second before it exits, and processes shorter than a second,
may be missed. Linux only; elsewhere it records nothing.
"""

from __future__ import annotations

import os
import re
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

PROC = Path("/proc")

# (pattern in the command line, what it is), the first match wins.
_KINDS: tuple[tuple[str, str], ...] = (
    (r"default_worker\.py", "Ray worker process, before it hosts an actor"),
    (r"dashboard/agent\.py", "Ray dashboard agent"),
    (r"dashboard/dashboard\.py", "Ray dashboard"),
    (r"runtime_env/agent", "Ray runtime-env agent"),
    (r"log_monitor\.py", "Ray log monitor"),
    (r"autoscaler/_private/monitor\.py|/monitor\.py", "Ray autoscaler monitor"),
    (r"(^|/)raylet( |$)", "Ray raylet"),
    (r"(^|/)gcs_server( |$)", "Ray GCS server"),
    (r"-m elastictrain|/elastictrain( |$)", "elastictrain CLI"),
    (r"xdist|execnet|exec\(eval\(sys\.stdin", "pytest worker (drivers, references)"),
    (r"(^|/)pytest( |$)|-m pytest", "pytest"),
    (r"(^|/| -m )(mlflow|gunicorn|uvicorn)( |$)", "MLflow server"),
    (r" -m moto\.server", "S3 server (moto)"),
)


def kind_of(cmdline: str) -> str:
    """What a process is, from its command line (arguments separated by spaces)."""
    if cmdline.startswith("ray::"):
        name = cmdline.split()[0]
        return "Ray worker idle" if name == "ray::IDLE" else name  # ray::TrainWorker.warmup
    head = " ".join(cmdline.split(" ")[:5])  # the program, its flags, the script or module
    for pattern, kind in _KINDS:
        if re.search(pattern, head):
            return kind
    first = cmdline.split(" ", 2)
    exe = os.path.basename(first[0]) if first and first[0] else "?"
    if exe.startswith("python") and len(first) > 1:
        return f"python {os.path.basename(first[1])[:40]}"
    return exe[:40] or "?"


def _ticks(pid: str) -> int | None:
    try:
        fields = (PROC / pid / "stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: str) -> str:
    try:
        raw = (PROC / pid / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


class ProcessCpu:
    """A sampler of the CPU seconds of processes started after it, summed by `kind_of` their command."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._before = set(self._pids())
        self._last: dict[str, int] = {}
        self._seen: dict[str, set[str]] = defaultdict(set)  # kind -> pids
        self._ticks: dict[str, int] = defaultdict(int)  # kind -> ticks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-cpu", daemon=True)

    @staticmethod
    def _pids() -> list[str]:
        try:
            return [p.name for p in PROC.iterdir() if p.name.isdigit()]
        except OSError:
            return []

    def sample(self) -> None:
        """Add each new process's CPU since the last sample to what it is doing now."""
        for pid in self._pids():
            if pid in self._before or pid == str(os.getpid()):
                continue
            ticks = _ticks(pid)
            if ticks is None:
                continue
            last = self._last.get(pid, 0)
            gained = ticks - last if ticks >= last else ticks  # fewer: a new process took the pid
            self._last[pid] = ticks
            if gained > 0:
                kind = kind_of(_cmdline(pid))
                self._ticks[kind] += gained
                self._seen[kind].add(pid)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> ProcessCpu:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def table(self, top: int = 15) -> dict[str, Any]:
        """The CPU seconds of the `top` kinds, most first, and the total over every kind."""
        rows = sorted(self._ticks.items(), key=lambda kv: -kv[1])
        return {
            "total_s": round(sum(self._ticks.values()) / self._hz, 1),
            "kinds": [
                {"kind": kind, "cpu_s": round(t / self._hz, 1), "processes": len(self._seen[kind])}
                for kind, t in rows[:top]
            ],
        }
