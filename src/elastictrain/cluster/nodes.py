"""The cluster's nodes as the checks before a run see them: which can host a worker, and a probe on each."""

from __future__ import annotations

import threading
import time
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
    nodes that did not answer within `timeout_s`.

    On the driver's own node (every node of the local cluster a driver starts) `fn` runs in this process
    instead: the same machine, without a new Ray worker process to start and import before each run."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = {
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            *args
        ): n
        for n in nodes
        if n["NodeID"] != here
    }
    deadline = time.monotonic() + timeout_s
    answers: list[tuple[dict[str, Any], Any]] = []
    late: list[dict[str, Any]] = []
    for node in (n for n in nodes if n["NodeID"] == here):
        answered, answer = _in_a_thread(fn, args, timeout_s)
        if answered:
            answers.append((node, answer))
        else:
            late.append(node)
    if refs:
        left = max(0.0, deadline - time.monotonic())
        done, not_done = ray.wait(list(refs), num_returns=len(refs), timeout=left)
        for ref in not_done:
            ray.cancel(ref, force=True)
        answers += [(refs[ref], ray.get(ref)) for ref in done]
        late += [refs[ref] for ref in not_done]
    return answers, late


def _in_a_thread(fn: Any, args: tuple[Any, ...], timeout_s: float) -> tuple[bool, Any]:
    """(answered in time, its answer): a daemon thread, so a probe stuck on a dead mount is left behind."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            out.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - raised in the caller, as ray.get raises a task's error
            errors.append(e)

    thread = threading.Thread(target=call, name="node-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if errors:
        raise errors[0]
    return (True, out[0]) if out else (False, None)
