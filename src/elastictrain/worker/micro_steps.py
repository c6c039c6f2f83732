"""One optimizer step's micro-batches on one rank: forward, backward, and DeepSpeed's step.

With the built-in causal LM loss every micro-batch's summed token loss is divided by the target tokens
of the whole global batch (model/loss.py), so padding and masked labels weigh the same at any
world size. A loss of your own (`training.loss`) returns a scalar per micro-batch, averaged as before:
exact across world sizes when every micro-batch weighs the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.model.build import causal_lm_loss
from elastictrain.model.loss import causal_lm_loss_sum, global_count, target_tokens


@dataclass
class StepLoss:
    """What a rank reports of its share of a step's loss."""

    loss: float  # this rank's mean (per target token with the built-in loss)
    loss_sum: float | None = None  # built-in loss: summed token losses of this rank
    target_tokens: int | None = None  # built-in loss: target tokens of this rank

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loss": self.loss}
        if self.target_tokens is not None:
            out.update(loss_sum=self.loss_sum, target_tokens=self.target_tokens)
        return out


def run_micro_batches(
    engine: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: Sequence[tuple[Any, int]],
    *,
    world_size: int,
    on_micro: Callable[[], None] = lambda: None,
    before_update: Callable[[], None] = lambda: None,
) -> StepLoss:
    """Forward and backward each (batch, seed) in order; DeepSpeed steps the optimizer after the last."""
    if loss_fn is not causal_lm_loss:
        losses = []
        for batch, seed in batches:
            torch.manual_seed(seed)  # dropout and other randomness follow the data position
            loss = loss_fn(engine, batch)  # the engine forwards to the module, as the module would
            engine.backward(loss)
            before_update()  # e.g. the last in-memory snapshot must be complete before weights change
            engine.step()
            losses.append(float(loss.detach().float().item()))
            on_micro()
        return StepLoss(sum(losses) / len(losses))
    local = sum(target_tokens(batch) for batch, _ in batches)
    total = global_count(local, engine.device)  # once per step, before any forward
    # DeepSpeed divides each backward by the accumulation steps and averages over ranks: undo both.
    scale = world_size * len(batches) / max(total, 1)
    loss_sum, counted = 0.0, 0
    for batch, seed in batches:
        torch.manual_seed(seed)
        summed, tokens = causal_lm_loss_sum(engine, batch)
        engine.backward(summed * scale)
        before_update()
        engine.step()
        loss_sum += float(summed.detach().item())
        counted += tokens
        on_micro()
    return StepLoss(loss_sum / max(counted, 1), loss_sum, counted)
