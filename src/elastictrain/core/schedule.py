"""The learning rate as a pure function of the optimizer step.

elastictrain owns the schedule (DeepSpeed gets no scheduler block), so the scheduler's whole state is
the step counter, which every checkpoint already holds: nothing to reshard.
"""

from __future__ import annotations

import math


def learning_rate(
    step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int, schedule: str
) -> float:
    """LR used for optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return lr + (min_lr - lr) * progress
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"training.lr_schedule: got {schedule!r}; expected one of constant, linear, cosine")
