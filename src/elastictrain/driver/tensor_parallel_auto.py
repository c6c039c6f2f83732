"""`scaling.tensor_parallel: auto` on the driver: the degree whose ranks fit the nodes' memory.

At the start (and at each `elastictrain resume`) the smallest degree the config allows whose
min_workers ranks fit the worker nodes' memory by the estimate is chosen; at every restart at a new
world size the control loop asks again (`DegreeChooser.fits`, with the nodes' memory read at the
start), so a run that shrinks to fewer ranks than its degree fits goes on at a larger one. The rule
itself is pure (core/replicas.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastictrain.cluster.nodes import on_each_node, worker_nodes
from elastictrain.driver.preflight import memory_estimate, model_parts, node_memory_probe, node_slots


@dataclass
class DegreeChooser:
    """What `auto` chooses from: the degrees the config allows, and the worker nodes' memory and ranks
    as read at the start (empty where no node was there yet: memory unknown)."""

    config: Any
    candidates: list[int]
    node_memory: list[int] = field(default_factory=list)
    node_ranks: list[int] = field(default_factory=list)
    _parts: tuple[list[int], int, int] | None = None

    def fits(self, n: int, world_size: int) -> bool | None:
        """Whether `world_size` ranks at degree n fit the nodes' memory (None: not known)."""
        from elastictrain.core.memory_estimate import memory_shortfall

        if not self.node_memory or self.config.model.lora.enabled:
            return None
        if self._parts is None:
            self._parts = model_parts(self.config)
        estimate = memory_estimate(self.config, world_size, n, parts=self._parts)
        return memory_shortfall(self.node_memory, self.node_ranks, estimate.host_need, world_size, n) is None


def choose_tensor_parallel(config: Any, timeout_s: float = 60.0) -> tuple[str, DegreeChooser]:
    """Resolve `auto` on the connected cluster for scaling.min_workers ranks: sets the degree in `config`
    and returns the line saying what was chosen and why, and the chooser the control loop asks again."""
    from elastictrain.config.tensor_parallel_check import tensor_parallel_candidates
    from elastictrain.core.replicas import pick_degree

    nodes = worker_nodes(config)
    answers, _ = on_each_node(nodes, node_memory_probe, timeout_s=timeout_s) if nodes else ([], [])
    known = [(n, mem) for n, (_, mem) in answers if mem]
    ranks = [node_slots(n.get("Resources", {}), config) for n, _ in known]
    # A replica's ranks share a node: a degree larger than any node's ranks is never placed.
    allowed = [n for n in tensor_parallel_candidates(config) if not ranks or n <= max(ranks)] or [1]
    chooser = DegreeChooser(config, allowed, [mem for _, mem in known], ranks)
    n, why = pick_degree(allowed, lambda n: chooser.fits(n, config.scaling.min_workers))
    config.scaling.tensor_parallel = n
    return f"scaling.tensor_parallel=auto chose {why}", chooser
