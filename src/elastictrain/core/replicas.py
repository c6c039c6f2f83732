"""Which workers form an attempt's replicas: a tensor-parallel replica's ranks on one node, a pipeline
replica's stages on as few nodes as the workers allow.

A replica of N tensor-parallel ranks exchanges activations at every layer, so its ranks share a node
(the fast link); DeepSpeed's mesh puts consecutive ranks in one replica. A node with k warm workers thus
offers floor(k / N) replicas, and the rank order lists each replica's workers together. Pipeline stages
send one activation per micro-batch to the next stage: a replica may span nodes (that is what stages
are for), but fewer nodes mean fewer of those sends cross the slower link.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from elastictrain.core.policy import ScalingRules


def usable_workers(nodes: Sequence[str], tensor_parallel: int) -> int:
    """How many of these workers (by node id) can take part: whole replicas on each node."""
    counts: dict[str, int] = {}
    for node in nodes:
        counts[node] = counts.get(node, 0) + 1
    return sum(k // tensor_parallel * tensor_parallel for k in counts.values())


def replica_order(nodes: Sequence[str], size: int, tensor_parallel: int) -> list[int] | None:
    """Indices of `size` workers (of those listed, by node id) in rank order, each replica's N ranks
    together on one node; None when the nodes do not hold size / N replicas.

    Workers keep their order of preference (survivors first): a replica is formed on the node where N
    preferred workers are first found, so survivors keep their places where they can.
    """
    if size % tensor_parallel:
        return None
    pending: dict[str, list[int]] = {}
    order: list[int] = []
    for index, node in enumerate(nodes):
        bucket = pending.setdefault(node, [])
        bucket.append(index)
        if len(bucket) == tensor_parallel:
            order.extend(bucket)
            bucket.clear()
            if len(order) == size:
                return order
    return None


def pipeline_order(nodes: Sequence[str], size: int, stages: int) -> list[int]:
    """Indices of the first `size` workers (of those listed, by node id, in order of preference) in rank
    order, each replica's `stages` ranks on as few nodes as they allow: first the whole replicas each
    node holds, then the rest, the nodes with most workers left first. Fewer than `size` when fewer are
    listed; a worker's preference order is kept within its node."""
    chosen = list(range(min(size, len(nodes))))
    by_node: dict[str, list[int]] = {}
    for index in chosen:
        by_node.setdefault(nodes[index], []).append(index)
    order: list[int] = []
    rest: list[list[int]] = []
    for workers in by_node.values():
        whole = len(workers) // stages * stages
        order.extend(workers[:whole])
        if whole < len(workers):
            rest.append(workers[whole:])
    rest.sort(key=len, reverse=True)  # stable: among equals, the node met first
    return order + [index for workers in rest for index in workers]


def nodes_per_replica(nodes: Sequence[str], ranks: int) -> list[int]:
    """How many nodes each replica of `ranks` consecutive ranks spans (nodes: each rank's, in rank order)."""
    return [len(set(nodes[i : i + ranks])) for i in range(0, len(nodes), ranks)]


def pick_degree(candidates: Sequence[int], fits: Callable[[int], bool | None]) -> tuple[int, str]:
    """`tensor_parallel: auto`: the smallest candidate degree whose ranks fit in memory, and why.

    `fits(n)` says whether min_workers ranks at degree n fit the nodes' memory (None: unknown, e.g. no
    node yet). Unknown memory keeps the smallest degree (more replicas, fewer collectives); where none
    fits, the largest is taken (each rank's share is smallest there) and the memory check says why."""
    if not candidates:
        raise ValueError("no tensor-parallel degree to choose from")
    tried: list[int] = []
    for n in candidates:
        verdict = fits(n)
        if verdict is None:
            return n, f"{n}: the nodes' memory is not known yet, so the smallest degree the config allows"
        if verdict:
            why = f"; {', '.join(map(str, tried))} would not fit" if tried else ""
            return n, f"{n}: the smallest degree whose memory estimate fits the nodes{why}"
        tried.append(n)
    return candidates[-1], (
        f"{candidates[-1]}: no degree of {', '.join(map(str, candidates))} fits the nodes' memory; "
        "the largest holds the smallest share"
    )


def size_and_degree(
    rules: ScalingRules,
    candidates: Sequence[int],
    usable: Callable[[int], int],
    fits: Callable[[int, int], bool | None],
) -> tuple[int, int, str] | None:
    """`tensor_parallel: auto` at a restart: (degree, world size, why). The smallest candidate degree
    whose largest workable world size (whole replicas of the `usable(n)` warm workers) fits in memory
    there (`fits(n, size)`; None: unknown, taken as fitting); where none fits, the largest degree that
    has a workable size. None where no degree has one."""
    tried: list[str] = []
    last: tuple[int, int] | None = None
    for n in candidates:
        size = replace(rules, tensor_parallel=n).best_size(usable(n))
        if size is None:
            continue
        if fits(n, size) is not False:
            why = f"; {', '.join(tried)} would not fit" if tried else ""
            return n, size, f"{n}, the smallest degree whose memory estimate fits at {size} ranks{why}"
        tried.append(f"{n} at {size} ranks")
        last = (n, size)
    if last is None:
        return None
    return (
        *last,
        f"{last[0]}: no degree fits the nodes' memory ({', '.join(tried)}); the largest holds the least",
    )


W = TypeVar("W")


def attempt_workers(
    previous: Sequence[W],
    warm: Sequence[W],
    size: int,
    tensor_parallel: int,
    node_of: Callable[[W], str],
    pipeline_stages: int = 1,
) -> list[W]:
    """The `size` workers of the next attempt, in rank order: the last attempt's survivors keep their
    order, newly warm workers follow; with tensor parallelism each replica's ranks share a node, with
    `pipeline_stages` each replica's stages span as few nodes as they can. Fewer than `size` when the
    warm workers cannot fill it."""
    order = [w for w in previous if w in warm] + [w for w in warm if w not in previous]
    if pipeline_stages > 1:
        return [order[i] for i in pipeline_order([node_of(w) for w in order], size, pipeline_stages)]
    if tensor_parallel > 1:
        picked = replica_order([node_of(w) for w in order], size, tensor_parallel)
        order = [order[i] for i in picked] if picked is not None else []
    return order[:size]
