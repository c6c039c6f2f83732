"""How long an epoch-counted run trains: training.num_epochs and training.warmup_ratio as step counts.

Data is read by global position (core/data_order.py): step s reads positions [s*G, (s+1)*G) and
position p is sample p % n of epoch p // n's own shuffled order. Epochs are not cut into batches of
their own: a batch may straddle two epochs, and no batch is ever short, so the global batch (and the
gradient) is the same at every world size.

The step count rounds up: max_steps = ceil(num_epochs * n / G). Every sample is trained on at least
num_epochs times; the last step fills its batch from the start of the next epoch's order, so fewer
than G samples (those first in that order) are seen once more. Rounding down would instead leave up to
G-1 samples of the last epoch never trained on. Hugging Face's Trainer (and so LLaMA-Factory) also
trains every sample, with a short last batch in each epoch instead.

The warmup rounds up too, as transformers' TrainingArguments.get_warmup_steps does:
warmup_steps = ceil(warmup_ratio * max_steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction


def _exact(value: float) -> Fraction:
    # From the decimal the user wrote: 1.1 epochs of 100 samples is 110 positions, not 110.00000000000001.
    return Fraction(repr(float(value)))


def steps_for_epochs(num_epochs: float, samples: int, global_batch: int) -> int:
    """Optimizer steps for `num_epochs` passes over `samples` training samples, `global_batch` a step."""
    if num_epochs <= 0:
        raise ValueError(f"training.num_epochs: got {num_epochs}; expected a number > 0")
    if samples < 1:
        raise ValueError(f"training.num_epochs: the training set holds {samples} samples; expected >= 1")
    if global_batch < 1:
        raise ValueError(f"training.global_batch_size: got {global_batch}; expected >= 1")
    return max(1, math.ceil(_exact(num_epochs) * samples / global_batch))


def warmup_for_ratio(warmup_ratio: float, max_steps: int) -> int:
    """Warmup steps for a share of the run's steps (rounded up, at most max_steps)."""
    if not 0 <= warmup_ratio <= 1:
        raise ValueError(f"training.warmup_ratio: got {warmup_ratio}; expected a number in [0, 1]")
    return min(max_steps, math.ceil(_exact(warmup_ratio) * max_steps))


@dataclass(frozen=True)
class EpochLength:
    """What num_epochs comes to for a training set: the steps, and what their positions cover."""

    num_epochs: float
    samples: int
    global_batch: int
    steps: int

    @property
    def positions(self) -> int:
        return self.steps * self.global_batch

    @property
    def repeated(self) -> int:
        """Samples read beyond num_epochs * samples: the last batch's fill from the next epoch (< G)."""
        return self.positions - math.ceil(_exact(self.num_epochs) * self.samples)

    def describe(self) -> str:
        fill = (
            f"; the last step completes its batch with {self.repeated} sample(s) from the start of the "
            "next epoch's order"
            if self.repeated
            else ""
        )
        return (
            f"training.num_epochs={self.num_epochs:g}: {self.samples} training samples x {self.num_epochs:g} "
            f"/ global batch {self.global_batch} = {self.steps} steps (training.max_steps, rounded up){fill}"
        )


def epoch_length(num_epochs: float, samples: int, global_batch: int) -> EpochLength:
    return EpochLength(num_epochs, samples, global_batch, steps_for_epochs(num_epochs, samples, global_batch))
