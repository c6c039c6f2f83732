"""How a fixed global batch splits into micro-batches and accumulation steps at a world size."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """global_batch_size == micro_batch_size * grad_accum_steps * world_size, always."""

    world_size: int
    micro_batch_size: int
    grad_accum_steps: int

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.micro_batch_size * self.grad_accum_steps


def plan_batch(global_batch_size: int, micro_batch_size_cap: int, world_size: int) -> BatchPlan | None:
    """The split with the largest micro-batch <= cap, or None when no exact split exists.

    A larger micro-batch means fewer accumulation steps, hence fewer optimizer-less forward/backward
    passes per step; the cap is what fits in a rank's memory.
    """
    if global_batch_size < 1 or micro_batch_size_cap < 1 or world_size < 1:
        return None
    if global_batch_size % world_size:
        return None
    per_rank = global_batch_size // world_size
    for micro in range(min(micro_batch_size_cap, per_rank), 0, -1):
        if per_rank % micro == 0:
            return BatchPlan(world_size, micro, per_rank // micro)
    return None  # unreachable: micro=1 always divides


def workable_world_sizes(global_batch_size: int, micro_batch_size_cap: int, lo: int, hi: int) -> list[int]:
    return [w for w in range(lo, hi + 1) if plan_batch(global_batch_size, micro_batch_size_cap, w)]
