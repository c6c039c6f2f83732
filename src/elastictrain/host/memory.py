"""How much host memory this node has, how much of it one rank's checkpoint snapshot may take, which
malloc this process runs, and giving back what a dropped engine leaves with it."""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

AUTO_SHARE = 0.5  # of the memory available at save time, split between the node's ranks


def _proc_kib_field(path: str, field: str) -> int | None:
    """A `Field:  N kB` line of a /proc file, in bytes; None where the file or the field is missing."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(ln for ln in Path(path).read_text().splitlines() if ln.startswith(field + ":"))
        return int(line.split()[1]) * 1024
    return None


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field (MemTotal, MemAvailable) in bytes; None where there is no such file."""
    return _proc_kib_field("/proc/meminfo", field)


def peak_resident_bytes(status: str = "/proc/self/status") -> int | None:
    """This process's resident high-water mark (VmHWM): the most memory it has held at once so far;
    None where there is no such file."""
    return _proc_kib_field(status, "VmHWM")


def memory_peaks(engine: object) -> dict[str, int | None]:
    """This rank's high-water marks so far: host (VmHWM) and, on a GPU, the device memory torch
    allocated. Both cheap reads, reported with every step so a run's peaks are known without asking."""
    import torch

    device = getattr(engine, "device", None)
    on_gpu = device is not None and torch.device(device).type == "cuda"
    return {
        "host_peak_bytes": peak_resident_bytes(),
        "device_peak_bytes": int(torch.cuda.max_memory_allocated(device)) if on_gpu else None,
    }


def snapshot_budget_bytes(max_host_memory_mb: float | None, ranks_on_node: int) -> float:
    """The largest snapshot a rank may hold: the setting, or half the available memory split between
    the node's ranks (they snapshot at the same moment). Above it the checkpoint is streamed instead."""
    if max_host_memory_mb is not None:
        return float(max_host_memory_mb) * (1 << 20)
    available = meminfo_bytes("MemAvailable")
    if available is None:
        return float("inf")  # no /proc: no bound, so a checkpoint snapshots rather than streams
    return AUTO_SHARE * available / max(1, ranks_on_node)


ALL_ARENAS = 4096  # jemalloc's MALLCTL_ARENAS_ALL


def release_freed_memory() -> str | None:
    """Return the memory the process's malloc keeps of freed objects to the system; says which malloc
    did (jemalloc, preloaded by `scaling.worker_allocator`, or glibc), None where neither could.

    Called once an attempt's engine is dropped. Without it a surviving rank keeps the old engine's
    freed memory and builds the new engine beside it, enough for Ray's memory monitor to kill a rank
    (docs/concepts/recovery.md). jemalloc, set to keep freed pages for the next step, purges all its
    arenas here.
    """
    with contextlib.suppress(OSError, AttributeError):
        process = ctypes.CDLL(None)  # the global namespace: a preloaded jemalloc's symbols come first
        if hasattr(process, "mallctl"):
            process.mallctl(f"arena.{ALL_ARENAS}.purge".encode(), None, None, None, 0)
            return "jemalloc"
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return "glibc"
    return None


def running_allocator(maps: str = "/proc/self/maps") -> str:
    """ "jemalloc" when this process has a jemalloc library mapped, else "system"."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return "system"
    return "jemalloc" if "libjemalloc" in text else "system"
