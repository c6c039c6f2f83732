"""The global data order: which dataset sample each rank reads at each micro-step.

Data is consumed by a global position (samples seen since the start of the run), never by per-rank
iterators, so a run resumed at any world size neither skips nor repeats a sample. Position p lies in
epoch p // n; each epoch is a seeded permutation of the n samples.
"""

from __future__ import annotations

import random
from functools import lru_cache

from elastictrain.core.batch import BatchPlan


@lru_cache(maxsize=4)
def epoch_permutation(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(num_samples))
    # A string seed is hashed deterministically by random.Random (unlike hash()).
    random.Random(f"elastictrain/{seed}/{epoch}").shuffle(order)
    return tuple(order)


def sample_at(position: int, num_samples: int, seed: int) -> int:
    """The dataset index consumed at a global position."""
    epoch, offset = divmod(position, num_samples)
    return epoch_permutation(num_samples, seed, epoch)[offset]


def micro_batch_positions(step: int, plan: BatchPlan, rank: int, micro_step: int) -> range:
    """Global positions read by `rank` in accumulation micro-step `micro_step` of optimizer step `step`.

    Step s covers positions [s*G, (s+1)*G). Inside it, micro-step k of rank r takes the contiguous
    slice k*W + r: every position of the step is read exactly once, whatever W is.
    """
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} outside world size {plan.world_size}")
    if not 0 <= micro_step < plan.grad_accum_steps:
        raise ValueError(f"micro_step {micro_step} outside {plan.grad_accum_steps} accumulation steps")
    start = step * plan.global_batch_size + (micro_step * plan.world_size + rank) * plan.micro_batch_size
    return range(start, start + plan.micro_batch_size)


def micro_batch_samples(
    step: int, plan: BatchPlan, rank: int, micro_step: int, num_samples: int, seed: int
) -> list[int]:
    return [sample_at(p, num_samples, seed) for p in micro_batch_positions(step, plan, rank, micro_step)]


def derive_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed for torch's RNG that depends only on (seed, parts), e.g. (step, first position).

    Re-seeding from the data position makes dropout masks a function of the sample, not of the rank
    or world size, so nothing RNG-related needs resharding.
    """
    return random.Random("/".join(map(str, (seed, *parts)))).getrandbits(63)
