"""A rank's share of a validation: the same micro-batch cut as a training step, no gradients.

Every rank runs the same number of forward passes (ZeRO-3 gathers parameters collectively) and reports
summed token losses and target tokens; the controller adds them up (core/losses.py), so the result does
not depend on the world size or the micro-batch size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from elastictrain.core.data_order import eval_positions
from elastictrain.core.losses import add_figures
from elastictrain.data.eval_data import source_ids
from elastictrain.data.sources import collate_items, to_device
from elastictrain.model.build import causal_lm_loss
from elastictrain.model.loss import causal_lm_loss_sum, target_tokens
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
    if dataset is None:
        raise ValueError("evaluate: this run has no validation set (set eval.split or eval.data)")
    if len(dataset) == 0:
        raise ValueError(
            "evaluate: the validation set is empty; raise eval.split or give eval.data more data"
        )
    module = engine.module
    was_training = module.training
    module.eval()
    read: list[int] = []
    try:
        batches = _eval_batches(engine, dataset, collate, spec, read)
        if isinstance(loss_fn, PreferenceObjective):
            share = _preference_share(engine, loss_fn, batches, spec.world_size)
        else:
            share = _loss_share(engine, loss_fn, batches)
    finally:
        module.train(was_training)
    return {
        "rank": spec.rank,
        "replica_ranks": spec.plan.replica_ranks,
        **share,
        "samples": len(read),
        "sample_ids": source_ids(dataset, read),
        "eval_s": time.perf_counter() - t0,
    }


def _eval_batches(
    engine: Any, dataset: Any, collate: Callable[[list[Any]], Any] | None, spec: AttemptSpec, read: list[int]
) -> Iterator[list[tuple[list[int], Any]]]:
    """Each global batch: this rank's micro-batches as (indices, batch on the device); `read` gets the
    indices as they are read."""
    plan, n = spec.plan, len(dataset)
    for b in range(spec.config.eval.steps):
        micro_batches = []
        for micro in range(plan.grad_accum_steps):
            indices = eval_positions(b, plan, spec.rank, micro, n)
            read.extend(indices)
            batch = to_device(collate_items([dataset[i] for i in indices], collate), engine.device)
            micro_batches.append((indices, batch))
        yield micro_batches


def _loss_share(
    engine: Any, loss_fn: Callable[[Any, Any], torch.Tensor], batches: Iterator[list[tuple[list[int], Any]]]
) -> dict[str, Any]:
    """Summed token losses and target tokens (the built-in loss), else each micro-batch's mean weighed by
    its samples (a loss of your own)."""
    builtin = loss_fn is causal_lm_loss
    loss_sum, tokens = 0.0, 0
    if hasattr(engine.module, "transformers_names"):  # pipeline stages: DeepSpeed runs the micro-batches
        from elastictrain.model.pipeline import eval_pipeline_batch

        for micro_batches in batches:
            loss_sum += float(eval_pipeline_batch(engine, [batch for _, batch in micro_batches]).item())
            tokens += sum(target_tokens(batch) for _, batch in micro_batches)
        return {"loss_sum": loss_sum, "target_tokens": tokens}
    with torch.no_grad():
        for micro_batches in batches:
            for indices, batch in micro_batches:
                if builtin:
                    summed, count = causal_lm_loss_sum(engine, batch)
                    loss_sum += float(summed.item())
                    tokens += count
                else:
                    loss_sum += float(loss_fn(engine, batch).float().item()) * len(indices)
    return {"loss_sum": loss_sum, "target_tokens": tokens if builtin else None}


def _preference_share(
    engine: Any,
    objective: PreferenceObjective,
    batches: Iterator[list[tuple[list[int], Any]]],
    world_size: int,
) -> dict[str, Any]:
    """The preference loss and figures, each global batch computed as a step's (KTO: its own KL estimate)."""
    from elastictrain.worker.preference_steps import run_preference_batches

    outs = []
    for micro_batches in batches:
        seeded = [(batch, 0) for _, batch in micro_batches]
        outs.append(run_preference_batches(engine, objective, seeded, world_size=world_size))
    return {
        "loss_sum": sum(out["loss_sum"] for out in outs),
        "items": sum(out["items"] for out in outs),
        "preference": add_figures(out["preference"] for out in outs),
    }
