"""Which malloc the worker processes run (`scaling.worker_allocator`): jemalloc, the copy Ray ships, or
the system's (glibc's on Linux).

A training step allocates and frees its temporaries (gathered layers, activations, gradients before
their reduce-scatter) again and again. glibc's malloc hands out its freed chunks from the whole of its
heap rather than the ones just freed, so a step touches, and keeps resident, about twice what it has
allocated at any one time; jemalloc reuses what was just freed. With purging off (`JEMALLOC_CONF`: freed
pages stay with the process instead of being returned and faulted in again at the next step) a rank
peaks lower and steps quicker (figures: docs/guides/model-sizes-and-memory.md). The price: a rank's
resident memory does not shrink after a spike (it is reused by the next one, e.g. an engine rebuilt
after a failure).

The library is preloaded (`LD_PRELOAD`) into the actor's process when Ray starts it, from where it
lies in the driver's Ray installation: nodes are expected to run the same image. A node where it is
missing runs the system's malloc, and the worker says so (`host.memory.running_allocator`).
The driver's own `MALLOC_CONF` replaces the default configuration.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from elastictrain.config.validate import ALLOCATORS

# Never return freed pages to the OS (dirty or muzzy): no page faults for what the next step reuses.
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def jemalloc_library() -> str | None:
    """The jemalloc shared library Ray ships (ray/core/libjemalloc.so), or None where it has none."""
    try:
        import ray
    except ImportError:
        return None
    path = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    return str(path) if path.is_file() else None


def allocator_env(choice: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables that make a new worker process run `choice` (one of ALLOCATORS)."""
    if choice not in ALLOCATORS:
        raise ValueError(f"scaling.worker_allocator: got {choice!r}; expected one of {', '.join(ALLOCATORS)}")
    environ = os.environ if environ is None else environ
    if choice == "system":
        return {}
    library = jemalloc_library()
    if library is None:
        return {}
    preload = environ.get("LD_PRELOAD", "")
    return {
        "LD_PRELOAD": f"{library}:{preload}" if preload else library,
        "MALLOC_CONF": environ.get("MALLOC_CONF", JEMALLOC_CONF),
    }
