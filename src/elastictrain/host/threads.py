"""How many threads a worker's torch uses: the cores Ray gave it (scaling.cpus_per_worker), or all of the
machine's where it is the only rank there, as torch itself would (a run at world size 1 on a 2-core
machine otherwise trains on one core)."""

from __future__ import annotations

import os


def worker_threads(cpus_per_worker: float, ranks_on_node: int, node_cpus: int) -> int:
    if ranks_on_node == 1:
        return max(1, node_cpus, int(cpus_per_worker))
    return max(1, int(cpus_per_worker))


def usable_cpus() -> int:
    """The cores this process may run on (its affinity: a container's or a cgroup's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def use_threads(cpus_per_worker: float, ranks_on_node: int) -> int:
    """Set torch's intra-op threads for this attempt; the number set."""
    import torch

    n = worker_threads(cpus_per_worker, ranks_on_node, usable_cpus())
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
