"""A rank's share of a validation: the same micro-batch cut as a training step, no gradients.

Every rank runs the same number of forward passes (ZeRO-3 gathers parameters collectively) and reports
summed token losses and target tokens; the controller adds them up (core/losses.py), so the result does
not depend on the world size or the micro-batch size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from elastictrain.core.data_order import eval_positions
from elastictrain.data.eval_data import source_ids
from elastictrain.data.sources import collate_items, to_device
from elastictrain.model.build import causal_lm_loss
from elastictrain.model.loss import causal_lm_loss_sum
from elastictrain.model.objective import PreferenceObjective
from elastictrain.worker.attempt import AttemptSpec


def evaluate_share(
    engine: Any,
    dataset: Any,
    collate: Callable[[list[Any]], Any] | None,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    spec: AttemptSpec,
) -> dict[str, Any]:
    """`eval.steps` global batches of the validation set, this rank's micro-batches of each."""
    t0 = time.perf_counter()
    plan, rank, batches = spec.plan, spec.rank, spec.config.eval.steps
    if dataset is None:
        raise ValueError("evaluate: this run has no validation set (set eval.split or eval.data)")
    n = len(dataset)
    if n == 0:
        raise ValueError(
            "evaluate: the validation set is empty; raise eval.split or give eval.data more data"
        )
    if isinstance(loss_fn, PreferenceObjective):
        return _evaluate_preference(engine, dataset, collate, loss_fn, spec, t0)
    module = engine.module
    was_training = module.training
    module.eval()
    builtin = loss_fn is causal_lm_loss
    loss_sum, tokens, read = 0.0, 0, []
    try:
        with torch.no_grad():
            for b in range(batches):
                for micro in range(plan.grad_accum_steps):
                    indices = eval_positions(b, plan, rank, micro, n)
                    read.extend(indices)
                    batch = to_device(collate_items([dataset[i] for i in indices], collate), engine.device)
                    if builtin:
                        summed, count = causal_lm_loss_sum(engine, batch)
                        loss_sum += float(summed.item())
                        tokens += count
                    else:  # a loss of your own: its mean, weighed by the micro-batch's samples
                        loss_sum += float(loss_fn(engine, batch).float().item()) * len(indices)
    finally:
        module.train(was_training)
    return {
        "rank": rank,
        "tensor_parallel": plan.tensor_parallel,
        "loss_sum": loss_sum,
        "target_tokens": tokens if builtin else None,
        "samples": len(read),
        "sample_ids": source_ids(dataset, read),
        "eval_s": time.perf_counter() - t0,
    }


def _evaluate_preference(
    engine: Any,
    dataset: Any,
    collate: Callable[[list[Any]], Any] | None,
    objective: PreferenceObjective,
    spec: AttemptSpec,
    t0: float,
) -> dict[str, Any]:
    """The preference loss and figures of `eval.steps` global batches, each computed as a step's."""
    from elastictrain.worker.preference_steps import run_preference_batches

    plan, rank, n = spec.plan, spec.rank, len(dataset)
    loss_sum, items, read = 0.0, 0, []
    figures: dict[str, list[float]] = {}
    module = engine.module
    was_training = module.training
    module.eval()
    try:
        for b in range(spec.config.eval.steps):
            batches = []
            for micro in range(plan.grad_accum_steps):
                indices = eval_positions(b, plan, rank, micro, n)
                read.extend(indices)
                batch = to_device(collate_items([dataset[i] for i in indices], collate), engine.device)
                batches.append((batch, 0))
            # Per global batch, as a step: KTO's KL estimate is that batch's.
            out = run_preference_batches(engine, objective, batches, world_size=spec.world_size, train=False)
            loss_sum += out["loss_sum"]
            items += out["items"]
            for name, (s, c) in out["preference"].items():
                acc = figures.setdefault(name, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + s, acc[1] + c
    finally:
        module.train(was_training)
    return {
        "rank": rank,
        "tensor_parallel": plan.tensor_parallel,
        "loss_sum": loss_sum,
        "items": items,
        "preference": figures,
        "samples": len(read),
        "sample_ids": source_ids(dataset, read),
        "eval_s": time.perf_counter() - t0,
    }
