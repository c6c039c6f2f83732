"""How DeepSpeed asks about the CPU: a py-cpuinfo probe (a Python subprocess) at every CPU Adam it
creates, that is at every CPU-offload engine build, a restart's and a resize's included."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any

from elastictrain.compat.registry import has_parameters, patch
from elastictrain.user_cache import cache_folder, save_whole


def _check_cpuinfo() -> str | None:
    import cpuinfo

    if not callable(getattr(cpuinfo, "get_cpu_info", None)):
        return "cpuinfo has no get_cpu_info"
    return has_parameters(cpuinfo.get_cpu_info, where="cpuinfo.get_cpu_info")  # takes no arguments


def _do_nothing() -> None:
    return None


@patch(
    "cpu_info_remembered",
    package="py-cpuinfo",
    tested=">=9.0",
    kind="performance",
    check=_check_cpuinfo,
    otherwise=_do_nothing,
    gains=(
        "recovery time (CPU offload): a warm actor's engine rebuild at every restart and resize probes the "
        "CPU no more: 1.2-1.3 s of a 4.3-6.0 s rebuild at 134M (2.6-3.4 s with it), 3.4 s of a cold build"
    ),
)
def remember_cpu_info() -> None:
    """Make py-cpuinfo's `get_cpu_info` ask once per machine: at the first call, then from a file.

    What: `cpuinfo.get_cpu_info` (which DeepSpeed imports from py-cpuinfo at each call) is replaced by a
    function that returns a copy of the first answer.
    Why: each call starts a Python subprocess that probes the CPU: 1.2-1.3 s on 2 cores. DeepSpeed calls it
    whenever it loads a CPU op (twice, for its compiler flags) and whenever it creates its CPU Adam, that
    is at every CPU-offload engine build: a warm actor's rebuild at 134M (one rank, CPU offload) took
    4.3-6.0 s with the probe and 2.6-3.4 s without, on every restart's and resize's critical path. The
    answer is kept for the process, and in a file named after the CPU's own description
    (`cpu_fingerprint`), so another CPU never reads it. Each caller gets its own copy.
    Retired by: DeepSpeed caching the CPU description per process in its op builders (`cpu_arch`,
    `simd_width`) and CPU Adam; no upstream issue found.
    """
    import functools

    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "remembered", False):
        return
    probe = cpuinfo.get_cpu_info
    asked_once = functools.cache(lambda: cpu_info_from_file(probe, cache_folder()))

    def get_cpu_info() -> dict[str, Any]:
        return dict(asked_once())

    get_cpu_info.remembered = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info


def cpu_fingerprint() -> str | None:
    """A digest of what /proc/cpuinfo says about the CPU's kind and features (not its clock or load)."""
    import platform

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    kinds = (
        "vendor_id",
        "cpu family",
        "model",
        "model name",
        "flags",
        "Features",
        "CPU implementer",
        "CPU part",
    )
    lines = sorted({line.strip() for line in text.splitlines() if line.split(":")[0].strip() in kinds})
    return hashlib.sha256("\n".join([platform.machine(), *lines]).encode()).hexdigest()[:16]


def cpu_info_from_file(probe: Any, folder: Path) -> dict[str, Any]:
    """`probe()`'s answer as saved in `folder` for this CPU, probed and saved there when missing."""
    import json

    key = cpu_fingerprint()
    path = folder / f"cpuinfo-{key}.json" if key else None
    if path is not None:
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass  # not saved yet (or unreadable): probe
    info = dict(probe())
    if path is not None:
        with contextlib.suppress(TypeError, ValueError):  # not JSON: unsaved, the next process probes again
            save_whole(path, json.dumps(info).encode())  # whole or absent, for workers starting together
    return info
