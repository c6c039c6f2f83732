"""One optimizer step's micro-batches on one rank: forward, backward, and DeepSpeed's step.

With the built-in causal LM loss every micro-batch's summed token loss is divided by the target tokens
of the whole global batch (model/loss.py), so padding and masked labels weigh the same at any
world size; a preference objective's items weigh the same (worker/preference_steps.py). A loss of your
own (`training.loss`) returns a scalar per micro-batch, averaged as before: exact across world sizes when
every micro-batch weighs the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.model.build import causal_lm_loss
from elastictrain.model.loss import causal_lm_token_loss_sum, global_count, target_token_count
from elastictrain.model.objective import PreferenceObjective
from elastictrain.worker.preference_steps import run_preference_batches


class ForwardClock:
    """Time spent in forward passes. Without ZeRO-3 a forward awaits no other rank, so it measures this
    rank's own speed (a step's backward and update wait for the slowest rank in their collectives). On a
    GPU, CUDA events read after the step's one synchronisation: timing adds no wait."""

    def __init__(self, device: Any) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self.host_s = 0.0
        self._began: Any = None

    def __enter__(self) -> ForwardClock:
        if self.cuda:
            self._began = torch.cuda.Event(enable_timing=True)
            self._began.record()
        else:
            self._began = time.perf_counter()
        return self

    def __exit__(self, *_: Any) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((self._began, end))
        else:
            self.host_s += time.perf_counter() - self._began

    def seconds(self) -> float:
        if not self.cuda:
            return self.host_s
        if self.spans:
            self.spans[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self.spans) / 1000.0


@dataclass
class StepLoss:
    """What a rank reports of its share of a step's loss."""

    loss: float  # this rank's mean (per target token with the built-in loss, per item for preferences)
    loss_sum: float | None = None  # built-in loss: summed token losses of this rank
    target_tokens: int | None = None  # built-in loss: target tokens of this rank
    items: int | None = None  # a preference objective: pairs (KTO records) of this rank
    preference: dict[str, list[float]] | None = None  # its figures: name -> [sum, count]
    forward_s: float | None = None  # this rank's forward passes: its own compute, no collective awaited

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loss": self.loss, "forward_s": self.forward_s}
        if self.target_tokens is not None:
            out.update(loss_sum=self.loss_sum, target_tokens=self.target_tokens)
        if self.items is not None:
            out.update(loss_sum=self.loss_sum, items=self.items, preference=self.preference)
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
    """Forward and backward each (batch, seed) in order; DeepSpeed steps the optimizer after the last.

    Nothing here waits for the device until the step is queued: losses and token counts stay tensors
    and are read once, at the end (one synchronisation per step, not one per micro-batch).
    """
    last = len(batches) - 1

    def step(i: int) -> None:
        # DeepSpeed changes weights and optimizer state only at the accumulation boundary (the step()
        # after the last micro-batch): only that one waits for an in-memory snapshot still copying, so
        # the copy overlaps every micro-batch's forward and backward, not only the first's.
        if i == last:
            before_update()
        engine.step()
        on_micro()

    if isinstance(loss_fn, PreferenceObjective):
        sums = run_preference_batches(engine, loss_fn, batches, world_size=world_size, step=step)
        items = int(sums["items"])
        return StepLoss(
            sums["loss_sum"] / max(items, 1), sums["loss_sum"], items=items, preference=sums["preference"]
        )
    clock = ForwardClock(engine.device)
    if loss_fn is not causal_lm_loss:
        acc = torch.zeros((), dtype=torch.float64, device=engine.device)
        for i, (batch, seed) in enumerate(batches):
            torch.manual_seed(seed)  # dropout and other randomness follow the data position
            with clock:
                loss = loss_fn(engine, batch)  # the engine forwards to the module, as the module would
            engine.backward(loss)
            step(i)
            acc = acc + loss.detach().float().double()  # fp64, in order: the sum floats would give
        return StepLoss(float(acc.item()) / len(batches), forward_s=clock.seconds())
    counts = [target_token_count(batch) for batch, _ in batches]
    local = torch.stack(counts).sum()
    total = global_count(local)  # queued once per step, before any forward; never waited for here
    # DeepSpeed divides each backward by the accumulation steps and averages over ranks: undo both.
    # In fp64 as Python would divide, then fp32: the same scale, bit for bit, as a Python float's.
    scale = ((world_size * len(batches)) / total.clamp(min=1).double()).float()
    if hasattr(engine.module, "transformers_names"):  # pipeline stages: DeepSpeed runs the micro-batches
        from elastictrain.model.pipeline import train_pipeline_batch

        # The stage's own forward passes, timed around its layers (not the activations it waits for).
        def began(*_: Any) -> None:  # a hook returning anything would replace the stage's input
            clock.__enter__()

        def ended(*_: Any) -> None:
            clock.__exit__()

        timed = [
            engine.module.register_forward_pre_hook(began, prepend=True),
            engine.module.register_forward_hook(ended),
        ]
        try:
            # Its schedule makes the update inside train_batch: a copy of the last state runs beside the
            # forward and backward passes and must end before the optimizer changes the state.
            with _called_before_the_update(engine, before_update):
                summed = train_pipeline_batch(engine, list(batches), scale)
        finally:
            for handle in timed:
                handle.remove()
        on_micro()
        summed_total, counted = torch.stack([summed, local.to(summed.device).double()]).tolist()
        return StepLoss(summed_total / max(counted, 1), summed_total, int(counted), forward_s=clock.seconds())
    loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
    for i, (batch, seed) in enumerate(batches):
        torch.manual_seed(seed)
        with clock:
            summed = causal_lm_token_loss_sum(engine, batch)
        engine.backward(summed * scale.to(summed.device))
        step(i)
        loss_sum = loss_sum + summed.detach().double()
    summed_total, counted = torch.stack([loss_sum, local.to(loss_sum.device).double()]).tolist()
    return StepLoss(summed_total / max(counted, 1), summed_total, int(counted), forward_s=clock.seconds())


class _called_before_the_update:
    """Calls `before_update` once, as the torch optimizer inside the engine's (ZeRO's, bf16's or a plain
    one) starts its update, or on leaving where no update was made (a skipped step; after an error the
    step is lost and the copy ends by itself)."""

    def __init__(self, engine: Any, before_update: Callable[[], None]) -> None:
        optimizer = engine.optimizer
        while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer  # DeepSpeed's wrappers hold the torch optimizer they step
        self.optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self.before_update = before_update
        self.called = False

    def _once(self, *_: Any) -> None:
        if not self.called:
            self.called = True
            self.before_update()

    def __enter__(self) -> None:
        if self.optimizer is None:
            self._once()  # no hook to wait at: the copy ends before the step starts
            return
        self.hook = self.optimizer.register_step_pre_hook(self._once)

    def __exit__(self, failed: type[BaseException] | None, *_: Any) -> None:
        if self.optimizer is not None:
            self.hook.remove()
        if failed is None:
            self._once()
