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

    Step s covers positions [s*G, (s+1)*G). Inside it, micro-step k of replica d takes the contiguous
    slice k*D + d, where D is the number of data-parallel replicas (the world size without tensor
    parallelism, each rank its own replica): every position of the step is read exactly once, whatever
    D is, and the ranks of one tensor-parallel replica read the same slice.
    """
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} outside world size {plan.world_size}")
    if not 0 <= micro_step < plan.grad_accum_steps:
        raise ValueError(f"micro_step {micro_step} outside {plan.grad_accum_steps} accumulation steps")
    slot = micro_step * plan.data_parallel + plan.data_rank(rank)
    start = step * plan.global_batch_size + slot * plan.micro_batch_size
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


def held_out(num_samples: int, fraction: float, seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(training indices, validation indices): a seeded `fraction` of the samples, never trained on.

    The split is a fixed permutation of the dataset (its own seed stream), so it is the same at every
    world size and restart; training reads only the first tuple, in the global order above.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"eval.split: got {fraction}; expected a fraction in [0, 1)")
    count = 0 if fraction == 0 else min(num_samples - 1, max(1, round(num_samples * fraction)))
    order = list(range(num_samples))
    random.Random(f"elastictrain/{seed}/held-out").shuffle(order)
    return tuple(sorted(order[count:])), tuple(sorted(order[:count]))


def eval_positions(batch: int, plan: BatchPlan, rank: int, micro_step: int, num_samples: int) -> list[int]:
    """Validation samples read by `rank` in micro-step `micro_step` of validation batch `batch`.

    The same cut of positions as a training step (so every rank does the same number of forward
    passes), read in the validation set's own order, from its start, wrapping around when an
    evaluation reads more than the set holds.
    """
    return [p % num_samples for p in micro_batch_positions(batch, plan, rank, micro_step)]
