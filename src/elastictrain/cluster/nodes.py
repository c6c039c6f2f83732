"""The cluster's nodes as the checks before a run see them: which can host a worker, and a probe on each."""

from __future__ import annotations

from typing import Any


def worker_nodes(config: Any) -> list[dict[str, Any]]:
    """The alive Ray nodes with room for at least one worker (CPUs, and GPUs where used)."""
    import ray

    s = config.scaling
    out = []
    for node in ray.nodes():
        res = node.get("Resources", {})
        gpus_ok = not s.use_gpu or res.get("GPU", 0) >= s.gpus_per_worker
        if node.get("Alive") and res.get("CPU", 0) >= s.cpus_per_worker and gpus_ok:
            out.append(node)
    return out


def on_each_node(
    nodes: list[dict[str, Any]], fn: Any, *args: Any, timeout_s: float
) -> tuple[list[tuple[dict[str, Any], Any]], list[dict[str, Any]]]:
    """Run `fn(*args)` once on every node (no CPU reserved, pinned there): (node, answer) pairs, and the
    nodes that did not answer within `timeout_s`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = {
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            *args
        ): n
        for n in nodes
    }
    done, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in late:
        ray.cancel(ref, force=True)
    return [(refs[ref], ray.get(ref)) for ref in done], [refs[ref] for ref in late]
