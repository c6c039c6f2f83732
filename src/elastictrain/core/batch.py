"""How a fixed global batch splits into micro-batches and accumulation steps at a world size.

With tensor parallelism of degree T and P pipeline stages, the world's ranks form world_size / (P x T)
data-parallel replicas of P x T ranks each (consecutive ranks: `data` the outer axis of DeepSpeed's
mesh); every rank of a replica reads the same micro-batches, so the global batch splits over the
replicas, not over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """global_batch_size == micro_batch_size * grad_accum_steps * data_parallel, always."""

    world_size: int
    micro_batch_size: int
    grad_accum_steps: int
    tensor_parallel: int = 1  # ranks of a stage, each holding a slice of every layer
    pipeline_parallel: int = 1  # stages of a replica, each holding a contiguous run of the layers

    @property
    def replica_ranks(self) -> int:
        """Ranks per data-parallel replica."""
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def data_parallel(self) -> int:
        """How many replicas read distinct micro-batches."""
        return self.world_size // self.replica_ranks

    def data_rank(self, rank: int) -> int:
        """The replica `rank` belongs to: the ranks of one replica read the same micro-batches."""
        return rank // self.replica_ranks

    @property
    def global_batch_size(self) -> int:
        return self.data_parallel * self.micro_batch_size * self.grad_accum_steps


def plan_batch(
    global_batch_size: int,
    micro_batch_size_cap: int,
    world_size: int,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> BatchPlan | None:
    """The split with the largest micro-batch <= cap, or None when no exact split exists (or the world
    is not a whole number of replicas).

    A larger micro-batch means fewer accumulation steps, hence fewer optimizer-less forward/backward
    passes per step; the cap is what fits in a rank's memory.
    """
    replica_ranks = tensor_parallel * pipeline_parallel
    if min(global_batch_size, micro_batch_size_cap, world_size, tensor_parallel, pipeline_parallel) < 1:
        return None
    if world_size % replica_ranks:
        return None
    replicas = world_size // replica_ranks
    if global_batch_size % replicas:
        return None
    per_replica = global_batch_size // replicas
    for micro in range(min(micro_batch_size_cap, per_replica), 0, -1):
        if per_replica % micro == 0:
            return BatchPlan(world_size, micro, per_replica // micro, tensor_parallel, pipeline_parallel)
    return None  # unreachable: micro=1 always divides


def workable_world_sizes(
    global_batch_size: int,
    micro_batch_size_cap: int,
    lo: int,
    hi: int,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> list[int]:
    return [
        w
        for w in range(lo, hi + 1)
        if plan_batch(global_batch_size, micro_batch_size_cap, w, tensor_parallel, pipeline_parallel)
    ]
