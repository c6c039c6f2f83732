"""Every Ray call made from inside a worker actor: who this actor is, and its calls to peer actors.

Peer calls go to the `replica` concurrency group, so a peer answers them while it trains; a peer that
does not answer within REPLICATE_TIMEOUT_S is treated as lost (the controller sees its failure itself).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

REPLICA_GROUP = "replica"  # the actors' concurrency group for replicas and serving snapshots
REPLICATE_TIMEOUT_S = 30.0  # a buddy that does not take a replica in this time is treated as lost


def actor_identity(use_gpu: bool) -> dict[str, Any]:
    """This actor's ids, node and GPUs, as Ray's runtime context gives them."""
    import ray

    ctx = ray.get_runtime_context()
    return {
        "actor_id": ctx.get_actor_id(),
        "node_id": ctx.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "gpu_ids": ray.get_gpu_ids() if use_gpu else [],
    }


def local_identity(use_gpu: bool) -> dict[str, Any]:
    """The same fields for a worker hosted by the driver's own process (`--local`): no Ray, one node."""
    gpu_ids: list[str] = []
    if use_gpu:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
        gpu_ids = [g for g in visible.split(",") if g][:1]
    return {
        "actor_id": "local",
        "node_id": "local",
        "node_ip": "127.0.0.1",
        "pid": os.getpid(),
        "gpu_ids": gpu_ids,
    }


def call_peer(handle: Any, method: str, *args: Any) -> Any:
    """`handle.method(*args)` on a peer actor, in its replica group; its result, or the error it raised."""
    import ray

    call = getattr(handle, method).options(concurrency_group=REPLICA_GROUP)
    return ray.get(call.remote(*args), timeout=REPLICATE_TIMEOUT_S)


def call_peers(calls: Iterable[tuple[Any, str, tuple[Any, ...]]]) -> list[Any]:
    """Several peer calls at once (handle, method, args), their results in the same order."""
    import ray

    refs = [
        getattr(handle, method).options(concurrency_group=REPLICA_GROUP).remote(*args)
        for handle, method, args in calls
    ]
    return [ray.get(ref, timeout=REPLICATE_TIMEOUT_S) for ref in refs]
