"""How a fixed global batch splits into micro-batches and accumulation steps at a world size.

With tensor parallelism of degree N, the world's ranks form world_size / N data-parallel replicas of N
ranks each (consecutive ranks: DeepSpeed's (data, tensor) mesh); every rank of a replica reads the
same micro-batches, so the global batch splits over the replicas, not over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """global_batch_size == micro_batch_size * grad_accum_steps * data_parallel, always."""

    world_size: int
    micro_batch_size: int
    grad_accum_steps: int
    tensor_parallel: int = 1  # ranks per data-parallel replica, each holding a slice of every layer

    @property
    def data_parallel(self) -> int:
        """How many replicas read distinct micro-batches."""
        return self.world_size // self.tensor_parallel

    def data_rank(self, rank: int) -> int:
        """The replica `rank` belongs to: the ranks of one replica read the same micro-batches."""
        return rank // self.tensor_parallel

    @property
    def global_batch_size(self) -> int:
        return self.data_parallel * self.micro_batch_size * self.grad_accum_steps


def plan_batch(
    global_batch_size: int, micro_batch_size_cap: int, world_size: int, tensor_parallel: int = 1
) -> BatchPlan | None:
    """The split with the largest micro-batch <= cap, or None when no exact split exists (or the world
    is not a whole number of tensor-parallel replicas).

    A larger micro-batch means fewer accumulation steps, hence fewer optimizer-less forward/backward
    passes per step; the cap is what fits in a rank's memory.
    """
    if global_batch_size < 1 or micro_batch_size_cap < 1 or world_size < 1 or tensor_parallel < 1:
        return None
    if world_size % tensor_parallel:
        return None
    replicas = world_size // tensor_parallel
    if global_batch_size % replicas:
        return None
    per_replica = global_batch_size // replicas
    for micro in range(min(micro_batch_size_cap, per_replica), 0, -1):
        if per_replica % micro == 0:
            return BatchPlan(world_size, micro, per_replica // micro, tensor_parallel)
    return None  # unreachable: micro=1 always divides


def workable_world_sizes(
    global_batch_size: int, micro_batch_size_cap: int, lo: int, hi: int, tensor_parallel: int = 1
) -> list[int]:
    return [
        w
        for w in range(lo, hi + 1)
        if plan_batch(global_batch_size, micro_batch_size_cap, w, tensor_parallel)
    ]
