"""The learning rate as a pure function of the optimizer step.

elastictrain owns the schedule (DeepSpeed gets no scheduler block), so the scheduler's whole state is
the step counter, which every checkpoint already holds: nothing to reshard.
"""

from __future__ import annotations

import math
from typing import Any


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


def step_learning_rate(step: int, training: Any) -> float:
    """LR of optimizer step `step` under a run's `training` section (lr, min_lr, warmup, length, schedule):
    the one reading of the config that the workers, the peers' script and the reference loops share."""
    return learning_rate(
        step,
        lr=training.lr,
        min_lr=training.min_lr,
        warmup_steps=training.warmup_steps,
        max_steps=training.max_steps,
        schedule=training.lr_schedule,
    )
