"""How many threads a worker's torch uses: the cores Ray gave it (scaling.cpus_per_worker), set at each
attempt. Not the machine's every core for a rank alone there, as torch would take by default: on a
2-core machine shared with one other busy process, 2 threads made a tiny model's ZeRO-0 step 20x slower
than 1 (1.20 s against 0.059 s, the threads waiting on each other), so more cores are asked for by
setting scaling.cpus_per_worker."""

from __future__ import annotations


def worker_threads(cpus_per_worker: float) -> int:
    return max(1, int(cpus_per_worker))


def use_threads(cpus_per_worker: float) -> int:
    """Set torch's intra-op threads for this attempt; the number set."""
    import torch

    n = worker_threads(cpus_per_worker)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
