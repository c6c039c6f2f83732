"""One step's (or one validation batch's) micro-batches under a preference objective on one rank.

The step's loss is the mean of the per-item losses over the global batch's items: each micro-batch
backs up the *sum* of its items' losses times world_size x accumulation / (items of the global batch),
undoing DeepSpeed's division by both, as the causal LM loss does with target tokens (model/loss.py).

KTO's KL estimate is the policy's mean log-ratio over the global batch's mismatched rows: a forward
without gradients of every micro-batch's second rows and one all-reduce come first, so every rank at any
world size uses the same estimate (TRL's is gathered over processes as well, per batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from elastictrain.model.loss import global_count
from elastictrain.model.objective import PreferenceObjective


def kto_estimate(
    engine: Any, objective: PreferenceObjective, batches: Sequence[Any], items: torch.Tensor
) -> Any:
    """KTO's KL estimate over the global batch (`items`: its item count), the same on every rank."""
    local = torch.zeros((), dtype=torch.float64, device=engine.device)
    for batch in batches:
        local = local + objective.kl_sum(engine, batch)
    # Every rank of a tensor-parallel replica adds the same sums, as `items` counts them: the ratio holds.
    return global_count(local) / items.clamp(min=1).double()


def run_preference_batches(
    engine: Any,
    objective: PreferenceObjective,
    batches: Sequence[tuple[Any, int]],
    *,
    world_size: int,
    step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Forward each (batch, seed); with `step` (training: DeepSpeed's step after micro-batch i, as
    worker/micro_steps.py orders it), backward it and call step(i). This rank's sums.

    Returns loss_sum, items and `preference`: {figure: [sum, count]} over this rank's items."""
    counts = [torch.tensor(b["input_ids"].shape[0] // 2, device=engine.device) for b, _ in batches]
    local = torch.stack(counts).sum()
    total = global_count(local)
    kl = None
    if objective.name == "kto":
        kl = kto_estimate(engine, objective, [b for b, _ in batches], total)
    scale = ((world_size * len(batches)) / total.clamp(min=1).double()).float()
    loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
    sums: dict[str, list[torch.Tensor]] = {}
    for i, (batch, seed) in enumerate(batches):
        torch.manual_seed(seed)  # any randomness follows the data position, not the rank
        if step is not None:
            terms = objective.terms(engine, batch, kl)
            summed = terms.losses.sum()
            engine.backward(summed * scale.to(summed.device))
            step(i)
        else:
            with torch.no_grad():
                terms = objective.terms(engine, batch, kl)
                summed = terms.losses.sum()
        loss_sum = loss_sum + summed.detach().double()
        for name, (s, n) in terms.stats.items():
            acc = sums.setdefault(name, [torch.zeros((), dtype=torch.float64, device=engine.device)] * 2)
            sums[name] = [acc[0] + s.double(), acc[1] + n.double()]
    names = sorted(sums)
    flat = torch.stack([loss_sum, local.double()] + [x for k in names for x in sums[k]]).tolist()
    figures = {k: [flat[2 + 2 * j], flat[3 + 2 * j]] for j, k in enumerate(names)}
    return {"loss_sum": flat[0], "items": int(flat[1]), "preference": figures}
